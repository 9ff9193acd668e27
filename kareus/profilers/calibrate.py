"""Measuring a GPU profile on a real GPU: what the emulated GPU needs, for ``kareus calibrate``.

On one GPU, at the clocks the GPU runs at (nothing is locked or changed), this module
measures:

* per op of the runnable partitions (``kareus.exec.torch_partition``) of the chosen
  workloads and kernel sets: the median time over repeated runs (CUDA events, the L2
  cache flushed by *reading* a buffer before each run, so that every op reads HBM as its
  roofline assumes), its roofline, and the average power over a loop of the op alone
  (NVML's total-energy counter over at least ``power_s`` seconds, replayed from a CUDA
  graph where the op captures, launched eagerly where it does not: the op's
  ``power_execution``) with the fraction of the window its timed speed explains
  (below 1 when the loop ran slower: the power limit lowered the clock) and the median
  SM clock sampled during the loop; and the host time of one eager call of the op (wall
  time around the call while the GPU is kept busy by ``torch.cuda._sleep``, so that the
  launch never waits on the GPU; median of at least 30 calls), which decides whether eager
  execution keeps the GPU fed (the emulator's ``execution="eager"``);
* the GEMM peak (best median bf16 ``torch.matmul`` at 8192^3 and 16384^3) and the HBM
  bandwidth (a 1 GiB device copy, bytes read plus written);
* idle power at the idle clock, and the power of one spinning block (what a GPU waiting
  on a collective draws: its kernel spins; on one GPU no receive can block, so this is the
  static power of a one-GPU profile) with the clocks observed.

Collective curves need several GPUs (``bench/collectives.py`` under torchrun); a one-GPU
profile copies them, with their sources, from a profile measured before on the same GPU
model (by default the one shipped with kareus).

The measurement goes through ``CalibrationDevice``; ``TorchCalibrationDevice`` is
the CUDA one, and tests drive ``measure_profile`` with a fake device on a CPU. torch
and pynvml are imported inside the functions that need them.
"""

from __future__ import annotations

import abc
import datetime
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kareus.errors import HardwareError
from kareus.model.gpu_profile import (
    CollectivePoint,
    GPUProfile,
    GPUProfileError,
    LoadPower,
    MachineInfo,
    OpProfile,
)
from kareus.model.ops import ComputeOp, OpKind
from kareus.profilers.emulator import profile_workload, profile_workload_key

__all__ = [
    "CalibrationDevice",
    "MeasuredOp",
    "OpProgram",
    "TorchCalibrationDevice",
    "gpu_preset_of",
    "measure_profile",
]

