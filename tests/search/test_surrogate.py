"""Surrogates: conformance of the defaults, the log-space objective model, ensembles."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search.surrogate import (
    BootstrapEnsemble,
    ObjectiveModel,
    ObjectivePrediction,
    Surrogate,
    XGBoostSurrogate,
)
from kareus.testing import SurrogateConformance


class TestXGBoostConformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return XGBoostSurrogate(n_estimators=40, seed=1)


class TestXGBoostTrendConformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return XGBoostSurrogate(n_estimators=40, seed=1, trend_features=(0,))


class TestEnsembleConformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return BootstrapEnsemble(base=XGBoostSurrogate(n_estimators=30), n_models=3, seed=2)


def test_trend_interpolates_between_seen_frequencies():
    # Trees alone predict in steps; a linear trend in column 0 orders unseen values.
    x_train = np.array([[900.0, 4], [900, 8], [1410, 4], [1410, 8]])
    y_train = -np.log(x_train[:, 0]) + 0.01 * x_train[:, 1]
    x_new = np.array([[1000.0, 4], [1100, 4], [1200, 4], [1300, 4]])
    plain = XGBoostSurrogate(n_estimators=30).fit(x_train, y_train).predict(x_new)
    trend = XGBoostSurrogate(n_estimators=30, trend_features=(0,)).fit(
        x_train, y_train).predict(x_new)
    assert len(set(np.round(plain, 9))) <= 2
    assert np.all(np.diff(trend) < 0)


def test_ensemble_spread_is_zero_on_a_constant_and_positive_on_noise():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(40, 3))
    ens = BootstrapEnsemble(base=XGBoostSurrogate(n_estimators=20), n_models=4, seed=0)
    _, spread = ens.fit(x, np.full(40, 3.0)).predict_spread(x)
    assert np.allclose(spread, 0.0)
    _, spread = ens.fit(x, rng.normal(size=40)).predict_spread(x)
    assert spread.mean() > 0


def test_ensemble_members_see_resamples():
    x = np.arange(20, dtype=float).reshape(-1, 1)
    ens = BootstrapEnsemble(base=XGBoostSurrogate(n_estimators=5), n_models=3, fraction=0.5)
    ens.fit(x, x[:, 0])
    assert len(ens.members) == 3 and all(m.fitted for m in ens.members)
    assert ens.member_predictions(x).shape == (3, 20)


def test_bad_arguments():
    with pytest.raises(ValueError):
        XGBoostSurrogate(n_estimators=0)
    with pytest.raises(ValueError):
        BootstrapEnsemble(n_models=1)
    with pytest.raises(TypeError):
        BootstrapEnsemble(base="xgboost")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ObjectiveModel("xgboost")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fitted on 2"):
        XGBoostSurrogate().fit(np.ones((3, 2)), [1.0, 2, 3]).predict(np.ones((2, 5)))


def test_objective_model_recombines_total_energy():
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(60, 2))
    t = 1e-3 * (1 + x[:, 0])
    d = 2.0 + x[:, 1]
    model = ObjectiveModel(XGBoostSurrogate(n_estimators=60), seed=0).fit(x, t, d, 340.0)
    p = model.predict(x)
    assert p.time_spread is None and p.spread is None
    np.testing.assert_allclose(p.total_energy_j, p.time_s * 340.0 + p.dynamic_energy_j)
    np.testing.assert_allclose(p.energy("static"), p.time_s * 340.0)
    # Fitted in log space: relative error is small across the range.
    assert np.max(np.abs(p.time_s / t - 1)) < 0.05
    assert np.max(np.abs(p.dynamic_energy_j / d - 1)) < 0.05


def test_objective_model_tolerates_negative_dynamic_energy_and_gives_spread():
    rng = np.random.default_rng(2)
    x = rng.uniform(size=(30, 2))
    d = rng.uniform(0.5, 1.0, 30)
    d[0] = -0.01  # a noisy measurement can come out slightly negative
    model = ObjectiveModel(BootstrapEnsemble(base=XGBoostSurrogate(n_estimators=10),
                                             n_models=3)).fit(x, np.full(30, 1e-3), d, 85.0)
    p = model.predict(x)
    assert np.all(p.dynamic_energy_j > 0)
    assert p.spread is not None and p.spread.shape == (30,)
    with pytest.raises(ValueError):
        model.fit(x, np.zeros(30), d, 85.0)


def test_prediction_energy_kind_is_checked():
    p = ObjectivePrediction(time_s=np.ones(2), dynamic_energy_j=np.ones(2), static_power_w=1.0)
    with pytest.raises(ValueError):
        p.energy("kinetic")
