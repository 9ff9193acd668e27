"""kareus.testing: the FakeProfiler behaves physically, and the conformance suites catch
broken plug-ins."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.errors import UnknownSlotError
from kareus.model import ConfigSpace, Measurement, ScheduleConfig, Workload, build_partitions
from kareus.search import AcquisitionPass, HypervolumePass, XGBoostSurrogate
from kareus.testing import (
    FakeProfiler,
    check_acquisition_pass,
    check_surrogate,
    make_acquisition_context,
)


@pytest.fixture(scope="module")
def part():
    return build_partitions(Workload.preset("llama3.2-3b", tp=4, microbatch_size=8))["fwd_attn"]


def test_fake_profiler_physics(part):
    prof = FakeProfiler("a100-40gb")
    fast = prof.measure(part, ScheduleConfig(1410, 8, "qkv"))
    slow = prof.measure(part, ScheduleConfig(900, 8, "qkv"))
    assert isinstance(fast, Measurement)
    assert slow.time_s > fast.time_s  # lower clock, longer run
    assert slow.dynamic_energy_j < fast.dynamic_energy_j  # but less dynamic energy
    assert fast.static_power_w == pytest.approx(85.0 * 4)  # scope: the TP group
    seq = prof.measure(part, ScheduleConfig(1410, 8, None))
    assert seq.time_s > fast.time_s  # overlap pays here
    starved = prof.measure(part, ScheduleConfig(1410, 1, "qkv"))
    assert starved.time_s > fast.time_s  # one SM leaves the collective exposed
    assert len(prof.calls) == 4 and prof.calls[0] == ("fwd_attn", ScheduleConfig(1410, 8, "qkv"))


def test_fake_profiler_noise_is_seeded(part):
    cfg = ScheduleConfig(1200, 4, "rope")
    a = [FakeProfiler(noise=0.05, seed=3).measure(part, cfg) for _ in range(2)]
    assert a[0] == a[1]
    prof = FakeProfiler(noise=0.05, seed=3)
    b = [prof.measure(part, cfg).time_s for _ in range(20)]
    assert np.std(np.log(b)) == pytest.approx(0.05, rel=0.5)
    exact = FakeProfiler().measure(part, cfg)
    assert np.median(b) == pytest.approx(exact.time_s, rel=0.05)
    with pytest.raises(ValueError):
        FakeProfiler(noise=-1)
    with pytest.raises(UnknownSlotError):
        FakeProfiler().measure(part, ScheduleConfig(1200, 4, "no_such_op"))


def test_fake_profiler_has_a_time_energy_tradeoff(part):
    from kareus.search.pareto import pareto_front

    space = ConfigSpace(part, "a100-40gb", comm_sms=[2, 4, 8, 16])
    prof = FakeProfiler()
    pts = np.array([(m.time_s, m.energy_j) for m in
                    (prof.measure(part, c) for c in space.configs)])
    assert len(pareto_front(pts)) >= 3


class _WrongShape(XGBoostSurrogate):
    def predict(self, X):
        return super().predict(X).reshape(-1, 1)


class _ForgetsToReset(XGBoostSurrogate):
    def clone(self, *, seed=None):
        return self


class _NoZeroRows(XGBoostSurrogate):
    """Refuses to predict nothing (as scikit-learn's models do)."""

    def predict(self, X):
        if len(X) == 0:
            raise ValueError("Found array with 0 sample(s)")
        return super().predict(X)


class _Leaky(AcquisitionPass):
    """Ignores availability."""

    def select(self, context, k):
        return np.arange(min(k, context.n_candidates))


class _Lazy(AcquisitionPass):
    """Never fills its share."""

    def select(self, context, k):
        return np.flatnonzero(context.available)[: max(0, k - 1)]


def test_conformance_accepts_the_defaults():
    check_surrogate(lambda: XGBoostSurrogate(n_estimators=20))
    check_acquisition_pass(HypervolumePass)


@pytest.mark.parametrize(("make", "check"), [(_WrongShape, "fit_predict_shapes"),
                                              (_ForgetsToReset, "clone")])
def test_conformance_catches_broken_surrogates(make, check):
    with pytest.raises(AssertionError, match=check):
        check_surrogate(lambda: make(n_estimators=10))


def test_an_exception_a_surrogate_raises_is_reported_against_its_check():
    with pytest.raises(AssertionError) as err:
        check_surrogate(lambda: _NoZeroRows(n_estimators=10))
    assert str(err.value) == ("surrogate conformance check 'zero_rows' failed: it raised "
                              "ValueError: Found array with 0 sample(s)")
    assert isinstance(err.value.__cause__, ValueError)


def test_conformance_skip():
    check_surrogate(lambda: _WrongShape(n_estimators=10),
                    skip=("fit_predict_shapes", "zero_rows", "learns", "tiny_and_constant",
                          "spread", "deterministic", "no_mutation", "clone"))


@pytest.mark.parametrize("make", [_Leaky, _Lazy])
def test_conformance_catches_broken_passes(make):
    with pytest.raises(AssertionError, match="basic"):
        check_acquisition_pass(make)


def test_conformance_suites_reject_non_plugins():
    with pytest.raises(AssertionError):
        check_surrogate(lambda: object())  # type: ignore[arg-type, return-value]
    with pytest.raises(AssertionError):
        check_acquisition_pass(lambda: object())  # type: ignore[arg-type, return-value]


def test_make_acquisition_context():
    ctx = make_acquisition_context(n=50, m=4, n_chosen=3, spread=False)
    assert ctx.n_candidates == 50 and len(ctx.chosen) == 3
    assert not ctx.available[ctx.chosen].any()
    assert ctx.prediction.spread is None


def test_make_workload_plan_makes_a_plan_that_saves_and_loads(tmp_path):
    # Its figures are placeholders, but consistent ones: a plan file a user writes with it
    # loads back (energy = dynamic + static power x time), splits and unsplit choices alike.
    from kareus.compose import Plan
    from kareus.model.workload import Parallelism
    from kareus.testing import make_workload_plan

    wl = Workload(model="qwen3-1.7b", parallelism=Parallelism(tp=2, pp=2),
                  microbatch_size=2, seq_len=512, num_microbatches=4)
    plan = make_workload_plan(wl, freqs_mhz=(1980, 1410), unsplit_microbatches=(1,))
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back.digest == plan.digest
    assert back.energy_j == pytest.approx(back.dynamic_energy_j
                                          + back.static_power_w * back.time_s)
