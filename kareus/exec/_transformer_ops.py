"""The transformer partitions' ops at a workload's shapes: inputs, weights, kernel calls.

``_op_builders`` is a table, op name -> builder: each builder creates the random inputs
and weights its op needs (at the per-rank nanobatch dimensions ``_dims`` gives: the
workload's TP and CP shares) and returns a zero-argument callable that runs the op through
the partition's ``KernelSet`` (the one definition of each op is
``kareus.exec.kernels``; this module only wires shapes and data flow). The ops are the
attention and MLP forward and backward ops of a Llama-shaped layer: GEMMs, RMSNorm, rotary
position embedding (a qk-norm model's with its per-head query/key norms fused in:
``qk_norm_rope``), causal grouped-query attention, SwiGLU, and their backward passes.
With context parallelism the attention ops are those of CP rank 0 on Megatron-Core's
load-balanced chunks (``kareus.exec._cp_attention``: the gathered keys and values put in
position order, one causal piece per chunk; every rank has the same causal work), and RoPE
runs at that rank's global positions.

``_OUTPUT_OPS`` and ``_ACCUMULATED_BY`` say which op writes the tensor the partition's
collective acts on (``_writers`` under sequence parallelism). The builders take the torch
module from their caller.

A mixture-of-experts model's ops (``kareus.model.decoder.moe_decoder_layer``: router,
top-k, permutation, the sort by local expert, the grouped SwiGLU expert GEMMs, the
un-permutation, the shared experts and every backward) run through the kernel set's MoE
ops at the shapes the partition model costs (``kareus.model.partition``'s MoE shapes, one
definition per field in ``_moe_dims``): ``tm`` routed tokens (the sequence shard under
sequence parallelism), ``rows = routing_imbalance x tm x top-k`` received rows (rounded
to whole rows) on the busiest expert-parallel rank, spread evenly over the rank's local
experts (the balanced routing the model costs: every local expert ``rows / L`` rows, each
source rank an even share of them). The router's own choices on the random inputs do not
set these sizes: the ops before the dispatch run on the rank's ``tm x top-k`` rows,
whatever experts they chose, and the ops after it on the balanced ``rows``. The
all-to-all moves ``rows`` rows each way on every rank (even splits; the busiest rank's
volume, which every rank waits for).

Under sequence parallelism (``Parallelism.sequence_parallel``) the norms and their
backward run on the rank's sequence shard (``tokens / TP`` rows) and write the input of the
TP all-gather that follows them; the GEMMs run on the gathered tokens, whose rows come in
rank order, so RoPE and attention reorder them (a copy when a nanobatch holds more than
one sequence), as the training loop's decoder does (``DecoderShard``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kareus.exec._cp_attention import (
    attention_pieces,
    cp_attention,
    cp_attention_bwd,
    order_kv,
    scatter_kv_grad,
)
from kareus.model.context_parallel import cp_positions
from kareus.model.decoder import layer_collectives, moe_decoder_layer
from kareus.model.workload import Workload

__all__: list[str] = []

# Ops whose result is the tensor the partition's all-reduce sums (the layer segment's
# output, or its input gradient in the backward pass): the producers of the decoder layer's
# all-reduces (kareus.model.decoder): out_proj, down, up_dgrad, qkv_dgrad.
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
_OUTPUT_OPS = frozenset(c.producer for c in layer_collectives() if c.kind == "all_reduce")


def _writers(kind: str, group: str | None, sp: bool) -> frozenset[str]:
    """The ops that produce the input of a TP collective of ``kind`` in the layer's layout
    (``sp``: the sequence-parallel one, whose TP collectives are all-gathers of the norms'
    outputs and reduce-scatters of the output projections' and the input gradients'). A CP
    collective (K/V) has none here: its input is RoPE's packed K and V, which the runnable
    ops do not pack."""
    if group == "cp":
        return frozenset()
    return frozenset(c.producer for c in layer_collectives(tp=2, cp=1, sp=sp)
                     if c.kind == kind and c.group == "tp")

# Ops whose result the next op accumulates into in place: gate_dgrad writes dX, then
# up_dgrad adds its product to it (one GEMM with beta=1, as Megatron-LM's fused gate/up
# weight does). ``torch.addmm(C, A, B)`` into a third tensor first copies C: 1.28x the
# plain GEMM's time at llama3.2-3b TP=4 on one H200 (bench/results/op_roofline_h200.json).
_ACCUMULATED_BY = {"gate_dgrad": "up_dgrad"}


def _a2a_writers() -> frozenset[str]:
    """The ops that write an expert-parallel all-to-all's input (the dispatch's
    ``permute``, the combine's ``expert_unsort`` or, without the sort, ``expert_down``;
    the combine gradient's ``unpermute_bwd``, the dispatch gradient's ``expert_sort_bwd``
    or, without the sort, ``expert_gate_up_dgrad``), in every variant of the MoE layer."""
    producers = {
        c.producer for phase in ("fwd", "bwd") for sort in (True, False)
        for shared in (True, False) for sp in (True, False)
        for c in moe_decoder_layer(phase, sp=sp, shared_experts=shared,
                                   sort_tokens=sort).collectives if c.kind == "all_to_all"}
    # the op order ends a segment with the weight gradient, which runs before the collective
    # in stream order; the tensor sent is its data gradient's output
    return frozenset(p.removesuffix("_wgrad") + "_dgrad" if p.endswith("_wgrad") else p
                     for p in producers)


@attrs.frozen
class _MoEDims:
    """One rank's mixture-of-experts shapes (see the module docstring)."""

    tm: int  # tokens this rank routes
    k: int  # top-k
    experts: int
    ep: int
    fe: int  # each expert's width
    fs: int  # the shared experts' width, side by side (0: none)
    router_dtype: str
    rows: int  # rows the rank's experts receive
    local_counts: tuple[int, ...]  # rows per local expert
    recv_counts: tuple[tuple[int, ...], ...]  # [source rank][local expert]

    @property
    def local(self) -> int:
        return self.experts // self.ep

    @property
    def sort(self) -> bool:
        """Whether the received rows are sorted by local expert (more than one per rank,
        EP > 1: Megatron-Core's layout, as the partition model has it)."""
        return self.ep > 1 and self.local > 1

    def splits(self, rank: int) -> tuple[list[int], list[int]]:
        """``(output_splits, input_splits)`` of EP rank ``rank``'s all-to-all of ``rows``
        rows each way: even shares, the remainder spread so that every rank sends and
        receives ``rows`` (rank ``s`` sends rank ``q`` one more row when ``(q - s) mod ep``
        is below the remainder)."""
        base, rem = divmod(self.rows, self.ep)
        ins = [base + ((q - rank) % self.ep < rem) for q in range(self.ep)]
        outs = [base + ((rank - s) % self.ep < rem) for s in range(self.ep)]
        return outs, ins


