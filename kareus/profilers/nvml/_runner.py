"""Running steps of a partition under a configuration on this rank's device.

A step is one run of the partition. Where the executor captures CUDA graphs (a
[`TorchExecutor`][kareus.exec.TorchExecutor] on a GPU, by default), what is measured is
what training runs: the step is captured once and each call replays it, one launch per
step instead of one per op. The program double-buffers its collective's tensor (step
``j`` computes into one buffer while the collective reduces the other,
[PartitionProgram.advance][kareus.exec.PartitionProgram.advance]),
so two consecutive steps read and write different addresses: the runner captures two
graphs, a step at each parity, into one sequence and replays them alternately.

A measurement is one of the GPU only if the host kept the GPU fed. So the runner can also
time steps *queued* behind a sleeping kernel
([`PartitionRunner.queued_step_s`][kareus.profilers.PartitionRunner.queued_step_s]): the host enqueues
them while the GPU is held, and the time from the first to the last is the GPU's alone. The NVML
profiler divides it by the time per step it measured (the GPU-busy fraction of the window) and flags
a measurement whose GPU was busy less than 90% of it as host-bound.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from kareus._logging import get_logger
from kareus.errors import ArgumentTypeError, GraphCaptureError
from kareus.exec.executor import Executor
from kareus.model.config import ScheduleConfig
from kareus.model.partition import Partition

__all__ = ["PartitionRunner", "TorchPartitionRunner"]

_log = get_logger(__name__)


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
        """A point in the device's stream order (an event), for [`elapsed_s`][kareus.profilers.PartitionRunner.elapsed_s]."""

    @abc.abstractmethod
    def elapsed_s(self, start: Any, end: Any) -> float:
        """Device time between two marks (after [`synchronize`][kareus.profilers.PartitionRunner.synchronize])."""

    @property
    def graphs(self) -> bool:
        """Whether a step replays captured CUDA graphs (``False``: its ops are launched
        eagerly, or the runner does not say)."""
        return False

    def queued_step_s(self, step: Callable[[], None], *, steps: int,
                      host_step_s: float) -> float | None:
        """Device time per step of ``steps`` steps enqueued while the device is held, so
        that the host never holds it back: what a step costs the GPU alone.

        A runner that answers runs the same number of steps on every rank (the steps'
        collectives must match). This default runs nothing and returns ``None``: the
        runner cannot tell, and its measurements carry no GPU-busy fraction.

        Args:
            step: A step from [`prepare`][kareus.profilers.PartitionRunner.prepare].
            steps: Steps to time.
            host_step_s: Host time to enqueue one step (what the hold must outlast).
        """
        return None


