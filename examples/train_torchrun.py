"""Apply a kareus plan inside a PyTorch training loop (one process per GPU, torchrun).

A plan fixes, for every microbatch computation of an iteration, a GPU clock and, for
every partition type, how many SMs the tensor-parallel all-reduce gets and which op it
launches with. This script shows how a training loop applies one, and times it on real
GPUs against the schedules it replaces::

    # 1. make the plan (CPU, emulated GPU; needs xgboost) -- or use the committed one
    python examples/train_torchrun.py --make-plan --plan examples/plans/llama3b_tp2_h200.json

    # 2. run it (one process per GPU of the tensor-parallel group)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 2 examples/train_torchrun.py \\
        --plan examples/plans/llama3b_tp2_h200.json --steps 20 --dry-run-clocks

What every rank does:

* builds the runnable partitions of the plan's workload (the layer segments' real
  kernels at the per-rank shapes: GEMMs, RMSNorm, RoPE, attention, SwiGLU and their
  backward passes; random weights, no model needed), with communication buffers from
  the executor's collective backend (registered memory, if that backend is
  :class:`~kareus.exec.collectives.OwnKernelCollective`);
* opens a :class:`~kareus.exec.executor.TorchExecutor` with NCCL communicators capped
  at each SM count of the plan (:class:`~kareus.exec.collectives.NCCLCappedCollective`),
  and a :class:`~kareus.exec.frequency.StreamOrderedTrigger` driving a
  :class:`~kareus.exec.frequency.DryRunFrequencyController`: clock requests reach the
  controller when the GPU gets to each microbatch boundary and are only *recorded*.
  Clocks change only with ``--nvml-clocks --allow-clock-changes`` (never on shared
  machines);
* compares the plan's digest across ranks (``executor.start()``), then runs the 1F1B
  order of the plan's microbatch computations: each under ``executor.microbatch(stage,
  microbatch, phase)``, each layer segment of each nanobatch under
  ``executor.partition(type)``, whose collective (the previous segment's all-reduce)
  launches at the plan's slot with the plan's SM count. Backward computations first
  recompute their layer's forward (the workload uses full recomputation);
* times each iteration with CUDA events, interleaving three schedules of the same ops:
  the plan; Megatron-style sequential (whole microbatch, each all-reduce right after the
  segment that produced it, NCCL's own CTA count); and default nanobatching (two
  nanobatches, each all-reduce launched with the next segment's first op, NCCL's own
  CTA count).

``--layers K`` runs K transformer layers per microbatch computation instead of all of
them (the plan's configurations are per partition type, so they apply to any number of
layers), to keep the run short. Every rank issues the same collectives in the same
order: all loop counts are fixed before the loop, never taken from timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without installing kareus
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast on the lent machines

DEFAULT_PLAN = _REPO / "examples" / "plans" / "llama3b_tp2_h200.json"
SCHEDULES = ("megatron", "nanobatching", "kareus")


# ------------------------------------------------------------------ arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (no torch needed)."""
    ap = argparse.ArgumentParser(
        prog="train_torchrun.py",
        description="Apply a kareus plan inside a PyTorch training loop (run with torchrun), "
                    "or make the plan (--make-plan, CPU).")
    ap.add_argument("--plan", type=Path, default=DEFAULT_PLAN,
                    help="plan JSON to run (or to write with --make-plan); default %(default)s")
    ap.add_argument("--steps", type=int, default=20, help="timed iterations per schedule")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations per schedule")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer layers per microbatch computation (default: all)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES),
                    help="schedules to time, in this order per step (default %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    ap.add_argument("--kernels", default="auto",
                    help="the ops' kernel set (kareus.exec.kernels): triton (fused, the "
                         "default on a GPU), torch, reference (the old eager formulas)")
    clocks = ap.add_mutually_exclusive_group()
    clocks.add_argument("--dry-run-clocks", dest="clocks", action="store_const",
                        const="dry-run", help="record clock requests only (the default)")
    clocks.add_argument("--nvml-clocks", dest="clocks", action="store_const", const="nvml",
                        help="lock SM clocks through NVML (needs --allow-clock-changes)")
    ap.set_defaults(clocks="dry-run")
    ap.add_argument("--allow-clock-changes", action="store_true",
                    help="permit --nvml-clocks; never on shared machines")
    mk = ap.add_argument_group("--make-plan (CPU, emulated GPU)")
    mk.add_argument("--make-plan", action="store_true",
                    help="run kareus.optimize on the emulator and save the plan to --plan")
    mk.add_argument("--model", default="llama3.2-3b")
    mk.add_argument("--tp", type=int, default=2, help="tensor-parallel degree = GPUs")
    mk.add_argument("--microbatch-size", type=int, default=8)
    mk.add_argument("--seq-len", type=int, default=4096)
    mk.add_argument("--nanobatches", type=int, default=2)
    mk.add_argument("--microbatches", type=int, default=4)
    mk.add_argument("--gpu", default="h200-sxm")
    mk.add_argument("--budget", type=int, default=32, help="profiles per partition type")
    mk.add_argument("--slack", type=float, default=0.0,
                    help="take the lowest-energy plan within (1 + slack) x the fastest time")
    args = ap.parse_args(argv)
    if args.clocks == "nvml" and not args.allow_clock_changes:
        ap.error("--nvml-clocks changes GPU clocks: it needs --allow-clock-changes, which must "
                 "never be given on shared machines (use --dry-run-clocks there)")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
    if args.slack < 0:
        ap.error("--slack must be >= 0")
    scheds = [s for s in args.schedules.split(",") if s]
    bad = [s for s in scheds if s not in SCHEDULES]
    if bad or not scheds or len(set(scheds)) != len(scheds):
        ap.error(f"--schedules: a comma list of distinct names among {', '.join(SCHEDULES)}")
    args.schedules = scheds
    return args


