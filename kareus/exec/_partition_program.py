"""The program of a runnable partition, and the buffers its collective acts on.

[`RunnablePartition`][kareus.exec.RunnablePartition] is a partition whose ops can be built as
kernels on a GPU; ``build()`` returns a [`PartitionProgram`][kareus.exec.PartitionProgram]:
zero-argument callables that enqueue each op on the current stream, plus the tensors the partition's
collective acts on. The program double-buffers the collective's tensor, as nanobatching does: step
``j`` computes into one buffer while the collective of step ``j-1`` reduces the other
([`PartitionProgram.advance`][kareus.exec.PartitionProgram.advance] flips them), so a loop of steps
is the steady state of a nanobatched layer.

The collective's buffers come from the executor the program is built for
([`Executor.empty`][kareus.exec.Executor.empty]), or from ``backend.empty(shape, dtype)`` when a
backend with such a method is given instead (``_comm_zeros``): with
[`OwnKernelCollective`][kareus.exec.OwnKernelCollective] they are registered tensors, so the
executor's collectives take the zero-copy path; backends without ``empty`` (NCCL) get plain
``torch.zeros`` buffers. ``_comm_buffers`` sizes them from the partition's
[`CommOp`][kareus.model.CommOp]. The functions take the torch module from their caller.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

from kareus.errors import ArgumentError
from kareus.exec._executor_role import Executor
from kareus.model.ops import CommKind, CommOp
from kareus.model.partition import Partition

__all__ = ["PartitionProgram", "RunnablePartition"]


class PartitionProgram:
    """One partition instance on one device: op callables and the collective's buffers.

    Attributes:
        op_names: The ops' names, in stream order.
        comm_kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or
            ``"all_to_all"``; ``None`` for
            work that runs its collectives among its ops (outside work), run plainly.
        writer: The op that writes [`output`][kareus.exec.PartitionProgram.output] (the collective's
            next input), or ``None`` when no op of the program does (the input is produced
            elsewhere).
        comm_group: The collective's parallel group (``"tp"``, ``"cp"``, ``"ep"``), for
            the executor's ``comm_group=``; ``None``: routed by kind.
        comm_splits: An all-to-all's ``(output_splits, input_splits)`` (host lists of row
            counts, one per rank), for the executor's ``comm_splits=``; ``None`` for the
            other kinds.
        step: Steps taken so far (see [`advance`][kareus.exec.PartitionProgram.advance]).
    """

    def __init__(self, *, op_names: Sequence[str], ops: Sequence[Callable[[], Any]],
                 comm_kind: str | None, buffers: Sequence[Any], comm_outputs: Sequence[Any] = (),
                 state: dict[str, Any] | None = None, writer: str | None = None,
                 comm_group: str | None = None,
                 comm_splits: tuple[Sequence[int], Sequence[int]] | None = None) -> None:
        if len(op_names) != len(ops):
            raise ArgumentError(f"{len(ops)} ops but {len(op_names)} names")
        if writer is not None and writer not in op_names:
            raise ArgumentError(f"writer {writer!r} is not one of the ops {list(op_names)}")
        if len(buffers) != 2:
            raise ArgumentError("a program double-buffers its collective's tensor: 2 buffers")
        self.op_names = tuple(op_names)
        self._ops = tuple(ops)
        self.comm_kind = comm_kind
        self._buffers = list(buffers)
        self._comm_outputs = list(comm_outputs)
        self.state = state if state is not None else {}
        self.writer = writer
        self.comm_group = comm_group
        self.comm_splits = comm_splits
        self.step = 0

    @property
    def ops(self) -> tuple[Callable[[], Any], ...]:
        """Zero-argument callables that enqueue each op on the current stream."""
        return self._ops

    @property
    def output(self) -> Any:
        """The buffer this step's computation writes (the collective's input next step)."""
        return self._buffers[self.step % 2]

    @property
    def comm_tensor(self) -> Any:
        """The tensor this step's collective acts on: the previous step's output."""
        return self._buffers[(self.step + 1) % 2]

    @property
    def comm_output(self) -> Any:
        """Output tensor of an all-gather / reduce-scatter (``None`` for all-reduce)."""
        return self._comm_outputs[self.step % 2] if self._comm_outputs else None

    def advance(self) -> None:
        """Move to the next step (flip the double buffers)."""
        self.step += 1

    def run_plain(self) -> None:
        """Enqueue every op on the current stream, in order (no collective)."""
        for fn in self._ops:
            fn()


class RunnablePartition(Partition):
    """A partition whose ops can be built as kernels on a GPU."""

    @abc.abstractmethod
    def build(self, *, device: Any = None, seed: int = 0,
              collective: Any = None) -> PartitionProgram:
        """Allocate inputs and weights on ``device`` and return the program.

        ``collective`` is the [`Executor`][kareus.exec.Executor] (or the collective backend)
        that will run the program's collective; a partition that allocates its
        communication buffers should take them from ``Executor.empty(shape, dtype,
        kind=...)``, or from ``collective.empty(shape, dtype)`` when a backend offers that
        method.
        """


def _comm_zeros(torch: Any, collective: Any, shape: tuple[int, ...], device: Any,
                dtype: Any, kind: str = "all_reduce", group: str | None = None) -> Any:
    """A zeroed buffer for the collective: from an [`Executor`][kareus.exec.Executor]'s
    ``empty`` (the role declares it, told the collective's ``kind``, so that a backend per
    group registers it with the right group), from a backend's ``empty(shape, dtype)`` when
    it has one (registered memory for the own kernels), else from ``torch.zeros``."""
    if isinstance(collective, Executor):
        t = (collective.empty(shape, dtype, kind=kind) if group is None
             else collective.empty(shape, dtype, kind=kind, group=group))
    else:
        empty = getattr(collective, "empty", None)
        if not callable(empty):
            return torch.zeros(shape, device=device, dtype=dtype)
        t = empty(shape, dtype)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ArgumentError(f"{type(collective).__name__}.empty({shape}, {dtype}) gave a tensor "
                            f"of shape {tuple(t.shape)}, {t.dtype} on {t.device}; the program is "
                            f"built on {device}: build it on the backend's device")
    return t.zero_()


def _comm_buffers(torch: Any, comm: CommOp, model_bytes: int, device: Any, dtype: Any,
                  shape: tuple[int, ...],
                  collective: Any = None,
                  group: str | None = None) -> tuple[list[Any], list[Any]]:
    """Two input buffers (and two outputs for all-gather / reduce-scatter / all-to-all),
    zeroed. An all-to-all's are ``shape`` each (its caller sizes them: the rows a rank
    sends and receives).

    ``comm.bytes`` counts the model's elements at ``model_bytes`` bytes each (the
    workload's ``dtype_bytes``, 2 for bf16), whatever ``dtype`` the kernels run in: the
    element count is what the buffers keep, so that e.g. a float32 program's all-reduce
    buffer is still the ``shape`` its output op writes.

    Every tensor the collective reads or writes comes from ``_comm_zeros``, in a
    fixed order (inputs, then outputs), so that a backend whose ``empty`` is collective
    sees the same calls on every rank.
    """
    kind = comm.kind.value
    if comm.kind is CommKind.ALL_TO_ALL:
        pair = [_comm_zeros(torch, collective, tuple(shape), device, dtype, kind, group)
                for _ in range(4)]
        return pair[:2], pair[2:]
    n, rest = divmod(int(comm.bytes), int(model_bytes))
    if rest or n <= 0:
        raise ArgumentError(f"{comm.name}: {comm.bytes} bytes is not a whole number of "
                            f"{model_bytes}-byte elements")
    g = comm.group_size
    if comm.kind is CommKind.ALL_REDUCE:
        in_shape, out_shape = (shape if _numel(shape) == n else (n,)), None
    elif comm.kind is CommKind.ALL_GATHER:  # bytes = gathered output
        in_shape, out_shape = (n // g,), (n // g * g,)
    else:
        in_shape, out_shape = (n // g * g,), (n // g,)
    ins = [_comm_zeros(torch, collective, in_shape, device, dtype, kind, group)
           for _ in range(2)]
    outs = ([] if out_shape is None
            else [_comm_zeros(torch, collective, out_shape, device, dtype, kind, group)
                  for _ in range(2)])
    return ins, outs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
