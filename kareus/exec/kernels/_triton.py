"""kareus's own Triton kernels: one launch per op, each input read once, each output
written once, nothing modified in place.

Why our own, beside liger-kernel: liger's RMSNorm backward, SwiGLU backward and RoPE
write their results into their inputs (they reuse buffers a training step no longer
needs) and its RoPE needs q and k contiguous. A runnable partition runs each op again
and again on the same inputs, and its q and k are strided views of the packed QKV
projection: in-place kernels would feed each run the previous run's output (values
drift to inf over a profiling loop, which changes the power drawn), and making q and k
contiguous first is an extra copy of both. These kernels take strided inputs and write
fresh outputs. liger's RMSNorm forward and SwiGLU forward, which compute out of place,
are an opt-in of ``TritonKernels``
(``use_liger=True``): the kernels here are launched with less host time.

All arithmetic is float32; results are rounded once to the output dtype.

Launches. Each op's wrapper has two paths. The plain one (``lean=False``) is what it
always was: checks, launch settings and strides worked out on every call, then
``kernel[grid](...)``, Triton's own dispatch. The lean one (the default) keeps, per
signature of the op's inputs (their types, shapes, strides, dtypes, devices, the current
device and the launch settings; a tuple built from attributes torch keeps at hand), what
the plain path worked out and the compiled kernel it launched, and on later calls at that
signature runs one generated function that allocates the outputs and calls the compiled
kernel's launcher directly (``kareus.exec.kernels._launch`` says how, and when it
falls back to the plain path). On one H200 host (bench/results/launch_cost_h200.json)
the plain path cost 22-121 us of host time per op at the presets' shapes, for 9-205 us
of GPU time, and the lean path 10-28 us before its calls became one generated frame
each with Triton's C launch called directly; it aims at 15 us or less
(``bench/launch_cost.py`` measures both).

Importing this module imports triton and torch.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kareus.errors import ArgumentError
from kareus.exec.kernels import _launch
from kareus.exec.kernels._launch import LaunchRecord, plain_launch
from kareus.exec.kernels._layout import _split_qkv

_empty_like = torch.empty_like
# Tensors whose data_ptr() is their memory (not wrapper subclasses such as DTensor).
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

# ------------------------------------------------------------------------- RMSNorm


@triton.jit
def _row_block(M, N, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # This program's ROWS rows (int64 offsets), its columns and their masks.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    return rows, cols, cmask, (rows < M)[:, None] & cmask[None, :]


@triton.jit
def _norm_rows(x, rows, cols, cmask, m, W, Y, stride_y, N, eps):
    # Y = RMSNorm of the float32 rows x, with Llama's casting: normalise in float32,
    # round to the weight's dtype, then scale.
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0)
    xn = (x * rstd[:, None]).to(W.dtype.element_ty)
    y = xn.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_fwd_kernel(X, Y, W, stride_x, stride_y, M, N, eps,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
    rows, cols, cmask, m = _row_block(M, N, BLOCK, ROWS)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    _norm_rows(x, rows, cols, cmask, m, W, Y, stride_y, N, eps)


@triton.jit
def _add_rms_norm_fwd_kernel(X, R, S, Y, W, stride_x, stride_r, stride_s, stride_y, M, N, eps,
                             BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # S = X + R (the residual stream, rounded to S's dtype as a separate addition rounds
    # it), then Y = RMSNorm(S) as _rms_norm_fwd_kernel computes it.
    rows, cols, cmask, m = _row_block(M, N, BLOCK, ROWS)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = (x + r).to(S.dtype.element_ty)
    tl.store(S + rows[:, None] * stride_s + cols[None, :], s, mask=m)
    _norm_rows(s.to(tl.float32), rows, cols, cmask, m, W, Y, stride_y, N, eps)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, DX, DWP, DRES, stride_dy, stride_x, stride_dx, stride_res,
                         M, N, eps, iters, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         PREFETCH: tl.constexpr, HAS_RES: tl.constexpr):
    # Persistent: program p handles row blocks p, p + P, ... and keeps its share of dw
    # in registers, written once at the end (P x N float32 partial sums). With PREFETCH
    # the loads of the next row block are issued before the current one is computed,
    # so memory latency overlaps the reductions. With HAS_RES, DX = DRES + dx: the
    # residual branch's gradient added to dx rounded to DX's dtype, as a separate
    # addition of the two rounded tensors computes it.
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    m = (rows < M)[:, None] & cmask[None, :]
    x_nxt = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
    dy_nxt = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m, other=0.0)
    for i in range(0, iters):
        x = x_nxt.to(tl.float32)
        dy = dy_nxt.to(tl.float32)
        cur, mc = rows, m
        rows = ((pid + (i + 1) * progs) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        m = (rows < M)[:, None] & cmask[None, :]
        if PREFETCH:
            x_nxt = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            dy_nxt = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m,
                             other=0.0)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / N
        dx = ((g - xhat * c[:, None]) * rstd[:, None]).to(DX.dtype.element_ty)
        if HAS_RES:
            dres = tl.load(DRES + cur[:, None] * stride_res + cols[None, :], mask=mc, other=0.0)
            dx = (dres.to(tl.float32) + dx.to(tl.float32)).to(DX.dtype.element_ty)
        tl.store(DX + cur[:, None] * stride_dx + cols[None, :], dx, mask=mc)
        dw += tl.sum(dy * xhat, axis=0)
        if not PREFETCH:
            x_nxt = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            dy_nxt = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=m,
                             other=0.0)
    tl.store(DWP + pid.to(tl.int64) * N + cols, dw, mask=cmask)


@triton.jit
def _sum_rows_kernel(P_ptr, OUT, N, P: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    # OUT[n] = sum_p P[p, n], rounded once to OUT's dtype (the dw partials' final sum);
    # with ACC, OUT[n] += that rounded sum (a gradient accumulated in place, rounded as a
    # separate in-place addition rounds it).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p0 in tl.static_range(0, P, BLOCK_P):
        r = p0 + tl.arange(0, BLOCK_P)
        acc += tl.sum(tl.load(P_ptr + r[:, None] * N + cols[None, :],
                              mask=(r < P)[:, None] & cm[None, :], other=0.0), axis=0)
    total = acc.to(OUT.dtype.element_ty)
    if ACC:
        total = (tl.load(OUT + cols, mask=cm, other=0.0).to(tl.float32)
                 + total.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + cols, total, mask=cm)


def _norm_config(n: int, rows: int | None, num_warps: int | None) -> tuple[int, int, int]:
    block = triton.next_power_of_2(n)
    if rows is None:
        rows = max(1, min(16, 4096 // block))
    if num_warps is None:
        num_warps = 16 if block * rows >= 8192 else 8 if block * rows >= 2048 else 4
    return block, rows, num_warps


def _bwd_config(n: int, rows: int | None, num_warps: int | None,
                programs_per_sm: int | None) -> tuple[int, int, int, int]:
    # Measured on one H200 (bench/results/op_roofline_h200_tune.json, then
    # op_roofline_h200_retune.json): widths of 2048, 3072 and 8192 ran fastest, or within
    # 3% of the fastest of 60-90 settings, with 2 x 2048, 1 x 4096 and 1 x 8192 elements a
    # program step, 8, 8 and 16 warps, and 2, 2 and 1 programs per SM.
    block = triton.next_power_of_2(n)
    if rows is None:
        rows = max(1, min(16, 4096 // block))
    if num_warps is None:
        num_warps = 16 if block * rows >= 8192 else 8 if block * rows >= 2048 else 4
    if programs_per_sm is None:
        programs_per_sm = 1 if block >= 8192 else 2
    return block, rows, num_warps, programs_per_sm


def _as_rows(t: Any, n: int) -> Any:
    """``t`` as ``[rows, n]`` with its columns contiguous (a view where it can be)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _rms_norm_fwd_plain(x: Any, w: Any, eps: float, rows: int | None,
                        num_warps: int | None, rec: list[LaunchRecord] | None = None) -> Any:
    n = x.shape[-1]
    x2 = _as_rows(x, n)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block, rows, warps = _norm_config(n, rows, num_warps)
    m = x2.shape[0]
    plain_launch(_rms_norm_fwd_kernel, (triton.cdiv(m, rows),),
                 (x2, y, w, x2.stride(0), y.stride(0), m, n, eps, block, rows),
                 {"num_warps": warps}, rec)
    return y.view(x.shape)


