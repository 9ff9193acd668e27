"""The Surrogate ABC: what a subclass must implement, its defaults, the input checks."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.search import Surrogate
from kareus.testing import check_surrogate


class _Mean(Surrogate):
    """The smallest complete surrogate: predicts the mean of its targets."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._mean: float | None = None

    def fit(self, X, y):
        from kareus.search.surrogate import _check_xy

        _, t = _check_xy(X, y)
        self._mean = float(t.mean())
        return self

    def predict(self, X):
        if self._mean is None:
            raise RuntimeError("predict before fit")
        return np.full(len(np.asarray(X)), self._mean)

    @property
    def fitted(self) -> bool:
        return self._mean is not None


class _DuckSurrogate:
    """Has every method a Surrogate has, but does not subclass the ABC."""

    has_spread = False
    fitted = False

    def fit(self, X, y):
        return self

    def predict(self, X):
        return np.zeros(len(X))


def test_a_subclass_must_implement_fit_predict_and_fitted():
    class NoFitted(Surrogate):
        def fit(self, X, y):
            return self

        def predict(self, X):
            return np.zeros(len(X))

    with pytest.raises(TypeError, match="fitted"):
        NoFitted()  # type: ignore[abstract]
    assert isinstance(_Mean(), Surrogate)


def test_conformance_rejects_a_surrogate_that_does_not_subclass_the_abc():
    # The contract is nominal: a duck-typed look-alike is not accepted by the search.
    with pytest.raises(AssertionError, match="'type'.*not a Surrogate"):
        check_surrogate(lambda: _DuckSurrogate())  # type: ignore[arg-type, return-value]


def test_defaults_clone_and_no_spread():
    s = _Mean(seed=3).fit(np.ones((4, 2)), [1.0, 2.0, 3.0, 4.0])
    c = s.clone(seed=7)
    assert type(c) is _Mean and c is not s and c.seed == 7 and s.seed == 3
    assert s.clone().seed == 3
    assert s.has_spread is False
    with pytest.raises(NotImplementedError, match="BootstrapEnsemble"):
        s.predict_spread(np.ones((2, 2)))


def test_input_checks():
    from kareus.search.surrogate import _check_x, _check_xy

    with pytest.raises(ValueError, match="2-D"):
        _check_xy(np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="one value per row"):
        _check_xy(np.ones((3, 2)), np.ones(2))
    with pytest.raises(ValueError, match="zero samples"):
        _check_xy(np.ones((0, 2)), np.ones(0))
    with pytest.raises(ValueError, match="finite"):
        _check_xy(np.array([[1.0], [np.inf]]), np.ones(2))
    with pytest.raises(ValueError, match="fitted on 3"):
        _check_x(np.ones((2, 2)), 3)
    assert _check_x([[1, 2]], 2).dtype == np.float64
