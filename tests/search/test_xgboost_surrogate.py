"""XGBoostSurrogate: conformance, the linear trend under the trees, argument checks."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search import Surrogate, XGBoostSurrogate
from kareus.testing import SurrogateConformance


class TestXGBoostConformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return XGBoostSurrogate(n_estimators=40, seed=1)


class TestXGBoostTrendConformance(SurrogateConformance):
    def make_surrogate(self) -> Surrogate:
        return XGBoostSurrogate(n_estimators=40, seed=1, trend_features=(0,))


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


def test_bad_arguments():
    with pytest.raises(ValueError):
        XGBoostSurrogate(n_estimators=0)
    with pytest.raises(ValueError, match="fitted on 2"):
        XGBoostSurrogate().fit(np.ones((3, 2)), [1.0, 2, 3]).predict(np.ones((2, 5)))


def test_without_xgboost_the_trees_surrogate_is_refused_at_construction(monkeypatch):
    """xgboost is the ``trees`` extra: a missing install is a typed one-line error when the
    surrogate is made (before any measurement), not an ImportError at the first fit."""
    import importlib.util

    from kareus.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgboost" else real(name, *a))
    with pytest.raises(ConfigError, match=r"kareus\[trees\]"):
        XGBoostSurrogate()
