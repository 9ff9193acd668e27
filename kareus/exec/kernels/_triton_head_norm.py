"""Query/key normalisation fused with RoPE: one Triton launch forward, one backward.

A model that normalises queries and keys per head (Qwen3: an RMSNorm over ``head_dim`` of
every query and key head, between the QKV projection and RoPE) would otherwise run, per
layer and nanobatch, a copy of the packed QKV, two strided per-head norms (each another
gather and scatter, since a head's vector is not a row of a contiguous matrix), then RoPE
reading the normalised heads again. On one H200 at Qwen3-1.7B's shapes (graphed, GPU
time; bench/probes/qk_norm_rope.py), the forward ran at 72-80% of HBM bandwidth
(3.5-3.8 TB/s of the minimum traffic) against 10-11% for the separate Triton norm and
RoPE kernels and 3% for ``TorchKernels``' composition; the backward at 33-51% (1.6-2.5
TB/s; the partial weight gradients' reduction is the rest) against 9-11% and 2-4%.

Here one program holds ``BLOCK_S`` positions of one head: it reads the head's two halves
from the packed QKV in place (any row stride), normalises them (float32 statistics, the
normalised value rounded to the activation dtype before the weight, as Llama's and Qwen3's
``RMSNorm`` cast), rounds the product to the activation dtype (what the unfused norm
stores), rotates it and writes q and k in the layout ``KernelSet.rope`` returns. Each
element of q and k is read once and written once.

The backward is the same walk in reverse: rotate ``dq``/``dk`` back, run the norm's
backward against the pre-norm heads (read from the packed QKV again, its statistics
recomputed: cheaper than storing them), write the projection's output gradient into the
packed dQKV that ``KernelSet.rope_bwd`` returns (with ``dv`` copied beside it, as there),
and leave each program's share of the norm weights' gradient in a float32 partial buffer
that one reduction sums (deterministic: no atomics).

Importing this module imports triton and torch.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kareus.errors import ArgumentError
from kareus.exec.kernels._launch import plain_launch
from kareus.exec.kernels._layout import _split_qkv

__all__ = ["qk_norm_rope_bwd", "qk_norm_rope_fwd"]


@triton.jit
def _norm_rope_fwd_kernel(QKV, s_b, s_s, s_h, Q, qb, qs, qh, K, kb, ks, kh, WQ, WK,
                          COS, SIN, c_s, seq, heads, kv_heads, eps,
                          HD: tl.constexpr, HALF: tl.constexpr, PAD: tl.constexpr,
                          BLOCK_S: tl.constexpr):
    # grid: (position blocks, query heads then key heads, sequences)
    si = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    h = tl.program_id(1)
    bi = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, PAD)
    cm = cols < HALF
    m = (si < seq)[:, None] & cm[None, :]
    is_q = h < heads
    src_head = h  # query heads, then key heads, are consecutive in the packed QKV
    so = (bi * s_b + si * s_s + src_head * s_h)[:, None] + cols[None, :]
    x1 = tl.load(QKV + so, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(QKV + so + HALF, mask=m, other=0.0).to(tl.float32)
    if is_q:
        w1 = tl.load(WQ + cols, mask=cm, other=0.0)
        w2 = tl.load(WQ + HALF + cols, mask=cm, other=0.0)
    else:
        w1 = tl.load(WK + cols, mask=cm, other=0.0)
        w2 = tl.load(WK + HALF + cols, mask=cm, other=0.0)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    r = tl.rsqrt(ss / HD + eps)[:, None]
    dt = Q.dtype.element_ty
    # the norm's output as the unfused norm stores it: (x * r) in the activation dtype,
    # times the weight, rounded again
    y1 = ((x1 * r).to(dt).to(tl.float32) * w1.to(tl.float32)[None, :]).to(dt).to(tl.float32)
    y2 = ((x2 * r).to(dt).to(tl.float32) * w2.to(tl.float32)[None, :]).to(dt).to(tl.float32)
    co = (si * c_s)[:, None] + cols[None, :]
    c = tl.load(COS + co, mask=m, other=0.0).to(tl.float32)
    s = tl.load(SIN + co, mask=m, other=0.0).to(tl.float32)
    o1 = y1 * c - y2 * s
    o2 = y2 * c + y1 * s
    if is_q:
        do = (bi * qb + si * qs + h * qh)[:, None] + cols[None, :]
        tl.store(Q + do, o1.to(dt), mask=m)
        tl.store(Q + do + HALF, o2.to(dt), mask=m)
    else:
        do = (bi * kb + si * ks + (h - heads) * kh)[:, None] + cols[None, :]
        tl.store(K + do, o1.to(dt), mask=m)
        tl.store(K + do + HALF, o2.to(dt), mask=m)


@triton.jit
def _norm_rope_bwd_kernel(DQ, dqb, dqs, dqh, DK, dkb, dks, dkh, DV, dvb, dvs, dvh,
                          QKV, s_b, s_s, s_h, DQKV, o_b, o_s, o_h, WQ, WK, DWP,
                          COS, SIN, c_s, seq, heads, kv_heads, eps,
                          HD: tl.constexpr, HALF: tl.constexpr, PAD: tl.constexpr,
                          BLOCK_S: tl.constexpr):
    # grid: (position blocks, query heads, key heads, value heads, sequences)
    pb = tl.program_id(0)
    si = (pb * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    h = tl.program_id(1)
    bi = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, PAD)
    cm = cols < HALF
    m = (si < seq)[:, None] & cm[None, :]
    dt = DQKV.dtype.element_ty
    oo = (bi * o_b + si * o_s + h * o_h)[:, None] + cols[None, :]
    if h >= heads + kv_heads:  # dV: copied into its place in the packed gradient
        vo = (bi * dvb + si * dvs + (h - heads - kv_heads) * dvh)[:, None] + cols[None, :]
        tl.store(DQKV + oo, tl.load(DV + vo, mask=m, other=0.0).to(dt), mask=m)
        tl.store(DQKV + oo + HALF, tl.load(DV + vo + HALF, mask=m, other=0.0).to(dt), mask=m)
    else:
        if h < heads:
            go = (bi * dqb + si * dqs + h * dqh)[:, None] + cols[None, :]
            g1 = tl.load(DQ + go, mask=m, other=0.0).to(tl.float32)
            g2 = tl.load(DQ + go + HALF, mask=m, other=0.0).to(tl.float32)
            w1 = tl.load(WQ + cols, mask=cm, other=0.0).to(tl.float32)
            w2 = tl.load(WQ + HALF + cols, mask=cm, other=0.0).to(tl.float32)
        else:
            go = (bi * dkb + si * dks + (h - heads) * dkh)[:, None] + cols[None, :]
            g1 = tl.load(DK + go, mask=m, other=0.0).to(tl.float32)
            g2 = tl.load(DK + go + HALF, mask=m, other=0.0).to(tl.float32)
            w1 = tl.load(WK + cols, mask=cm, other=0.0).to(tl.float32)
            w2 = tl.load(WK + HALF + cols, mask=cm, other=0.0).to(tl.float32)
        co = (si * c_s)[:, None] + cols[None, :]
        c = tl.load(COS + co, mask=m, other=0.0).to(tl.float32)
        s = tl.load(SIN + co, mask=m, other=0.0).to(tl.float32)
        # the inverse rotation, rounded as the unfused RoPE backward stores it
        d1 = (g1 * c + g2 * s).to(dt).to(tl.float32)
        d2 = (g2 * c - g1 * s).to(dt).to(tl.float32)
        xo = (bi * s_b + si * s_s + h * s_h)[:, None] + cols[None, :]
        x1 = tl.load(QKV + xo, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(QKV + xo + HALF, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)[:, None]
        n1 = x1 * r
        n2 = x2 * r
        a1 = d1 * w1[None, :]
        a2 = d2 * w2[None, :]
        dot = (tl.sum(a1 * n1, axis=1) + tl.sum(a2 * n2, axis=1))[:, None] / HD
        tl.store(DQKV + oo, (r * (a1 - n1 * dot)).to(dt), mask=m)
        tl.store(DQKV + oo + HALF, (r * (a2 - n2 * dot)).to(dt), mask=m)
        # this program's part of the weight's gradient: sum over its positions of dy * xhat
        slot = ((bi * tl.num_programs(1) + h) * tl.num_programs(0) + pb) * HD
        tl.store(DWP + slot + cols, tl.sum(d1 * n1, axis=0), mask=cm)
        tl.store(DWP + slot + HALF + cols, tl.sum(d2 * n2, axis=0), mask=cm)


def _head_strides(t: Any) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ArgumentError("the fused q/k norm and RoPE kernels need the head dimension "
                            "contiguous (stride 1)")
    return t.stride(0), t.stride(1), t.stride(2)


def _check(hd: int, seq: int, cos: Any, sin: Any, wq: Any, wk: Any) -> tuple[Any, Any]:
    if hd % 2 or cos.shape[-1] != hd or sin.shape != cos.shape or cos.shape[0] < seq:
        raise ArgumentError(f"cos/sin of shape {tuple(cos.shape)} do not fit head dim {hd} "
                            f"and {seq} positions")
    if tuple(wq.shape) != (hd,) or tuple(wk.shape) != (hd,):
        raise ArgumentError(f"the query and key norm weights must each hold head_dim = {hd} "
                            f"values, got {tuple(wq.shape)} and {tuple(wk.shape)}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or sin.stride(0) != cos.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def qk_norm_rope_fwd(qkv: Any, wq: Any, wk: Any, cos: Any, sin: Any, *, heads: int,
                     kv_heads: int, eps: float, block_s: int = 16,
                     num_warps: int = 4) -> tuple[Any, Any]:
    """Normalise each query and key head of the packed ``qkv``
    (``[batch * seq, (heads + 2 kv_heads) * hd]``, ``seq = cos.shape[0]``) over ``hd`` with
    the weights ``wq`` / ``wk`` (``[hd]``), then rotate: ``(q, k)``, each
    ``[batch, seq, heads, hd]``, as ``KernelSet.rope`` of the normalised QKV returns."""
    seq, hd = cos.shape[0], cos.shape[1]
    q, _, _ = _split_qkv(qkv, seq, heads, kv_heads, hd)
    cos, sin = _check(hd, seq, cos, sin, wq, wk)
    b = q.shape[0]
    qo = torch.empty((b, seq, heads, hd), dtype=qkv.dtype, device=qkv.device)
    ko = torch.empty((b, seq, kv_heads, hd), dtype=qkv.dtype, device=qkv.device)
    half = hd // 2
    plain_launch(_norm_rope_fwd_kernel, (triton.cdiv(seq, block_s), heads + kv_heads, b),
                 (q, *_head_strides(q), qo, *_head_strides(qo), ko, *_head_strides(ko),
                  wq, wk, cos, sin, cos.stride(0), seq, heads, kv_heads, float(eps),
                  hd, half, triton.next_power_of_2(half), block_s),
                 {"num_warps": num_warps}, None)
    return qo, ko


def qk_norm_rope_bwd(dq: Any, dk: Any, dv: Any, qkv: Any, wq: Any, wk: Any, cos: Any,
                     sin: Any, *, eps: float, block_s: int = 64,
                     num_warps: int = 4) -> tuple[Any, Any, Any]:
    """The backward of ``qk_norm_rope_fwd``: ``(dqkv, dwq, dwk)``: the packed gradient of the
    projection's output (``[batch * seq, (heads + 2 kv_heads) * hd]``, ``dv`` copied into
    its place) and the float32 gradients of the two norm weights. ``dq``, ``dk``, ``dv``:
    ``[batch, seq, heads or kv_heads, hd]``, any strides with the last 1; ``qkv`` the
    projection's output the forward read. ``block_s``: positions a program (64: fewer
    partial weight gradients to reduce; on one H200 at Qwen3-1.7B's shapes the backward
    ran 1.2-1.6x faster than at 16, bench/probes/results/qk_norm_rope_h200.json, where
    the forward was faster at 16)."""
    b, seq, heads, hd = dq.shape
    kv_heads = dk.shape[2]
    if dv.shape[2] != kv_heads or dk.shape[:2] != dq.shape[:2] or dv.shape[:2] != dq.shape[:2]:
        raise ArgumentError(f"dq {tuple(dq.shape)}, dk {tuple(dk.shape)} and dv "
                            f"{tuple(dv.shape)} do not describe one attention's gradients")
    x, _, _ = _split_qkv(qkv, seq, heads, kv_heads, hd)
    cos, sin = _check(hd, seq, cos, sin, wq, wk)
    out = torch.empty((b, seq, heads + 2 * kv_heads, hd), dtype=dq.dtype, device=dq.device)
    blocks = triton.cdiv(seq, block_s)
    nh = heads + 2 * kv_heads
    # every query and key program writes its slot; the value heads' slots are not read
    dwp = torch.empty((b, nh, blocks, hd), dtype=torch.float32, device=dq.device)
    half = hd // 2
    plain_launch(_norm_rope_bwd_kernel, (blocks, nh, b),
                 (dq, *_head_strides(dq), dk, *_head_strides(dk), dv, *_head_strides(dv),
                  x, *_head_strides(x), out, *_head_strides(out), wq, wk, dwp,
                  cos, sin, cos.stride(0), seq, heads, kv_heads, float(eps),
                  hd, half, triton.next_power_of_2(half), block_s),
                 {"num_warps": num_warps}, None)
    per_head = dwp[:, :heads + kv_heads].sum(dim=(0, 2))  # [heads + kv_heads, hd]
    return (out.view(b * seq, -1), per_head[:heads].sum(0),
            per_head[heads:heads + kv_heads].sum(0))
