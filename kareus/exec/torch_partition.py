"""Runnable partitions: the computation ops of a partition as real torch kernels.

To profile a partition on a GPU, kareus needs its ops as kernels, not only as FLOP
and byte counts. :class:`RunnableTransformerPartition` wraps a
:class:`~kareus.model.partition.TransformerPartition` of a preset workload and builds,
on one GPU, the attention and MLP forward and backward ops at the workload's
per-rank nanobatch shapes: GEMMs (cuBLAS), RMSNorm, rotary position embedding, causal
scaled-dot-product attention with grouped-query heads, SwiGLU, and their backward
passes, each from a :class:`~kareus.exec.kernels.KernelSet` (fused Triton kernels on a
GPU by default, see :mod:`kareus.exec.kernels`), so that what is profiled is what
production stacks train with. No model is needed. :class:`CallablePartition` does the same
for user callables.

``build()`` returns a :class:`PartitionProgram`: zero-argument callables that
enqueue each op on the current stream, plus the tensors the partition's collective
acts on. The program double-buffers the collective's tensor, as nanobatching does:
step ``j`` computes into one buffer while the collective of step ``j-1`` reduces the
other (:meth:`PartitionProgram.advance` flips them), so a loop of steps is the
steady state of a nanobatched layer.

``build(collective=backend)`` allocates those buffers with ``backend.empty(shape,
dtype)`` when the backend has such a method: with
:class:`~kareus.exec.collectives.OwnKernelCollective` they are registered tensors, so
the executor's collectives take the zero-copy path; backends without ``empty`` (NCCL)
get plain ``torch.zeros`` buffers, as before.

torch is imported inside the functions that need it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kareus.model.ops import CommKind, CommOp, ComputeOp
from kareus.model.partition import OpPartition, Partition, TransformerPartition
from kareus.model.workload import Workload

__all__ = [
    "CallablePartition",
    "PartitionProgram",
    "RunnablePartition",
    "RunnableTransformerPartition",
    "runnable_partitions",
]

# Ops whose result is the tensor the partition's all-reduce sums (the layer segment's
# output, or its input gradient in the backward pass).
#
# A partition type pairs a segment's computation with either the segment's own
# collective (of the previous nanobatch), whose input one of these ops produces, or, for
# nanobatch 1, the last collective of the segment before it (kareus.model.partition).
# When a segment meets two kinds of collective (TP x CP), that second pairing is a type
# of its own: ``fwd_attn_in_ar`` (attn_norm, qkv, rope beside the MLP's all-reduce) and
# ``bwd_attn_out_ar`` (mlp_norm_bwd ... attn_core_bwd beside the MLP's backward
# all-reduce). Their collective's input comes from ``down`` / ``up_dgrad``, ops of the
# previous segment's type, so no op of theirs writes the buffer, by design: running the
# producer too would measure a GEMM the type does not hold, and storing some other op's
# result there would fake a dependence. In a chain of segments (a training loop) the
# collective is handed the previous program's output; alone (profiling) the buffer
# stays zero, a fixed point of the in-place sum (seeded data, with nothing rewriting
# it, would grow by the group size every other step until it overflows).
_OUTPUT_OPS = frozenset({"out_proj", "down", "up_dgrad", "qkv_dgrad"})

# Ops whose result the next op accumulates into in place: gate_dgrad writes dX, then
# up_dgrad adds its product to it (one GEMM with beta=1, as Megatron-LM's fused gate/up
# weight does). ``torch.addmm(C, A, B)`` into a third tensor first copies C: 1.28x the
# plain GEMM's time at llama3.2-3b TP=4 on one H200 (bench/results/op_roofline_h200.json).
_ACCUMULATED_BY = {"gate_dgrad": "up_dgrad"}


class PartitionProgram:
    """One partition instance on one device: op callables and the collective's buffers.

    Attributes:
        op_names: The ops' names, in stream order.
        comm_kind: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``; ``None`` for
            work that runs its collectives among its ops (outside work), run plainly.
        writer: The op that writes :attr:`output` (the collective's next input), or
            ``None`` when no op of the program does (the input is produced elsewhere).
        step: Steps taken so far (see :meth:`advance`).
    """

    def __init__(self, *, op_names: Sequence[str], ops: Sequence[Callable[[], Any]],
                 comm_kind: str | None, buffers: Sequence[Any], comm_outputs: Sequence[Any] = (),
                 state: dict[str, Any] | None = None, writer: str | None = None) -> None:
        if len(op_names) != len(ops):
            raise ValueError(f"{len(ops)} ops but {len(op_names)} names")
        if writer is not None and writer not in op_names:
            raise ValueError(f"writer {writer!r} is not one of the ops {list(op_names)}")
        if len(buffers) != 2:
            raise ValueError("a program double-buffers its collective's tensor: 2 buffers")
        self.op_names = tuple(op_names)
        self._ops = tuple(ops)
        self.comm_kind = comm_kind
        self._buffers = list(buffers)
        self._comm_outputs = list(comm_outputs)
        self.state = state if state is not None else {}
        self.writer = writer
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

        ``collective`` is the backend that will run the program's collective; a
        partition that allocates its communication buffers should take them from
        ``collective.empty(shape, dtype)`` when the backend offers that method.
        """


# ------------------------------------------------------------------ transformer ops


@attrs.frozen
class _Dims:
    b: int  # sequences per nanobatch
    sq: int  # query tokens per sequence on this rank
    sk: int  # key tokens per sequence
    h: int
    heads: int  # query heads on this rank
    kvh: int  # KV heads on this rank
    hd: int
    f: int

    @property
    def t(self) -> int:
        return self.b * self.sq

    @property
    def q(self) -> int:
        return self.heads * self.hd

    @property
    def kv(self) -> int:
        return self.kvh * self.hd


def _dims(wl: Workload) -> _Dims:
    m, p = wl.model, wl.parallelism
    return _Dims(b=wl.microbatch_size // wl.nanobatches, sq=wl.seq_len // p.cp, sk=wl.seq_len,
                 h=m.hidden, heads=m.heads // p.tp, kvh=m.kv_heads // p.tp, hd=m.head_dim,
                 f=m.ffn // p.tp)


def _sdpa(torch: Any, q: Any, k: Any, v: Any) -> Any:
    """Causal attention over grouped K/V (PyTorch's default SDPA dispatch); the one
    definition is :meth:`kareus.exec.kernels.KernelSet.attention`."""
    from kareus.exec.kernels.base import _sdpa as sdpa

    return sdpa(q, k, v)


def _op_builders() -> dict[str, Callable[[Any, dict[str, Any], _Dims, Any], Callable[[], Any]]]:  # noqa: C901 - a table of one small builder per op; the nested builders count toward it
    """Op name -> builder(torch, ctx, dims, out_buffer_getter) -> op callable.

    Each builder creates the inputs it needs in ``ctx`` if earlier ops did not, and its
    op stores results in ``ctx``; ops named in ``_OUTPUT_OPS`` write the collective's
    buffer (``out()``) instead. Every op runs through the kernel set in
    ``ctx["_kernels"]`` (:mod:`kareus.exec.kernels`, the one definition of each op).
    """

    def rnd(torch: Any, ctx: dict[str, Any], key: str, *shape: int, scale: float = 1.0) -> Any:
        if key not in ctx:
            g = ctx["_gen"]
            ctx[key] = (torch.randn(*shape, generator=g, device=ctx["_device"],
                                    dtype=torch.float32) * scale).to(ctx["_dtype"])
        return ctx[key]

    def weight(torch: Any, ctx: dict[str, Any], key: str, *shape: int) -> Any:
        return rnd(torch, ctx, key, *shape, scale=shape[0] ** -0.5)

    def cos_sin(torch: Any, ctx: dict[str, Any], d: _Dims) -> tuple[Any, Any]:
        if "cos" not in ctx:
            inv = 1.0 / (500000.0 ** (torch.arange(0, d.hd, 2, device=ctx["_device"],
                                                   dtype=torch.float32) / d.hd))
            pos = torch.arange(d.sq, device=ctx["_device"], dtype=torch.float32)
            ang = torch.outer(pos, inv)
            ang = torch.cat((ang, ang), dim=-1)  # [s, hd], the two halves equal
            ctx["cos"] = ang.cos().to(ctx["_dtype"])
            ctx["sin"] = ang.sin().to(ctx["_dtype"])
        return ctx["cos"], ctx["sin"]

    def norm(key_w: str) -> Callable[..., Callable[[], Any]]:
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            x = rnd(torch, ctx, "x", d.t, d.h)
            w = rnd(torch, ctx, key_w, d.h, scale=0.1)
            w.add_(1.0)

            ks = ctx["_kernels"]

            def op() -> None:
                ctx["xn"] = ks.rms_norm(x, w)
            return op
        return build

    def norm_bwd(key_w: str) -> Callable[..., Callable[[], Any]]:
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            x = rnd(torch, ctx, "x", d.t, d.h)
            w = rnd(torch, ctx, key_w, d.h, scale=0.1)
            dy = rnd(torch, ctx, "dy", d.t, d.h)

            ks = ctx["_kernels"]

            def op() -> None:
                ctx["dyn"], ctx["d" + key_w] = ks.rms_norm_bwd(dy, x, w)
            return op
        return build

    def gemm(a_key: str, a_shape: Callable[[_Dims], tuple[int, int]], w_key: str,
             w_shape: Callable[[_Dims], tuple[int, int]], dst: str, *,
             trans_a: bool = False, trans_w: bool = False,
             accumulate: bool = False) -> Callable[..., Callable[[], Any]]:
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            def operand(key: str, shape: tuple[int, int], is_weight: bool) -> Callable[[], Any]:
                if is_weight and key.startswith("W"):
                    weight(torch, ctx, key, *shape)
                else:
                    rnd(torch, ctx, key, *shape)
                return lambda: ctx[key]

            get_a = operand(a_key, a_shape(d), False)
            get_w = operand(w_key, w_shape(d), True)
            ks = ctx["_kernels"]

            if accumulate and out is None:
                rnd(torch, ctx, dst, a_shape(d)[0], w_shape(d)[0 if trans_w else 1])

            def op() -> None:
                a = get_a().t() if trans_a else get_a()
                w = get_w().t() if trans_w else get_w()
                if accumulate:  # into the result of the op before (_ACCUMULATED_BY)
                    ks.matmul(a, w, out=out() if out is not None else ctx[dst],
                              accumulate=True)
                elif out is not None:
                    ks.matmul(a, w, out=out())
                else:
                    ctx[dst] = ks.matmul(a, w)
            return op
        return build

    def rope(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        rnd(torch, ctx, "qkv", d.t, d.q + 2 * d.kv)
        cos, sin = cos_sin(torch, ctx, d)
        ks = ctx["_kernels"]

        def op() -> None:
            qkv = ctx["qkv"]
            q, k = ks.rope(qkv, cos, sin, heads=d.heads, kv_heads=d.kvh)
            ctx["q"], ctx["k"] = q.transpose(1, 2), k.transpose(1, 2)
            v = qkv.view(d.b, d.sq, d.heads + 2 * d.kvh, d.hd)[:, :, d.heads + d.kvh:]
            ctx["v"] = v.transpose(1, 2)
        return op

    def ensure_qkv(torch: Any, ctx: dict[str, Any], d: _Dims) -> None:
        if "q" not in ctx:
            ctx["q"] = rnd(torch, ctx, "_q", d.b, d.sq, d.heads, d.hd).transpose(1, 2)
        if "k" not in ctx:
            ctx["k"] = rnd(torch, ctx, "_k", d.b, d.sk, d.kvh, d.hd).transpose(1, 2)
            ctx["v"] = rnd(torch, ctx, "_v", d.b, d.sk, d.kvh, d.hd).transpose(1, 2)

    def attn_core(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        ensure_qkv(torch, ctx, d)
        ks = ctx["_kernels"]

        def op() -> None:
            o = ks.attention(ctx["q"], ctx["k"], ctx["v"])
            ctx["attn"] = o.transpose(1, 2).reshape(d.t, d.q)
        return op

    def attn_core_bwd(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        ensure_qkv(torch, ctx, d)
        q = ctx["q"].detach().requires_grad_()
        k = ctx["k"].detach().requires_grad_()
        v = ctx["v"].detach().requires_grad_()
        with torch.enable_grad():
            o = ctx["_kernels"].attention(q, k, v)
        rnd(torch, ctx, "dattn", d.t, d.q)

        def op() -> None:
            do = ctx["dattn"].view(d.b, d.sq, d.heads, d.hd).transpose(1, 2)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            ctx["dq"], ctx["dk"], ctx["dv"] = dq, dk, dv
        return op

    def rope_bwd(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        cos, sin = cos_sin(torch, ctx, d)
        if "dq" not in ctx:
            ctx["dq"] = rnd(torch, ctx, "_dq", d.b, d.sq, d.heads, d.hd).transpose(1, 2)
            ctx["dk"] = rnd(torch, ctx, "_dk", d.b, d.sq, d.kvh, d.hd).transpose(1, 2)
            ctx["dv"] = rnd(torch, ctx, "_dv", d.b, d.sq, d.kvh, d.hd).transpose(1, 2)

        ks = ctx["_kernels"]

        def op() -> None:
            # RoPE is a rotation: its backward rotates back; dv is packed beside.
            ctx["dqkv"] = ks.rope_bwd(ctx["dq"].transpose(1, 2), ctx["dk"].transpose(1, 2),
                                      ctx["dv"].transpose(1, 2), cos, sin)
        return op

    def swiglu(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        rnd(torch, ctx, "g", d.t, d.f)
        rnd(torch, ctx, "u", d.t, d.f)
        ks = ctx["_kernels"]

        def op() -> None:
            ctx["a"] = ks.swiglu(ctx["g"], ctx["u"])
        return op

    def swiglu_bwd(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        g = rnd(torch, ctx, "g", d.t, d.f)
        u = rnd(torch, ctx, "u", d.t, d.f)
        rnd(torch, ctx, "da", d.t, d.f)

        ks = ctx["_kernels"]

        def op() -> None:
            ctx["dg"], ctx["du"] = ks.swiglu_bwd(ctx["da"], g, u)
        return op

    tq = lambda d: (d.t, d.q)  # noqa: E731
    th = lambda d: (d.t, d.h)  # noqa: E731
    tf = lambda d: (d.t, d.f)  # noqa: E731
    tqkv = lambda d: (d.t, d.q + 2 * d.kv)  # noqa: E731
    return {
        "attn_norm": norm("w_attn_norm"),
        "mlp_norm": norm("w_mlp_norm"),
        "qkv": gemm("xn", th, "Wqkv", lambda d: (d.h, d.q + 2 * d.kv), "qkv"),
        "rope": rope,
        "attn_core": attn_core,
        "out_proj": gemm("attn", tq, "Wo", lambda d: (d.q, d.h), "y"),
        "gate": gemm("xn", th, "Wg", lambda d: (d.h, d.f), "g"),
        "up": gemm("xn", th, "Wu", lambda d: (d.h, d.f), "u"),
        "swiglu": swiglu,
        "down": gemm("a", tf, "Wd", lambda d: (d.f, d.h), "y"),
        # backward (weights stored [in, out]; dgrad multiplies by W^T, wgrad is in^T @ dout)
        "attn_norm_bwd": norm_bwd("w_attn_norm"),
        "mlp_norm_bwd": norm_bwd("w_mlp_norm"),
        "down_dgrad": gemm("dyn", th, "Wd", lambda d: (d.f, d.h), "da", trans_w=True),
        "down_wgrad": gemm("a", tf, "dyn", th, "dWd", trans_a=True),
        "swiglu_bwd": swiglu_bwd,
        "gate_dgrad": gemm("dg", tf, "Wg", lambda d: (d.h, d.f), "dx", trans_w=True),
        "up_dgrad": gemm("du", tf, "Wu", lambda d: (d.h, d.f), "dx", trans_w=True,
                         accumulate=True),
        "gate_wgrad": gemm("xn", th, "dg", tf, "dWg", trans_a=True),
        "up_wgrad": gemm("xn", th, "du", tf, "dWu", trans_a=True),
        "out_dgrad": gemm("dyn", th, "Wo", lambda d: (d.q, d.h), "dattn", trans_w=True),
        "out_wgrad": gemm("attn", tq, "dyn", th, "dWo", trans_a=True),
        "attn_core_bwd": attn_core_bwd,
        "rope_bwd": rope_bwd,
        "qkv_dgrad": gemm("dqkv", tqkv, "Wqkv", lambda d: (d.h, d.q + 2 * d.kv), "dx",
                          trans_w=True),
        "qkv_wgrad": gemm("xn", th, "dqkv", tqkv, "dWqkv", trans_a=True),
    }


def _comm_zeros(torch: Any, collective: Any, shape: tuple[int, ...], device: Any,
                dtype: Any, kind: str = "all_reduce") -> Any:
    """A zeroed buffer for the collective: from ``collective.empty`` when the backend has
    it (registered memory for the own kernels; an executor's ``empty`` is told the
    collective's ``kind``, so that a backend per group registers it with the right group),
    else from ``torch.zeros``."""
    import inspect

    empty = getattr(collective, "empty", None)
    if not callable(empty):
        return torch.zeros(shape, device=device, dtype=dtype)
    try:
        takes_kind = "kind" in inspect.signature(empty).parameters
    except (TypeError, ValueError):
        takes_kind = False
    t = empty(shape, dtype, kind=kind) if takes_kind else empty(shape, dtype)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"{type(collective).__name__}.empty({shape}, {dtype}) gave a tensor "
                         f"of shape {tuple(t.shape)}, {t.dtype} on {t.device}; the program is "
                         f"built on {device}: build it on the backend's device")
    return t.zero_()


def _comm_buffers(torch: Any, comm: CommOp, model_bytes: int, device: Any, dtype: Any,
                  shape: tuple[int, ...],
                  collective: Any = None) -> tuple[list[Any], list[Any]]:
    """Two input buffers (and two outputs for all-gather / reduce-scatter), zeroed.

    ``comm.bytes`` counts the model's elements at ``model_bytes`` bytes each (the
    workload's ``dtype_bytes``, 2 for bf16), whatever ``dtype`` the kernels run in: the
    element count is what the buffers keep, so that e.g. a float32 program's all-reduce
    buffer is still the ``shape`` its output op writes.

    Every tensor the collective reads or writes comes from :func:`_comm_zeros`, in a
    fixed order (inputs, then outputs), so that a backend whose ``empty`` is collective
    sees the same calls on every rank.
    """
    n, rest = divmod(int(comm.bytes), int(model_bytes))
    if rest or n <= 0:
        raise ValueError(f"{comm.name}: {comm.bytes} bytes is not a whole number of "
                         f"{model_bytes}-byte elements")
    g = comm.group_size
    if comm.kind is CommKind.ALL_REDUCE:
        in_shape, out_shape = (shape if _numel(shape) == n else (n,)), None
    elif comm.kind is CommKind.ALL_GATHER:  # bytes = gathered output
        in_shape, out_shape = (n // g,), (n // g * g,)
    else:
        in_shape, out_shape = (n // g * g,), (n // g,)
    kind = comm.kind.value
    ins = [_comm_zeros(torch, collective, in_shape, device, dtype, kind) for _ in range(2)]
    outs = ([] if out_shape is None
            else [_comm_zeros(torch, collective, out_shape, device, dtype, kind)
                  for _ in range(2)])
    return ins, outs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class RunnableTransformerPartition(RunnablePartition):
    """A preset workload's partition whose ops run as torch kernels at its shapes.

    Args:
        partition: The partition type (from :func:`~kareus.model.partition.build_partitions`).
        workload: The workload it was built from (gives the per-rank nanobatch shapes).
        dtype: torch dtype name of activations and weights (default ``"bfloat16"``).
        kernels: The ops' kernels: a :class:`~kareus.exec.kernels.KernelSet` or a
            registered name (``"triton"``, ``"torch"``, ``"reference"``); default
            :func:`~kareus.exec.kernels.get_kernels`'s choice, made at :meth:`build`.
    """

    def __init__(self, partition: TransformerPartition, workload: Workload, *,
                 dtype: str | None = None, kernels: Any = None) -> None:
        if not isinstance(partition, TransformerPartition):
            raise TypeError(f"partition must be a TransformerPartition, got "
                            f"{type(partition).__name__}")
        if not isinstance(workload, Workload):
            raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
        builders = _op_builders()
        unknown = [op.name for op in partition.compute_ops if op.name not in builders]
        if unknown:
            raise ValueError(f"no kernel for ops {unknown} of partition {partition.name!r}")
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

        Args:
            device: Where to build (a CUDA device; ``"cpu"`` works for small shapes).
            seed: Seed of the random inputs and weights.
            collective: The backend that will run the program's collective. If it has
                ``empty(shape, dtype)`` (:class:`~kareus.exec.collectives.OwnKernelCollective`
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
        bufs, outs = _comm_buffers(torch, self.comm_op, self.workload.dtype_bytes, dev,
                                   dtype, (d.t, d.h), collective)
        holder: dict[str, Any] = {}
        builders = _op_builders()
        names = [op.name for op in self.compute_ops]
        # The op that produces the all-reduce's input writes the buffer; a type whose
        # collective belongs to the segment before it has none (see _OUTPUT_OPS).
        out_ops = [n for n in names if n in _OUTPUT_OPS]
        writes_buffer = (self.comm_op.kind is CommKind.ALL_REDUCE and bool(out_ops)
                         and bufs[0].shape == (d.t, d.h))
        writer = out_ops[-1] if writes_buffer else None
        ops = []
        for name in names:
            writes = name == writer or (writer is not None
                                        and _ACCUMULATED_BY.get(name) == writer)
            out = (lambda: holder["prog"].output) if writes else None
            fn = builders[name](torch, ctx, d, out)
            ops.append(fn)
        prog = PartitionProgram(op_names=names, ops=ops, comm_kind=self.comm_op.kind.value,
                                buffers=bufs, comm_outputs=outs, state=ctx, writer=writer)
        holder["prog"] = prog
        with torch.no_grad():
            prog.run_plain()  # materialise every intermediate once
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        return prog

    def __repr__(self) -> str:
        return f"Runnable{self.partition!r}"


def runnable_partitions(workload: Workload, names: Sequence[str] | None = None, *,
                        dtype: str | None = None,
                        kernels: Any = None) -> dict[str, RunnableTransformerPartition]:
    """Runnable versions of a workload's partition types (all, or those in ``names``),
    their ops run by ``kernels`` (see :class:`RunnableTransformerPartition`)."""
    from kareus.model.partition import build_partitions

    ps = build_partitions(workload)
    chosen = ps.names if names is None else list(names)
    out = {}
    for n in chosen:
        p = ps[n]
        if not isinstance(p, TransformerPartition):
            raise TypeError(f"partition {n!r} is not a TransformerPartition")
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
            raise ValueError(f"partition {self.name!r}: {len(self.compute_ops)} ops but "
                             f"{len(self.callables)} callables")
        if not all(callable(c) for c in self.callables):
            raise TypeError("every entry of callables must be callable")
        if len(self.comm_buffers) != 2:
            raise ValueError("comm_buffers must hold two tensors (double buffering)")
        if self.comm_op.kind is not CommKind.ALL_REDUCE and len(self.comm_outputs) != 2:
            raise ValueError(f"{self.comm_op.kind.value} needs two comm_outputs")

    def build(self, *, device: Any = None, seed: int = 0,
              collective: Any = None) -> PartitionProgram:
        """The program over the given callables and buffers (which you allocated, so
        ``device``, ``seed`` and ``collective`` are not used)."""
        return PartitionProgram(op_names=[op.name for op in self.compute_ops],
                                ops=self.callables, comm_kind=self.comm_op.kind.value,
                                buffers=self.comm_buffers, comm_outputs=self.comm_outputs)
