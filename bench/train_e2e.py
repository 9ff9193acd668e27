"""End to end: a decoder trained under a kareus plan against the schedules it replaces.

Every rank builds its shard of a Llama-shaped decoder from a preset's dimensions (the
library's loop, :mod:`kareus.exec.train`: N layers, random initialisation, cross-entropy
on random tokens, AdamW) and trains it, tensor and context parallel, under three schedules
of the same ops (Megatron-style ``sequential``, default ``nanobatching``, ``kareus`` with
the plan), ``--repeats`` runs of each in an order shuffled from ``--order-seed`` (the same
on every rank), each run from the same initial weights and data. Per run: device-event
time of each iteration (slowest rank per iteration), NVML energy of every GPU (the
step-edge meter, :class:`~kareus.profilers.nvml.EnergyMeter`, summed over ranks) and the loss
after each iteration. Then each partition type's overlap efficiency under the plan and
under default nanobatching: its time over max(computation alone, collective alone).
Clocks are never changed (the plan's clock requests go to a dry-run controller).

Usage (GPUs; TP x CP = GPUs)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 2 bench/train_e2e.py \\
        --plan examples/plans/llama3b_tp2_h200.json --layers 4

    # one GPU, the group stood in for by the loopback collective (a smoke run, not a
    # measurement of TP): the same command with --nproc_per_node 1 --backend loopback

Writes ``bench/results/train_e2e_<machine>.json`` (``--json`` to change): ``machine``,
``systems`` = {"sequential", "nanobatching", "kareus"}, each with ``time_s`` and
``energy_j`` (per iteration, mean over repeats, energy over every GPU) and their spreads
(sample standard deviation over repeats), the runs, the losses and the overlap
efficiencies.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast

DEFAULT_PLAN = _REPO / "examples" / "plans" / "llama3b_tp2_h200.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no torch needed)."""
    from kareus.exec.train import BACKENDS

    ap = argparse.ArgumentParser(prog="train_e2e.py", description=__doc__.split("\n")[0])
    ap.add_argument("--plan", type=Path, default=DEFAULT_PLAN,
                    help="the kareus plan; its workload is the job (default %(default)s)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers to build")
    ap.add_argument("--steps", type=int, default=4, help="timed iterations per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations per run first")
    ap.add_argument("--repeats", type=int, default=3, help="runs per schedule")
    ap.add_argument("--order-seed", type=int, default=0, help="seed of the run order")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    ap.add_argument("--backend", choices=BACKENDS, default="nccl_capped",
                    help="the plan's collectives (loopback: one GPU stands in for the group)")
    ap.add_argument("--loopback", choices=("plain", "faithful"), default="plain",
                    help="with --backend loopback: plain (a kernel of each collective's "
                         "bytes) or faithful (each collective holds its SM count for the real "
                         "collective's time, from the measured collective curves: a "
                         "STAND-IN, said in the output)")
    ap.add_argument("--kernels", default=None, help="kernel set (default: fused on a GPU)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="launch every op eagerly instead of replaying CUDA graphs of each "
                         "microbatch computation (the default on a GPU)")
    ap.add_argument("--comm-priority", choices=("high", "normal"), default="high",
                    help="stream priority of the collectives (high: they take their SMs "
                         "ahead of the overlapped op's pending blocks; normal: measure "
                         "what that changes)")
    ap.add_argument("--overlap-reps", type=int, default=20,
                    help="runs per partition type for the overlap efficiency (0: skip)")
    ap.add_argument("--machine", default=None,
                    help="name in the output file (default: <GPUs>x<gpu>[_loopback])")
    ap.add_argument("--json", type=Path, default=None,
                    help="output (default bench/results/train_e2e_<machine>.json)")
    args = ap.parse_args(argv)
    if min(args.steps, args.repeats, args.layers) < 1 or args.warmup < 0:
        ap.error("--steps, --repeats and --layers must be >= 1, --warmup >= 0")
    return args


