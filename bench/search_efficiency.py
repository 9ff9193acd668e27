"""Search efficiency: how close each search's measured front gets to the true front.

For every partition type of ``llama3.2-3b`` (TP=4) and ``qwen3-1.7b`` (CP=2, TP=4),
microbatch 8, sequence 4096, two nanobatches, on ``a100-40gb`` and ``h200-sxm`` (all
EMULATED: kareus.profilers.emulator.EmulatedProfiler), over the full default space: each
GPU's default frequency grid (``GPUSpec.search_clocks_mhz``: A100 1410 -> 900 MHz in
30 MHz steps, H200 1980 -> 1215 MHz in 45 MHz steps; 18 values each), SM counts 1..32,
every launch slot plus sequential (ConfigSpace's default):

* ground truth: every configuration emulated without noise; its (time, total energy)
  front and that front's hypervolume against the reference point 1.1 x the true
  front's worst time and worst energy (the nadir of the front, not of the whole space,
  so that dominated junk earns no area);
* three searches, each profiling with noise (``noise=0.01``, seeded per run) up to 224
  profiles: (a) kareus (:class:`kareus.search.MultiPassSearch` with its defaults: a
  16-point maximin design, batches of 8, the default pass mix, the Gaussian-process
  surrogate; its hypervolume stop rule is evaluated, not enforced: see below), (b)
  uniform random search, (c) the schedule of the public reference artifact of the Kareus
  paper (96 random, then 4 batches of 32: 40% hypervolume improvement in (time, total
  energy), 20% in (time, dynamic energy), 20% lowest predicted time, the rest largest
  bootstrap spread, scored on the mean prediction, top-k per pass, on the reference's surrogates: a
  bootstrap ensemble of five XGBoost models, :func:`kareus.search.tree_surrogate`);
* after 16, 32, 48, 64, 96, 128 and 224 profiles, the hypervolume of the front of the
  configurations the search has measured so far, each re-evaluated noise-free (looked
  up in the ground truth), divided by the true front's hypervolume. Noise steers the
  searches but cannot inflate their fronts.

Reported: median and worst ratio over partitions and seeds, and the search overhead
(everything but profiling: fitting, predicting, choosing) per batch. kareus runs with
``stop=False`` so that every budget is measured; where its default stop rule would have
stopped (and the ratio there) is reported under ``kareus.stop_rule``.

Usage::

    python bench/search_efficiency.py [--quick] [--json PATH] [--jobs N]
        [--seeds N] [--first-seed S] [--methods kareus,random,reference]
        [--partitions MODEL/GPU/TYPE,...]
    python bench/search_efficiency.py --small-budgets [--truth perturbed|preset] [--quick]
        [--seeds N] [--json PATH]

``--small-budgets`` measures what real tuning runs afford instead: kareus at budgets 8, 12,
16, 32 and 96, each a search of its own, started from what the baselines measure of the type
(the default SM count in the first slot at every clock, as prior observations), without and
with the *preset* emulator's noise-free prediction as prior mean (``PriorMean``), measured
on ``--truth``: ``perturbed`` (default) = ``EmulatedGPU.perturbed(seed)``, every model
constant about 10% off, so the prior is a model of the GPU, not the GPU; ``preset`` = the
preset itself (then the prior mean is exactly right: an upper bound). Besides the
hypervolume ratio it reports the per-clock ratio: the mean over clocks of the hypervolume in
(time, dynamic energy) of the measured configurations at each clock over the true front's
there, which is what the microbatch composer takes.

``--quick`` (for CI; under 5 minutes on a 2-core machine) runs a documented subset:
five partition types per GPU (llama3.2-3b fwd_attn, bwd_mlp; qwen3-1.7b fwd_attn_in_ag,
fwd_mlp, bwd_attn_out_rs) and 2 seeds; the full mode runs all 28 partitions x 5 seeds.
``--first-seed`` and ``--seeds`` pick other seeds (development compares variants on seeds
5 and up, keeping 0-4 for the measurement of record); ``--methods`` and ``--partitions``
(each entry matched against the end of ``model/gpu/type``) run a part; ``--jobs`` runs
searches in that many processes (the results do not depend on it).
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

# One BLAS thread per process, set before numpy loads: the search's matrices are a few
# hundred rows, where OpenBLAS's threads cost more than they give, and with --jobs they
# busy-wait against the other processes (a search beside two workers on 2 cores: 52 s with
# default threads, 7.9 s with one).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kareus.model import ConfigSpace, Workload, build_partitions  # noqa: E402
from kareus.search import MultiPassSearch, tree_surrogate  # noqa: E402
from kareus.search.acquisition import FastestPass, HypervolumePass, UncertaintyPass  # noqa: E402
from kareus.search.pareto import hypervolume, pareto_front, reference_point  # noqa: E402

BUDGETS = (16, 32, 48, 64, 96, 128, 224)
GPUS = ("a100-40gb", "h200-sxm")
WORKLOADS = {
    "llama3.2-3b": {"tp": 4},
    "qwen3-1.7b": {"cp": 2, "tp": 4},
}
QUICK_TYPES = {
    "llama3.2-3b": ("fwd_attn", "bwd_mlp"),
    "qwen3-1.7b": ("fwd_attn_in_ag", "fwd_mlp", "bwd_attn_out_rs"),
}
NOISE = 0.01
MAX_BUDGET = max(BUDGETS)


def make_profiler(kind: str, gpu: str, noise: float, seed: int) -> Any:
    if kind == "emulated":
        from kareus.profilers.emulator import EmulatedProfiler

        return EmulatedProfiler(gpu, noise=noise, seed=seed)
    from kareus.testing import FakeProfiler  # development stand-in only

    return FakeProfiler(gpu, noise=noise, seed=seed)


def model_partitions(model: str) -> Any:
    """The partition types of one benchmark workload (microbatch 8, sequence 4096)."""
    return build_partitions(Workload.preset(model, microbatch_size=8, seq_len=4096,
                                            **WORKLOADS[model]))


def partitions(quick: bool) -> list[tuple[str, str, Any]]:
    out = []
    for model in WORKLOADS:
        ps = model_partitions(model)
        for gpu in GPUS:
            for p in ps:
                if quick and p.name not in QUICK_TYPES[model]:
                    continue
                out.append((model, gpu, p))
    return out


def ground_truth(space: ConfigSpace, profiler: Any) -> np.ndarray:
    """(n, 2) noise-free (time, total energy) of every configuration."""
    part = space.partition
    return np.array([(m.time_s, m.energy_j) for m in
                     (profiler.measure(part, c) for c in space.configs)])


def ratios(order: list[int], truth: np.ndarray, ref: np.ndarray, hv_true: float
           ) -> dict[str, float]:
    out = {}
    for b in BUDGETS:
        idx = order[:b]
        out[str(b)] = hypervolume(truth[idx], ref) / hv_true if idx else 0.0
    return out


def run_kareus(space: ConfigSpace, profiler: Any, seed: int) -> tuple[list[int], MultiPassSearch]:
    # stop=False: run to the full budget so every budget is measured; where the default
    # stop rule would have stopped is recorded (converged_at) and reported separately.
    # Stopping does not change the choices before it, so the ratio at that point is the
    # ratio a stopping search ends with.
    search = MultiPassSearch(space, budget=MAX_BUDGET, seed=seed, stop=False, progress=False)
    search.run(profiler)
    return [space.index(o.config) for o in search.observations], search


def run_reference(space: ConfigSpace, profiler: Any, seed: int
                  ) -> tuple[list[int], MultiPassSearch]:
    passes = [(HypervolumePass("total", greedy=False), 0.4),
              (HypervolumePass("dynamic", greedy=False), 0.2),
              (FastestPass(), 0.2), (UncertaintyPass(), 0.2)]
    # The reference artifact fits XGBoost models: the tree ensemble, not kareus's default GP.
    search = MultiPassSearch(space, budget=MAX_BUDGET, seed=seed, passes=passes,
                             surrogate=tree_surrogate(seed), batch_size=32, initial_size=96, initial_design="random",
                             allocation="last", stop_patience=None, progress=False)
    search.run(profiler)
    return [space.index(o.config) for o in search.observations], search


def run_random(space: ConfigSpace, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, 31337])
    return [int(i) for i in rng.permutation(len(space))[:MAX_BUDGET]]


def _git(*args: str) -> str:
    import subprocess

    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()
    except OSError:
        return "unknown"


_TRUTH: dict[tuple[str, str, str, str], tuple[np.ndarray, np.ndarray, float]] = {}


def _truth(model: str, gpu: str, name: str, kind: str) -> tuple[np.ndarray, np.ndarray, float]:
    """Ground truth of one partition (cached per process): values, reference point, HV."""
    key = (model, gpu, name, kind)
    if key not in _TRUTH:
        space = ConfigSpace(model_partitions(model)[name], gpu)
        truth = ground_truth(space, make_profiler(kind, gpu, 0.0, 0))
        front = pareto_front(truth)
        ref = reference_point(front, 0.1)
        _TRUTH[key] = (truth, ref, hypervolume(front, ref))
    return _TRUTH[key]


def run_unit(unit: tuple[str, str, str, int, tuple[str, ...], str]) -> dict[str, Any]:
    """Every method's search on one partition with one seed (a process-pool job)."""
    model, gpu, name, seed, methods, kind = unit
    t0 = time.perf_counter()
    truth, ref, hv_true = _truth(model, gpu, name, kind)
    gt_s = time.perf_counter() - t0
    space = ConfigSpace(model_partitions(model)[name], gpu)
    out: dict[str, Any] = {"ratios": {}, "overhead": {}, "ground_truth_s": gt_s,
                           "configs": len(space), "true_front_points": len(pareto_front(truth))}
    if "kareus" in methods:
        order, search = run_kareus(space, make_profiler(kind, gpu, NOISE, 1000 + seed), seed)
        out["ratios"]["kareus"] = ratios(order, truth, ref, hv_true)
        out["overhead"]["kareus"] = search.ask_seconds[1:]
        stop_at = search.converged_at or search.n_measured
        out["stop_at"] = stop_at
        out["ratio_at_stop"] = hypervolume(truth[order[:stop_at]], ref) / hv_true
    if "reference" in methods:
        order, search = run_reference(space, make_profiler(kind, gpu, NOISE, 2000 + seed), seed)
        out["ratios"]["reference"] = ratios(order, truth, ref, hv_true)
        out["overhead"]["reference"] = search.ask_seconds[1:]
    if "random" in methods:
        tr = time.perf_counter()
        order = run_random(space, seed)
        out["overhead"]["random"] = [time.perf_counter() - tr]
        out["ratios"]["random"] = ratios(order, truth, ref, hv_true)
    return out


