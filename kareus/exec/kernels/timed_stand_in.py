"""A kernel that stands in for a collective for as long as the collective would take.

On one GPU a TP or CP group is stood in for by loopback collectives
([`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective]): a kernel of the
collective's bytes that finishes in a fraction of the real collective's time, so a one-GPU
run has nothing to hide behind computation. [`timed_collective`][kareus.exec.kernels.timed_stand_in.timed_collective]
is the time-faithful variant: exactly ``ctas`` thread blocks (the collective's SM count:
one block per SM while SMs are free, as a capped collective's kernel takes them) each
move their share of the collective's bytes (the same data a loopback collective computes)
and then wait on the GPU's nanosecond ``%globaltimer`` (inline PTX) until ``duration_ns``
after they started. The kernel holds its blocks, and so its SMs, for the target time
while the computation beside it runs on the others: what overlap sees of a real
collective on those SMs, without the links.

What it computes (``kind``):

* ``"scale"``: ``dst[i] = src[i] * scale`` (the all-reduce of a group whose every rank
  holds ``src``: ``scale`` = the group size; ``dst`` may be ``src``);
* ``"repeat"``: ``dst[j] = src[j % m]`` for ``j < group * m`` (the all-gather);
* ``"sum_blocks"``: ``dst[i] = sum_k src[k * m + i]`` for ``i < m`` (the reduce-scatter:
  the adjoint of the all-gather);
* ``"cycle"``: ``dst[j] = src[j % m]`` for every ``j < dst.numel()``, any sizes (an
  all-to-all's stand-in: the received bytes written from the sent ones, as
  ``LoopbackCollective.all_to_all`` does without the timing).

If moving the bytes takes longer than ``duration_ns`` the kernel takes that long (it
never cuts the copy short). Each block's clock starts when the block starts: a block
placed late (every SM busy) ends late, as a real collective's would.

Importing this module imports triton and torch (only on a GPU path).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kareus.errors import ArgumentError

__all__ = ["KINDS", "timed_collective"]

#: What the kernel computes: name -> the kernel's constexpr code.
KINDS = {"scale": 0, "repeat": 1, "sum_blocks": 2, "cycle": 1}

# Elements per block per loop step and warps per block: 16 warps of 32 elements per thread
# keep four 16-byte loads in flight per thread (32 KiB per SM), so that the copy on a few
# SMs moves its bytes at a rate near a real collective's per-SM rate (~20-25 GB/s of bus
# bandwidth, up to 3x that of HBM traffic) and stays inside the time it stands in for.
_BLOCK = 16384
_NUM_WARPS = 16
_MAX_ELEMENTS = 2**31 - 1  # 32-bit offsets inside the kernel


@triton.jit
def _now_ns():
    # The GPU's global nanosecond timer (PTX %globaltimer).
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _timed_kernel(src, dst, m, total, group, scale, duration_ns,
                  KIND: tl.constexpr, BLOCK: tl.constexpr):
    t0 = _now_ns()
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    if KIND == 0:
        for off in range(pid * BLOCK, total, step):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < total
            x = tl.load(src + idx, mask=mask).to(tl.float32)
            tl.store(dst + idx, (x * scale).to(dst.dtype.element_ty), mask=mask)
    elif KIND == 1:
        for off in range(pid * BLOCK, total, step):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < total
            x = tl.load(src + idx % m, mask=mask)
            tl.store(dst + idx, x, mask=mask)
    else:
        for off in range(pid * BLOCK, m, step):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < m
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k in range(group):
                acc += tl.load(src + k * m + idx, mask=mask).to(tl.float32)
            tl.store(dst + idx, acc.to(dst.dtype.element_ty), mask=mask)
    deadline = t0 + duration_ns
    t = _now_ns()
    while t < deadline:
        t = _now_ns()


def timed_collective(kind: str, dst: Any, src: Any, *, group: int, ctas: int,
                     duration_ns: int, scale: float = 1.0) -> Any:
    """Launch the stand-in on the current CUDA stream; returns ``dst``.

    Args:
        kind: ``"scale"``, ``"repeat"``, ``"sum_blocks"`` or ``"cycle"`` (see the module).
        dst: Output (contiguous CUDA tensor): ``src``'s size for ``"scale"``,
            ``group`` times it for ``"repeat"``, a ``group``-th of it for ``"sum_blocks"``,
            any size for ``"cycle"`` (``src`` then not empty).
        src: Input (contiguous, same dtype and device).
        group: The group size stood in for.
        ctas: Thread blocks (the collective's SM count), >= 1.
        duration_ns: How long each block holds its SM, counted from its start (ns).
        scale: The factor of ``"scale"``.

    Raises:
        ArgumentError: an unknown kind, mismatched sizes, non-contiguous tensors, a
            tensor of 2^31 elements or more, ``ctas`` < 1 or a negative duration.
    """
    if kind not in KINDS:
        raise ArgumentError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    if ctas < 1 or duration_ns < 0 or group < 1:
        raise ArgumentError(f"ctas and group must be >= 1 and duration_ns >= 0, got {ctas}, "
                            f"{group}, {duration_ns}")
    if not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype:
        raise ArgumentError("the timed stand-in needs contiguous src and dst of one dtype")
    n_src, n_dst = int(src.numel()), int(dst.numel())
    want = {"scale": n_src, "repeat": n_src * group, "sum_blocks": n_src // group,
            "cycle": n_dst}[kind]
    if kind == "cycle" and n_src == 0 and n_dst:
        raise ArgumentError("cycle: src is empty but dst is not; zero dst instead")
    if n_dst != want or (kind == "sum_blocks" and n_src % group):
        raise ArgumentError(f"{kind}: dst has {n_dst} elements for src's {n_src} in a group "
                            f"of {group}; expected {want}")
    if max(n_src, n_dst) > _MAX_ELEMENTS:
        raise ArgumentError(f"the timed stand-in takes tensors under 2^31 elements, got "
                            f"{max(n_src, n_dst)}")
    m = n_dst if kind == "sum_blocks" else n_src
    with torch.cuda.device(src.device):
        _timed_kernel[(int(ctas),)](src, dst, m, n_dst, int(group), float(scale),
                                    int(duration_ns), KIND=KINDS[kind], BLOCK=_BLOCK,
                                    num_warps=_NUM_WARPS)
    return dst
