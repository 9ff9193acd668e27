"""Iteration composition: a monotone frontier over the pipeline DAG whose plans add up."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose import (
    IterationComposer,
    IterationContext,
    MicrobatchChoice,
    MicrobatchFrontier,
    MicrobatchPoint,
)
from kareus.model.config import ScheduleConfig
from kareus.model.pipeline import one_f_one_b


def test_select(composed):
    fr = composed["kareus"]
    fast, slow = fr.points[0], fr.points[-1]
    assert fr.max_throughput() is fast.plan
    assert fr.min_energy() is slow.plan
    mid = fr.points[len(fr) // 2]
    assert fr.select(deadline_s=mid.time_s) is mid.plan
    assert fr.select(energy_budget_j=mid.energy_j) is mid.plan
    assert fr.select(deadline_s=10 * slow.time_s) is slow.plan
    with pytest.raises(ValueError, match="no plan meets the deadline"):
        fr.select(deadline_s=fast.time_s * 0.5)
    with pytest.raises(ValueError, match="energy budget"):
        fr.select(energy_budget_j=slow.energy_j * 0.5)
    with pytest.raises(ValueError, match="exactly one"):
        fr.select()
    assert "kareus" in repr(fr) and "time (s)" in fr.summary()


def test_composer_arguments(composed):
    mf = composed.microbatch["kareus"]
    with pytest.raises(ValueError, match="schedule= or num_microbatches="):
        IterationComposer().compose(mf, static_power_w=1.0, gpu="a100-40gb")
    with pytest.raises(ValueError, match="unit_s"):
        IterationComposer(unit_s=0)
    with pytest.warns(DeprecationWarning, match="IterationContext"):  # earlier releases' form
        old = IterationComposer(resolution=0.05).compose(mf, static_power_w=100.0,
                                                         gpu="a100-40gb", num_microbatches=3)
    fr = IterationComposer(resolution=0.05).compose(mf, IterationContext(
        static_power_w=100.0, gpu="a100-40gb", schedule=one_f_one_b(2, 3)))
    assert fr.stats["unit_s"] > 0 and len(fr) >= 1
    assert [p.plan.digest for p in fr] == [p.plan.digest for p in old]
    with pytest.raises(ValueError, match="static_power_w must be >= 0"):
        IterationContext(static_power_w=-1.0, gpu="a100-40gb", schedule=one_f_one_b(2, 3))
    with pytest.raises(TypeError, match="PipelineSchedule"):
        IterationContext(static_power_w=1.0, gpu="a100-40gb", schedule=None)  # type: ignore[arg-type]


def test_plot_smoke(composed):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = composed["kareus"].plot()
    composed.microbatch["kareus"][(0, "fwd")].plot(ax=None)
    assert ax.get_xlabel().startswith("iteration time")


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 5))
def test_iteration_frontier_invariants(seed, pp, m):
    """Random microbatch frontiers: the iteration frontier is monotone, and every plan's
    computations, looked up in the microbatch frontiers, give its time and energy."""
    rng = np.random.default_rng(seed)
    freqs = [1410, 1200, 1050, 900]
    mfs = {}
    for s in range(pp):
        for ph in ("fwd", "bwd"):
            by_freq = {}
            for f in freqs:
                k = int(rng.integers(1, 4))
                ts = np.sort(rng.uniform(1, 2, k)) * 1410 / f * (2 if ph == "bwd" else 1)
                es = np.sort(rng.uniform(5, 10, k))[::-1] * f / 1410
                by_freq[f] = [MicrobatchPoint(time_s=t, dynamic_energy_j=e, choice=MicrobatchChoice(
                    freq_mhz=f, configs={"t": ScheduleConfig(f, i + 1, None)}))
                    for i, (t, e) in enumerate(zip(ts, es))]
            mfs[(s, ph)] = MicrobatchFrontier.from_fronts(s, ph, by_freq)
    static = float(rng.uniform(0, 20))
    fr = IterationComposer(resolution=0.05).compose(mfs, IterationContext(
        static_power_w=static, gpu="a100-40gb", schedule=one_f_one_b(pp, m)))
    a = fr.array()
    assert len(fr) >= 1
    assert np.all(np.diff(a[:, 0]) > 0) and np.all(np.diff(a[:, 1]) < 0)
    sched = one_f_one_b(pp, m)
    for pt in fr.points:
        durations, dyn = {}, 0.0
        for c in sched.nodes:
            ch = pt.plan.choice(c)
            p = next(p for p in mfs[(c.stage, c.phase)].points if p.choice == ch)
            durations[c] = p.time_s
            dyn += p.dynamic_energy_j
        t = sched.makespan(durations)
        assert t == pytest.approx(pt.time_s, rel=1e-9)
        assert dyn + static * t == pytest.approx(pt.energy_j, rel=1e-9)
