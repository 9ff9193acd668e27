"""Measured study on H200 GPUs (NVLink): Llama 3.2 3B fwd_attn / fwd_mlp at TP = GPUs.

Run with one process per GPU (4 for the TP=4 study, ``--tp 2`` on two GPUs), at the
GPUs' default clocks (this script never changes clocks, power limits or any other GPU
setting)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 4 bench/h200_study.py --json out/study.json

``--analyze FILE`` (CPU, no torch) replays the search on a measured grid with
``ReplayProfiler`` and prints the comparison with the baselines (docs/results.md).

What it does, on every rank in lockstep:

1. measures static power (GPUs blocked in a late receive) and idle power;
2. per partition type (microbatch 8, sequence 4096, 2 nanobatches): the baselines
   (Megatron-style sequential on the whole microbatch with NCCL's own CTA count;
   sequential per nanobatch; default nanobatching = launched with the first op,
   NCCL's own CTAs), then the whole grid of SM counts x launch slots (+ sequential),
   with repeated measurements of one configuration interleaved to check the spread;
3. ``MultiPassSearch`` with a budget on the same partitions, measured live (rank 0
   runs the search and broadcasts each configuration; the others follow).

Rank 0 prints a table and writes every measurement as JSON (``--json``). Energy is the
sum over the GPUs of the tensor-parallel group; time is per run of the partition.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # never NVLink multicast

WORKLOAD = dict(model="llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096, nanobatches=2)
DEFAULT_FREQ_MHZ = 1980  # default clocks: not locked; the hardware lowers them under its cap


@attrs.frozen
class DefaultCTAConfig:
    """A configuration whose collective uses NCCL's own CTA count (baselines)."""

    freq_mhz: int
    launch_slot: str | None
    comm_sms: None = None

    @property
    def sequential(self) -> bool:
        return self.launch_slot is None

    def to_dict(self) -> dict[str, Any]:
        return {"freq_mhz": self.freq_mhz, "comm_sms": None, "launch_slot": self.launch_slot}


