"""Operations: the computation kernels and communication kernels a partition is made of.

A [`ComputeOp`][kareus.model.ComputeOp] is described by what it does, not how long it takes: FLOPs,
bytes moved to and from HBM, and a kind (GEMM, attention, norm, ...). Profilers
turn that into time and energy for a given GPU and configuration. GEMM and
attention ops are *compute-bound kinds*: each gets its own launch slot. Every
other kind is *memory-bound*, and consecutive memory-bound ops share one slot.

A [`CommOp`][kareus.model.CommOp] is a collective over a group of GPUs: all-reduce, all-gather or
reduce-scatter, with the message size in bytes per rank.
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

    @property
    def short(self) -> str:
        """Two-letter abbreviation: ``ar``, ``ag`` or ``rs``."""
        return {"all_reduce": "ar", "all_gather": "ag", "reduce_scatter": "rs"}[self.value]


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
    """

    name: str
    kind: OpKind = attrs.field(converter=OpKind)
    flops: float = attrs.field(validator=_nonneg)
    bytes_moved: float = attrs.field(validator=_nonneg)

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise ArgumentError("a ComputeOp needs a name")
        if self.flops == 0 and self.bytes_moved == 0:
            raise ArgumentError(f"op {self.name!r} does no work (0 FLOPs and 0 bytes)")

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
                         flops=self.flops * factor, bytes_moved=self.bytes_moved * factor)


@attrs.frozen(kw_only=True)
class CommOp:
    """One collective among ``group_size`` GPUs.

    Attributes:
        name: e.g. ``"tp_all_reduce"``.
        kind: The [`CommKind`][kareus.model.CommKind].
        bytes: Message size per rank: the tensor reduced (all-reduce), the gathered
            output (all-gather), or the input to be reduced and scattered (reduce-scatter).
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

        All-reduce moves ``2 (g-1)/g`` of the message; all-gather and reduce-scatter ``(g-1)/g``.
        """
        g = self.group_size
        factor = 2.0 * (g - 1) / g if self.kind is CommKind.ALL_REDUCE else (g - 1) / g
        return self.bytes * factor
