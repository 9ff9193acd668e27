"""Surrogate models: cheap stand-ins for profiling, fitted to the measurements so far.

A :class:`Surrogate` learns one scalar objective (time, or dynamic energy) from
configuration features (:meth:`kareus.model.ConfigSpace.encode`) and predicts it
for configurations not yet measured. Some surrogates also give a *spread*: how much
they trust each prediction. The search uses predictions to decide what to profile
next, never as results: a partition frontier holds measured points only.

* :class:`XGBoostSurrogate` - gradient-boosted trees, the default learner: fast to fit
  on a few hundred points, and at ease with the kinks of this domain (a communication
  kernel becomes link-bound above some SM count; a launch slot is categorical).
* :class:`BootstrapEnsemble` - n copies of a base surrogate, each fitted on a resample
  of the data; the mean of their predictions is the prediction and their standard
  deviation is the spread. That is how the search measures its own uncertainty.

kareus models time and *dynamic* energy separately, and recombines them into total
energy as ``time x static power + dynamic energy``: static power is a property of the
GPUs, not of the configuration (:class:`ObjectiveModel`). Both targets are fitted in
log space (they are positive and span decades across frequencies and slots), so the
spread of an ensemble in log space is a *relative* uncertainty.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import math
from typing import Any

import attrs
import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "BootstrapEnsemble",
    "GaussianProcessSurrogate",
    "ObjectiveModel",
    "ObjectivePrediction",
    "Surrogate",
    "XGBoostSurrogate",
]


def _check_xy(X: ArrayLike, y: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(X, dtype=np.float64)
    t = np.asarray(y, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"X must be a 2-D array (samples x features), got shape {x.shape}")
    if t.ndim != 1 or len(t) != len(x):
        raise ValueError(f"y must be a 1-D array with one value per row of X "
                         f"({len(x)} rows), got shape {t.shape}")
    if len(x) == 0:
        raise ValueError("cannot fit a surrogate on zero samples")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise ValueError("X and y must be finite")
    return x, t


def _check_x(X: ArrayLike, n_features: int | None) -> np.ndarray:
    x = np.asarray(X, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"X must be a 2-D array (samples x features), got shape {x.shape}")
    if n_features is not None and x.shape[1] != n_features:
        raise ValueError(f"X has {x.shape[1]} features; the surrogate was fitted on {n_features}")
    return x


class Surrogate(abc.ABC):
    """A regression model of one objective over configuration features.

    Subclasses implement :meth:`fit` and :meth:`predict`. A surrogate that can say how
    much it trusts its predictions sets ``has_spread = True`` and overrides
    :meth:`predict_spread`. :meth:`clone` must return an *unfitted* copy with the same
    settings (optionally reseeded); the default deep-copies an unfitted instance, so
    override it when ``self`` may be fitted and fitting state is heavy.

    Conformance: :func:`kareus.testing.check_surrogate` checks a subclass.
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

        Raises:
            RuntimeError: if called before :meth:`fit`.
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
        """Whether :meth:`fit` has been called."""


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
        if n_estimators < 1:
            raise ValueError(f"n_estimators must be >= 1, got {n_estimators}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not 0 < learning_rate <= 1:
            raise ValueError(f"learning_rate must be in (0, 1], got {learning_rate}")
        if not 0 < subsample <= 1 or not 0 < colsample_bytree <= 1:
            raise ValueError("subsample and colsample_bytree must be in (0, 1]")
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
        x, t = _check_xy(X, y)
        self._n_features = x.shape[1]
        t = self._fit_trend(x, t)
        if len(t) < 2 or np.ptp(t) == 0:
            # Nothing to learn: a constant (XGBoost would also give one, more slowly).
            self._booster, self._constant = None, float(t.mean())
            return self
        import xgboost as xgb  # noqa: PLC0415 - heavy import, only when fitting

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
        return self._booster is not None or self._constant is not None

    def predict(self, X: ArrayLike) -> np.ndarray:
        if not self.fitted:
            raise RuntimeError("XGBoostSurrogate.predict called before fit")
        x = _check_x(X, self._n_features)
        if len(x) == 0:
            return np.zeros(0)
        trend = self._trend_at(x)
        if self._constant is not None:
            return np.full(len(x), self._constant) + trend
        import xgboost as xgb  # noqa: PLC0415

        return np.asarray(self._booster.predict(xgb.DMatrix(x, nthread=self.nthread)),
                          dtype=np.float64) + trend

    def clone(self, *, seed: int | None = None) -> XGBoostSurrogate:
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


class BootstrapEnsemble(Surrogate):
    """``n_models`` copies of a base surrogate, each fitted on a bootstrap resample.

    The prediction is the mean over the members; the spread is their standard deviation.
    Each member sees ``fraction`` x n distinct samples drawn without replacement (the
    reference artifact fits 5 models on 80% resamples; FACTS.md); with
    ``replace=True`` it sees n samples drawn with replacement (the classic bootstrap).

    Args:
        base: The member surrogate (cloned, never fitted itself); ``None`` =
            :class:`XGBoostSurrogate` with default settings.
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
            raise TypeError(f"base must be a kareus Surrogate, got {type(base).__name__}")
        if n_models < 2:
            raise ValueError(f"n_models must be >= 2 for a spread, got {n_models}")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.base = base
        self.n_models = int(n_models)
        self.fraction = float(fraction)
        self.replace = bool(replace)
        self.seed = int(seed)
        self.members: list[Surrogate] = []

    def fit(self, X: ArrayLike, y: ArrayLike) -> BootstrapEnsemble:
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
        return bool(self.members)

    def member_predictions(self, X: ArrayLike) -> np.ndarray:
        """Each member's predictions: shape (n_models, n)."""
        if not self.fitted:
            raise RuntimeError("BootstrapEnsemble.predict called before fit")
        x = _check_x(X, None)
        return np.stack([m.predict(x) for m in self.members])

    def predict(self, X: ArrayLike) -> np.ndarray:
        return self.member_predictions(X).mean(axis=0)

    def predict_spread(self, X: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        p = self.member_predictions(X)
        return p.mean(axis=0), p.std(axis=0)

    def clone(self, *, seed: int | None = None) -> BootstrapEnsemble:
        return BootstrapEnsemble(base=self.base, n_models=self.n_models, fraction=self.fraction,
                                 replace=self.replace,
                                 seed=self.seed if seed is None else int(seed))

    def __repr__(self) -> str:
        return (f"BootstrapEnsemble({self.base!r}, n_models={self.n_models}, "
                f"fraction={self.fraction}, seed={self.seed})")


class GaussianProcessSurrogate(Surrogate):
    """Gaussian-process regression: a smooth interpolator that knows its own uncertainty.

    The prediction at a configuration is a weighted average of the measurements near it,
    where "near" is learnt per feature (one length scale each, automatic relevance
    determination) together with the noise level, by maximising the marginal likelihood
    of the data. Two things make it suit this search better than trees:

    * It *interpolates*. Trees predict a step function, flat between the values they saw,
      so at one clock and slot they cannot say where between two measured SM counts the
      time stops falling. A GP draws a smooth curve through the measurements and pools
      the neighbouring clocks, so the fewest SMs that hide a collective (where the
      partition's front sits) is located to within an SM or two from measurements that
      are each 1% noisy while one SM changes the time by 0.1-0.3%.
    * Its spread is a posterior standard deviation, large far from the data and small
      near it, with no resampling: one fit gives mean and spread
      (``has_spread = True``).

    Inputs are standardised (columns constant in the data are dropped), optionally after
    a log transform (``log_features``: the SM count, since a collective's time falls about
    as 1/SMs); the target is standardised. The kernel is Matern 5/2 (or 3/2) with
    automatic relevance determination plus white noise; the hyperparameters are the MAP
    estimate under weak log-normal priors (they keep a fit to a few dozen points from
    degenerating), found by L-BFGS-B (scipy) on the exact gradient.

    Why not scikit-learn's GaussianProcessRegressor: it is not a kareus dependency, puts no
    prior on the hyperparameters, and refits this small problem no faster. Exact GPs cost
    O(n^3) in the number of measurements n (fits of 0.01 s at 64 and 0.15 s at 224 on one
    core) and O(n^2) per predicted configuration: 85,000 candidates from 224
    measurements take about 0.3 s for the mean and 0.55 s with the spread.

    Args:
        features: Columns of ``X`` to use (``None`` = all).
        log_features: Columns of ``X`` (indices into ``X``, not into ``features``) to
            log-transform first; their values must be positive.
        kernel: ``"matern52"`` or ``"matern32"``.
        noise_bounds: Bounds of the noise variance, as a fraction of the target's variance.
        max_iter: L-BFGS-B iterations for the hyperparameters.
        seed: Kept for the :class:`Surrogate` protocol (the fit is deterministic).
    """

    has_spread = True

    _KERNELS = ("matern52", "matern32")
    # Rows of predictions computed at once (bounds the rows x n_train kernel matrix).
    _CHUNK = 4096

    def __init__(self, *, features: tuple[int, ...] | list[int] | None = None,
                 log_features: tuple[int, ...] | list[int] = (), kernel: str = "matern52",
                 noise_bounds: tuple[float, float] = (1e-6, 1.0), max_iter: int = 100,
                 seed: int = 0) -> None:
        if kernel not in self._KERNELS:
            raise ValueError(f"kernel must be one of {self._KERNELS}, got {kernel!r}")
        lo, hi = (float(b) for b in noise_bounds)
        if not 0 < lo < hi:
            raise ValueError(f"noise_bounds must satisfy 0 < low < high, got {noise_bounds}")
        if max_iter < 1:
            raise ValueError(f"max_iter must be >= 1, got {max_iter}")
        self.features = None if features is None else tuple(int(c) for c in features)
        self.log_features = tuple(int(c) for c in log_features)
        self.kernel = kernel
        self.noise_bounds = (lo, hi)
        self.max_iter = int(max_iter)
        self.seed = int(seed)
        self._n_features: int | None = None
        self._state: dict[str, Any] | None = None

    # -- transforms ---------------------------------------------------------------------

    def _transform(self, x: np.ndarray) -> np.ndarray:
        if self.log_features:
            x = x.copy()
            for c in self.log_features:
                if np.any(x[:, c] <= 0):
                    raise ValueError(f"log_features column {c} must be positive")
                x[:, c] = np.log(x[:, c])
        if self.features is not None:
            x = x[:, list(self.features)]
        return x

    def _corr(self, r: np.ndarray) -> np.ndarray:
        """Kernel correlation at scaled distance r."""
        if self.kernel == "matern52":
            s = math.sqrt(5.0) * r
            return (1.0 + s + s * s / 3.0) * np.exp(-s)
        s = math.sqrt(3.0) * r
        return (1.0 + s) * np.exp(-s)

    def _corr_grad_factor(self, r: np.ndarray) -> np.ndarray:
        """g(r) with d corr / d log(l_k) = g(r) * (delta_k / l_k)^2 (no 1/r singularity)."""
        if self.kernel == "matern52":
            s = math.sqrt(5.0) * r
            return (5.0 / 3.0) * (1.0 + s) * np.exp(-s)
        return 3.0 * np.exp(-math.sqrt(3.0) * r)

    def _neg_log_posterior(self, p: np.ndarray, sq: np.ndarray, u: np.ndarray
                           ) -> tuple[float, np.ndarray]:
        """Negative log marginal likelihood plus the hyperprior, and its gradient.

        ``p`` = (log length scales..., log signal variance, log noise variance); ``sq`` the
        (n, n, d) squared differences of the standardised inputs; ``u`` the standardised
        targets. Up to a constant.
        """
        d = sq.shape[-1]
        ls, s2, n2 = np.exp(p[:d]), math.exp(p[d]), math.exp(p[d + 1])
        scaled = sq / ls ** 2
        r = np.sqrt(scaled.sum(axis=-1))
        corr = self._corr(r)
        n = len(u)
        k = s2 * corr
        k[np.diag_indices(n)] += n2 + 1e-9
        from scipy.linalg import LinAlgError, cho_factor, cho_solve  # noqa: PLC0415
        from scipy.linalg.lapack import dpotri  # noqa: PLC0415

        try:
            chol, lower = cho_factor(k, lower=True, check_finite=False)
        except LinAlgError:
            return 1e10, np.zeros_like(p)
        alpha = cho_solve((chol, lower), u, check_finite=False)
        # Weak priors: log length scales and log signal variance ~ N(0, 2^2).
        value = (0.5 * u @ alpha + np.log(np.diag(chol)).sum()
                 + 0.125 * (np.sum(p[:d] ** 2) + p[d] ** 2))
        kinv, info = dpotri(chol, lower=1)
        if info != 0:
            return 1e10, np.zeros_like(p)
        kinv = np.tril(kinv) + np.tril(kinv, -1).T
        w = kinv - np.outer(alpha, alpha)  # K^-1 - alpha alpha^T
        g = np.empty_like(p)
        g[:d] = (0.5 * (w * (s2 * self._corr_grad_factor(r))).reshape(-1)
                 @ scaled.reshape(-1, d) + 0.25 * p[:d])
        g[d] = 0.5 * np.sum(w * (s2 * corr)) + 0.25 * p[d]
        g[d + 1] = 0.5 * np.trace(w) * n2
        return float(value), g

    # -- fitting --------------------------------------------------------------------------

    def fit(self, X: ArrayLike, y: ArrayLike) -> GaussianProcessSurrogate:
        x, t = _check_xy(X, y)
        self._n_features = x.shape[1]
        for c in (*(self.features or ()), *self.log_features):
            if not 0 <= c < x.shape[1]:
                raise ValueError(f"feature column {c} out of range for X with "
                                 f"{x.shape[1]} columns")
        z = self._transform(x)
        mu, sd = z.mean(axis=0), z.std(axis=0)
        keep = sd > 0
        y_mean, y_sd = float(t.mean()), float(t.std())
        if len(t) < 2 or y_sd == 0 or not keep.any():
            # Nothing to learn: the mean, with no spread.
            self._state = {"constant": y_mean}
            return self
        z = (z[:, keep] - mu[keep]) / sd[keep]
        u = (t - y_mean) / y_sd
        sq = np.square(z[:, None, :] - z[None, :, :])  # (n, n, d) squared differences
        d = z.shape[1]
        lo, hi = np.log(self.noise_bounds)

        from scipy.linalg import cho_solve  # noqa: PLC0415 - only when fitting
        from scipy.optimize import minimize  # noqa: PLC0415

        p0 = np.concatenate([np.zeros(d), [0.0], [float(np.clip(np.log(1e-2), lo, hi))]])
        bounds = [(-3.0, 3.0)] * d + [(-3.0, 3.0), (float(lo), float(hi))]
        with _one_blas_thread():
            res = minimize(self._neg_log_posterior, p0, args=(sq, u), jac=True,
                           method="L-BFGS-B", bounds=bounds, options={"maxiter": self.max_iter})
            p = res.x
            ls, s2, n2 = np.exp(p[:d]), math.exp(p[d]), math.exp(p[d + 1])
            k = s2 * self._corr(np.sqrt((sq / ls ** 2).sum(axis=-1)))
            for jitter in (1e-9, 1e-6, 1e-4):  # more only if rounding broke definiteness
                try:
                    chol = np.linalg.cholesky(k + (n2 + jitter) * np.eye(len(u)))
                    break
                except np.linalg.LinAlgError:
                    continue
            else:
                raise RuntimeError("GaussianProcessSurrogate: the fitted kernel matrix is not "
                                   "positive definite; duplicate rows with different targets "
                                   "need a larger noise_bounds low end")
            alpha = cho_solve((chol, True), u, check_finite=False)
        self._state = {"keep": keep, "mu": mu[keep], "sd": sd[keep], "z": z,
                       "y_mean": y_mean, "y_sd": y_sd, "ls": ls, "s2": s2, "noise": n2,
                       "chol": chol, "alpha": alpha}
        return self

    @property
    def fitted(self) -> bool:
        return self._state is not None

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The fitted length scales (standardised units), signal and noise variance
        (fractions of the target's variance)."""
        if self._state is None:
            raise RuntimeError("GaussianProcessSurrogate.hyperparameters before fit")
        s = self._state
        if "constant" in s:
            return {}
        return {"length_scales": s["ls"].copy(), "signal_variance": s["s2"],
                "noise_variance": s["noise"]}

    # -- prediction -------------------------------------------------------------------------

    def predict_spread(self, X: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        return self._predict(X, spread=True)

    def predict(self, X: ArrayLike) -> np.ndarray:
        return self._predict(X, spread=False)[0]

    def _predict(self, X: ArrayLike, *, spread: bool) -> tuple[np.ndarray, np.ndarray]:
        if self._state is None:
            raise RuntimeError("GaussianProcessSurrogate.predict called before fit")
        x = _check_x(X, self._n_features)
        s = self._state
        if "constant" in s:
            return np.full(len(x), s["constant"]), np.zeros(len(x))
        if len(x) == 0:
            return np.zeros(0), np.zeros(0)
        from scipy.linalg import solve_triangular  # noqa: PLC0415

        q = (self._transform(x)[:, s["keep"]] - s["mu"]) / s["sd"] / s["ls"]
        z = s["z"] / s["ls"]
        zz = np.sum(z * z, axis=1)
        mean = np.empty(len(q))
        sd = np.zeros(len(q))
        with _one_blas_thread():
            for a in range(0, len(q), self._CHUNK):
                b = min(a + self._CHUNK, len(q))
                qc = q[a:b]
                # Squared scaled distances by |q|^2 + |z|^2 - 2 q.z: one matrix product
                # instead of an (rows x n x d) temporary.
                d2 = np.sum(qc * qc, axis=1)[:, None] + zz[None, :] - 2.0 * (qc @ z.T)
                ks = s["s2"] * self._corr(np.sqrt(np.maximum(d2, 0.0)))
                mean[a:b] = ks @ s["alpha"]
                if spread:
                    v = solve_triangular(s["chol"], ks.T, lower=True)  # L^-1 k*
                    sd[a:b] = np.sqrt(np.maximum(s["s2"] - np.sum(v * v, axis=0), 0.0))
        return s["y_mean"] + s["y_sd"] * mean, s["y_sd"] * sd

    def clone(self, *, seed: int | None = None) -> GaussianProcessSurrogate:
        return GaussianProcessSurrogate(
            features=self.features, log_features=self.log_features, kernel=self.kernel,
            noise_bounds=self.noise_bounds, max_iter=self.max_iter,
            seed=self.seed if seed is None else int(seed))

    def __repr__(self) -> str:
        return (f"GaussianProcessSurrogate(features={self.features}, log_features="
                f"{self.log_features}, kernel={self.kernel!r})")


def _one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """Limit BLAS to one thread while a GP fits or predicts, if threadpoolctl is installed.

    The GP's matrices are a few hundred rows; there OpenBLAS's threads give little (on
    an otherwise idle 2-core machine, a 224-profile search's batches took 0.10-0.19 s
    either way), and beside a profiler or a process pool on the same cores they
    busy-wait: beside two other search processes on 2 cores, a 224-profile search took
    52 s with default threads and 7.9 s with one. threadpoolctl is optional: without it
    the process's own setting (``OPENBLAS_NUM_THREADS``) applies.
    """
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


# --------------------------------------------------------------------------- objectives


@attrs.frozen(kw_only=True)
class ObjectivePrediction:
    """Predicted objectives of a set of configurations.

    Attributes:
        time_s: Predicted time, seconds (n,).
        dynamic_energy_j: Predicted dynamic energy, joules (n,), over the partition's scope.
        static_power_w: Static power of the scope, watts (from the measurements).
        time_spread: Relative (log-space) spread of the time prediction, or ``None``.
        dynamic_spread: Relative (log-space) spread of the dynamic energy, or ``None``.
    """

    time_s: np.ndarray
    dynamic_energy_j: np.ndarray
    static_power_w: float
    time_spread: np.ndarray | None = None
    dynamic_spread: np.ndarray | None = None

    @property
    def total_energy_j(self) -> np.ndarray:
        """time x static power + dynamic energy."""
        return self.time_s * self.static_power_w + self.dynamic_energy_j

    @property
    def static_energy_j(self) -> np.ndarray:
        return self.time_s * self.static_power_w

    def energy(self, kind: str) -> np.ndarray:
        """``"total"``, ``"dynamic"`` or ``"static"`` energy, joules."""
        if kind == "total":
            return self.total_energy_j
        if kind == "dynamic":
            return self.dynamic_energy_j
        if kind == "static":
            return self.static_energy_j
        raise ValueError(f"energy must be 'total', 'dynamic' or 'static', got {kind!r}")

    @property
    def spread(self) -> np.ndarray | None:
        """Combined relative spread sqrt(time_spread^2 + dynamic_spread^2), or ``None``."""
        if self.time_spread is None and self.dynamic_spread is None:
            return None
        ts = 0.0 if self.time_spread is None else self.time_spread
        ds = 0.0 if self.dynamic_spread is None else self.dynamic_spread
        return np.sqrt(np.square(ts) + np.square(ds)) * np.ones(len(self.time_s))

    def __len__(self) -> int:
        return len(self.time_s)


class ObjectiveModel:
    """Time and dynamic energy, each modelled by its own surrogate in log space.

    Total energy is recombined as ``time x static power + dynamic energy``. Dynamic
    energies are floored at a small positive fraction of their median before the log
    (a noisy measurement's dynamic energy can come out slightly negative).

    Args:
        surrogate: Template for both models (cloned twice); ``None`` =
            :class:`BootstrapEnsemble` of 5 :class:`XGBoostSurrogate`.
        seed: Seed for the clones.
    """

    def __init__(self, surrogate: Surrogate | None = None, *, seed: int = 0) -> None:
        if surrogate is None:
            surrogate = BootstrapEnsemble(seed=seed)
        if not isinstance(surrogate, Surrogate):
            raise TypeError(f"surrogate must be a kareus Surrogate, got "
                            f"{type(surrogate).__name__}")
        self.template = surrogate
        self.seed = int(seed)
        self.time_model: Surrogate | None = None
        self.dynamic_model: Surrogate | None = None
        self.static_power_w = 0.0

    def fit(self, X: ArrayLike, time_s: ArrayLike, dynamic_energy_j: ArrayLike,
            static_power_w: float) -> ObjectiveModel:
        t = np.asarray(time_s, dtype=np.float64)
        d = np.asarray(dynamic_energy_j, dtype=np.float64)
        if np.any(t <= 0):
            raise ValueError("times must be positive")
        floor = max(float(np.median(np.abs(d))) * 1e-3, 1e-12)
        self.time_model = self.template.clone(seed=self.seed * 2 + 1).fit(X, np.log(t))
        self.dynamic_model = self.template.clone(seed=self.seed * 2 + 2).fit(
            X, np.log(np.maximum(d, floor)))
        self.static_power_w = float(static_power_w)
        return self

    def predict(self, X: ArrayLike) -> ObjectivePrediction:
        if self.time_model is None or self.dynamic_model is None:
            raise RuntimeError("ObjectiveModel.predict called before fit")
        if self.time_model.has_spread and self.dynamic_model.has_spread:
            tm, ts = self.time_model.predict_spread(X)
            dm, ds = self.dynamic_model.predict_spread(X)
        else:
            tm, ts = self.time_model.predict(X), None
            dm, ds = self.dynamic_model.predict(X), None
        return ObjectivePrediction(time_s=np.exp(tm), dynamic_energy_j=np.exp(dm),
                                   static_power_w=self.static_power_w,
                                   time_spread=ts, dynamic_spread=ds)
