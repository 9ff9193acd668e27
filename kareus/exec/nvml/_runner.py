"""Running steps of a partition under a configuration on this rank's device."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from kareus.exec.executor import Executor
from kareus.model.config import ScheduleConfig
from kareus.model.partition import Partition

__all__ = ["PartitionRunner", "TorchPartitionRunner"]


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
    :class:`~kareus.exec.executor.TorchExecutor` (programs are built once and cached; their
    communication buffers come from the executor's backends, :meth:`TorchExecutor.empty
    <kareus.exec.executor.TorchExecutor.empty>`, so that
    :class:`~kareus.exec.collectives.OwnKernelCollective` gets registered buffers, which
    the other backends of the executor run on too).

    Partitions the runner is given may also be model partitions it can make runnable:
    ``resolve`` maps them (the tuning driver maps each workload partition type to its
    :class:`~kareus.exec.torch_partition.RunnableTransformerPartition`).

    Args:
        executor: The executor (carries the collective backend and the streams).
        seed: Seed of the programs' random inputs and weights.
    """

    def __init__(self, executor: Executor, *, seed: int = 0,
                 resolve: Callable[[Partition], Partition] | None = None) -> None:
        if not isinstance(executor, Executor):
            raise TypeError(f"executor must be an Executor (e.g. TorchExecutor), got "
                            f"{type(executor).__name__}")
        import torch

        self._torch = torch
        self.executor = executor
        self.seed = int(seed)
        self.resolve = resolve
        self._programs: dict[int, tuple[Partition, Any]] = {}
        self._built: dict[int, tuple[Partition, Any]] = {}

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
                raise TypeError(f"partition {partition.name!r} is not runnable: wrap it in "
                                "RunnableTransformerPartition or CallablePartition")
            built = self._built.get(id(partition))
            if built is None:
                # Buffers from the executor's backends: registered memory for the own
                # kernels (a collective allocation: every rank measures the same
                # partitions in the same order).
                alloc = self.executor if callable(getattr(self.executor, "empty", None)) \
                    else getattr(self.executor, "collective", None)
                built = (partition, partition.build(seed=self.seed, collective=alloc))
                self._built[id(partition)] = built
            # Keep the partitions alive with their program so no id is ever reused.
            self._programs[key] = (given, built[1])
        return self._programs[key][1]

    def prepare(self, partition: Partition, config: ScheduleConfig) -> Callable[[], None]:
        """A callable that runs one step of ``partition`` under ``config`` through the executor."""
        prog = self.program(partition)
        ex = self.executor
        if prog.comm_kind is None:  # work without a collective (outside partitions)
            def plain() -> None:
                prog.run_plain()
                prog.advance()
            return plain

        def step() -> None:
            ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, config,
                             comm_kind=prog.comm_kind, comm_output=prog.comm_output)
            prog.advance()
        return step

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
