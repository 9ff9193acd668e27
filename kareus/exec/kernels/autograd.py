"""Differentiable wrappers: a kernel set's forward and backward ops as autograd functions.

For a model's own training loop: ``rms_norm(x, w)``, ``rope(qkv, cos, sin, heads=...,
kv_heads=...)`` and ``swiglu(g, u)`` run the kernel set's forward op and, in the
backward pass, its backward op (the same kernels the runnable partitions profile).
``kernels`` is anything ``get_kernels`` accepts.

The mixture-of-experts ops likewise (``kareus.exec.kernels._moe`` has their data flow):
``moe_router(x, w, dtype=)``, ``moe_router_topk(logits, k)`` (``(probs, indices)``, the
gradient to the logits), ``moe_permute(x, indices, experts=, ep=)`` (``(rows, perm)``),
``moe_expert_sort(rows, counts)`` / ``moe_expert_unsort``, ``moe_grouped_mm(x, w, counts)``
(gradients to ``x`` and ``w``), ``moe_expert_swiglu(h)`` and ``moe_unpermute(rows, probs,
perm)`` (gradients to ``rows`` and ``probs``). The expert-parallel all-to-alls between them
are the caller's (a collective backend's ``all_to_all``, whose gradient is the all-to-all
with the splits swapped).
"""

from __future__ import annotations

from typing import Any

from kareus.exec.kernels.registry import get_kernels

__all__ = ["moe_expert_sort", "moe_expert_swiglu", "moe_expert_unsort", "moe_grouped_mm",
           "moe_permute", "moe_router", "moe_router_topk", "moe_unpermute", "rms_norm", "rope",
           "swiglu"]


def _functions() -> dict[str, Any]:
    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, eps: float, ks: Any) -> Any:
            ctx.save_for_backward(x, w)
            ctx.eps, ctx.ks = eps, ks
            return ks.rms_norm(x, w, eps)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            x, w = ctx.saved_tensors
            dx, dw = ctx.ks.rms_norm_bwd(dy.contiguous(), x, w, ctx.eps)
            return dx, dw, None, None

    class SwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, g: Any, u: Any, ks: Any) -> Any:
            ctx.save_for_backward(g, u)
            ctx.ks = ks
            return ks.swiglu(g, u)

        @staticmethod
        def backward(ctx: Any, da: Any) -> Any:
            g, u = ctx.saved_tensors
            dg, du = ctx.ks.swiglu_bwd(da.contiguous(), g, u)
            return dg, du, None

    class Rope(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, qkv: Any, cos: Any, sin: Any, heads: int, kv_heads: int,
                    ks: Any) -> Any:
            ctx.save_for_backward(cos, sin)
            ctx.ks, ctx.heads, ctx.kv_heads = ks, heads, kv_heads
            q, k = ks.rope(qkv, cos, sin, heads=heads, kv_heads=kv_heads)
            seq, hd = cos.shape
            v = qkv.view(-1, seq, heads + 2 * kv_heads, hd)[:, :, heads + kv_heads:]
            ctx.shapes = (tuple(q.shape), tuple(k.shape))
            return q, k, v

        @staticmethod
        def backward(ctx: Any, dq: Any, dk: Any, dv: Any) -> Any:
            cos, sin = ctx.saved_tensors
            q_shape, k_shape = ctx.shapes
            dq = dq if dq is not None else cos.new_zeros(q_shape)
            dk = dk if dk is not None else cos.new_zeros(k_shape)
            dv = dv if dv is not None else cos.new_zeros(k_shape)
            dqkv = ctx.ks.rope_bwd(dq, dk, dv, cos, sin)
            return dqkv, None, None, None, None, None

    return {"rms_norm": RMSNorm, "swiglu": SwiGLU, "rope": Rope, **_moe_functions()}


def _moe_functions() -> dict[str, Any]:
    import torch

    class Router(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, dtype: Any, ks: Any) -> Any:
            ctx.save_for_backward(x, w)
            ctx.ks = ks
            return ks.router(x, w, dtype=dtype)

        @staticmethod
        def backward(ctx: Any, dlogits: Any) -> Any:
            x, w = ctx.saved_tensors
            dx = ctx.ks.router_dgrad(dlogits, w, dtype=x.dtype)
            dw = ctx.ks.router_wgrad(x, dlogits).to(w.dtype)
            return dx, dw, None, None

    class RouterTopk(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: Any, k: int, ks: Any) -> Any:
            probs, idx = ks.router_topk(logits, k)
            ctx.save_for_backward(probs, idx)
            ctx.ks, ctx.experts = ks, logits.shape[-1]
            ctx.mark_non_differentiable(idx)
            return probs, idx

        @staticmethod
        def backward(ctx: Any, dprobs: Any, _didx: Any) -> Any:
            probs, idx = ctx.saved_tensors
            return ctx.ks.router_topk_bwd(dprobs, probs, idx, ctx.experts), None, None

    class Permute(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, indices: Any, experts: int, ep: int, ks: Any,
                    box: list[Any]) -> Any:
            rows, perm = ks.permute(x, indices, experts=experts, ep=ep)
            ctx.ks, ctx.perm = ks, perm
            box.append(perm)
            return rows

        @staticmethod
        def backward(ctx: Any, drows: Any) -> Any:
            return ctx.ks.permute_bwd(drows.contiguous(), ctx.perm), None, None, None, None, None

    class Sort(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, rows: Any, counts: Any, inverse: bool, ks: Any) -> Any:
            ctx.ks, ctx.counts, ctx.inverse = ks, counts, inverse
            return (ks.expert_unsort if inverse else ks.expert_sort)(rows, counts)

        @staticmethod
        def backward(ctx: Any, d: Any) -> Any:
            ks, d = ctx.ks, d.contiguous()
            back = ks.expert_unsort_bwd if ctx.inverse else ks.expert_sort_bwd
            return back(d, ctx.counts), None, None, None

    class GroupedMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, w: Any, counts: Any, ks: Any) -> Any:
            ctx.save_for_backward(x, w)
            ctx.ks, ctx.counts = ks, counts
            return ks.grouped_mm(x, w, counts)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            x, w = ctx.saved_tensors
            dy = dy.contiguous()
            dx = ctx.ks.grouped_mm(dy, w.transpose(1, 2), ctx.counts)
            dw = ctx.ks.grouped_mm_wgrad(x, dy, ctx.counts)
            return dx, dw, None, None

    class ExpertSwiGLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, h: Any, ks: Any) -> Any:
            ctx.save_for_backward(h)
            ctx.ks = ks
            return ks.expert_swiglu(h)

        @staticmethod
        def backward(ctx: Any, da: Any) -> Any:
            (h,) = ctx.saved_tensors
            return ctx.ks.expert_swiglu_bwd(da.contiguous(), h), None

    class Unpermute(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, rows: Any, probs: Any, perm: Any, ks: Any) -> Any:
            ctx.save_for_backward(rows, probs)
            ctx.ks, ctx.perm = ks, perm
            return ks.unpermute(rows, probs, perm)

        @staticmethod
        def backward(ctx: Any, dout: Any) -> Any:
            rows, probs = ctx.saved_tensors
            drows, dprobs = ctx.ks.unpermute_bwd(dout.contiguous(), rows, probs, ctx.perm)
            return drows, dprobs, None, None

    return {"moe_router": Router, "moe_router_topk": RouterTopk, "moe_permute": Permute,
            "moe_sort": Sort, "moe_grouped_mm": GroupedMM, "moe_expert_swiglu": ExpertSwiGLU,
            "moe_unpermute": Unpermute}


