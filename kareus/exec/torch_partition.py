"""Runnable partitions: the computation ops of a partition as real torch kernels.

To profile a partition on a GPU, kareus needs its ops as kernels, not only as FLOP
and byte counts. [`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition] wraps a
[`TransformerPartition`][kareus.model.TransformerPartition] of a preset workload and builds,
on one GPU, the attention and MLP forward and backward ops at the workload's
per-rank nanobatch shapes: GEMMs (cuBLAS), RMSNorm, rotary position embedding, causal
scaled-dot-product attention with grouped-query heads, SwiGLU, and their backward
passes, each from a ``KernelSet`` (fused Triton kernels on a
GPU by default, see ``kareus.exec.kernels``), so that what is profiled is what
production stacks train with. No model is needed.
[`CallablePartition`][kareus.exec.CallablePartition] does the same for user callables.

``build()`` returns a [`PartitionProgram`][kareus.exec.PartitionProgram]: zero-argument callables
that enqueue each op on the current stream, plus the tensors the partition's collective
acts on. The program double-buffers the collective's tensor, as nanobatching does:
step ``j`` computes into one buffer while the collective of step ``j-1`` reduces the
other ([`PartitionProgram.advance`][kareus.exec.PartitionProgram.advance] flips them), so a loop of
steps is the steady state of a nanobatched layer.

``build(collective=backend)`` allocates those buffers with ``backend.empty(shape,
dtype)`` when the backend has such a method: with
[`OwnKernelCollective`][kareus.exec.OwnKernelCollective] they are registered tensors, so
the executor's collectives take the zero-copy path; backends without ``empty`` (NCCL)
get plain ``torch.zeros`` buffers, as before.

torch is imported inside the functions that need it.

Modules: ``_partition_program`` holds [`PartitionProgram`][kareus.exec.PartitionProgram], the
[`RunnablePartition`][kareus.exec.RunnablePartition] role and the collective's buffers;
``_transformer_ops`` the table of transformer ops (inputs, weights and kernel calls at a workload's
shapes). This module holds the two runnable partitions
([`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition],
[`CallablePartition`][kareus.exec.CallablePartition]) and re-exports the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kareus.errors import ArgumentError, ArgumentTypeError, WorkloadError
from kareus.exec._partition_program import PartitionProgram, RunnablePartition, _comm_buffers
from kareus.exec._transformer_ops import (
    _ACCUMULATED_BY,
    _OUTPUT_OPS,
    _a2a_writers,
    _Dims,
    _dims,
    _op_builders,
    _writers,
)
from kareus.exec.model_check import refuse_uncomputed
from kareus.model.ops import CommKind, CommOp, ComputeOp
from kareus.model.partition import OpPartition, TransformerPartition
from kareus.model.workload import Workload

__all__ = [
    "CallablePartition",
    "PartitionProgram",
    "RunnablePartition",
    "RunnableTransformerPartition",
    "runnable_partitions",
]


class RunnableTransformerPartition(RunnablePartition):
    """A preset workload's partition whose ops run as torch kernels at its shapes.

    Args:
        partition: The partition type (from [`build_partitions`][kareus.model.build_partitions]).
        workload: The workload it was built from (gives the per-rank nanobatch shapes).
        dtype: torch dtype name of activations and weights (default ``"bfloat16"``).
        kernels: The ops' kernels: a ``KernelSet`` or a
            registered name (``"triton"``, ``"torch"``, ``"reference"``); default
            ``get_kernels``'s choice, made at
            [`build`][kareus.exec.RunnableTransformerPartition.build].
    """

    def __init__(self, partition: TransformerPartition, workload: Workload, *,
                 dtype: str | None = None, kernels: Any = None) -> None:
        if not isinstance(partition, TransformerPartition):
            raise ArgumentTypeError(f"partition must be a TransformerPartition, got "
                            f"{type(partition).__name__}")
        if not isinstance(workload, Workload):
            raise ArgumentTypeError(f"workload must be a Workload, got {type(workload).__name__}")
        refuse_uncomputed(workload.model, where="kareus's runnable partitions",
                          computes=frozenset({"qk_norm", "norm_eps", "moe"}))
        if workload.sequence_split:
            raise WorkloadError(f"{workload.model.name}: kareus's runnable partitions split "
                                "nanobatches along the batch only, and microbatch_size=1 "
                                f"holds one sequence; use nanobatches=1 (the cost model and "
                                "the emulator split along the sequence)")
        if workload.document_tokens is not None:
            raise WorkloadError(f"{workload.model.name}: kareus's runnable partitions run "
                                "causal attention over whole sequences, not packed documents "
                                f"(document_tokens={workload.document_tokens}): measure "
                                "without document_tokens, or cost packed documents on the "
                                "emulated GPU")
        builders = _op_builders()
        unknown = [op.name for op in partition.compute_ops if op.name not in builders]
        if unknown:
            raise ArgumentError(f"no kernel for ops {unknown} of partition {partition.name!r}")
        self.partition = partition
        self.workload = workload
        self.dtype = "bfloat16" if dtype is None else str(dtype)
        self.kernels = kernels

    @property
    def name(self) -> str:
        return self.partition.name

    @property
    def compute_ops(self) -> tuple[ComputeOp, ...]:
        return self.partition.compute_ops

    @property
    def comm_op(self) -> CommOp:
        return self.partition.comm_op

    @property
    def overlappable(self) -> bool:
        return self.partition.overlappable

    @property
    def group_gpus(self) -> int:
        """GPUs that run it (the wrapped partition's scope: TP x CP of the stage)."""
        return int(getattr(self.partition, "group_gpus", self.comm_op.group_size))

    @property
    def phase(self) -> str:
        """``"fwd"`` or ``"bwd"``: the wrapped partition's phase."""
        return self.partition.phase

    @property
    def segment(self) -> str:
        """The wrapped partition's layer segment (``"attn"``, ``"mlp"``, ...)."""
        return self.partition.segment

    @property
    def dims(self) -> _Dims:
        """The tensor dimensions of one nanobatch on one rank (its TP and CP shares)."""
        return _dims(self.workload)

    def build(self, *, device: Any = None, seed: int = 0,
              collective: Any = None) -> PartitionProgram:
        """Allocate inputs, weights and buffers on ``device`` (default: the current CUDA
        device), run each op once to materialise its outputs, and return the program.

        A mixture of experts' all-to-all partition (dispatch, combine and their gradients)
        gets send and receive buffers of the busiest rank's received rows and the splits of
        an even all-to-all of them (``PartitionProgram.comm_splits``; the MoE shapes in
        ``kareus.exec._transformer_ops``), for this rank of the expert-parallel group: the
        ``rank`` of ``collective`` when it is a backend over a group of ``ep`` ranks, else
        rank 0 (a stand-in on one GPU).

        Args:
            device: Where to build (a CUDA device; ``"cpu"`` works for small shapes).
            seed: Seed of the random inputs and weights.
            collective: The backend that will run the program's collective. If it has
                ``empty(shape, dtype)`` ([`OwnKernelCollective`][kareus.exec.OwnKernelCollective]
                does), the collective's buffers come from it: registered tensors, which
                the own kernels reduce without staging copies. ``empty`` is then a
                collective call, so every rank must build the same partitions in the same
                order, and the buffers live until the backend is closed (do not use the
                program after that). Backends without ``empty`` get ``torch.zeros``.
        """
        import torch

        dev = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        dtype = getattr(torch, self.dtype)
        d = self.dims
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        from kareus.exec.kernels import get_kernels

        ctx: dict[str, Any] = {"_gen": gen, "_device": dev, "_dtype": dtype,
                               "_kernels": get_kernels(self.kernels)}
        group = getattr(self.partition, "comm_group", None) or None
        a2a = self.comm_op.kind is CommKind.ALL_TO_ALL
        if a2a and d.moe is None:
            raise ArgumentError(f"partition {self.name!r}: an all-to-all without a mixture of "
                                "experts in the workload's model")
        bufs, outs = _comm_buffers(
            torch, self.comm_op, self.workload.dtype_bytes, dev, dtype,
            (d.moe.rows, d.h) if a2a and d.moe is not None else (d.t, d.h), collective,
            group if d.sp > 1 or a2a else None)
        holder: dict[str, Any] = {}
        builders = _op_builders()
        names = [op.name for op in self.compute_ops]
        # The op that produces the collective's input writes the buffer; a type whose
        # collective belongs to the segment before it has none (see _OUTPUT_OPS). Under
        # sequence parallelism the TP all-gathers' inputs come from the norms (on the
        # sequence shard), the reduce-scatters' from the output projections and input
        # gradients (on every token).
        kind = self.comm_op.kind
        if a2a:  # the dispatch's / combine's (and their gradients') send buffer
            out_ops = [n for n in names if n in _a2a_writers()]
            writes_buffer = bool(out_ops)
        elif d.sp > 1 and kind is not CommKind.ALL_REDUCE:
            group = getattr(self.partition, "comm_group", None)
            out_ops = [n for n in names if n in _writers(kind.value, group, True)]
            rows = d.ts if kind is CommKind.ALL_GATHER else d.t
            writes_buffer = bool(out_ops) and bufs[0].numel() == rows * d.h
        else:
            out_ops = [n for n in names if n in _OUTPUT_OPS]
            writes_buffer = (kind is CommKind.ALL_REDUCE and bool(out_ops)
                             and bufs[0].shape == (d.t, d.h))
        writer = out_ops[-1] if writes_buffer else None
        ops = []
        for name in names:
            writes = name == writer or (writer is not None
                                        and _ACCUMULATED_BY.get(name) == writer)
            out = (lambda: holder["prog"].output) if writes else None
            fn = builders[name](torch, ctx, d, out)
            ops.append(fn)
        splits = None
        if a2a and d.moe is not None:
            splits = d.moe.splits(_ep_rank(collective, d.moe.ep))
        prog = PartitionProgram(op_names=names, ops=ops, comm_kind=self.comm_op.kind.value,
                                buffers=bufs, comm_outputs=outs, state=ctx, writer=writer,
                                comm_group=group, comm_splits=splits)
        holder["prog"] = prog
        with torch.no_grad():
            prog.run_plain()  # materialise every intermediate once
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        return prog

    def __repr__(self) -> str:
        return f"Runnable{self.partition!r}"


def _ep_rank(collective: Any, ep: int) -> int:
    """This process's rank in the expert-parallel group, as far as ``collective`` tells
    (a backend over ``ep`` ranks), else 0."""
    try:
        if int(collective.world_size) == ep:
            return int(collective.rank)
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        pass
    return 0


def runnable_partitions(workload: Workload, names: Sequence[str] | None = None, *,
                        dtype: str | None = None,
                        kernels: Any = None) -> dict[str, RunnableTransformerPartition]:
    """Runnable versions of a workload's partition types (all, or those in ``names``),
    their ops run by ``kernels`` (see
    [`RunnableTransformerPartition`][kareus.exec.RunnableTransformerPartition])."""
    from kareus.model.partition import build_partitions

    ps = build_partitions(workload)
    chosen = ps.names if names is None else list(names)
    out = {}
    for n in chosen:
        p = ps[n]
        if not isinstance(p, TransformerPartition):
            raise ArgumentTypeError(f"partition {n!r} is not a TransformerPartition")
        out[n] = RunnableTransformerPartition(p, workload, dtype=dtype, kernels=kernels)
    return out


# ------------------------------------------------------------------ user callables


@attrs.frozen(kw_only=True, repr=False)
class CallablePartition(OpPartition, RunnablePartition):
    """A partition given by its ops and one callable per op, for your own kernels.

    Attributes:
        callables: One zero-argument callable per entry of ``compute_ops``, each
            enqueueing that op on the current stream.
        comm_buffers: The two tensors the collective alternates between (step ``j``
            reduces buffer ``(j+1) % 2`` while the ops write buffer ``j % 2``); the
            callables write ``program.output`` themselves if they want real data flow.
            Allocate them (and ``comm_outputs``) with ``backend.empty(shape, dtype)``
            when the backend has it, for the own kernels' zero-copy path.
        comm_outputs: Two output tensors for all-gather / reduce-scatter (empty for
            all-reduce).
    """

    callables: tuple[Callable[[], Any], ...] = attrs.field(converter=tuple)
    comm_buffers: tuple[Any, Any] = attrs.field(converter=tuple)
    comm_outputs: tuple[Any, ...] = attrs.field(converter=tuple, factory=tuple)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if len(self.callables) != len(self.compute_ops):
            raise ArgumentError(f"partition {self.name!r}: {len(self.compute_ops)} ops but "
                             f"{len(self.callables)} callables")
        if not all(callable(c) for c in self.callables):
            raise ArgumentTypeError("every entry of callables must be callable")
        if len(self.comm_buffers) != 2:
            raise ArgumentError("comm_buffers must hold two tensors (double buffering)")
        if self.comm_op.kind is not CommKind.ALL_REDUCE and len(self.comm_outputs) != 2:
            raise ArgumentError(f"{self.comm_op.kind.value} needs two comm_outputs")

    def build(self, *, device: Any = None, seed: int = 0,
              collective: Any = None) -> PartitionProgram:
        """The program over the given callables and buffers (which you allocated, so
        ``device``, ``seed`` and ``collective`` are not used)."""
        return PartitionProgram(op_names=[op.name for op in self.compute_ops],
                                ops=self.callables, comm_kind=self.comm_op.kind.value,
                                buffers=self.comm_buffers, comm_outputs=self.comm_outputs)
