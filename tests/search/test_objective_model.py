"""ObjectiveModel and ObjectivePrediction: time and dynamic energy in log space, total
recombined."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search import (
    BootstrapEnsemble,
    ObjectiveModel,
    ObjectivePrediction,
    XGBoostSurrogate,
)


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


def test_bad_arguments():
    with pytest.raises(TypeError):
        ObjectiveModel("xgboost")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="before fit"):
        ObjectiveModel(XGBoostSurrogate()).predict(np.ones((2, 2)))
