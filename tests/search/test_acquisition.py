"""Acquisition passes: conformance, and each pass's choice on small hand-made cases."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given
from hypothesis import strategies as st

from kareus.search import ObjectivePrediction
from kareus.search.acquisition import (
    AcquisitionContext,
    AcquisitionPass,
    ClockSweepPass,
    FastestPass,
    HingePass,
    HypervolumePass,
    NeighbourhoodPass,
    RandomPass,
    UncertaintyPass,
    allocate,
)
from kareus.testing import AcquisitionPassConformance, make_acquisition_context

P_STATIC = 1.0


class TestHypervolumeTotal(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return HypervolumePass("total")


class TestHypervolumeDynamicDenoised(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return HypervolumePass("dynamic", front="denoised")


class TestHypervolumeStaticTopK(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return HypervolumePass("static", greedy=False, optimism=1.0)


class TestUncertainty(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return UncertaintyPass()


class TestFastest(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return FastestPass()


class TestRandom(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return RandomPass()


class TestNeighbourhood(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return NeighbourhoodPass()


class TestHinge(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return HingePass()


class TestClockSweep(AcquisitionPassConformance):
    def make_pass(self) -> AcquisitionPass:
        return ClockSweepPass()


def context(time_s, dynamic_j, *, observed, spread=None, available=None, features=None,
            observed_index=None) -> AcquisitionContext:
    """Candidates given by predicted (time, dynamic energy); observed (time, dynamic) pairs."""
    t = np.asarray(time_s, dtype=float)
    obs = np.asarray(observed, dtype=float).reshape(-1, 2)
    pred = ObjectivePrediction(
        time_s=t, dynamic_energy_j=np.asarray(dynamic_j, dtype=float), static_power_w=P_STATIC,
        time_spread=None if spread is None else np.asarray(spread, dtype=float),
        dynamic_spread=None if spread is None else np.zeros(len(t)))
    return AcquisitionContext(
        prediction=pred,
        available=np.ones(len(t), dtype=bool) if available is None else available,
        observed_time_s=obs[:, 0], observed_energy_j=obs[:, 1] + P_STATIC * obs[:, 0],
        observed_static_power_w=np.full(len(obs), P_STATIC), features=features,
        observed_index=observed_index)


# Measured front in (time, dynamic): (1.0, 10), (2.0, 5); in (time, total): (1, 11), (2, 7).
# Static 1 W.
OBSERVED = [(1.0, 10.0), (2.0, 5.0)]


def test_hypervolume_total_prefers_the_largest_improvement():
    # 0: dominated; 1: small gain; 2: large gain (fast and frugal); 3: slow and wasteful.
    ctx = context([1.5, 1.9, 1.2, 3.0], [10.0, 4.9, 6.0, 12.0], observed=OBSERVED)
    assert HypervolumePass("total").select(ctx, 1).tolist() == [2]
    assert HypervolumePass("total").select(ctx, 2).tolist() == [2, 1]


def test_hypervolume_energy_kinds_pick_differently():
    # In total energy the fast candidate 0 wins; in dynamic energy the frugal but slow
    # candidate 1 wins; in static energy only speed counts.
    ctx = context([0.2, 2.05, 1.9], [10.5, 1.0, 6.0], observed=OBSERVED)
    assert HypervolumePass("total").select(ctx, 1).tolist() == [0]
    assert HypervolumePass("dynamic").select(ctx, 1).tolist() == [1]
    assert HypervolumePass("static").select(ctx, 1).tolist() == [0]


def test_greedy_spreads_a_batch_along_the_front():
    # Candidates 0 and 1 are nearly the same point with the largest gains; 2 improves
    # elsewhere. Greedy takes 0, then sees 1 as worthless next to it and takes 2.
    ctx = context([1.2, 1.2001, 1.9], [6.0, 6.0, 4.0], observed=OBSERVED)
    assert HypervolumePass("total", greedy=False).select(ctx, 1).tolist() == [0]
    assert HypervolumePass("total", greedy=True).select(ctx, 2).tolist() == [0, 2]
    assert sorted(HypervolumePass("total", greedy=False).select(ctx, 2).tolist()) == [0, 1]


def test_dominated_candidates_rank_by_closeness_to_the_front():
    ctx = context([3.0, 2.05, 4.0], [9.0, 5.1, 20.0], observed=OBSERVED)
    assert HypervolumePass("total").select(ctx, 3).tolist() == [1, 0, 2]


def test_optimism_rewards_uncertain_candidates():
    # Candidate 1's mean is a little worse than candidate 0's but it is far less certain.
    ctx = context([1.3, 1.35], [6.0, 6.0], observed=OBSERVED, spread=[0.0, 0.5])
    assert HypervolumePass("total").select(ctx, 1).tolist() == [0]
    assert HypervolumePass("total", optimism=1.0).select(ctx, 1).tolist() == [1]


def test_denoised_front_uses_predicted_values_of_measured_configs():
    # Candidate 0 was measured with lucky noise (dynamic 4.0) but is predicted at 6.0.
    # The measured front dominates both candidates and 2 is closer to it; against the
    # denoised front (1.5, 6.0) candidate 1 is the larger improvement.
    t, d = [1.5, 1.5, 1.6], [6.0, 5.0, 4.2]
    ctx = context(t, d, observed=[(1.5, 4.0)], available=np.array([False, True, True]),
                  observed_index=np.array([0]))
    assert HypervolumePass("dynamic").select(ctx, 1).tolist() == [2]
    assert HypervolumePass("dynamic", front="denoised").select(ctx, 1).tolist() == [1]


def test_uncertainty_picks_the_largest_spread():
    ctx = context([1.0, 1.0, 1.0, 1.0], [5.0] * 4, observed=OBSERVED, spread=[0.1, 0.4, 0.0, 0.3])
    assert UncertaintyPass().select(ctx, 2).tolist() == [1, 3]


def test_fastest_picks_lowest_predicted_time():
    ctx = context([3.0, 0.9, 2.0], [1.0, 50.0, 1.0], observed=OBSERVED)
    assert FastestPass().select(ctx, 2).tolist() == [1, 2]


def test_no_pass_picks_unavailable_or_chosen():
    ctx = context([0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], observed=OBSERVED,
                  spread=[1.0, 0.9, 0.8, 0.7],
                  available=np.array([False, True, True, True])).with_chosen([1])
    for p in (HypervolumePass("total"), HypervolumePass("static"), UncertaintyPass(),
              FastestPass(), RandomPass(), NeighbourhoodPass(), HingePass()):
        got = p.select(ctx, 4).tolist()
        assert sorted(got) == [2, 3], p


def test_neighbourhood_looks_near_the_front():
    # Features: (freq, SMs, slot-a, slot-b, seq). Grid: 2 freqs x 5 SM counts x 1 slot.
    feats = np.array([(f, s, 0.0, 0.0, 0.0) for f in (1000.0, 1400.0)
                      for s in (1.0, 2.0, 4.0, 8.0, 16.0)])
    n = len(feats)
    # Measured: config 1 (1000 MHz, 2 SMs) on the front; predicted everywhere flat except a
    # far candidate (1000 MHz, 16 SMs) that looks great.
    t = np.full(n, 2.0)
    d = np.full(n, 10.0)
    t[4], d[4] = 1.0, 1.0
    available = np.ones(n, dtype=bool)
    available[1] = False
    ctx = context(t, d, observed=[(2.0, 10.0)], available=available, features=feats,
                  observed_index=np.array([1]))
    local = NeighbourhoodPass(steps=(None, 2, None))
    masks = local.neighbours(ctx)
    near = np.flatnonzero(np.logical_or.reduce(masks)).tolist()
    # Same SMs at the other frequency (6), +-2 SM steps at the same frequency (0, 2, 3).
    assert near == [0, 2, 3, 6]
    got = local.select(ctx, 4).tolist()
    assert sorted(got) == [0, 2, 3, 6]
    # Asked for more than the neighbourhood holds, it falls back to the whole space,
    # where candidate 4 wins.
    assert local.select(ctx, 5).tolist()[-1] == 4
    # The default radius (4 SM steps) reaches it directly.
    assert 4 in NeighbourhoodPass().select(ctx, 4).tolist()
    # A derived feature column in no knob (here a ratio) does not restrict neighbours.
    ratio = np.column_stack([feats, feats[:, 1] / feats[:, 0]])
    ctx2 = context(t, d, observed=[(2.0, 10.0)], available=available, features=ratio,
                   observed_index=np.array([1]))
    assert np.flatnonzero(np.logical_or.reduce(local.neighbours(ctx2))).tolist() == near
    # Without features it behaves as a plain hypervolume pass.
    plain = context(t, d, observed=[(2.0, 10.0)], available=available)
    assert NeighbourhoodPass().select(plain, 1).tolist() == [4]


def _hinge_context(measured: list[int]) -> AcquisitionContext:
    # Features (freq, SMs, slot-a, slot-b, seq): 2 clocks x SM counts 1..16, one slot.
    # Index i < 16 is 1400 MHz with i + 1 SMs; i >= 16 is 1000 MHz. Predicted: 16 SMs at
    # 1400 MHz (index 15) is the fastest and cheapest; everything else is worse.
    feats = np.array([(f, s, 0.0, 0.0, 0.0) for f in (1400.0, 1000.0)
                      for s in range(1, 17)])
    n = len(feats)
    t = np.full(n, 3.0)
    d = np.full(n, 3.0)
    t[15], d[15] = 1.0, 1.0
    available = np.ones(n, dtype=bool)
    available[measured] = False
    return context(t, d, observed=[(t[i], d[i]) for i in measured], available=available,
                   features=feats, observed_index=np.array(measured))


def test_hinge_bisects_below_the_front_configuration():
    # Front: 16 SMs at 1400 MHz; 2 SMs measured there: halfway is 9 SMs (index 8).
    # Measurements at the other clock (1 and 8 SMs at 1000 MHz) do not narrow the gap.
    assert HingePass().select(_hinge_context([1, 15, 16, 23]), 1).tolist() == [8]
    # With 9 SMs measured, the next step is 13 SMs (index 12), then 15, then 16 is
    # bracketed (15 SMs measured) and nothing is left to bisect.
    assert HingePass().proposals(_hinge_context([1, 8, 15])).tolist() == [12]
    assert HingePass().proposals(_hinge_context([1, 8, 12, 15])).tolist() == [14]
    assert HingePass().proposals(_hinge_context([1, 8, 12, 14, 15])).tolist() == []
    # Nothing measured below: half the front configuration's SM count (8 SMs, index 7).
    assert HingePass().proposals(_hinge_context([15])).tolist() == [7]


def test_hinge_fills_its_share_from_the_hypervolume_pass():
    measured = [1, 8, 12, 14, 15]
    got = HingePass().select(_hinge_context(measured), 2).tolist()
    want = HypervolumePass("total", front="denoised").select(_hinge_context(measured), 2)
    assert got == want.tolist()
    # Without features or observed indices it is a plain hypervolume pass.
    plain = context([2.0, 1.0, 3.0], [1.0, 1.0, 1.0], observed=OBSERVED)
    assert HingePass().select(plain, 1).tolist() == [1]
    # No group columns: every configuration is one group, so SM counts measured at the
    # other clock count too (8 SMs at 1000 MHz, index 23, narrows 16 down to 12).
    assert HingePass(group_columns=()).proposals(_hinge_context([15, 23])).tolist() == [11]


def _backend_features() -> np.ndarray:
    # (freq, SMs, slot-a, slot-b, seq, 3 derived, backend): 1400 MHz, SMs 1..16, two
    # backends; index i < 16 is backend 0 with i + 1 SMs, i >= 16 backend 1.
    return np.array([(1400.0, s, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, b) for b in (0.0, 1.0)
                     for s in range(1, 17)])


def test_hinge_bisects_within_one_backend():
    # Front: 16 SMs on backend 0 (index 15). 8 SMs measured on backend 1 (index 23) is
    # another collective's hinge and must not narrow the gap: the bisection proposes
    # half of 16 on backend 0 (index 7), as if nothing were measured below.
    feats = _backend_features()
    n = len(feats)
    t, d = np.full(n, 3.0), np.full(n, 3.0)
    t[15], d[15] = 1.0, 1.0
    measured = [15, 23]
    available = np.ones(n, dtype=bool)
    available[measured] = False
    ctx = context(t, d, observed=[(t[i], d[i]) for i in measured], available=available,
                  features=feats, observed_index=np.array(measured))
    assert HingePass().proposals(ctx).tolist() == [7]
    # Ignoring the backend (the behaviour before it was a column), 8 SMs would count.
    assert HingePass(extra_group_from=None).proposals(ctx).tolist() == [11]
    with pytest.raises(ValueError, match="group column"):
        HingePass(sm_column=9)


def test_neighbourhood_treats_the_backend_as_a_knob():
    # The front configuration (index 3: 4 SMs on backend 0): its SM neighbours stay on
    # backend 0, and its backend neighbour is 4 SMs on backend 1 (index 19).
    feats = _backend_features()
    n = len(feats)
    t, d = np.full(n, 2.0), np.full(n, 10.0)
    available = np.ones(n, dtype=bool)
    available[3] = False
    ctx = context(t, d, observed=[(2.0, 10.0)], available=available, features=feats,
                  observed_index=np.array([3]))
    freq, sms, slot, backend = NeighbourhoodPass(steps=(None, 2, None)).neighbours(ctx)
    assert np.flatnonzero(sms).tolist() == [1, 2, 4, 5]
    assert np.flatnonzero(backend).tolist() == [19]
    assert not freq.any() and not slot.any()
    # Knobs given explicitly are used as given.
    assert len(NeighbourhoodPass(knobs=((0,), (1,)), steps=(None, 2)).neighbours(ctx)) == 2


def test_pass_arguments_are_checked():
    with pytest.raises(ValueError):
        HypervolumePass("kinetic")
    with pytest.raises(ValueError):
        HypervolumePass(optimism=-1)
    with pytest.raises(ValueError):
        HypervolumePass(front="guessed")
    with pytest.raises(ValueError):
        NeighbourhoodPass(knobs=[(0,)], steps=[1, 2])
    with pytest.raises(ValueError):
        HingePass(sm_column=1, group_columns=(0, 1))


def test_context_checks_shapes():
    ctx = make_acquisition_context(n=10)
    with pytest.raises(ValueError):
        AcquisitionContext(prediction=ctx.prediction, available=np.ones(3, dtype=bool),
                           observed_time_s=[], observed_energy_j=[],
                           observed_static_power_w=[])
    with pytest.raises(ValueError):
        ctx.observed("kinetic")


def test_allocate_examples():
    assert allocate([0.4, 0.2, 0.2, 0.2], 16) == [7, 3, 3, 3]
    assert allocate([0.4, 0.2, 0.2, 0.2], 32, remainder="last") == [12, 6, 6, 8]
    assert allocate([1, 0], 5) == [5, 0]
    with pytest.raises(ValueError):
        allocate([0, 0], 3)
    with pytest.raises(ValueError):
        allocate([1], 3, remainder="first")


@given(st.lists(st.floats(0, 10), min_size=1, max_size=6).filter(lambda w: sum(w) > 0.01),
       st.integers(0, 100))
def test_allocate_properties(weights, k):
    shares = allocate(weights, k)
    assert sum(shares) == k
    exact = np.asarray(weights) / sum(weights) * k
    assert np.all(np.asarray(shares) >= np.floor(exact - 1e-6))
    assert np.all(np.asarray(shares) <= np.ceil(exact + 1e-6))


def clocked_context(clock_mhz, time_s, dynamic_j, measured, *, chosen=()) -> AcquisitionContext:
    """Candidates at clocks (feature column 0), the ``measured`` ones among them observed at
    their predicted values."""
    f = np.column_stack([np.asarray(clock_mhz, dtype=float), np.ones(len(clock_mhz))])
    t, d = np.asarray(time_s, dtype=float), np.asarray(dynamic_j, dtype=float)
    idx = np.asarray(measured, dtype=np.int64)
    available = np.ones(len(t), dtype=bool)
    available[idx] = False
    ctx = context(t, d, observed=np.column_stack([t[idx], d[idx]]), available=available,
                  features=f, observed_index=idx)
    return ctx.with_chosen(list(chosen)) if chosen else ctx


def test_clock_sweep_spreads_a_batch_over_the_clocks():
    # Three clocks, each with its measured default (0, 3, 6). At 1410 MHz candidate 1
    # improves on the default by a lot (and 2 adds little next to it); at 1200 and 1000 MHz
    # one candidate each improves on its clock's default a little. Over all clocks,
    # candidate 1 dominates the 1200 MHz improvement, so the hypervolume pass never takes
    # it; the composer needs it (it sums the types' fronts at each clock), and the sweep,
    # scoring each clock's own front, takes one candidate per clock.
    clock = [1410, 1410, 1410, 1200, 1200, 1200, 1000, 1000, 1000]
    t = [1.00, 0.90, 0.905, 1.18, 1.16, 1.30, 1.41, 1.39, 1.60]
    d = [10.0, 7.0, 6.98, 8.00, 7.85, 9.00, 6.50, 6.40, 8.00]
    ctx = clocked_context(clock, t, d, [0, 3, 6])
    picks = ClockSweepPass().select(ctx, 3).tolist()
    assert picks[0] == 1
    assert sorted(picks) == [1, 4, 7]
    assert 4 not in HypervolumePass("dynamic", front="denoised").select(ctx, 3).tolist()


def test_clock_sweep_counts_what_the_batch_chose_already():
    # Candidate 1 chosen by an earlier pass of the batch joins its clock's front, so the
    # sweep goes to the other clocks first.
    clock = [1410, 1410, 1410, 1200, 1200, 1000, 1000]
    t = [1.00, 0.90, 0.905, 1.18, 1.16, 1.41, 1.39]
    d = [10.0, 9.0, 8.95, 8.00, 7.85, 6.50, 6.40]
    ctx = clocked_context(clock, t, d, [0, 3, 5], chosen=[1])
    assert sorted(ClockSweepPass().select(ctx, 2).tolist()) == [4, 6]


def test_clock_sweep_scores_a_clock_with_nothing_measured():
    # Nothing measured at 1000 MHz: its candidates still score (against their own best
    # predicted values), so the sweep reaches clocks the measurements have not.
    clock = [1410, 1410, 1000, 1000]
    ctx = clocked_context(clock, [1.0, 0.999, 1.4, 1.5], [10.0, 9.999, 6.0, 6.5], [0])
    picks = ClockSweepPass().select(ctx, 2).tolist()
    assert 2 in picks and len(picks) == 2


@given(st.integers(0, 10_000), st.integers(1, 12), st.integers(0, 4))
def test_clock_sweep_picks_are_valid(seed, k, n_chosen):
    rng = np.random.default_rng(seed)
    n = 60
    clock = rng.choice([1980, 1800, 1500, 1215], n)
    t = rng.uniform(1.0, 2.0, n) * 1980 / clock
    d = rng.uniform(5.0, 10.0, n)
    measured = rng.choice(n, 8, replace=False)
    ctx = clocked_context(clock, t, d, measured)
    if n_chosen:
        ctx = ctx.with_chosen(rng.choice(np.flatnonzero(ctx.available), n_chosen,
                                         replace=False))
    avail = ctx.available.copy()
    picks = ClockSweepPass().select(ctx, k)
    assert np.array_equal(ctx.available, avail)
    assert len(set(picks.tolist())) == len(picks) == min(k, int(avail.sum()))
    assert avail[picks].all()
    again = ClockSweepPass().select(clocked_context(clock, t, d, measured).with_chosen(
        ctx.chosen) if n_chosen else clocked_context(clock, t, d, measured), k)
    assert np.array_equal(picks, again)
