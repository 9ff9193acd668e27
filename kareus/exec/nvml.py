"""Energy from NVML, measured so that repeated measurements agree.

NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules
since driver load) does not move continuously: on an H200 it changes in steps about
every 100 ms, and a read returns a value up to one step stale. Reading it at arbitrary
moments around a 0.5-2 s window scatters energy by 2-9% (FACTS.md). Three things fix
that here:

* **Step-edge reads.** :class:`EnergyMeter` polls the counter of each local GPU on a
  background thread and keeps only the moments it *changes* (its edges) with their
  host time. The energy between two edges is exact, and their host times are known
  to about the polling period, so average power over an edge-to-edge span of a few
  steps is accurate to a fraction of a percent.
* **Steady-state windows.** :class:`NVMLProfiler` runs the partition back to back for
  a warm-up, then a measurement span of whole counter steps, then a short tail, with a
  device event after every run. The events give the host time at which each run
  finished, so the runs completed between the span's first and last counter step are
  counted (fractionally at the ends): energy per run = counter energy over the span /
  runs in it, time per run = span / runs in it. Under a power cap the GPU's clock
  wanders, and this keeps energy and time of exactly the same span together. The span
  is cut into sub-windows whose spread is checked; while it is above the target, the
  profiler measures again.
* **Thermal state.** Before each candidate, the profiler waits until every GPU's
  temperature is back near the baseline taken when the profiler started (not a fixed
  sleep), so the heat of one configuration does not leak into the next.

Static power is measured, not assumed: :meth:`NVMLProfiler.measure_static_power`
reads the power of GPUs blocked in a receive whose sender is late (the power a GPU
draws while it waits on communication), and of idle GPUs.

Scope: a measurement sums the energy of every GPU of the partition's group (each rank
reads its own GPU, and the ranks sum). All ranks must call :meth:`NVMLProfiler.measure`
with the same arguments in the same order; step counts are decided by rank 0 and
broadcast, so no loop length depends on one rank's timing.

``pynvml`` (the ``nvidia-ml-py`` package) is imported lazily; pass a fake module as
``nvml=`` to test without GPUs.
"""

from __future__ import annotations

import abc
import bisect
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kareus.errors import HardwareError
from kareus.model.config import ScheduleConfig
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.measurement import Measurement
from kareus.model.partition import Partition
from kareus.model.profiler import Profiler

__all__ = [
    "Coordinator",
    "EnergyMeter",
    "LocalCoordinator",
    "MeasurementRecord",
    "NVMLProfiler",
    "PartitionRunner",
    "TorchDistributedCoordinator",
    "TorchPartitionRunner",
    "load_nvml",
]


def load_nvml(nvml: Any = None) -> Any:
    """The NVML module (``pynvml``), initialised; ``nvml`` passes a fake through.

    Raises:
        HardwareError: nvidia-ml-py is missing or NVML cannot initialise.
    """
    if nvml is None:
        try:
            import pynvml  # noqa: PLC0415
        except ImportError as exc:
            raise HardwareError("NVML is not available: install nvidia-ml-py") from exc
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses
        raise HardwareError(
            f"NVML failed to initialise ({exc}): this needs a machine with NVIDIA GPUs and their "
            "driver. Without GPUs, measure with EmulatedProfiler (or replay recorded data with "
            "ReplayProfiler) and use DryRunFrequencyController") from exc
    return nvml


# ------------------------------------------------------------------------ meter


@attrs.frozen
class _Edge:
    t_s: float  # host time (perf_counter) at which the new value was first seen
    energy_mj: int


