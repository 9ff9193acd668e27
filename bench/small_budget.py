"""Search at real budgets: how often the default search finds the measured optima.

On real GPUs a profile costs about 1.5 s (a window of repeated runs read from NVML's
energy counter, then a cool-down; ``mean_wall_s_per_candidate`` of the measured grids
below), so a tuning run affords a handful of profiles per partition type. This bench
replays the default :class:`kareus.search.MultiPassSearch` (``budget=B``, everything
else default) on measured grids, with ``kareus.profilers.replay.ReplayProfiler`` answering
each configuration's recorded measurement, for several seeds and budgets, and counts how
often the configurations it measured include

* the **energy optimum** of the grid (the configuration with the lowest measured
  energy), or one whose measured energy is within the grid's repeat noise of it;
* the **time optimum**, likewise in time.

**Repeat noise.** Each grid file holds repeated measurements of one configuration,
interleaved through the run (default nanobatching with NCCL's own CTA count: the
``nanobatch`` row and the ``repeat`` rows, 5 per partition). Their relative sample
standard deviation (``stdev / mean``) per partition and objective is the noise of one
measurement in that run; a configuration *within noise* of the optimum is one whose
measured value exceeds the optimum's by at most that fraction (one standard deviation).
"exact" counts only the optimum itself.

Default data: the two measured 2x H200 (NVLink) grids of Llama 3.2 3B ``fwd_attn`` and
``fwd_mlp`` at TP=2, one clock (``data/h200_llama3b_tp2_grid.json``: 6 SM counts x 6 slots,
36 configurations; ``data/h200_llama3b_tp2_grid13.json``: 13 SM counts, 78).

``--emulated`` runs the same count on EMULATED partitions instead (a development set,
so that design choices are not fitted to the measured grids, which are held out for
validation): every partition type of the ``bench/search_efficiency.py`` workloads on
``a100-40gb`` and ``h200-sxm`` (28), at the GPU's maximum clock only (as on machines whose
clocks must not change), over the 13 SM counts of the measured grid13 and every slot;
searches profile with the emulator's default noise (1% on energy, 0.25% on time), and a
configuration counts as found when its noise-free value is within one noise standard
deviation of the noise-free optimum.

Usage::

    python bench/small_budget.py [--grids A.json,B.json] [--budgets 6,8,...] [--seeds 50]
        [--jobs N] [--json bench/results/small_budget.json] [--emulated]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # small matrices; one BLAS thread per process

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kareus.model import Workload, build_partitions  # noqa: E402
from kareus.profilers.replay import ReplayProfiler  # noqa: E402
from kareus.search import MultiPassSearch  # noqa: E402

GRIDS = ("data/h200_llama3b_tp2_grid.json", "data/h200_llama3b_tp2_grid13.json")
BUDGETS = (6, 8, 10, 12, 16, 24, 32)
OBJECTIVES = ("energy", "time")
#: SM counts of the emulated development spaces: those of data/h200_llama3b_tp2_grid13.json.
EMULATED_SMS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
EMULATED_NOISE = {"energy": 0.01, "time": 0.0025}  # the emulator's default noise (1 sd)
OPT_KEY = {"energy": "energy_j", "time": "time_s"}
#: Tolerances in noise standard deviations: the optimum itself; one sd; and the difference
#: two single measurements with that noise cannot tell apart at 95% (1.96 x sqrt(2) sd).
CRITERIA = {"exact": 0.0, "1sd": 1.0, "95%": 1.96 * 2 ** 0.5}


def _load(path: str) -> tuple[dict[str, Any], Any]:
    data = json.loads((ROOT / path).read_text())
    w = data["workload"]
    wl = Workload.preset(w["model"], tp=w["tp"], cp=w.get("cp", 1),
                         microbatch_size=w["microbatch_size"], seq_len=w["seq_len"],
                         nanobatches=w["nanobatches"])
    return data, build_partitions(wl)


def repeat_noise(data: dict[str, Any], partition: str) -> dict[str, float]:
    """Relative sample standard deviation of the repeated measurements, per objective."""
    reps = [r["measurement"] for r in data["measurements"]
            if r["partition"] == partition and r["kind"] in ("nanobatch", "repeat")
            and "measurement" in r]
    if len(reps) < 2:
        raise SystemExit(f"{partition}: fewer than 2 repeated measurements in the grid")
    out = {}
    for obj, key in (("energy", "energy_j"), ("time", "time_s")):
        v = [m[key] for m in reps]
        out[obj] = statistics.stdev(v) / statistics.fmean(v)
    out["n"] = len(reps)
    return out


def _emulated_case(key: str) -> tuple[Any, Any, Any]:
    """The emulated development case ``model/gpu/type``: (space, partition, noise-free
    profiler)."""
    from search_efficiency import model_partitions

    from kareus.model import ConfigSpace
    from kareus.model.gpu import get_gpu
    from kareus.profilers.emulator import EmulatedProfiler

    model, gpu, name = key.split("/")
    part = model_partitions(model)[name]
    space = ConfigSpace(part, gpu, freqs_mhz=[get_gpu(gpu).max_clock_mhz],
                        comm_sms=EMULATED_SMS)
    return space, part, EmulatedProfiler(gpu, noise=0.0)


def emulated_keys() -> list[str]:
    """The 28 emulated development cases (``model/gpu/type``)."""
    from search_efficiency import partitions

    return [f"{m}/{g}/{p.name}" for m, g, p in partitions(quick=False)]


def _prior_mean(space: Any, data: dict[str, Any]) -> Any:
    """The calibrated emulator's prediction of a measured grid's space (``--prior-mean
    emulator``): the shipped H200 profile, NCCL's capped-CTA curves (what the grids ran),
    the grid's stream priority, noise off."""
    from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler, measured_priority
    from kareus.search import PriorMean

    priority, _ = measured_priority(data)
    gpu = EmulatedGPU.from_profile("h200-sxm", comm_backend="nccl", comm_priority=priority)
    return PriorMean.from_profiler(space, EmulatedProfiler(gpu, noise=0.0))