# ------------------------------------------------------------------ plans


def make_plan(args: argparse.Namespace) -> Any:
    """Search and compose on the emulated GPU; save the chosen kareus plan to ``args.plan``."""
    from kareus.model.workload import Workload
    from kareus.workflow import optimize

    wl = Workload.preset(args.model, tp=args.tp, microbatch_size=args.microbatch_size,
                         seq_len=args.seq_len, nanobatches=args.nanobatches,
                         num_microbatches=args.microbatches)
    result = optimize(wl, args.gpu, budget=args.budget, seed=0, progress=False)
    fastest = result.kareus.points[0].time_s
    plan = (result.select() if args.slack == 0
            else result.select(deadline_s=fastest * (1 + args.slack)))
    args.plan.parent.mkdir(parents=True, exist_ok=True)
    plan.save(args.plan)
    print(result.table())
    print()
    print(plan.summary())
    print(f"\nsaved {args.plan} (emulated {args.gpu}; digest {plan.digest[:16]})")
    return plan


def load_plan(path: Path) -> tuple[Any, Any]:
    """The plan at ``path`` and its workload (raises ``PlanError`` for a bad file)."""
    from kareus.compose.plan import Plan
    from kareus.errors import PlanError
    from kareus.model.workload import Workload

    plan = Plan.load(path)
    w = plan.workload
    if not w:
        raise PlanError(f"{path}: the plan does not record its workload")
    if plan.num_stages != 1 or int(w.get("pp", 1)) != 1:
        raise PlanError(f"{path}: this example runs one pipeline stage (PP=1); the plan has "
                        f"{plan.num_stages}")
    if int(w.get("cp", 1)) != 1:
        # The loop below pairs one all-reduce with each layer segment; context parallelism
        # adds all-gather / reduce-scatter partition types it does not schedule.
        raise PlanError(f"{path}: this example runs tensor parallelism only (CP=1); the plan "
                        f"has CP={w['cp']}: make a TP-only plan")
    wl = Workload.preset(str(w["model"]), tp=int(w["tp"]), cp=int(w.get("cp", 1)),
                         pp=1, dp=int(w.get("dp", 1)),
                         microbatch_size=int(w["microbatch_size"]), seq_len=int(w["seq_len"]),
                         num_microbatches=int(w["num_microbatches"]),
                         recompute=bool(w.get("recompute", True)),
                         nanobatches=int(w["nanobatches"]))
    return plan, wl


def segment_order(pset: Any, phase: str, nanobatches: int, recompute: bool) -> list[str]:
    """Partition types of one layer of a ``phase`` computation, in stream order.

    Each layer segment runs once per nanobatch; a backward computation first recomputes
    the layer's forward when the workload recomputes activations.
    """
    def of(ph: str) -> list[str]:
        seen: list[str] = []
        for name, p in pset.types.items():
            if p.phase == ph and name not in seen:
                seen.append(name)
        return [n for n in seen for _ in range(nanobatches)]

    if phase == "fwd":
        return of("fwd")
    return (of("fwd") if recompute else []) + of("bwd")