class EnergyMeter:
    """Step-edge reads of NVML's total-energy counter of some local GPUs.

    A background thread polls each GPU's counter every ``poll_interval_s`` and records
    the host time and value whenever the value changes. :meth:`energy_between` then
    answers "energy and exact duration between the first and last counter step inside
    [t0, t1]" per GPU. The thread also samples SM clock and temperature.

    Args:
        device_indices: NVML indices of the GPUs to read (a rank's own GPU).
        nvml: The NVML module (``None``: ``pynvml``).
        poll_interval_s: Polling period; the edge times are known to about this much.
        history: Edges kept per GPU.
    """

    def __init__(self, *, device_indices: Sequence[int], nvml: Any = None,
                 poll_interval_s: float | None = None, history: int = 20000) -> None:
        self.nvml = load_nvml(nvml)
        self.device_indices = tuple(int(i) for i in device_indices)
        if not self.device_indices:
            raise ValueError("an EnergyMeter needs at least one GPU")
        self.poll_interval_s = 0.0005 if poll_interval_s is None else float(poll_interval_s)
        self._handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in self.device_indices]
        self._history = int(history)
        self._edges: list[list[_Edge]] = [[] for _ in self._handles]
        self._samples: list[tuple[float, list[float], list[float]]] = []  # t, temps, clocks
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Failed counter reads so far, and the last failure.
        self.read_errors = 0
        self.last_error: str | None = None

    @property
    def alive(self) -> bool:
        """Whether the polling thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- raw reads ---------------------------------------------------------------------
    def read_energy_mj(self) -> list[int]:
        """Current counter values (mJ), one per GPU."""
        return [int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles]

    def temperatures_c(self) -> list[float]:
        """GPU temperatures (degrees C)."""
        return [float(self.nvml.nvmlDeviceGetTemperature(h, 0)) for h in self._handles]

    def sm_clocks_mhz(self) -> list[float]:
        """Current SM clocks (MHz)."""
        sm = getattr(self.nvml, "NVML_CLOCK_SM", 1)
        return [float(self.nvml.nvmlDeviceGetClockInfo(h, sm)) for h in self._handles]

    # -- background polling ---------------------------------------------------------
    def start(self) -> EnergyMeter:
        """Start the polling thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, name="kareus-energy-meter",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the polling thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._thread = None

    def __enter__(self) -> EnergyMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _poll(self) -> None:
        last = self.read_energy_mj()
        now = time.perf_counter()
        with self._lock:
            for k, v in enumerate(last):
                self._edges[k].append(_Edge(now, v))
        next_sample = now
        while not self._stop.is_set():
            try:
                vals = self.read_energy_mj()
            except Exception as exc:  # noqa: BLE001 - keep polling through NVML hiccups
                self.read_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(self.poll_interval_s)
                continue
            now = time.perf_counter()
            changed = [k for k, v in enumerate(vals) if v != last[k]]
            if changed:
                with self._lock:
                    for k in changed:
                        edges = self._edges[k]
                        edges.append(_Edge(now, vals[k]))
                        if len(edges) > self._history:
                            del edges[: len(edges) - self._history]
                last = vals
            if now >= next_sample:
                try:
                    s = (now, self.temperatures_c(), self.sm_clocks_mhz())
                except Exception:  # noqa: BLE001 - sampling is best effort
                    s = None
                if s is not None:
                    with self._lock:
                        self._samples.append(s)
                        if len(self._samples) > self._history:
                            del self._samples[: len(self._samples) - self._history]
                next_sample = now + 0.05
            self._stop.wait(self.poll_interval_s)

    # -- queries -----------------------------------------------------------------------
    def edges(self, device: int = 0) -> list[tuple[float, int]]:
        """(host time, mJ) of every recorded counter step of GPU ``device`` (position)."""
        with self._lock:
            return [(e.t_s, e.energy_mj) for e in self._edges[device]]

    def step_period_s(self, device: int = 0) -> float | None:
        """Median time between counter steps seen so far (``None`` before two steps)."""
        ts = [t for t, _ in self.edges(device)]
        gaps = [b - a for a, b in zip(ts[:-1], ts[1:]) if b > a]
        return statistics.median(gaps) if gaps else None

    def wait_edges(self, count: int, *, timeout_s: float = 5.0) -> None:
        """Block until every GPU's counter has stepped ``count`` more times."""
        start = [len(self.edges(k)) for k in range(len(self._handles))]
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if all(len(self.edges(k)) - start[k] >= count for k in range(len(self._handles))):
                return
            time.sleep(self.poll_interval_s)

    def energy_between(self, t0_s: float, t1_s: float, *, device: int = 0,
                       ) -> tuple[float, float, int]:
        """Energy (J), duration (s) and step count between the first and last counter
        steps of GPU ``device`` inside [t0_s, t1_s] (host ``perf_counter`` times).

        Returns ``(0, 0, 0)`` when fewer than two steps fall inside.
        """
        inside = [(t, e) for t, e in self.edges(device) if t0_s <= t <= t1_s]
        if len(inside) < 2:
            return 0.0, 0.0, 0
        (ta, ea), (tb, eb) = inside[0], inside[-1]
        return (eb - ea) / 1000.0, tb - ta, len(inside) - 1

    def split_powers_w(self, t0_s: float, t1_s: float, parts: int, *, device: int = 0
                       ) -> list[float]:
        """Average power (W) over ``parts`` consecutive edge-to-edge sub-windows that
        together span the steps inside [t0_s, t1_s] (fewer if there are too few steps)."""
        inside = [(t, e) for t, e in self.edges(device) if t0_s <= t <= t1_s]
        n = len(inside) - 1
        if n < 1:
            return []
        parts = max(1, min(parts, n))
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            (ta, ea), (tb, eb) = inside[a], inside[b]
            if tb > ta:
                out.append((eb - ea) / 1000.0 / (tb - ta))
        return out

    def mean_sm_clock_mhz(self, t0_s: float, t1_s: float) -> float | None:
        """Mean sampled SM clock over [t0_s, t1_s] (all GPUs of this meter)."""
        with self._lock:
            vals = [c for t, _, cs in self._samples if t0_s <= t <= t1_s for c in cs]
        return statistics.fmean(vals) if vals else None


