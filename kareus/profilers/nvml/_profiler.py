"""The NVML profiler: thermally stable energy and time of partitions on real GPUs.

Each measurement also says how the GPU was fed: ``execution`` (``"graphed"``: every step a
CUDA-graph replay, as the training loop runs on a GPU; ``"eager"``: every op launched from
the host) and ``gpu_busy``, the fraction of the measured time per step that the GPU needs
alone (steps queued behind a sleeping kernel,
[PartitionRunner.queued_step_s][kareus.profilers.PartitionRunner.queued_step_s]). Below
``HOST_BOUND_BUSY`` the host, not the GPU, set the pace: the measurement is of the launches as much
as of the partition, and it is flagged (a warning on the ``kareus`` logger and
[`MeasurementRecord.host_bound`][kareus.profilers.MeasurementRecord.host_bound]).
"""

from __future__ import annotations

import bisect
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kareus._logging import get_logger
from kareus.errors import (
    ArgumentError,
    ArgumentTypeError,
    ConfigError,
    HardwareError,
    UnknownSlotError,
)
from kareus.exec.frequency import DryRunFrequencyController, FrequencyController
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition
from kareus.model.profiler import Profiler
from kareus.profilers.nvml._coordinator import Coordinator, LocalCoordinator
from kareus.profilers.nvml._meter import EnergyMeter
from kareus.profilers.nvml._runner import PartitionRunner

__all__ = ["HOST_BOUND_BUSY", "MeasurementRecord", "NVMLProfiler"]

_log = get_logger(__name__)

#: Shortest window the idle power is averaged over (s).
IDLE_WINDOW_S = 0.5

#: A measurement whose GPU was busy less than this fraction of its window is host-bound.
HOST_BOUND_BUSY = 0.90


def _mhz(clock: float | None) -> str:
    return "?" if clock is None else f"{clock:.0f}"


def _busy(gpu_step_s: float | None, step_s: float, queued_clock: float | None,
          window_clock: float | None) -> float | None:
    """Busy fraction of a window: the GPU's own time per step (timed in a short queued
    burst) over the measured time per step. Where the window ran at a lower SM clock than
    the burst (sustained load brings the GPU to its power limit), the GPU's time is scaled
    up by the clock ratio first: compute-bound work takes that much longer at the lower
    clock, and a slower GPU is not a starved one. (Memory-bound work slows less, so the
    scaled figure is an upper bound of its busy time: a window is called host-bound only
    when even that leaves the GPU idle.)"""
    if gpu_step_s is None or step_s <= 0:
        return None
    scale = 1.0
    if queued_clock and window_clock and 0 < window_clock < queued_clock:
        scale = queued_clock / window_clock
    return min(1.0, gpu_step_s * scale / step_s)