_FN: dict[str, Any] = {}


def _fn(name: str) -> Any:
    if not _FN:
        _FN.update(_functions())
    return _FN[name]


def rms_norm(x: Any, w: Any, eps: float = 1e-5, *, kernels: Any = None) -> Any:
    """Differentiable RMSNorm over the last dimension (gradients for ``x`` and ``w``)."""
    return _fn("rms_norm").apply(x, w, eps, get_kernels(kernels))


def swiglu(g: Any, u: Any, *, kernels: Any = None) -> Any:
    """Differentiable ``silu(g) * u``."""
    return _fn("swiglu").apply(g, u, get_kernels(kernels))


def rope(qkv: Any, cos: Any, sin: Any, *, heads: int, kv_heads: int,
         kernels: Any = None) -> tuple[Any, Any, Any]:
    """Differentiable RoPE on the packed QKV projection: returns ``(q, k, v)``, each
    ``[batch, seq, heads, hd]`` (v a view of ``qkv``); the gradient flows to ``qkv``."""
    return _fn("rope").apply(qkv, cos, sin, heads, kv_heads, get_kernels(kernels))


def moe_router(x: Any, w: Any, *, dtype: Any = "float32", kernels: Any = None) -> Any:
    """Differentiable router logits ``x @ w`` in the router dtype (gradients for ``x``, in
    its dtype, and ``w``, in its dtype)."""
    return _fn("moe_router").apply(x, w, dtype, get_kernels(kernels))


def moe_router_topk(logits: Any, k: int, *, kernels: Any = None) -> tuple[Any, Any]:
    """Differentiable top-k routing: ``(probs, indices)``, the softmax over the chosen
    logits (the gradient flows to ``logits``) and the experts (not differentiable)."""
    probs, idx = _fn("moe_router_topk").apply(logits, k, get_kernels(kernels))
    return probs, idx


def moe_permute(x: Any, indices: Any, *, experts: int, ep: int = 1,
                kernels: Any = None) -> tuple[Any, Any]:
    """Differentiable permutation: ``(rows, perm)``, each token once per chosen expert
    (the gradient of ``rows`` summed back per token); ``perm`` is the
    ``TokenPermutation`` for ``moe_unpermute`` and the all-to-all's splits."""
    box: list[Any] = []
    rows = _fn("moe_permute").apply(x, indices, experts, ep, get_kernels(kernels), box)
    return rows, box[0]


def moe_expert_sort(rows: Any, counts: Any, *, kernels: Any = None) -> Any:
    """Differentiable sort of received rows by local expert (``KernelSet.expert_sort``)."""
    return _fn("moe_sort").apply(rows, counts, False, get_kernels(kernels))


def moe_expert_unsort(rows: Any, counts: Any, *, kernels: Any = None) -> Any:
    """Differentiable inverse of ``moe_expert_sort``."""
    return _fn("moe_sort").apply(rows, counts, True, get_kernels(kernels))


def moe_grouped_mm(x: Any, w: Any, counts: Any, *, kernels: Any = None) -> Any:
    """Differentiable grouped GEMM ``[r, in] x [G, in, out] -> [r, out]`` (gradients for
    ``x`` and every group's weight; a group without rows gets zero)."""
    return _fn("moe_grouped_mm").apply(x, w, counts, get_kernels(kernels))


def moe_expert_swiglu(h: Any, *, kernels: Any = None) -> Any:
    """Differentiable ``silu(gate) * up`` of the fused gate/up output (gate first)."""
    return _fn("moe_expert_swiglu").apply(h, get_kernels(kernels))


def moe_unpermute(rows: Any, probs: Any, perm: Any, *, kernels: Any = None) -> Any:
    """Differentiable probability-weighted sum of each token's rows (gradients for
    ``rows`` and ``probs``); add a shared experts' output to the result yourself."""
    return _fn("moe_unpermute").apply(rows, probs, perm, get_kernels(kernels))