#: Names of the GPU presets by the driver's GPU name (the first that is a substring).
_GPU_NAMES = (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-40gb"))


def gpu_preset_of(device_name: str) -> str | None:
    """The kareus GPU preset of a device name as the driver reports it, if known."""
    for key, preset in _GPU_NAMES:
        if key in device_name:
            return preset
    return None


@attrs.frozen(kw_only=True)
class OpProgram:
    """One op of a runnable partition, ready to be measured.

    Attributes:
        partition: Partition type name.
        op: The op's model (name, kind, FLOPs, bytes).
        run: Runs the op once on the device (asynchronously).
        kernel: The kernel or implementation that runs.
    """

    partition: str
    op: ComputeOp
    run: Callable[[], Any]
    kernel: str


@attrs.frozen(kw_only=True)
class MeasuredOp:
    """What ``CalibrationDevice.power`` returns for one op.

    Attributes:
        power_w: Average power of one GPU over the loop (``None``: no power meter).
        busy_fraction: The loop's time explained by the op's timed median (<= 1).
        freq_mhz: Median SM clock sampled during the loop (``None``: not read).
        graphed: Whether the loop replayed a CUDA graph of the op (``False``: it launched
            each run eagerly; ``None``: no loop ran).
    """

    power_w: float | None
    busy_fraction: float | None
    freq_mhz: int | None
    graphed: bool | None = None


class CalibrationDevice(abc.ABC):
    """The GPU side of a calibration: timing, power and the partitions' ops."""

    @abc.abstractmethod
    def machine(self) -> MachineInfo:
        """Machine, driver and software versions."""

    @abc.abstractmethod
    def ceilings(self) -> tuple[float, float]:
        """``(GEMM peak TFLOP/s, HBM bandwidth GB/s)`` measured on the device."""

    @abc.abstractmethod
    def idle_power(self) -> tuple[float, int | None]:
        """``(W, SM clock MHz or None)`` with nothing running."""

    @abc.abstractmethod
    def waiting_power(self) -> tuple[float, int | None]:
        """``(W, SM clock MHz or None)`` while one block spins (a GPU waiting on a
        collective)."""

    @abc.abstractmethod
    def programs(self, workload: Any, kernels: str) -> Iterator[list[OpProgram]]:
        """The ops of each runnable partition of ``workload`` with kernel set ``kernels``,
        one list per partition (the device may free a partition's buffers after it)."""

    @abc.abstractmethod
    def time_s(self, run: Callable[[], Any]) -> float:
        """Median time of one run, seconds."""

    @abc.abstractmethod
    def power(self, run: Callable[[], Any], time_s: float, *, graph: bool) -> MeasuredOp:
        """Average power over a loop of ``run`` alone (``time_s``: its timed median)."""

    #: How :meth:`host_s` measures (recorded as the profile's ``host_method``).
    host_method: str = ""

    def host_s(self, run: Callable[[], Any]) -> float | None:
        """Host seconds of one eager call of ``run`` with the GPU kept busy (a median), or
        ``None``: this device does not measure host cost (the default)."""
        return None


def measure_profile(device: CalibrationDevice, *, gpu: str,
                    workloads: Sequence[Any], kernel_sets: Sequence[str],
                    collectives_from: GPUProfile | None = None,
                    log: Callable[[str], None] | None = None) -> GPUProfile:
    """Measure a ``GPUProfile`` on ``device``.

    Args:
        device: The device to measure.
        gpu: The GPU preset the profile refines (``"h200-sxm"``).
        workloads: [`Workload`][kareus.model.Workload] objects whose runnable
            partitions' ops to measure.
        kernel_sets: Kernel sets, the first the main one (time and power of every op);
            the others re-measure their elementwise and attention ops (time only).
        collectives_from: A profile of the same GPU model whose collective points (and
            static-power readings of GPUs blocked in a receive) the new one copies; the
            note says so. ``None``: no collective points.
        log: Called with one line of progress per stage.

    Raises:
        GPUProfileError: ``collectives_from`` is a profile of another GPU, or no kernel set.
    """
    say = log or (lambda _line: None)
    if not kernel_sets:
        raise GPUProfileError("calibration needs at least one kernel set")
    if collectives_from is not None and collectives_from.gpu != gpu:
        raise GPUProfileError(f"collectives from a profile of {collectives_from.gpu} cannot "
                              f"serve a profile of {gpu}: measure them on this GPU model")
    t0 = time.perf_counter()
    idle_w, idle_f = device.idle_power()  # first: before any load raises the clock
    peak_tflops, hbm_gbps = device.ceilings()
    say(f"ceilings: {peak_tflops:.0f} TFLOP/s bf16 GEMM, {hbm_gbps / 1e3:.2f} TB/s HBM")
    wait_w, wait_f = device.waiting_power()
    say(f"idle {idle_w:.1f} W at {idle_f} MHz; one spinning block {wait_w:.1f} W at {wait_f} MHz")
    ops: list[OpProfile] = []
    main = kernel_sets[0]
    for wl in workloads:
        key = profile_workload_key(wl.model.name, tp=wl.parallelism.tp, cp=wl.parallelism.cp,
                                   microbatch_size=wl.microbatch_size, seq_len=wl.seq_len,
                                   nanobatches=wl.nanobatches)
        profile_workload(key)  # the name must read back
        for ks in kernel_sets:
            # Every op of the workload is timed before any power loop runs: a loop holds
            # the GPU at its power limit for a second or more, and an op timed right after
            # one runs at a lower clock, where the times are taken as the GPU's clock of
            # short bursts (the emulator scales them from its maximum clock).
            times: dict[tuple[str, str], float] = {}
            hosts: dict[tuple[str, str], float | None] = {}
            for progs in device.programs(wl, ks):
                for p in progs:
                    kind = _kind(p.op)
                    if (ks != main and kind == "gemm") or (p.partition, p.op.name) in times:
                        continue  # kernel sets differ in elementwise ops and attention only
                    times[(p.partition, p.op.name)] = device.time_s(p.run)
                    # The host's time per launch: CPU-side, the GPU only kept busy (no
                    # power load), so it sits with the timings.
                    hosts[(p.partition, p.op.name)] = device.host_s(p.run)
            done: set[tuple[str, str]] = set()
            for progs in device.programs(wl, ks):
                for p in progs:
                    kind = _kind(p.op)
                    if (p.partition, p.op.name) not in times or (p.partition, p.op.name) in done:
                        continue
                    done.add((p.partition, p.op.name))
                    t = times[(p.partition, p.op.name)]
                    m = (device.power(p.run, t, graph=kind != "attention") if ks == main
                         else MeasuredOp(power_w=None, busy_fraction=None, freq_mhz=None))
                    roof = max(p.op.flops / (peak_tflops * 1e12),
                               p.op.bytes_moved / (hbm_gbps * 1e9))
                    ops.append(OpProfile(
                        workload=key, partition=p.partition, op=p.op.name, kind=kind,
                        time_s=t, power_w=m.power_w, freq_mhz=m.freq_mhz,
                        roofline_s=roof if roof > 0 else None, kernel=p.kernel, kernels=ks,
                        power_busy_fraction=(None if m.busy_fraction is None
                                             else min(1.0, float(m.busy_fraction))),
                        power_execution=(None if m.graphed is None or m.power_w is None
                                         else "graphed" if m.graphed else "eager"),
                        host_s=hosts.get((p.partition, p.op.name))))
            say(f"{key} / {ks}: {sum(1 for o in ops if o.workload == key and o.kernels == ks)} "
                f"ops ({time.perf_counter() - t0:.0f} s)")
    loads = [LoadPower(load="idle", power_w=idle_w, freq_mhz=idle_f, source="kareus calibrate"),
             LoadPower(load="one spinning block", power_w=wait_w, freq_mhz=wait_f,
                       source="kareus calibrate")]
    collectives: tuple[CollectivePoint, ...] = ()
    notes = ["static_power_w: one spinning block on this GPU (a GPU waiting on a collective "
             "spins its kernel; on one GPU no receive can block)",
             "ops: time = median of timed runs after an L2 flush (each run launched eagerly "
             "and timed on the device); power = NVML energy over a loop of the op alone "
             "(power_execution: replayed from a CUDA graph, or eager where the op does not "
             "capture); freq_mhz = median SM clock sampled in that loop",
             f"ops: kernel set {main} measured with power; "
             f"{', '.join(kernel_sets[1:]) or 'no other set'} time only"]
    measured_host = any(o.host_s is not None for o in ops)
    if measured_host:
        notes.append(f"ops: host_s = {device.host_method}")
    sources = ["kareus calibrate"]
    if collectives_from is not None:
        collectives = collectives_from.collectives
        loads += [lp for lp in collectives_from.load_powers
                  if lp.load.startswith("blocked in a receive")]
        sources += [s for s in collectives_from.sources if "collectives" in s]
        notes.append(f"collectives: copied from the {collectives_from.gpu} profile digest "
                     f"{collectives_from.digest[:12]} (measured on several GPUs; this run had "
                     "one)")
    return GPUProfile(
        gpu=gpu, sm_count=_sm_count(gpu), machine=device.machine(), kernel_set=main,
        gemm_peak_tflops=peak_tflops, gemm_peak_freq_mhz=None, hbm_bandwidth_gbps=hbm_gbps,
        idle_power_w=idle_w, idle_freq_mhz=idle_f, static_power_w=max(wait_w, idle_w),
        load_powers=tuple(loads), ops=tuple(ops), collectives=collectives,
        sources=tuple(sources), notes=tuple(notes),
        host_method=device.host_method if measured_host else "")


def _kind(op: Any) -> str:
    return ("gemm" if op.kind is OpKind.GEMM else
            "attention" if op.kind is OpKind.ATTENTION else "elementwise")


def _sm_count(gpu: str) -> int:
    from kareus.model.gpu import get_gpu

    return get_gpu(gpu).sm_count


# ----------------------------------------------------------------------------- CUDA


class TorchCalibrationDevice(CalibrationDevice):
    """The current CUDA device through PyTorch and NVML (clocks are only read).

    Args:
        reps: Timed runs per op (median).
        power_s: Seconds of each op's power loop (0: no power).

    Raises:
        HardwareError: no CUDA device.
    """

    def __init__(self, *, reps: int = 30, power_s: float = 1.0) -> None:
        try:
            import torch
        except ImportError:
            raise HardwareError("kareus calibrate needs PyTorch with CUDA and a GPU; torch "
                                "is not installed here") from None
        if not torch.cuda.is_available():
            raise HardwareError("kareus calibrate needs a CUDA GPU; none is visible")
        torch.backends.cuda.matmul.allow_tf32 = False
        self.torch = torch
        self.reps = int(reps)
        self.power_s = float(power_s)
        # Flushing by reading (not writing) leaves the L2 cache full of clean lines: a
        # written flush buffer would be written back to HBM during the timed op.
        self.flush = torch.randn(128 * 2**20, device="cuda", dtype=torch.bfloat16)
        self.nvml: Any = None
        self.handle: Any = None
        try:
            import pynvml

            from kareus.profilers.nvml import nvml_device_index

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_device_index())
            self.nvml = pynvml
        except Exception:  # power is optional; the profile says None
            self.nvml = None

    # ------------------------------------------------------------------ readings
    def _energy_j(self) -> float:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3

    def _clock(self) -> int | None:
        if self.nvml is None:
            return None
        return int(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))

    def machine(self) -> MachineInfo:
        torch = self.torch
        driver = ""
        if self.nvml is not None:
            d = self.nvml.nvmlSystemGetDriverVersion()
            driver = d.decode() if isinstance(d, bytes) else str(d)
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = ""
        return MachineInfo(gpu_name=torch.cuda.get_device_name(), driver=driver,
                           torch=str(torch.__version__), cuda=str(torch.version.cuda or ""),
                           nccl=nccl)

    def time_s(self, run: Callable[[], Any], *, flush: bool = True,
               reps: int | None = None) -> float:
        torch = self.torch
        n = reps or self.reps
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        torch.cuda._sleep(40_000_000)  # lets the host queue the runs ahead of the GPU
        for i in range(n):
            if flush:
                self.flush.amax()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e-3

    host_method = ("host time per eager call (time.perf_counter around the call) with the "
                   "GPU kept busy by torch.cuda._sleep so that the launch never waits on "
                   "it; median of at least 30 calls after one warm-up call")

    #: GPU cycles of the spin that keeps the GPU busy while :meth:`host_s` times the calls
    #: (about 50 ms at 2 GHz; longer at a lower clock), and how often it is lengthened
    #: (4x each time) when the calls outlast it.
    _HOST_SPIN_CYCLES = 100_000_000
    _HOST_SPIN_RETRIES = 2

    def host_s(self, run: Callable[[], Any]) -> float | None:
        """Host seconds of one eager call of ``run``: the median of at least 30 calls
        timed on the host while a spinning kernel keeps the GPU busy; ``None`` when the
        calls outlast even the longest spin (a call that waits on the GPU, e.g. a
        synchronisation, has no launch cost to measure)."""
        torch = self.torch
        n = max(30, self.reps)
        run()  # warm-up: allocator, autotuning, compilation
        torch.cuda.synchronize()
        cycles = self._HOST_SPIN_CYCLES
        for _ in range(self._HOST_SPIN_RETRIES + 1):
            torch.cuda._sleep(cycles)
            spun = torch.cuda.Event()
            spun.record()
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            busy = not spun.query()  # still spinning: no call could wait on the GPU
            torch.cuda.synchronize()
            if busy:
                return statistics.median(times)
            cycles *= 4
        return None

    def ceilings(self) -> tuple[float, float]:
        torch = self.torch
        best = 0.0
        for n in (8192, 16384):
            x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            def gemm(a: Any = x, b: Any = y) -> Any:
                return torch.matmul(a, b)

            t = self.time_s(gemm, flush=False, reps=10)
            best = max(best, 2 * n**3 / t / 1e12)
        src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
        dst = torch.empty_like(src)
        t = self.time_s(lambda: dst.copy_(src), flush=False, reps=20)
        bw = 2 * src.numel() * 2 / t / 1e9
        x = y = src = dst = None
        torch.cuda.empty_cache()
        return best, bw

    def _window(self, seconds: float, busy: Callable[[], Any] | None) -> tuple[float, int | None]:
        """Average power and median clock over ``seconds`` (``busy`` keeps the GPU busy)."""
        if self.nvml is None:
            raise HardwareError("NVML is not available: kareus calibrate cannot read power")
        torch = self.torch
        torch.cuda.synchronize()
        clocks: list[int] = []
        e0, t0 = self._energy_j(), time.perf_counter()
        if busy is not None:
            busy()
        while time.perf_counter() - t0 < seconds:
            c = self._clock()
            if c is not None:
                clocks.append(c)
            time.sleep(0.05)
        torch.cuda.synchronize()
        e1, t1 = self._energy_j(), time.perf_counter()
        return (e1 - e0) / (t1 - t0), (int(statistics.median(clocks)) if clocks else None)

    def idle_power(self) -> tuple[float, int | None]:
        # The clock drops to the idle clock only seconds after the last kernel: wait (up
        # to 10 s) until it stops falling, then read.
        last, t0 = self._clock(), time.perf_counter()
        while time.perf_counter() - t0 < 10.0:
            time.sleep(0.5)
            now = self._clock()
            if now is None or last is None or now >= last:
                break
            last = now
        return self._window(2.0, None)

    def waiting_power(self) -> tuple[float, int | None]:
        torch = self.torch
        clock = self._clock() or 1980
        # One block spinning for ~2 s at the current clock (cycles, not seconds).
        return self._window(2.0, lambda: torch.cuda._sleep(int(2.2 * clock * 1e6)))

    def programs(self, workload: Any, kernels: str) -> Iterator[list[OpProgram]]:
        from kareus.exec.kernels import get_kernels
        from kareus.exec.torch_partition import runnable_partitions

        ks = get_kernels(kernels)
        names = ks.kernel_names()
        family = {"attn_norm": "rms_norm", "mlp_norm": "rms_norm",
                  "attn_norm_bwd": "rms_norm_bwd", "mlp_norm_bwd": "rms_norm_bwd",
                  "rope": "rope", "rope_bwd": "rope_bwd", "qk_norm_rope": "qk_norm_rope",
                  "qk_norm_rope_bwd": "qk_norm_rope_bwd", "swiglu": "swiglu",
                  "swiglu_bwd": "swiglu_bwd", "attn_core": "attention",
                  "attn_core_bwd": "attention"}
        for pname, part in runnable_partitions(workload, kernels=ks).items():
            prog = part.build(seed=0)
            out = []
            for op, fn in zip(part.compute_ops, prog.ops):
                fam = family.get(op.name, "matmul")
                kernel = names.get(fam, fam)
                if fam == "attention":
                    st = prog.state
                    kernel = f"sdpa {ks.attention_backend(st['q'], st['k'], st['v'])}"
                out.append(OpProgram(partition=pname, op=op, run=fn, kernel=str(kernel)))
            yield out
            del prog, out  # free this partition's tensors before the next is built
            self.torch.cuda.empty_cache()

    def power(self, run: Callable[[], Any], time_s: float, *, graph: bool) -> MeasuredOp:
        if self.nvml is None or self.power_s <= 0:
            return MeasuredOp(power_w=None, busy_fraction=None, freq_mhz=None)
        torch = self.torch
        per = 20
        runner: Callable[[], Any] | None = None
        if graph:
            try:
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run()
                torch.cuda.current_stream().wait_stream(s)
                torch.cuda.synchronize()
                with torch.cuda.graph(g):
                    for _ in range(per):
                        run()
                g.replay()
                torch.cuda.synchronize()
                runner = g.replay
            except Exception:  # some ops (autograd.grad) do not capture
                torch.cuda.synchronize()
                runner = None
        graphed = runner is not None
        if runner is None:
            def runner() -> None:
                for _ in range(per):
                    run()
        n = max(1, math.ceil(self.power_s / max(time_s * per, 1e-6)))
        runner()
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        clocks: list[int] = []
        e0, t0 = self._energy_j(), time.perf_counter()
        for _ in range(n):
            runner()
        done.record()
        while not done.query():
            c = self._clock()
            if c is not None:
                clocks.append(c)
            time.sleep(0.02)
        torch.cuda.synchronize()
        e1, t1 = self._energy_j(), time.perf_counter()
        wall = t1 - t0
        return MeasuredOp(power_w=(e1 - e0) / wall,
                          busy_fraction=min(1.0, n * per * time_s / wall),
                          freq_mhz=int(statistics.median(clocks)) if clocks else None,
                          graphed=graphed)