def one_search(task: tuple[str, str, int, int] | tuple[str, str, int, int, str]
               ) -> dict[str, Any]:
    """Replay one default search; the best measured energy and time, and the profiles.

    On an emulated case the values are the noise-free ones of the configurations the
    search measured (it measured them with noise)."""
    path, name, budget, seed = task[:4]
    prior = task[4] if len(task) > 4 else "none"
    if path == "emulated":
        from kareus.profilers.emulator import EmulatedProfiler

        space, part, truth = _emulated_case(name)
        profiler: Any = EmulatedProfiler(space.gpu, noise=EMULATED_NOISE["energy"],
                                         time_noise=EMULATED_NOISE["time"], seed=seed)
    else:
        data, parts = _load(path)
        profiler = ReplayProfiler(data, kinds=("grid",), samples="mean")
        part = parts[name]
        space = profiler.space(part)
        truth = profiler
    mean = None
    if prior == "emulator":
        if path == "emulated":
            raise SystemExit("--prior-mean emulator replays the measured grids only")
        mean = _prior_mean(space, data)
    search = MultiPassSearch(space, budget=budget, seed=seed, progress=False, prior_mean=mean)
    t0 = time.perf_counter()
    front = search.run(profiler, part)
    wall = time.perf_counter() - t0
    ms = [truth.measure(part, o.config) for o in front.observations]
    return {"grid": path, "partition": name, "budget": budget, "seed": seed,
            "profiles": len(ms),
            "best_energy_j": min(m.energy_j for m in ms),
            "best_time_s": min(m.time_s for m in ms),
            "initial_size": search.initial_size,
            "wall_s": wall}


