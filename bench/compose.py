"""Benchmark: kareus's composition against lowtime 0.3.0 on identical inputs (emulated).

Workload: llama3.3-70b, TP=8, PP=8 (the deepest pipeline of the 64-GPU H200 job; PP >= 8
as required), 32 microbatches of 2 x 4096 tokens, 2 nanobatches, on the emulated H200
(EmulatedProfiler, 1% energy noise, seed 0). Every partition type's configuration space
is measured exhaustively on the emulator, the microbatch frontiers are composed once, and
then the same microbatch frontiers, schedule (1F1B), time unit and static power go to:

* ``IterationComposer`` (kareus), and
* lowtime 0.3.0's ``PhillipsDessouky`` solver, each computation an ``Operation`` whose
  options are the microbatch frontier's points (knob = point index) and whose cost model
  is the lower convex hull of its options (a ``CostModel`` subclass written here; the
  same hull kareus uses), cost = dynamic energy.

Both sides' solutions are re-evaluated the same way: every computation at the point its
plan (or lowtime's assigned knob) names, exact (unrounded) durations through the DAG's
longest path, energy = dynamic energy + static power x time x all GPUs. The hypervolumes
of the two Pareto fronts use one reference point (the union's worst time and energy,
plus 1%). Wall times: kareus's ``compose`` call vs lowtime's graph construction + solver
loop (snapshots of the knobs included, re-evaluation excluded).

``microbatch_compose_s``: ``MicrobatchComposer.compose`` on 4 partition types x 18
frequencies x 30-point synthetic fronts (every stage and phase of the workload).

Usage: python bench/compose.py [--quick] --json PATH   (lowtime==0.3.0 must be installed:
``pip install -e .[bench]``). ``--quick`` measures a smaller SM grid and uses a coarser
time unit.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from kareus.compose import (
    IterationComposer,
    IterationContext,
    MicrobatchComposer,
    MicrobatchContext,
)
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.dag import Dag
from kareus.model.measurement import Measurement
from kareus.model.partition import build_partitions
from kareus.model.pipeline import one_f_one_b
from kareus.model.workload import Workload
from kareus.profilers.emulator import EmulatedProfiler
from kareus.search.pareto import hypervolume, pareto_front, pareto_mask
from kareus.search.partition_frontier import Observation, PartitionFrontier
from kareus.workflow import exhaustive_search, measure_outside_work


def _lowtime_solve(n, edges, node_type, options, unit):
    """Run lowtime's solver; return (wall seconds, knob snapshots per iteration)."""
    import networkx as nx
    from lowtime.cost_model import CostModel
    from lowtime.graph_utils import add_sink_node, add_source_node
    from lowtime.operation import (
        CandidateExecutionOptions,
        ExecutionOption,
        Operation,
        OperationSpec,
    )
    from lowtime.solver import PhillipsDessouky

    class HullCostModel(CostModel):
        """Lower convex hull of the options' (quantised time, cost), interpolated."""

        def __init__(self, cand):
            q = np.array([o.quant_time for o in cand.options], dtype=float)
            c = np.array([o.cost for o in cand.options], dtype=float)
            order = np.argsort(q)
            q, c = q[order], c[order]
            hull: list[int] = []
            for k in range(len(q)):
                while len(hull) >= 2:
                    a, b = hull[-2], hull[-1]
                    if (q[b] - q[a]) * (c[k] - c[a]) - (c[b] - c[a]) * (q[k] - q[a]) <= 0:
                        hull.pop()
                    else:
                        break
                hull.append(k)
            self.q, self.c = q[hull], c[hull]

        def __call__(self, quant_time):
            return float(np.interp(quant_time, self.q, self.c))

    start = time.perf_counter()
    specs = []
    for times, costs in options:
        opts = [ExecutionOption(real_time=float(t), unit_time=unit, cost=float(c), knob=i)
                for i, (t, c) in enumerate(zip(times, costs))]
        cand = CandidateExecutionOptions(options=opts)
        specs.append(OperationSpec(options=cand, cost_model=HullCostModel(cand)))
    g = nx.DiGraph()
    for v in range(n):
        g.add_node(v, op=Operation(spec=specs[node_type[v]]))
    g.add_edges_from(edges)
    add_source_node(g, "source")
    add_sink_node(g, "sink")
    g.graph["source_node"] = "source"
    g.graph["sink_node"] = "sink"
    ops = [g.nodes[v]["op"] for v in range(n)]
    snaps = [[op.assigned_knob for op in ops]]
    for _ in PhillipsDessouky(g).run():
        snaps.append([op.assigned_knob for op in ops])
    return time.perf_counter() - start, snaps


