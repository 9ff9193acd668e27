"""Gradient-boosted regression trees as a [`Surrogate`][kareus.search.Surrogate].

XGBoost is the learner of the public reference artifact of the Kareus paper. Trees are
at ease with the kinks of this domain (a communication kernel becomes link-bound above
some SM count; a launch slot is categorical) but predict in steps; an optional linear
trend in a smooth knob (the clock) keeps predictions ordered along it. xgboost is
imported only when a model is fitted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from kareus._check import check_count, check_number
from kareus.errors import ArgumentError, ConfigError
from kareus.search.surrogate import Surrogate, _check_x, _check_xy

__all__ = ["XGBoostSurrogate"]


class XGBoostSurrogate(Surrogate):
    """Gradient-boosted regression trees (XGBoost), the reference artifact's learner.

    Small and fast by default: a partition search refits its models every batch on at
    most a few hundred points, and search overhead must stay well under the seconds a
    profile costs. The defaults (100 rounds of depth-4 trees, learning rate 0.1, at least
    2 samples per leaf) are regularised a little against measurement noise: on the
    emulator with 1% noise they found better fronts than deeper, faster-learning trees
    (docs/search.md).

    Args:
        n_estimators: Boosting rounds.
        max_depth: Tree depth.
        learning_rate: Shrinkage per round.
        subsample: Row subsampling per tree (1.0 = none).
        colsample_bytree: Feature subsampling per tree.
        min_child_weight: Minimum hessian weight in a leaf (squared error: samples).
        reg_lambda: L2 regularisation of leaf weights.
        nthread: XGBoost threads; ``None`` = 1 (fitting is tiny, threads cost more than
            they give, and the profiler may be sharing the machine).
        seed: Random seed (used by subsampling).
        trend_features: Feature columns of a linear trend fitted (least squares) before
            boosting; the trees then fit what the trend leaves. Trees predict in steps and
            cannot interpolate between the values they saw; a trend in a smooth knob (the
            clock frequency: column 0 of ConfigSpace's features) keeps predictions ordered
            along it. ``()`` = no trend.
        params: Extra XGBoost booster parameters, merged last.
    """

    def __init__(
        self,
        *,
        n_estimators: int = 100,
        max_depth: int = 4,
        learning_rate: float = 0.1,
        subsample: float = 1.0,
        colsample_bytree: float = 1.0,
        min_child_weight: float = 2.0,
        reg_lambda: float = 1.0,
        nthread: int | None = None,
        seed: int = 0,
        trend_features: tuple[int, ...] | list[int] = (),
        params: dict[str, Any] | None = None,
    ) -> None:
        import importlib.util

        if importlib.util.find_spec("xgboost") is None:  # checked before any measurement
            raise ConfigError("the trees surrogate (XGBoostSurrogate) needs xgboost: "
                              "pip install 'kareus[trees]', or use the default gp surrogate")
        check_count("n_estimators", n_estimators)
        if max_depth < 1:
            raise ArgumentError(f"max_depth must be >= 1, got {max_depth}")
        check_number("learning_rate", learning_rate)
        if not 0 < learning_rate <= 1:
            raise ArgumentError(f"learning_rate must be in (0, 1], got {learning_rate}")
        if not 0 < subsample <= 1 or not 0 < colsample_bytree <= 1:
            raise ArgumentError("subsample and colsample_bytree must be in (0, 1]")
        self.n_estimators = int(n_estimators)
        self.max_depth = int(max_depth)
        self.learning_rate = float(learning_rate)
        self.subsample = float(subsample)
        self.colsample_bytree = float(colsample_bytree)
        self.min_child_weight = float(min_child_weight)
        self.reg_lambda = float(reg_lambda)
        self.nthread = 1 if nthread is None else int(nthread)
        self.seed = int(seed)
        self.params = dict(params or {})
        self.trend_features = tuple(int(c) for c in trend_features)
        # (columns, means, standard deviations, coefficients) of the linear trend.
        self._trend: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._booster: Any = None
        self._n_features: int | None = None
        self._constant: float | None = None

    def _booster_params(self) -> dict[str, Any]:
        p: dict[str, Any] = {
            "objective": "reg:squarederror", "tree_method": "hist", "max_depth": self.max_depth,
            "eta": self.learning_rate, "subsample": self.subsample,
            "colsample_bytree": self.colsample_bytree, "min_child_weight": self.min_child_weight,
            "lambda": self.reg_lambda, "nthread": self.nthread, "seed": self.seed,
            "verbosity": 0, "max_bin": 64,
        }
        p.update(self.params)
        return p

    def _fit_trend(self, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Fit the linear trend; return the residuals."""
        self._trend = None
        cols = [c for c in self.trend_features if c < x.shape[1]]
        if not cols or len(t) < 3:
            return t
        z = x[:, cols]
        mu, sd = z.mean(axis=0), z.std(axis=0)
        keep = sd > 0
        if not keep.any():
            return t
        zs = (z[:, keep] - mu[keep]) / sd[keep]
        a = np.column_stack([np.ones(len(t)), zs])
        # A little ridge on the slopes: a trend from few points must not run wild.
        reg = np.diag([0.0] + [1e-3 * len(t)] * zs.shape[1])
        coef = np.linalg.solve(a.T @ a + reg, a.T @ t)
        self._trend = (np.asarray(cols)[keep], mu[keep], sd[keep], coef)
        return t - a @ coef

    def _trend_at(self, x: np.ndarray) -> np.ndarray | float:
        if self._trend is None:
            return 0.0
        cols, mu, sd, coef = self._trend
        zs = (x[:, cols] - mu) / sd
        return coef[0] + zs @ coef[1:]

    def fit(self, X: ArrayLike, y: ArrayLike) -> XGBoostSurrogate:
        """Fit the trend (if any), then the boosted trees on what it leaves; return ``self``."""
        x, t = _check_xy(X, y)
        self._n_features = x.shape[1]
        t = self._fit_trend(x, t)
        if len(t) < 2 or np.ptp(t) == 0:
            # Nothing to learn: a constant (XGBoost would also give one, more slowly).
            self._booster, self._constant = None, float(t.mean())
            return self
        import xgboost as xgb  # heavy import, only when fitting

        self._constant = None
        # base_score at the mean: trees then model deviations, which small ensembles
        # of shallow trees do better than the raw level.
        params = self._booster_params()
        params.setdefault("base_score", float(t.mean()))
        dtrain = xgb.DMatrix(x, label=t, nthread=self.nthread)
        self._booster = xgb.train(params, dtrain, num_boost_round=self.n_estimators)
        return self

    @property
    def fitted(self) -> bool:
        """Whether [`fit`][kareus.search.XGBoostSurrogate.fit] has been called."""
        return self._booster is not None or self._constant is not None

    def predict(self, X: ArrayLike) -> np.ndarray:
        """The trees' prediction plus the trend for each row of ``X``."""
        if not self.fitted:
            raise RuntimeError("XGBoostSurrogate.predict called before fit")
        x = _check_x(X, self._n_features)
        if len(x) == 0:
            return np.zeros(0)
        trend = self._trend_at(x)
        if self._constant is not None:
            return np.full(len(x), self._constant) + trend
        import xgboost as xgb

        return np.asarray(self._booster.predict(xgb.DMatrix(x, nthread=self.nthread)),
                          dtype=np.float64) + trend

    def clone(self, *, seed: int | None = None) -> XGBoostSurrogate:
        """An unfitted model with the same settings (``seed`` reseeds it)."""
        return XGBoostSurrogate(
            n_estimators=self.n_estimators, max_depth=self.max_depth,
            learning_rate=self.learning_rate, subsample=self.subsample,
            colsample_bytree=self.colsample_bytree, min_child_weight=self.min_child_weight,
            reg_lambda=self.reg_lambda, nthread=self.nthread,
            seed=self.seed if seed is None else int(seed),
            trend_features=self.trend_features, params=self.params)

    def __repr__(self) -> str:
        return (f"XGBoostSurrogate(n_estimators={self.n_estimators}, max_depth="
                f"{self.max_depth}, learning_rate={self.learning_rate}, seed={self.seed})")
