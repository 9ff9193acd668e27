"""BootstrapEnsemble: conformance, spread from resamples, argument checks."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search import BootstrapEnsemble, Surrogate, XGBoostSurrogate
from kareus.testing import SurrogateConformance


class TestEnsembleConformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return BootstrapEnsemble(base=XGBoostSurrogate(n_estimators=30), n_models=3, seed=2)


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
        BootstrapEnsemble(n_models=1)
    with pytest.raises(TypeError):
        BootstrapEnsemble(base="xgboost")  # type: ignore[arg-type]