def main() -> int:  # noqa: C901 - a linear script
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--sms", default="2,4,8,16,24,32", help="SM counts of the grid")
    ap.add_argument("--comm-priority", choices=("high", "normal"), default="high",
                    help="stream priority of the capped collectives (the grids in data/ of "
                         "2026-11/12 predate this option: normal)")
    ap.add_argument("--partitions", default="fwd_attn,fwd_mlp")
    ap.add_argument("--slots", default=None, help="restrict slots (comma list), default all")
    ap.add_argument("--search-budget", type=int, default=10)
    ap.add_argument("--search-batch", type=int, default=5)
    ap.add_argument("--repeat-every", type=int, default=8,
                    help="re-measure the check configuration every N grid configurations")
    ap.add_argument("--extra-repeats", type=int, default=0,
                    help="back-to-back repeats of the check configuration before the grid")
    ap.add_argument("--time-limit-s", type=float, default=175.0,
                    help="stop starting new measurements after this long")
    ap.add_argument("--warmup-s", type=float, default=0.4)
    ap.add_argument("--window-steps", type=int, default=6)
    ap.add_argument("--sub-windows", type=int, default=3)
    ap.add_argument("--max-runs", type=int, default=1)
    ap.add_argument("--max-cooldown-s", type=float, default=1.0)
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--tp", type=int, default=4, help="tensor-parallel degree = GPUs")
    ap.add_argument("--analyze", type=Path, default=None,
                    help="CPU only: analyse a measured grid file (replayed search, baselines)")
    ap.add_argument("--budgets", default="10,16", help="replayed search budgets (--analyze)")
    ap.add_argument("--seeds", type=int, default=5, help="replayed search seeds (--analyze)")
    ap.add_argument("--surrogates", default="gp",
                    help="replayed searches' surrogates, comma list of gp (the default) and "
                         "trees (the XGBoost ensemble) (--analyze)")
    args = ap.parse_args()
    if args.analyze is not None:
        result = analyze(args.analyze, budgets=[int(b) for b in args.budgets.split(",")],
                         seeds=args.seeds, surrogates=args.surrogates.split(","))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        return 0

    import pynvml
    import torch
    import torch.distributed as dist

    from kareus.errors import HardwareError
    from kareus.exec.collectives import NCCLCappedCollective
    from kareus.exec.executor import ProcessGroupCollective, TorchExecutor
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.config import ConfigSpace, ScheduleConfig
    from kareus.model.workload import Workload
    from kareus.profilers.nvml import (
        EnergyMeter,
        NVMLProfiler,
        TorchDistributedCoordinator,
        TorchPartitionRunner,
    )

    t_begin = time.perf_counter()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    w = dict(WORKLOAD)
    w.pop("tp")
    wl = Workload.preset(w.pop("model"), tp=args.tp, **w)
    names = args.partitions.split(",")
    parts = runnable_partitions(wl, names)
    full = runnable_partitions(wl.with_(nanobatches=1), names)  # Megatron: no split
    sms_grid = [int(s) for s in args.sms.split(",")]

    capped = NCCLCappedCollective(high_priority=args.comm_priority == "high")
    for s in sms_grid:  # create every capped communicator up front (collective)
        capped.group_for(s)
    executor = TorchExecutor(collective=capped, default_collective=ProcessGroupCollective(),
                             comm_high_priority=args.comm_priority == "high")
    runner = TorchPartitionRunner(executor, seed=1234)
    pynvml.nvmlInit()
    meter = EnergyMeter()  # this process's GPU, found in NVML by its UUID
    coord = TorchDistributedCoordinator()
    prof = NVMLProfiler(gpu="h200-sxm", runner=runner, meter=meter, coordinator=coord,
                        warmup_s=args.warmup_s, window_steps=args.window_steps,
                        max_cooldown_s=args.max_cooldown_s, max_runs=args.max_runs,
                        sub_windows=args.sub_windows)
    prof.start()
    log(f"[{time.perf_counter() - t_begin:.1f}s] counter step {prof.step_period_s * 1e3:.1f} ms;"
        f" static (blocked) {prof.blocked_power_w} W, idle {prof.idle_power_w:.1f} W (group)")

    rows: list[dict[str, Any]] = []
    stopped = {"flag": False}

    def time_left() -> bool:
        ok = time.perf_counter() - t_begin < args.time_limit_s
        flag = coord.broadcast([1.0 if ok else 0.0])[0] > 0
        stopped["flag"] = stopped["flag"] or not flag
        return flag

    def measure(kind: str, part: Any, cfg: Any, **extra: Any) -> dict[str, Any] | None:
        try:
            rec = prof.measure_record(part, cfg)
        except HardwareError as exc:  # raised on every rank together (a group decision)
            log(f"  {kind} {part.name} {cfg}: FAILED {exc}")
            rows.append({"kind": kind + "_failed", "partition": part.name,
                         "config": cfg.to_dict(), "error": str(exc)})
            return None
        row = {"kind": kind, **rec.to_dict(), **extra}
        rows.append(row)
        m = rec.measurement
        log(f"  {kind:9s} {part.name:9s} sms={str(cfg.comm_sms):>4s} "
            f"slot={str(cfg.launch_slot):10s} {m.time_s * 1e3:8.3f} ms {m.energy_j:8.3f} J "
            f"P={rec.power_w:5.0f}W cv={rec.subwindow_cv:.3f} "
            f"clk={rec.sm_clock_mhz or 0:4.0f} cool={rec.cooldown_s:.2f} wall={rec.wall_s:.2f}")
        return row

    def dump() -> None:
        if rank != 0 or args.json is None:
            return
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "what": ("Measured grid of schedule configurations, Llama 3.2 3B fwd_attn and fwd_mlp "
                     f"partitions at TP={args.tp} (microbatch 8, sequence 4096, 2 nanobatches), "
                     f"bf16, on {args.tp}x NVIDIA H200 SXM (NVLink), default clocks (not locked; the GPUs lower "
                     "their own SM clock under the 700 W limit). Energy: NVML total-energy "
                     f"counter summed over the {args.tp} GPUs, read at counter step edges; "
                     "energy and time per run from the runs completed between the first and "
                     "last counter step of the measured span (CUDA events per run) (one nanobatch's computation + the "
                     "previous nanobatch's all-reduce). comm_sms = NCCL min_ctas = max_ctas; "
                     "null = NCCL's own choice. launch_slot null = sequential."),
            "machine": f"{args.tp}x NVIDIA H200 SXM 141GB, NVLink",
            "comm_priority": args.comm_priority,
            "software": {"torch": torch.__version__,
                         "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                         "driver": pynvml.nvmlSystemGetDriverVersion()},
            "command": f"torchrun --standalone --nproc_per_node {args.tp} bench/h200_study.py "
                       + " ".join(sys.argv[1:]),
            "workload": wl.to_dict(),
            "gpu": "h200-sxm",
            "freq_mhz": DEFAULT_FREQ_MHZ,
            "counter_step_s": prof.step_period_s,
            "static_power_w": prof.static_power_w(),
            "blocked_power_w": prof.blocked_power_w,
            "idle_power_w": prof.idle_power_w,
            "profiler": {"warmup_s": prof.warmup_s, "window_steps": prof.window_steps,
                         "sub_windows": prof.sub_windows, "target_cv": prof.target_cv,
                         "max_runs": prof.max_runs, "max_cooldown_s": prof.max_cooldown_s,
                         "cooldown_tolerance_c": prof.cooldown_tolerance_c,
                         "baseline_temp_c": prof.baseline_temp_c},
            "grid": {"comm_sms": sms_grid,
                     "partitions": {n: {"ops": [o.name for o in parts[n].compute_ops],
                                        "slots": [s.name for s in parts[n].slots]}
                                    for n in names}},
            "elapsed_s": time.perf_counter() - t_begin,
            "stopped_early": stopped["flag"],
            "measurements": rows,
        }
        args.json.write_text(json.dumps(data, indent=1))

    # Pre-heat with the default-nanobatching configuration, then take the working
    # temperature as the cool-down baseline.
    first = parts[names[0]]
    check = {n: DefaultCTAConfig(DEFAULT_FREQ_MHZ, parts[n].slots[0].name) for n in names}
    try:
        prof.preheat(first, check[names[0]])
    except HardwareError as exc:
        log(f"pre-heat measurement failed: {exc}")
        prof.baseline_temp_c = max(meter.temperatures_c())
    log(f"[{time.perf_counter() - t_begin:.1f}s] pre-heated; baseline temperature "
        f"{prof.baseline_temp_c:.0f} C (rank 0)")

    slot_filter = None if args.slots is None else args.slots.split(",")
    for n in names:
        p = parts[n]
        log(f"[{time.perf_counter() - t_begin:.1f}s] partition {p!r}")
        if not time_left():
            break
        measure("megatron", full[n], DefaultCTAConfig(DEFAULT_FREQ_MHZ, None),
                note="whole microbatch, no nanobatching; compare with 2 runs of the partition")
        measure("seq_default", p, DefaultCTAConfig(DEFAULT_FREQ_MHZ, None))
        measure("nanobatch", p, check[n])
        for _ in range(args.extra_repeats):
            measure("repeat", p, check[n])
        slots = [s.name for s in p.slots if slot_filter is None or s.name in slot_filter]
        grid = [ScheduleConfig(DEFAULT_FREQ_MHZ, s, slot) for s in sms_grid
                for slot in [*slots, None]]
        for i, cfg in enumerate(grid):
            if not time_left():
                break
            measure("grid", p, cfg)
            if args.repeat_every and (i + 1) % args.repeat_every == 0:
                measure("repeat", p, check[n])
        dump()

    # Live search with a budget on the same partitions (rank 0 decides, others follow).
    search_info: dict[str, Any] = {}
    have_search = 1.0
    if rank == 0 and not args.no_search:
        # The default surrogate (a Gaussian process) needs numpy and scipy only; xgboost
        # is needed by the tree ensemble alone, which this live search does not use.
        try:
            from kareus.search import MultiPassSearch
        except Exception as exc:
            log(f"search not available here: {exc}")
            have_search = 0.0
    if args.no_search:
        have_search = 0.0
    have_search = coord.broadcast([have_search])[0]
    if have_search > 0 and not stopped["flag"]:
        for n in names:
            p = parts[n]
            space = ConfigSpace(p, "h200-sxm", freqs_mhz=[DEFAULT_FREQ_MHZ], comm_sms=sms_grid,
                                slots=[s.name for s in p.slots
                                       if slot_filter is None or s.name in slot_filter])
            configs = space.configs
            if rank == 0:
                from kareus.model.measurement import Measurement
                from kareus.search import MultiPassSearch

                released = {"done": False}

                def release() -> None:
                    if not released["done"]:  # noqa: B023 - used within the iteration
                        coord.broadcast([0.0, -1.0])
                        released["done"] = True  # noqa: B023

                class Leader:
                    def measure(self, part: Any, cfg: ScheduleConfig) -> Measurement:
                        if time.perf_counter() - t_begin > args.time_limit_s + 90:
                            release()
                            raise TimeoutError("study time limit reached during the search")
                        coord.broadcast([1.0, float(configs.index(cfg))])  # noqa: B023
                        row = measure("search", part, cfg)
                        if row is None:
                            release()
                            raise HardwareError(f"measurement of {cfg} failed")
                        return Measurement.from_dict(row["measurement"])

                search = MultiPassSearch(space, budget=args.search_budget,
                                         batch_size=args.search_batch, seed=0,
                                         stop_patience=None, progress=False)
                t0 = time.perf_counter()
                try:
                    front = search.run(Leader(), p)
                    search_info[n] = {
                        "budget": args.search_budget, "batch_size": args.search_batch,
                        "measured": len(front.measured()),
                        "front": [o.to_dict() for o in front.points],
                        "wall_s": time.perf_counter() - t0}
                except Exception as exc:  # keep the followers in step
                    search_info[n] = {"stopped": f"{type(exc).__name__}: {exc}"}
                    log(f"search of {n} stopped: {exc}")
                release()
            else:
                while True:
                    cmd, idx = coord.broadcast([0.0, 0.0])
                    if cmd == 0.0:
                        break
                    measure("search", p, configs[int(idx)])
    if rank == 0 and args.json is not None:
        dump()
        data = json.loads(args.json.read_text())
        data["search"] = search_info
        args.json.write_text(json.dumps(data, indent=1))
    summarize(rows, names, log)
    log(f"[{time.perf_counter() - t_begin:.1f}s] done")
    prof.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def summarize(rows: list[dict[str, Any]], names: list[str], log: Any) -> None:
    """Print the headline table (rank 0)."""
    for n in names:
        mine = [r for r in rows if r["partition"] == n]
        if not mine:
            continue
        mine = [r for r in mine if "measurement" in r]
        grid = [r for r in mine if r["kind"] == "grid"]
        reps = [r["measurement"]["energy_j"] for r in mine if r["kind"] in ("nanobatch", "repeat")]
        rep_t = [r["measurement"]["time_s"] for r in mine if r["kind"] in ("nanobatch", "repeat")]
        base = {r["kind"]: r["measurement"] for r in mine
                if r["kind"] in ("megatron", "seq_default", "nanobatch")}
        log(f"== {n}: {len(grid)} grid configs; mean wall per candidate "
            f"{statistics.fmean(r['wall_s'] for r in mine):.2f} s")
        if len(reps) > 1:
            log(f"   repeat check ({len(reps)}x default nanobatching): energy cv "
                f"{statistics.pstdev(reps) / statistics.fmean(reps) * 100:.2f}%, time cv "
                f"{statistics.pstdev(rep_t) / statistics.fmean(rep_t) * 100:.2f}%")
        if not grid:
            continue
        e_opt = min(grid, key=lambda r: r["measurement"]["energy_j"])
        t_opt = min(grid, key=lambda r: r["measurement"]["time_s"])
        for label, r in (("energy-optimal", e_opt), ("time-optimal", t_opt)):
            m = r["measurement"]
            line = f"   {label:15s} {r['config']} {m['time_s'] * 1e3:.3f} ms {m['energy_j']:.3f} J"
            for bk in ("megatron", "seq_default", "nanobatch"):
                if bk in base:
                    # Megatron runs the whole microbatch at once: compare 2 nanobatch runs.
                    k = 2.0 if bk == "megatron" else 1.0
                    b = base[bk]
                    de = (1 - k * m["energy_j"] / b["energy_j"]) * 100
                    dt = (1 - k * m["time_s"] / b["time_s"]) * 100
                    line += f" | vs {bk}: E {de:+.1f}%, T {dt:+.1f}% lower"
            log(line)