def rms_norm_fwd(x: Any, w: Any, eps: float, *, rows: int | None = None,
                 num_warps: int | None = None, lean: bool = True) -> Any:
    """RMSNorm forward over the last dimension (rows of ``x`` may be strided).

    ``lean=False``: Triton's own dispatch on every call (the plain path); by default
    the launch is cached per signature (module docstring)."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _rms_norm_fwd_plain(x, w, eps, rows, num_warps)
    eps = float(eps)  # an int eps would compile another kernel (1 even as a constant)
    dev = rt.current_device()
    key = ("rms_norm_fwd", type(x), x.shape, x.stride(), x.dtype, x.get_device(), type(w),
           w.shape, w.stride(), w.dtype, w.get_device(), dev, rows, num_warps)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        y = p.fast(x, w, eps)
        if y is not None:
            return y
    rec: list[LaunchRecord] | None = [] if p is None else None
    y = _rms_norm_fwd_plain(x, w, eps, rows, num_warps, rec)
    if rec:
        _learn(rt, dev, key, rec, (x, y, w), _RMS_FWD_ROOTS, {"eps": eps},
               (None, _template(y), None), 1)
    return y


def _add_rms_norm_fwd_plain(x: Any, r: Any, w: Any, eps: float, rows: int | None,
                            num_warps: int | None, rec: list[LaunchRecord] | None = None
                            ) -> tuple[Any, Any]:
    if r.shape != x.shape:
        raise ArgumentError(f"the residual's shape {tuple(r.shape)} is not x's "
                            f"{tuple(x.shape)}")
    n = x.shape[-1]
    x2, r2 = _as_rows(x, n), _as_rows(r, n)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block, rows, warps = _norm_config(n, rows, num_warps)
    m = x2.shape[0]
    plain_launch(_add_rms_norm_fwd_kernel, (triton.cdiv(m, rows),),
                 (x2, r2, s, y, w, x2.stride(0), r2.stride(0), s.stride(0), y.stride(0), m, n,
                  eps, block, rows), {"num_warps": warps}, rec)
    return s.view(x.shape), y.view(x.shape)


def add_rms_norm_fwd(x: Any, r: Any, w: Any, eps: float, *, rows: int | None = None,
                     num_warps: int | None = None, lean: bool = True) -> tuple[Any, Any]:
    """``(s, rms_norm(s))`` with ``s = x + r``, in one pass: the residual addition and the
    norm that reads it (reads x and r, writes s and the normalised rows; a separate
    addition would write s and read it back). ``lean`` as in ``rms_norm_fwd``."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _add_rms_norm_fwd_plain(x, r, w, eps, rows, num_warps)
    eps = float(eps)
    dev = rt.current_device()
    key = ("add_rms_norm_fwd", type(x), x.shape, x.stride(), x.dtype, x.get_device(), type(r),
           r.shape, r.stride(), r.dtype, r.get_device(), type(w), w.shape, w.stride(),
           w.dtype, w.get_device(), dev, rows, num_warps)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        out = p.fast(x, r, w, eps)
        if out is not None:
            return out  # type: ignore[no-any-return]
    rec: list[LaunchRecord] | None = [] if p is None else None
    s, y = _add_rms_norm_fwd_plain(x, r, w, eps, rows, num_warps, rec)
    if rec:
        _learn(rt, dev, key, rec, (x, r, w, s, y), _ADD_RMS_FWD_ROOTS, {"eps": eps},
               (None, None, None, _template(s), _template(y)), (3, 4))
    return s, y


