"""The Profiler role: measure one partition under one configuration.

Every source of measurements — the emulated GPU, real GPUs through NVML, a file
of recorded measurements — implements [`Profiler`][kareus.model.Profiler], so the search, the
composition and the command line drive them all the same way.

A profiler also says what it is, so that no caller has to guess from its class or its
attributes: how the measured steps reach the GPU ([`execution`][kareus.model.Profiler.execution]),
whether measuring occupies the job's GPUs ([`uses_gpus`][kareus.model.Profiler.uses_gpus]), what
distinguishes its numbers from another profiler's ([`identity`][kareus.model.Profiler.identity],
recorded in output folders' manifests and search logs), the profiler that measures under any
wrappers ([`innermost`][kareus.model.Profiler.innermost]), how many measurements it has made
([`measurement_count`][kareus.model.Profiler.measurement_count]) and how the GPU was fed in the
last one ([`last_facts`][kareus.model.Profiler.last_facts]).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from kareus.errors import ArgumentTypeError
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.gpu import GPUSpec
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition

__all__ = ["Profiler", "ProfilerWrapper"]


class Profiler(abc.ABC):
    """Measures partitions.

    Subclasses implement [`measure`][kareus.model.Profiler.measure];
    [`measure_outside`][kareus.model.Profiler.measure_outside] (work outside partitions, run
    sequentially) and [`static_power_w`][kareus.model.Profiler.static_power_w] have defaults where
    possible. What a profiler can measure beyond partitions it declares
    ([`measures_outside_work`][kareus.model.Profiler.measures_outside_work]), so that
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
        """Whether [`measure_outside`][kareus.model.Profiler.measure_outside] is implemented: what
        composing whole iterations needs (``kareus.optimize``, ``compose_systems``).

        By default: whether the class overrides it (a
        [`ProfilerWrapper`][kareus.model.ProfilerWrapper]: whether its inner profiler measures
        it). Override it where that does not say the truth.
        """
        return type(self).measure_outside is not Profiler.measure_outside

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

    # ------------------------------------------------------------------ what it is
    @property
    def execution(self) -> str | None:
        """How the measured steps reach the GPU: ``"graphed"`` (one CUDA-graph replay per
        step, what training runs on a GPU) or ``"eager"`` (kernel by kernel from the host);
        ``None`` when the profiler does not say (a model of GPU time alone).

        Search logs and manifests record it, so a search measured one way is not resumed
        the other way."""
        return None

    @property
    def uses_gpus(self) -> bool:
        """Whether measuring occupies GPUs of the job: a search task of this profiler then
        needs its partition's GPUs (a pool places it on them). By default ``True``: a
        profiler that does not say is taken to need them; the emulator and replays say
        ``False``."""
        return True

    def identity(self) -> dict[str, Any]:
        """What distinguishes this profiler's numbers from another's, as JSON-able values:
        the output folder's manifest records it, and a run resumed with another identity is
        refused. By default the class and [`execution`][kareus.model.Profiler.execution];
        override it to add every setting that changes a measurement (a seed, a noise level, a
        calibration)."""
        ident: dict[str, Any] = {"class": f"{type(self).__module__}.{type(self).__qualname__}"}
        if self.execution is not None:
            ident["execution"] = self.execution
        return ident

    @property
    def innermost(self) -> Profiler:
        """The profiler that measures, under any wrappers (recorders, caches, the lockstep of
        a tuning run): this one, unless it wraps another."""
        return self

    @property
    def measurement_count(self) -> int | None:
        """Measurements made so far, where the profiler counts them (``None``: it does not).

        A profiler that draws noise per measurement (the emulator) keys it on this count, so
        that searches run as tasks on copies of it continue the count of the original
        ([`advance_measurements`][kareus.model.Profiler.advance_measurements]) and give what
        one process gives."""
        return None

    def advance_measurements(self, count: int) -> None:
        """Take ``count`` measurements made by copies of this profiler (a pool's tasks) as
        made here; by default nothing (a profiler that counts none)."""
        return None

    @property
    def last_facts(self) -> Mapping[str, Any] | None:
        """How the GPU was fed in this profiler's most recent measurement (``execution``,
        ``gpu_busy``: the fraction of the window the GPU was busy), or ``None`` where it keeps
        no such facts. The same object until the next measurement, so a wrapper can tell
        whether a measurement it asked for made new facts."""
        return None


class ProfilerWrapper(Profiler):
    """A profiler that adds something around another one and otherwise answers as it does:
    a cache of measurements, a recorder that keeps them for a replay file, the lockstep
    protocol of a tuning run across ranks.

    Every method of the role goes to ``inner`` unless the subclass overrides it, so a
    wrapper changes only what it means to change (the GPU, the configuration space, the
    clocks it can measure at and the static power stay the inner profiler's; whether it
    measures outside work too, through
    [`measures_outside_work`][kareus.model.Profiler.measures_outside_work]).

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

    @property
    def measures_outside_work(self) -> bool:
        """Whether the inner profiler measures work outside partitions."""
        return self.inner.measures_outside_work

    @property
    def execution(self) -> str | None:
        """The inner profiler's execution mode."""
        return self.inner.execution

    @property
    def uses_gpus(self) -> bool:
        """Whether the inner profiler uses GPUs."""
        return self.inner.uses_gpus

    def identity(self) -> dict[str, Any]:
        """The inner profiler's identity: a wrapper that only records, caches or keeps ranks
        in step does not change a number (override it in one that does)."""
        return self.inner.identity()

    @property
    def innermost(self) -> Profiler:
        """The innermost profiler of the chain."""
        return self.inner.innermost

    @property
    def measurement_count(self) -> int | None:
        """The inner profiler's count of measurements."""
        return self.inner.measurement_count

    def advance_measurements(self, count: int) -> None:
        """Advance the inner profiler's count."""
        self.inner.advance_measurements(count)

    @property
    def last_facts(self) -> Mapping[str, Any] | None:
        """The facts of the inner profiler's most recent measurement."""
        return self.inner.last_facts

    def facts_since(self, before: Mapping[str, Any] | None) -> dict[str, Any]:
        """The facts of the measurement the inner profiler made since ``before`` (its
        [`last_facts`][kareus.model.Profiler.last_facts] then), or ``{}`` when it made none
        with facts (a cached answer, a profiler that keeps none)."""
        after = self.inner.last_facts
        return dict(after) if after is not None and after is not before else {}
