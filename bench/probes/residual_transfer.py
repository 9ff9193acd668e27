"""Does a GPU's deviation from the model transfer between the partition types of one job?

A search with a prior mean (``optimize(prior_model=...)``) models the residual, log measured
over the model's prediction, of each partition type on its own. If the GPU deviated from the
model in the same way for every type (a collective rate, a tensor-core efficiency), the
residual learnt on the types searched first would tell the later types' searches where to
look. This probe measures the most any such transfer could give, EMULATED: the "GPU" is
``EmulatedGPU.perturbed(seed)`` of the job's preset, the model the preset itself, and each
type's residual over its whole space is known noise-free. The residual's part along the clock
(its mean per clock, which the baselines' measurements at every clock give each search
anyway) is taken out; what is left is what 16 profiles must learn (SM counts, slots). For
each type a Gaussian process is fitted on every other type's residuals (400 of them, drawn
at random), or on those of the types with the same collective, and scored on the type's
whole space: the R^2 of the residual it explains, for time and for dynamic energy.

Usage::

    python bench/probes/residual_transfer.py --seeds 0,1 \\
        --json bench/probes/results/residual_transfer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402 (after the BLAS thread settings)

from kareus.compose import kareus_types  # noqa: E402 (after the BLAS thread settings)
from kareus.model import Workload  # noqa: E402 (after the BLAS thread settings)
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler  # noqa: E402 (after the BLAS thread settings)
from kareus.search import GaussianProcessSurrogate, search_features  # noqa: E402 (after the BLAS thread settings)

#: The jobs (bench/baseline_dominance.py's, by label): (preset, GPU, workload keywords).
JOBS = {
    "readme": ("qwen3-1.7b", "a100-40gb",
               dict(tp=4, cp=2, pp=2, num_microbatches=8, microbatch_size=16, seq_len=4096)),
    "llama3b-tp4": ("llama3.2-3b", "h200-sxm",
                    dict(tp=4, pp=2, num_microbatches=8, microbatch_size=8, seq_len=4096)),
}
#: The GP's columns of ``search_features``: MHz, SMs (log), slot log intensity,
#: sequential, hide balance.
COLUMNS = (0, 1, 3, 4, 6)


def residuals(job: str, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per split type: (features, time residual, dynamic-energy residual), each residual
    with its mean per clock taken out."""
    preset, gpu, kw = JOBS[job]
    model = EmulatedGPU.from_spec(gpu)
    prior, truth = EmulatedProfiler(model, noise=0.0), EmulatedProfiler(model.perturbed(seed),
                                                                        noise=0.0)
    out = {}
    for key, part in kareus_types(Workload.preset(preset, **kw)).items():
        if "@" in key:  # the unsplit types: no collective beside computation
            continue
        space = prior.space(part)
        a = [prior.measure(part, c) for c in space.configs]
        b = [truth.measure(part, c) for c in space.configs]
        feats = search_features(space)
        res = []
        for get in (lambda m: m.time_s, lambda m: m.dynamic_energy_j):
            r = np.log([get(m) for m in b]) - np.log([get(m) for m in a])
            for f in np.unique(feats[:, 0]):
                r[feats[:, 0] == f] -= r[feats[:, 0] == f].mean()
            res.append(r)
        out[key] = (feats, res[0], res[1])
    return out


def transfer(data: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], *,
             same_collective: bool) -> list[dict[str, object]]:
    kind = {k: k.rsplit("_", 1)[-1] for k in data}
    rng = np.random.default_rng(0)
    rows = []
    for key, (feats, rt, rd) in data.items():
        src = [k for k in data if k != key and (not same_collective or kind[k] == kind[key])]
        if not src:
            continue
        row: dict[str, object] = {"type": key, "from": src}
        for name, col in (("time", 1), ("dynamic_energy", 2)):
            x = np.vstack([data[k][0] for k in src])
            y = np.concatenate([data[k][col] for k in src])
            pick = rng.choice(len(x), size=min(400, len(x)), replace=False)
            gp = GaussianProcessSurrogate(features=COLUMNS, log_features=(1,), seed=0)
            gp.fit(x[pick], y[pick])
            target = rt if col == 1 else rd
            err = target - gp.predict(feats)
            row[f"r2_{name}"] = float(1 - np.mean(err ** 2) / np.var(target))
            row[f"sd_{name}"] = float(np.std(target))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    results = []
    for job in args.jobs.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            data = residuals(job, seed)
            for same in (False, True):
                rows = transfer(data, same_collective=same)
                summary = {f"median_r2_{n}": statistics.median(r[f"r2_{n}"] for r in rows)
                           for n in ("time", "dynamic_energy")}
                results.append({"job": job, "seed": seed, "from": "same collective" if same
                                else "every other type", **summary, "types": rows})
                print(f"{job:<12} seed {seed} from {results[-1]['from']:<16} median R^2 "
                      f"time {summary['median_r2_time']:.2f}, dynamic energy "
                      f"{summary['median_r2_dynamic_energy']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "emulated": True, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "command": " ".join(sys.argv), "results": results},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