# ------------------------------------------------------------------ coordination


class Coordinator(abc.ABC):
    """What the ranks of a partition's group agree on while profiling."""

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def world_size(self) -> int: ...

    @abc.abstractmethod
    def broadcast(self, values: Sequence[float]) -> list[float]:
        """Rank 0's ``values`` on every rank."""

    @abc.abstractmethod
    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks."""

    def barrier(self) -> None:
        self.sum([0.0])

    def blocked_wait(self, *, waiting: bool, peer: int, seconds: float) -> None:
        """Block this GPU in a receive from ``peer`` (``waiting``) or send to it after
        ``seconds`` of host sleep; used to measure blocked-in-communication power."""
        raise NotImplementedError


class LocalCoordinator(Coordinator):
    """A group of one process (no communication)."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def broadcast(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]


class TorchDistributedCoordinator(Coordinator):
    """Coordination over a ``torch.distributed`` group (small CUDA tensors through the
    group's backend; the same calls on every rank)."""

    def __init__(self, *, group: Any = None) -> None:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        if not dist.is_initialized():
            raise HardwareError("torch.distributed is not initialised; call "
                                "init_process_group first (or use LocalCoordinator)")
        self._torch, self._dist, self._group = torch, dist, group
        self._device = torch.device("cuda", torch.cuda.current_device())

    @property
    def rank(self) -> int:
        return int(self._dist.get_rank(self._group))

    @property
    def world_size(self) -> int:
        return int(self._dist.get_world_size(self._group))

    def _tensor(self, values: Sequence[float]) -> Any:
        return self._torch.tensor([float(v) for v in values], dtype=self._torch.float64,
                                  device=self._device)

    def broadcast(self, values: Sequence[float]) -> list[float]:
        t = self._tensor(values)
        src = self._dist.get_global_rank(self._group, 0) if self._group is not None else 0
        self._dist.broadcast(t, src=src, group=self._group)
        return [float(v) for v in t.tolist()]

    def sum(self, values: Sequence[float]) -> list[float]:
        t = self._tensor(values)
        self._dist.all_reduce(t, group=self._group)
        return [float(v) for v in t.tolist()]

    def blocked_wait(self, *, waiting: bool, peer: int, seconds: float) -> None:
        buf = self._torch.zeros(1024, device=self._device)
        if self._group is not None:
            peer = self._dist.get_global_rank(self._group, peer)
        if waiting:
            self._dist.recv(buf, src=peer, group=self._group)
        else:
            time.sleep(seconds)
            self._dist.send(buf, dst=peer, group=self._group)


