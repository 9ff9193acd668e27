"""Partition frontiers: what a search over one partition type leaves behind.

A [`PartitionFrontier`][kareus.search.PartitionFrontier] keeps every observation (configuration and
its measurement) of one partition type. Its [`points`][kareus.search.PartitionFrontier.points] are
the measured Pareto-optimal observations in (time, total energy); composition needs,
per frequency, the Pareto-optimal observations in (time, dynamic energy), since
static energy is charged once at iteration level:
[`front_at`][kareus.search.PartitionFrontier.front_at]. Observations marked ``predicted`` come from
a surrogate, not a measurement, and are left out unless asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs
import numpy as np

from kareus.errors import ArgumentError
from kareus.model.config import ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.search.pareto import pareto_mask

__all__ = ["Observation", "PartitionFrontier"]


@attrs.frozen(kw_only=True)
class Observation:
    """One configuration and its measurement (or prediction, if ``predicted``)."""

    config: ScheduleConfig
    measurement: Measurement
    predicted: bool = False

    @property
    def time_s(self) -> float:
        """The measured (or predicted) time, seconds."""
        return self.measurement.time_s

    @property
    def energy_j(self) -> float:
        """The total energy over the partition's group of GPUs, joules."""
        return self.measurement.energy_j

    @property
    def dynamic_energy_j(self) -> float:
        """The total energy less static power x time, joules."""
        return self.measurement.dynamic_energy_j

    def to_dict(self) -> dict[str, Any]:
        """This observation as JSON-ready data (inverse of [`from_dict`][kareus.search.Observation.from_dict])."""
        return {"config": self.config.to_dict(), "measurement": self.measurement.to_dict(),
                "predicted": self.predicted}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Observation:
        """An observation from [`to_dict`][kareus.search.Observation.to_dict]'s data (``predicted`` defaults to False)."""
        return cls(config=ScheduleConfig.from_dict(d["config"]),
                   measurement=Measurement.from_dict(d["measurement"]),
                   predicted=bool(d.get("predicted", False)))


def _observation_tuple(observations: Iterable[Observation]) -> tuple[Observation, ...]:
    """attrs converter: any iterable of observations as a tuple."""
    return tuple(observations)


def _front(obs: list[Observation], energy: str) -> list[Observation]:
    if not obs:
        return []
    if energy == "total":
        pts = np.array([(o.time_s, o.energy_j) for o in obs])
    elif energy == "dynamic":
        pts = np.array([(o.time_s, o.dynamic_energy_j) for o in obs])
    else:
        raise ArgumentError(f"energy must be 'total' or 'dynamic', got {energy!r}")
    mask = pareto_mask(pts)
    out = [o for o, keep in zip(obs, mask) if keep]
    return sorted(out, key=lambda o: o.time_s)


@attrs.frozen(kw_only=True)
class PartitionFrontier:
    """Every observation of one partition type, and its Pareto-optimal ones.

    Attributes:
        partition: The partition type's name.
        gpu: The GPU preset's name.
        observations: All observations, in the order they were made.
    """

    partition: str
    gpu: str
    observations: tuple[Observation, ...] = attrs.field(converter=_observation_tuple)

    @classmethod
    def from_observations(cls, partition: str, gpu: str,
                          observations: Iterable[Observation]) -> PartitionFrontier:
        """A frontier of ``observations`` (in the order made) of one partition type.

        Args:
            partition: The partition type's name.
            gpu: The GPU preset's name.
            observations: Every observation, measured or predicted.
        """
        return cls(partition=partition, gpu=gpu, observations=tuple(observations))

    def measured(self) -> list[Observation]:
        """Observations that were measured (not predicted)."""
        return [o for o in self.observations if not o.predicted]

    @property
    def points(self) -> list[Observation]:
        """Measured Pareto-optimal observations in (time, total energy), fastest first."""
        return _front(self.measured(), "total")

    @property
    def freqs_mhz(self) -> list[int]:
        """Frequencies with at least one measured observation, descending."""
        return sorted({o.config.freq_mhz for o in self.measured()}, reverse=True)

    def front_at(self, freq_mhz: int, *, energy: str = "dynamic",
                 include_predicted: bool = False) -> list[Observation]:
        """Pareto-optimal observations at one frequency, in (time, ``energy``), fastest first."""
        obs = [o for o in self.observations if o.config.freq_mhz == freq_mhz
               and (include_predicted or not o.predicted)]
        return _front(obs, energy)

    def to_dict(self) -> dict[str, Any]:
        """This frontier as JSON-ready data (inverse of [`from_dict`][kareus.search.PartitionFrontier.from_dict])."""
        return {"partition": self.partition, "gpu": self.gpu,
                "observations": [o.to_dict() for o in self.observations]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartitionFrontier:
        """A frontier from [`to_dict`][kareus.search.PartitionFrontier.to_dict]'s data."""
        return cls(partition=d["partition"], gpu=d["gpu"],
                   observations=tuple(Observation.from_dict(o) for o in d["observations"]))

    def __repr__(self) -> str:
        pts = self.points
        if not pts:
            return f"PartitionFrontier({self.partition!r} on {self.gpu}: no measurements)"
        fast, low = pts[0], min(pts, key=lambda o: o.energy_j)
        return (f"PartitionFrontier({self.partition!r} on {self.gpu}: "
                f"{len(self.measured())} measured, {len(pts)} Pareto points; "
                f"fastest {fast.time_s * 1e3:.3f} ms / {fast.energy_j:.3f} J [{fast.config}]; "
                f"lowest energy {low.time_s * 1e3:.3f} ms / {low.energy_j:.3f} J [{low.config}])")

    def plot(self, ax: Any = None, **kwargs: Any) -> Any:
        """Scatter every measured observation and draw the front (needs matplotlib)."""
        import matplotlib.pyplot as plt  # optional dependency

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 4))
        obs = self.measured()
        ax.scatter([o.time_s * 1e3 for o in obs], [o.energy_j for o in obs], s=8, alpha=0.3,
                   label="measured")
        pts = self.points
        ax.plot([o.time_s * 1e3 for o in pts], [o.energy_j for o in pts], "o-", color="C3",
                label="Pareto front", **kwargs)
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("energy (J)")
        ax.set_title(f"{self.partition} on {self.gpu}")
        ax.legend()
        return ax
