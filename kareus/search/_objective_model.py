"""Time and dynamic energy modelled apart, total energy recombined.

Static power is a property of the GPUs, not of the configuration, so kareus models time
and *dynamic* energy, each with its own [`Surrogate`][kareus.search.Surrogate] in log space
(they are positive and span decades across frequencies and slots, so an ensemble's
spread in log space is a *relative* uncertainty), and recombines total energy as ``time x
static power + dynamic energy``. [`ObjectivePrediction`][kareus.search.ObjectivePrediction] is what
acquisition passes read.
"""

from __future__ import annotations

import attrs
import numpy as np
from numpy.typing import ArrayLike

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.search._bootstrap_ensemble import BootstrapEnsemble
from kareus.search.surrogate import Surrogate

__all__ = ["ObjectiveModel", "ObjectivePrediction"]


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
        """time x static power, joules (n,)."""
        return self.time_s * self.static_power_w

    def energy(self, kind: str) -> np.ndarray:
        """``"total"``, ``"dynamic"`` or ``"static"`` energy, joules."""
        if kind == "total":
            return self.total_energy_j
        if kind == "dynamic":
            return self.dynamic_energy_j
        if kind == "static":
            return self.static_energy_j
        raise ArgumentError(f"energy must be 'total', 'dynamic' or 'static', got {kind!r}")

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
            [`BootstrapEnsemble`][kareus.search.BootstrapEnsemble] of 5
            [`XGBoostSurrogate`][kareus.search.XGBoostSurrogate].
        seed: Seed for the clones.
    """

    def __init__(self, surrogate: Surrogate | None = None, *, seed: int = 0) -> None:
        if surrogate is None:
            surrogate = BootstrapEnsemble(seed=seed)
        if not isinstance(surrogate, Surrogate):
            raise ArgumentTypeError(f"surrogate must be a kareus Surrogate, got "
                            f"{type(surrogate).__name__}")
        self.template = surrogate
        self.seed = int(seed)
        self.time_model: Surrogate | None = None
        self.dynamic_model: Surrogate | None = None
        self.static_power_w = 0.0
        #: Whether the last fit modelled the residual from an offset (a prior mean).
        self.with_offset = False

    def fit(self, X: ArrayLike, time_s: ArrayLike, dynamic_energy_j: ArrayLike,
            static_power_w: float, *, offset: tuple[ArrayLike, ArrayLike] | None = None
            ) -> ObjectiveModel:
        """Fit the time and dynamic-energy models (log space); return ``self``.

        Args:
            X: Features (n x d).
            time_s: Measured times, seconds (n,), positive.
            dynamic_energy_j: Measured dynamic energies, joules (n,).
            static_power_w: Static power of the scope, watts.
            offset: A prior mean in log space, ``(log time, log dynamic energy)`` of each
                row (a [`PriorMean`][kareus.search.PriorMean]'s ``log_values``): the
                surrogates then model the residual, log measured minus the offset, and
                [`predict`][kareus.search.ObjectiveModel.predict] needs the offsets of its
                rows too. ``None``: the surrogates model the log values themselves.

        Raises:
            ValueError: for a time <= 0, or bad shapes.
        """
        t = np.asarray(time_s, dtype=np.float64)
        d = np.asarray(dynamic_energy_j, dtype=np.float64)
        if np.any(t <= 0):
            raise ArgumentError("times must be positive")
        floor = max(float(np.median(np.abs(d))) * 1e-3, 1e-12)
        log_t, log_d = np.log(t), np.log(np.maximum(d, floor))
        if offset is not None:
            off_t, off_d = self._offset(offset, len(t))
            log_t, log_d = log_t - off_t, log_d - off_d
        self.time_model = self.template.clone(seed=self.seed * 2 + 1).fit(X, log_t)
        self.dynamic_model = self.template.clone(seed=self.seed * 2 + 2).fit(X, log_d)
        self.static_power_w = float(static_power_w)
        self.with_offset = offset is not None
        return self

    @staticmethod
    def _offset(offset: tuple[ArrayLike, ArrayLike], n: int) -> tuple[np.ndarray, np.ndarray]:
        off_t, off_d = (np.asarray(o, dtype=np.float64).reshape(-1) for o in offset)
        if off_t.shape != (n,) or off_d.shape != (n,):
            raise ArgumentError(f"offset must hold two arrays of {n} values (one per row), got "
                                f"{off_t.shape} and {off_d.shape}")
        return off_t, off_d

    def predict(self, X: ArrayLike, *, offset: tuple[ArrayLike, ArrayLike] | None = None
                ) -> ObjectivePrediction:
        """Predicted time, dynamic energy and their spreads for each row of ``X``.

        Args:
            X: Features (n x d).
            offset: The prior mean of each row, ``(log time, log dynamic energy)``: needed
                exactly when the model was fitted with one.

        Raises:
            RuntimeError: if called before [`fit`][kareus.search.ObjectiveModel.fit].
            ValueError: an offset given to a model fitted without one, or the reverse.
        """
        if self.time_model is None or self.dynamic_model is None:
            raise RuntimeError("ObjectiveModel.predict called before fit")
        if (offset is not None) != self.with_offset:
            raise ArgumentError("ObjectiveModel.predict: give offset= exactly when fit had one "
                                "(the surrogates model the residual from it)")
        if self.time_model.has_spread and self.dynamic_model.has_spread:
            tm, ts = self.time_model.predict_spread(X)
            dm, ds = self.dynamic_model.predict_spread(X)
        else:
            tm, ts = self.time_model.predict(X), None
            dm, ds = self.dynamic_model.predict(X), None
        if offset is not None:
            off_t, off_d = self._offset(offset, len(tm))
            tm, dm = tm + off_t, dm + off_d
        return ObjectivePrediction(time_s=np.exp(tm), dynamic_energy_j=np.exp(dm),
                                   static_power_w=self.static_power_w,
                                   time_spread=ts, dynamic_spread=ds)
