"""Gaussian-process regression as a [`Surrogate`][kareus.search.Surrogate]: the search's default.

An exact GP with a Matern kernel, automatic relevance determination and white noise,
its hyperparameters the MAP estimate found by L-BFGS-B (scipy, imported when fitting).
It interpolates between measured configurations and gives a posterior spread from one
fit.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from kareus._check import check_count
from kareus.errors import ArgumentError
from kareus.search.surrogate import Surrogate, _check_x, _check_xy

__all__ = ["GaussianProcessSurrogate"]


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
        extra_features_from: Also use every column of ``X`` from this one on, however
            many there are (``None``: none). The default surrogate passes 8
            (``EXTRA_COLUMNS_FROM``) so that, in a space of several
            collective backends, the backend column is a feature.
        log_features: Columns of ``X`` (indices into ``X``, not into ``features``) to
            log-transform first; their values must be positive.
        kernel: ``"matern52"`` or ``"matern32"``.
        noise_bounds: Bounds of the noise variance, as a fraction of the target's variance.
        max_iter: L-BFGS-B iterations for the hyperparameters.
        seed: Kept for the [`Surrogate`][kareus.search.Surrogate] protocol (the fit is
            deterministic).
    """

    has_spread = True

    _KERNELS = ("matern52", "matern32")
    # Rows of predictions computed at once (bounds the rows x n_train kernel matrix).
    _CHUNK = 4096

    def __init__(self, *, features: tuple[int, ...] | list[int] | None = None,
                 extra_features_from: int | None = None,
                 log_features: tuple[int, ...] | list[int] = (), kernel: str = "matern52",
                 noise_bounds: tuple[float, float] = (1e-6, 1.0), max_iter: int = 100,
                 seed: int = 0) -> None:
        if kernel not in self._KERNELS:
            raise ArgumentError(f"kernel must be one of {self._KERNELS}, got {kernel!r}")
        lo, hi = (float(b) for b in noise_bounds)
        if not 0 < lo < hi:
            raise ArgumentError(f"noise_bounds must satisfy 0 < low < high, got {noise_bounds}")
        check_count("max_iter", max_iter)
        self.features = None if features is None else tuple(int(c) for c in features)
        if extra_features_from is not None and extra_features_from < 0:
            raise ArgumentError(f"extra_features_from must be >= 0, got {extra_features_from}")
        self.extra_features_from = (None if extra_features_from is None
                                    else int(extra_features_from))
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
                    raise ArgumentError(f"log_features column {c} must be positive")
                x[:, c] = np.log(x[:, c])
        if self.features is not None:
            cols = list(self.features)
            if self.extra_features_from is not None:
                cols += [c for c in range(self.extra_features_from, x.shape[1])
                         if c not in cols]
            x = x[:, cols]
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
        from scipy.linalg import LinAlgError, cho_factor, cho_solve
        from scipy.linalg.lapack import dpotri

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
        """Fit the hyperparameters (MAP, L-BFGS-B) and the posterior; return ``self``."""
        x, t = _check_xy(X, y)
        self._n_features = x.shape[1]
        for c in (*(self.features or ()), *self.log_features):
            if not 0 <= c < x.shape[1]:
                raise ArgumentError(f"feature column {c} out of range for X with "
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

        from scipy.linalg import cho_solve  # only when fitting
        from scipy.optimize import minimize

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
        """Whether [`fit`][kareus.search.GaussianProcessSurrogate.fit] has been called."""
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
        """Posterior mean and standard deviation for each row of ``X``."""
        return self._predict(X, spread=True)

    def predict(self, X: ArrayLike) -> np.ndarray:
        """Posterior mean for each row of ``X`` (without the spread's solve)."""
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
        from scipy.linalg import solve_triangular

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
        """An unfitted GP with the same settings (``seed`` reseeds it)."""
        return GaussianProcessSurrogate(
            features=self.features, extra_features_from=self.extra_features_from,
            log_features=self.log_features, kernel=self.kernel,
            noise_bounds=self.noise_bounds, max_iter=self.max_iter,
            seed=self.seed if seed is None else int(seed))

    def __repr__(self) -> str:
        extra = ("" if self.extra_features_from is None
                 else f", extra_features_from={self.extra_features_from}")
        return (f"GaussianProcessSurrogate(features={self.features}{extra}, log_features="
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
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")