SMALL_BUDGETS = (8, 12, 16, 32, 96)
VARIANTS = ("priors", "priors+mean")


def baseline_like_priors(space: ConfigSpace, profiler: Any) -> list[Any]:
    """What the baselines measure of a type before kareus searches it (``kareus.workflow``'s
    ``baseline_priors``): the default SM count in the first slot (nanobatching + Perseus; a
    type with no overlap: sequential, Perseus) at every clock."""
    from kareus.search import Observation

    sms = space.gpu.default_comm_sms
    first = next((s for s in space.slots if s is not None), None)
    return [Observation(config=c, measurement=profiler.measure(space.partition, c))
            for c in space.configs if c.comm_sms == sms and c.launch_slot == first]


def per_clock_ratio(space: ConfigSpace, dyn: np.ndarray, truth: np.ndarray, idx: list[int]
                    ) -> float:
    """Mean over clocks of the hypervolume in (time, dynamic energy) of the measured
    configurations at the clock over the true front's there (noise-free): the microbatch
    composer takes each type's front at each clock, not its front over all clocks."""
    freqs = np.array([c.freq_mhz for c in space.configs])
    pts = np.column_stack([truth[:, 0], dyn])
    chosen = np.zeros(len(space), dtype=bool)
    chosen[idx] = True
    out = []
    for f in np.unique(freqs):
        at = freqs == f
        front = pareto_front(pts[at])
        ref = reference_point(front, 0.1)
        mine = pts[at & chosen]
        out.append(hypervolume(mine, ref) / hypervolume(front, ref) if len(mine) else 0.0)
    return float(np.mean(out))


