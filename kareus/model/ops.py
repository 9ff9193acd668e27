"""Operations: the computation kernels and communication kernels a partition is made of.

A [`ComputeOp`][kareus.model.ComputeOp] is described by what it does, not how long it takes: FLOPs,
bytes moved to and from HBM, and a kind (GEMM, attention, norm, ...). Profilers
turn that into time and energy for a given GPU and configuration. GEMM and
attention ops are *compute-bound kinds*: each gets its own launch slot. Every
other kind is *memory-bound*, and consecutive memory-bound ops share one slot.

A [`CommOp`][kareus.model.CommOp] is a collective over a group of GPUs: all-reduce, all-gather,
reduce-scatter or all-to-all (the expert-parallel dispatch and combine of a mixture-of-experts
layer), with the message size in bytes per rank.

A GEMM may be *grouped* (``ComputeOp.group_rows > 0``): one kernel running one GEMM per
expert of a mixture-of-experts layer, each over the tokens routed to that expert; its
FLOPs and bytes are the sum over the experts, and ``group_rows`` is the token rows of each
expert's GEMM (the emulator's tile model reads it).
"""

from __future__ import annotations

import enum
import math

import attrs

from kareus.errors import ArgumentError

__all__ = ["CommKind", "CommOp", "ComputeOp", "OpKind"]


class OpKind(str, enum.Enum):
    """What a computation kernel does; decides whether it opens its own launch slot."""

    GEMM = "gemm"
    ATTENTION = "attention"
    NORM = "norm"
    ELEMENTWISE = "elementwise"
    ROPE = "rope"
    ACTIVATION = "activation"
    EMBEDDING = "embedding"
    LOSS = "loss"

    @property
    def compute_bound(self) -> bool:
        """GEMMs and attention are compute-bound kinds; the rest are memory-bound."""
        return self in (OpKind.GEMM, OpKind.ATTENTION)


class CommKind(str, enum.Enum):
    """The collective a communication kernel performs."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"

    @property
    def short(self) -> str:
        """Abbreviation: ``ar``, ``ag``, ``rs`` or ``a2a``."""
        return {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs",
                "all_to_all": "a2a"}[self.value]


def _nonneg(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ArgumentError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class ComputeOp:
    """One computation kernel of one rank.

    Attributes:
        name: Unique within its partition, e.g. ``"qkv"`` or ``"attn_core"``.
        kind: The [`OpKind`][kareus.model.OpKind].
        flops: Floating-point operations this rank executes.
        bytes_moved: Bytes read from plus written to HBM by this rank.
        group_rows: For a grouped GEMM (one kernel, one GEMM per expert), the token rows
            of each group's GEMM (tokens per expert, a mean: it may be fractional); ``0``
            (default): not grouped. Only a GEMM may be grouped.
    """

    name: str
    kind: OpKind = attrs.field(converter=OpKind)
    flops: float = attrs.field(validator=_nonneg)
    bytes_moved: float = attrs.field(validator=_nonneg)
    # not in the repr: a dense op's repr (which digests of outside work take) stays as it was
    group_rows: float = attrs.field(default=0.0, validator=_nonneg, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise ArgumentError("a ComputeOp needs a name")
        if self.flops == 0 and self.bytes_moved == 0:
            raise ArgumentError(f"op {self.name!r} does no work (0 FLOPs and 0 bytes)")
        if self.group_rows and self.kind is not OpKind.GEMM:
            raise ArgumentError(f"op {self.name!r}: only a GEMM may be grouped (group_rows "
                                f"> 0), not a {self.kind.value} op")

    @property
    def grouped(self) -> bool:
        """Whether the op is a grouped GEMM (``group_rows > 0``)."""
        return self.group_rows > 0

    @property
    def compute_bound(self) -> bool:
        """Whether the op's kind opens its own launch slot (GEMM, attention)."""
        return self.kind.compute_bound

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved (infinite for an op that moves no bytes)."""
        return self.flops / self.bytes_moved if self.bytes_moved else math.inf

    def scaled(self, factor: float, *, name: str | None = None) -> ComputeOp:
        """The same op with FLOPs and bytes multiplied by ``factor``."""
        return ComputeOp(name=name or self.name, kind=self.kind,
                         flops=self.flops * factor, bytes_moved=self.bytes_moved * factor,
                         group_rows=self.group_rows)


@attrs.frozen(kw_only=True)
class CommOp:
    """One collective among ``group_size`` GPUs.

    Attributes:
        name: e.g. ``"tp_all_reduce"``.
        kind: The [`CommKind`][kareus.model.CommKind].
        bytes: Message size per rank: the tensor reduced (all-reduce), the gathered
            output (all-gather), the input to be reduced and scattered (reduce-scatter), or
            the rows a rank exchanges (all-to-all: of which ``(g-1)/g`` go to or come from
            the other ranks).
        group_size: GPUs taking part.
    """

    name: str
    kind: CommKind = attrs.field(converter=CommKind)
    bytes: float = attrs.field(validator=_nonneg)
    group_size: int

    def __attrs_post_init__(self) -> None:
        if self.group_size < 2:
            raise ArgumentError(f"a collective needs group_size >= 2, got {self.group_size}")
        if self.bytes <= 0:
            raise ArgumentError("a collective must move a positive number of bytes")

    @property
    def bus_bytes(self) -> float:
        """Bytes each rank sends over its links (the 'bus bandwidth' convention of nccl-tests).

        All-reduce moves ``2 (g-1)/g`` of the message; all-gather, reduce-scatter and
        all-to-all ``(g-1)/g``.
        """
        g = self.group_size
        factor = 2.0 * (g - 1) / g if self.kind is CommKind.ALL_REDUCE else (g - 1) / g
        return self.bytes * factor