def _rms_norm_bwd_plain(dy: Any, x: Any, w: Any, eps: float, rows: int | None,
                        num_warps: int | None, programs_per_sm: int | None, prefetch: bool,
                        sum_block_n: int, sum_block_p: int,
                        rec: list[LaunchRecord] | None = None, dres: Any = None,
                        dw_out: Any = None) -> tuple[Any, Any]:
    n = x.shape[-1]
    x2, dy2 = _as_rows(x, n), _as_rows(dy, n)
    res2 = dy2
    if dres is not None:
        if dres.shape != x.shape:
            raise ArgumentError(f"the residual gradient's shape {tuple(dres.shape)} is not "
                                f"x's {tuple(x.shape)}")
        res2 = _as_rows(dres, n)
    if dw_out is not None and (tuple(dw_out.shape) != (n,) or not dw_out.is_contiguous()
                               or dw_out.device != w.device):
        raise ArgumentError(f"dw_out must be a contiguous [{n}] tensor on {w.device}, got "
                            f"shape {tuple(dw_out.shape)} on {dw_out.device}")
    m = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block, rows, warps, programs_per_sm = _bwd_config(n, rows, num_warps, programs_per_sm)
    sms = (torch.cuda.get_device_properties(x.device).multi_processor_count
           if x.device.type == "cuda" else 4)
    progs = max(1, min(triton.cdiv(m, rows), sms * programs_per_sm))
    dwp = torch.empty(progs, n, dtype=torch.float32, device=x.device)
    plain_launch(_rms_norm_bwd_kernel, (progs,),
                 (dy2, x2, w, dx, dwp, res2, dy2.stride(0), x2.stride(0), dx.stride(0),
                  res2.stride(0), m, n, eps, triton.cdiv(triton.cdiv(m, rows), progs), block,
                  rows, prefetch, dres is not None),
                 {"num_warps": warps}, rec)
    dw = torch.empty(n, dtype=w.dtype, device=w.device) if dw_out is None else dw_out
    plain_launch(_sum_rows_kernel, (triton.cdiv(n, sum_block_n),),
                 (dwp, dw, n, progs, sum_block_p, sum_block_n, dw_out is not None),
                 {"num_warps": 4}, rec)
    return dx.view(x.shape), dw


