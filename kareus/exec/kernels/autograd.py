"""Differentiable wrappers: a kernel set's forward and backward ops as autograd functions.

For a model's own training loop: ``rms_norm(x, w)``, ``rope(qkv, cos, sin, heads=...,
kv_heads=...)`` and ``swiglu(g, u)`` run the kernel set's forward op and, in the
backward pass, its backward op (the same kernels the runnable partitions profile).
``kernels`` is anything ``get_kernels`` accepts.
"""

from __future__ import annotations

from typing import Any

from kareus.exec.kernels.registry import get_kernels

__all__ = ["rms_norm", "rope", "swiglu"]


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

    return {"rms_norm": RMSNorm, "swiglu": SwiGLU, "rope": Rope}


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
