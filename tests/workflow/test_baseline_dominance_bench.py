"""bench/baseline_dominance.py's scores: the chosen plans valued noise-free (--score selected)."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

from kareus.model import Workload
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler
from kareus.workflow import optimize


def test_chosen_plans_measured_without_noise_cost_what_they_claim():
    # With a noise-free profiler the claims are the truth, so re-evaluating every system's
    # chosen plans noise-free must give back each plan's claimed time and energy.
    bench = load_bench("baseline_dominance")
    label, preset, gpu, kw = bench.QUICK_JOBS[0]
    wl = Workload.preset(preset, **kw)
    exact = EmulatedProfiler(EmulatedGPU.from_spec(gpu).perturbed(0), noise=0.0)
    res = optimize(wl, profiler=exact, budget=8, seed=0, progress=False)
    composed = bench.true_frontiers(res, wl, gpu, 0, "perturbed")
    chosen = bench.selected_true(res, wl, gpu, 0, "perturbed", composed.partitions)
    assert set(chosen) == set(res.frontiers)
    for name, points in chosen.items():
        claimed = [(p.time_s, p.energy_j) for p in res.frontiers[name].points]
        assert len(points) == len(claimed) > 0
        for (t, e), (tc, ec) in zip(points, claimed):
            assert t == pytest.approx(tc, rel=1e-12) and e == pytest.approx(ec, rel=1e-12)


def test_the_quick_run_scores_the_chosen_plans(tmp_path):
    import json

    bench = load_bench("baseline_dominance")
    out = tmp_path / "bd.json"
    assert bench.main(["--quick", "--budgets", "8", "--score", "selected", "--smooth",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["score"] for r in rows} == {"measured", "true", "selected"}
    assert all(r["smooth"] for r in rows)
    # claimed frontiers hold every baseline point by construction
    assert all(r["behind"] == 0 for r in rows if r["score"] == "measured")
