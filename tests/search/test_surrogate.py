"""Surrogates: conformance of the defaults, the log-space objective model, ensembles."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search.surrogate import (
    BootstrapEnsemble,
    GaussianProcessSurrogate,
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


class TestGaussianProcessConformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return GaussianProcessSurrogate()


class TestGaussianProcessMatern32Conformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return GaussianProcessSurrogate(kernel="matern32", features=(0, 1, 2))


def test_gp_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(25, 3))
    u = np.sin(z[:, 0]) + 0.1 * rng.normal(size=25)
    u = (u - u.mean()) / u.std()
    sq = np.square(z[:, None, :] - z[None, :, :])
    p = np.array([0.3, -0.2, 0.5, 0.1, np.log(0.05)])
    for kernel in ("matern52", "matern32"):
        gp = GaussianProcessSurrogate(kernel=kernel)
        _, grad = gp._neg_log_posterior(p, sq, u)
        num = np.array([(gp._neg_log_posterior(p + e, sq, u)[0]
                         - gp._neg_log_posterior(p - e, sq, u)[0]) / 2e-6
                        for e in np.eye(len(p)) * 1e-6])
        assert np.allclose(grad, num, rtol=1e-4, atol=1e-5)


def test_gp_interpolates_between_measured_sm_counts_where_trees_step():
    # An exposed collective: time falls as 1/SMs. Measured at 2, 4, 8, 16 and 32 SMs
    # (two clocks), the GP's predictions in between fall smoothly and stay close to the
    # truth; trees predict the same value across each gap.
    sms = np.array([2.0, 4, 8, 16, 32])
    x = np.array([[f, s] for f in (900.0, 1410.0) for s in sms])
    truth = lambda q: np.log(0.3 + 1.0 / q[:, 1]) - 0.1 * np.log(q[:, 0] / 900)  # noqa: E731
    q = np.column_stack([np.full(31, 1410.0), np.arange(2, 33)]).astype(float)
    gp = GaussianProcessSurrogate(log_features=(1,)).fit(x, truth(x))
    pred = gp.predict(q)
    assert np.all(np.diff(pred) < 0)
    assert np.max(np.abs(pred - truth(q))) < 0.02
    trees = XGBoostSurrogate(n_estimators=50, min_child_weight=1).fit(x, truth(x)).predict(q)
    assert np.sum(np.abs(np.diff(trees)) < 1e-9) >= 20
    # Uncertain away from the data, sure on it.
    _, on = gp.predict_spread(x)
    _, off = gp.predict_spread(np.array([[1150.0, 24.0], [600.0, 1.0]]))
    assert off.min() > on.max()


def test_gp_chunked_prediction_equals_whole(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.uniform(1, 5, size=(30, 2))
    gp = GaussianProcessSurrogate().fit(x, np.sin(x[:, 0]) + x[:, 1])
    q = rng.uniform(1, 5, size=(50, 2))
    whole = gp.predict_spread(q)
    monkeypatch.setattr(GaussianProcessSurrogate, "_CHUNK", 7)
    parts = gp.predict_spread(q)
    assert np.allclose(whole[0], parts[0]) and np.allclose(whole[1], parts[1])


def test_gp_arguments_and_state():
    with pytest.raises(ValueError, match="kernel"):
        GaussianProcessSurrogate(kernel="rbf")
    with pytest.raises(ValueError, match="noise_bounds"):
        GaussianProcessSurrogate(noise_bounds=(0.1, 0.01))
    with pytest.raises(ValueError, match="max_iter"):
        GaussianProcessSurrogate(max_iter=0)
    with pytest.raises(ValueError, match="positive"):
        GaussianProcessSurrogate(log_features=(0,)).fit(np.array([[1.0], [0.0]]), [1.0, 2.0])
    with pytest.raises(ValueError, match="out of range"):
        GaussianProcessSurrogate(features=(3,)).fit(np.ones((4, 2)), [1.0, 2, 3, 4])
    with pytest.raises(RuntimeError):
        _ = GaussianProcessSurrogate().hyperparameters
    x = np.linspace(0, 1, 12).reshape(-1, 1)
    hp = GaussianProcessSurrogate(features=(0,)).fit(
        np.column_stack([x, np.ones(12)]), np.sin(4 * x[:, 0])).hyperparameters
    assert hp["length_scales"].shape == (1,) and 0 < hp["noise_variance"] <= 1.0


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
