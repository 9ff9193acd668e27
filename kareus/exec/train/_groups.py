"""Tensor-, context- and expert-parallel groups of a training job, and their one-GPU stand-in.

A job of ``world = TP x CP x DP`` ranks lays ranks out TP-fastest, then CP, then DP
(``rank = (dp_rank * CP + cp_rank) * TP + tp_rank``, as Megatron-LM does): the TP group of a
rank is the ``TP`` consecutive ranks around it, its CP group the ranks ``TP`` apart within
its data-parallel replica, its DP group the ranks ``TP x CP`` apart (the replicas, each
training on its own microbatches).

A mixture-of-experts model adds two groups folded over the same ranks
(``kareus.model.moe``: Megatron-Core's "MoE parallel folding" at an expert tensor-parallel
size of 1): its expert-parallel (EP) group is ``EP`` consecutive ranks (``ep_rank = rank
% EP``; ``EP`` divides ``TP x CP x DP``), which hold ``experts / EP`` experts each and
exchange token rows in all-to-alls; its expert-data-parallel (EDP) group is the
``TP x CP x DP / EP`` ranks ``EP`` apart, which hold the same experts and sum their
gradients (the dense weights' gradients are summed over CP and DP; the router's and the
shared experts', replicated over TP and fed by each TP rank's sequence shard, over TP as
well).

Two kinds of collective use them:

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


#: The groups a job's collectives run over (``ParallelGroups.size``).
GROUPS = ("tp", "cp", "dp", "ep", "edp")


class ParallelGroups:
    """The TP, CP (and EP, EDP) coordinates of this rank and the outside work's collectives.

    Attributes:
        tp_size: Tensor-parallel degree.
        tp_rank: This rank's place in its TP group.
        cp_size: Context-parallel degree.
        cp_rank: This rank's place in its CP group.
        dp_size: Data-parallel degree (replicas of the model, each on its own data).
        dp_rank: This rank's replica.
        ep_size: Expert-parallel degree (1 without a mixture of experts).
        ep_rank: This rank's place in its EP group.
        edp_size: Expert-data-parallel degree, ``TP x CP x DP / EP``: the ranks that hold
            the same experts.
    """

    tp_size: int
    tp_rank: int
    cp_size: int
    cp_rank: int
    dp_size: int = 1
    dp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    edp_size: int = 1

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

    def all_to_all(self, output: Any, input: Any, output_splits: list[int],
                   input_splits: list[int], *, group: str = "ep") -> Any:
        """Send ``input_splits[r]`` rows of ``input`` (in rank order) to rank ``r`` of the
        group and receive ``output_splits[r]`` rows from it into ``output``, on the current
        stream (a mixture of experts' token counts before its dispatch); returns ``output``."""
        raise NotImplementedError

    def size(self, group: str) -> int:
        """Ranks in the ``"tp"``, ``"cp"``, ``"ep"`` or ``"edp"`` group."""
        if group not in GROUPS:
            raise ArgumentError(f"group must be one of {GROUPS}, got {group!r:.40}")
        return {"tp": self.tp_size, "cp": self.cp_size, "dp": self.dp_size,
                "ep": self.ep_size, "edp": self.edp_size}[group]

    def rank_in(self, group: str) -> int:
        """This rank's place in ``group``."""
        self.size(group)
        return {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank,
                "ep": self.ep_rank, "edp": self._edp_rank()}[group]

    def _edp_rank(self) -> int:
        rank = (self.dp_rank * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank
        return rank // self.ep_size


class TorchParallelGroups(ParallelGroups):
    """TP and CP (and EP, EDP) process groups of an initialised ``torch.distributed`` world.

    Args:
        tp: Tensor-parallel degree; ``world_size / (tp x dp)`` is the CP degree.
        ep: Expert-parallel degree (a mixture of experts; 1: none): ``ep`` consecutive
            ranks form an EP group, the ranks ``ep`` apart an EDP group (module docstring).
        dp: Data-parallel degree (replicas; the slowest-varying coordinate).

    Raises:
        ValueError: ``tp x dp`` does not divide the world size, or ``ep`` does not.
    """

    def __init__(self, *, tp: int, ep: int = 1, dp: int = 1) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if tp < 1 or dp < 1 or world % (tp * dp):
            raise ArgumentError(f"tp x dp = {tp} x {dp} does not divide the world size {world}")
        if ep < 1 or world % ep:
            raise ArgumentError(f"ep={ep} does not divide the world size {world} "
                                "(TP x CP x DP)")
        cp = world // (tp * dp)
        self.tp_size, self.cp_size, self.dp_size = int(tp), cp, int(dp)
        self.tp_rank, self.cp_rank, self.dp_rank = rank % tp, (rank // tp) % cp, rank // (tp * cp)
        self.ep_size, self.ep_rank, self.edp_size = int(ep), rank % ep, world // ep
        self._dist = dist
        self.tp_group: Any = None
        self.cp_group: Any = None
        self.dp_group: Any = None
        self.ep_group: Any = None
        self.edp_group: Any = None
        self._new_groups(dist, world, rank)

    def _new_groups(self, dist: Any, world: int, rank: int) -> None:
        """Every group, created by every rank in one order (``new_group`` is collective)."""
        tp, cp, dp, ep = self.tp_size, self.cp_size, self.dp_size, self.ep_size
        replica = tp * cp
        for b in range(world // tp):  # every rank creates every group, in one order
            g = dist.new_group([b * tp + t for t in range(tp)])
            if b == rank // tp:
                self.tp_group = g
        for d in range(dp):
            for t in range(tp):
                g = dist.new_group([d * replica + c * tp + t for c in range(cp)])
                if (d, t) == (self.dp_rank, self.tp_rank):
                    self.cp_group = g
        if dp > 1:
            for i in range(replica):
                g = dist.new_group([d * replica + i for d in range(dp)])
                if i == rank % replica:
                    self.dp_group = g
        if ep > 1:
            for e in range(world // ep):
                g = dist.new_group([e * ep + i for i in range(ep)])
                if e == rank // ep:
                    self.ep_group = g
        if ep > 1 and world // ep > 1:
            for i in range(ep):
                g = dist.new_group([e * ep + i for e in range(world // ep)])
                if i == self.ep_rank:
                    self.edp_group = g

    @classmethod
    def from_groups(cls, *, tp: Any = None, cp: Any = None, ep: Any = None,
                    edp: Any = None, dp: Any = None) -> TorchParallelGroups:
        """The groups a framework already made (Megatron-Core's ``parallel_state``, a
        torchtitan device mesh's ``get_group``, a hand-written model's ``new_group``).

        Args:
            tp: The tensor-parallel ``torch.distributed`` group of this rank (``None``: TP = 1).
            cp: The context-parallel group of this rank (``None``: CP = 1).
            ep: The expert-parallel group of this rank (``None``: EP = 1).
            edp: The expert-data-parallel group of this rank (``None``: one rank).
            dp: The data-parallel group of this rank (``None``: DP = 1).
        """
        import torch.distributed as dist

        self = cls.__new__(cls)
        self._dist = dist
        self.tp_group, self.cp_group, self.ep_group, self.edp_group = tp, cp, ep, edp
        self.dp_group = dp
        self.dp_size = 1 if dp is None else int(dist.get_world_size(dp))
        self.dp_rank = 0 if dp is None else int(dist.get_rank(dp))
        self.tp_size = 1 if tp is None else int(dist.get_world_size(tp))
        self.tp_rank = 0 if tp is None else int(dist.get_rank(tp))
        self.cp_size = 1 if cp is None else int(dist.get_world_size(cp))
        self.cp_rank = 0 if cp is None else int(dist.get_rank(cp))
        self.ep_size = 1 if ep is None else int(dist.get_world_size(ep))
        self.ep_rank = 0 if ep is None else int(dist.get_rank(ep))
        self.edp_size = 1 if edp is None else int(dist.get_world_size(edp))
        self._edp_rank_given = 0 if edp is None else int(dist.get_rank(edp))
        return self

    _edp_rank_given: int | None = None

    def _edp_rank(self) -> int:
        given = self._edp_rank_given
        return super()._edp_rank() if given is None else given

    def group(self, name: str) -> Any:
        """The ``torch.distributed`` group ``"tp"``, ``"cp"``, ``"ep"`` or ``"edp"``."""
        self.size(name)
        return {"tp": self.tp_group, "cp": self.cp_group, "dp": self.dp_group,
                "ep": self.ep_group, "edp": self.edp_group}[name]

    def all_to_all(self, output: Any, input: Any, output_splits: list[int],
                   input_splits: list[int], *, group: str = "ep") -> Any:
        """The group's all-to-all into ``output`` on the current stream (rows of dim 0)."""
        if self.size(group) == 1:
            return output.copy_(input)
        self._dist.all_to_all_single(output, input.contiguous(),
                                     output_split_sizes=list(output_splits),
                                     input_split_sizes=list(input_splits),
                                     group=self.group(group))
        return output

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
            output.copy_(tmp.view(n, *output.shape)[self.rank_in(group)])
        return output


class LoopbackGroups(ParallelGroups):
    """TP and CP groups on one GPU: this process plays rank 0 of each, and every other
    rank holds the same data (a sum multiplies by the group size; a max is the tensor).

    The function such a stand-in computes is not the model's: every rank claims the tokens
    of this rank's vocabulary shard, so the loss counts the target's logit once per TP rank
    and can fall below zero as training goes on. It is a deterministic function of the same
    kernels, for timing the loop and comparing its schedules on one GPU.

    A mixture of experts' EP group (``ep``) stands in the same way: every rank routes as
    this one does, so each sends this rank its rows for rank 0's experts, and this rank's
    experts (rank 0's) run ``ep`` copies of those rows; the combine returns, for the rows
    this rank sent to rank ``s``, rows of what its own experts computed (``_loopback_rows``).

    Args:
        tp: The tensor-parallel degree to stand in for.
        cp: The context-parallel degree to stand in for.
        ep: The expert-parallel degree to stand in for (it divides ``tp x cp x dp``).
        dp: The data-parallel degree to stand in for (every replica holds this one's data).
    """

    def __init__(self, *, tp: int, cp: int = 1, ep: int = 1, dp: int = 1) -> None:
        if min(tp, cp, ep, dp) < 1:
            raise ArgumentError(f"tp, cp, ep and dp must be >= 1, got {tp}, {cp}, {ep}, {dp}")
        if (tp * cp * dp) % ep:
            raise ArgumentError(f"ep={ep} must divide tp x cp x dp = {tp * cp * dp}")
        self.tp_size, self.cp_size, self.dp_size = int(tp), int(cp), int(dp)
        self.ep_size, self.edp_size = int(ep), int(tp) * int(cp) * int(dp) // int(ep)
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

    def all_to_all(self, output: Any, input: Any, output_splits: list[int],
                   input_splits: list[int], *, group: str = "ep") -> Any:
        """What the group's all-to-all gives when every rank holds ``input``: from each rank,
        the rows this rank sends rank 0 (``_loopback_rows``)."""
        self.size(group)
        return _loopback_rows(output, input, output_splits, input_splits)

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


def _loopback_rows(output: Any, input: Any, output_splits: list[int],
                   input_splits: list[int]) -> Any:
    """An all-to-all's stand-in on one rank (rank 0 of a group whose every rank holds this
    rank's data): every rank sends rank 0 what this rank sends it, the first block of
    ``input`` (``input_splits[0]`` rows), so ``output`` is that block repeated, cycled to
    its length (zeros from an empty block). The dispatch's and the count exchange's blocks
    are then exact (every rank sends rank 0 as many rows as this one); the combine's, whose
    blocks are the rows this rank sent each rank, are rows of what rank 0's experts
    computed: the bytes and shapes of the real exchange, not its values (and, as the cycle
    runs within each call, a function of how the microbatch is split into nanobatches)."""
    import torch

    from kareus.exec.collectives import cycle_rows

    first = input[:int(input_splits[0])] if len(input_splits) else input[:0]
    return cycle_rows(torch, output, first)


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

    def all_to_all(self, output: Any, input: Any, output_splits: list[int],
                   input_splits: list[int], stream: Any, sms: int | None) -> Any:
        """The EP group's all-to-all as [`LoopbackGroups`][kareus.exec.train.LoopbackGroups]
        stands it in (every rank holds this rank's data), on ``stream``."""
        self._record("all_to_all", int(output.numel()), sms)
        with _on(stream):
            _loopback_rows(output, input, output_splits, input_splits)
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
    """One backend for the executor that sends all-reduces to the TP group's backend,
    all-gathers / reduce-scatters to the CP group's and all-to-alls to the EP group's,
    unless the collective names its group
    ([`for_group`][kareus.exec.train.GroupedCollective.for_group]: sequence parallelism's
    all-gathers and reduce-scatters run over TP).

    Args:
        tp: Backend of the TP group (``None`` when TP = 1).
        cp: Backend of the CP group (``None`` when CP = 1).
        ep: Backend of the expert-parallel group (``None`` when EP = 1 or no mixture of
            experts): it runs the dispatch and combine all-to-alls
            (``all_to_all(output, input, output_splits, input_splits, stream, sms)``).
    """

    name: ClassVar[str] = "grouped"

    def __init__(self, *, tp: CollectiveBackend | None, cp: CollectiveBackend | None,
                 ep: CollectiveBackend | None = None) -> None:
        for label, b in (("tp", tp), ("cp", cp), ("ep", ep)):
            if b is not None and not isinstance(b, CollectiveBackend):
                raise ArgumentTypeError(f"{label} must be a CollectiveBackend or None, got "
                                        f"{type(b).__name__}")
        if tp is None and cp is None and ep is None:
            raise ArgumentError("GroupedCollective needs a TP, CP or EP backend")
        self.tp, self.cp, self.ep = tp, cp, ep

    def _backends(self) -> tuple[CollectiveBackend, ...]:
        return tuple(b for b in (self.tp, self.cp, self.ep) if b is not None)

    def backend_for(self, kind: str) -> CollectiveBackend:
        """The backend that runs collectives of ``kind``.

        Raises:
            ValueError: that group has no backend (its degree is 1).
        """
        b = {"all_reduce": self.tp, "all_gather": self.cp, "reduce_scatter": self.cp,
             "all_to_all": self.ep}.get(kind)
        if b is None:
            raise ArgumentError(f"no backend runs {kind!r} here (TP, CP or EP degree 1?)")
        return b

    def for_group(self, group: str) -> CollectiveBackend:
        """The backend of the ``"tp"``, ``"cp"`` or ``"ep"`` group (what the executor uses
        for a collective that names its group:
        [`CollectiveLaunch.group`][kareus.exec.CollectiveLaunch]).

        Raises:
            ValueError: ``group`` is none of them, or that group has no backend (degree 1).
        """
        if group not in ("tp", "cp", "ep"):
            raise ArgumentError(f"group must be 'tp', 'cp' or 'ep', got {group!r:.40}")
        b = {"tp": self.tp, "cp": self.cp, "ep": self.ep}[group]
        if b is None:
            raise ArgumentError(f"no backend runs collectives over {group!r} here (degree 1)")
        return b

    def _first(self) -> CollectiveBackend:
        return self._backends()[0]

    @property
    def world_size(self) -> int:
        """Ranks of the TP group (of the CP group when TP = 1, of the EP group when both
        are 1)."""
        return self._first().world_size

    @property
    def rank(self) -> int:
        """This rank in the TP group (in the CP group when TP = 1, ...)."""
        return self._first().rank

    @property
    def sm_count(self) -> int:
        """SMs of this rank's GPU."""
        return self._first().sm_count

    @property
    def max_sms(self) -> int:
        """The smallest of the backends' limits."""
        return min(b.max_sms for b in self._backends())

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """The TP group's all-reduce."""
        return self.backend_for("all_reduce").all_reduce(tensor, stream, sms)

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """The CP group's all-gather."""
        return self.backend_for("all_gather").all_gather(output, input, stream, sms)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """The CP group's reduce-scatter."""
        return self.backend_for("reduce_scatter").reduce_scatter(output, input, stream, sms)

    def all_to_all(self, output: Any, input: Any, output_splits: list[int],
                   input_splits: list[int], stream: Any, sms: int | None) -> Any:
        """The EP group's all-to-all (rows of dim 0: ``input_splits[r]`` to rank ``r``,
        ``output_splits[r]`` from it)."""
        b: Any = self.backend_for("all_to_all")
        return b.all_to_all(output, input, output_splits, input_splits, stream, sms)

    def close(self) -> None:
        """Close every backend (once each: a group's backend may serve two names)."""
        seen: set[int] = set()
        for b in self._backends():
            if id(b) not in seen:
                seen.add(id(b))
                b.close()
