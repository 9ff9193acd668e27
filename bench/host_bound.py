"""Host-bound or GPU-bound: eager launches against CUDA-graph replay, partitions and loop.

A GPU is *fed* when the host enqueues work faster than the GPU runs it; then the GPU is
busy for its whole window and a schedule's time is its GPU time. Eager PyTorch costs
10-150 us of host time per op, so small partitions (Qwen3-1.7B at TP=4, CP=2) are
host-bound when launched one op at a time; replayed from CUDA graphs they are not. This
bench measures both, on one GPU:

* **partitions**: every partition type of llama3.2-3b TP=4, qwen3-1.7b TP=4 CP=2
  (microbatch 8 and 16) and llama3.3-70b TP=8 (sequence 4096, two nanobatches), run as
  the profiler runs them (ops on the compute stream, the collective on the side stream at
  the first launch slot; the group stood in for by the loopback collective): per step,
  *GPU-only* time (the steps enqueued behind a sleeping kernel, so the host never holds
  the GPU back), *eager* time (back to back, launched as they go) and *graphed* time
  (replays of a CUDA graph of two steps). Busy fraction = GPU-only / measured.
  Medians of interleaved rounds.
  The partition's computation alone is timed the same way (*compute only*) and compared
  with the calibrated emulator's time for it (the shipped h200-sxm profile), backward
  partitions included.
* **loop** (``--loop``): the library's training loop (kareus.exec.train, loopback on
  one GPU) for qwen3-1.7b TP=4 CP=2 (28 layers, 4 microbatches of 8 x 4096) and
  llama3.2-3b TP=2 (8 layers), per schedule (sequential, nanobatching, the kareus plan
  in bench/plans/, those the committed results trained under) eager and graphed:
  iteration time (device events, median over repeats interleaved in a shuffled
  order), kernels per iteration and GPU-busy fraction
  of the iteration's span (torch.profiler: union of kernel intervals over first kernel
  start to last kernel end), and the loss of every step (eager and graphed runs start
  from the same weights and data, so losses compare step by step).
  ``--sp on`` runs the loop jobs with sequence parallelism (Megatron-LM's
  ``--sequence-parallel``: TP all-gathers before the QKV and gate/up GEMMs, reduce-scatters
  after the output projections, norms on the sequence shard) under the job's SP plan
  (``bench/plans/*_sp_h200.json``; a job without one runs its baselines only);
  ``--sp both`` runs each job in both layouts (rows labelled ``... sp``).

Usage (one CUDA GPU)::

    python bench/host_bound.py --json bench/results/host_bound_h200.json
    python bench/host_bound.py --quick       # fewer steps, for a smoke run
    python bench/host_bound.py --loop --no-partitions --only qwen3 --modes graphed \
        --sp both --json bench/results/host_bound_qwen3_sp_h200.json

Prints a table and writes JSON (``--json``): the machine, driver, torch and triton
versions, every row. Clocks are never changed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast

#: (label, preset, tp, cp, microbatch size) of the partition rows.
PARTITION_WORKLOADS = (
    ("llama3.2-3b tp4", "llama3.2-3b", 4, 1, 8),
    ("qwen3-1.7b tp4cp2 mb8", "qwen3-1.7b", 4, 2, 8),
    ("qwen3-1.7b tp4cp2 mb16", "qwen3-1.7b", 4, 2, 16),
    ("llama3.3-70b tp8", "llama3.3-70b", 8, 1, 8),
)

#: (label, plan file, layers, the plan of the same job under sequence parallelism or None)
#: of the loop rows.
LOOP_JOBS = (
    ("qwen3-1.7b tp4cp2", _REPO / "bench" / "plans" / "qwen3_1.7b_tp4cp2_mb8_h200.json", 28,
     _REPO / "bench" / "plans" / "qwen3_1.7b_tp4cp2_mb8_sp_h200.json"),
    ("llama3.2-3b tp2", _REPO / "bench" / "plans" / "llama3b_tp2_h200_measured.json", 8,
     None),
)

#: ``--sp``'s choices: the TP layouts a loop job runs in.
SP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no torch needed)."""
    ap = argparse.ArgumentParser(prog="host_bound.py", description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--no-partitions", action="store_true", help="skip the partition rows")
    ap.add_argument("--loop", action="store_true", help="also measure the training loop")
    ap.add_argument("--steps", type=int, default=20, help="steps per partition timing")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per partition")
    ap.add_argument("--loop-steps", type=int, default=3, help="timed iterations per loop run")
    ap.add_argument("--loop-repeats", type=int, default=2, help="runs per loop schedule+mode")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds (smoke run)")
    ap.add_argument("--modes", default="eager,graphed",
                    help="loop modes to run (eager, graphed); with one, the eager-vs-graphed "
                         "loss difference reads NaN")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="write each profiled loop iteration here as a Chrome trace")
    ap.add_argument("--only", default=None,
                    help="comma-separated labels (substrings) of the workloads to run")
    ap.add_argument("--sp", choices=sorted(SP_CHOICES), default="off",
                    help="the loop jobs' TP layout: off (all-reduces, the default), on "
                         "(sequence parallelism, under the job's SP plan) or both")
    return ap.parse_args(argv)


