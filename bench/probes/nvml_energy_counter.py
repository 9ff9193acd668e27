"""How often NVML's total-energy counter advances on this GPU, under load and idle.

``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the driver loaded) is what
kareus's NVML profiler and ``kareus verify`` difference over a measurement window. A window
shorter than the counter's update period can see no change at all. This probe reads the
counter in a tight host loop for ``--seconds`` while the GPU runs back-to-back matmuls, and
again idle, and reports the intervals between the reads at which the value changed.

Usage (one CUDA GPU; reads only)::

    python bench/probes/nvml_energy_counter.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _watch(handle, seconds: float, pynvml, work=None) -> dict:
    changes, last_v, last_t = [], None, None
    end = time.perf_counter() + seconds
    reads = 0
    while time.perf_counter() < end:
        if work is not None:
            work()
        v = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        t = time.perf_counter()
        reads += 1
        if last_v is not None and v != last_v:
            changes.append((t - last_t, v - last_v))
            last_t = t
        if last_v is None:
            last_t = t
        last_v = v
    gaps = [c[0] for c in changes[1:]]  # the first change's interval is from the start
    return {"reads": reads, "changes": len(changes),
            "interval_ms_median": statistics.median(gaps) * 1e3 if gaps else None,
            "interval_ms_min": min(gaps) * 1e3 if gaps else None,
            "interval_ms_max": max(gaps) * 1e3 if gaps else None,
            "mj_per_change_median": statistics.median(c[1] for c in changes) if changes else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def work() -> None:  # keeps a few matmuls queued ahead of the host
        for _ in range(2):
            a @ a

    busy = _watch(h, args.seconds, pynvml, work)
    torch.cuda.synchronize()
    time.sleep(0.5)
    idle = _watch(h, args.seconds, pynvml)
    out = {"gpu": torch.cuda.get_device_name(), "driver": pynvml.nvmlSystemGetDriverVersion(),
           "busy": busy, "idle": idle}
    for k in ("busy", "idle"):
        r = out[k]
        print(f"{k:>5}: {r['changes']} changes in {args.seconds} s ({r['reads']} reads), "
              f"interval median {r['interval_ms_median']} ms, min {r['interval_ms_min']}, "
              f"max {r['interval_ms_max']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
