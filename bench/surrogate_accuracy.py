"""Surrogate accuracy: how well each surrogate predicts configurations it has not seen.

The search's choices rest on predictions of time and dynamic energy for unmeasured
configurations. This benchmark fits each surrogate (in :class:`kareus.search.ObjectiveModel`,
log space, on :func:`kareus.search.search_features`) to a training subset and scores
its predictions on the rest, for

* ``gp``: :func:`kareus.search.default_surrogate` (a Gaussian process, the default);
* ``trees``: :func:`kareus.search.tree_surrogate` (a bootstrap ensemble of five XGBoost
  models, the reference artifact's learner and kareus's default before the GP).

Two sources:

* **measured**: two 2x H200 (NVLink) grids of Llama 3.2 3B ``fwd_attn`` and ``fwd_mlp`` at
  TP=2 at the default clock (5 launch slots + sequential), measured with NVML's energy
  counter: ``data/h200_llama3b_tp2_grid.json`` (6 SM counts, 36 configurations each;
  training sets of 10 and 18) and ``data/h200_llama3b_tp2_grid13.json`` (13 SM counts,
  1-32, 78 configurations each; training sets of 16 and 32). Training sets drawn at
  random (50 draws); scored on the other configurations' measured values.
* **emulated**: the 28 partition types of ``bench/search_efficiency.py`` on the
  emulated A100 and H200; training sets of 64 configurations measured with 1% noise,
  drawn at random (3 draws per partition); scored on every configuration's noise-free
  value.

Scores on the held-out configurations:

* ``rmse_log_time``: root-mean-square error of log time (a relative error);
* ``rank_time`` / ``rank_energy``: Spearman rank correlation of predicted and true time
  and total energy (the acquisition passes compare candidates, so order matters);
* ``regret_fastest``: true time of the configuration predicted fastest over the
  fastest one, minus 1;
* ``front_hv`` (emulated only): hypervolume ratio, against the true front, of the 32
  configurations the model predicts best (its predicted Pareto layers, peeled until 32
  are taken), evaluated at their true values: how well a model fitted on 64 random
  profiles points at the front.

Usage::

    python bench/surrogate_accuracy.py [--quick] [--json PATH]

``--quick`` scores the measured grid and 6 emulated partitions with 1 draw each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

# One BLAS thread (see bench/search_efficiency.py): small matrices.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import search_efficiency as se  # noqa: E402

from kareus.model import ConfigSpace, Workload, build_partitions  # noqa: E402
from kareus.search import SURROGATES, ObjectiveModel, search_features  # noqa: E402
from kareus.search.pareto import (  # noqa: E402
    hypervolume,
    pareto_front,
    pareto_mask,
    reference_point,
)

# Measured grids (2x H200, NVLink, TP=2, default clock): file -> training-set sizes.
MEASURED = {ROOT / "data" / "h200_llama3b_tp2_grid.json": (10, 18),
            ROOT / "data" / "h200_llama3b_tp2_grid13.json": (16, 32)}
QUICK_EMULATED = ("llama3.2-3b/a100-40gb/fwd_attn", "llama3.2-3b/h200-sxm/bwd_mlp",
                  "qwen3-1.7b/a100-40gb/fwd_attn_in_ar", "qwen3-1.7b/a100-40gb/fwd_mlp",
                  "qwen3-1.7b/h200-sxm/fwd_attn_out_ag", "qwen3-1.7b/h200-sxm/bwd_attn_in_rs")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (ties broken by order; the values here are continuous)."""
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def predicted_layers(time_s: np.ndarray, energy_j: np.ndarray, k: int) -> np.ndarray:
    """Indices of the first ``k`` configurations by predicted Pareto layer."""
    left = np.arange(len(time_s))
    out: list[int] = []
    while len(out) < k and len(left):
        mask = pareto_mask(np.column_stack([time_s[left], energy_j[left]]))
        layer = left[mask]
        out.extend(layer[np.argsort(time_s[layer])][: k - len(out)].tolist())
        left = left[~mask]
    return np.array(out, dtype=int)


def score(name: str, x: np.ndarray, train: np.ndarray, test: np.ndarray,
          meas_t: np.ndarray, meas_d: np.ndarray, static_w: float, true_t: np.ndarray,
          true_e: np.ndarray, seed: int) -> dict[str, float]:
    model = ObjectiveModel(SURROGATES[name](seed), seed=seed)
    model.fit(x[train], meas_t[train], meas_d[train], static_w)
    pred = model.predict(x[test])
    t, e = true_t[test], true_e[test]
    best = int(np.argmin(pred.time_s))
    return {"rmse_log_time": float(np.sqrt(np.mean(np.square(np.log(pred.time_s / t))))),
            "rank_time": spearman(pred.time_s, t),
            "rank_energy": spearman(pred.total_energy_j, e),
            "regret_fastest": float(t[best] / t.min() - 1)}