def loop_jobs(args: argparse.Namespace) -> list[tuple[str, Path | None, int, Any]]:
    """``(label, plan file or None, layers, Workload)`` of the loop runs ``args`` ask for:
    each job of ``LOOP_JOBS`` in each layout of ``--sp`` (under sequence parallelism its SP
    plan, or no plan when it has none: the baselines only)."""
    from kareus.compose.plan import Plan
    from kareus.model.workload import Workload

    out = []
    for label, plan_path, layers, sp_plan in LOOP_JOBS:
        if args.only and not any(s in label for s in args.only.split(",")):
            continue
        wl = Workload.from_dict(dict(Plan.load(plan_path).workload or {}))
        for sp in SP_CHOICES[args.sp]:
            if not sp:
                out.append((label, plan_path, layers, wl))
                continue
            p = wl.parallelism
            swl = wl.with_(parallelism=type(p)(tp=p.tp, cp=p.cp, pp=p.pp, dp=p.dp, sp=True))
            plan = sp_plan if sp_plan is not None and sp_plan.exists() else None
            out.append((f"{label} sp", plan, layers, swl))
    return out


def _versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    try:
        import pynvml

        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        out["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
    except Exception:  # recorded as unknown
        out["driver"] = None
    return out


# ------------------------------------------------------------------ partitions


class ClockSampler:
    """The GPU's SM clock, sampled by NVML from a thread while a timed window runs.

    Under the H200's 700 W power limit the SM clock sags below its 1980 MHz maximum on
    long dense work, and a window that follows an idle moment runs at a higher clock than
    one that follows seconds of work: two timings of the same kernels can differ by their
    clocks, not by how they were launched. Each window's mean clock is recorded beside
    its time so that a ratio can be read at equal clocks. Without NVML (or with no
    permission) it records nothing.
    """

    def __init__(self, period_s: float = 0.0005, *, nvml: bool = True) -> None:
        self.period_s = period_s
        self._handle: Any = None
        self._nvml: Any = None
        if not nvml:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(
                int(os.environ.get("KAREUS_BENCH_NVML_INDEX", "0")))
            self._nvml = pynvml
        except Exception:  # no NVML: clocks stay unknown
            self._handle = None

    def mean_mhz(self, fn: Any) -> tuple[Any, float | None]:
        """Run ``fn()`` while sampling; returns its result and the mean SM clock."""
        if self._handle is None:
            return fn(), None
        import threading

        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):  # a failed read is skipped
                    samples.append(self._nvml.nvmlDeviceGetClockInfo(
                        self._handle, self._nvml.NVML_CLOCK_SM))
                stop.wait(self.period_s)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            out = fn()
        finally:
            stop.set()
            th.join()
        return out, (statistics.fmean(samples) if samples else None)


CLOCKS = ClockSampler(nvml=False)  # main() samples on a GPU


