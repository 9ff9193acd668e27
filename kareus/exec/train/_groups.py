"""Tensor- and context-parallel groups of a training job, and their one-GPU stand-in.

A job of ``world = TP x CP`` ranks lays ranks out TP-fastest (``rank = cp_rank * TP +
tp_rank``, as Megatron-LM does): the TP group of a rank is the ``TP`` consecutive ranks
around it, its CP group the ranks ``TP`` apart. Two kinds of collective use them:

* the partitions' collectives (TP all-reduce; CP all-gather of K/V and reduce-scatter of
  their gradients) go through a [`CollectiveBackend`][kareus.exec.CollectiveBackend] on
  the executor's side stream, with the configured SM count:
  [`GroupedCollective`][kareus.exec.train.GroupedCollective] sends each kind to the backend of its
  group;
* the work outside partitions (the vocabulary-parallel embedding and loss, the LM head's
  input gradient, the gradient sum over CP ranks) uses
  [`ParallelGroups.all_reduce`][kareus.exec.train.ParallelGroups.all_reduce] on the current stream.

[`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective] and
[`LoopbackGroups`][kareus.exec.train.LoopbackGroups] stand in for a group on one GPU: every
collective is a real kernel of the collective's size on the stream it is given, computing what the
group would if every other rank held this rank's data (an all-reduce multiplies by the group size,
an all-gather repeats the input, a reduce-scatter sums the input's blocks: the adjoint of that
all-gather, so a backward through the stand-in is the exact gradient of its forward). They let the
whole loop run end to end on one GPU; their times are not those of a group (no link traffic, no SM
cap).

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.exec.collectives import CollectiveBackend

__all__ = ["GroupedCollective", "LoopbackGroupCollective", "LoopbackGroups", "ParallelGroups",
           "TorchParallelGroups"]


def _on(stream: Any) -> Any:
    """``torch.cuda.stream(stream)`` for a CUDA stream, else a no-op context."""
    import torch

    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


class ParallelGroups:
    """The TP and CP coordinates of this rank and the outside work's all-reduce.

    Attributes:
        tp_size: Tensor-parallel degree.
        tp_rank: This rank's place in its TP group.
        cp_size: Context-parallel degree.
        cp_rank: This rank's place in its CP group.
    """

    tp_size: int
    tp_rank: int
    cp_size: int
    cp_rank: int

    #: Whether every rank of each group holds this rank's data (a one-process stand-in such
    #: as [`LoopbackGroups`][kareus.exec.train.LoopbackGroups]): the training loop then draws
    #: its tokens from this rank's vocabulary shard, so that no token's embedding is the zero
    #: row a real vocabulary-parallel lookup never produces (see ``TrainingLoop``).
    replicated: ClassVar[bool] = False

    def all_reduce(self, tensor: Any, *, group: str, op: str = "sum") -> Any:
        """Reduce ``tensor`` in place over the ``"tp"`` or ``"cp"`` group (``op``:
        ``"sum"`` or ``"max"``) on the current stream; returns ``tensor``."""
        raise NotImplementedError

    def all_gather(self, output: Any, input: Any, *, group: str) -> Any:
        """Gather every rank's ``input`` of the group into ``output`` (``[size, *input.shape]``,
        rank order) on the current stream (sequence parallelism's final-norm output before
        the LM head); returns ``output``."""
        raise NotImplementedError

    def reduce_scatter(self, output: Any, input: Any, *, group: str) -> Any:
        """Sum ``input`` (``[size, *output.shape]``) over the group; this rank's block into
        ``output``, on the current stream (sequence parallelism's embedding output and the
        LM head's input gradient); returns ``output``."""
        raise NotImplementedError

    def size(self, group: str) -> int:
        """Ranks in the ``"tp"`` or ``"cp"`` group."""
        if group not in ("tp", "cp"):
            raise ArgumentError(f"group must be 'tp' or 'cp', got {group!r}")
        return self.tp_size if group == "tp" else self.cp_size


class TorchParallelGroups(ParallelGroups):
    """TP and CP process groups of an initialised ``torch.distributed`` world.

    Args:
        tp: Tensor-parallel degree; ``world_size / tp`` is the CP degree.

    Raises:
        ValueError: ``tp`` does not divide the world size.
    """

    def __init__(self, *, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if tp < 1 or world % tp:
            raise ArgumentError(f"tp={tp} does not divide the world size {world}")
        self.tp_size, self.cp_size = int(tp), world // tp
        self.tp_rank, self.cp_rank = rank % tp, rank // tp
        self._dist = dist
        self.tp_group: Any = None
        self.cp_group: Any = None
        for c in range(self.cp_size):  # every rank creates every group, in one order
            g = dist.new_group([c * tp + t for t in range(tp)])
            if c == self.cp_rank:
                self.tp_group = g
        for t in range(tp):
            g = dist.new_group([c * tp + t for c in range(self.cp_size)])
            if t == self.tp_rank:
                self.cp_group = g

    @classmethod
    def from_groups(cls, *, tp: Any = None, cp: Any = None) -> TorchParallelGroups:
        """The groups a framework already made (Megatron-Core's ``parallel_state``, a
        torchtitan device mesh's ``get_group``, a hand-written model's ``new_group``).

        Args:
            tp: The tensor-parallel ``torch.distributed`` group of this rank (``None``: TP = 1).
            cp: The context-parallel group of this rank (``None``: CP = 1).
        """
        import torch.distributed as dist

        self = cls.__new__(cls)
        self._dist = dist
        self.tp_group, self.cp_group = tp, cp
        self.tp_size = 1 if tp is None else int(dist.get_world_size(tp))
        self.tp_rank = 0 if tp is None else int(dist.get_rank(tp))
        self.cp_size = 1 if cp is None else int(dist.get_world_size(cp))
        self.cp_rank = 0 if cp is None else int(dist.get_rank(cp))
        return self

    def group(self, name: str) -> Any:
        """The ``torch.distributed`` group ``"tp"`` or ``"cp"``."""
        self.size(name)
        return self.tp_group if name == "tp" else self.cp_group

    def all_reduce(self, tensor: Any, *, group: str, op: str = "sum") -> Any:
        """Reduce ``tensor`` in place over the group on the current stream."""
        if self.size(group) == 1:
            return tensor
        red = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX}[op]
        self._dist.all_reduce(tensor, op=red, group=self.group(group))
        return tensor

    def _nccl(self, group: str) -> bool:
        return str(self._dist.get_backend(self.group(group))) == "nccl"

    def all_gather(self, output: Any, input: Any, *, group: str) -> Any:
        """The group's all-gather into ``output`` on the current stream."""
        if self.size(group) == 1:
            return output.view(input.shape).copy_(input)
        if self._nccl(group):
            self._dist.all_gather_into_tensor(output, input.contiguous(), group=self.group(group))
        else:  # gloo: a list of views of output
            parts = list(output.view(self.size(group), -1).unbind(0))
            self._dist.all_gather(parts, input.reshape(-1).contiguous(), group=self.group(group))
        return output

    def reduce_scatter(self, output: Any, input: Any, *, group: str) -> Any:
        """The group's reduce-scatter into ``output`` on the current stream."""
        n = self.size(group)
        if n == 1:
            return output.copy_(input.view(output.shape))
        if self._nccl(group):
            self._dist.reduce_scatter_tensor(output, input.contiguous(), group=self.group(group))
        else:  # gloo has no reduce-scatter: the sum, then this rank's block
            tmp = input.contiguous().clone()
            self._dist.all_reduce(tmp, group=self.group(group))
            rank = self.tp_rank if group == "tp" else self.cp_rank
            output.copy_(tmp.view(n, *output.shape)[rank])
        return output


class LoopbackGroups(ParallelGroups):
    """TP and CP groups on one GPU: this process plays rank 0 of each, and every other
    rank holds the same data (a sum multiplies by the group size; a max is the tensor).

    The function such a stand-in computes is not the model's: every rank claims the tokens
    of this rank's vocabulary shard, so the loss counts the target's logit once per TP rank
    and can fall below zero as training goes on. It is a deterministic function of the same
    kernels, for timing the loop and comparing its schedules on one GPU.

    Args:
        tp: The tensor-parallel degree to stand in for.
        cp: The context-parallel degree to stand in for.
    """

    def __init__(self, *, tp: int, cp: int = 1) -> None:
        if tp < 1 or cp < 1:
            raise ArgumentError(f"tp and cp must be >= 1, got {tp}, {cp}")
        self.tp_size, self.cp_size = int(tp), int(cp)
        self.tp_rank = self.cp_rank = 0
        self._through: dict[str, CollectiveBackend] = {}

    replicated: ClassVar[bool] = True

    def run_through(self, backends: dict[str, CollectiveBackend | None]) -> None:
        """Run the work outside partitions' collectives of each group (``"tp"``, ``"cp"``)
        through that group's stand-in backend, on the current stream at its uncapped SM
        count: the time-faithful stand-in
        ([`TimedLoopbackGroupCollective`][kareus.exec.train.TimedLoopbackGroupCollective]),
        so that they take as long as the partitions' collectives do
        (``make_collectives(loopback="faithful")`` sets it; the first backend given for a
        group stays). The data is what the plain methods compute; a max-reduction stays
        the tensor as it is."""
        for g, b in backends.items():
            self.size(g)
            if b is not None and g not in self._through:  # the first given stays
                self._through[g] = b

    def all_reduce(self, tensor: Any, *, group: str, op: str = "sum") -> Any:
        """What the group's all-reduce gives when every rank holds ``tensor``."""
        n = self.size(group)
        if op not in ("sum", "max"):
            raise ArgumentError(f"op must be 'sum' or 'max', got {op!r}")
        if op == "sum" and n > 1:
            if group in self._through:
                return self._through[group].all_reduce(tensor, None, None)
            tensor.mul_(n)
        return tensor

    def all_gather(self, output: Any, input: Any, *, group: str) -> Any:
        """What the group's all-gather gives when every rank holds ``input``: it repeated."""
        n = self.size(group)
        if group in self._through and n > 1:
            return self._through[group].all_gather(output, input, None, None)
        output.view(n, -1).copy_(input.reshape(1, -1).expand(n, -1))
        return output

    def reduce_scatter(self, output: Any, input: Any, *, group: str) -> Any:
        """The sum of ``input``'s blocks (the adjoint of
        [`all_gather`][kareus.exec.train.LoopbackGroups.all_gather], as
        [`LoopbackGroupCollective.reduce_scatter`][kareus.exec.train.LoopbackGroupCollective.reduce_scatter])."""
        import torch

        n = self.size(group)
        if group in self._through and n > 1:
            return self._through[group].reduce_scatter(output, input, None, None)
        torch.sum(input.reshape(n, -1), dim=0, out=output.view(-1))
        return output


class LoopbackGroupCollective(CollectiveBackend):
    """A one-GPU stand-in for a group's collectives: a real kernel of the collective's
    bytes on the given stream, computing what the group would if every rank held this
    rank's data. ``sms`` is accepted and recorded but not applied.

    Args:
        group_size: The group size to stand in for.

    Attributes:
        calls: ``(kind, elements, sms)`` of the latest calls in order, at least the last
            ``CALLS_KEPT`` (a tuning run launches eagerly for hours with ``graphs=False``:
            an unbounded log would grow by every step).
        calls_total: Calls made since it was built.
    """

    name: ClassVar[str] = "loopback"

    #: How many of the latest calls ``calls`` keeps.
    CALLS_KEPT = 4096

    def __init__(self, *, group_size: int) -> None:
        if group_size < 1:
            raise ArgumentError(f"group_size must be >= 1, got {group_size}")
        self._size = int(group_size)
        self.calls: list[tuple[str, int, int | None]] = []
        self.calls_total = 0

    def _record(self, kind: str, elements: int, sms: int | None) -> None:
        self.calls.append((kind, elements, sms))
        self.calls_total += 1
        if len(self.calls) >= 2 * self.CALLS_KEPT:  # trimmed now and then: O(1) per call
            del self.calls[:-self.CALLS_KEPT]

    @property
    def world_size(self) -> int:
        """The group size stood in for."""
        return self._size

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def sm_count(self) -> int:
        """SMs of the current CUDA device (132 without one)."""
        import torch

        if not torch.cuda.is_available():
            return 132
        return int(torch.cuda.get_device_properties(torch.cuda.current_device())
                   .multi_processor_count)

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """``tensor *= group_size`` in place on ``stream`` (reads and writes its bytes)."""
        self._record("all_reduce", int(tensor.numel()), sms)
        with _on(stream):
            tensor.mul_(self._size)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """``output`` = ``input`` repeated ``group_size`` times, on ``stream``."""
        self._record("all_gather", int(output.numel()), sms)
        with _on(stream):
            output.view(self._size, -1).copy_(input.reshape(1, -1).expand(self._size, -1))
        return output

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """``output`` = the sum of ``input``'s ``group_size`` blocks, on ``stream``.

        This is the adjoint of [`all_gather`][kareus.exec.train.LoopbackGroupCollective.all_gather]
        (which copies one block to every place): the CP backward reduce-scatters the K/V
        gradients of every gathered copy, and their sum is the exact gradient of this
        rank's K/V through the stand-in's forward. (Scaling this rank's block by the group
        size instead is no gradient of anything: over 28 layers of Qwen3-1.7B at CP=2 it
        compounds into non-finite gradients in the first step.) It reads the whole input,
        as a real reduce-scatter does.
        """
        import torch

        self._record("reduce_scatter", int(input.numel()), sms)
        m = output.numel()
        with _on(stream):
            torch.sum(input.reshape(self._size, m), dim=0, out=output.view(-1))
        return output


class GroupedCollective(CollectiveBackend):
    """One backend for the executor that sends all-reduces to the TP group's backend and
    all-gathers / reduce-scatters to the CP group's, unless the collective names its group
    ([`for_group`][kareus.exec.train.GroupedCollective.for_group]: sequence parallelism's
    all-gathers and reduce-scatters run over TP).

    Args:
        tp: Backend of the TP group (``None`` when TP = 1).
        cp: Backend of the CP group (``None`` when CP = 1).
    """

    name: ClassVar[str] = "grouped"

    def __init__(self, *, tp: CollectiveBackend | None, cp: CollectiveBackend | None) -> None:
        for label, b in (("tp", tp), ("cp", cp)):
            if b is not None and not isinstance(b, CollectiveBackend):
                raise ArgumentTypeError(f"{label} must be a CollectiveBackend or None, got "
                                        f"{type(b).__name__}")
        if tp is None and cp is None:
            raise ArgumentError("GroupedCollective needs a TP or a CP backend")
        self.tp, self.cp = tp, cp

    def backend_for(self, kind: str) -> CollectiveBackend:
        """The backend that runs collectives of ``kind``.

        Raises:
            ValueError: that group has no backend (its degree is 1).
        """
        b = self.tp if kind == "all_reduce" else self.cp
        if kind not in ("all_reduce", "all_gather", "reduce_scatter") or b is None:
            raise ArgumentError(f"no backend runs {kind!r} here (TP or CP degree 1?)")
        return b

    def for_group(self, group: str) -> CollectiveBackend:
        """The backend of the ``"tp"`` or ``"cp"`` group (what the executor uses for a
        collective that names its group: [`CollectiveLaunch.group`][kareus.exec.CollectiveLaunch]).

        Raises:
            ValueError: ``group`` is neither, or that group has no backend (degree 1).
        """
        if group not in ("tp", "cp"):
            raise ArgumentError(f"group must be 'tp' or 'cp', got {group!r:.40}")
        b = self.tp if group == "tp" else self.cp
        if b is None:
            raise ArgumentError(f"no backend runs collectives over {group!r} here (degree 1)")
        return b

    def _first(self) -> CollectiveBackend:
        b = self.tp if self.tp is not None else self.cp
        assert b is not None
        return b

    @property
    def world_size(self) -> int:
        """Ranks of the TP group (of the CP group when TP = 1)."""
        return self._first().world_size

    @property
    def rank(self) -> int:
        """This rank in the TP group (in the CP group when TP = 1)."""
        return self._first().rank

    @property
    def sm_count(self) -> int:
        """SMs of this rank's GPU."""
        return self._first().sm_count

    @property
    def max_sms(self) -> int:
        """The smaller of the two backends' limits."""
        return min(b.max_sms for b in (self.tp, self.cp) if b is not None)

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """The TP group's all-reduce."""
        return self.backend_for("all_reduce").all_reduce(tensor, stream, sms)

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """The CP group's all-gather."""
        return self.backend_for("all_gather").all_gather(output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """The CP group's reduce-scatter."""
        return self.backend_for("reduce_scatter").reduce_scatter(output, input, stream, sms)

    def close(self) -> None:
        """Close both backends."""
        for b in (self.tp, self.cp):
            if b is not None:
                b.close()