def measured(draws: int) -> dict[str, Any]:
    from kareus.profilers.replay import ReplayProfiler

    out: dict[str, Any] = {}
    for path, sizes in MEASURED.items():
        data = json.loads(path.read_text())
        w = data["workload"]
        parts = build_partitions(Workload.preset(
            w["model"], tp=w["tp"], cp=w.get("cp", 1), microbatch_size=w["microbatch_size"],
            seq_len=w["seq_len"], nanobatches=w["nanobatches"]))
        grid = ReplayProfiler(data, kinds=("grid",), samples="mean")
        for pname in grid.partitions:
            part = parts[pname]
            space = grid.space(part)
            ms = [grid.measure(part, c) for c in space.configs]
            tt = np.array([m.time_s for m in ms])
            te = np.array([m.energy_j for m in ms])
            td = np.array([m.dynamic_energy_j for m in ms])
            x = search_features(space)
            for n_train in sizes:
                rows: dict[str, list[dict[str, float]]] = {k: [] for k in SURROGATES}
                for draw in range(draws):
                    perm = np.random.default_rng([draw, n_train]).permutation(len(space))
                    train, test = perm[:n_train], perm[n_train:]
                    for name in SURROGATES:
                        rows[name].append(score(name, x, train, test, tt, td,
                                                ms[0].static_power_w, tt, te, draw))
                key = f"{path.stem}/{pname}/n{n_train}"
                out[key] = {k: _mean(v) for k, v in rows.items()}
                _print_row(f"measured {path.stem} {pname} ({len(space)})", n_train, out[key])
    return out


def emulated(keys: list[str], draws: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, gpu, part in se.partitions(False):
        key = f"{model}/{gpu}/{part.name}"
        if key not in keys:
            continue
        space = ConfigSpace(part, gpu)
        truth = se.ground_truth(space, se.make_profiler("emulated", gpu, 0.0, 0))
        front = pareto_front(truth)
        ref = reference_point(front, 0.1)
        hv_true = hypervolume(front, ref)
        x = search_features(space)
        rows: dict[str, list[dict[str, float]]] = {k: [] for k in SURROGATES}
        for draw in range(draws):
            rng = np.random.default_rng([draw, 64])
            train = rng.permutation(len(space))[:64]
            noisy = se.make_profiler("emulated", gpu, se.NOISE, 5000 + draw)
            mt = np.zeros(len(space))
            md = np.zeros(len(space))
            static_w = 0.0
            for i in train:
                m = noisy.measure(part, space.configs[i])
                mt[i], md[i], static_w = m.time_s, m.dynamic_energy_j, m.static_power_w
            test = np.setdiff1d(np.arange(len(space)), train)
            for name in SURROGATES:
                r = score(name, x, train, test, mt, md, static_w, truth[:, 0], truth[:, 1],
                          draw)
                model_ = ObjectiveModel(SURROGATES[name](draw), seed=draw)
                model_.fit(x[train], mt[train], md[train], static_w)
                pred = model_.predict(x)
                top = predicted_layers(pred.time_s, pred.total_energy_j, 32)
                r["front_hv"] = hypervolume(truth[top], ref) / hv_true
                rows[name].append(r)
        out[key] = {k: _mean(v) for k, v in rows.items()}
        _print_row(f"emulated {key}", 64, out[key])
    return out


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _print_row(label: str, n: int, res: dict[str, dict[str, float]]) -> None:
    cells = " | ".join(
        f"{name}: rmse {r['rmse_log_time']:.4f} rank t/e {r['rank_time']:.3f}/"
        f"{r['rank_energy']:.3f} regret {100 * r['regret_fastest']:.2f}%"
        + (f" fronthv {r['front_hv']:.3f}" if "front_hv" in r else "")
        for name, r in res.items())
    print(f"{label:48s} n={n:<3d} {cells}", flush=True)


def summary(block: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Median over partitions of each score, per surrogate."""
    out: dict[str, dict[str, float]] = {}
    for name in SURROGATES:
        keys = next(iter(block.values()))[name].keys()
        out[name] = {k: float(np.median([v[name][k] for v in block.values()])) for k in keys}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.time()
    result: dict[str, Any] = {
        "command": "python bench/surrogate_accuracy.py" + (" --quick" if args.quick else ""),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (the measured grid: 2x "
                   "NVIDIA H200 SXM, NVLink; the rest EMULATED)",
        "surrogates": {name: repr(make(0)) for name, make in SURROGATES.items()},
    }
    result["measured"] = measured(10 if args.quick else 50)
    keys = (list(QUICK_EMULATED) if args.quick else
            [f"{m}/{g}/{p.name}" for m, g, p in se.partitions(False)])
    result["emulated"] = emulated(keys, 1 if args.quick else 3)
    result["summary"] = {"measured": summary(result["measured"]),
                         "emulated": summary(result["emulated"])}
    result["elapsed_s"] = time.time() - t0
    print("\nmedian over partitions")
    print("| source | surrogate | rmse log time | rank time | rank energy | regret fastest "
          "| front hv |")
    print("|---|---|---|---|---|---|---|")
    for src, block in result["summary"].items():
        for name, r in block.items():
            print(f"| {src} | {name} | {r['rmse_log_time']:.4f} | {r['rank_time']:.3f} | "
                  f"{r['rank_energy']:.3f} | {100 * r['regret_fastest']:.2f}% | "
                  f"{r.get('front_hv', float('nan')):.3f} |")
    print(f"({result['elapsed_s']:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