class TorchPartitionRunner(PartitionRunner):
    """Runs [`RunnablePartition`][kareus.exec.RunnablePartition] programs through any
    [`Executor`][kareus.exec.Executor] (programs are built once and cached; their communication
    buffers come from the executor, [Executor.empty][kareus.exec.Executor.empty]: with a
    [`TorchExecutor`][kareus.exec.TorchExecutor] from its backends, so that
    [`OwnKernelCollective`][kareus.exec.OwnKernelCollective] gets registered buffers, which the
    other backends of the executor run on too). Device timing (``synchronize``, ``mark``,
    ``queued_step_s``) is CUDA's, through torch.

    Partitions the runner is given may also be model partitions it can make runnable:
    ``resolve`` maps them (the tuning driver maps each workload partition type to its
    [`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition]).

    Where the executor captures graphs ([`Executor.graphs`][kareus.exec.Executor.graphs];
    ``TorchExecutor(graphs=False)`` keeps every op eager, and the role's default captures none), [`prepare`][kareus.profilers.TorchPartitionRunner.prepare] captures the
    partition's step into a sequence of two graphs (a step at each parity of the program's double
    buffers, with its collective, events and SM cap) and returns a callable that replays the next of
    them. The graphs of one configuration are held at a time: preparing another releases them first
    (their memory pool goes back to the allocator), and preparing the same one again reuses them.

    Args:
        executor: The executor (its hooks launch the collectives; its ``empty`` allocates
            their buffers; its ``capture`` makes graphs where ``graphs`` is true).
        seed: Seed of the programs' random inputs and weights.
        resolve: Makes a partition that is not runnable runnable (``None``: none is).
    """

    #: The name of the runner's graph sequence in the executor (one configuration's).
    SEQUENCE = "partition-runner"

    #: How much longer than the host's enqueueing :meth:`queued_step_s` holds the device
    #: (doubled for the next call whenever a hold ran out too early).
    HOLD_FACTOR = 3.0

    def __init__(self, executor: Executor, *, seed: int = 0,
                 resolve: Callable[[Partition], Partition] | None = None) -> None:
        if not isinstance(executor, Executor):
            raise ArgumentTypeError(f"executor must be an Executor (e.g. TorchExecutor), got "
                                    f"{type(executor).__name__}")
        import torch

        self._torch = torch
        self.executor = executor
        self.seed = int(seed)
        self.resolve = resolve
        self._programs: dict[int, tuple[Partition, Any]] = {}
        self._built: dict[int, tuple[Partition, Any]] = {}
        # The captured sequence, what it was captured for ((id(program), config)) and the
        # program's parity when graph 0 was captured.
        self._sequence: Any = None
        self._captured: tuple[int, ScheduleConfig] | None = None
        self._parity = 0
        self._hold_factor = self.HOLD_FACTOR
        #: Graph sequences captured so far (one per configuration prepared in turn).
        self.captures = 0

    @property
    def graphs(self) -> bool:
        """Whether the executor captures graphs (then every step is a graph replay)."""
        return bool(self.executor.graphs)

    def program(self, partition: Partition) -> Any:
        """The built program of ``partition`` (built once with the executor's backend, then cached).

        Raises:
            TypeError: ``partition`` is not a runnable partition.
        """
        from kareus.exec.torch_partition import RunnablePartition

        key = id(partition)
        if key not in self._programs:
            given = partition
            if self.resolve is not None and not isinstance(partition, RunnablePartition):
                partition = self.resolve(partition)
            if not isinstance(partition, RunnablePartition):
                raise ArgumentTypeError(f"partition {partition.name!r} is not runnable: wrap it in "
                                        "RunnableTransformerPartition or CallablePartition")
            built = self._built.get(id(partition))
            if built is None:
                # Buffers from the executor (Executor.empty): registered memory for the
                # own kernels (a collective allocation: every rank measures the same
                # partitions in the same order).
                built = (partition, partition.build(seed=self.seed, collective=self.executor))
                self._built[id(partition)] = built
            # Keep the partitions alive with their program so no id is ever reused.
            self._programs[key] = (given, built[1])
        return self._programs[key][1]

    def prepare(self, partition: Partition, config: ScheduleConfig) -> Callable[[], None]:
        """A callable that runs one step of ``partition`` under ``config`` through the
        executor: a replay of the step's next graph where the executor captures graphs,
        else the step's ops launched one by one. Collective (every rank prepares the same
        steps in the same order: the capture's warm-up runs them).

        Raises:
            GraphCaptureError: the step cannot be captured (an op that synchronises with
                the host): build the executor with ``graphs=False``.
        """
        prog = self.program(partition)
        ex = self.executor
        if prog.comm_kind is None:  # work without a collective (outside partitions)
            def eager() -> None:
                prog.run_plain()
                prog.advance()
        else:
            def eager() -> None:
                ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, config,
                                 comm_kind=prog.comm_kind, comm_output=prog.comm_output,
                                 comm_group=getattr(prog, "comm_group", None),
                                 comm_splits=getattr(prog, "comm_splits", None))
                prog.advance()
        if not self.graphs:
            return eager
        return self._graphed(prog, config, eager)

    def _graphed(self, prog: Any, config: ScheduleConfig,
                 eager: Callable[[], None]) -> Callable[[], None]:
        """Capture ``eager`` as two graphs (a step at each parity of the program's double
        buffers) unless they are held already, and return a callable that replays the
        next one."""
        key = (id(prog), config)
        if self._sequence is None or self._captured != key:
            self.release()  # the previous configuration's graphs and memory go first
            # The capture runs both bodies once eagerly (library set-up), then captures
            # them; each advances the program, so graph 0 holds this parity's buffers and
            # graph 1 the other's, and the program is back at this parity afterwards.
            parity = prog.step % 2
            self._sequence = self.executor.capture(
                self.SEQUENCE, [eager, eager], signature=key, warmup=1)
            self._captured, self._parity = key, parity
            self.captures += 1
        seq, parity = self._sequence, self._parity

        def replay() -> None:
            i = seq.next_index
            if (prog.step - parity) % 2 != i:
                raise GraphCaptureError(
                    f"the program is at step {prog.step}, whose buffers are not those of "
                    f"graph {i} of its sequence: it was stepped outside the runner's steps")
            seq.replay(i)
            prog.advance()
        return replay

    def release(self) -> None:
        """Drop the captured graphs (the executor's and this runner's references), so that
        their memory pool can return to the allocator."""
        if self._sequence is not None:
            self.executor.release_graphs(self.SEQUENCE)
        self._sequence = None
        self._captured = None

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``."""
        self._torch.cuda.synchronize()

    def mark(self) -> Any:
        """A timing CUDA event recorded on the current stream."""
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Device time between two marks, seconds."""
        return float(start.elapsed_time(end)) / 1000.0

    def queued_step_s(self, step: Callable[[], None], *, steps: int,
                      host_step_s: float) -> float | None:
        """Device time per step of ``steps`` steps enqueued behind a sleeping kernel
        (``torch.cuda._sleep``, sized to outlast the host's enqueueing), so that no step
        waits on the host: the GPU's time alone.

        As many steps run first, untimed and queued too: their collectives absorb the
        ranks' different start times, and the GPU leaves the sleeping kernel's low-power
        state before the timed steps (on 1x H200, GEMM-heavy steps timed right after the
        sleep ran up to 13% faster than back to back, at a higher clock, and GPU-bound
        partitions were flagged host-bound). Runs ``2 * steps`` steps on every rank.
        """
        from kareus.exec.device_time import queued_time_s

        n = max(1, int(steps))
        factor = self._hold_factor
        got = queued_time_s(step, steps=n, host_step_s=host_step_s, hold_factor=factor)
        if not got.held_long_enough:
            self._hold_factor = 2 * factor
            _log.debug("the device hold ran out before %d steps were enqueued (%.2f ms): the "
                       "queued time may include host gaps; the next hold is %gx the host "
                       "time", 2 * n, got.enqueue_s * 1e3, self._hold_factor)
        return got.step_s