def _queued_time_s(torch: Any, step: Any, steps: int) -> tuple[float, bool]:
    """Device time per step with the steps enqueued behind a sleeping kernel (the host
    never holds the GPU back), and whether the sleep outlasted the enqueueing (it is
    sized from one step's host time; ``False`` means the figure may include host
    gaps)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    per_host = time.perf_counter() - t0  # an upper bound of one step's host time
    cycles = int(min(2e10, max(1e7, 2.5e9 * per_host * steps * 3.0)))
    torch.cuda._sleep(cycles)
    # As many untimed steps first, queued too: the GPU leaves the sleeping kernel's low
    # power state before the timed steps (timed right after it, large GEMMs ran up to 13%
    # faster than back to back, at a higher clock).
    for _ in range(steps):
        step()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        step()
    b.record()
    fed = not a.query()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / steps, fed


def _timed_s(torch: Any, fn: Any, calls: int, per_call: int) -> float:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / (calls * per_call)


def measure_partitions(args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    """The partition rows."""
    import torch

    from kareus.exec.executor import TorchExecutor
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.exec.train import LoopbackGroupCollective
    from kareus.model.config import ScheduleConfig
    from kareus.model.gpu import get_gpu
    from kareus.model.workload import Workload

    gpu = get_gpu("h200-sxm")
    rows = []
    for label, preset, tp, cp, mbs in PARTITION_WORKLOADS:
        if args.only and not any(s in label for s in args.only.split(",")):
            continue
        wl = Workload.preset(preset, tp=tp, cp=cp, microbatch_size=mbs, seq_len=4096,
                             nanobatches=2)
        parts = runnable_partitions(wl)
        for name, part in parts.items():
            kind = part.comm_op.kind.value
            size = cp if kind in ("all_gather", "reduce_scatter") else tp
            coll = LoopbackGroupCollective(group_size=size)
            ex = TorchExecutor(collective=coll, graphs=True)
            prog = part.build(collective=coll)
            slot = part.slots[0].name if part.slots else None
            cfg = ScheduleConfig(gpu.max_clock_mhz, gpu.default_comm_sms, slot)

            def step(prog: Any = prog, cfg: Any = cfg, kind: str = kind, ex: Any = ex) -> None:
                ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, cfg,
                                 comm_kind=kind, comm_output=prog.comm_output)
                prog.advance()

            def two(step: Any = step) -> None:
                step()
                step()

            def plain(prog: Any = prog) -> None:
                prog.run_plain()
                prog.advance()

            seq = ex.capture(f"{label}:{name}", [two], warmup=2)
            for _ in range(3):
                step()
            res: dict[str, list[float]] = {"gpu_only_s": [], "eager_s": [], "graphed_s": [],
                                           "graphed_queued_s": [], "compute_only_s": []}

            def replay_queued(seq: Any = seq) -> tuple[float, bool]:
                t, ok = _queued_time_s(torch, seq.replay, max(1, args.steps // 2))
                return t / 2, ok  # two steps per replay

            fed = True
            mhz: dict[str, list[float]] = {"gpu_only": [], "eager": [], "graphed": []}

            def clocked(key: str, fn: Any, mhz: dict[str, list[float]] = mhz) -> Any:
                out, m = CLOCKS.mean_mhz(fn)
                if m is not None:
                    mhz[key].append(m)
                return out

            for _ in range(args.rounds):
                q, ok = clocked("gpu_only", partial(_queued_time_s, torch, step, args.steps))
                res["gpu_only_s"].append(q)
                q, ok2 = _queued_time_s(torch, plain, args.steps)
                res["compute_only_s"].append(q)
                fed = fed and ok and ok2
                res["eager_s"].append(clocked(
                    "eager", partial(_timed_s, torch, step, args.steps, 1)))
                res["graphed_s"].append(clocked(
                    "graphed", partial(_timed_s, torch, seq.replay, args.steps // 2, 2)))
                res["graphed_queued_s"].append(replay_queued()[0])
            med = {k: statistics.median(v) for k, v in res.items()}
            clock = {f"{k}_mhz": (statistics.median(v) if v else None) for k, v in mhz.items()}
            emulated = _emulated_compute_s(part, name, gpu.max_clock_mhz)
            row = {"workload": label, "partition": name, "ops": len(prog.op_names),
                   "collective": kind, "slot": slot, **med,
                   "emulated_compute_s": emulated,
                   "emulated_compute_error": (None if emulated is None else
                                              emulated / med["compute_only_s"] - 1.0),
                   "eager_ratio": med["eager_s"] / med["gpu_only_s"],
                   "graphed_ratio": med["graphed_s"] / med["gpu_only_s"],
                   # the graph's replays queued behind a sleep: what the graph costs the
                   # GPU itself, with the host out of the way; graphed_s near it = fed
                   "graph_gpu_ratio": med["graphed_queued_s"] / med["gpu_only_s"],
                   "eager_busy": min(1.0, med["gpu_only_s"] / med["eager_s"]),
                   "graphed_busy": min(1.0, med["gpu_only_s"] / med["graphed_s"]),
                   "gpu_only_fed": fed, **clock, "rounds": res, "rounds_mhz": mhz}
            rows.append(row)
            err = row["emulated_compute_error"]
            cs = "/".join("-" if clock[f"{k}_mhz"] is None else f"{clock[f'{k}_mhz']:.0f}"
                          for k in ("gpu_only", "eager", "graphed"))
            log(f"{label:24s} {name:18s} gpu-only {1e6 * med['gpu_only_s']:8.1f} us  "
                f"eager {row['eager_ratio']:5.2f}x  graphed {row['graphed_ratio']:5.2f}x "
                f"(queued {row['graph_gpu_ratio']:5.2f}x)  "
                f"MHz {cs}  "
                f"compute {1e6 * med['compute_only_s']:8.1f} us, emulated "
                f"{'-' if err is None else f'{100 * err:+.1f}%'}")
            del seq, prog, ex
        torch.cuda.empty_cache()
    return rows


def _emulated_compute_s(part: Any, name: str, freq_mhz: int) -> float | None:
    """The calibrated emulator's time of the partition's computation alone (the shipped
    h200-sxm profile; graph-replay launches), to check its ops against the measurement."""
    try:
        from kareus.model.gpu_profile import GPUProfile
        from kareus.profilers.emulator import EmulatedGPU

        gpu = _EMU.get("gpu")
        if gpu is None:
            gpu = _EMU["gpu"] = EmulatedGPU.from_profile(GPUProfile.preset("h200-sxm"))
        return float(sum(gpu.op_time_s(op, freq_mhz, partition=name)
                         for op in part.compute_ops))
    except Exception:  # the comparison is optional
        return None


_EMU: dict[str, Any] = {}


# ------------------------------------------------------------------ the loop


#: Upper ends (us) of the idle-gap bins of ``kernel_timeline``.
GAP_BINS_US = (1.0, 2.0, 3.0, 5.0, 10.0, 50.0, math.inf)


def kernel_timeline(kernels: list[tuple[float, float, str]],
                    top: int = 15) -> dict[str, Any]:
    """What one iteration's kernels say about feeding: ``kernels`` are ``(start_us,
    end_us, name)`` of every kernel (any stream). Busy = the union of their intervals
    over the span (first start to last end); every idle gap between busy stretches is
    binned by length (``gaps``: count and idle time per bin, upper ends
    ``GAP_BINS_US``) and charged to the kernel that ends it (``top_kernels``: per kernel
    name, calls, GPU time, idle time before it, the ``top`` names with most idle time
    first): where a graph's launches leave the GPU waiting."""
    if not kernels:
        return {"kernels": 0, "busy": None, "span_s": None}
    ks = sorted(kernels)
    busy = idle = 0.0
    cur_s, cur_e = ks[0][0], ks[0][1]
    bins = [[0, 0.0] for _ in GAP_BINS_US]
    per: dict[str, list[float]] = {}
    for s, e, name in ks:
        rec = per.setdefault(name, [0, 0.0, 0.0])
        rec[0] += 1
        rec[1] += e - s
        if s > cur_e:
            busy += cur_e - cur_s
            gap = s - cur_e
            idle += gap
            rec[2] += gap
            b = next(i for i, hi in enumerate(GAP_BINS_US) if gap <= hi)
            bins[b][0] += 1
            bins[b][1] += gap
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in ks) - ks[0][0]
    names = sorted(per.items(), key=lambda kv: -kv[1][2])[:top]
    return {"kernels": len(ks), "busy": busy / span if span > 0 else None,
            "span_s": span / 1e6, "idle_s": idle / 1e6,
            "gaps": [{"up_to_us": hi, "count": n, "idle_s": t / 1e6}
                     for hi, (n, t) in zip(GAP_BINS_US, bins)],
            "top_kernels": [{"name": n[:120], "calls": int(c), "gpu_s": g / 1e6,
                             "idle_before_s": i / 1e6} for n, (c, g, i) in names]}


