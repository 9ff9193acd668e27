"""Train with a kareus plan (one process per GPU, torchrun): a thin script over the library.

A plan fixes, for every microbatch computation of an iteration, a GPU clock and, for
every partition type, how many SMs its collective gets and which op it launches with.
The library's training loop (:mod:`kareus.exec.train`) applies it to a Llama-shaped
decoder built from the plan's model (random weights, cross-entropy on random tokens,
AdamW; tensor and context parallel), and runs the same model under the schedules the
plan replaces::

    # 1. make the plan (CPU, emulated GPU) -- or use the committed one
    python examples/train_torchrun.py --make-plan --plan examples/plans/llama3b_tp2_h200.json

    # 2. train with it (one process per GPU: TP x CP of the plan's workload)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 2 examples/train_torchrun.py \\
        --plan examples/plans/llama3b_tp2_h200.json --layers 4 --steps 10

Each rank builds its shard (:class:`~kareus.exec.train.TrainingLoop`), opens
:class:`~kareus.exec.executor.TorchExecutor` with SM-capped collectives (NCCL
communicators capped at the plan's SM counts, or ``--backend own`` for kareus's own
kernels on registered buffers), compares the plan's digest with every rank, and trains
``--steps`` iterations under each schedule from the same initial weights: ``kareus``
(the plan: each collective at its slot with its SM count, the clock requested per
microbatch computation in stream order, recorded by a dry-run controller unless
``--nvml-clocks --allow-clock-changes``), ``sequential`` (Megatron-style) and
``nanobatching`` (default overlap). It prints time per iteration and the loss of each.
``bench/train_e2e.py`` measures the same with repeats and energy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:  # run from a checkout without installing kareus
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast (NVLS)

DEFAULT_PLAN = _REPO / "examples" / "plans" / "llama3b_tp2_h200.json"
SCHEDULES = ("kareus", "sequential", "nanobatching")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line (no torch needed)."""
    ap = argparse.ArgumentParser(
        prog="train_torchrun.py",
        description="Train with a kareus plan (run with torchrun), or make the plan "
                    "(--make-plan, CPU).")
    ap.add_argument("--plan", type=Path, default=DEFAULT_PLAN,
                    help="plan JSON to run (or to write with --make-plan); default %(default)s")
    ap.add_argument("--steps", type=int, default=10, help="timed iterations per schedule")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations per schedule")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer layers to build (default: the model's)")
    ap.add_argument("--schedules", default=",".join(SCHEDULES),
                    help="schedules to run, in this order (default %(default)s)")
    ap.add_argument("--backend", choices=("nccl_capped", "own", "loopback"),
                    default="nccl_capped",
                    help="the plan's collectives (loopback: one GPU stands in for the group)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="launch every op eagerly instead of replaying CUDA graphs of each "
                         "microbatch computation (the default on a GPU)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (rank 0)")
    ap.add_argument("--kernels", default="auto",
                    help="the ops' kernel set (kareus.exec.kernels): triton (fused, the "
                         "default on a GPU), torch, reference")
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
    mk.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    mk.add_argument("--cp", type=int, default=1, help="context-parallel degree")
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


def make_plan(args: argparse.Namespace) -> Any:
    """Search and compose on the emulated GPU; save the chosen kareus plan to ``args.plan``."""
    from kareus.model.workload import Workload
    from kareus.workflow import optimize

    wl = Workload.preset(args.model, tp=args.tp, cp=args.cp,
                         microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                         nanobatches=args.nanobatches, num_microbatches=args.microbatches)
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
    """The plan at ``path`` and its workload (``PlanError`` for a bad file or a plan the
    loop cannot run: more than one pipeline stage, or no recorded workload)."""
    from kareus.compose.plan import Plan
    from kareus.errors import PlanError
    from kareus.exec.train import check_plan_workload
    from kareus.model.workload import Workload

    plan = Plan.load(path)
    if not plan.workload:
        raise PlanError(f"{path}: the plan does not record its workload")
    wl = Workload.from_dict(dict(plan.workload))
    check_plan_workload(plan, wl)
    return plan, wl


def main(argv: list[str] | None = None) -> int:
    """Train under each schedule; print (and with ``--json`` write) times and losses."""
    args = parse_args(argv)
    if args.make_plan:
        make_plan(args)
        return 0

    import torch
    import torch.distributed as dist

    from kareus.exec.frequency import (
        DryRunFrequencyController,
        NVMLFrequencyController,
        StreamOrderedTrigger,
    )
    from kareus.exec.train import (
        LoopbackGroups,
        TorchParallelGroups,
        TrainingLoop,
        make_collectives,
        measure_runs,
        named_collectives,
    )

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    plan, wl = load_plan(args.plan)
    p = wl.parallelism
    if args.backend == "loopback":
        if world != 1:
            raise SystemExit("--backend loopback runs on one GPU (--nproc_per_node 1)")
        groups: Any = LoopbackGroups(tp=p.tp, cp=p.cp, ep=p.ep)
    elif p.tp * p.cp != world:
        raise SystemExit(f"the plan is for TP={p.tp} x CP={p.cp}; run it with that many "
                         f"processes, not {world}")
    else:
        groups = TorchParallelGroups(tp=p.tp, ep=p.ep)
    caps = tuple(sorted({c.comm_sms for cs in plan.partition_configs().values() for c in cs}))
    capped, default, note = make_collectives(groups, backend=args.backend, caps=caps)
    named = named_collectives(groups, {c.backend for cs in plan.partition_configs().values()
                                       for c in cs if c.backend}, caps=caps)
    controller: Any = (NVMLFrequencyController(gpu=plan.gpu) if args.clocks == "nvml"
                       else DryRunFrequencyController(gpu=plan.gpu))
    trigger = StreamOrderedTrigger(controller)
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan, backends=named,
                        frequency=trigger,
                        layers=args.layers, graphs=not args.no_graphs,
                        kernels=None if args.kernels == "auto" else args.kernels)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{world} rank(s): {wl.describe()}, {loop.layers} layers; collectives: {note}; "
        f"plan {plan.digest[:16]} on every rank")
    records = measure_runs(loop, [(s, 0) for s in args.schedules], steps=args.steps,
                           warmup=args.warmup, barrier=dist.barrier, log=say)
    trigger.close()
    if args.clocks == "nvml":
        controller.reset()  # give the default clocks back
    every: list[Any] = [None] * world
    dist.all_gather_object(every, [r.to_dict() for r in records])
    if rank == 0:
        rows = {}
        for k, s in enumerate(args.schedules):
            per_step = [max(e[k]["step_time_s"][i] for e in every) for i in range(args.steps)]
            rows[s] = {"median_s": statistics.median(per_step), "step_time_s": per_step,
                       "losses": every[0][k]["losses"]}
        print(f"\n{'schedule':13s} {'median (ms)':>11s} {'first loss':>10s} {'last loss':>10s}")
        for s, r in rows.items():
            print(f"{s:13s} {1e3 * r['median_s']:11.2f} {r['losses'][0]:10.4f} "
                  f"{r['losses'][-1]:10.4f}")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "command": "torchrun --nproc_per_node "
                           f"{world} examples/train_torchrun.py " + " ".join(sys.argv[1:]),
                "hardware": f"{world}x {torch.cuda.get_device_name(local)}",
                "workload": wl.to_dict(), "layers": loop.layers, "collectives": note,
                "plan": {"path": str(args.plan), "digest": plan.digest},
                "frequency_requests_received": len(trigger.fired),
                "schedules": rows}, indent=1) + "\n")
            print(f"wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
