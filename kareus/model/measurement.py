"""Measurements: time and energy of one run of some work.

Energy splits into a static part (static power x time; what the GPUs would draw
anyway while waiting) and a dynamic part (the rest). kareus models time and
dynamic energy separately and recombines them, since the static power is a
property of the GPUs, not of the configuration.

Scope: a partition's measurement covers every GPU that runs it (its TP x CP
group), and ``static_power_w`` is the static power of that whole group. A measurement taken
on fewer GPUs than its scope (a world of one standing in for the group) is scaled to the
scope by [`Measurement.scaled_to_scope`][kareus.model.Measurement.scaled_to_scope]: the time
as measured, the energy and the static power by the GPU count, as if every GPU of the scope
drew what the measured ones drew. The NVML profiler scales its partitions that way and
``kareus verify`` scales a training loop's energy to the job the same way.
"""

from __future__ import annotations

import math

import attrs

from kareus.errors import ArgumentError

__all__ = ["Measurement"]


#: Upper bounds of a measurement's fields: far beyond any run of training work (31 years,
#: 280 GWh, 10 MW), low enough that sums over an iteration stay finite. A larger value is
#: a corrupt record, not a measurement.
MAX_VALUE = {"time_s": 1e9, "energy_j": 1e15, "static_power_w": 1e7}


def _number(value: object) -> float:
    if isinstance(value, (str, bool)):  # left for the validator to refuse, by name
        return value  # type: ignore[return-value]
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer beyond float range
        return math.inf


def _finite_nonneg(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"Measurement.{attribute.name} must be finite and >= 0, got "
                         f"{value!r:.40}")
    if value > MAX_VALUE[attribute.name]:
        raise ArgumentError(f"Measurement.{attribute.name} must be at most "
                         f"{MAX_VALUE[attribute.name]:g}, got {value:g}: not a measurement")


@attrs.frozen(kw_only=True)
class Measurement:
    """Time and energy of one run.

    Attributes:
        time_s: Wall time in seconds.
        energy_j: Total energy in joules over the measurement's scope.
        static_power_w: Static power of the scope in watts.
    """

    time_s: float = attrs.field(converter=_number, validator=_finite_nonneg)
    energy_j: float = attrs.field(converter=_number, validator=_finite_nonneg)
    static_power_w: float = attrs.field(converter=_number, validator=_finite_nonneg)

    @property
    def static_energy_j(self) -> float:
        """static_power_w x time_s."""
        return self.static_power_w * self.time_s

    @property
    def dynamic_energy_j(self) -> float:
        """energy_j - static_energy_j (may be slightly negative for noisy measurements)."""
        return self.energy_j - self.static_energy_j

    @property
    def average_power_w(self) -> float:
        """Energy over time (0 for a zero-time measurement)."""
        return self.energy_j / self.time_s if self.time_s > 0 else 0.0

    def scaled_to_scope(self, *, measured_gpus: int, scope_gpus: int) -> Measurement:
        """This measurement, taken on ``measured_gpus`` GPUs, as one of ``scope_gpus``:
        time as measured, energy and static power times ``scope_gpus / measured_gpus``
        (every GPU of the scope taken to draw what the measured ones drew on average).

        Raises:
            ArgumentError: a GPU count below 1.
        """
        for name, n in (("measured_gpus", measured_gpus), ("scope_gpus", scope_gpus)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ArgumentError(f"{name} must be a whole number >= 1, got {n!r:.40}")
        if measured_gpus == scope_gpus:
            return self
        k = scope_gpus / measured_gpus
        return Measurement(time_s=self.time_s, energy_j=self.energy_j * k,
                           static_power_w=self.static_power_w * k)

    def to_dict(self) -> dict[str, float]:
        """``{"time_s", "energy_j", "static_power_w"}``, JSON-ready."""
        return {"time_s": self.time_s, "energy_j": self.energy_j,
                "static_power_w": self.static_power_w}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> Measurement:
        """Rebuild from [`to_dict`][kareus.model.Measurement.to_dict] output."""
        return cls(time_s=d["time_s"], energy_j=d["energy_j"], static_power_w=d["static_power_w"])

    def __str__(self) -> str:
        return (f"{self.time_s * 1e3:.3f} ms, {self.energy_j:.3f} J "
                f"(static {self.static_energy_j:.3f} J, dynamic {self.dynamic_energy_j:.3f} J)")