def _even(total: int, parts: int) -> list[int]:
    base, rem = divmod(total, parts)
    return [base + (i < rem) for i in range(parts)]


def _moe_dims(wl: Workload, tm: int) -> _MoEDims | None:
    """The MoE shapes of ``kareus.model.partition`` (``_moe_shapes``) for a rank routing
    ``tm`` tokens, with the received rows rounded to whole rows."""
    moe = wl.model.moe
    if moe is None:
        return None
    ep = wl.parallelism.ep
    rows = int(round(wl.routing_imbalance * tm * moe.experts_per_token))
    local = moe.experts // ep
    per_expert = _even(rows, local)
    # each local expert's rows, an even share from each source rank
    by_source = [_even(n, ep) for n in per_expert]  # [local][source]
    recv = tuple(tuple(by_source[e][s] for e in range(local)) for s in range(ep))
    return _MoEDims(tm=tm, k=moe.experts_per_token, experts=moe.experts, ep=ep,
                    fe=moe.expert_ffn, fs=moe.shared_experts * moe.shared_expert_ffn,
                    router_dtype=moe.router_dtype, rows=rows,
                    local_counts=tuple(per_expert), recv_counts=recv)


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
    eps: float = 1e-5  # the model's RMSNorm epsilon
    sp: int = 1  # TP under sequence parallelism (the norms' tokens are t / sp), else 1
    cp: int = 1  # context-parallel ranks (the ops are CP rank 0's)
    moe: _MoEDims | None = None  # a mixture-of-experts model's shapes

    @property
    def t(self) -> int:
        return self.b * self.sq

    @property
    def ts(self) -> int:
        """Tokens the norms see: the sequence shard under sequence parallelism."""
        return self.t // self.sp

    def seq_order(self, x: Any) -> Any:
        """Gathered rows from rank order (``[TP, b, sq / TP]``) to sequence order."""
        if self.sp == 1 or self.b == 1:
            return x
        c = x.shape[-1]
        return x.view(self.sp, self.b, self.sq // self.sp, c).transpose(0, 1).reshape(-1, c)

    def rank_order(self, x: Any) -> Any:
        """The inverse of ``seq_order``."""
        if self.sp == 1 or self.b == 1:
            return x
        c = x.shape[-1]
        return x.view(self.b, self.sp, self.sq // self.sp, c).transpose(0, 1).reshape(-1, c)

    @property
    def q(self) -> int:
        return self.heads * self.hd

    @property
    def kv(self) -> int:
        return self.kvh * self.hd


def _dims(wl: Workload) -> _Dims:
    m, p = wl.model, wl.parallelism
    b, sq = wl.microbatch_size // wl.nanobatches, wl.seq_len // p.cp
    sp = p.tp if p.sequence_parallel else 1
    return _Dims(b=b, sq=sq, sk=wl.seq_len,
                 h=m.hidden, heads=m.heads // p.tp, kvh=m.kv_heads // p.tp, hd=m.head_dim,
                 f=m.ffn // p.tp, eps=m.norm_eps, sp=sp, cp=p.cp,
                 moe=_moe_dims(wl, b * sq // sp))


def _sdpa(torch: Any, q: Any, k: Any, v: Any) -> Any:
    """Causal attention over grouped K/V (PyTorch's default SDPA dispatch); the one
    definition is ``kareus.exec.kernels.KernelSet.attention``."""
    from kareus.exec.kernels.base import _sdpa as sdpa

    return sdpa(q, k, v)


def _op_builders() -> dict[str, Callable[[Any, dict[str, Any], _Dims, Any], Callable[[], Any]]]:  # noqa: C901 - a table of one small builder per op; the nested builders count toward it
    """Op name -> builder(torch, ctx, dims, out_buffer_getter) -> op callable.

    Each builder creates the inputs it needs in ``ctx`` if earlier ops did not, and its
    op stores results in ``ctx``; ops named in ``_OUTPUT_OPS`` write the collective's
    buffer (``out()``) instead. Every op runs through the kernel set in
    ``ctx["_kernels"]`` (``kareus.exec.kernels``, the one definition of each op).
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
            pos = torch.tensor(cp_positions(d.sk, d.cp, 0), device=ctx["_device"],
                               dtype=torch.float32)  # CP rank 0's tokens
            ang = torch.outer(pos, inv)
            ang = torch.cat((ang, ang), dim=-1)  # [s, hd], the two halves equal
            ctx["cos"] = ang.cos().to(ctx["_dtype"])
            ctx["sin"] = ang.sin().to(ctx["_dtype"])
        return ctx["cos"], ctx["sin"]

    def norm(key_w: str) -> Callable[..., Callable[[], Any]]:
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            x = rnd(torch, ctx, "x", d.ts, d.h)
            w = rnd(torch, ctx, key_w, d.h, scale=0.1)
            w.add_(1.0)

            ks = ctx["_kernels"]

            def op() -> None:
                y = ks.rms_norm(x, w, d.eps)
                if out is not None:  # the all-gather's input (sequence parallelism)
                    y = out().view(d.ts, d.h).copy_(y)
                ctx["xn"] = y
                if key_w == "w_mlp_norm":  # a mixture of experts' input
                    ctx["xm"] = y
            return op
        return build

    def norm_bwd(key_w: str) -> Callable[..., Callable[[], Any]]:
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            x = rnd(torch, ctx, "x", d.ts, d.h)
            w = rnd(torch, ctx, key_w, d.h, scale=0.1)
            dy = rnd(torch, ctx, "dy", d.ts, d.h)

            ks = ctx["_kernels"]

            def op() -> None:
                dx, ctx["d" + key_w] = ks.rms_norm_bwd(dy, x, w, d.eps)
                if out is not None:  # the all-gather's input (sequence parallelism)
                    dx = out().view(d.ts, d.h).copy_(dx)
                ctx["dyn"] = dx
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
                    ks.matmul(a, w, out=out().view(a.shape[0], -1) if out is not None
                              else ctx[dst], accumulate=True)
                elif out is not None:
                    ks.matmul(a, w, out=out().view(a.shape[0], -1))
                else:
                    ctx[dst] = ks.matmul(a, w)
            return op
        return build

    def qk_weights(torch: Any, ctx: dict[str, Any], d: _Dims) -> tuple[Any, Any]:
        """The per-head query and key norm weights (``head_dim`` each, near one)."""
        ws = []
        for which in ("q", "k"):
            key = f"w_{which}_norm"
            fresh = key not in ctx
            w = rnd(torch, ctx, key, d.hd, scale=0.1)
            if fresh:
                w.add_(1.0)
            ws.append(w)
        return ws[0], ws[1]

    def rope_op(fused: bool) -> Callable[..., Callable[[], Any]]:
        # RoPE of the packed QKV's queries and keys (``rope``), or with ``fused`` each query
        # and key head RMS-normalised first, in the same kernel (``qk_norm_rope``, as the
        # decoder of a qk-norm model runs it)
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            rnd(torch, ctx, "qkv", d.t, d.q + 2 * d.kv)
            cos, sin = cos_sin(torch, ctx, d)
            ks = ctx["_kernels"]
            wq, wk = qk_weights(torch, ctx, d) if fused else (None, None)

            def op() -> None:
                qkv = d.seq_order(ctx["qkv"])
                if fused:
                    q, k = ks.qk_norm_rope(qkv, wq, wk, cos, sin, heads=d.heads,
                                           kv_heads=d.kvh, eps=d.eps)
                else:
                    q, k = ks.rope(qkv, cos, sin, heads=d.heads, kv_heads=d.kvh)
                ctx["q"], ctx["k"] = q.transpose(1, 2), k.transpose(1, 2)
                v = qkv.view(d.b, d.sq, d.heads + 2 * d.kvh, d.hd)[:, :, d.heads + d.kvh:]
                ctx["v"] = v.transpose(1, 2)
            return op
        return build

    def ensure_qkv(torch: Any, ctx: dict[str, Any], d: _Dims) -> None:
        if "q" not in ctx:
            ctx["q"] = rnd(torch, ctx, "_q", d.b, d.sq, d.heads, d.hd).transpose(1, 2)
        if "k" not in ctx:
            ctx["k"] = rnd(torch, ctx, "_k", d.b, d.sk, d.kvh, d.hd).transpose(1, 2)
            ctx["v"] = rnd(torch, ctx, "_v", d.b, d.sk, d.kvh, d.hd).transpose(1, 2)

    def gathered(torch: Any, ctx: dict[str, Any], d: _Dims) -> Any:
        # the CP all-gather's output: every rank's two chunks of K and V, rank-major
        return rnd(torch, ctx, "_kv_gathered", d.cp * 2 * d.t * d.kv)

    def attn_core(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        ensure_qkv(torch, ctx, d)
        ks = ctx["_kernels"]
        if d.cp > 1:  # as the decoder: order the gathered K/V, one causal piece per chunk
            kv_in = gathered(torch, ctx, d)
            pieces = attention_pieces(d.sq, d.cp, 0)

            def op_cp() -> None:
                kv = order_kv(kv_in, cp=d.cp, b=d.b, sq=d.sq, kvh=d.kvh, hd=d.hd)
                o, _ = cp_attention(ks, ctx["q"], kv[0].transpose(1, 2),
                                    kv[1].transpose(1, 2), pieces, keep=False)
                ctx["attn"] = d.rank_order(o.transpose(1, 2).reshape(d.t, d.q))
            return op_cp

        def op() -> None:
            o = ks.attention(ctx["q"], ctx["k"], ctx["v"])
            ctx["attn"] = d.rank_order(o.transpose(1, 2).reshape(d.t, d.q))
        return op

    def attn_core_bwd(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        ensure_qkv(torch, ctx, d)
        ks = ctx["_kernels"]
        rnd(torch, ctx, "dattn", d.t, d.q)
        # The forward runs once here; each run of the op is the backward alone, called
        # directly (no autograd engine), so it captures in a CUDA graph.
        if d.cp > 1:  # as the decoder: the pieces' backwards, dK/dV laid out for the RS
            pieces = attention_pieces(d.sq, d.cp, 0)
            _, saved_cp = cp_attention(ks, ctx["q"], ctx["k"], ctx["v"], pieces, keep=True)
            grad_buf = rnd(torch, ctx, "_kv_grad", d.cp * 2 * d.t * d.kv)

            def op_cp() -> None:
                do = d.seq_order(ctx["dattn"]).view(d.b, d.sq, d.heads, d.hd).transpose(1, 2)
                ctx["dq"], dkv = cp_attention_bwd(do, saved_cp, pieces, keys=d.sk)
                scatter_kv_grad(dkv, grad_buf, cp=d.cp, b=d.b, sq=d.sq, kvh=d.kvh, hd=d.hd)
            return op_cp
        saved = ks.attention_fwd(ctx["q"], ctx["k"], ctx["v"])

        def op() -> None:
            do = d.seq_order(ctx["dattn"]).view(d.b, d.sq, d.heads, d.hd).transpose(1, 2)
            ctx["dq"], ctx["dk"], ctx["dv"] = ks.attention_bwd(do, saved)
        return op

    def rope_bwd_op(fused: bool) -> Callable[..., Callable[[], Any]]:
        # RoPE's backward (``rope_bwd``), or with ``fused`` the norms' backward after it in
        # the same kernel (``qk_norm_rope_bwd``: it reads the pre-norm QKV too)
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            cos, sin = cos_sin(torch, ctx, d)
            if "dq" not in ctx:
                ctx["dq"] = rnd(torch, ctx, "_dq", d.b, d.sq, d.heads, d.hd).transpose(1, 2)
            if "dk" not in ctx:  # with CP: this rank's chunks' (the reduce-scatter's output)
                ctx["dk"] = rnd(torch, ctx, "_dk", d.b, d.sq, d.kvh, d.hd).transpose(1, 2)
                ctx["dv"] = rnd(torch, ctx, "_dv", d.b, d.sq, d.kvh, d.hd).transpose(1, 2)
            ks = ctx["_kernels"]
            if fused:
                qkv = d.seq_order(rnd(torch, ctx, "qkv", d.t, d.q + 2 * d.kv))
                wq, wk = qk_weights(torch, ctx, d)

            def op() -> None:
                dq, dk, dv = (ctx[n].transpose(1, 2) for n in ("dq", "dk", "dv"))
                if fused:
                    dqkv, ctx["dw_q_norm"], ctx["dw_k_norm"] = ks.qk_norm_rope_bwd(
                        dq, dk, dv, qkv, wq, wk, cos, sin, eps=d.eps)
                else:  # RoPE is a rotation: its backward rotates back; dv packed beside
                    dqkv = ks.rope_bwd(dq, dk, dv, cos, sin)
                ctx["dqkv"] = d.rank_order(dqkv)
            return op
        return build

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

    moe_ops = _moe_op_builders(rnd, weight, gemm)
    tq = lambda d: (d.t, d.q)  # noqa: E731
    th = lambda d: (d.t, d.h)  # noqa: E731
    tf = lambda d: (d.t, d.f)  # noqa: E731
    tqkv = lambda d: (d.t, d.q + 2 * d.kv)  # noqa: E731
    return {
        "attn_norm": norm("w_attn_norm"),
        "mlp_norm": norm("w_mlp_norm"),
        "qkv": gemm("xn", th, "Wqkv", lambda d: (d.h, d.q + 2 * d.kv), "qkv"),
        "rope": rope_op(fused=False),
        "qk_norm_rope": rope_op(fused=True),
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
        "rope_bwd": rope_bwd_op(fused=False),
        "qk_norm_rope_bwd": rope_bwd_op(fused=True),
        "qkv_dgrad": gemm("dqkv", tqkv, "Wqkv", lambda d: (d.h, d.q + 2 * d.kv), "dx",
                          trans_w=True),
        "qkv_wgrad": gemm("xn", th, "dqkv", tqkv, "dWqkv", trans_a=True),
        **moe_ops,
    }


def _moe_op_builders(rnd: Callable[..., Any], weight: Callable[..., Any],  # noqa: C901 - a table
                     gemm: Callable[..., Any]) -> dict[str, Callable[..., Callable[[], Any]]]:
    """The mixture-of-experts ops' builders (``_op_builders``' table takes them in), at the
    shapes of ``_MoEDims``; ``rnd``, ``weight`` and ``gemm`` are that table's helpers."""

    def m(d: _Dims) -> _MoEDims:
        if d.moe is None:
            raise AssertionError("a mixture-of-experts op of a model without one")
        return d.moe

    def rnd_as(torch: Any, ctx: dict[str, Any], key: str, dtype: Any, *shape: int) -> Any:
        if key not in ctx:
            ctx[key] = torch.randn(*shape, generator=ctx["_gen"], device=ctx["_device"],
                                   dtype=torch.float32).to(dtype)
        return ctx[key]

    def xm(torch: Any, ctx: dict[str, Any], d: _Dims) -> Any:
        return rnd(torch, ctx, "xm", m(d).tm, d.h)

    def table(torch: Any, ctx: dict[str, Any], d: _Dims) -> Any:
        """The received rows per (source rank, local expert), a device table (the sorts
        read it without host copies)."""
        if "_recv_counts" not in ctx:
            ctx["_recv_counts"] = torch.tensor(m(d).recv_counts, dtype=torch.int64,
                                               device=ctx["_device"])
        return ctx["_recv_counts"]

    def group_counts(torch: Any, ctx: dict[str, Any], d: _Dims, x: Any, w: Any) -> Any:
        """The rows per local expert in the form the grouped GEMM's path reads without a
        host round trip: a device tensor for ``torch._grouped_mm``, host ints for the loop
        (decided once, at build, on the operands' shapes and dtypes)."""
        if ctx["_kernels"].grouped_mm_path(x, w) == "grouped_mm":
            if "_local_counts" not in ctx:
                ctx["_local_counts"] = torch.tensor(m(d).local_counts, dtype=torch.int64,
                                                    device=ctx["_device"])
            return ctx["_local_counts"]
        return list(m(d).local_counts)

    def routing(torch: Any, ctx: dict[str, Any], d: _Dims) -> None:
        """The router's logits, top-k and permutation of this rank's tokens, once (for ops
        that read them without their producer in the partition)."""
        if "perm" in ctx:
            return
        md, ks = m(d), ctx["_kernels"]
        w = weight(torch, ctx, "Wr", d.h, md.experts)
        ctx.setdefault("logits", ks.router(xm(torch, ctx, d), w, dtype=md.router_dtype))
        ctx["probs"], ctx["idx"] = ks.router_topk(ctx["logits"], md.k)
        _, ctx["perm"] = ks.permute(xm(torch, ctx, d), ctx["idx"], experts=md.experts,
                                    ep=md.ep)

    def experts_w(torch: Any, ctx: dict[str, Any], d: _Dims) -> tuple[Any, Any]:
        md = m(d)
        if "We1" not in ctx:  # [L, h, 2 fe] (gate | up) and [L, fe, h], input-major
            g = ctx["_gen"]
            for key, shape in (("We1", (md.local, d.h, 2 * md.fe)),
                               ("We2", (md.local, md.fe, d.h))):
                ctx[key] = (torch.randn(*shape, generator=g, device=ctx["_device"],
                                        dtype=torch.float32) * shape[1] ** -0.5
                            ).to(ctx["_dtype"])
        return ctx["We1"], ctx["We2"]

    def prefix(out: Any, rows: int) -> Any:
        """The first ``rows`` rows of the all-to-all's send buffer (a rank sends its
        ``tm x top-k`` rows there; the buffer holds the busiest rank's ``rows``)."""
        return None if out is None else out()[:rows]

    # ---------------------------------------------------------------- forward
    def router(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        x = xm(torch, ctx, d)
        w = weight(torch, ctx, "Wr", d.h, md.experts)

        def op() -> None:
            ctx["logits"] = ks.router(ctx.get("xm", x), w, dtype=md.router_dtype)
        return op

    def router_topk(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        routing(torch, ctx, d)

        def op() -> None:
            ctx["probs"], ctx["idx"] = ks.router_topk(ctx["logits"], md.k)
        return op

    def permute(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        routing(torch, ctx, d)

        def op() -> None:
            ctx["rows"], ctx["perm"] = ks.permute(ctx.get("xm"), ctx["idx"],
                                                  experts=md.experts, ep=md.ep,
                                                  out=prefix(out, md.tm * md.k))
        return op

    def expert_sort(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        ks = ctx["_kernels"]
        recv = rnd(torch, ctx, "recv", m(d).rows, d.h)  # the dispatch's output
        tab = table(torch, ctx, d)

        def op() -> None:
            ctx["xs"] = ks.expert_sort(recv, tab)
        return op

    def expert_gate_up(torch: Any, ctx: dict[str, Any], d: _Dims,
                       out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        xs = rnd(torch, ctx, "xs", md.rows, d.h)
        w1, _ = experts_w(torch, ctx, d)
        c = group_counts(torch, ctx, d, xs, w1)

        def op() -> None:
            ctx["h1"] = ks.grouped_mm(ctx["xs"], w1, c)
        return op

    def expert_swiglu(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        rnd(torch, ctx, "h1", md.rows, 2 * md.fe)

        def op() -> None:
            ctx["ea"] = ks.expert_swiglu(ctx["h1"])
        return op

    def expert_down(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        a = rnd(torch, ctx, "ea", md.rows, md.fe)
        _, w2 = experts_w(torch, ctx, d)
        c = group_counts(torch, ctx, d, a, w2)

        def op() -> None:  # without the sort, the combine's input (``out``)
            ctx["ey"] = ks.grouped_mm(ctx["ea"], w2, c, out=None if out is None else out())
        return op

    def expert_unsort(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        ks = ctx["_kernels"]
        rnd(torch, ctx, "ey", m(d).rows, d.h)
        tab = table(torch, ctx, d)

        def op() -> None:  # the combine's input
            ctx["ys"] = ks.expert_unsort(ctx["ey"], tab, out=None if out is None else out())
        return op

    def unpermute(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        routing(torch, ctx, d)
        back = rnd(torch, ctx, "back", md.tm * md.k, d.h)  # the combine's output
        shared = rnd(torch, ctx, "ysh", md.tm, d.h) if md.fs else None

        def op() -> None:
            ctx["y_moe"] = ks.unpermute(back, ctx["probs"], ctx["perm"],
                                        shared=ctx.get("ysh", shared))
        return op

    # ---------------------------------------------------------------- backward
    def unpermute_bwd(torch: Any, ctx: dict[str, Any], d: _Dims,
                      out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        routing(torch, ctx, d)
        back = rnd(torch, ctx, "back", md.tm * md.k, d.h)
        dy = rnd(torch, ctx, "dy_moe", md.tm, d.h)

        def op() -> None:  # the combine gradient's input
            ctx["drows"], ctx["dprobs"] = ks.unpermute_bwd(
                dy, back, ctx["probs"], ctx["perm"], out=prefix(out, md.tm * md.k))
        return op

    def expert_unsort_bwd(torch: Any, ctx: dict[str, Any], d: _Dims,
                          out: Any) -> Callable[[], Any]:
        ks = ctx["_kernels"]
        recv = rnd(torch, ctx, "recv_g", m(d).rows, d.h)  # the combine gradient's output
        tab = table(torch, ctx, d)

        def op() -> None:
            ctx["dey"] = ks.expert_unsort_bwd(recv, tab)
        return op

    def expert_down_dgrad(torch: Any, ctx: dict[str, Any], d: _Dims,
                          out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        dy = rnd(torch, ctx, "dey", md.rows, d.h)
        _, w2 = experts_w(torch, ctx, d)
        w2t = w2.transpose(1, 2)
        c = group_counts(torch, ctx, d, dy, w2t)

        def op() -> None:
            ctx["dea"] = ks.grouped_mm(ctx["dey"], w2t, c)
        return op

    def wgrad(x_key: str, x_cols: Callable[[_MoEDims, _Dims], int], dy_key: str,
              dy_cols: Callable[[_MoEDims, _Dims], int], dst: str) -> Callable[..., Any]:
        def build(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
            md, ks = m(d), ctx["_kernels"]
            x = rnd(torch, ctx, x_key, md.rows, x_cols(md, d))
            dy = rnd(torch, ctx, dy_key, md.rows, dy_cols(md, d))
            # the path is decided on the operands' widths and dtypes
            c = group_counts(torch, ctx, d, x, dy.unsqueeze(0))

            def op() -> None:
                ctx[dst] = ks.grouped_mm_wgrad(ctx[x_key], ctx[dy_key], c)
            return op
        return build

    def expert_swiglu_bwd(torch: Any, ctx: dict[str, Any], d: _Dims,
                          out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        h1 = rnd(torch, ctx, "h1", md.rows, 2 * md.fe)
        rnd(torch, ctx, "dea", md.rows, md.fe)

        def op() -> None:
            ctx["dh1"] = ks.expert_swiglu_bwd(ctx["dea"], ctx.get("h1", h1))
        return op

    def expert_gate_up_dgrad(torch: Any, ctx: dict[str, Any], d: _Dims,
                             out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        dh = rnd(torch, ctx, "dh1", md.rows, 2 * md.fe)
        w1, _ = experts_w(torch, ctx, d)
        w1t = w1.transpose(1, 2)
        c = group_counts(torch, ctx, d, dh, w1t)

        def op() -> None:  # without the sort, the dispatch gradient's input (``out``)
            ctx["dxs"] = ks.grouped_mm(ctx["dh1"], w1t, c, out=None if out is None else out())
        return op

    def expert_sort_bwd(torch: Any, ctx: dict[str, Any], d: _Dims,
                        out: Any) -> Callable[[], Any]:
        ks = ctx["_kernels"]
        rnd(torch, ctx, "dxs", m(d).rows, d.h)
        tab = table(torch, ctx, d)

        def op() -> None:  # the dispatch gradient's input
            ctx["dxr"] = ks.expert_sort_bwd(ctx["dxs"], tab, out=None if out is None else out())
        return op

    def permute_bwd(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        routing(torch, ctx, d)
        drows = rnd(torch, ctx, "dperm", md.tm * md.k, d.h)  # the dispatch gradient's output

        def op() -> None:
            ctx["dxm"] = ks.permute_bwd(drows, ctx["perm"])
        return op

    def router_topk_bwd(torch: Any, ctx: dict[str, Any], d: _Dims,
                        out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        routing(torch, ctx, d)
        rd = getattr(torch, md.router_dtype)
        dprobs = rnd_as(torch, ctx, "_dprobs", rd, md.tm, md.k)

        def op() -> None:
            ctx["dlogits"] = ks.router_topk_bwd(ctx.get("dprobs", dprobs), ctx["probs"],
                                                ctx["idx"], md.experts)
        return op

    def router_dgrad(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        rd = getattr(torch, md.router_dtype)
        rnd_as(torch, ctx, "dlogits", rd, md.tm, md.experts)
        w = weight(torch, ctx, "Wr", d.h, md.experts)

        def op() -> None:
            ctx["dxr_router"] = ks.router_dgrad(ctx["dlogits"], w, dtype=ctx["_dtype"])
        return op

    def router_wgrad(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        rd = getattr(torch, md.router_dtype)
        rnd_as(torch, ctx, "dlogits", rd, md.tm, md.experts)
        x = xm(torch, ctx, d)

        def op() -> None:
            ctx["dWr"] = ks.router_wgrad(ctx.get("xm", x), ctx["dlogits"])
        return op

    # ---------------------------------------------------------------- shared experts
    def shared_swiglu(torch: Any, ctx: dict[str, Any], d: _Dims, out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        rnd(torch, ctx, "sg", md.tm, md.fs)
        rnd(torch, ctx, "su", md.tm, md.fs)

        def op() -> None:
            ctx["sa"] = ks.swiglu(ctx["sg"], ctx["su"])
        return op

    def shared_swiglu_bwd(torch: Any, ctx: dict[str, Any], d: _Dims,
                          out: Any) -> Callable[[], Any]:
        md, ks = m(d), ctx["_kernels"]
        g = rnd(torch, ctx, "sg", md.tm, md.fs)
        u = rnd(torch, ctx, "su", md.tm, md.fs)
        rnd(torch, ctx, "dsa", md.tm, md.fs)

        def op() -> None:
            ctx["dsg"], ctx["dsu"] = ks.swiglu_bwd(ctx["dsa"], g, u)
        return op

    th = lambda d: (m(d).tm, d.h)  # noqa: E731
    tf = lambda d: (m(d).tm, m(d).fs)  # noqa: E731
    hf = lambda d: (d.h, m(d).fs)  # noqa: E731
    fh = lambda d: (m(d).fs, d.h)  # noqa: E731
    return {
        "router": router,
        "router_topk": router_topk,
        "permute": permute,
        "expert_sort": expert_sort,
        "expert_gate_up": expert_gate_up,
        "expert_swiglu": expert_swiglu,
        "expert_down": expert_down,
        "expert_unsort": expert_unsort,
        "unpermute": unpermute,
        "shared_gate": gemm("xm", th, "Wsg", hf, "sg"),
        "shared_up": gemm("xm", th, "Wsu", hf, "su"),
        "shared_swiglu": shared_swiglu,
        "shared_down": gemm("sa", tf, "Wsd", fh, "ysh"),
        "unpermute_bwd": unpermute_bwd,
        "expert_unsort_bwd": expert_unsort_bwd,
        "expert_down_dgrad": expert_down_dgrad,
        "expert_down_wgrad": wgrad("ea", lambda md, d: md.fe, "dey", lambda md, d: d.h,
                                   "dWe2"),
        "expert_swiglu_bwd": expert_swiglu_bwd,
        "expert_gate_up_dgrad": expert_gate_up_dgrad,
        "expert_gate_up_wgrad": wgrad("xs", lambda md, d: d.h, "dh1",
                                      lambda md, d: 2 * md.fe, "dWe1"),
        "expert_sort_bwd": expert_sort_bwd,
        "shared_down_dgrad": gemm("dy_moe", th, "Wsd", fh, "dsa", trans_w=True),
        "shared_down_wgrad": gemm("sa", tf, "dy_moe", th, "dWsd", trans_a=True),
        "shared_swiglu_bwd": shared_swiglu_bwd,
        "shared_gate_dgrad": gemm("dsg", tf, "Wsg", hf, "dxsh", trans_w=True),
        "shared_up_dgrad": gemm("dsu", tf, "Wsu", hf, "dxsh", trans_w=True, accumulate=True),
        "shared_gate_wgrad": gemm("xm", th, "dsg", tf, "dWsg", trans_a=True),
        "shared_up_wgrad": gemm("xm", th, "dsu", tf, "dWsu", trans_a=True),
        "permute_bwd": permute_bwd,
        "router_topk_bwd": router_topk_bwd,
        "router_dgrad": router_dgrad,
        "router_wgrad": router_wgrad,
    }