def main() -> int:  # noqa: C901 - a linear bench script, one branch per option and output
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grids", default=",".join(GRIDS))
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prior-mean", choices=("none", "emulator"), default="none",
                    help="the searches' prior mean: none, or the emulator calibrated to the "
                         "shipped H200 profile (NCCL curves), predicting the grid")
    ap.add_argument("--emulated", action="store_true",
                    help="the emulated development set instead of the measured grids")
    args = ap.parse_args()
    grids = args.grids.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    t_start = time.perf_counter()

    cases: dict[tuple[str, str], dict[str, Any]] = {}
    tasks = []
    for key in emulated_keys() if args.emulated else []:
        space, part, truth = _emulated_case(key)
        ms = [truth.measure(part, c) for c in space.configs]
        cases[("emulated", key)] = {
            "grid": "emulated", "partition": key, "configs": len(space),
            "optimum_energy_j": min(m.energy_j for m in ms),
            "optimum_time_s": min(m.time_s for m in ms),
            "repeat_noise": dict(EMULATED_NOISE, n=0),
            "values": {"energy": [m.energy_j for m in ms], "time": [m.time_s for m in ms]},
            "budgets": {}}
        tasks += [("emulated", key, b, s) for b in budgets for s in seeds]
    for path in [] if args.emulated else grids:
        data, parts = _load(path)
        replay = ReplayProfiler(data, kinds=("grid",), samples="mean")
        for name in replay.partitions:
            space = replay.space(parts[name])
            ms = [replay.measure(parts[name], c) for c in space.configs]
            cases[(path, name)] = {
                "grid": path, "partition": name, "configs": len(space),
                "optimum_energy_j": min(m.energy_j for m in ms),
                "optimum_time_s": min(m.time_s for m in ms),
                "repeat_noise": repeat_noise(data, name),
                "values": {"energy": [m.energy_j for m in ms], "time": [m.time_s for m in ms]},
                "budgets": {}}
            tasks += [(path, name, b, s, args.prior_mean) for b in budgets for s in seeds]

    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(one_search, tasks, chunksize=4))
    else:
        results = [one_search(t) for t in tasks]

    for case in cases.values():
        values = case.pop("values")
        case["configs_within"] = {}
        for obj in OBJECTIVES:
            opt = case[f"optimum_{OPT_KEY[obj]}"]
            case["configs_within"][obj] = {
                crit: sum(v <= opt * (1 + z * case["repeat_noise"][obj]) for v in values[obj])
                for crit, z in CRITERIA.items()}
        for b in budgets:
            rs = [r for r in results if r["grid"] == case["grid"]
                  and r["partition"] == case["partition"] and r["budget"] == b]
            entry: dict[str, Any] = {"searches": len(rs),
                                     "initial_size": rs[0]["initial_size"]}
            for obj in OBJECTIVES:
                opt = case[f"optimum_{OPT_KEY[obj]}"]
                best = [r[f"best_{OPT_KEY[obj]}"] for r in rs]
                for crit, z in CRITERIA.items():
                    tol = z * case["repeat_noise"][obj]
                    entry[f"p_{obj}_{crit}"] = sum(v <= opt * (1 + tol) for v in best) / len(rs)
                entry[f"worst_{obj}_excess"] = max(v / opt - 1 for v in best)
            case["budgets"][str(b)] = entry

    print(f"default MultiPassSearch, budget B profiles per partition type, {args.seeds} seeds: "
          "P(a measured configuration is the optimum or within the noise of it)")
    print("criteria: " + "; ".join(f"{c} = within {z:.2f} sd" for c, z in CRITERIA.items()))
    if args.emulated:
        print("EMULATED development set: min / mean over the 28 cases, and cases below 0.95")
        for obj in OBJECTIVES:
            print(f"\n{obj}-optimum")
            print(f"{'B':>4} " + " ".join(f"{c:>20}" for c in CRITERIA))
            for b in budgets:
                cells = []
                for crit in CRITERIA:
                    ps = [c["budgets"][str(b)][f"p_{obj}_{crit}"] for c in cases.values()]
                    cells.append(f"{min(ps):.2f} / {statistics.fmean(ps):.3f} "
                                 f"({sum(p < 0.95 for p in ps):2d})")
                print(f"{b:>4} " + " ".join(f"{x:>20}" for x in cells))
    else:
        labels = [f"{Path(c['grid']).stem.replace('h200_llama3b_tp2_', '')}/{c['partition']}"
                  for c in cases.values()]
        for obj in OBJECTIVES:
            for crit in CRITERIA:
                print(f"\n{obj}-optimum, {crit}")
                print(f"{'B':>4} " + " ".join(f"{lab:>16}" for lab in labels) + f" {'min':>6}")
                for b in budgets:
                    ps = [c["budgets"][str(b)][f"p_{obj}_{crit}"] for c in cases.values()]
                    print(f"{b:>4} " + " ".join(f"{p:>16.2f}" for p in ps)
                          + f" {min(ps):>6.2f}")
        print("\nrepeat noise (1 sd, relative; from the repeats) and configurations within "
              "each criterion of the optimum:")
        for lab, c in zip(labels, cases.values()):
            rn, cw = c["repeat_noise"], c["configs_within"]
            print(f"  {lab:16s} {c['configs']:3d} configs, {rn['n']} repeats; energy "
                  f"{rn['energy'] * 100:.2f}% {cw['energy']}, time {rn['time'] * 100:.2f}% "
                  f"{cw['time']}")
    elapsed = time.perf_counter() - t_start
    print(f"({len(results)} replayed searches, {elapsed:.0f} s)")

    if args.json is not None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                    capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = None
        out = {"what": "default MultiPassSearch replayed on measured grids: probability of "
                       "finding the energy and time optima (or a point within one repeat "
                       "standard deviation of them) within B profiles",
               "measured": "grids measured on 2x H200 (NVLink); searches replayed on CPU",
               "command": "python bench/small_budget.py " + " ".join(sys.argv[1:]),
               "commit": commit, "machine": platform.platform(),
               "cpus": os.cpu_count(), "seeds": list(seeds), "budgets": budgets,
               "prior_mean": args.prior_mean, "elapsed_s": elapsed,
               "cases": list(cases.values())}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