@attrs.frozen(kw_only=True)
class MeasurementRecord:
    """Everything one [`NVMLProfiler.measure`][kareus.profilers.NVMLProfiler.measure] call saw (for logs and studies).

    Attributes:
        config: The configuration.
        partition: Partition type.
        measurement: The result, over the partition's group (its TP x CP GPUs): measured on
            ``measured_gpus``, scaled to ``scope_gpus`` where the two differ.
        steps: Steps run in the last run; ``runs``: runs made (repeats).
        power_w: Group power over the measured span; ``subwindow_cv``: spread (std / mean) of
            the energy per step of the span's sub-windows in the accepted run.
        window_s: Edge-to-edge span of the accepted run (rank 0).
        cooldown_s: Time spent waiting for the temperature before the candidate.
        start_temp_c: Hottest GPU at the start of the candidate.
        sm_clock_mhz: Mean SM clock during the measured span (this rank's GPU).
        queued_sm_clock_mhz: Mean SM clock while ``gpu_step_s`` was timed (a short burst of
            queued steps, before the power limit bites).
        wall_s: Wall time the candidate took, cool-down included.
        host_step_s: Host time to enqueue one step; close to the step's device time means
            the host, not the GPU, set the pace.
        gpu_step_s: The GPU's time per step alone (steps queued behind a sleeping kernel;
            the mean over the group's ranks); ``None``: the runner cannot tell.
        gpu_busy: The fraction of the window the GPU was busy: ``gpu_step_s``, scaled to
            the window's clock where the window ran at a lower one (a GPU at its power
            limit is busy, only slower), over the measured time per step, at most 1
            (``None`` without ``gpu_step_s``).
        execution: ``"graphed"`` (steps were CUDA-graph replays) or ``"eager"``.
        measured_gpus: GPUs whose energy was read (the profiler's group).
        scope_gpus: GPUs the measurement stands for (the partition's group).
    """

    config: ScheduleConfig
    partition: str
    measurement: Measurement
    steps: int
    runs: int
    power_w: float
    subwindow_cv: float
    window_s: float
    cooldown_s: float
    start_temp_c: float
    sm_clock_mhz: float | None
    wall_s: float
    host_step_s: float = 0.0
    gpu_step_s: float | None = None
    gpu_busy: float | None = None
    execution: str | None = None
    queued_sm_clock_mhz: float | None = None
    measured_gpus: int = 1
    scope_gpus: int = 1

    @property
    def host_bound(self) -> bool:
        """Whether the GPU was busy less than ``HOST_BOUND_BUSY`` of the window."""
        return self.gpu_busy is not None and self.gpu_busy < HOST_BOUND_BUSY

    def execution_facts(self) -> dict[str, Any]:
        """How the GPU was fed, for logs and recordings: ``execution`` and ``gpu_busy``
        where known (a JSON-ready dict)."""
        facts: dict[str, Any] = {}
        if self.execution is not None:
            facts["execution"] = self.execution
        if self.gpu_busy is not None:
            facts["gpu_busy"] = round(self.gpu_busy, 4)
        return facts

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (configuration and measurement as their dicts)."""
        d = attrs.asdict(self, recurse=False)
        d["config"] = self.config.to_dict()
        d["measurement"] = self.measurement.to_dict()
        return d


class NVMLProfiler(Profiler):
    """Thermally stable energy and time of partitions on real GPUs, through NVML.

    Every rank of the partition's group creates one, with an
    [`EnergyMeter`][kareus.profilers.EnergyMeter] on its own GPU, and calls
    [`measure`][kareus.profilers.NVMLProfiler.measure] in lockstep.

    Args:
        gpu: GPU preset (or spec) the measurements are of.
        runner: Runs the partition's steps (e.g.
            [`TorchPartitionRunner`][kareus.profilers.TorchPartitionRunner]).
        meter: This rank's [`EnergyMeter`][kareus.profilers.EnergyMeter] (started by the profiler).
        coordinator: Agreement among the group's ranks; ``None`` =
            [`LocalCoordinator`][kareus.profilers.LocalCoordinator].
        warmup_s: Back-to-back running before the measured span; ``None`` = 0.4 s.
        window_steps: Counter steps in the measured span (each 75-100 ms on H200);
            ``None`` = 6.
        sub_windows: Parts the span is cut into to detect a span that is not steady.
        target_cv: Accept a run when its sub-windows' energy-per-step spread is at most this
            (else run again, up to ``max_runs``); ``None`` = 0.05. Sub-windows of two
            counter steps scatter by 1-4% under a power cap even when whole spans agree
            to 0.2% (measured on H200, docs/results.md), so this only catches spans that
            are clearly not steady.
        max_runs: Runs per candidate at most (each one a full warm-up and span); ``None``
            = 2.
        cooldown_tolerance_c: Wait before a candidate until every GPU is at most this
            much above the baseline temperature...
        max_cooldown_s: ...but no longer than this (``None`` = 1 s; an H200 falls from
            ~58 C to within 3 C of its working baseline in 0.3-0.6 s).
        static_power_w: Static power of the whole group; ``None`` = measure it at
            [`start`][kareus.profilers.NVMLProfiler.start] (blocked-in-communication power, or idle power
            on one GPU).
        group_size: GPUs of the group (``None`` = the coordinator's world size).
        counter_timeout_s: How long [`start`][kareus.profilers.NVMLProfiler.start] waits for the counter
            to step.
        frequency: Sets the SM clock of each candidate. Only a controller that changes
            clocks ([`NVMLFrequencyController`][kareus.exec.NVMLFrequencyController]) opens the
            frequency dimension; without one, or with a
            [`DryRunFrequencyController`][kareus.exec.DryRunFrequencyController] (machines whose
            clocks must not change), the space holds one clock, the GPU's default
            (``clock_note`` says so), and no clock is ever set.
        freqs_mhz: The clocks to search when clocks are controlled; ``None`` = the GPU's
            search grid.
        comm_sms: SM counts to search; ``None`` = [`ConfigSpace`][kareus.model.ConfigSpace]'s.
        backends: Names of the collective backends the runner's executor holds
            (``TorchExecutor(backends=...)``); with two or more, the backend is a dimension
            of every space. ``None`` = the executor's one collective.
        outside: ``(work, comm_sms) -> runnable partition`` for
            [`measure_outside`][kareus.profilers.NVMLProfiler.measure_outside] (e.g.
            ``RunnableOutsideWork``); ``None``: this profiler cannot measure the work outside
            partitions.
        busy_steps: Steps the runner queues behind a sleeping kernel, once per
            measurement, for the GPU's time per step alone (the GPU-busy fraction);
            ``None`` = 10.
        clock: Time source (tests).
        sleep: Sleep function (tests).
    """

    def __init__(self, *, gpu: str | GPUSpec, runner: PartitionRunner, meter: EnergyMeter,
                 coordinator: Coordinator | None = None, warmup_s: float | None = None,
                 window_steps: int | None = None, sub_windows: int | None = None,
                 target_cv: float | None = None, max_runs: int | None = None,
                 cooldown_tolerance_c: float | None = None, max_cooldown_s: float | None = None,
                 static_power_w: float | None = None, group_size: int | None = None,
                 counter_timeout_s: float = 5.0,
                 frequency: FrequencyController | None = None,
                 freqs_mhz: Sequence[int] | None = None,
                 comm_sms: Sequence[int] | None = None,
                 backends: Sequence[str] | None = None,
                 outside: Callable[[OutsideWork, int | None], Partition] | None = None,
                 busy_steps: int | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None) -> None:
        if not isinstance(runner, PartitionRunner):
            raise ArgumentTypeError(f"runner must be a PartitionRunner, got "
                                    f"{type(runner).__name__}")
        if not isinstance(meter, EnergyMeter):
            raise ArgumentTypeError(f"meter must be an EnergyMeter, got {type(meter).__name__}")
        if coordinator is not None and not isinstance(coordinator, Coordinator):
            raise ArgumentTypeError(f"coordinator must be a Coordinator, got "
                                    f"{type(coordinator).__name__}")
        self.gpu = get_gpu(gpu)
        self.runner = runner
        self.meter = meter
        self.coord = coordinator if coordinator is not None else LocalCoordinator()
        self.warmup_s = 0.4 if warmup_s is None else float(warmup_s)
        self.window_steps = 6 if window_steps is None else int(window_steps)
        self.sub_windows = 3 if sub_windows is None else int(sub_windows)
        self.target_cv = 0.05 if target_cv is None else float(target_cv)
        self.max_runs = 2 if max_runs is None else int(max_runs)
        self.cooldown_tolerance_c = 3.0 if cooldown_tolerance_c is None \
            else float(cooldown_tolerance_c)
        self.max_cooldown_s = 1.0 if max_cooldown_s is None else float(max_cooldown_s)
        self.group_size = self.coord.world_size if group_size is None else int(group_size)
        self.busy_steps = 10 if busy_steps is None else int(busy_steps)
        if self.window_steps < 1 or self.sub_windows < 1 or self.max_runs < 1 \
                or self.busy_steps < 1:
            raise ArgumentError("window_steps, sub_windows, max_runs and busy_steps must be >= 1")
        if not 0 < self.target_cv < 1:
            raise ArgumentError(f"target_cv must be in (0, 1), got {self.target_cv}")
        self._clock = clock or time.perf_counter
        self._sleep = sleep or time.sleep
        self.counter_timeout_s = float(counter_timeout_s)
        self._static_w = None if static_power_w is None else float(static_power_w)
        self.idle_power_w: float | None = None
        self.blocked_power_w: float | None = None
        self.baseline_temp_c: float | None = None
        self.step_period_s: float | None = None
        self.records: list[MeasurementRecord] = []
        #: The record of the latest measurement (pre-heating runs included).
        self.last_record: MeasurementRecord | None = None
        self._last_facts: dict[str, Any] | None = None
        self._preheating = False
        self._started = False
        if frequency is not None and not isinstance(frequency, FrequencyController):
            raise ArgumentTypeError(f"frequency must be a FrequencyController, got "
                                    f"{type(frequency).__name__}")
        self.frequency = frequency
        #: Whether this profiler sets the clock of each candidate (the frequency dimension).
        self.clocks_controlled = frequency is not None and not isinstance(
            frequency, DryRunFrequencyController)
        if self.clocks_controlled:
            grid = self.gpu.search_clocks_mhz if freqs_mhz is None else freqs_mhz
            self.freqs_mhz: tuple[int, ...] = tuple(sorted({int(f) for f in grid},
                                                           reverse=True))
            for f in self.freqs_mhz:
                self.gpu.check_clock(f)
            self.clock_note = (f"clocks set per candidate by {type(frequency).__name__}: "
                               f"{len(self.freqs_mhz)} clocks, {min(self.freqs_mhz)}-"
                               f"{max(self.freqs_mhz)} MHz")
        else:
            self.freqs_mhz = (self.gpu.max_clock_mhz,)
            why = ("no frequency controller" if frequency is None else
                   f"{type(frequency).__name__} (clocks must not change here)")
            self.clock_note = (f"clocks not controlled ({why}): the frequency dimension is "
                               f"the GPU's default clock only, {self.gpu.max_clock_mhz} MHz "
                               "(not locked: the GPU may run lower under its power limit)")
        self.comm_sms = None if comm_sms is None else tuple(int(c) for c in comm_sms)
        self.backends = None if backends is None else tuple(str(b) for b in backends)
        self._outside = outside
        self._outside_parts: dict[tuple[OutsideWork, int | None], Partition] = {}
        self._current_mhz: int | None = None

    # -- setup -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the meter, learn the counter's step period, the baseline temperature
        and (unless given) the static power. Collective over the group."""
        if self._started:
            return
        self.meter.start()
        self.meter.wait_edges(3, timeout_s=self.counter_timeout_s)
        period = self.meter.step_period_s()
        if period is None:
            raise HardwareError(f"NVML's energy counter did not move in "
                                f"{self.counter_timeout_s:g} s; this GPU or driver does not "
                                "report energy")
        self.step_period_s = self.coord.broadcast([period])[0]
        temps = self.meter.temperatures_c()
        self.baseline_temp_c = max(temps)
        if self._static_w is None:
            self.measure_static_power()
        self._started = True

    def preheat(self, partition: Partition, config: ScheduleConfig, *, runs: int = 2,
                settle_s: float = 0.5) -> float:
        """Run ``partition`` a few times, let the GPUs settle, and take their temperature
        then as the cool-down baseline (a working temperature: waiting for the cold idle
        temperature before every candidate would cost far more time). Collective.

        Returns:
            The new baseline temperature (hottest GPU of this rank).
        """
        self.start()
        self._preheating = True
        try:
            for _ in range(runs):
                self.measure_record(partition, config)
        finally:
            self._preheating = False
        self.records = self.records[:-runs] if runs else self.records
        self._sleep(settle_s)
        self.baseline_temp_c = max(self.meter.temperatures_c())
        return self.baseline_temp_c

    def static_power_w(self, group_size: int | None = None) -> float:
        """Measured static power of the whole group (W); per GPU times ``group_size``
        when a different group size is asked for."""
        if self._static_w is None:
            self.start()
        assert self._static_w is not None
        if group_size is None or group_size == self.group_size:
            return self._static_w
        return self._static_w / self.group_size * group_size

    def measure_static_power(self) -> float:
        """Measure idle power and blocked-in-communication power; return the group's
        static power (blocked power where the group has >= 2 GPUs, else idle power)."""
        assert self.step_period_s is not None
        # window_steps + 1.5 steps of the energy counter, and at least IDLE_WINDOW_S after
        # the 20 ms settle margin: where the counter steps every few ms (a fake meter,
        # some GPUs), a few steps are too short a window for the host times' jitter. (At
        # an H200's ~100 ms steps the counter window is the longer one.)
        span = max((self.window_steps + 1.5) * self.step_period_s, 0.02 + IDLE_WINDOW_S)
        self.runner.synchronize()
        self.coord.barrier()
        t0 = self._clock()
        self._sleep(span)
        idle = self._power_between(t0 + 0.02, self._clock())
        self.idle_power_w = self.coord.sum([idle])[0]
        blocked: float | None = None
        world = self.coord.world_size
        if world >= 2 and world % 2 == 0:
            r = self.coord.rank
            wait_s = span + 0.25
            powers = []
            peer = r + 1 if r % 2 == 0 else r - 1
            for waiting_parity in (0, 1):  # create the point-to-point channels first
                self.coord.blocked_wait(waiting=r % 2 == waiting_parity, peer=peer, seconds=0.0)
                self.runner.synchronize()
            for waiting_parity in (0, 1):
                waiting = r % 2 == waiting_parity
                self.runner.synchronize()
                self.coord.barrier()
                t0 = self._clock()
                self.coord.blocked_wait(waiting=waiting, peer=peer, seconds=wait_s)
                if waiting:
                    self._sleep(wait_s - 0.05)
                    powers.append(self._power_between(t0 + 0.15, t0 + wait_s - 0.05))
                self.runner.synchronize()
            mine = statistics.fmean(powers) if powers else 0.0
            blocked = self.coord.sum([mine])[0]
        self.blocked_power_w = blocked
        self._static_w = blocked if blocked else self.idle_power_w
        return self._static_w

    def _power_between(self, t0: float, t1: float) -> float:
        e, dt, _ = self.meter.energy_between(t0, t1)
        return e / dt if dt > 0 else 0.0

    def space(self, partition: Partition) -> ConfigSpace:
        """The configurations this profiler can measure: its clocks (``freqs_mhz``),
        SM counts and, with several, its backends."""
        several = self.backends is not None and len(self.backends) > 1
        return ConfigSpace(partition, self.gpu, freqs_mhz=self.freqs_mhz,
                           comm_sms=self.comm_sms, backends=self.backends if several else None)

    def clocks_mhz(self) -> tuple[int, ...] | None:
        """``freqs_mhz``: the clocks this profiler measures at."""
        return self.freqs_mhz

    @property
    def measures_outside_work(self) -> bool:
        """Whether it was built with ``outside=`` (how to run work outside partitions):
        without it, it measures partitions alone and ``kareus.optimize`` refuses it before
        the first measurement."""
        return self._outside is not None

    @property
    def execution(self) -> str:
        """How the measured steps feed the GPU: ``"graphed"`` (CUDA-graph replays, the
        runner's executor captures) or ``"eager"`` (every op launched from the host)."""
        return "graphed" if self.runner.graphs else "eager"

    @property
    def last_facts(self) -> dict[str, Any] | None:
        """How the GPU was fed in the last measurement (``execution``, ``gpu_busy``: its
        record's [`execution_facts`][kareus.profilers.MeasurementRecord.execution_facts])."""
        return self._last_facts

    def _validate(self, partition: Partition, config: ScheduleConfig) -> None:
        """Refuse a configuration the GPU or the partition cannot take, before the clock is
        set or anything runs (a configuration with ``comm_sms=None``, the collective's own
        CTA count, passes the SM check)."""
        self.gpu.check_clock(config.freq_mhz)
        if config.comm_sms is not None:
            self.gpu.check_comm_sms(config.comm_sms)
        slots = [] if config.launch_slot is None else [s.name for s in partition.slots]
        if config.launch_slot is not None and config.launch_slot not in slots:
            raise UnknownSlotError(f"partition {partition.name!r} has no launch slot "
                                   f"{config.launch_slot!r}; its slots: {slots or 'none'} "
                                   "(or launch_slot=None for sequential)")
        backend = getattr(config, "backend", None)
        if backend is not None and backend not in (self.backends or ()):
            raise ConfigError(f"collective backend {backend!r} is not one this profiler runs "
                              f"({list(self.backends or ())})")

    def _set_clock(self, freq_mhz: int) -> None:
        """Lock the clock at ``freq_mhz`` (controlled clocks), or check that it is the one
        clock this profiler measures at."""
        f = int(freq_mhz)
        if not self.clocks_controlled:
            if f not in self.freqs_mhz:
                raise HardwareError(f"cannot measure at {f} MHz: {self.clock_note}")
            return
        if f != self._current_mhz:
            assert self.frequency is not None
            self.frequency.set_frequency(f)
            self._current_mhz = f

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Measure the work outside partitions (embedding, LM head, loss and their
        collectives, sequentially) at ``freq_mhz``; collective over the group like
        [`measure`][kareus.profilers.NVMLProfiler.measure]. Its scope is ``group_size`` GPUs: a
        measurement of this profiler's group scaled, where the two differ, as if every GPU drew what
        the measured ones did.

        Raises:
            NotImplementedError: the profiler was built without ``outside``.
        """
        if self._outside is None:
            return super().measure_outside(work, freq_mhz, group_size=group_size,
                                           comm_sms=comm_sms)
        key = (work, comm_sms)
        if key not in self._outside_parts:
            self._outside_parts[key] = self._outside(work, comm_sms)
        part = self._outside_parts[key]
        sms = self.gpu.default_comm_sms if comm_sms is None else int(comm_sms)
        # Work asked for over another number of GPUs than this group (the once-per-
        # iteration work is asked for over every GPU of the job): each GPU runs the same
        # work, so each is taken to draw what the measured ones did (scaled once, here).
        return self.measure_record(part, ScheduleConfig(freq_mhz, sms, None),
                                   scope_gpus=int(group_size)).measurement

    # -- measuring ---------------------------------------------------------------------
    def _cooldown(self) -> tuple[float, float]:
        assert self.baseline_temp_c is not None
        t0 = self._clock()
        start = max(self.meter.temperatures_c())
        while self._clock() - t0 < self.max_cooldown_s:
            if max(self.meter.temperatures_c()) <= self.baseline_temp_c + \
                    self.cooldown_tolerance_c:
                break
            self._sleep(0.05)
        waited = self._clock() - t0
        # Everyone starts together (a wait never changes how many collectives run).
        self.coord.barrier()
        return waited, start

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Measure one run of ``partition`` under ``config`` (collective over the group)."""
        return self.measure_record(partition, config).measurement

    def measure_record(self, partition: Partition, config: ScheduleConfig, *,
                       scope_gpus: int | None = None) -> MeasurementRecord:
        """Like [`measure`][kareus.profilers.NVMLProfiler.measure], returning the full [`MeasurementRecord`][kareus.profilers.MeasurementRecord].

        ``scope_gpus``: the GPUs the measurement stands for; ``None`` = the partition's group
        (``partition.group_gpus``)."""
        self.start()
        assert self.step_period_s is not None
        wall0 = self._clock()
        self._validate(partition, config)
        self._set_clock(config.freq_mhz)
        cooldown_s, start_temp = self._cooldown()
        step = self.runner.prepare(partition, config)
        # Calibrate the step time (the same number of steps on every rank).
        for _ in range(2):
            step()
        self.runner.synchronize()
        c0 = self._clock()
        for _ in range(5):
            step()
        enqueue_s = (self._clock() - c0) / 5
        self.runner.synchronize()
        est = max((self._clock() - c0) / 5, 1e-6)
        # The GPU's time per step alone (steps queued behind a held GPU), the mean over
        # the group; every rank runs the same steps and takes part in the sum.
        q0 = self._clock()
        queued = self.runner.queued_step_s(step, steps=self.busy_steps, host_step_s=enqueue_s)
        queued_clock = self._burst_clock_mhz(q0, config.freq_mhz)
        known, total = self.coord.sum([0.0 if queued is None else 1.0, queued or 0.0])
        gpu_step_s = total / known if known == self.coord.world_size else None
        span_s = self.window_steps * self.step_period_s
        total_s = self.warmup_s + span_s + 0.6 * self.step_period_s + 0.05
        n_steps = int(self.coord.broadcast([math.ceil(total_s / est)])[0])
        n_warm = int(self.coord.broadcast([math.ceil(self.warmup_s / est)])[0])
        n_steps = max(n_steps, n_warm + 3)
        result: tuple[float, float, float, float, float] | None = None
        runs = 0
        short_retries = 0
        diag = ""
        while runs < self.max_runs:
            runs += 1
            # Let the meter's thread take the GIL often while this thread enqueues.
            switch = sys.getswitchinterval()
            sys.setswitchinterval(min(switch, 1e-4))
            try:
                t_start = self._clock()
                marks = []
                for _ in range(n_steps):
                    step()
                    marks.append(self.runner.mark())
                host_step_s = (self._clock() - t_start) / n_steps
                self.runner.synchronize()
                t_end = self._clock()
            finally:
                sys.setswitchinterval(switch)
            # A run much shorter than planned (the calibration was off): rescale, run again.
            ratio = self.coord.broadcast([total_s / max(t_end - t_start, 1e-6)])[0]
            if ratio > 1.25 and short_retries < 3:
                short_retries += 1
                runs -= 1
                n_steps = n_warm + math.ceil((n_steps - n_warm) * ratio * 1.1)
                n_warm = math.ceil(n_warm * ratio)
                n_steps = max(n_steps, n_warm + 3)
                continue
            # Host time at which each step finished on the device: the last one finished
            # just before synchronize() returned; the others by device time before it.
            done = [t_end - self.runner.elapsed_s(m, marks[-1]) for m in marks]
            lo, hi = t_start + self.warmup_s, t_end - 0.01
            all_edges = self.meter.edges()
            edges = self.meter.timed_edges(lo, hi)  # steps seen late do not bound the span
            mine = _per_step(edges, done, self.sub_windows)
            summed = self.coord.sum([float(mine is None),
                                     *(mine or [0.0] * (3 + self.sub_windows))])
            if summed[0] > 0:
                # Some GPU saw fewer than two counter steps in the span: run longer.
                n_run = sum(1 for t, _ in all_edges if t_start <= t <= t_end)
                diag = (f"run {runs}: {n_steps} steps over {t_end - t_start:.3f} s, "
                        f"{len(edges)} counter steps in the span [{lo - t_start:.3f}, "
                        f"{hi - t_start:.3f}] s and {n_run} in the run on this GPU; steps "
                        f"finished from {done[0] - t_start:.3f} to {done[-1] - t_start:.3f} s; "
                        f"meter alive={self.meter.alive}, read errors={self.meter.read_errors} "
                        f"({self.meter.last_error})")
                if not self.meter.alive:
                    self.meter.start()
                if short_retries < 2:
                    short_retries += 1
                    runs -= 1
                    n_steps = n_warm + 2 * (n_steps - n_warm)
                continue
            e_step, t_step, span = summed[1], summed[2] / self.coord.world_size, summed[3]
            sub = summed[4:]
            cv = (statistics.pstdev(sub) / statistics.fmean(sub)) if len(sub) > 1 and \
                statistics.fmean(sub) > 0 else 0.0
            result = (e_step, t_step, cv, span / self.coord.world_size, 0.0)
            decision = self.coord.broadcast([1.0 if cv <= self.target_cv else 0.0])[0]
            if decision > 0:
                break
        if result is None:
            raise HardwareError(f"could not measure {partition.name} under {config}: the "
                                f"energy counter did not step inside the measured span ({diag})")
        assert result is not None
        e_group, step_mean, cv, dt_s, _ = result
        p_group = e_group / step_mean if step_mean > 0 else 0.0
        # The partition's scope is its group (TP x CP GPUs). Measured on fewer GPUs (a world
        # of one, its collectives stood in for by loopback groups), the energy and the static
        # power are scaled to the scope, as if every GPU of the group drew what the measured
        # ones drew; the time is the measured one.
        scope = int(partition.group_gpus if scope_gpus is None else scope_gpus)
        m = Measurement(time_s=step_mean, energy_j=e_group,
                        static_power_w=self.static_power_w()).scaled_to_scope(
            measured_gpus=self.group_size, scope_gpus=scope)
        window_clock = self.meter.mean_sm_clock_mhz(lo, hi)
        busy = _busy(gpu_step_s, step_mean, queued_clock, window_clock)
        rec = MeasurementRecord(
            config=config, partition=partition.name, measurement=m, steps=n_steps, runs=runs,
            power_w=p_group, subwindow_cv=cv, window_s=dt_s, cooldown_s=cooldown_s,
            start_temp_c=start_temp, sm_clock_mhz=window_clock,
            queued_sm_clock_mhz=queued_clock,
            wall_s=self._clock() - wall0, host_step_s=host_step_s, gpu_step_s=gpu_step_s,
            gpu_busy=busy, execution=self.execution, measured_gpus=self.group_size,
            scope_gpus=scope)
        self.records.append(rec)
        self.last_record = rec
        self._last_facts = rec.execution_facts()
        raw = _busy(gpu_step_s, step_mean, None, None)
        if (not rec.host_bound and raw is not None and raw < HOST_BOUND_BUSY
                and not self._preheating and self.coord.rank == 0):
            _log.info("clock-limited measurement: %s under %s ran at %.0f MHz in its window "
                      "against %.0f MHz in a short queued burst (a power or thermal limit): "
                      "the GPU was busy, at a lower clock (%.0f%% of the window at the "
                      "burst's clock)", partition.name, config, window_clock or 0.0,
                      queued_clock or 0.0, 100 * raw)
        if rec.host_bound and not self._preheating and self.coord.rank == 0:
            assert busy is not None and gpu_step_s is not None
            _log.warning(
                "host-bound measurement: %s under %s kept the GPU busy %.0f%% of its window "
                "(%.1f us per step measured, %.1f us of GPU work; SM clock %s MHz in the "
                "window, %s MHz alone; %s execution): the figures are of the launches as "
                "much as of the partition; %s", partition.name, config, 100 * busy,
                1e6 * step_mean, 1e6 * gpu_step_s, _mhz(window_clock), _mhz(queued_clock),
                self.execution,
                "a graph replay longer than the partition: measure a larger partition"
                if self.runner.graphs else "capture graphs (TorchExecutor(graphs=None), the "
                "default on a GPU) or use the lean kernels, whose launches cost less host time")
        return rec

    def _burst_clock_mhz(self, t0_s: float, requested_mhz: int) -> float:
        """The SM clock of a short burst of steps that just ended: the meter's samples in
        it (it samples clocks every 50 ms, so a burst of a few ms often has none), else a
        reading now (the clock lags the load by milliseconds), else the requested one."""
        sampled = self.meter.mean_sm_clock_mhz(t0_s, self._clock())
        if sampled:
            return float(sampled)
        try:
            now = [c for c in self.meter.sm_clocks_mhz() if c]
        except Exception:  # best effort, as the meter's own sampling
            now = []
        return float(statistics.fmean(now)) if now else float(requested_mhz)

    def close(self) -> None:
        """Stop the meter's thread and give the clocks back (controlled clocks)."""
        self.meter.stop()
        if self.clocks_controlled and self.frequency is not None:
            self.frequency.reset()
            self._current_mhz = None


def _steps_done_at(t: float, done: Sequence[float]) -> float:
    """Steps finished by host time ``t`` (linear between step completions)."""
    i = bisect.bisect_right(done, t)
    if i == 0:
        return 0.0
    if i >= len(done):
        return float(len(done))
    a, b = done[i - 1], done[i]
    return i + ((t - a) / (b - a) if b > a else 0.0)


def _per_step(edges: Sequence[tuple[float, int]], done: Sequence[float], parts: int
              ) -> list[float] | None:
    """This GPU's energy per step (J), time per step (s), span (s) and energy per step of
    each of ``parts`` sub-windows, from the counter steps inside the span and the steps'
    completion times; ``None`` with fewer than two counter steps."""
    if len(edges) < 2:
        return None
    (ta, ea), (tb, eb) = edges[0], edges[-1]
    steps = _steps_done_at(tb, done) - _steps_done_at(ta, done)
    if steps <= 0 or tb <= ta:
        return None
    n = len(edges) - 1
    k = max(1, min(parts, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    sub = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        (t0, e0), (t1, e1) = edges[a], edges[b]
        st = _steps_done_at(t1, done) - _steps_done_at(t0, done)
        sub.append((e1 - e0) / 1000.0 / st if st > 0 else 0.0)
    sub = (sub + [sub[-1]] * parts)[:parts]
    return [(eb - ea) / 1000.0 / steps, (tb - ta) / steps, tb - ta, *sub]
