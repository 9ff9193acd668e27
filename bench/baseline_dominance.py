"""Is kareus's frontier ahead of every baseline's at every search budget? (EMULATED)

kareus's space holds every baseline's configurations, so its iteration frontier should never
be behind any baseline's. For each job and budget this runs ``kareus.optimize`` on the
embedded emulator and compares kareus's iteration frontier with each baseline's point by
point: for a baseline point (time t, energy e), kareus's lowest energy among its plans of at
most t. A point is *behind* when that energy exceeds e (beyond 1e-9 relative); the *saving*
at the point is ``1 - E_kareus(t) / e``.

Printed per job, budget and baseline: the points behind, the median and minimum saving over
the baseline's points, and (against nanobatching+Perseus) the median saving as a fraction of
the one at the largest budget run.

Usage::

    python bench/baseline_dominance.py [--budgets 8,16,32,96] [--seeds 0] [--quick]
        [--json bench/results/baseline_dominance.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: The jobs: (label, preset, GPU, workload keywords).
JOBS = [
    ("readme", "qwen3-1.7b", "a100-40gb",
     dict(tp=4, cp=2, pp=2, num_microbatches=8, microbatch_size=16, seq_len=4096)),
    ("llama70b-1024", "llama3.3-70b", "h200-sxm",
     dict(tp=8, pp=8, dp=16, num_microbatches=16, microbatch_size=2, seq_len=8192)),
    ("llama3b-tp4", "llama3.2-3b", "h200-sxm",
     dict(tp=4, pp=2, num_microbatches=8, microbatch_size=8, seq_len=4096)),
    ("qwen3-tp2-cp2", "qwen3-1.7b", "h100-sxm",
     dict(tp=2, cp=2, pp=2, num_microbatches=8, microbatch_size=8, seq_len=8192)),
]
QUICK_JOBS = [
    ("qwen3-small", "qwen3-1.7b", "h200-sxm",
     dict(tp=2, pp=2, num_microbatches=4, microbatch_size=2, seq_len=1024)),
]
BASELINES = ("megatron", "nanobatching", "perseus", "nanobatching+perseus")


def compare(kareus: Any, baseline: Any) -> dict[str, Any]:
    """Point by point: kareus's lowest energy within each baseline point's time."""
    k = sorted((p.time_s, p.energy_j) for p in kareus.points)
    behind, savings = 0, []
    for p in baseline.points:
        within = [e for t, e in k if t <= p.time_s * (1 + 1e-9)]
        if not within:
            behind += 1
            savings.append(float("-inf"))
            continue
        best = min(within)
        if best > p.energy_j * (1 + 1e-9):
            behind += 1
        savings.append(1 - best / p.energy_j)
    finite = [s for s in savings if s != float("-inf")]
    return {"points": len(savings), "behind": behind,
            "median_saving": statistics.median(finite) if finite else None,
            "min_saving": min(savings) if savings else None}


def profilers(gpu: str, seed: int, truth: str, prior: str) -> tuple[Any, Any]:
    """(what measures, the searches' prior model or None).

    ``truth``: ``"preset"`` = the GPU's emulated preset (1% noise, as ``kareus optimize``);
    ``"perturbed"`` = the preset with every model constant scaled by a seeded factor
    (``EmulatedGPU.perturbed(seed)``, about 10% each), standing for the GPU a model only
    approximates. ``prior``: ``"none"``, or ``"preset"`` = the noise-free preset as each
    search's prior mean (with ``truth="preset"`` that prior is exactly right: an upper
    bound, not a result).
    """
    from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler

    model = EmulatedGPU.from_spec(gpu)
    measured = model if truth == "preset" else model.perturbed(seed)
    prior_model = None if prior == "none" else EmulatedProfiler(model, noise=0.0)
    return EmulatedProfiler(measured, seed=seed), prior_model


def true_frontiers(res: Any, wl: Any, gpu: str, seed: int, truth: str) -> dict[str, Any]:
    """Every system's iteration frontier with each configuration it measured valued
    noise-free: what the plans found really cost (``--score true``).

    The searches and the baselines measure with noise, and a frontier of many noisy
    measurements of nearly equal configurations keeps the luckiest draw: at the iteration
    level that selection alone makes a large budget look better than it is (the baselines
    measure each configuration once). Re-valued noise-free, noise steers the searches but
    cannot inflate their frontiers, as ``search_efficiency.py`` scores partition fronts."""
    from kareus.compose import kareus_types
    from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler
    from kareus.search import Observation, PartitionFrontier
    from kareus.workflow import compose_systems

    model = EmulatedGPU.from_spec(gpu)
    exact = EmulatedProfiler(model if truth == "preset" else model.perturbed(seed), noise=0.0)
    types = kareus_types(wl)
    given = {}
    for key, pf in res.composition.partitions["kareus"].items():
        obs = [Observation(config=o.config, measurement=exact.measure(types[key], o.config))
               for o in pf.measured()]
        given[key] = PartitionFrontier.from_observations(pf.partition, pf.gpu, obs)
    return compose_systems(wl, exact, systems=["kareus", *BASELINES],
                           kareus_frontiers=given)


def selected_true(res: Any, wl: Any, gpu: str, seed: int, truth: str,
                  exact_fronts: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Every system's *selected* plans valued noise-free (``--score selected``): the plans
    of its iteration frontier as measured (chosen on noisy measurements, as a real tune
    chooses them), each re-evaluated with every partition, outside work and tail cost it
    uses taken noise-free.

    This is what a user gets from the plans a search offers, whatever it claimed: noise can
    neither inflate the frontier (as in the ``measured`` score) nor pick for the system (as
    the ``true`` score's re-composition on noise-free values does, an oracle among the
    measured configurations). The points are not a Pareto front (a plan chosen as faster
    may turn out slower); each is kept."""
    from kareus.compose import evaluate_plan
    from kareus.compose.systems import system_workload
    from kareus.model import build_partitions
    from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler
    from kareus.workflow import measure_outside_work

    model = EmulatedGPU.from_spec(gpu)
    exact = EmulatedProfiler(model if truth == "preset" else model.perturbed(seed), noise=0.0)
    p = wl.parallelism
    static = exact.static_power_w(p.world_size)
    out: dict[str, list[tuple[float, float]]] = {}
    for name in ("kareus", *BASELINES):
        pset = build_partitions(system_workload(name, wl))
        fronts = exact_fronts[name]
        freqs = sorted({o.config.freq_mhz for pf in fronts.values() for o in pf.observations})
        outside = measure_outside_work(exact, pset, freqs)
        tail = (None if pset.iteration.empty else
                exact.measure_outside(pset.iteration, exact.gpu.max_clock_mhz,
                                      group_size=p.world_size))
        pts = []
        for pt in res.frontiers[name].points:
            t, e, _ = evaluate_plan(pt.plan, frontiers=fronts, partitions=pset,
                                    outside=outside, static_power_w=static, tail=tail)
            pts.append((t, e))
        out[name] = pts
    return out


