"""A bootstrap ensemble of surrogates: a spread for surrogates that give none.

n copies of a base surrogate, each fitted on a resample of the data; the mean of their
predictions is the prediction and their standard deviation is the spread. That is how
the public reference artifact of the Kareus paper measures its search's uncertainty
(five XGBoost models on 80% resamples).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from kareus._check import check_count, check_number
from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.search._xgboost_surrogate import XGBoostSurrogate
from kareus.search.surrogate import Surrogate, _check_x, _check_xy

__all__ = ["BootstrapEnsemble"]


class BootstrapEnsemble(Surrogate):
    """``n_models`` copies of a base surrogate, each fitted on a bootstrap resample.

    The prediction is the mean over the members; the spread is their standard deviation.
    Each member sees ``fraction`` x n distinct samples drawn without replacement (the
    public reference artifact of the Kareus paper fits 5 models on 80% resamples); with
    ``replace=True`` it sees n samples drawn with replacement (the classic bootstrap).

    Args:
        base: The member surrogate (cloned, never fitted itself); ``None`` =
            [`XGBoostSurrogate`][kareus.search.XGBoostSurrogate] with default settings.
        n_models: Members (>= 2).
        fraction: Share of the samples each member sees, in (0, 1].
        replace: Draw with replacement (``fraction`` is then ignored).
        seed: Seed of the resampling and of the members.
    """

    has_spread = True

    def __init__(self, *, base: Surrogate | None = None, n_models: int = 5,
                 fraction: float = 0.8, replace: bool = False, seed: int = 0) -> None:
        if base is None:
            base = XGBoostSurrogate()
        if not isinstance(base, Surrogate):
            raise ArgumentTypeError(f"base must be a kareus Surrogate, got {type(base).__name__}")
        check_count("n_models", n_models, minimum=2)
        check_number("fraction", fraction)
        if not 0 < fraction <= 1:
            raise ArgumentError(f"fraction must be in (0, 1], got {fraction}")
        self.base = base
        self.n_models = int(n_models)
        self.fraction = float(fraction)
        self.replace = bool(replace)
        self.seed = int(seed)
        self.members: list[Surrogate] = []

    def fit(self, X: ArrayLike, y: ArrayLike) -> BootstrapEnsemble:
        """Fit each member on its own resample of ``X``, ``y``; return ``self``."""
        x, t = _check_xy(X, y)
        n = len(t)
        rng = np.random.default_rng([self.seed, n])
        members = []
        for i in range(self.n_models):
            if self.replace:
                idx = rng.integers(0, n, size=n)
            else:
                m = max(1, min(n, int(math.ceil(self.fraction * n))))
                idx = rng.choice(n, size=m, replace=False)
            member = self.base.clone(seed=self.seed * 1000 + i)
            member.fit(x[idx], t[idx])
            members.append(member)
        self.members = members
        return self

    @property
    def fitted(self) -> bool:
        """Whether the members have been fitted."""
        return bool(self.members)

    def member_predictions(self, X: ArrayLike) -> np.ndarray:
        """Each member's predictions: shape (n_models, n)."""
        if not self.fitted:
            raise RuntimeError("BootstrapEnsemble.predict called before fit")
        x = _check_x(X, None)
        return np.stack([m.predict(x) for m in self.members])

    def predict(self, X: ArrayLike) -> np.ndarray:
        """The members' mean prediction for each row of ``X``."""
        return self.member_predictions(X).mean(axis=0)

    def predict_spread(self, X: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """The members' mean and standard deviation for each row of ``X``."""
        p = self.member_predictions(X)
        return p.mean(axis=0), p.std(axis=0)

    def clone(self, *, seed: int | None = None) -> BootstrapEnsemble:
        """An unfitted ensemble with the same settings (``seed`` reseeds it)."""
        return BootstrapEnsemble(base=self.base, n_models=self.n_models, fraction=self.fraction,
                                 replace=self.replace,
                                 seed=self.seed if seed is None else int(seed))

    def __repr__(self) -> str:
        return (f"BootstrapEnsemble({self.base!r}, n_models={self.n_models}, "
                f"fraction={self.fraction}, seed={self.seed})")
