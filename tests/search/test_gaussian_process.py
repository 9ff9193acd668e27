"""GaussianProcessSurrogate: conformance, exact gradient, interpolation, chunked prediction."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search import GaussianProcessSurrogate, Surrogate, XGBoostSurrogate
from kareus.testing import SurrogateConformance


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


def test_gp_extra_features_from_takes_every_later_column():
    # Column 8 (a backend position) alone decides the target; a GP on columns 0-4 cannot
    # see it and predicts the mean for both, one with extra_features_from=8 tells them
    # apart, as default_surrogate does in a space of several backends.
    from kareus.search import EXTRA_COLUMNS_FROM, default_surrogate

    rng = np.random.default_rng(0)
    x = np.column_stack([rng.choice([1500.0, 1980.0], 40), rng.integers(1, 33, 40),
                         np.zeros((40, 3)), rng.random((40, 3)),
                         rng.integers(0, 2, 40)]).astype(float)
    y = np.where(x[:, 8] == 1, 2.0, 1.0) + 0.001 * rng.normal(size=40)
    blind = GaussianProcessSurrogate(features=(0, 1, 2, 3, 4), log_features=(1,)).fit(x, y)
    sees = default_surrogate().fit(x, y)
    q = np.repeat(x[:1], 2, axis=0)
    q[:, 8] = [0.0, 1.0]
    mb, ms = blind.predict(q), sees.predict(q)
    assert abs(mb[1] - mb[0]) < 0.3
    assert ms[0] == pytest.approx(1.0, abs=0.05) and ms[1] == pytest.approx(2.0, abs=0.05)
    # Without the extra column it is the plain GP on 0-4; the setting survives a clone.
    plain = x[:, :EXTRA_COLUMNS_FROM]
    np.testing.assert_allclose(
        default_surrogate().fit(plain, y).predict(plain[:5]),
        GaussianProcessSurrogate(features=(0, 1, 2, 3, 4), log_features=(1,))
        .fit(plain, y).predict(plain[:5]))
    assert sees.clone().extra_features_from == EXTRA_COLUMNS_FROM
    assert "extra_features_from=8" in repr(sees)
    with pytest.raises(ValueError, match="extra_features_from"):
        GaussianProcessSurrogate(extra_features_from=-1)
