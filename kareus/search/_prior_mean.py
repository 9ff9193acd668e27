"""A model's prediction of every configuration, as the surrogates' prior mean.

A search that knows nothing about a partition type spends its first profiles learning what
any model of the GPU already says: that time falls with the clock where the computation is
compute-bound, that a collective hides once it has enough SMs, which launch slot leaves
the most computation to hide behind. [`PriorMean`][kareus.search.PriorMean] carries such a
model's prediction of every configuration of a space (its time and dynamic energy), and a
[`MultiPassSearch`][kareus.search.MultiPassSearch] given one (``prior_mean=``) fits its
surrogates to the *residual*, the log of measured over predicted, instead of to the
measurements themselves: where the model is right up to a constant factor, the residual is
flat and a handful of profiles pin it down; where the model is wrong, the surrogate learns the
difference as it would have learnt the landscape.

The model is any [`Profiler`][kareus.model.Profiler] whose measurements are predictions
(``from_profiler``): on real GPUs, the emulator calibrated to the GPU's profile
([`kareus.workflow`][kareus.workflow] makes it). Predictions are never results: the search's
frontier holds measured points only, as without a prior mean.
"""

from __future__ import annotations

import hashlib

import attrs
import numpy as np

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model.config import ConfigSpace
from kareus.model.profiler import Profiler

__all__ = ["PriorMean"]


def _array(values: object) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


@attrs.frozen(kw_only=True, eq=False)
class PriorMean:
    """A model's predicted time and dynamic energy of every configuration of one space.

    Attributes:
        time_s: Predicted time of each configuration, in the order of ``space.configs``,
            seconds (positive).
        dynamic_energy_j: Predicted dynamic energy, joules, same order and scope as the
            measurements (a floor of 1e-3 of the median is applied in log space).
        source: What made the prediction (a model's name and calibration), recorded in the
            search log.

    Raises:
        ArgumentError: arrays of different lengths, non-finite values or a time <= 0.
    """

    time_s: np.ndarray = attrs.field(converter=_array)
    dynamic_energy_j: np.ndarray = attrs.field(converter=_array)
    source: str = ""

    def __attrs_post_init__(self) -> None:
        if self.time_s.shape != self.dynamic_energy_j.shape:
            raise ArgumentError(f"PriorMean: time_s has {len(self.time_s)} values, "
                                f"dynamic_energy_j {len(self.dynamic_energy_j)}: give one of "
                                "each per configuration of the space")
        if not (np.all(np.isfinite(self.time_s)) and np.all(np.isfinite(self.dynamic_energy_j))):
            raise ArgumentError("PriorMean: the predictions must be finite")
        if np.any(self.time_s <= 0):
            raise ArgumentError("PriorMean: every predicted time_s must be > 0")

    def __len__(self) -> int:
        """Configurations predicted."""
        return len(self.time_s)

    @classmethod
    def from_profiler(cls, space: ConfigSpace, model: Profiler, *,
                      source: str | None = None) -> PriorMean:
        """The prediction of ``model`` (a noise-free profiler, e.g. an emulator) of every
        configuration of ``space``, for its partition type.

        Args:
            space: The configurations (``space.partition`` is measured).
            model: Predicts; its measurements should carry no noise (noise would be
                learnt as landscape).
            source: Recorded in the search log; ``None`` = the model's class, GPU and
                calibration.

        Raises:
            ArgumentTypeError: ``model`` is not a [`Profiler`][kareus.model.Profiler].
        """
        if not isinstance(model, Profiler):
            raise ArgumentTypeError(f"a prior mean's model must be a kareus Profiler, got "
                                    f"{type(model).__name__}")
        ms = [model.measure(space.partition, c) for c in space.configs]
        if source is None:
            calibration = model.identity().get("calibration")
            source = f"{type(model).__name__} {model.gpu.name}" + (
                f" ({calibration})" if calibration else "")
        return cls(time_s=[m.time_s for m in ms],
                   dynamic_energy_j=[m.dynamic_energy_j for m in ms], source=source)

    def log_values(self) -> tuple[np.ndarray, np.ndarray]:
        """log time and log dynamic energy (floored at 1e-3 of the median): the
        surrogates' offsets."""
        d = self.dynamic_energy_j
        floor = max(float(np.median(np.abs(d))) * 1e-3, 1e-12)
        return np.log(self.time_s), np.log(np.maximum(d, floor))

    @property
    def digest(self) -> str:
        """A short digest of the predictions: a resumed search must start from the same."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.time_s).tobytes())
        h.update(np.ascontiguousarray(self.dynamic_energy_j).tobytes())
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        return f"PriorMean({len(self)} configurations, source={self.source!r})"
