"""The executor role: what a training loop and the NVML profiler's runner rely on.

[`Executor`][kareus.exec.Executor] runs partitions (and microbatches of them) under configurations
or a plan; [`PartitionHook`][kareus.exec.PartitionHook] is the scope of one partition in a user's
loop (name the collective, then issue the ops); ``LaunchConfig`` is what an executor reads of a
configuration (the launch slot and the SM count, not the clock, which is applied per
microbatch). ``COMM_KINDS`` are the collectives an executor launches.

[`TorchExecutor`][kareus.exec.TorchExecutor] implements the role on CUDA streams;
``kareus.testing`` has a recording fake and a conformance suite.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kareus.compose import Plan
from kareus.exec._plan_lookup import ComputationId

__all__ = ["COMM_KINDS", "Executor", "LaunchConfig", "PartitionHook"]

#: Collective kinds the executor can launch (the names of ``CollectiveBackend`` methods).
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


class LaunchConfig(Protocol):
    """What an executor reads of a partition's configuration: where the collective starts
    and how many SMs it gets.

    A [`ScheduleConfig`][kareus.model.ScheduleConfig] is one (its clock is applied per
    microbatch, not here); so is a baseline's configuration whose ``comm_sms`` is ``None``
    (the collective with its own CTA count, on the executor's ``default_collective``), as
    [`kareus.exec.train.DefaultConfig`][kareus.exec.train.DefaultConfig] is.
    """

    @property
    def launch_slot(self) -> str | None:
        """The op the collective launches with; ``None`` = after every op (sequential)."""

    @property
    def comm_sms(self) -> int | None:
        """SMs the collective gets; ``None`` = the backend's own choice."""

    @property
    def sequential(self) -> bool:
        """Whether the collective runs after every op (``launch_slot is None``)."""


class PartitionHook(abc.ABC):
    """The scope of one partition in a user's loop (what [`Executor.partition`][kareus.exec.Executor.partition] yields).

    Call [`communicate`][kareus.exec.PartitionHook.communicate] to name the partition's collective,
    then [`op`][kareus.exec.PartitionHook.op] for each computation op in order; the executor
    launches the collective at the configured slot.

    Attributes:
        key: The partition type.
        config: The configuration it runs under.
    """

    key: str
    config: LaunchConfig

    @abc.abstractmethod
    def communicate(self, tensor: Any, *, kind: str = "all_reduce", output: Any = None) -> None:
        """Register the collective of this partition (launched at the configured slot).

        Args:
            tensor: The tensor to all-reduce in place, or the input of an all-gather /
                reduce-scatter.
            kind: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``.
            output: Output tensor of all-gather / reduce-scatter.
        """

    @abc.abstractmethod
    def op(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run (enqueue) computation op ``name`` as ``fn(*args, **kwargs)``; returns its result.

        Args:
            name: The op's name (launch slots refer to it).
            fn: The callable that enqueues the op.
            *args: Positional arguments of ``fn``.
            **kwargs: Keyword arguments of ``fn``.
        """


class Executor(abc.ABC):
    """Runs partitions (and microbatches of them) under configurations or a plan.

    The role a training loop and the NVML profiler's runner rely on. Under a plan, call
    [`start`][kareus.exec.Executor.start] first (every rank compares the plan's digest), then wrap
    each microbatch computation in [`microbatch`][kareus.exec.Executor.microbatch] and each
    partition in [`partition`][kareus.exec.Executor.partition]; outside a plan,
    [`run_partition`][kareus.exec.Executor.run_partition] and
    [`run_nanobatched`][kareus.exec.Executor.run_nanobatched] take a configuration directly. Usable
    as a context manager (``with executor:`` calls [`start`][kareus.exec.Executor.start]).

    Attributes:
        plan: The plan the executor applies, or ``None``.
        current: ``(stage, microbatch, phase)`` of the microbatch computation being run,
            or ``None`` outside [`microbatch`][kareus.exec.Executor.microbatch].
    """

    plan: Plan | None
    current: ComputationId | None

    @abc.abstractmethod
    def start(self) -> None:
        """Agree with every rank on the plan (compare digests) before any collective runs.

        Raises:
            PlanError: some rank holds another plan.
        """

    def __enter__(self) -> Executor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @abc.abstractmethod
    def run_partition(self, ops: Sequence[Callable[[], Any]], op_names: Sequence[str],
                      comm_tensor: Any, config: LaunchConfig, *,
                      comm_kind: str = "all_reduce", comm_output: Any = None) -> None:
        """Enqueue one partition: ``ops`` in order, the collective at ``config``'s slot.

        Args:
            ops: Zero-argument callables that enqueue each computation op.
            op_names: Their names (the slot names refer to them).
            comm_tensor: The tensor the collective acts on.
            config: The schedule configuration.
            comm_kind: The collective (one of ``COMM_KINDS``).
            comm_output: Output tensor of all-gather / reduce-scatter.
        """

    @abc.abstractmethod
    def run_nanobatched(self, ops: Sequence[Callable[[int], Any]], op_names: Sequence[str],
                        comm_tensors: Sequence[Any], config: LaunchConfig, *,
                        comm_kind: str = "all_reduce", comm_outputs: Sequence[Any] | None = None,
                        ) -> None:
        """Run one layer segment over ``n >= 2`` nanobatches, each nanobatch's collective
        overlapping the next nanobatch's computation from ``config``'s slot on.

        Args:
            ops: Callables ``op(i)`` that enqueue an op for nanobatch ``i``.
            op_names: Their names.
            comm_tensors: Per nanobatch, the tensor its collective acts on.
            config: The schedule configuration.
            comm_kind: The collective.
            comm_outputs: Per nanobatch, the output tensor (all-gather / reduce-scatter).
        """

    @abc.abstractmethod
    def partition(self, key: str, *, config: LaunchConfig | None = None,
                  op_names: Sequence[str] | None = None
                  ) -> contextlib.AbstractContextManager[PartitionHook]:
        """Hook for a user's loop: the scope of one partition of type ``key``.

        Args:
            key: The partition type (e.g. ``"fwd_attn"``).
            config: Override the plan's configuration.
            op_names: Expected op order, checked as ops are issued (optional).
        """

    @abc.abstractmethod
    def microbatch(self, stage: int, microbatch: int, phase: str
                   ) -> contextlib.AbstractContextManager[None]:
        """Hook for a user's loop around one microbatch computation (under a plan: its clock
        is requested here, in stream order).

        Args:
            stage: Pipeline stage.
            microbatch: Microbatch index.
            phase: ``"fwd"`` or ``"bwd"``.
        """
