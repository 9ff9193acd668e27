"""The packed QKV layout (``[tokens, (heads + 2 * kv_heads) * head_dim]``) split into views;
shared by the plain-torch sets (``base``) and the Triton kernels (``_triton``), and importing
neither."""

from __future__ import annotations

from typing import Any

from kareus.errors import ArgumentError


def _split_qkv(qkv: Any, seq: int, heads: int, kv_heads: int, hd: int) -> tuple[Any, Any, Any]:
    t = qkv.shape[0]
    if t % seq or qkv.shape[1] != (heads + 2 * kv_heads) * hd:
        raise ArgumentError(f"qkv of shape {tuple(qkv.shape)} is not [batch * {seq}, "
                            f"({heads} + 2 * {kv_heads}) * {hd}]")
    x = qkv.view(t // seq, seq, heads + 2 * kv_heads, hd)
    return x.split((heads, kv_heads, kv_heads), dim=2)