def rms_norm_bwd(dy: Any, x: Any, w: Any, eps: float, *, rows: int | None = None,
                 num_warps: int | None = None, programs_per_sm: int | None = None,
                 prefetch: bool = True, sum_block_n: int = 16, sum_block_p: int = 64,
                 lean: bool = True) -> tuple[Any, Any]:
    """RMSNorm backward: ``(dx, dw)`` in one pass over ``x`` and ``dy`` (plus a sum of
    the per-program ``dw`` partials, ``programs x N`` floats, by ``N / sum_block_n``
    programs reading ``sum_block_p`` partials a step).

    The sum's shape was measured on one H200 (bench/results/op_roofline_h200_tune.json):
    16 columns x 64 partials a step was the fastest of four shapes at all three presets'
    widths (2048: 32.4 us for the whole op against 37.1 us with the 64 x 32 used before;
    3072: 88.3 against 92.7; 8192: 204.1 against 205.3); a later sweep of seven shapes
    (op_roofline_h200_retune.json) put it within 3% of the fastest at each width.

    On the lean path (``lean=True``, module docstring) the partials' buffer is kept per
    signature and stream instead of allocated per call: both kernels run on that stream,
    so a call's first kernel cannot start before the previous call's sum has read the
    buffer (the caching allocator's own rule for memory it hands out again on the same
    stream). While the stream captures a CUDA graph the buffer is allocated per call, so
    no graph holds a buffer that eager calls (or another graph replayed on another stream)
    also write."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _rms_norm_bwd_plain(dy, x, w, eps, rows, num_warps, programs_per_sm, prefetch,
                                   sum_block_n, sum_block_p)
    eps = float(eps)
    dev = rt.current_device()
    key = ("rms_norm_bwd", type(dy), dy.shape, dy.stride(), dy.dtype, dy.get_device(),
           type(x), x.shape, x.stride(), x.dtype, x.get_device(), type(w), w.shape,
           w.stride(), w.dtype, w.get_device(), dev, rows, num_warps, programs_per_sm,
           prefetch, sum_block_n, sum_block_p)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        out = p.fast(dy, x, w, eps)
        if out is not None:
            return out  # type: ignore[no-any-return]
    rec: list[LaunchRecord] | None = [] if p is None else None
    dx, dw = _rms_norm_bwd_plain(dy, x, w, eps, rows, num_warps, programs_per_sm, prefetch,
                                 sum_block_n, sum_block_p, rec)
    if rec:
        dwp = rec[0].args[4]
        _learn(rt, dev, key, rec, (dy, x, w, dx, dwp, dw), _RMS_BWD_ROOTS, {"eps": eps},
               (None, None, None, _template(dx), _launch.Scratch(_template(dwp)),
                _template(dw)), (3, 5))
    return dx, dw


def rms_norm_bwd_add(dy: Any, x: Any, w: Any, dres: Any, dw_out: Any, eps: float, *,
                     rows: int | None = None, num_warps: int | None = None,
                     programs_per_sm: int | None = None, prefetch: bool = True,
                     sum_block_n: int = 16, sum_block_p: int = 64, lean: bool = True) -> Any:
    """``dres + dx`` of ``rms_norm_bwd``, with its ``dw`` added into ``dw_out`` in place:
    the norm's backward, the residual branch's gradient and the weight gradient's
    accumulation in the same two launches (a separate addition of ``dres`` would read
    ``dx`` back, and ``dw`` would be added by a third kernel). Rounded as those separate
    additions round. Settings and ``lean`` as in ``rms_norm_bwd``."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _rms_norm_bwd_plain(dy, x, w, eps, rows, num_warps, programs_per_sm, prefetch,
                                   sum_block_n, sum_block_p, None, dres, dw_out)[0]
    eps = float(eps)
    dev = rt.current_device()
    key = ("rms_norm_bwd_add", type(dy), dy.shape, dy.stride(), dy.dtype, dy.get_device(),
           type(x), x.shape, x.stride(), x.dtype, x.get_device(), type(w), w.shape,
           w.stride(), w.dtype, w.get_device(), type(dres), dres.shape, dres.stride(),
           dres.dtype, dres.get_device(), type(dw_out), dw_out.shape, dw_out.stride(),
           dw_out.dtype, dw_out.get_device(), dev, rows, num_warps, programs_per_sm, prefetch,
           sum_block_n, sum_block_p)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        out = p.fast(dy, x, w, dres, dw_out, eps)
        if out is not None:
            return out
    rec: list[LaunchRecord] | None = [] if p is None else None
    dx, _ = _rms_norm_bwd_plain(dy, x, w, eps, rows, num_warps, programs_per_sm, prefetch,
                                sum_block_n, sum_block_p, rec, dres, dw_out)
    if rec:
        dwp = rec[0].args[4]
        _learn(rt, dev, key, rec, (dy, x, w, dres, dw_out, dx, dwp), _RMS_BWD_ADD_ROOTS,
               {"eps": eps}, (None, None, None, None, None, _template(dx),
                              _launch.Scratch(_template(dwp))), 5)
    return dx


# Which root tensor (by its index in the op's roots) each pointer parameter lies in.
_RMS_FWD_ROOTS = {"X": 0, "Y": 1, "W": 2}
_ADD_RMS_FWD_ROOTS = {"X": 0, "R": 1, "W": 2, "S": 3, "Y": 4}
# Without a residual the kernel's DRES is DY (read by nothing).
_RMS_BWD_ROOTS = {"DY": 0, "DRES": 0, "X": 1, "W": 2, "DX": 3, "DWP": 4, "P_ptr": 4, "OUT": 5}
_RMS_BWD_ADD_ROOTS = {"DY": 0, "X": 1, "W": 2, "DRES": 3, "OUT": 4, "DX": 5, "DWP": 6,
                      "P_ptr": 6}