class _Points:
    """Bare (time, energy) points for ``compare``."""

    def __init__(self, pts: list[tuple[float, float]]) -> None:
        self.points = [type("P", (), {"time_s": t, "energy_j": e})() for t, e in pts]


def run(jobs: list[tuple[str, str, str, dict[str, Any]]], budgets: list[int],
        seeds: list[int], *, truth: str = "preset", prior: str = "none",
        score: str = "measured", smooth: bool = False) -> list[dict[str, Any]]:
    from kareus.model import Workload
    from kareus.workflow import optimize

    rows = []
    for label, preset, gpu, kw in jobs:
        wl = Workload.preset(preset, **kw)
        for seed in seeds:
            for budget in budgets:
                t0 = time.monotonic()
                profiler, prior_model = profilers(gpu, seed, truth, prior)
                res = optimize(wl, profiler=profiler, budget=budget, seed=seed,
                               progress=False, prior_model=prior_model, smooth=smooth)
                wall = time.monotonic() - t0
                scored = {"measured": res.frontiers}
                if score in ("true", "selected"):  # the measured rows first
                    exact = true_frontiers(res, wl, gpu, seed, truth)
                    scored["true"] = exact.frontiers
                if score == "selected":
                    sel = selected_true(res, wl, gpu, seed, truth, exact.partitions)
                    scored["selected"] = {k: _Points(v) for k, v in sel.items()}
                for how, fronts in scored.items():
                    for base in BASELINES:
                        rows.append({"job": label, "seed": seed, "budget": budget,
                                     "baseline": base, "wall_s": wall, "truth": truth,
                                     "prior": prior, "score": how, "smooth": smooth,
                                     **compare(fronts["kareus"], fronts[base])})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="8,16,32,96")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--quick", action="store_true", help="one small job, budgets 8 and 16")
    ap.add_argument("--jobs", default=None, help="job labels to run (comma-separated)")
    ap.add_argument("--truth", choices=("preset", "perturbed"), default="preset",
                    help="what measures: the emulated preset, or a perturbed copy per seed")
    ap.add_argument("--prior", choices=("none", "preset"), default="none",
                    help="the searches' prior mean: none, or the noise-free preset")
    ap.add_argument("--score", choices=("measured", "true", "selected"), default="measured",
                    help="compare the frontiers as measured (noisy); 'true' adds them with "
                         "every configuration each system measured valued noise-free and "
                         "re-composed; 'selected' adds both and each system's plans as "
                         "chosen on its measurements, valued noise-free")
    ap.add_argument("--smooth", action="store_true",
                    help="kareus composes on smoothed values (optimize(smooth=True))")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    budgets = [8, 16] if args.quick else [int(b) for b in args.budgets.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = QUICK_JOBS if args.quick else JOBS
    if args.jobs:
        jobs = [j for j in jobs if j[0] in args.jobs.split(",")]
    rows = run(jobs, budgets, seeds, truth=args.truth, prior=args.prior, score=args.score,
               smooth=args.smooth)
    top = max(budgets)
    ref = {(r["job"], r["seed"], r["score"]): r["median_saving"] for r in rows
           if r["budget"] == top and r["baseline"] == "nanobatching+perseus"}
    print(f"{'job':<15} {'seed':>4} {'budget':>6} {'score':<8} {'baseline':<21} {'behind':>10} "
          f"{'median':>8} {'min':>8} {'of top':>7}")
    for r in rows:
        frac = ""
        top_saving = ref.get((r["job"], r["seed"], r["score"]))
        if r["baseline"] == "nanobatching+perseus" and top_saving:
            frac = f"{r['median_saving'] / top_saving:.2f}"
        med = "n/a" if r["median_saving"] is None else f"{100 * r['median_saving']:.2f}%"
        low = "n/a" if r["min_saving"] is None else f"{100 * r['min_saving']:.2f}%"
        print(f"{r['job']:<15} {r['seed']:>4} {r['budget']:>6} {r['score']:<8} {r['baseline']:<21} "
              f"{r['behind']:>4}/{r['points']:<5} {med:>8} {low:>8} {frac:>7}")
    print("(EMULATED; saving = 1 - kareus's lowest energy within the baseline point's time / "
          "the baseline point's energy; score true: every measured configuration valued "
          "noise-free)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "emulated": True, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
