"""Tuning on this job's GPUs: ``tune`` sets up the hardware and runs the job.

``tune`` is what ``kareus optimize --profiler nvml`` runs on every rank under
``torchrun``. It checks the world (one pipeline stage's TP x CP group, or one process),
picks the GPU preset from the device name (``detect_gpu_preset``), builds the collective
backends that run on the group (``tuning_backends``), the executor, the frequency
controller and the [`NVMLProfiler`][kareus.profilers.NVMLProfiler], pre-heats the GPUs, and hands
the profiler to ``run_lockstep``.

The frequency and backend dimensions it sets up are described in ``kareus.tune``.

A world of one process runs the same path on one GPU (``one_gpu_backends``): each of
the workload's TP and CP groups is stood in for by a
[`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective] of that group's size (a real
kernel of each collective's bytes on the side stream, communicating with nobody), so that the
partitions' buffers, sized for their groups, fit the collectives that run on them: a smoke
run of the tuning path, whose figures are not kareus's.

On a GPU the executor captures each measured step into CUDA graphs and the profiler
measures their replays, as training runs (``graphs=False``: every op launched eagerly);
``tune.json`` says which (``execution``) and lists the measurements whose GPU was busy
less than 90% of their window (``host_bound``), which the end of the run also reports.

PyTorch, pynvml and the execution layer's GPU modules are imported when ``tune`` runs,
never at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kareus.errors import ArgumentError, ArgumentTypeError, HardwareError, KareusError
from kareus.model.config import ScheduleConfig
from kareus.model.partition import OutsideWork, Partition, TransformerPartition
from kareus.model.workload import Workload
from kareus.profilers.nvml import Coordinator
from kareus.tune._job import TuneReport, run_lockstep
from kareus.tune._lockstep import Catalog

__all__ = ["detect_gpu_preset", "one_gpu_backends", "tune", "tuning_backends"]


def tuning_backends(env: Any, wanted: Sequence[str] | None,
                    build: dict[str, Callable[[], Any]], *,
                    group_sizes: Sequence[int] | None = None
                    ) -> tuple[dict[str, Any], dict[str, str]]:
    """The collective backends a tuning run searches: each of ``build`` (name -> its
    constructor, in order) that ``wanted`` names (``None``: all) and that can run in the
    agreed environment ``env`` on every group its collectives use (``group_sizes``: the TP
    and CP degrees above 1; ``None`` = the environment's whole world), built.

    Construction is collective (every rank builds the same backends in the same order); a
    failure on one rank only (an IPC mapping) stops the job, as NCCL's would.

    Returns:
        ``(backends by name, why each other one cannot run)``.

    Raises:
        HardwareError: none can run; the message says why for each.
        ValueError: ``wanted`` names a backend that is not in ``build``.
    """
    from kareus.exec.collectives import backend_unavailable_reason

    unknown = sorted(set(wanted or ()) - set(build))
    if unknown:
        raise ArgumentError(f"unknown backend(s) {unknown} for tuning: use {sorted(build)}")
    named: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for name, make in build.items():
        if wanted is not None and name not in wanted:
            continue
        sizes = [env.world_size] if group_sizes is None else list(group_sizes)
        why = next((w for n in sizes if (w := backend_unavailable_reason(
            name, dataclasses.replace(env, world_size=n))) is not None), None)
        if why is None:
            try:
                named[name] = make()
            except KareusError as exc:
                why = str(exc)
        if why is not None:
            notes[name] = why
    if not named:
        raise HardwareError("no capped collective backend runs on this group: "
                            + "; ".join(f"{n}: {w}" for n, w in notes.items()))
    return named, notes


def one_gpu_backends(workload: Workload, *, loopback: str = "plain",
                     gpu: str | None = None) -> tuple[dict[str, Any], Any, str]:
    """The collective backends of a tuning run on one GPU (a world of one process).

    The partitions' communication buffers are sized for their groups (a CP all-gather's
    output holds CP times its input), so each group is stood in for at its size: a
    [`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective] per TP and CP group of
    more than one rank, routed by kind as in training (all-reduces to TP, all-gathers and
    reduce-scatters to CP; [`make_collectives`][kareus.exec.train.make_collectives] with
    [`LoopbackGroups`][kareus.exec.train.LoopbackGroups]). A workload with TP = CP = 1 gets a
    [`LoopbackCollective`][kareus.exec.LoopbackCollective] (a world of one; needs a GPU). A
    mixture of experts' expert-parallel group gets its stand-in beside them (all-to-alls to
    it: ``LoopbackGroups(ep=...)``, plain or time-faithful).

    Args:
        workload: The job.
        loopback: ``"plain"`` (a kernel of the collective's bytes) or ``"faithful"`` (the
            time-faithful stand-in,
            [`TimedLoopbackGroupCollective`][kareus.exec.train.TimedLoopbackGroupCollective],
            its times from [`EmulatedCollectiveTimes`][kareus.profilers.EmulatedCollectiveTimes]
            of ``gpu``: every figure it makes is a STAND-IN's, and the note says so).
        gpu: The GPU preset whose collective times the faithful stand-in takes.

    Returns:
        ``({"loopback": capped backend}, the default backend, a line saying what runs)``.
    """
    from kareus.exec.train import LoopbackGroups, make_collectives

    p = workload.parallelism
    times = None
    if loopback == "faithful":
        from kareus.profilers.collective_times import EmulatedCollectiveTimes

        if gpu is None:
            raise ArgumentError("loopback='faithful' needs the GPU preset whose collective "
                                "times it stands in for (gpu=)")
        times = EmulatedCollectiveTimes(gpu)
    # a mixture of experts' EP group stood in beside the TP and CP groups (its all-to-alls:
    # LoopbackGroupCollective.all_to_all, timed by the faithful stand-in)
    ep = p.ep if workload.model.moe is not None else 1
    capped, default, note = make_collectives(LoopbackGroups(tp=p.tp, cp=p.cp, ep=ep, dp=p.dp),
                                             backend="loopback", loopback=loopback,
                                             times=times)
    if capped is None:  # TP = CP = EP = 1: nothing to stand in for
        from kareus.exec.collectives import LoopbackCollective

        loop = LoopbackCollective()
        return {"loopback": loop}, loop, "LoopbackCollective (a world of one)"
    return {"loopback": capped}, default, note


def _check_loopback(loopback: str, world: int) -> None:
    from kareus.exec.train import LOOPBACK_MODES

    if loopback not in LOOPBACK_MODES:
        raise ArgumentError(f"--loopback must be one of {LOOPBACK_MODES}, got {loopback!r}")
    if loopback != "plain" and world != 1:
        raise ArgumentError(f"--loopback {loopback} stands in for the groups on one GPU; "
                            f"{world} processes run the real collectives: leave it out")


def detect_gpu_preset(device_name: str) -> str:
    """The GPU preset of a CUDA device name (``"NVIDIA H200"`` -> ``"h200-sxm"``).

    Raises:
        HardwareError: no preset matches; pass ``--gpu``.
    """
    name = device_name.lower()
    for key, preset in (("h200", "h200-sxm"), ("h100", "h100-sxm"), ("a100", "a100-40gb")):
        if key in name:
            return preset
    raise HardwareError(f"no GPU preset for {device_name!r}: pass --gpu (see `kareus gpus`) "
                        "or --gpu-file")


def tune(workload: Workload, *, out_dir: str | os.PathLike[str], gpu: str | None = None,
         budget: int = 16, batch_size: int | None = None, seed: int = 0,
         schedule: str = "1f1b", surrogate: Any = None, systems: Sequence[str] | None = None,
         types: Sequence[str] | None = None, fresh: bool = False,
         progress: bool | None = None, allow_clock_changes: bool = False,
         backends: Sequence[str] | None = None, comm_sms: Sequence[int] | None = None,
         kernels: Any = None, deadline_s: float | None = None,
         energy_budget_j: float | None = None,
         profiler_options: dict[str, Any] | None = None,
         graphs: bool | None = None, loopback: str = "plain") -> TuneReport | None:
    """Tune ``workload`` on this job's GPUs; call it on every rank (under ``torchrun``).

    The world is one pipeline stage's TP x CP group (``world_size == tp x cp``), or one
    process (a smoke run of the path, each group stood in for on one GPU:
    ``one_gpu_backends``).

    Args:
        workload: The workload.
        out_dir: Output folder (rank 0 writes ``results.json``, ``plan.json``, ``tune.json``
            and ``logs/``).
        gpu: GPU preset; ``None`` = detected from the device name.
        budget: Profiles per partition type.
        batch_size, seed, schedule, surrogate, systems, fresh, progress: As for
            [`optimize`][kareus.workflow.optimize].
        types: Only these partition types (no composition), e.g. a smoke run.
        allow_clock_changes: Search the clocks with an
            [`NVMLFrequencyController`][kareus.exec.NVMLFrequencyController] (needs root; never on
            shared machines). Otherwise the clocks stay as they are and only the default
            clock is measured.
        backends: Backends to search among ``"own"`` and ``"nccl_capped"``; ``None`` =
            every one that runs on this group (``"loopback"`` alone in a world of one).
            Each is built per TP and CP group
            ([`kareus.exec.train.make_collectives`][kareus.exec.train.make_collectives]).
        comm_sms: SM counts to search; ``None`` = 2, 4, 8, 16, 24, 32 and the GPU's default
            (each NCCL cap is a communicator of its own).
        kernels: The runnable partitions' kernel set (``None``: the library's choice).
        deadline_s, energy_budget_j: The plan chosen (at most one).
        profiler_options: Keyword arguments of [`NVMLProfiler`][kareus.profilers.NVMLProfiler]
            (``warmup_s``, ``window_steps``, ...).
        graphs: Measure CUDA-graph replays of each step (``None``, the default: as the
            training loop runs on a GPU) or eager launches (``False``);
            ``TorchExecutor(graphs=...)``.
        loopback: In a world of one: ``"plain"`` (the default) or ``"faithful"`` (each
            collective stood in for by a kernel that holds its SM count for the real
            collective's time: ``one_gpu_backends``; ``tune.json`` and every line say
            STAND-IN). Refused in a world of several processes (they run the real
            collectives).

    Returns:
        The report on rank 0, ``None`` elsewhere.

    Raises:
        HardwareError: no GPU, no NVML, a world that is not the workload's group.
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise HardwareError("--profiler nvml measures on GPUs through PyTorch: install it "
                            "(pip install 'kareus[torch]') on a machine with NVIDIA GPUs") from exc

    from kareus.exec.collectives import probe_collective_environment
    from kareus.exec.executor import TorchExecutor
    from kareus.exec.frequency import (
        DryRunFrequencyController,
        NVMLFrequencyController,
    )
    from kareus.profilers.nvml import (
        EnergyMeter,
        LocalCoordinator,
        NVMLProfiler,
        TorchDistributedCoordinator,
        TorchPartitionRunner,
    )
    t_begin = time.monotonic()
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")  # no multicast
    if not torch.cuda.is_available():
        raise HardwareError("no CUDA GPU visible: tuning on the machine needs its GPUs (use "
                            "the emulated profiler without them)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    owns_group = not dist.is_initialized() and "WORLD_SIZE" in os.environ
    if owns_group:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = workload.parallelism.tp * workload.parallelism.cp
    if world not in (1, group):
        raise HardwareError(f"{world} processes for a TP x CP group of {group}: run one process "
                            f"per GPU of one stage (torchrun --nproc_per_node {group}), or one "
                            "for a smoke run")
    coord: Coordinator = TorchDistributedCoordinator() if world > 1 else LocalCoordinator()
    device_name = torch.cuda.get_device_name()
    gpu_name = gpu or detect_gpu_preset(device_name)
    from kareus.model.gpu import get_gpu

    spec = get_gpu(gpu_name)

    # Collective backends: every one that runs on this group, the same on every rank.
    from kareus.exec.train import STAND_IN_LABEL

    _check_loopback(loopback, world)
    loop_note = ""
    if world == 1:
        named, default, loop_note = one_gpu_backends(workload, loopback=loopback,
                                                     gpu=gpu_name)
        notes: dict[str, str] = {}
    else:
        # One backend per TP and CP group (all-reduces over TP, all-gathers and
        # reduce-scatters over CP), as the training loop runs them.
        from kareus.exec.train import TorchParallelGroups, make_collectives

        p = workload.parallelism
        groups = TorchParallelGroups(tp=p.tp)
        made: dict[str, Any] = {}

        def maker(name: str) -> Callable[[], Any]:
            def make() -> Any:
                made[name] = make_collectives(groups, backend=name)
                return made[name][0]
            return make

        named, notes = tuning_backends(probe_collective_environment(), backends,
                                       {n: maker(n) for n in ("own", "nccl_capped")},
                                       group_sizes=[n for n in (p.tp, p.cp) if n > 1])
        default = made[next(iter(named))][1]  # each group's collectives, NCCL's own CTAs
    names = list(named)
    primary = named.get("nccl_capped", named[names[0]])  # the baselines' NCCL where it runs
    executor = TorchExecutor(collective=primary, backends=named, default_collective=default,
                             graphs=graphs)

    resolve, outside = _runnables(Catalog(workload), kernels)
    runner = TorchPartitionRunner(executor, seed=1234, resolve=resolve)
    if allow_clock_changes:
        controller: Any = NVMLFrequencyController(gpu=spec)
    else:
        controller = DryRunFrequencyController(gpu=spec)
    sms = sorted({*(comm_sms or (2, 4, 8, 16, 24, 32)), spec.default_comm_sms})
    meter = EnergyMeter()
    prof = NVMLProfiler(gpu=spec, runner=runner, meter=meter, coordinator=coord,
                        frequency=controller, comm_sms=sms, backends=names, outside=outside,
                        **(profiler_options or {}))
    say = (lambda msg: print(f"kareus: {msg}", file=sys.stderr, flush=True)) \
        if coord.rank == 0 else (lambda msg: None)
    say(f"tuning {workload.describe()} on {world}x {device_name} ({spec.name}); backends "
        f"{names}" + (f" (not available: {notes})" if notes else "")
        + (f"; a world of one (smoke run), {loop_note}" if world == 1 else "")
        + ("; steps measured as CUDA-graph replays" if executor.graphs
           else "; steps measured as eager launches"))
    say(prof.clock_note)
    try:
        with contextlib.ExitStack() as stack:
            if allow_clock_changes:
                stack.callback(controller.close)
            prof.start()
            say(f"energy counter steps every {1e3 * (prof.step_period_s or 0):.0f} ms; static "
                f"power {prof.static_power_w():.0f} W over {world} GPU(s)")
            _preheat(prof, resolve, Catalog(workload), names, say)
            import pynvml

            info = {
                "machine": f"{world}x {device_name}",
                "software": {"torch": torch.__version__,
                             "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                             "cuda": torch.version.cuda,
                             # cuBLAS's workspace (kareus.exec.prefer_workspace_free_gemms)
                             "cublas_workspace_config":
                                 os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
                "gpu": spec.name, "clocks_controlled": prof.clocks_controlled,
                "clocks_mhz": list(prof.freqs_mhz), "clock_note": prof.clock_note,
                "comm_sms": sms, "backends_unavailable": notes,
                "comm_priority": "high" if executor.comm_high_priority else "normal",
                "execution": prof.execution,
                "static_power_w": prof.static_power_w(),
                "counter_step_s": prof.step_period_s,
                "smoke_run": world == 1,
                "loopback": loopback if world == 1 else None,
                "stand_in": (f"{STAND_IN_LABEL}: every measurement of this run is a "
                             "stand-in's" if world == 1 and loopback == "faithful" else None),
                "collectives": loop_note if world == 1 else ", ".join(names),
                # a partition is measured on this world's GPUs and stands for its TP x CP
                # group: energy and static power scaled to the group where they differ
                "energy_scope": (f"each partition measured on {world} GPU(s) and scaled to "
                                 f"its TP x CP group of {workload.parallelism.gpus_per_stage} "
                                 "(energy and static power; time as measured)"
                                 if world != workload.parallelism.gpus_per_stage else
                                 f"each partition measured on its {world} GPU(s)"),
                "command": _command(),
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
            }
            report = run_lockstep(workload, profiler=prof, coordinator=coord, out_dir=out_dir,
                                  backends=names if len(names) > 1 else (), types=types,
                                  budget=budget, batch_size=batch_size, seed=seed,
                                  schedule=schedule, surrogate=surrogate, systems=systems,
                                  fresh=fresh, progress=progress, deadline_s=deadline_s,
                                  energy_budget_j=energy_budget_j, info=info,
                                  started=t_begin)
    finally:
        prof.close()
        for backend in named.values():
            with contextlib.suppress(Exception):
                backend.close()
        if owns_group:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    wall = time.monotonic() - t_begin
    if report is not None:
        say(f"GPU time: {wall:.1f} s x {world} GPU(s) = {wall * world:.1f} GPU-s "
            f"({report.measured} measurements, {len(prof.records)} on this rank)")
        say(_host_bound_summary(report))
        report = attrs.evolve(report, wall_s=wall, gpu_time_s=wall * world)
    return report


def _host_bound_summary(report: TuneReport) -> str:
    """One line on the run's host-bound measurements (``tune.json``'s ``host_bound``)."""
    from kareus.profilers.nvml import HOST_BOUND_BUSY

    mode = report.execution or "unknown"
    flagged = report.host_bound
    if not flagged:
        return (f"{mode} execution; no measurement was host-bound (every GPU busy at least "
                f"{HOST_BOUND_BUSY:.0%} of its window, where measured)")
    worst = flagged[0]
    what = worst.get("partition", f"outside work {worst.get('outside_work')}")
    hint = ("larger partitions (a graph replay outlasted them)" if mode == "graphed"
            else "CUDA graphs (the default on a GPU) or the lean kernels")
    return (f"{mode} execution; {len(flagged)} measurement(s) host-bound (GPU busy below "
            f"{HOST_BOUND_BUSY:.0%} of the window; lowest {worst['gpu_busy']:.0%}, {what}): "
            f"their figures are of the host's launches as much as of the GPU; try {hint} "
            "(tune.json lists them under host_bound)")


def _preheat(prof: Any, resolve: Callable[[Partition], Any], catalog: Catalog,
             names: Sequence[str], say: Callable[[str], None]) -> None:
    """Run the first partition type a few times on every rank and take the GPUs' working
    temperature as the cool-down baseline (else each candidate would wait for the idle
    temperature, which a loaded GPU does not reach in its cool-down time)."""
    part = catalog.partitions[0][0]
    gpu = prof.gpu
    slot = part.slots[0].name if part.slots else None
    cfg = ScheduleConfig(gpu.max_clock_mhz, gpu.default_comm_sms, slot,
                         backend=names[-1] if len(names) > 1 else None)
    try:
        temp = prof.preheat(resolve(part), cfg)
    except HardwareError as exc:  # decided on every rank together
        say(f"pre-heating failed ({exc}); the cool-down baseline stays the idle temperature")
        return
    say(f"pre-heated on {part.name}: cool-down baseline {temp:.0f} C")


def _runnables(catalog: Catalog, kernels: Any) -> tuple[Callable[[Partition], Any],
                                                        Callable[[OutsideWork, int | None], Any]]:
    """How the NVML profiler gets kernels: each catalogued partition type as one
    [`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition] (made once), and
    outside work as ``RunnableOutsideWork``."""
    from kareus.exec.outside_work import RunnableOutsideWork
    from kareus.exec.torch_partition import RunnableTransformerPartition

    made: dict[int, Any] = {}

    def resolve(part: Partition) -> Any:
        idx = catalog.partition_index(part)
        if idx not in made:
            p, wl = catalog.partitions[idx]
            if not isinstance(p, TransformerPartition):  # the partition builder's type
                raise ArgumentTypeError(f"partition {p.name!r} is not a TransformerPartition")
            made[idx] = RunnableTransformerPartition(p, wl, kernels=kernels)
        return made[idx]

    def outside(work: OutsideWork, sms: int | None) -> Any:
        wl = catalog.outside[catalog.outside_index(work)][1]
        return RunnableOutsideWork(work, wl, comm_sms=sms, kernels=kernels)

    return resolve, outside


def _command() -> str:
    """This process's command line, as the user typed it (``kareus ...`` under torchrun)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("kareus/__main__.py", "kareus/cli.py")):
        argv[0] = "kareus"
    return " ".join(argv)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