def profiled_kernels(torch: Any, fn: Any,
                     trace: Path | None = None) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every GPU operation ``fn()`` enqueues (torch.profiler,
    after a synchronisation); the profile as a Chrome trace at ``trace``, if given."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return [(ev.time_range.start, ev.time_range.end, str(ev.name)) for ev in prof.events()
            if str(getattr(ev, "device_type", None)).endswith("CUDA")]


def _profile_iteration(torch: Any, loop: Any, schedule: str,
                       trace: Path | None = None) -> dict[str, Any]:
    """Kernels of one iteration, the GPU-busy fraction of their span and where the GPU
    waited (``kernel_timeline``); the profile as a Chrome trace at ``trace``, if given."""
    return kernel_timeline(profiled_kernels(torch, lambda: loop.step(schedule), trace))


def loss_rel_diff(a: list[float], b: list[float]) -> float:
    """Largest relative difference of two loss curves, step by step; ``inf`` when a loss
    of either is not finite (a NaN compares unequal to everything, and ``max`` over NaNs
    depends on their order: such runs must not read as equal)."""
    if len(a) != len(b) or not all(math.isfinite(x) for x in (*a, *b)):
        return math.inf
    return max((abs(x - y) / max(abs(x), 1e-9) for x, y in zip(a, b)), default=0.0)