def _synthetic_frontiers(pset, gpu, rng):
    """30-point Pareto fronts at each of 18 frequencies for every partition type."""
    out = {}
    for name in pset.types:
        obs = []
        for f in gpu.search_clocks_mhz:
            t = np.sort(rng.uniform(1.0, 2.0, 30)) * 1e-3 * gpu.max_clock_mhz / f
            e = np.sort(rng.uniform(0.5, 1.0, 30))[::-1] * f / gpu.max_clock_mhz
            for i, (tt, ee) in enumerate(zip(t, e)):
                cfg = ScheduleConfig(f, i + 1, None)
                obs.append(Observation(config=cfg, measurement=Measurement(
                    time_s=tt, energy_j=ee + 100.0 * tt, static_power_w=100.0)))
        out[name] = PartitionFrontier.from_observations(name, gpu.name, obs)
    return out


def _git_commit():
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller SM grid, coarser time unit")
    ap.add_argument("--json", type=Path, help="write results to this JSON file")
    ap.add_argument("--resolution", type=float, default=None,
                    help="time unit as a fraction of the shortest computation "
                         "(default 0.02, --quick 0.1)")
    args = ap.parse_args(argv)
    resolution = args.resolution or (0.1 if args.quick else 0.02)

    wl = Workload.preset("llama3.3-70b", tp=8, pp=8, dp=1, microbatch_size=2, seq_len=4096,
                         num_microbatches=32, nanobatches=2)
    pset = build_partitions(wl)
    prof = EmulatedProfiler("h200-sxm", noise=0.01, seed=0)
    gpu = prof.gpu
    sms = [2, 4, 8, 16, 32] if args.quick else None

    t0 = time.perf_counter()
    pfs = {name: exhaustive_search(prof, ConfigSpace(part, gpu, comm_sms=sms))
           for name, part in pset.types.items()}
    measure_s = time.perf_counter() - t0
    outside = measure_outside_work(prof, pset, gpu.search_clocks_mhz)

    t0 = time.perf_counter()
    mfs = MicrobatchComposer().compose(pfs, MicrobatchContext(partitions=pset, outside=outside))
    mb_real_s = time.perf_counter() - t0

    syn = _synthetic_frontiers(pset, gpu, np.random.default_rng(0))
    t0 = time.perf_counter()
    MicrobatchComposer().compose(syn, MicrobatchContext(partitions=pset))
    mb_syn_s = time.perf_counter() - t0

    # Identical inputs for both solvers.
    sched = one_f_one_b(wl.parallelism.pp, wl.num_microbatches)
    nodes = sched.nodes
    index = {c: i for i, c in enumerate(nodes)}
    keys = sorted({(c.stage, c.phase) for c in nodes})
    node_type = [keys.index((c.stage, c.phase)) for c in nodes]
    edges = [(index[u], index[v]) for u, v in sched.edges]
    options = [([p.time_s for p in mfs[k].points], [p.dynamic_energy_j for p in mfs[k].points])
               for k in keys]
    shortest = min(min(t) for t, _ in options)
    unit = shortest * resolution
    static_w = prof.static_power_w(wl.parallelism.world_size)

    comp = IterationComposer(unit_s=unit)
    t0 = time.perf_counter()
    ours = comp.compose(mfs, IterationContext(static_power_w=static_w, gpu=gpu.name,
                                              schedule=sched, label="kareus",
                                              workload=wl.to_dict()))
    ours_s = time.perf_counter() - t0

    lt_s, snaps = _lowtime_solve(len(nodes), edges, node_type, options, unit)
    dag = Dag(len(nodes), edges)
    knobs = np.array(snaps, dtype=np.int64)
    opt_t = [np.asarray(t) for t, _ in options]
    opt_c = [np.asarray(c) for _, c in options]
    dur = np.array([[opt_t[node_type[v]][k[v]] for v in range(len(nodes))] for k in knobs])
    dyn = np.array([[opt_c[node_type[v]][k[v]] for v in range(len(nodes))] for k in knobs])
    lt_time = dag.makespans(dur[:, dag.order])
    lt_energy = dyn.sum(axis=1) + static_w * lt_time
    lt_pts = np.column_stack([lt_time, lt_energy])
    lt_front = pareto_front(lt_pts)

    our_front = ours.array()
    union = np.vstack([our_front, lt_front])
    ref = union.max(axis=0) * 1.01
    hv_ours = hypervolume(our_front, ref)
    hv_lt = hypervolume(lt_front, ref)
    both = np.vstack([our_front, lt_front])
    share = pareto_mask(both)

    result = {
        "benchmark": "compose",
        "emulated": True,
        "machine": f"{platform.machine()} CPU, {__import__('os').cpu_count()} cores (shared), "
                   "emulated GPU",
        "command": "python bench/compose.py" + (" --quick" if args.quick else "")
                   + (f" --resolution {args.resolution}" if args.resolution else "")
                   + " --json PATH",
        "workload": wl.to_dict(),
        "gpu": gpu.name,
        "computations": len(nodes),
        "partition_types": len(pset.types),
        "measured_configs": int(sum(len(pf.observations) for pf in pfs.values())),
        "measure_s": round(measure_s, 3),
        "microbatch_points": {f"s{s}.{ph}": len(mfs[(s, ph)].points) for s, ph in keys},
        "unit_s": unit,
        "resolution": resolution,
        "static_power_w": static_w,
        "hv_ratio_vs_lowtime": hv_ours / hv_lt,
        "speedup_vs_lowtime": lt_s / ours_s,
        "microbatch_compose_s": mb_syn_s,
        "microbatch_compose_real_s": mb_real_s,
        "ours_wall_s": ours_s,
        "lowtime_wall_s": lt_s,
        "lowtime_iterations": len(snaps) - 1,
        "ours_points": len(our_front),
        "lowtime_points": len(lt_front),
        "ours_stats": {k: v for k, v in ours.stats.items() if k != "wall_s"},
        "reference_point": ref.tolist(),
        "hv_ours": hv_ours,
        "hv_lowtime": hv_lt,
        "joint_front_share_ours": float(share[: len(our_front)].mean()),
        "joint_front_share_lowtime": float(share[len(our_front):].mean()),
        "ours_fastest": our_front[0].tolist(),
        "ours_min_energy": our_front[-1].tolist(),
        "lowtime_fastest": lt_front[0].tolist(),
        "lowtime_min_energy": lt_front[-1].tolist(),
        "targets": {"hv_ratio_vs_lowtime": ">= 0.999", "speedup_vs_lowtime": ">= 10",
                    "microbatch_compose_s": "<= 1"},
        "python": sys.version.split()[0],
        "git_commit": _git_commit(),
    }
    print(f"compose benchmark (emulated {gpu.name}; {wl.describe()})")
    print(f"  {len(nodes)} computations, unit {unit * 1e3:.4f} ms "
          f"({resolution} x shortest computation)")
    print(f"  {'':<28} {'kareus':>12} {'lowtime 0.3.0':>14}")
    print(f"  {'wall time (s)':<28} {ours_s:>12.2f} {lt_s:>14.2f}")
    print(f"  {'Pareto points':<28} {len(our_front):>12d} {len(lt_front):>14d}")
    print(f"  {'hypervolume':<28} {hv_ours:>12.5g} {hv_lt:>14.5g}")
    print(f"  {'fastest (s, J)':<28} {our_front[0][0]:>6.3f} {our_front[0][1]:>6.0f}"
          f" {lt_front[0][0]:>7.3f} {lt_front[0][1]:>6.0f}")
    print(f"  {'lowest energy (s, J)':<28} {our_front[-1][0]:>6.3f} {our_front[-1][1]:>6.0f}"
          f" {lt_front[-1][0]:>7.3f} {lt_front[-1][1]:>6.0f}")
    print(f"  hv_ratio_vs_lowtime   {result['hv_ratio_vs_lowtime']:.5f}   (target >= 0.999)")
    print(f"  speedup_vs_lowtime    {result['speedup_vs_lowtime']:.1f}x   (target >= 10)")
    print(f"  microbatch_compose_s  {mb_syn_s:.3f} s  (target <= 1; real frontiers: "
          f"{mb_real_s:.3f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