def run_small_unit(unit: tuple[str, str, str, int, str]) -> dict[str, Any]:
    """kareus at each small budget, from the baselines' measurements (priors), without and
    with the preset emulator's prediction as prior mean, measured on ``truth``."""
    from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler
    from kareus.search import PriorMean

    model, gpu, name, seed, truth_kind = unit
    space = ConfigSpace(model_partitions(model)[name], gpu)
    preset = EmulatedGPU.from_spec(gpu)
    world = preset if truth_kind == "preset" else preset.perturbed(seed)
    exact = EmulatedProfiler(world, noise=0.0)
    ms = [exact.measure(space.partition, c) for c in space.configs]
    truth = np.array([(m.time_s, m.energy_j) for m in ms])
    dyn = np.array([m.dynamic_energy_j for m in ms])
    front = pareto_front(truth)
    ref = reference_point(front, 0.1)
    hv_true = hypervolume(front, ref)
    mean = PriorMean.from_profiler(space, EmulatedProfiler(preset, noise=0.0))
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        for b in SMALL_BUDGETS:
            prof = EmulatedProfiler(world, noise=NOISE, seed=1000 + seed)
            priors = baseline_like_priors(space, prof)
            search = MultiPassSearch(space, budget=b, seed=seed, stop_patience=None,
                                     progress=False, prior=priors,
                                     prior_mean=mean if variant == "priors+mean" else None)
            search.run(prof)
            idx = [space.index(o.config) for o in search.observations]
            out[f"{variant}/{b}"] = {
                "hv": hypervolume(truth[idx], ref) / hv_true,
                "per_clock": per_clock_ratio(space, dyn, truth, idx)}
        base_idx = [space.index(o.config) for o in priors]
        out[f"{variant}/0"] = {"hv": hypervolume(truth[base_idx], ref) / hv_true,
                               "per_clock": per_clock_ratio(space, dyn, truth, base_idx)}
    return out