def utc_now() -> str:
    """The current time, ISO 8601 UTC (for the profile's notes)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def calibrate_to_file(out: Any, *, workloads: Sequence[str], kernels: Sequence[str],
                      gpu: str | None = None, collectives_from: str | None = "shipped",
                      reps: int = 30, power_s: float = 1.0,
                      device: CalibrationDevice | None = None,
                      log: Callable[[str], None] | None = None) -> Any:
    """Measure a profile on this machine's GPU (or ``device``) and write it to ``out``.

    Args:
        out: The profile file to write (versioned JSON).
        workloads: Workload names as profile records name them (``profile_workload``).
        kernels: Kernel sets, the first measured with power.
        gpu: The GPU preset (default: from the device's name).
        collectives_from: ``"shipped"`` (kareus's profile of this GPU, if any), ``"none"``,
            or the path of a profile of the same GPU model.
        reps: Timed runs per op.
        power_s: Seconds of each op's power loop.
        device: The device (default: ``TorchCalibrationDevice``).
        log: Progress lines.

    Returns:
        The path written.

    Raises:
        HardwareError: no CUDA GPU, or no preset for it and ``gpu`` not given.
        GPUProfileError: a bad workload name, kernel set or collectives profile.
    """
    from kareus._io import check_output_file
    from kareus.model.gpu_profile import shipped_profiles

    check_output_file(out, what="--out")
    wls = [profile_workload(w) for w in workloads]
    dev = device or TorchCalibrationDevice(reps=reps, power_s=power_s)
    name = gpu or gpu_preset_of(dev.machine().gpu_name)
    if name is None:
        raise HardwareError(f"no kareus GPU preset matches {dev.machine().gpu_name!r}: pass "
                            "--gpu (see `kareus gpus`)")
    base: GPUProfile | None = None
    if collectives_from == "shipped":
        base = GPUProfile.preset(name) if name in shipped_profiles() else None
    elif collectives_from not in (None, "none"):
        base = GPUProfile.load(collectives_from)
    prof = measure_profile(dev, gpu=name, workloads=wls, kernel_sets=list(kernels),
                           collectives_from=base, log=log)
    prof = attrs.evolve(prof, notes=(*prof.notes, f"measured {utc_now()}"))
    return prof.save(out)
