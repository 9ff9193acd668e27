"""Attention forward and backward as two explicit ops, without the autograd engine.

``scaled_dot_product_attention`` under autograd runs its backward through the autograd
engine: the engine hands CUDA work to its device thread and joins the stream the forward
ran on. That costs 100-150 us of host time per backward call on an H200 (measured, see
docs/performance.md), and it cannot be captured in a CUDA graph when the forward ran on
another stream than the capture (a runnable partition builds its attention forward once,
then replays only the backward): the join with a stream that is not capturing invalidates
the capture.

``attention_forward`` calls the fused attention op SDPA would choose (cuDNN or flash)
directly and keeps what its backward needs (output, log-sum-exp, the random-number
state); ``attention_backward`` calls the matching backward op on the current stream.
Both are plain ops: they capture like any kernel and cost one dispatch each. Where the
chosen backend has no direct pair (the math or memory-efficient backends, a custom mask),
the saved state is an autograd graph and the backward goes through
``torch.autograd.grad`` as before (correct, slower, and capturable only when the forward
is captured on the same stream).

torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kareus._logging import get_logger

__all__ = ["SavedAttention", "attention_backward", "attention_forward"]

_log = get_logger(__name__)


@attrs.frozen(eq=False)
class SavedAttention:
    """What an attention backward needs of its forward.

    Attributes:
        backend: ``"cudnn"``, ``"flash"`` (direct ops) or ``"autograd"`` (a graph).
        output: The forward's output ``[b, heads, s, hd]``.
        tensors: The forward's inputs and saved results, in the backend's order.
        max_q: Longest query sequence (direct backends).
        max_k: Longest key sequence (direct backends).
    """

    backend: str
    output: Any
    tensors: tuple[Any, ...]
    max_q: int = 0
    max_k: int = 0


def _direct_backend(name: str) -> str | None:
    return {"cudnn_attention": "cudnn", "flash_attention": "flash"}.get(name)


def attention_forward(q: Any, k: Any, v: Any, *, backend: str,
                      fallback: Callable[[Any, Any, Any], Any]) -> SavedAttention:
    """Causal attention of ``q`` [b, heads, s, hd] over ``k``, ``v`` [b, kv_heads, s_k, hd],
    keeping what ``attention_backward`` needs.

    Args:
        q: Queries.
        k: Keys (grouped: fewer heads than ``q`` is allowed where the backend takes it).
        v: Values.
        backend: The SDPA backend name that SDPA picks for these inputs
            (``attention_backend``):
            ``"cudnn_attention"`` and ``"flash_attention"`` run directly, anything else
            through ``fallback`` under autograd.
        fallback: ``(q, k, v) -> output``: SDPA as the kernel set runs it (used when the
            backend has no direct pair or the direct op refuses the inputs).

    Returns:
        The output and saved state.
    """
    import torch

    direct = _direct_backend(backend)
    if direct is not None:
        try:
            with torch.no_grad():
                if direct == "cudnn":
                    r = torch.ops.aten._scaled_dot_product_cudnn_attention(
                        q, k, v, None, True, 0.0, True, False)
                else:
                    r = torch.ops.aten._scaled_dot_product_flash_attention(
                        q, k, v, 0.0, True, False)
            # Both return (out, lse, cum_q, cum_k, max_q, max_k, two random-number state
            # tensors, debug mask); the backward takes the same six tensors.
            saved = (q, k, v, r[0], r[1], r[2], r[3], r[6], r[7])
            return SavedAttention(direct, r[0], saved, int(r[4]), int(r[5]))
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            # the op refuses these inputs (a layout or a head grouping): autograd
            _log.debug("attention through autograd: the %s op refused the inputs (%s)",
                       direct, str(exc)[:200])
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        o = fallback(qg, kg, vg)
    return SavedAttention("autograd", o, (o, qg, kg, vg))


def attention_backward(do: Any, saved: SavedAttention) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of the attention saved by ``attention_forward`` for the output
    gradient ``do`` (same shape as the output; any strides). Repeatable: the saved state
    is not consumed, so a profiling loop may run the same backward again."""
    import torch

    if saved.backend == "autograd":
        o, q, k, v = saved.tensors
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        return dq, dk, dv
    q, k, v, out, lse, cum_q, cum_k, a, b = saved.tensors
    if saved.backend == "cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, out, lse, a, b, None, cum_q, cum_k, saved.max_q, saved.max_k,
            0.0, True)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, cum_q, cum_k, saved.max_q, saved.max_k, 0.0, True, a, b)
    return dq, dk, dv