def _spread(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def summarise(runs: list[dict[str, Any]], schedules: list[str]) -> dict[str, Any]:
    """Per schedule: mean and spread over repeats of time and energy per iteration.

    ``runs``: every rank's records of one run merged (``step_time_s`` the slowest rank's
    per iteration, ``energy_j`` summed over ranks, ``None`` if a rank had no reading).
    """
    out: dict[str, Any] = {}
    for s in schedules:
        mine = [r for r in runs if r["schedule"] == s]
        times = [statistics.fmean(r["step_time_s"]) for r in mine]
        energies = [r["energy_j"] for r in mine if r["energy_j"] is not None]
        row: dict[str, Any] = {
            "time_s": statistics.fmean(times), "time_s_spread": _spread(times),
            "energy_j": statistics.fmean(energies) if energies else None,
            "energy_j_spread": _spread(energies) if energies else None,
            "repeats": len(mine),
            "time_s_by_repeat": times, "energy_j_by_repeat": energies,
        }
        out[s] = row
    return out


def loss_agreement(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """How far the losses of every run are from each other, step by step."""
    seqs = [r["losses"] for r in runs]
    n = min(len(x) for x in seqs)
    worst = 0.0
    for k in range(n):
        vals = [x[k] for x in seqs]
        ref = max(abs(v) for v in vals) or 1.0
        worst = max(worst, (max(vals) - min(vals)) / ref)
    by_schedule = {}
    for r in runs:
        by_schedule.setdefault(r["schedule"], r["losses"])
    return {"per_step_first_repeat": by_schedule,
            "identical": all(x[:n] == seqs[0][:n] for x in seqs),
            "max_rel_diff": worst}


def _collectives(args: argparse.Namespace, plan: Any, wl: Any, world: int) -> tuple:
    """The groups and collectives of the run: ``(groups, capped, default, named, note,
    loopback, faithful)``."""
    from kareus.exec.train import (
        LoopbackGroups,
        TorchParallelGroups,
        make_collectives,
        named_collectives,
    )

    p = wl.parallelism
    loopback = args.backend == "loopback"
    faithful = loopback and args.loopback == "faithful"
    if args.loopback != "plain" and not loopback:
        raise SystemExit("--loopback faithful goes with --backend loopback (one GPU)")
    times = None
    if faithful:
        from kareus.profilers.collective_times import EmulatedCollectiveTimes

        times = EmulatedCollectiveTimes(plan.gpu)
    if loopback:
        if world != 1:
            raise SystemExit("--backend loopback stands in for the group on ONE GPU: run it "
                             "with --nproc_per_node 1")
        groups: Any = LoopbackGroups(tp=p.tp, cp=p.cp, ep=p.ep)
    else:
        if p.tp * p.cp != world:
            raise SystemExit(f"the plan is for TP={p.tp} x CP={p.cp}: run it on that many GPUs "
                             f"(not {world}), or on one GPU with --backend loopback")
        groups = TorchParallelGroups(tp=p.tp, ep=p.ep)
    caps = tuple(sorted({c.comm_sms for cs in plan.partition_configs().values() for c in cs}))
    high = args.comm_priority == "high"
    mode = "faithful" if faithful else "plain"
    capped, default, note = make_collectives(groups, backend=args.backend, caps=caps,
                                             high_priority=high, loopback=mode, times=times)
    named = named_collectives(groups, {c.backend for cs in plan.partition_configs().values()
                                       for c in cs if c.backend}, caps=caps,
                              high_priority=high, loopback=mode, times=times)
    return groups, capped, default, named, note, loopback, faithful


def main(argv: list[str] | None = None) -> int:  # a linear script
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from kareus.compose.plan import Plan
    from kareus.exec.frequency import DryRunFrequencyController, StreamOrderedTrigger
    from kareus.exec.schedule import DefaultConfig
    from kareus.exec.train import (
        TrainingLoop,
        measure_runs,
        overlap_efficiency,
        shuffled_order,
    )
    from kareus.model.workload import Workload

    t_begin = time.perf_counter()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}", flush=True)

    plan = Plan.load(args.plan)
    wl = Workload.from_dict(dict(plan.workload or {}))
    p = wl.parallelism
    groups, capped, default, named, note, loopback, faithful = _collectives(
        args, plan, wl, world)
    high = args.comm_priority == "high"
    mode = "faithful" if faithful else "plain"
    trigger = StreamOrderedTrigger(DryRunFrequencyController(gpu=plan.gpu))
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan, backends=named,
                        frequency=trigger,
                        layers=args.layers, kernels=args.kernels, seed=args.seed, lr=args.lr,
                        comm_high_priority=high, graphs=not args.no_graphs)
    log(f"{world} rank(s), {wl.describe()}, {loop.layers} layers, "
        f"{loop.model.num_params / 1e6:.0f}M parameters per rank; collectives: {note}")

    meter = None
    meter_note = "NVML EnergyMeter (step-edge reads), this process's GPU by UUID"
    try:
        from kareus.profilers.nvml import EnergyMeter

        meter = EnergyMeter().start()
    except Exception as exc:  # energy is reported as missing
        meter_note = f"no energy: {type(exc).__name__}: {exc}"
        log(meter_note)

    order = shuffled_order(list(loop.schedules), args.repeats, args.order_seed)
    log("order: " + ", ".join(f"{s}#{r}" for s, r in order))
    # One untimed iteration of each schedule first: kernel compilation and autotuning.
    for s in loop.schedules:
        loop.reset()
        loop.step(s)
    torch.cuda.synchronize()
    log("compiled and warmed up")
    records = measure_runs(loop, order, steps=args.steps, warmup=args.warmup, meter=meter,
                           barrier=dist.barrier, log=log)

    configs_k = {t: cs[0] for t, cs in plan.partition_configs().items() if t in loop.types}
    configs_n = {t: DefaultConfig(loop.types[t].op_names[0]) for t in configs_k}
    overlap: dict[str, Any] = {}
    if args.overlap_reps > 0:
        assert loop.executor is not None
        overlap["kareus"] = overlap_efficiency(wl, executor=loop.executor, configs=configs_k,
                                               kernels=args.kernels, reps=args.overlap_reps)
        overlap["nanobatching"] = overlap_efficiency(
            wl, executor=loop.baseline, configs=configs_n, kernels=args.kernels,
            reps=args.overlap_reps)
    trigger.close()
    if meter is not None:
        meter.stop()

    every: list[Any] = [None] * world
    dist.all_gather_object(every, {"runs": [r.to_dict() for r in records],
                                   "overlap": overlap,
                                   "fired": len(trigger.fired),
                                   "gpu": torch.cuda.get_device_name(local)})
    if rank == 0:
        runs = []
        for k, (s, r) in enumerate(order):
            per = [e["runs"][k] for e in every]
            energies = [x["energy_j"] for x in per]
            runs.append({
                "schedule": s, "repeat": r,
                "step_time_s": [max(x["step_time_s"][i] for x in per)
                                for i in range(args.steps)],
                "energy_j": None if any(e is None for e in energies) else sum(energies),
                "energy_j_by_rank": energies,
                "counter_steps_by_rank": [x["counter_steps"] for x in per],
                "window_s": max(x["window_s"] for x in per),
                "losses": per[0]["losses"],
            })
        systems = summarise(runs, list(loop.schedules))
        gpu = every[0]["gpu"]
        short = "h200" if "H200" in gpu else gpu.replace("NVIDIA ", "").replace(" ", "").lower()
        machine = args.machine or f"{world}x{short}" + (
            "_loopback_faithful" if faithful else "_loopback" if loopback else "")
        driver = None
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        except Exception:  # recorded as unknown
            pass
        ref = systems["nanobatching"]
        print(f"\n{wl.describe()}, {loop.layers} layers, {args.steps} timed iterations x "
              f"{args.repeats} repeats per schedule" +
              (" -- STAND-IN: time-faithful loopback on one GPU, not a TP measurement"
               if faithful else
               " -- ONE-GPU LOOPBACK SMOKE RUN, not a TP measurement" if loopback else ""))
        print(f"{'schedule':13s} {'time (ms)':>10s} {'+-':>6s} {'energy (J)':>11s} {'+-':>6s} "
              f"{'time vs nb':>10s} {'energy vs nb':>12s}")
        for s, row in systems.items():
            e = row["energy_j"]
            print(f"{s:13s} {1e3 * row['time_s']:10.2f} {1e3 * row['time_s_spread']:6.2f} "
                  + (f"{e:11.1f} {row['energy_j_spread']:6.1f} " if e is not None
                     else f"{'-':>11s} {'-':>6s} ")
                  + f"{row['time_s'] / ref['time_s']:10.3f}" +
                  (f" {e / ref['energy_j']:12.3f}" if e is not None and ref["energy_j"]
                   else ""))
        agree = loss_agreement(runs)
        print(f"losses identical in every run: {agree['identical']}; largest relative "
              f"difference between runs at one step: {agree['max_rel_diff']:.2e}")
        for sys_name, rows in overlap.items():
            print(f"overlap efficiency ({sys_name}): " + ", ".join(
                f"{t} {v['efficiency']:.3f}" for t, v in rows.items()))
        out = args.json or (_REPO / "bench" / "results" / f"train_e2e_{machine}.json")
        data = {
            "what": ("The library's training loop (kareus.exec.train): a Llama-shaped decoder "
                     "trained under three schedules of the same ops; time per iteration = "
                     "device events, slowest rank; energy per iteration = NVML step-edge "
                     "average power x window / iterations, summed over every GPU; spreads = "
                     "sample standard deviation over the repeats."),
            "machine": machine,
            "hardware": f"{world}x {gpu}",
            "comm_priority": args.comm_priority,
            "loopback": loopback,
            "loopback_mode": mode if loopback else None,
            "note": (f"STAND-IN (time-faithful loopback): one GPU runs one rank's shard of a "
                     f"TP={p.tp} x CP={p.cp} job; each collective holds its SM count for the "
                     "real collective's time (see collectives) while computing the "
                     "loopback's data; no link traffic. Not a TP measurement." if faithful
                     else "ONE-GPU LOOPBACK SMOKE RUN: one GPU runs one rank's shard of a "
                     f"TP={p.tp} x CP={p.cp} job and stands in for the rest of the group "
                     "(each collective a real kernel of its bytes on the side stream, no "
                     "link traffic, SM caps not applied). It checks the loop, schedules, "
                     "meter and JSON end to end; its times and energies are NOT a TP "
                     "measurement." if loopback else "measured on the GPUs named"),
            "command": (f"torchrun --standalone --nproc_per_node {world} bench/train_e2e.py "
                        + " ".join(sys.argv[1:])),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "software": {"torch": torch.__version__, "cuda": torch.version.cuda,
                         "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                         "driver": driver},
            "clocks": "not changed; the plan's clock requests were recorded by a dry-run "
                      f"controller ({every[0]['fired']} requests reached it on rank 0)",
            "workload": wl.to_dict(), "layers": loop.layers,
            "parameters_per_rank": loop.model.num_params,
            "kernels": loop.model.ks.kernel_names(),
            "collectives": note, "energy_meter": meter_note,
            "plan": {"path": str(args.plan.relative_to(_REPO)
                                 if args.plan.is_relative_to(_REPO) else args.plan),
                     "digest": plan.digest, "label": plan.label,
                     "configs": {t: [c.to_dict() for c in cs]
                                 for t, cs in plan.partition_configs().items()}},
            "order": [f"{s}#{r}" for s, r in order], "order_seed": args.order_seed,
            "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "systems": systems,
            "loss": agree,
            "overlap_efficiency": overlap,
            "overlap_efficiency_definition": (
                "per partition type at the workload's nanobatch shapes: time of ops and "
                "collective under the configuration / max(ops alone, collective alone); "
                "1.0 is the limit"),
            "runs": runs,
            "elapsed_s": time.perf_counter() - t_begin,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
