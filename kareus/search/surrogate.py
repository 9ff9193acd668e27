"""The Surrogate role: a cheap stand-in for profiling, fitted to the measurements so far.

A [`Surrogate`][kareus.search.Surrogate] learns one scalar objective (time, or dynamic energy) from
configuration features ([`kareus.search.search_features`][kareus.search.search_features], built on
[`kareus.model.ConfigSpace.features`][kareus.model.ConfigSpace.features]) and predicts it for
configurations not yet measured. Some surrogates also give a *spread*: how much they trust each
prediction. The search uses predictions to decide what to profile next, never as results: a
partition frontier holds measured points only.

The defaults, one per module, are exported from [`kareus.search`][kareus.search]:

* [`GaussianProcessSurrogate`][kareus.search.GaussianProcessSurrogate] - a smooth interpolator with
  a posterior spread, the search's default
  ([`kareus.search.default_surrogate`][kareus.search.default_surrogate]).
* [`XGBoostSurrogate`][kareus.search.XGBoostSurrogate] - gradient-boosted trees, the learner of the
  public reference artifact of the Kareus paper.
* [`BootstrapEnsemble`][kareus.search.BootstrapEnsemble] - n copies of a base surrogate, each fitted
  on a resample of the data; the mean of their predictions is the prediction and their
  standard deviation is the spread.

[`ObjectiveModel`][kareus.search.ObjectiveModel] fits two surrogates, for time and *dynamic*
energy, in log space, and recombines them into total energy as ``time x static power +
dynamic energy``: static power is a property of the GPUs, not of the configuration.

Conformance: [`kareus.testing.check_surrogate`][kareus.testing.check_surrogate] checks a subclass.
"""

from __future__ import annotations

import abc
import copy

import numpy as np
from numpy.typing import ArrayLike

from kareus.errors import ArgumentError

__all__ = ["Surrogate"]


def _check_xy(X: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(X, dtype=np.float64)
    t = np.asarray(y, dtype=np.float64)
    if x.ndim != 2:
        raise ArgumentError(f"X must be a 2-D array (samples x features), got shape {x.shape}")
    if t.ndim != 1 or len(t) != len(x):
        raise ArgumentError(f"y must be a 1-D array with one value per row of X "
                         f"({len(x)} rows), got shape {t.shape}")
    if len(x) == 0:
        raise ArgumentError("cannot fit a surrogate on zero samples")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise ArgumentError("X and y must be finite")
    return x, t


def _check_x(X: ArrayLike, n_features: int | None) -> np.ndarray:
    x = np.asarray(X, dtype=np.float64)
    if x.ndim != 2:
        raise ArgumentError(f"X must be a 2-D array (samples x features), got shape {x.shape}")
    if n_features is not None and x.shape[1] != n_features:
        raise ArgumentError(f"X has {x.shape[1]} features; the surrogate was fitted on {n_features}")
    return x


class Surrogate(abc.ABC):
    """A regression model of one objective over configuration features.

    Subclasses implement [`fit`][kareus.search.Surrogate.fit] and
    [`predict`][kareus.search.Surrogate.predict]. A surrogate that can say how much it trusts its
    predictions sets ``has_spread = True`` and overrides
    [`predict_spread`][kareus.search.Surrogate.predict_spread].
    [`clone`][kareus.search.Surrogate.clone] must return an *unfitted* copy with the same settings
    (optionally reseeded); the default deep-copies an unfitted instance, so override it when
    ``self`` may be fitted and fitting state is heavy.

    Conformance: [`kareus.testing.check_surrogate`][kareus.testing.check_surrogate] checks a
        subclass.
    """

    #: Whether :meth:`predict_spread` is implemented.
    has_spread: bool = False

    @abc.abstractmethod
    def fit(self, X: ArrayLike, y: ArrayLike) -> Surrogate:
        """Fit to features ``X`` (n x d) and targets ``y`` (n,); return ``self``.

        Raises:
            ValueError: on shapes that do not match, non-finite values or zero samples.
        """

    @abc.abstractmethod
    def predict(self, X: ArrayLike) -> np.ndarray:
        """Predicted mean target for each row of ``X``: a float array of shape (n,).

        Zero rows give an empty array of shape ``(0,)``, not an error (a search may ask for
        the predictions of no candidates); ``predict_spread`` likewise gives two.

        Raises:
            RuntimeError: if called before [`fit`][kareus.search.Surrogate.fit].
        """

    def predict_spread(self, X: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Predicted mean and spread (a standard deviation, >= 0) for each row of ``X``.

        Raises:
            NotImplementedError: if this surrogate gives no spread (``has_spread`` False).
        """
        raise NotImplementedError(f"{type(self).__name__} gives no spread; wrap it in a "
                                  "BootstrapEnsemble for one")

    def clone(self, *, seed: int | None = None) -> Surrogate:
        """An unfitted copy with the same settings; ``seed`` reseeds it where it has one."""
        other = copy.deepcopy(self)
        if seed is not None and hasattr(other, "seed"):
            other.seed = int(seed)
        return other

    @property
    @abc.abstractmethod
    def fitted(self) -> bool:
        """Whether [`fit`][kareus.search.Surrogate.fit] has been called."""