def build_programs(wl: Any, collective: Any, *, device: Any = None, kernels: Any = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Programs of every partition type: at nanobatch shapes (kareus, nanobatching) and at
    whole-microbatch shapes (Megatron-style); one program per type, reused by every layer.

    ``collective`` is the executor's backend: when it has ``empty(shape, dtype)``
    (:class:`~kareus.exec.collectives.OwnKernelCollective`) the communication buffers
    are registered tensors, which its kernels reduce without staging copies. ``empty``
    is a collective call: every rank builds the same programs in the same order.
    ``device``: where to build (default: the current CUDA device). ``kernels``: the ops'
    kernel set (:mod:`kareus.exec.kernels`, the one definition of each op; default: the
    fused kernels on a GPU).
    """
    from kareus.exec.kernels import get_kernels
    from kareus.exec.torch_partition import runnable_partitions

    ks = get_kernels(None if kernels == "auto" else kernels)

    def build(workload: Any, seed0: int) -> dict[str, Any]:
        return {name: p.build(device=device, seed=seed0 + i, collective=collective)
                for i, (name, p) in enumerate(runnable_partitions(workload,
                                                                  kernels=ks).items())}

    return build(wl, 1000), build(wl.with_(nanobatches=1), 2000)


# ------------------------------------------------------------------ schedules


@attrs.frozen
class DefaultCTAs:
    """A baseline configuration: the collective uses NCCL's own CTA count.

    ``comm_sms=None`` makes :class:`~kareus.exec.executor.TorchExecutor` use its
    ``default_collective``; ``launch_slot=None`` is sequential.
    """

    launch_slot: str | None = None
    comm_sms: None = None

    @property
    def sequential(self) -> bool:
        return self.launch_slot is None


def run_overlapped(ex: Any, progs: dict[str, Any], types: list[str], *,
                   config: Callable[[Any], Any] | None = None) -> None:
    """One nanobatched microbatch computation: every segment's collective overlaps the
    next segment in stream order (the chain kareus's partitions describe).

    Args:
        ex: The executor.
        progs: Partition type -> :class:`~kareus.exec.torch_partition.PartitionProgram`.
        types: The segments' partition types in stream order.
        config: ``program -> configuration``; ``None`` = the executor's plan (call this
            inside ``ex.microbatch(...)``).
    """
    pending = None
    for name in types:
        prog = progs[name]
        if pending is None:  # the first segment: no collective before it
            prog.run_plain()
        else:
            cfg = None if config is None else config(prog)
            with ex.partition(name, config=cfg, op_names=prog.op_names) as part:
                part.communicate(pending)
                for op_name, fn in zip(prog.op_names, prog.ops):
                    part.op(op_name, fn)
        prog.advance()
        pending = prog.comm_tensor  # the buffer this segment just wrote
    if pending is None:
        return
    # The last collective has nothing left to overlap: sequential, with the SM count of
    # the first segment's type (its partner in kareus's cyclic chain).
    if config is None:
        from kareus.exec.executor import plan_config
        from kareus.model.config import ScheduleConfig

        c = plan_config(ex.plan, types[0], ex.current)
        tail: Any = ScheduleConfig(c.freq_mhz, c.comm_sms, None)
    else:
        tail = DefaultCTAs()
    with ex.partition(types[0], config=tail) as part:
        part.communicate(pending)


def run_sequential(ex: Any, progs: dict[str, Any], types: list[str]) -> None:
    """One Megatron-style computation: each segment, then its own all-reduce (exposed)."""
    for name in types:
        prog = progs[name]
        with ex.partition(name, config=DefaultCTAs(), op_names=prog.op_names) as part:
            part.communicate(prog.output)  # launched after the ops: sequential
            for op_name, fn in zip(prog.op_names, prog.ops):
                part.op(op_name, fn)
        prog.advance()


def run_iteration(schedule: str, *, computations: list[Any], plan_executor: Any,
                  baseline_executor: Any, progs: dict[str, Any], full_progs: dict[str, Any],
                  order: dict[str, list[str]], full_order: dict[str, list[str]]) -> None:
    """Enqueue one training iteration (every computation of the stage) under ``schedule``.

    ``"kareus"`` runs each computation inside ``plan_executor.microbatch(...)`` (the plan's
    clock request, in stream order) with the plan's configurations; ``"nanobatching"``
    launches each collective with the next segment's first op; ``"megatron"`` runs the
    whole-microbatch programs ``full_progs`` sequentially. The baselines use
    ``baseline_executor`` and NCCL's own CTA count.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for comp in computations:
        if schedule == "kareus":
            with plan_executor.microbatch(comp.stage, comp.microbatch, comp.phase):
                run_overlapped(plan_executor, progs, order[comp.phase])
        elif schedule == "nanobatching":
            run_overlapped(baseline_executor, progs, order[comp.phase],
                           config=lambda prog: DefaultCTAs(prog.op_names[0]))
        else:
            run_sequential(baseline_executor, full_progs, full_order[comp.phase])


# ------------------------------------------------------------------ the loop


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0915 - a linear script
    args = parse_args(argv)
    if args.make_plan:
        make_plan(args)
        return 0

    import torch
    import torch.distributed as dist

    from kareus.exec.collectives import CollectiveUnavailableError, NCCLCappedCollective
    from kareus.exec.executor import ProcessGroupCollective, TorchExecutor
    from kareus.exec.frequency import (
        DryRunFrequencyController,
        NVMLFrequencyController,
        StreamOrderedTrigger,
    )
    from kareus.model.partition import build_partitions
    from kareus.model.pipeline import get_schedule

    t_begin = time.perf_counter()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    plan, wl = load_plan(args.plan)
    if wl.parallelism.tp * wl.parallelism.cp != world:
        raise SystemExit(f"the plan is for TP={wl.parallelism.tp} x CP={wl.parallelism.cp}; "
                         f"run it with that many processes, not {world}")
    layers = wl.layers_per_stage if args.layers is None else min(args.layers,
                                                                 wl.layers_per_stage)
    n = wl.nanobatches
    pset = build_partitions(wl)
    order = {ph: segment_order(pset, ph, n, wl.recompute) * layers for ph in ("fwd", "bwd")}
    full_pset = build_partitions(wl.with_(nanobatches=1))
    full_order = {ph: segment_order(full_pset, ph, 1, wl.recompute) * layers
                  for ph in ("fwd", "bwd")}
    computations = list(get_schedule(plan.schedule, 1, plan.num_microbatches).stage_orders[0])

    # Collectives: one NCCL communicator per SM cap of the plan (created up front, in the
    # same order on every rank), and the plain world group for the baselines.
    caps = sorted({cfg.comm_sms for cfgs in plan.partition_configs().values() for cfg in cfgs})
    default = ProcessGroupCollective()
    try:
        capped: Any = NCCLCappedCollective()
        for sms in caps:
            capped.group_for(sms)
        collective_note = "NCCLCappedCollective (min_ctas = max_ctas = the plan's SM count)"
    except CollectiveUnavailableError as exc:  # the same on every rank (PyTorch's options)
        capped = default
        collective_note = f"UNCAPPED fallback, the plan's SM counts are not applied: {exc}"
        log(f"warning: {collective_note}")

    if args.clocks == "nvml":  # only with --allow-clock-changes (checked in parse_args)
        controller: Any = NVMLFrequencyController(device_indices=[local], gpu=plan.gpu)
    else:
        controller = DryRunFrequencyController(gpu=plan.gpu)
    trigger = StreamOrderedTrigger(controller)
    executor = TorchExecutor(plan=plan, collective=capped, frequency=trigger,
                             default_collective=default)
    baseline = TorchExecutor(collective=capped, default_collective=default)
    # Kernels of every partition type, their communication buffers from the executors'
    # backend (the same one: registered memory if it is OwnKernelCollective).
    progs, full_progs = build_programs(wl, executor.collective, kernels=args.kernels)
    executor.start()  # every rank compares the plan's digest; raises PlanError on a mismatch
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, plan.digest)
    log(f"[{time.perf_counter() - t_begin:.1f}s] {world} ranks, plan {plan.digest[:16]} on "
        f"every rank; {wl.describe()}; {layers} of {wl.layers_per_stage} layers per "
        f"computation; SM caps {caps}; clock requests via {trigger.mechanism} -> "
        f"{type(controller).__name__}")

    def step(schedule: str) -> None:
        run_iteration(schedule, computations=computations, plan_executor=executor,
                      baseline_executor=baseline, progs=progs, full_progs=full_progs,
                      order=order, full_order=full_order)

    times: dict[str, list[float]] = {s: [] for s in args.schedules}
    expected_freqs: list[int] = []
    for it in range(args.warmup + args.steps):  # fixed counts: same collectives on all ranks
        for s in args.schedules:
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(s)
            end.record()
            end.synchronize()
            if s == "kareus":
                expected_freqs += [plan.freq_mhz(c) for c in computations]
            if it >= args.warmup:
                times[s].append(start.elapsed_time(end) / 1e3)
        log(f"[{time.perf_counter() - t_begin:.1f}s] step {it + 1}/{args.warmup + args.steps}"
            f"{' (warm-up)' if it < args.warmup else ''}: " + ", ".join(
                f"{s} {times[s][-1] * 1e3:.1f} ms" for s in args.schedules
                if it >= args.warmup))
    torch.cuda.synchronize()
    trigger.close()
    if args.clocks == "nvml":
        controller.reset()  # give the default clocks back
    fired = list(trigger.fired)
    tokens = [t for t, _, _ in fired]
    freq_info = {
        "controller": type(controller).__name__,
        "mechanism": trigger.mechanism,
        "fallback_reason": trigger.fallback_reason,
        "requests_made": len(expected_freqs),
        "requests_received": len(fired),
        "controller_recorded": sum(1 for r in controller.requests if r.freq_mhz is not None),
        "in_stream_order": tokens == sorted(tokens) and [f for _, f, _ in fired] == expected_freqs,
        "errors": [repr(e) for e in trigger.errors],
        "clocks_changed": args.clocks == "nvml",
    }

    # Gather every rank's step times; an iteration takes as long as its slowest rank.
    mine = {"times": times, "freq": freq_info}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        rows = {}
        for s in args.schedules:
            per_step = [max(r["times"][s][i] for r in every) for i in range(args.steps)]
            rows[s] = {"step_time_s": per_step, "median_s": statistics.median(per_step),
                       "mean_s": statistics.fmean(per_step), "min_s": min(per_step),
                       "max_s": max(per_step),
                       "per_rank_median_s": [statistics.median(r["times"][s]) for r in every]}
        ref = rows.get("megatron", rows[args.schedules[0]])["median_s"]
        print(f"\n{wl.describe()}, {layers} layers per computation, "
              f"{len(computations)} computations per iteration, {args.steps} timed steps")
        print(f"{'schedule':14s} {'median (ms)':>11s} {'mean (ms)':>10s} {'min (ms)':>9s} "
              f"{'max (ms)':>9s} {'vs megatron':>12s}")
        for s, r in rows.items():
            print(f"{s:14s} {r['median_s'] * 1e3:11.2f} {r['mean_s'] * 1e3:10.2f} "
                  f"{r['min_s'] * 1e3:9.2f} {r['max_s'] * 1e3:9.2f} "
                  f"{r['median_s'] / ref:11.3f}x")
        fi = [r["freq"] for r in every]
        print(f"clock requests (dry run, nothing changed): {fi[0]['requests_received']} of "
              f"{fi[0]['requests_made']} per rank received via {fi[0]['mechanism']}, in stream "
              f"order on every rank: {all(f['in_stream_order'] for f in fi)}")
        if args.json is not None:
            data = {
                "what": ("A kareus plan applied inside a training-style loop through "
                         "TorchExecutor's microbatch()/partition() hooks, timed against "
                         "Megatron-style sequential and default nanobatching on the same ops. "
                         "Step = one iteration (every microbatch computation of the 1F1B "
                         "order, fwd and bwd with recomputation) over the first "
                         f"{layers} layers; time per step = CUDA events, slowest rank. "
                         "Megatron and nanobatching use NCCL's own CTA count; kareus uses "
                         "NCCL communicators capped at the plan's SM counts."),
                "machine": f"{world}x {torch.cuda.get_device_name(local)}, NVLink; " + (
                    "clocks not changed; frequency requests recorded by the dry-run "
                    "controller only" if args.clocks == "dry-run"
                    else "SM clocks locked through NVML as the plan asks"),
                "command": "torchrun --standalone --nproc_per_node "
                           f"{world} examples/train_torchrun.py " + " ".join(sys.argv[1:]),
                "software": {"torch": torch.__version__,
                             "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
                "workload": wl.to_dict(),
                "collective": collective_note,
                "kernels": next(iter(progs.values())).state["_kernels"].kernel_names()
                if progs and hasattr(next(iter(progs.values())), "state") else None,
                "layers_run": layers,
                "computations_per_step": [c.key() for c in computations],
                "steps": args.steps, "warmup": args.warmup,
                "plan": {"path": str(args.plan), "digest": plan.digest, "label": plan.label,
                         "emulated_iteration_time_s_all_layers": plan.time_s,
                         "configs": {k: [c.to_dict() if hasattr(c, "to_dict") else str(c)
                                         for c in v]
                                     for k, v in plan.partition_configs().items()},
                         "digests_by_rank": digests},
                "schedules": rows,
                "frequency_requests_by_rank": fi,
                "elapsed_s": time.perf_counter() - t_begin,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=1) + "\n")
            print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
