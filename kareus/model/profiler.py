"""The Profiler role: measure one partition under one configuration.

Every source of measurements — the emulated GPU, real GPUs through NVML, a file
of recorded measurements — implements [`Profiler`][kareus.exec.Profiler], so the search, the
composition and the command line drive them all the same way.
"""

from __future__ import annotations

import abc

from kareus.errors import ArgumentTypeError
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.gpu import GPUSpec
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition

__all__ = ["Profiler", "ProfilerWrapper"]


class Profiler(abc.ABC):
    """Measures partitions.

    Subclasses implement [`measure`][kareus.exec.Profiler.measure];
    [`measure_outside`][kareus.exec.Profiler.measure_outside] (work outside partitions, run
    sequentially) and [`static_power_w`][kareus.exec.Profiler.static_power_w] have defaults where
    possible. What a profiler can measure beyond partitions it declares
    ([`measures_outside_work`][kareus.exec.Profiler.measures_outside_work]), so that
    [`kareus.optimize`][kareus.workflow.optimize] refuses one that lacks what it needs before the
    first measurement rather than after every search.

    Scope: a partition's [`Measurement`][kareus.model.Measurement] covers every GPU of the
        partition's group
    (TP x CP GPUs), static power included.
    """

    #: The GPU the measurements are of.
    gpu: GPUSpec

    @abc.abstractmethod
    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Run (or emulate, or look up) ``partition`` under ``config`` once and measure it."""

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Measure work outside partitions at ``freq_mhz`` (sequential, no overlap)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot measure work outside partitions; "
            "use a profiler that can (e.g. EmulatedProfiler) for iteration-level composition")

    @property
    def measures_outside_work(self) -> bool:
        """Whether [`measure_outside`][kareus.exec.Profiler.measure_outside] is implemented: what
        composing whole iterations needs (``kareus.optimize``, ``compose_systems``).

        By default: whether the class overrides it, and, for a profiler that wraps another as
        its ``inner`` profiler (as recorders do), whether that one measures it too. Override it
        where neither says the truth.
        """
        if type(self).measure_outside is Profiler.measure_outside:
            return False
        inner = getattr(self, "inner", None)
        return inner.measures_outside_work if isinstance(inner, Profiler) else True

    def static_power_w(self, group_size: int) -> float:
        """Static power of ``group_size`` GPUs."""
        return self.gpu.static_power_w * group_size

    def clocks_mhz(self) -> tuple[int, ...] | None:
        """The only clocks this profiler can measure at, where it cannot measure every clock
        of the GPU's search grid (a GPU whose clocks must not change measures at its
        default clock alone); ``None`` = any clock. The frequency-planning baselines are
        composed over these clocks."""
        return None

    def space(self, partition: Partition) -> ConfigSpace:
        """The configurations of ``partition`` this profiler can measure: by default the
        GPU's full space (a replay of recorded data narrows it to what was recorded)."""
        return ConfigSpace(partition, self.gpu)


class ProfilerWrapper(Profiler):
    """A profiler that adds something around another one and otherwise answers as it does:
    a cache of measurements, a recorder that keeps them for a replay file, the lockstep
    protocol of a tuning run across ranks.

    Every method of the role goes to ``inner`` unless the subclass overrides it, so a
    wrapper changes only what it means to change (the GPU, the configuration space, the
    clocks it can measure at and the static power stay the inner profiler's; whether it
    measures outside work too, through
    [`measures_outside_work`][kareus.exec.Profiler.measures_outside_work]).

    Args:
        inner: The profiler that measures.

    Raises:
        ArgumentTypeError: ``inner`` is not a Profiler.
    """

    def __init__(self, inner: Profiler) -> None:
        if not isinstance(inner, Profiler):
            raise ArgumentTypeError(f"inner must be a kareus Profiler, got {type(inner).__name__}")
        self.inner = inner
        self.gpu = inner.gpu

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """The inner profiler's measurement."""
        return self.inner.measure(partition, config)

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """The inner profiler's measurement of outside work."""
        return self.inner.measure_outside(work, freq_mhz, group_size=group_size,
                                          comm_sms=comm_sms)

    def static_power_w(self, group_size: int) -> float:
        """The inner profiler's static power of ``group_size`` GPUs."""
        return self.inner.static_power_w(group_size)

    def space(self, partition: Partition) -> ConfigSpace:
        """The inner profiler's configuration space of ``partition``."""
        return self.inner.space(partition)

    def clocks_mhz(self) -> tuple[int, ...] | None:
        """The inner profiler's clocks."""
        return self.inner.clocks_mhz()