# ------------------------------------------------------------------ runners


class PartitionRunner(abc.ABC):
    """Runs steps of a partition under a configuration on this rank's device."""

    @abc.abstractmethod
    def prepare(self, partition: Partition, config: ScheduleConfig) -> Callable[[], None]:
        """A callable that enqueues one step (one run of the partition)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until the device has finished everything enqueued."""

    @abc.abstractmethod
    def mark(self) -> Any:
        """A point in the device's stream order (an event), for :meth:`elapsed_s`."""

    @abc.abstractmethod
    def elapsed_s(self, start: Any, end: Any) -> float:
        """Device time between two marks (after :meth:`synchronize`)."""


class TorchPartitionRunner(PartitionRunner):
    """Runs :class:`~kareus.exec.torch_partition.RunnablePartition` programs through a
    :class:`~kareus.exec.executor.TorchExecutor` (programs are built once and cached,
    with the executor's collective backend, so that
    :class:`~kareus.exec.collectives.OwnKernelCollective` gets registered buffers).

    Args:
        executor: The executor (carries the collective backend and the streams).
        seed: Seed of the programs' random inputs and weights.
    """

    def __init__(self, executor: Any, *, seed: int = 0) -> None:
        import torch  # noqa: PLC0415

        self._torch = torch
        self.executor = executor
        self.seed = int(seed)
        self._programs: dict[int, tuple[Partition, Any]] = {}

    def program(self, partition: Partition) -> Any:
        from kareus.exec.torch_partition import RunnablePartition  # noqa: PLC0415

        if not isinstance(partition, RunnablePartition):
            raise TypeError(f"partition {partition.name!r} is not runnable: wrap it in "
                            "RunnableTransformerPartition or CallablePartition")
        key = id(partition)
        if key not in self._programs:
            # Buffers from the executor's backend: registered memory for the own kernels
            # (a collective allocation: every rank measures the same partitions in order).
            prog = partition.build(seed=self.seed,
                                   collective=getattr(self.executor, "collective", None))
            # Keep the partition alive with its program so the id is never reused.
            self._programs[key] = (partition, prog)
        return self._programs[key][1]

    def prepare(self, partition: Partition, config: ScheduleConfig) -> Callable[[], None]:
        prog = self.program(partition)
        ex = self.executor

        def step() -> None:
            ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, config,
                             comm_kind=prog.comm_kind, comm_output=prog.comm_output)
            prog.advance()
        return step

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def mark(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0


# ------------------------------------------------------------------ the profiler


@attrs.frozen(kw_only=True)
class MeasurementRecord:
    """Everything one :meth:`NVMLProfiler.measure` call saw (for logs and studies).

    Attributes:
        config: The configuration.
        partition: Partition type.
        measurement: The result (group scope).
        steps: Steps run in the last run; ``runs``: runs made (repeats).
        power_w: Group power over the measured span; ``subwindow_cv``: spread (std / mean) of
            the energy per step of the span's sub-windows in the accepted run.
        window_s: Edge-to-edge span of the accepted run (rank 0).
        cooldown_s: Time spent waiting for the temperature before the candidate.
        start_temp_c: Hottest GPU at the start of the candidate.
        sm_clock_mhz: Mean SM clock during the measured span (this rank's GPU).
        wall_s: Wall time the candidate took, cool-down included.
        host_step_s: Host time to enqueue one step; close to the step's device time means
            the host, not the GPU, set the pace.
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

    def to_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)
        d["config"] = self.config.to_dict()
        d["measurement"] = self.measurement.to_dict()
        return d


class NVMLProfiler(Profiler):
    """Thermally stable energy and time of partitions on real GPUs, through NVML.

    Every rank of the partition's group creates one, with an :class:`EnergyMeter` on
    its own GPU, and calls :meth:`measure` in lockstep.

    Args:
        gpu: GPU preset (or spec) the measurements are of.
        runner: Runs the partition's steps (e.g. :class:`TorchPartitionRunner`).
        meter: This rank's :class:`EnergyMeter` (started by the profiler).
        coordinator: Agreement among the group's ranks; ``None`` = :class:`LocalCoordinator`.
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
            :meth:`start` (blocked-in-communication power, or idle power on one GPU).
        group_size: GPUs of the group (``None`` = the coordinator's world size).
        counter_timeout_s: How long :meth:`start` waits for the counter to step.
        clock, sleep: Time source and sleep (tests).
    """

    def __init__(self, *, gpu: str | GPUSpec, runner: PartitionRunner, meter: EnergyMeter,
                 coordinator: Coordinator | None = None, warmup_s: float | None = None,
                 window_steps: int | None = None, sub_windows: int | None = None,
                 target_cv: float | None = None, max_runs: int | None = None,
                 cooldown_tolerance_c: float | None = None, max_cooldown_s: float | None = None,
                 static_power_w: float | None = None, group_size: int | None = None,
                 counter_timeout_s: float = 5.0,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None) -> None:
        if not isinstance(runner, PartitionRunner):
            raise TypeError(f"runner must be a PartitionRunner, got {type(runner).__name__}")
        if not isinstance(meter, EnergyMeter):
            raise TypeError(f"meter must be an EnergyMeter, got {type(meter).__name__}")
        if coordinator is not None and not isinstance(coordinator, Coordinator):
            raise TypeError(f"coordinator must be a Coordinator, got "
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
        if self.window_steps < 1 or self.sub_windows < 1 or self.max_runs < 1:
            raise ValueError("window_steps, sub_windows and max_runs must be >= 1")
        if not 0 < self.target_cv < 1:
            raise ValueError(f"target_cv must be in (0, 1), got {self.target_cv}")
        self._clock = clock or time.perf_counter
        self._sleep = sleep or time.sleep
        self.counter_timeout_s = float(counter_timeout_s)
        self._static_w = None if static_power_w is None else float(static_power_w)
        self.idle_power_w: float | None = None
        self.blocked_power_w: float | None = None
        self.baseline_temp_c: float | None = None
        self.step_period_s: float | None = None
        self.records: list[MeasurementRecord] = []
        self._started = False

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
        for _ in range(runs):
            self.measure_record(partition, config)
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
        span = (self.window_steps + 1.5) * self.step_period_s
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

    def measure_record(self, partition: Partition, config: ScheduleConfig
                       ) -> MeasurementRecord:
        """Like :meth:`measure`, returning the full :class:`MeasurementRecord`."""
        self.start()
        assert self.step_period_s is not None
        wall0 = self._clock()
        cooldown_s, start_temp = self._cooldown()
        step = self.runner.prepare(partition, config)
        # Calibrate the step time (the same number of steps on every rank).
        for _ in range(2):
            step()
        self.runner.synchronize()
        c0 = self._clock()
        for _ in range(5):
            step()
        self.runner.synchronize()
        est = max((self._clock() - c0) / 5, 1e-6)
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
            edges = [(t, e) for t, e in all_edges if lo <= t <= hi]
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
        m = Measurement(time_s=step_mean, energy_j=e_group, static_power_w=self.static_power_w())
        rec = MeasurementRecord(
            config=config, partition=partition.name, measurement=m, steps=n_steps, runs=runs,
            power_w=p_group, subwindow_cv=cv, window_s=dt_s, cooldown_s=cooldown_s,
            start_temp_c=start_temp, sm_clock_mhz=self.meter.mean_sm_clock_mhz(lo, hi),
            wall_s=self._clock() - wall0, host_step_s=host_step_s)
        self.records.append(rec)
        return rec

    def close(self) -> None:
        """Stop the meter's thread."""
        self.meter.stop()


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
