"""Microbatch composition: exact Pareto sums, count weighting, predicted points, speed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose import MicrobatchContext
from kareus.compose.microbatch import MicrobatchComposer, pareto_sum
from kareus.model.config import ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.partition import build_partitions
from kareus.search.pareto import pareto_front
from kareus.search.partition_frontier import Observation, PartitionFrontier
from kareus.workflow import measure_outside_work

fronts_st = st.lists(
    st.lists(st.tuples(st.floats(0.1, 10), st.floats(0.1, 10)), min_size=1, max_size=6),
    min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(fronts_st)
def test_pareto_sum_matches_cartesian_product(fronts):
    arrays = [(np.array([p[0] for p in f]), np.array([p[1] for p in f])) for f in fronts]
    T, E, picks = pareto_sum(arrays)
    sums = [(sum(p[0] for p in combo), sum(p[1] for p in combo))
            for combo in itertools.product(*fronts)]
    expected = pareto_front(np.array(sums))
    got = np.column_stack([T, E])
    assert np.allclose(pareto_front(got), expected)
    # Every point keeps its picks: re-summing them gives the point.
    for t, e, row in zip(T, E, picks):
        assert t == pytest.approx(sum(fronts[k][i][0] for k, i in enumerate(row)))
        assert e == pytest.approx(sum(fronts[k][i][1] for k, i in enumerate(row)))
    assert np.all(np.diff(T) > 0) and np.all(np.diff(E) < 0)


def _obs(freq, sms, t, dyn, predicted=False, static=10.0):
    return Observation(config=ScheduleConfig(freq, sms, None),
                       measurement=Measurement(time_s=t, energy_j=dyn + static * t,
                                               static_power_w=static),
                       predicted=predicted)


def _frontiers_for(pset, freqs, rng, predicted_freqs=()):
    out = {}
    for name in pset.types:
        obs = []
        for f in freqs:
            for sms in (2, 4, 8):
                t = rng.uniform(1, 2) * 1e-3 * 1410 / f
                obs.append(_obs(f, sms, t, rng.uniform(0.5, 1.0) * f / 1410,
                                predicted=f in predicted_freqs))
        out[name] = PartitionFrontier.from_observations(name, "a100-40gb", obs)
    return out


def test_composer_weights_by_counts_and_scales_to_stage(tiny_workload, fake_profiler):
    pset = build_partitions(tiny_workload)
    rng = np.random.default_rng(0)
    freqs = [1410, 1200]
    pfs = _frontiers_for(pset, freqs, rng)
    outside = measure_outside_work(fake_profiler, pset, freqs)
    mfs = MicrobatchComposer().compose(pfs, MicrobatchContext(partitions=pset, outside=outside))
    assert set(mfs) == {(s, ph) for s in range(2) for ph in ("fwd", "bwd")}
    dp = tiny_workload.parallelism.dp
    for (stage, phase), mf in mfs.items():
        assert mf.freqs_mhz == [1410, 1200]
        for p in mf.points:
            t = outside[(stage, phase)][p.freq_mhz].time_s
            e = outside[(stage, phase)][p.freq_mhz].dynamic_energy_j
            for name, count in pset.counts[phase].items():
                o = next(o for o in pfs[name].observations if o.config == p.choice.config(name))
                t += count * o.time_s
                e += count * o.dynamic_energy_j
            assert p.time_s == pytest.approx(t)
            assert p.dynamic_energy_j == pytest.approx(e * dp)
        times = [p.time_s for p in mf.points]
        energies = [p.dynamic_energy_j for p in mf.points]
        assert times == sorted(times) and energies == sorted(energies, reverse=True)
    assert "MicrobatchFrontier(stage 0 fwd" in repr(mfs[(0, "fwd")])


def test_predicted_points_only_when_allowed(tiny_workload):
    pset = build_partitions(tiny_workload)
    rng = np.random.default_rng(1)
    pfs = _frontiers_for(pset, [1410, 1200], rng, predicted_freqs=(1200,))
    measured = MicrobatchComposer().compose(pfs, MicrobatchContext(partitions=pset))
    assert all(mf.freqs_mhz == [1410] for mf in measured.values())
    assert not any(p.predicted for mf in measured.values() for p in mf.points)
    with_pred = MicrobatchComposer(include_predicted=True).compose(
        pfs, MicrobatchContext(partitions=pset))
    for mf in with_pred.values():
        assert mf.freqs_mhz == [1410, 1200]
        assert all(p.predicted for p in mf.at(1200))
        assert not any(p.predicted for p in mf.at(1410))


def test_missing_type_is_an_error(tiny_workload):
    pset = build_partitions(tiny_workload)
    pfs = _frontiers_for(pset, [1410], np.random.default_rng(2))
    pfs.pop(next(iter(pfs)))
    with pytest.raises(ValueError, match="no partition frontier"):
        MicrobatchComposer().compose(pfs, MicrobatchContext(partitions=pset))


def test_the_keyword_form_of_earlier_releases_still_composes_with_a_warning(tiny_workload):
    pset = build_partitions(tiny_workload)
    pfs = _frontiers_for(pset, [1410], np.random.default_rng(3))
    with pytest.warns(DeprecationWarning, match="MicrobatchContext"):
        old = MicrobatchComposer().compose(pfs, partitions=pset)
    new = MicrobatchComposer().compose(pfs, MicrobatchContext(partitions=pset))
    assert {k: v.to_json() for k, v in old.items()} == {k: v.to_json() for k, v in new.items()}
    with pytest.raises(TypeError, match="not both"):
        MicrobatchComposer().compose(pfs, MicrobatchContext(partitions=pset), outside=None)
    with pytest.raises(TypeError, match="must be a MicrobatchContext"):
        MicrobatchComposer().compose(pfs, pset)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PartitionSet"):
        MicrobatchContext(partitions=None)  # type: ignore[arg-type]


def test_four_types_of_thirty_points_compose_to_a_front_of_their_sums():
    # One microbatch composition's size (4 partition types, 30-point fronts). Its speed is a
    # benchmark's figure, not a unit test's bound (a loaded CI machine makes wall-clock
    # bounds flaky): bench/compose.py reports it as microbatch_compose_s (4 types x 18
    # clocks x 30 points, target <= 1 s).
    rng = np.random.default_rng(3)
    fronts = []
    for _ in range(4):
        t = np.sort(rng.uniform(1, 2, 30))
        fronts.append((t, np.sort(rng.uniform(1, 2, 30))[::-1]))
    T, E, picks = pareto_sum(fronts)
    assert picks.shape == (len(T), 4) and len(T) > 30
    assert np.all(np.diff(T) > 0) and np.all(np.diff(E) < 0)  # sorted, none dominated
    # each point is the sum of one pick per front
    assert np.allclose(T, sum(t[picks[:, k]] for k, (t, _) in enumerate(fronts)))
    assert np.allclose(E, sum(e[picks[:, k]] for k, (_, e) in enumerate(fronts)))
    assert T[0] == pytest.approx(sum(t.min() for t, _ in fronts))  # the fastest
    assert E[-1] == pytest.approx(sum(e.min() for _, e in fronts))  # the thriftiest