def small_main(args: argparse.Namespace) -> int:
    """``--small-budgets``: kareus at 8-96 profiles from the baselines' measurements, with
    and without a prior mean (see the module doc)."""
    seeds = list(range(args.first_seed, args.first_seed + (args.seeds or 2)))
    parts = partitions(args.quick)
    if args.partitions:
        wanted = [w.strip() for w in args.partitions.split(",") if w.strip()]
        parts = [(m, g, p) for m, g, p in parts
                 if any(f"{m}/{g}/{p.name}".endswith(w) for w in wanted)]
    units = [(m, g, p.name, s, args.truth) for m, g, p in parts for s in seeds]
    t0 = time.time()
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run_small_unit, units))
    else:
        results = [run_small_unit(u) for u in units]
    table: dict[str, Any] = {}
    print(f"truth: {args.truth}; {len(parts)} partitions x {len(seeds)} seeds; median (worst)")
    print(f"{'variant':12s} {'metric':9s} " + " ".join(f"{b:>15d}" for b in (0, *SMALL_BUDGETS)))
    for variant in VARIANTS:
        for metric in ("hv", "per_clock"):
            row = {}
            for b in (0, *SMALL_BUDGETS):
                vals = [r[f"{variant}/{b}"][metric] for r in results]
                row[str(b)] = {"median": round(statistics.median(vals), 4),
                               "worst": round(min(vals), 4),
                               "mean": round(statistics.fmean(vals), 4)}
            table[f"{variant}/{metric}"] = row
            print(f"{variant:12s} {metric:9s} " + " ".join(
                f"{row[str(b)]['median']:7.4f} ({row[str(b)]['worst']:.3f})"
                for b in (0, *SMALL_BUDGETS)))
    print(f"(EMULATED; budget 0 = the baselines' measurements alone; {time.time() - t0:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "emulated": True, "truth": args.truth, "seeds": seeds,
            "partitions": [f"{m}/{g}/{p.name}" for m, g, p in parts],
            "budgets": list(SMALL_BUDGETS), "noise": NOISE, "git_head": _git("rev-parse",
                                                                              "--short", "HEAD"),
            "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
            "wall_s": round(time.time() - t0, 1), "table": table}, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - a linear bench script, one branch per option and output
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="documented subset (CI)")
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--seeds", type=int, default=None, help="override the number of seeds")
    ap.add_argument("--first-seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--methods", default="kareus,random,reference",
                    help="comma-separated subset of kareus,random,reference")
    ap.add_argument("--partitions", default=None,
                    help="comma-separated model/gpu/type suffixes (default: all of the mode)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--profiler", choices=("emulated", "fake"), default="emulated",
                    help="'fake' = kareus.testing.FakeProfiler, for development only")
    ap.add_argument("--small-budgets", action="store_true",
                    help="kareus at budgets 8/12/16/32/96 from the baselines' measurements, "
                         "without and with the preset emulator as prior mean")
    ap.add_argument("--truth", choices=("preset", "perturbed"), default="perturbed",
                    help="with --small-budgets: what measures (the preset, or a perturbed "
                         "copy per seed, EmulatedGPU.perturbed)")
    args = ap.parse_args(argv)
    if args.small_budgets:
        return small_main(args)
    methods = tuple(m for m in ("kareus", "random", "reference")
                    if m in args.methods.split(","))
    unknown = set(args.methods.split(",")) - {"kareus", "random", "reference"}
    if unknown or not methods:
        ap.error(f"--methods takes kareus, random, reference; got {args.methods!r}")
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")
    n_seeds = args.seeds if args.seeds is not None else (2 if args.quick else 5)
    if n_seeds < 1:
        ap.error("--seeds must be >= 1")
    seeds = list(range(args.first_seed, args.first_seed + n_seeds))
    parts = partitions(args.quick)
    if args.partitions:
        wanted = [w.strip() for w in args.partitions.split(",") if w.strip()]
        parts = [(m, g, p) for m, g, p in parts
                 if any(f"{m}/{g}/{p.name}".endswith(w) for w in wanted)]
        if not parts:
            ap.error(f"--partitions {args.partitions!r} matches no partition")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    overhead: dict[str, list[float]] = {m: [] for m in methods}
    used: list[int] = []
    at_stop: list[float] = []
    per_partition = []
    t0 = time.time()
    gt_seconds = 0.0
    units = [(model, gpu, part.name, seed, methods, args.profiler)
             for model, gpu, part in parts for seed in seeds]
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        pool: Any = ProcessPoolExecutor(args.jobs)
        results = pool.map(run_unit, units)
    else:
        pool, results = None, map(run_unit, units)
    try:
        for model, gpu, part in parts:
            row: dict[str, Any] = {"model": model, "gpu": gpu, "partition": part.name}
            for _seed in seeds:
                res = next(results)
                gt_seconds += res["ground_truth_s"]
                row["configs"] = res["configs"]
                row["true_front_points"] = res["true_front_points"]
                for m in methods:
                    runs[m].append(res["ratios"][m])
                    overhead[m] += res["overhead"][m]
                if "kareus" in methods:
                    used.append(res["stop_at"])
                    at_stop.append(res["ratio_at_stop"])
            for m in methods:
                row[m] = {b: round(min(r[b] for r in runs[m][-len(seeds):]), 4)
                          for b in ("64", "96", "224")}
            per_partition.append(row)
            print(f"{model:12s} {gpu:10s} {part.name:18s} {row['configs']:5d} configs, true "
                  f"front {row['true_front_points']:2d} pts | worst@64 "
                  + " ".join(f"{m} {row[m]['64']:.4f}" for m in methods)
                  + f" [{time.time() - t0:.0f}s]", flush=True)
    finally:
        if pool is not None:
            pool.shutdown()

    result: dict[str, Any] = {}
    for m in methods:
        result[m] = {
            "hv_ratio_median": {str(b): round(statistics.median(r[str(b)] for r in runs[m]), 5)
                                for b in BUDGETS},
            "hv_ratio_worst": {str(b): round(min(r[str(b)] for r in runs[m]), 5)
                               for b in BUDGETS},
            "hv_ratio_mean": {str(b): round(statistics.fmean(r[str(b)] for r in runs[m]), 5)
                              for b in BUDGETS},
            "overhead_s_per_batch": round(float(np.mean(overhead[m])) if overhead[m] else 0.0,
                                          4),
        }
    if "kareus" in methods:
        result["kareus"]["stop_rule"] = {
            "profiles_median": statistics.median(used), "profiles_min": min(used),
            "profiles_max": max(used),
            "hv_ratio_median": round(statistics.median(at_stop), 5),
            "hv_ratio_worst": round(min(at_stop), 5),
            "note": "where the default stop rule (4 batches with < 0.1% relative hypervolume "
                    "gain) fired (224 if never), and the ratio there",
        }
    result["meta"] = {
        "command": "python bench/search_efficiency.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "emulated": args.profiler == "emulated",
        "git_head": _git("rev-parse", "--short", "HEAD"),
        "emulator_commit": _git("log", "-1", "--format=%h", "--", "kareus/profilers/emulator"),
        "emulator_dirty": bool(_git("status", "--porcelain", "--", "kareus/profilers/emulator")),
        "profiler": ("kareus.profilers.emulator.EmulatedProfiler" if args.profiler == "emulated"
                     else "kareus.testing.FakeProfiler (development stand-in)"),
        "noise": NOISE,
        "machine": f"{platform.machine()} CPU, {platform.system()}, {os.cpu_count()} cores",
        "quick": args.quick,
        "seeds": seeds,
        "partitions": len(parts),
        "budgets": list(BUDGETS),
        "space": "GPU default frequency grid (18 values), comm SMs 1..32, every slot + "
                 "sequential",
        "reference_point": "1.1 x worst time and worst energy of the true front",
        "evaluation": "fronts of measured configs re-evaluated noise-free",
        "methods": list(methods),
        "jobs": args.jobs,
        "ground_truth_s": round(gt_seconds, 1),
        "wall_s": round(time.time() - t0, 1),
        "per_partition_worst": per_partition,
    }
    print()
    print(f"{'method':10s} " + " ".join(f"{b:>7d}" for b in BUDGETS) + "   overhead/batch")
    for m in methods:
        for stat in ("median", "mean", "worst"):
            vals = result[m][f"hv_ratio_{stat}"]
            print(f"{m[:10]:10s} {stat[:3]} " + " ".join(f"{vals[str(b)]:7.4f}" for b in BUDGETS)
                  + (f"   {result[m]['overhead_s_per_batch']:.3f} s" if stat == "median" else ""))
    tail = ""
    if "kareus" in methods:
        sr = result["kareus"]["stop_rule"]
        tail = (f"; kareus's stop rule would stop at a median of {sr['profiles_median']} "
                f"profiles with ratio median {sr['hv_ratio_median']:.4f}, worst "
                f"{sr['hv_ratio_worst']:.4f}")
    print(f"(emulated: {result['meta']['emulated']}; {len(parts)} partitions x {len(seeds)} "
          f"seeds {seeds[0]}-{seeds[-1]}{tail}; {result['meta']['wall_s']:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