def _pct_lower(x: float, base: float) -> float:
    return (1.0 - x / base) * 100.0


def analyze(path: Path, *, budgets: list[int], seeds: int,  # noqa: C901 - one linear replay-and-compare report, a branch per optional section
            surrogates: list[str] | None = None) -> dict[str, Any]:
    """Replay the search on a measured grid (CPU) and compare with the baselines.

    ``surrogates``: ``"gp"`` (kareus's default) and/or ``"trees"`` (the XGBoost ensemble);
    the first one's replays are ``replayed_search``, all of them
    ``replayed_search_by_surrogate``.
    """
    import numpy as np

    from kareus.model.partition import build_partitions
    from kareus.model.workload import Workload
    from kareus.profilers.replay import ReplayProfiler
    from kareus.search import SURROGATES, MultiPassSearch
    from kareus.search.pareto import hypervolume, pareto_front, reference_point

    surrogates = surrogates or ["gp"]
    unknown = set(surrogates) - set(SURROGATES)
    if unknown:
        raise SystemExit(f"--surrogates takes gp and trees, got {sorted(unknown)}")

    data = json.loads(Path(path).read_text())
    w = data["workload"]
    wl = Workload.preset(w["model"], tp=w["tp"], cp=w.get("cp", 1),
                         microbatch_size=w["microbatch_size"], seq_len=w["seq_len"],
                         nanobatches=w["nanobatches"])
    ps = build_partitions(wl)
    grid = ReplayProfiler(data, kinds=("grid",), samples="mean")
    out: dict[str, Any] = {"source": str(path), "machine": data.get("machine"),
                           "command": "python bench/h200_study.py --analyze "
                                      + " ".join(sys.argv[2:]),
                           "measured_with": data.get("command"),
                           "static_power_w": data["static_power_w"], "partitions": {}}
    print(f"{data.get('machine')}: {wl.describe()}; static power {data['static_power_w']:.0f} W "
          "(group, measured)")
    for name in grid.partitions:
        part = ps[name]
        space = grid.space(part)
        pts = np.array([(grid.measure(part, c).time_s, grid.measure(part, c).energy_j)
                        for c in space.configs])
        front = pareto_front(pts)
        refs = {"wide": reference_point(pts, 0.1), "front": reference_point(front, 0.1)}
        hv_exh = {k: hypervolume(front, r) for k, r in refs.items()}
        rows = [r for r in data["measurements"] if r["partition"] == name and "measurement" in r]
        res: dict[str, Any] = {"space": repr(space), "configs": len(space),
                               "exhaustive_front": front.tolist(),
                               "reference_points": {k: v.tolist() for k, v in refs.items()}}
        # Repeats of one configuration (default nanobatching), interleaved through the run.
        reps = [r["measurement"] for r in rows if r["kind"] in ("nanobatch", "repeat")]
        if len(reps) > 1:
            e = [m["energy_j"] for m in reps]
            t = [m["time_s"] for m in reps]
            res["repeat_check"] = {"n": len(reps),
                                   "energy_cv": statistics.pstdev(e) / statistics.fmean(e),
                                   "time_cv": statistics.pstdev(t) / statistics.fmean(t)}
        walls = [r["wall_s"] for r in rows if "wall_s" in r]
        res["mean_wall_s_per_candidate"] = statistics.fmean(walls) if walls else None
        # Optimal schedules against the baselines.
        best_e = min(space.configs, key=lambda c: grid.measure(part, c).energy_j)
        best_t = min(space.configs, key=lambda c: grid.measure(part, c).time_s)
        base = {}
        for kind, factor in (("megatron", 0.5), ("seq_default", 1.0), ("nanobatch", 1.0)):
            try:
                b = grid.baseline(name, kind)
            except KeyError:
                continue
            if kind == "nanobatch":
                ms = grid.baselines.get((name, "nanobatch"), []) + \
                    grid.baselines.get((name, "repeat"), [])
                b = type(b)(time_s=statistics.fmean(m.time_s for m in ms),
                            energy_j=statistics.fmean(m.energy_j for m in ms),
                            static_power_w=b.static_power_w)
            # Megatron runs the whole microbatch: half of it compares with one partition run.
            base[kind] = (b.time_s * factor, b.energy_j * factor)
        res["baselines_per_partition_run"] = {k: {"time_s": v[0], "energy_j": v[1]}
                                              for k, v in base.items()}
        for label, cfg in (("energy_optimal", best_e), ("time_optimal", best_t)):
            m = grid.measure(part, cfg)
            entry: dict[str, Any] = {"config": cfg.to_dict(), "time_s": m.time_s,
                                     "energy_j": m.energy_j}
            for k, (bt, be) in base.items():
                entry[f"vs_{k}"] = {"energy_pct_lower": _pct_lower(m.energy_j, be),
                                    "time_pct_lower": _pct_lower(m.time_s, bt)}
            res[label] = entry
        # The search, replayed on the measured grid (each configuration's grid sample).
        res["replayed_search_by_surrogate"] = {}
        for sname in surrogates:
            by_budget: dict[str, Any] = {}
            for budget in budgets:
                ratios: dict[str, list[float]] = {k: [] for k in refs}
                for seed in range(seeds):
                    replay = ReplayProfiler(data, kinds=("grid",), samples="mean")
                    # The default search (design size, batches) at this budget.
                    search = MultiPassSearch(space, budget=budget, seed=seed,
                                             stop_patience=None, progress=False,
                                             surrogate=SURROGATES[sname](seed))
                    fr = search.run(replay, part)
                    got = np.array([(o.time_s, o.energy_j) for o in fr.points])
                    for k, r in refs.items():
                        ratios[k].append(hypervolume(got, r) / hv_exh[k])
                by_budget[str(budget)] = {
                    k: {"mean": statistics.fmean(v), "min": min(v)} for k, v in ratios.items()}
            res["replayed_search_by_surrogate"][sname] = by_budget
        res["replayed_search"] = res["replayed_search_by_surrogate"][surrogates[0]]
        live = data.get("search", {}).get(name, {})
        if "front" in live:
            got = np.array([(o["measurement"]["time_s"], o["measurement"]["energy_j"])
                            for o in live["front"]])
            res["live_search"] = {"budget": live["budget"], "measured": live["measured"],
                                  **{f"hv_ratio_{k}": hypervolume(got, r) / hv_exh[k]
                                     for k, r in refs.items()}}
        out["partitions"][name] = res
        # Table.
        print(f"== {name}: {len(space)} configurations measured "
              f"(mean {res['mean_wall_s_per_candidate'] or 0:.2f} s per candidate)")
        if "repeat_check" in res:
            rc = res["repeat_check"]
            print(f"   repeat check, {rc['n']}x default nanobatching: energy cv "
                  f"{rc['energy_cv'] * 100:.2f}%, time cv {rc['time_cv'] * 100:.2f}%")
        for label in ("energy_optimal", "time_optimal"):
            e = res[label]
            line = (f"   {label:14s} {e['config']['comm_sms']:>2} SMs @ "
                    f"{str(e['config']['launch_slot']):10s} {e['time_s'] * 1e3:7.3f} ms "
                    f"{e['energy_j']:7.3f} J")
            for k in base:
                v = e[f"vs_{k}"]
                line += (f" | vs {k}: E {v['energy_pct_lower']:+5.1f}% T "
                         f"{v['time_pct_lower']:+5.1f}%")
            print(line)
        for sname, by_budget in res["replayed_search_by_surrogate"].items():
            for b, v in by_budget.items():
                print(f"   replayed search ({sname}), budget {b}/{len(space)}, {seeds} seeds: "
                      f"HV ratio {v['front']['mean']:.3f} (min {v['front']['min']:.3f}; wide "
                      f"reference {v['wide']['mean']:.3f})")
        if "live_search" in res:
            v = res["live_search"]
            print(f"   live search, budget {v['budget']}: HV ratio {v['hv_ratio_front']:.3f} "
                  f"(wide reference {v['hv_ratio_wide']:.3f})")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