def loss_noise_floor(repeats: list[dict[str, Any]]) -> float | None:
    """The largest relative difference between repeated runs of one schedule and mode:
    what the GPU's own non-determinism (atomic adds in the embedding and attention
    backward) makes of the same computation. Eager against graphed is judged against
    it; ``None`` with a single run."""
    curves = [r["losses"] for r in repeats]
    if len(curves) < 2:
        return None
    return max(loss_rel_diff(curves[0], c) for c in curves[1:])


def measure_loop(args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    """The loop rows: per job, schedule and mode."""
    import torch

    from kareus.compose.plan import Plan
    from kareus.exec.frequency import DryRunFrequencyController, StreamOrderedTrigger
    from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives

    rows = []
    for label, plan_path, layers, wl in loop_jobs(args):
        plan = Plan.load(plan_path) if plan_path is not None else None
        if plan is None:
            log(f"{label}: no plan for this layout: the baselines only")
        p = wl.parallelism
        groups = LoopbackGroups(tp=p.tp, cp=p.cp)
        capped, default, _ = make_collectives(groups, backend="loopback")
        trigger = StreamOrderedTrigger(DryRunFrequencyController(
            gpu=plan.gpu if plan is not None else "h200-sxm"))
        loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                            default_collective=default, plan=plan, frequency=trigger,
                            layers=layers, graphs=True)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        modes = [m for m in ("eager", "graphed") if m in args.modes.split(",")]
        order = [(s, m) for s in loop.schedules for m in modes]
        order = [o for _ in range(args.loop_repeats) for o in order]
        random.Random(0).shuffle(order)
        t0 = time.perf_counter()
        for schedule, mode in order:
            loop.graphs = mode == "graphed"
            loop.reset()
            losses = [loop.step(schedule)]  # warm-up (captures the graphs the first time)
            torch.cuda.synchronize()
            times = []

            def timed(schedule: str = schedule, losses: list[Any] = losses,
                      times: list[Any] = times, loop: Any = loop) -> None:
                for _ in range(args.loop_steps):
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    a.record()
                    losses.append(loop.step(schedule))
                    b.record()
                    times.append((a, b))
                torch.cuda.synchronize()

            _, mhz = CLOCKS.mean_mhz(timed)
            runs.setdefault((schedule, mode), []).append({
                "time_s": [a.elapsed_time(b) / 1e3 for a, b in times],
                "losses": [float(x) for x in losses], "sm_mhz": mhz})
        log(f"{label}: {len(order)} runs in {time.perf_counter() - t0:.1f} s")
        prof: dict[tuple[str, str], dict[str, Any]] = {}
        for schedule in loop.schedules:
            for mode in modes:
                loop.graphs = mode == "graphed"
                loop.reset()
                loop.step(schedule)
                trace = (None if args.trace_dir is None else args.trace_dir /
                         f"{label.replace(' ', '_')}_{schedule}_{mode}.json")
                try:
                    prof[(schedule, mode)] = _profile_iteration(torch, loop, schedule, trace)
                except Exception as exc:  # the profiler is optional here
                    prof[(schedule, mode)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        trigger.close()
        seq = {m: statistics.median(t for r in runs[("sequential", m)] for t in r["time_s"])
               for m in modes}
        for (schedule, mode), rs in sorted(runs.items()):
            t = statistics.median(x for r in rs for x in r["time_s"])
            ref = seq[mode]
            both = all((schedule, m) in runs for m in ("eager", "graphed"))
            diff = (loss_rel_diff(runs[(schedule, "eager")][0]["losses"],
                                  runs[(schedule, "graphed")][0]["losses"]) if both
                    else math.nan)
            floor = loss_noise_floor(runs.get((schedule, "eager"), runs[(schedule, mode)]))
            clocks = [r["sm_mhz"] for r in rs if r.get("sm_mhz") is not None]
            row = {"job": label, "layers": loop.layers, "workload": wl.to_dict(),
                   "sequence_parallel": p.sequence_parallel,
                   "schedule": schedule, "mode": mode, "time_s": t,
                   "sm_mhz": statistics.median(clocks) if clocks else None,
                   "vs_sequential": t / ref, **prof.get((schedule, mode), {}),
                   "loss_rel_diff_eager_vs_graphed": diff,
                   "loss_rel_diff_eager_repeats": floor,
                   "losses_finite": all(math.isfinite(x) for r in rs for x in r["losses"]),
                   "runs": rs}
            rows.append(row)
            busy = row.get("busy")
            log(f"{label:20s} {schedule:13s} {mode:8s} {1e3 * t:9.2f} ms  "
                f"x{row['vs_sequential']:.3f} seq  kernels {row.get('kernels')}  busy "
                f"{'-' if busy is None else f'{100 * busy:.1f}%'}  loss diff {diff:.2e} "
                f"(repeats {'-' if floor is None else f'{floor:.2e}'})  "
                f"SM {'-' if row['sm_mhz'] is None else round(row['sm_mhz'])} MHz")
            if row.get("gaps"):
                log("    idle gaps (<= us: count, ms): " + ", ".join(
                    f"{g['up_to_us']:g}: {g['count']}, {1e3 * g['idle_s']:.1f}"
                    for g in row["gaps"]))
        del loop
        torch.cuda.empty_cache()
    return rows


def cuda_torch(script: str) -> Any:
    """torch, when it sees a CUDA GPU; else ``None`` after a one-line reason on stderr.
    cuBLAS is asked for GEMMs without a workspace first, as the ``kareus`` command and
    the training loop ask (``kareus.exec.prefer_workspace_free_gemms``; a
    ``CUBLAS_WORKSPACE_CONFIG`` set by the caller is kept), so the benches measure what
    kareus runs."""
    from kareus.exec import prefer_workspace_free_gemms

    prefer_workspace_free_gemms()
    try:
        import torch
    except ImportError:
        print(f"{script}: torch is not installed (pip install torch)", file=sys.stderr)
        return None
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA GPU visible: this bench measures a GPU", file=sys.stderr)
        return None
    return torch


def main(argv: list[str] | None = None) -> int:
    """Run the bench; exit 2 without a CUDA GPU."""
    args = parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.loop_steps, args.loop_repeats = 8, 1, 2, 1
    torch = cuda_torch("host_bound.py")
    if torch is None:
        return 2
    t_begin = time.perf_counter()
    global CLOCKS
    CLOCKS = ClockSampler()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}", flush=True)

    out: dict[str, Any] = {
        "bench": "host_bound", "command": " ".join(["python", "bench/host_bound.py",
                                                   *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": "1x H200" if "H200" in torch.cuda.get_device_name() else
        torch.cuda.get_device_name(), **_versions(),
        "method": __doc__.split("Usage")[0].strip(),
    }
    if not args.no_partitions:
        out["partitions"] = measure_partitions(args, log)
        if args.json is not None:  # kept if the loop fails
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.loop:
        out["loop"] = measure_loop(args, log)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
