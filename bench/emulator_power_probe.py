"""Measure what the emulator's power model needs on one real GPU, without touching clocks.

The GPU runs at its default clocks (nothing is locked or changed). For each load, run
back to back for a few seconds, it records the mean board power (NVML total-energy
counter over the window), the median SM clock (NVML, sampled every 20 ms), the
temperature and the kernel throughput:

* ``idle``: nothing running;
* ``spin``: one spinning thread block (``torch.cuda._sleep``): the GPU busy, SMs idle;
* ``gemm_d<duty>``: bursts of 4 chained bf16 GEMMs 8192x4096 @ 4096x4096 followed by a
  spin gap, so the GEMMs fill ``duty`` of the time. Under an average-power limiter the
  clock rises as the duty falls, so the series traces the GEMM's power against clock;
* ``copy``: device-to-device copy of 2 GiB (bytes read + written counted);
* ``elementwise``: in-place multiply over a 96M-element bf16 tensor (as in the overlap probe).

Usage (on the GPU machine)::

    python bench/emulator_power_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()

    import pynvml
    import torch

    from kareus.profilers.nvml import nvml_device_index

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(nvml_device_index())  # by UUID
    dev = torch.device("cuda")
    samples: list[tuple[float, float, int, int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            with contextlib.suppress(pynvml.NVMLError):
                samples.append((time.perf_counter(), pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                                pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                                pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)))
            time.sleep(0.02)

    th = threading.Thread(target=poll, daemon=True)
    th.start()

    def energy_mj() -> int:
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(h)

    def window(step, seconds: float, warm: float = 1.0) -> dict[str, float]:
        """Run step() back to back: warm-up, then a timed window; returns stats."""
        t_end = time.perf_counter() + warm
        while time.perf_counter() < t_end:
            step()
        torch.cuda.synchronize()
        n = 0
        e0 = energy_mj()
        t0 = time.perf_counter()
        s0 = len(samples)
        while time.perf_counter() - t0 < seconds:
            for _ in range(20):
                step()
            n += 20
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        e1 = energy_mj()
        win = samples[s0:]
        return {"steps": n, "s": t1 - t0, "ms_per_step": (t1 - t0) / n * 1e3,
                "avg_w": (e1 - e0) / 1e3 / (t1 - t0),
                "nvml_power_median_w": statistics.median(x[1] for x in win) if win else -1,
                "sm_clock_median_mhz": statistics.median(x[2] for x in win) if win else -1,
                "sm_clock_min_mhz": min(x[2] for x in win) if win else -1,
                "sm_clock_max_mhz": max(x[2] for x in win) if win else -1,
                "temp_c_median": statistics.median(x[3] for x in win) if win else -1}

    out: dict[str, object] = {"gpu": torch.cuda.get_device_name(),
                              "driver": pynvml.nvmlSystemGetDriverVersion(),
                              "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3,
                              "torch": torch.__version__, "loads": {}}
    loads: dict[str, dict[str, float]] = out["loads"]  # type: ignore[assignment]

    time.sleep(1.0)
    s0 = len(samples)
    e0, t0 = energy_mj(), time.perf_counter()
    time.sleep(args.seconds)
    win = samples[s0:]
    loads["idle"] = {"avg_w": (energy_mj() - e0) / 1e3 / (time.perf_counter() - t0),
                     "sm_clock_median_mhz": statistics.median(x[2] for x in win)}
    print("idle", loads["idle"], flush=True)

    # Spin: calibrate cycles per ms first.
    torch.cuda._sleep(1000)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def spin_ms(cycles: int) -> float:
        ev0.record()
        torch.cuda._sleep(cycles)
        ev1.record()
        torch.cuda.synchronize()
        return ev0.elapsed_time(ev1)

    for _ in range(50):
        spin_ms(2_000_000)
    cyc_per_ms = 2_000_000 / statistics.median(spin_ms(2_000_000) for _ in range(20))
    loads["spin"] = window(lambda: torch.cuda._sleep(int(cyc_per_ms)), args.seconds)
    loads["spin"]["cycles_per_ms"] = cyc_per_ms
    print("spin", loads["spin"], flush=True)

    M, K, N = 8192, 4096, 4096
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) / 64 for _ in range(4)]
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    flops4 = 4 * 2.0 * M * K * N

    def gemms() -> None:
        x = a
        for wi in w:
            torch.matmul(x, wi, out=c)
            x = c

    # GEMM-only first (duty 1), then duty cycles with spin gaps sized from the GEMM time.
    r = window(gemms, args.seconds)
    r["tflops"] = flops4 / (r["ms_per_step"] * 1e-3) / 1e12
    loads["gemm_d1.0"] = r
    print("gemm_d1.0", r, flush=True)
    gemm_ms = r["ms_per_step"]
    for duty in (0.8, 0.6, 0.45, 0.3):
        gap_ms = gemm_ms * (1 - duty) / duty
        cycles = int(gap_ms * cyc_per_ms)

        def step(cycles: int = cycles) -> None:
            gemms()
            torch.cuda._sleep(cycles)

        r = window(step, args.seconds)
        # Measure the GEMM part of a step at the clock this load settles at.
        ev0.record()
        for _ in range(10):
            gemms()
        ev1.record()
        torch.cuda.synchronize()
        g = ev0.elapsed_time(ev1) / 10
        r["gemm_ms_in_this_load"] = g
        r["duty_measured"] = g / r["ms_per_step"]
        r["tflops_of_gemm_part"] = flops4 / (g * 1e-3) / 1e12
        loads[f"gemm_d{duty}"] = r
        print(f"gemm_d{duty}", r, flush=True)

    src = torch.empty(2**30, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    r = window(lambda: dst.copy_(src), args.seconds)
    r["tb_per_s"] = 2 * src.numel() * 2 / (r["ms_per_step"] * 1e-3) / 1e12
    loads["copy"] = r
    print("copy", r, flush=True)
    big = torch.randn(96 * 2**20, device=dev, dtype=torch.bfloat16)
    r = window(lambda: big.mul_(1.0001), args.seconds)
    r["tb_per_s"] = 2 * big.numel() * 2 / (r["ms_per_step"] * 1e-3) / 1e12
    loads["elementwise"] = r
    print("elementwise", r, flush=True)
    stop.set()
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