# ---------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_tile(src, s_b, s_s, s_h, dst, d_b, d_s, d_h, cos, sin, c_s, bi, si, head, valid,
               SIGN: tl.constexpr, ROTATE: tl.constexpr, HALF: tl.constexpr,
               PAD: tl.constexpr):
    # One head vector a row: row r is position si[r] of head head[r] of sequence bi[r]
    # (each a vector over the rows or one value for all), where valid[r].
    cols = tl.arange(0, PAD)
    m = valid[:, None] & (cols < HALF)[None, :]
    so = (bi * s_b + si * s_s + head * s_h)[:, None] + cols[None, :]
    do = (bi * d_b + si * d_s + head * d_h)[:, None] + cols[None, :]
    x1 = tl.load(src + so, mask=m, other=0.0)
    x2 = tl.load(src + so + HALF, mask=m, other=0.0)
    if ROTATE:
        co = (si * c_s)[:, None] + cols[None, :]
        c = tl.load(cos + co, mask=m, other=0.0).to(tl.float32)
        s = tl.load(sin + co, mask=m, other=0.0).to(tl.float32) * SIGN
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        tl.store(dst + do, (a * c - b * s).to(dst.dtype.element_ty), mask=m)
        tl.store(dst + do + HALF, (b * c + a * s).to(dst.dtype.element_ty), mask=m)
    else:
        tl.store(dst + do, x1.to(dst.dtype.element_ty), mask=m)
        tl.store(dst + do + HALF, x2.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rope_rows(src, s_b, s_s, s_h, dst, d_b, d_s, d_h, cos, sin, c_s, n_rows, heads, seq,
               blk, SIGN: tl.constexpr, ROTATE: tl.constexpr, HALF: tl.constexpr,
               PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    # Rows are (token, head) pairs of one tensor; each row is one head's vector.
    rows = (blk * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    tok = rows // heads
    head = rows % heads
    bi = tok // seq
    si = tok % seq
    _rope_tile(src, s_b, s_s, s_h, dst, d_b, d_s, d_h, cos, sin, c_s, bi, si, head,
               rows < n_rows, SIGN, ROTATE, HALF, PAD)


@triton.jit
def _rope_kernel(a_src, a_sb, a_ss, a_sh, a_dst, a_db, a_ds, a_dh, a_heads, a_blocks,
                 b_src, b_sb, b_ss, b_sh, b_dst, b_db, b_ds, b_dh, b_heads, b_blocks,
                 c_src, c_sb, c_ss, c_sh, c_dst, c_db, c_ds, c_dh, c_heads,
                 cos, sin, c_s, tokens, seq,
                 SIGN: tl.constexpr, HALF: tl.constexpr, PAD: tl.constexpr,
                 BLOCK_R: tl.constexpr, COPY_C: tl.constexpr):
    # One launch over q and k (and, backward, the copy of dv): the grid's first blocks
    # rotate tensor a, the next ones tensor b, the last ones copy tensor c.
    pid = tl.program_id(0)
    if pid < a_blocks:
        _rope_rows(a_src, a_sb, a_ss, a_sh, a_dst, a_db, a_ds, a_dh, cos, sin, c_s,
                   tokens * a_heads, a_heads, seq, pid, SIGN, True, HALF, PAD, BLOCK_R)
    elif pid < a_blocks + b_blocks:
        _rope_rows(b_src, b_sb, b_ss, b_sh, b_dst, b_db, b_ds, b_dh, cos, sin, c_s,
                   tokens * b_heads, b_heads, seq, pid - a_blocks, SIGN, True, HALF, PAD,
                   BLOCK_R)
    elif COPY_C:
        _rope_rows(c_src, c_sb, c_ss, c_sh, c_dst, c_db, c_ds, c_dh, cos, sin, c_s,
                   tokens * c_heads, c_heads, seq, pid - a_blocks - b_blocks, SIGN, False,
                   HALF, PAD, BLOCK_R)


@triton.jit
def _rope_heads_kernel(a_src, a_sb, a_ss, a_sh, a_dst, a_db, a_ds, a_dh, a_heads,
                       b_src, b_sb, b_ss, b_sh, b_dst, b_db, b_ds, b_dh, b_heads,
                       c_src, c_sb, c_ss, c_sh, c_dst, c_db, c_ds, c_dh,
                       cos, sin, c_s, seq,
                       SIGN: tl.constexpr, HALF: tl.constexpr, PAD: tl.constexpr,
                       BLOCK_S: tl.constexpr, COPY_C: tl.constexpr):
    # The same work as _rope_kernel on a 3-D grid (position blocks, heads of a then b then
    # c, sequences): the grid gives each program its head and sequence, where
    # _rope_kernel divides a flat row index by the head and sequence counts (64-bit
    # divisions before the first load can issue).
    si = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    h = tl.program_id(1)
    bi = tl.program_id(2).to(tl.int64)
    valid = si < seq
    if h < a_heads:
        _rope_tile(a_src, a_sb, a_ss, a_sh, a_dst, a_db, a_ds, a_dh, cos, sin, c_s, bi, si,
                   h, valid, SIGN, True, HALF, PAD)
    elif h < a_heads + b_heads:
        _rope_tile(b_src, b_sb, b_ss, b_sh, b_dst, b_db, b_ds, b_dh, cos, sin, c_s, bi, si,
                   h - a_heads, valid, SIGN, True, HALF, PAD)
    elif COPY_C:
        _rope_tile(c_src, c_sb, c_ss, c_sh, c_dst, c_db, c_ds, c_dh, cos, sin, c_s, bi, si,
                   h - a_heads - b_heads, valid, SIGN, False, HALF, PAD)


def _strides(t: Any) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ArgumentError("RoPE kernels need the head dimension contiguous (stride 1)")
    return t.stride(0), t.stride(1), t.stride(2)


ROPE_GRIDS = ("rows", "heads")
_MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third dimensions


def _rope_grid(grid: str | None, bsz: int, heads: int) -> str:
    # The 3-D grid unless its dimensions exceed CUDA's limits.
    if grid is None:
        return "heads" if bsz <= _MAX_GRID_YZ and heads <= _MAX_GRID_YZ else "rows"
    if grid not in ROPE_GRIDS:
        raise ArgumentError(f"unknown RoPE grid {grid!r}; choose one of {ROPE_GRIDS}")
    return grid


def _launch_rope(a: Any, a_out: Any, b: Any, b_out: Any, c: Any, c_out: Any, cos: Any,
                 sin: Any, sign: float, block_r: int, num_warps: int, grid: str | None,
                 rec: list[LaunchRecord] | None = None) -> None:
    bsz, seq, _, hd = a.shape
    if hd % 2 or cos.shape[-1] != hd or sin.shape != cos.shape or cos.shape[0] < seq:
        raise ArgumentError(f"cos/sin of shape {tuple(cos.shape)} do not fit head dim {hd} and "
                            f"{seq} positions")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or sin.stride(0) != cos.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    grid = _rope_grid(grid, bsz, a.shape[2] + b.shape[2] + (c.shape[2] if c is not None else 0))
    tokens = bsz * seq
    half = hd // 2
    consts = (sign, half, triton.next_power_of_2(half), block_r, c is not None)
    if grid == "heads":
        hc = c.shape[2] if c is not None else 0
        c_args3 = ((c, *_strides(c), c_out, *_strides(c_out)) if c is not None
                   else (a, 0, 0, 0, a_out, 0, 0, 0))
        plain_launch(_rope_heads_kernel, (triton.cdiv(seq, block_r), a.shape[2] + b.shape[2] + hc,
                                          bsz),
                     (a, *_strides(a), a_out, *_strides(a_out), a.shape[2],
                      b, *_strides(b), b_out, *_strides(b_out), b.shape[2],
                      *c_args3, cos, sin, cos.stride(0), seq, *consts),
                     {"num_warps": num_warps}, rec)
        return
    ab = triton.cdiv(tokens * a.shape[2], block_r)
    bb = triton.cdiv(tokens * b.shape[2], block_r)
    cb = triton.cdiv(tokens * c.shape[2], block_r) if c is not None else 0
    c_args = ((c, *_strides(c), c_out, *_strides(c_out), c.shape[2]) if c is not None
              else (a, 0, 0, 0, a_out, 0, 0, 0, 1))
    plain_launch(_rope_kernel, (ab + bb + cb,),
                 (a, *_strides(a), a_out, *_strides(a_out), a.shape[2], ab,
                  b, *_strides(b), b_out, *_strides(b_out), b.shape[2], bb,
                  *c_args, cos, sin, cos.stride(0), tokens, seq, *consts),
                 {"num_warps": num_warps}, rec)


def _rope_fwd_plain(q: Any, k: Any, cos: Any, sin: Any, block_r: int, num_warps: int,
                    grid: str | None, rec: list[LaunchRecord] | None = None
                    ) -> tuple[Any, Any]:
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch_rope(q, qo, k, ko, None, None, cos, sin, 1.0, block_r, num_warps, grid, rec)
    return qo, ko


def rope_fwd(q: Any, k: Any, cos: Any, sin: Any, *, block_r: int = 16,
             num_warps: int = 4, grid: str | None = None,
             lean: bool = True) -> tuple[Any, Any]:
    """Rotate ``q`` and ``k`` ([b, s, heads, hd], any strides with the last 1, e.g.
    views of the packed QKV) into new contiguous tensors, in one launch.

    ``grid``: ``"heads"`` (the default, see ``_rope_heads_kernel``): ``block_r``
    positions of one head a program, on a 3-D grid (sequence blocks x heads x
    sequences) that needs no index arithmetic; ``"rows"``: ``block_r`` (token, head)
    rows a program on a 1-D grid (used when a batch or head count exceeds a grid
    dimension's 65,535). Measured on one H200 (bench/results/op_roofline_h200_tune.json),
    the 3-D grid at 16 positions and 4 warps ran 1-5% faster than the row grid at all
    three presets' shapes, forward and backward (qwen3-1.7b forward 9.7 against
    10.2 us). ``lean``: as in ``rms_norm_fwd``."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _rope_fwd_plain(q, k, cos, sin, block_r, num_warps, grid)
    dev = rt.current_device()
    key = ("rope_fwd", type(q), q.shape, q.stride(), q.dtype, q.get_device(), type(k),
           k.shape, k.stride(), k.dtype, k.get_device(), type(cos), cos.shape, cos.stride(),
           cos.dtype, cos.get_device(), type(sin), sin.shape, sin.stride(), sin.dtype,
           sin.get_device(), dev, block_r, num_warps, grid)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        out = p.fast(q, k, cos, sin)
        if out is not None:
            return out  # type: ignore[no-any-return]
    rec: list[LaunchRecord] | None = [] if p is None else None
    qo, ko = _rope_fwd_plain(q, k, cos, sin, block_r, num_warps, grid, rec)
    if rec:
        _learn(rt, dev, key, rec, (q, k, qo, ko, cos, sin), _ROPE_FWD_ROOTS, {},
               (None, None, _template(qo), _template(ko), None, None), (2, 3))
    return qo, ko


def _rope_qkv_plain(qkv: Any, cos: Any, sin: Any, heads: int, kv_heads: int, block_r: int,
                    num_warps: int, grid: str | None,
                    rec: list[LaunchRecord] | None = None) -> tuple[Any, Any]:
    q, k, _ = _split_qkv(qkv, cos.shape[0], heads, kv_heads, cos.shape[1])
    return _rope_fwd_plain(q, k, cos, sin, block_r, num_warps, grid, rec)


def rope_qkv(qkv: Any, cos: Any, sin: Any, *, heads: int, kv_heads: int, block_r: int = 16,
             num_warps: int = 4, grid: str | None = None,
             lean: bool = True) -> tuple[Any, Any]:
    """``rope_fwd`` of q and k read from the packed QKV projection
    ``[batch * seq, (heads + 2 kv_heads) * hd]`` (``seq = cos.shape[0]``): the lean path
    takes their addresses and strides from ``qkv`` without making the two views."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _rope_qkv_plain(qkv, cos, sin, heads, kv_heads, block_r, num_warps, grid)
    dev = rt.current_device()
    key = ("rope_qkv", type(qkv), qkv.shape, qkv.stride(), qkv.dtype, qkv.get_device(),
           type(cos), cos.shape, cos.stride(), cos.dtype, cos.get_device(), type(sin),
           sin.shape, sin.stride(), sin.dtype, sin.get_device(), heads, kv_heads, dev,
           block_r, num_warps, grid)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        out = p.fast(qkv, cos, sin)
        if out is not None:
            return out  # type: ignore[no-any-return]
    rec: list[LaunchRecord] | None = [] if p is None else None
    qo, ko = _rope_qkv_plain(qkv, cos, sin, heads, kv_heads, block_r, num_warps, grid, rec)
    if rec:
        _learn(rt, dev, key, rec, (qkv, qo, ko, cos, sin), _ROPE_QKV_ROOTS, {},
               (None, _template(qo), _template(ko), None, None), (1, 2))
    return qo, ko


def _rope_bwd_plain(dq: Any, dk: Any, dv: Any, cos: Any, sin: Any, block_r: int,
                    num_warps: int, grid: str | None,
                    rec: list[LaunchRecord] | None = None) -> Any:
    b, s, nq, hd = dq.shape
    nk, nv = dk.shape[2], dv.shape[2]
    out = torch.empty(b, s, nq + nk + nv, hd, dtype=dq.dtype, device=dq.device)
    _launch_rope(dq, out[:, :, :nq], dk, out[:, :, nq:nq + nk], dv, out[:, :, nq + nk:],
                 cos, sin, -1.0, block_r, num_warps, grid, rec)
    return out.view(b * s, -1)


def rope_bwd(dq: Any, dk: Any, dv: Any, cos: Any, sin: Any, *, block_r: int = 16,
             num_warps: int = 4, grid: str | None = None, lean: bool = True) -> Any:
    """Rotate ``dq`` and ``dk`` back and write them with ``dv`` into one packed
    ``[b * s, (heads + 2 kv_heads) * hd]`` tensor, in one launch (``grid`` as in
    ``rope_fwd``; ``lean`` as in ``rms_norm_fwd``)."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _rope_bwd_plain(dq, dk, dv, cos, sin, block_r, num_warps, grid)
    dev = rt.current_device()
    key = ("rope_bwd", type(dq), dq.shape, dq.stride(), dq.dtype, dq.get_device(), type(dk),
           dk.shape, dk.stride(), dk.dtype, dk.get_device(), type(dv), dv.shape, dv.stride(),
           dv.dtype, dv.get_device(), type(cos), cos.shape, cos.stride(), cos.dtype,
           cos.get_device(), type(sin), sin.shape, sin.stride(), sin.dtype, sin.get_device(),
           dev, block_r, num_warps, grid)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        out = p.fast(dq, dk, dv, cos, sin)
        if out is not None:
            return out
    rec: list[LaunchRecord] | None = [] if p is None else None
    out = _rope_bwd_plain(dq, dk, dv, cos, sin, block_r, num_warps, grid, rec)
    if rec:
        _learn(rt, dev, key, rec, (dq, dk, dv, out, cos, sin), _ROPE_BWD_ROOTS, {},
               (None, None, None, _template(out), None, None), 3)
    return out


_ROPE_FWD_ROOTS = {"a_src": 0, "c_src": 0, "b_src": 1, "a_dst": 2, "c_dst": 2, "b_dst": 3,
                   "cos": 4, "sin": 5}
_ROPE_QKV_ROOTS = {"a_src": 0, "b_src": 0, "c_src": 0, "a_dst": 1, "c_dst": 1, "b_dst": 2,
                   "cos": 3, "sin": 4}
_ROPE_BWD_ROOTS = {"a_src": 0, "b_src": 1, "c_src": 2, "a_dst": 3, "b_dst": 3, "c_dst": 3,
                   "cos": 4, "sin": 5}


# -------------------------------------------------------------------------- SwiGLU


@triton.jit
def _swiglu_fwd_kernel(G, U, A, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(A + offs, (g * tl.sigmoid(g) * u).to(A.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(DA, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    da = tl.load(DA + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DU + offs, (da * g * s).to(DU.dtype.element_ty), mask=m)
    tl.store(DG + offs, (da * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=m)


def _flat(*ts: Any) -> list[Any]:
    return [t if t.is_contiguous() else t.contiguous() for t in ts]


def _swiglu_fwd_plain(g: Any, u: Any, block: int, num_warps: int,
                      rec: list[LaunchRecord] | None = None) -> Any:
    g, u = _flat(g, u)
    a = torch.empty_like(g)
    n = g.numel()
    plain_launch(_swiglu_fwd_kernel, (triton.cdiv(n, block),), (g, u, a, n, block),
                 {"num_warps": num_warps}, rec)
    return a


def swiglu_fwd(g: Any, u: Any, *, block: int = 2048, num_warps: int = 8,
               lean: bool = True) -> Any:
    """``silu(g) * u`` in one pass (``lean`` as in ``rms_norm_fwd``)."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _swiglu_fwd_plain(g, u, block, num_warps)
    dev = rt.current_device()
    key = ("swiglu_fwd", type(g), g.shape, g.stride(), g.dtype, g.get_device(), type(u),
           u.shape, u.stride(), u.dtype, u.get_device(), dev, block, num_warps)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        a = p.fast(g, u)
        if a is not None:
            return a
    rec: list[LaunchRecord] | None = [] if p is None else None
    a = _swiglu_fwd_plain(g, u, block, num_warps, rec)
    if rec:
        _learn(rt, dev, key, rec, (g, u, a), _SWIGLU_FWD_ROOTS, {}, (None, None, _template(a)),
               2)
    return a


def _swiglu_bwd_plain(da: Any, g: Any, u: Any, block: int, num_warps: int,
                      rec: list[LaunchRecord] | None = None) -> tuple[Any, Any]:
    da, g, u = _flat(da, g, u)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    plain_launch(_swiglu_bwd_kernel, (triton.cdiv(n, block),), (da, g, u, dg, du, n, block),
                 {"num_warps": num_warps}, rec)
    return dg, du


def swiglu_bwd(da: Any, g: Any, u: Any, *, block: int = 2048, num_warps: int = 8,
               lean: bool = True) -> tuple[Any, Any]:
    """``(dg, du)`` of ``silu(g) * u`` in one pass (reads da, g, u; writes dg, du;
    ``lean`` as in ``rms_norm_fwd``)."""
    rt = _launch.runtime() if lean else None
    if rt is None:
        return _swiglu_bwd_plain(da, g, u, block, num_warps)
    dev = rt.current_device()
    key = ("swiglu_bwd", type(da), da.shape, da.stride(), da.dtype, da.get_device(), type(g),
           g.shape, g.stride(), g.dtype, g.get_device(), type(u), u.shape, u.stride(),
           u.dtype, u.get_device(), dev, block, num_warps)
    p = _PLANS.get(key)
    if p is not None and p.fast is not None:
        out = p.fast(da, g, u)
        if out is not None:
            return out  # type: ignore[no-any-return]
    rec: list[LaunchRecord] | None = [] if p is None else None
    dg, du = _swiglu_bwd_plain(da, g, u, block, num_warps, rec)
    if rec:
        _learn(rt, dev, key, rec, (da, g, u, dg, du), _SWIGLU_BWD_ROOTS, {},
               (None, None, None, _template(dg), _template(du)), (3, 4))
    return dg, du


_SWIGLU_FWD_ROOTS = {"G": 0, "U": 1, "A": 2}
_SWIGLU_BWD_ROOTS = {"DA": 0, "G": 1, "U": 2, "DG": 3, "DU": 4}


# ------------------------------------------------------------------ lean-path plans


class _Plan:
    """What an op keeps at one signature: ``fast``, its whole lean call
    (``kareus.exec.kernels._launch.lean_op``), or ``None`` when it takes the plain
    path at that signature; and ``scratch``, the buffers it keeps per stream (RMSNorm
    backward's partial sums), if any."""

    __slots__ = ("fast", "scratch")

    def __init__(self, fast: Any, scratch: dict[int, Any] | None = None) -> None:
        self.fast = fast
        self.scratch = scratch


def _template(t: Any) -> Any:
    """A stand-in for ``t`` that ``torch.empty_like`` turns into a new contiguous tensor
    of ``t``'s shape, dtype and device: one element broadcast to the shape (an
    overlapping layout, which ``empty_like`` answers with a contiguous one). The lean
    path's outputs are made from these: ``empty_like`` of a tensor parses no shape, the
    cheapest allocation torch offers from Python."""
    return t.new_empty(1).expand(tuple(t.shape))


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_MAX_PLANS = 1024  # signatures kept; a job with more (varying shapes) starts over


def _learn(rt: _launch.LaunchRuntime, dev: int, key: tuple[Any, ...],
           rec: list[LaunchRecord], roots: tuple[Any, ...], root_of: dict[str, int],
           values: dict[str, Any], make: tuple[Any, ...],
           returns: int | tuple[int, ...]) -> None:
    """Keep the plan of ``key`` after a plain call that recorded ``rec``: its lean call
    (``make`` and ``returns`` as in ``kareus.exec.kernels._launch.lean_op``), or
    none where the fast path cannot take this signature (then later calls at it go
    straight to the plain path). A call with an unaligned tensor keeps nothing, so the
    next call at the signature tries again."""
    if any(t.data_ptr() % 16 for t in roots) or not rt.hooks_idle():
        return
    fast = None
    if all(type(t) in _TENSOR_TYPES and t.get_device() == dev for t in roots):
        try:
            fast = _launch.lean_op(rt, rec, roots, root_of, values, make, returns, dev,
                                   _empty_like)
        except Exception:  # never let the fast path's set-up fail an op
            fast = None
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    scratch = next((m.buffers for m in make if isinstance(m, _launch.Scratch)), None)
    _PLANS[key] = _Plan(fast, scratch)


def lean_status() -> dict[str, dict[str, int]]:
    """Per op (its plans' tag: ``"rms_norm_fwd"``, ``"rope_qkv"``, ...), how many
    signatures have a plan and how many of those launch lean (for reports and benches)."""
    out: dict[str, dict[str, int]] = {}
    for key, p in list(_PLANS.items()):
        s = out.setdefault(key[0], {"signatures": 0, "fast": 0})
        s["signatures"] += 1
        s["fast"] += p.fast is not None
    return out


def clear_plans() -> None:
    """Forget every signature's plan (and the scratch buffers they keep)."""
    _PLANS.clear()
