"""Every op of every runnable partition against its roofline, with its power, on one GPU.

For the three preset workloads at their default shapes (llama3.2-3b TP=4, qwen3-1.7b
TP=4 CP=2, llama3.3-70b TP=8; microbatch 8 x 4096 tokens in 2 nanobatches), every
partition type is built as a runnable partition with a kernel set
(:mod:`kareus.exec.kernels`, default: the fused one) and each op is timed alone.

* Ceilings, measured in the same run: the GEMM peak (best median bf16 ``torch.matmul``
  at 8192^3 and 16384^3, random data) and the HBM bandwidth (a 1 GiB device copy,
  bytes read plus written). Beside them, two figures that bound what the targets can
  ask: the launch floor (a one-element copy timed as the ops are: an op's fixed cost
  cannot go below it) and the attention ceiling (SDPA's cuDNN and flash backends at
  2 x 8192 tokens, 16 heads of 128, causal and not; each partition is also reported
  against the sum of its ops' rooflines with attention at the best causal throughput
  found there, ``ratio_attention_ceiling``).
* Per op: the median time (CUDA events, 30 runs after warm-up, the L2 cache flushed
  before each run so every op reads HBM, as its roofline assumes); the roofline
  ``max(FLOPs / peak, bytes / bandwidth)`` with the op's FLOPs and bytes from the
  partition model (kareus.model.partition); their ratio; the kernel; the average power
  (NVML's energy counter over at least ``--power-s`` seconds of that op alone, replayed
  from a CUDA graph where it captures, else launched in a loop; no setting is changed).
  GEMMs also get the best ``torch.matmul`` time at their (m, k, n) over the four operand
  layouts, and their time over it as the median of 7 rounds timing the two one after
  the other (``vs_best_matmul``; ``vs_best_matmul_separate`` divides the two medians).
* Per partition: its ops run back to back (``PartitionProgram.run_plain``, no
  collective), against the sum of its ops' rooflines.
* Order: per preset, every op and partition is timed (after 5 s idle) before any power
  loop runs: a loop holds the GPU at its power limit, and what is timed right after one
  runs at a lower clock. The SM clock read after each timing is kept
  (``sm_clock_mhz_after_timing``).
* ``--candidates reference,torch``: the elementwise and attention ops and the partitions
  again with those kernel sets (``reference`` = the eager formulas the partitions ran
  before the fused kernels). ``--tune``: launch settings of kareus's Triton kernels and
  single SDPA backends at the presets' shapes. ``--check``: each fused op against a
  float64 evaluation of the formula at the presets' shapes. ``--workloads qwen3-30b-a3b``:
  the mixture-of-experts preset at EP=8 (DP=8), its router, top-k, permutation, sort by
  local expert, grouped expert GEMMs and un-permutation with their backward; a grouped
  GEMM has no single ``torch.matmul`` to compare with (``peak_frac`` only; its two paths
  side by side: ``bench/moe_gemm.py``). Not in the default list.

Targets (printed last): every elementwise op <= 1.5x its roofline; every GEMM >= 75% of
the measured peak or within 5% of the best ``torch.matmul`` at its shape; each
partition's compute <= 1.2x the sum of its ops' rooflines.

Usage (one GPU; clocks, power limits and modes are never changed)::

    python bench/op_roofline.py --json bench/results/op_roofline_h200.json \\
        --candidates reference,torch --check
    bash bench/run_op_roofline.sh --check --candidates reference,torch  # + GPU tests

and, on any machine, the measured table kareus keeps under data/ from such a result::

    python bench/op_roofline.py --data-from bench/results/op_roofline_h200.json \\
        --json data/h200_op_roofline.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from kareus.profilers.calibrate import TorchCalibrationDevice

WORKLOADS: dict[str, dict[str, int]] = {
    "llama3.2-3b": {"tp": 4},
    "qwen3-1.7b": {"tp": 4, "cp": 2},
    "llama3.3-70b": {"tp": 8},
    "qwen3-30b-a3b": {"ep": 8, "dp": 8},
}
#: ``--workloads`` by default: the dense presets (the MoE one on request)
DEFAULT_WORKLOADS = ("llama3.2-3b", "qwen3-1.7b", "llama3.3-70b")
BATCH = {"microbatch_size": 8, "seq_len": 4096, "nanobatches": 2}

FAMILY = {"attn_norm": "rms_norm", "mlp_norm": "rms_norm", "attn_norm_bwd": "rms_norm_bwd",
          "mlp_norm_bwd": "rms_norm_bwd", "rope": "rope", "rope_bwd": "rope_bwd",
          "qk_norm_rope": "qk_norm_rope", "qk_norm_rope_bwd": "qk_norm_rope_bwd",
          "swiglu": "swiglu", "swiglu_bwd": "swiglu_bwd", "attn_core": "attention",
          "attn_core_bwd": "attention",
          # a mixture of experts' ops: the kernel set's MoE ops (KernelSet.kernel_names)
          "router_topk": "router_topk", "router_topk_bwd": "router_topk_bwd",
          "permute": "permute", "permute_bwd": "permute_bwd",
          "expert_sort": "expert_sort", "expert_unsort": "expert_unsort",
          "expert_sort_bwd": "expert_unsort", "expert_unsort_bwd": "expert_sort",
          "expert_gate_up": "grouped_mm", "expert_down": "grouped_mm",
          "expert_down_dgrad": "grouped_mm", "expert_gate_up_dgrad": "grouped_mm",
          "expert_down_wgrad": "grouped_mm_wgrad", "expert_gate_up_wgrad": "grouped_mm_wgrad",
          "expert_swiglu": "expert_swiglu", "expert_swiglu_bwd": "expert_swiglu_bwd",
          "unpermute": "unpermute", "unpermute_bwd": "unpermute_bwd",
          "shared_swiglu": "swiglu", "shared_swiglu_bwd": "swiglu_bwd"}

TARGET_ELEMENTWISE = 1.5
TARGET_GEMM_PEAK = 0.75
TARGET_GEMM_BEST = 1.05
TARGET_PARTITION = 1.2
COOL_S = 5.0  # idle seconds before each preset's timings (after the power loops before)


def gemm_mkn(name: str, d: Any) -> tuple[int, int, int]:
    """(m, k, n) of a partition GEMM (kareus.model.partition's shapes)."""
    t, h, q, kv, f = d.t, d.h, d.q, d.kv, d.f
    qkv = q + 2 * kv
    return {
        "qkv": (t, h, qkv), "out_proj": (t, q, h), "gate": (t, h, f), "up": (t, h, f),
        "down": (t, f, h), "down_dgrad": (t, h, f), "down_wgrad": (f, t, h),
        "gate_dgrad": (t, f, h), "up_dgrad": (t, f, h), "gate_wgrad": (h, t, f),
        "up_wgrad": (h, t, f), "out_dgrad": (t, h, q), "out_wgrad": (q, t, h),
        "qkv_dgrad": (t, qkv, h), "qkv_wgrad": (h, t, qkv),
    }[name]


#: The GEMMs ``gemm_mkn`` knows (a mixture of experts' router and grouped GEMMs are not
#: single ``torch.matmul`` calls).
_DENSE_GEMMS = frozenset({"qkv", "out_proj", "gate", "up", "down", "down_dgrad", "down_wgrad",
                          "gate_dgrad", "up_dgrad", "gate_wgrad", "up_wgrad", "out_dgrad",
                          "out_wgrad", "qkv_dgrad", "qkv_wgrad"})


class Bench(TorchCalibrationDevice):
    """The library's one-GPU measuring device (kareus.profilers.calibrate, which ``kareus
    calibrate`` uses) with this bench's units: milliseconds and row dicts."""

    def __init__(self, torch: Any, reps: int, power_s: float) -> None:
        super().__init__(reps=reps, power_s=power_s)

    def time_ms(self, fn: Any, *, flush: bool = True, reps: int | None = None) -> float:
        """Median GPU time of ``fn`` (ms), each run after an L2 flush."""
        return self.time_s(fn, flush=flush, reps=reps) * 1e3

    def energy_j(self) -> float:
        return self._energy_j()

    def power(self, fn: Any, est_ms: float, *, graph: bool = True) -> dict[str, Any]:  # type: ignore[override]
        """Average power of ``fn`` run alone for >= power_s seconds."""
        m = TorchCalibrationDevice.power(self, fn, est_ms * 1e-3, graph=graph)
        return {"power_w": m.power_w, "power_busy_frac": m.busy_fraction,
                "sm_clock_mhz": m.freq_mhz}


def ceilings(b: Bench) -> dict[str, float]:
    peak, bw_gbps = b.ceilings()
    return {"gemm_peak_tflops": peak, "hbm_tb_s": bw_gbps / 1e3}


def best_matmul(b: Bench, m: int, k: int, n: int, cache: dict) -> tuple[float, str, Any]:
    """(time ms, layout, a callable running it) of the fastest ``torch.matmul`` at
    (m, k, n) over the four operand layouts."""
    if (m, k, n) in cache:
        return cache[(m, k, n)]
    torch = b.torch
    res = []
    for la in ("n", "t"):
        for lb in ("n", "t"):
            a = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) if la == "n"
                 else torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t())
            w = (torch.randn(k, n, device="cuda", dtype=torch.bfloat16) if lb == "n"
                 else torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t())

            def run(a: Any = a, w: Any = w) -> Any:
                return torch.matmul(a, w)
            res.append((b.time_ms(run), la + lb, run))
    best = min(res, key=lambda x: x[0])
    cache[(m, k, n)] = best
    return best


def interleaved_ratio(b: Bench, fn: Any, ref: Any, rounds: int = 7) -> float:
    """Median over ``rounds`` of (time of ``fn``) / (time of ``ref``), the two timed one
    after the other in each round, so that a clock or temperature drift during the run
    moves both."""
    import statistics

    reps = max(5, b.reps // 3)
    return statistics.median(b.time_ms(fn, reps=reps) / b.time_ms(ref, reps=reps)
                             for _ in range(rounds))


def kind_of(op: Any) -> str:
    k = op.kind.value if hasattr(op.kind, "value") else str(op.kind)
    return {"gemm": "gemm", "attention": "attention"}.get(k, "elementwise")


def measure_workload(b: Bench, wl_name: str, ks: Any, ceil: dict[str, float], *,
                     full: bool, gemm_cache: dict) -> tuple[list[dict], list[dict]]:
    """Every op and partition of one preset: all timings first, then (``full``) the power
    loops. A power loop holds the GPU at its power limit for a second or more, and an op
    timed right after one ran at a lower clock; the rooflines (and the emulator that
    reads these times) take the ops at the GPU's clock of short bursts."""
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.workload import Workload

    torch = b.torch
    wl = Workload.preset(wl_name, **WORKLOADS[wl_name], **BATCH)
    parts = runnable_partitions(wl, kernels=ks)
    peak, bw = ceil["gemm_peak_tflops"] * 1e12, ceil["hbm_tb_s"] * 1e12
    names = ks.kernel_names()
    seen: dict[str, dict] = {}
    rows, prows = [], []
    time.sleep(COOL_S)  # after the previous stage's power loops
    for pname, part in parts.items():
        prog = part.build(seed=0)
        roof_sum = roof_att_sum = 0.0
        for op, fn in zip(part.compute_ops, prog.ops):
            kind = kind_of(op)
            roof = max(op.flops / peak, op.bytes_moved / bw) * 1e3
            roof_sum += roof
            att = ceil.get("attention_bwd_tflops" if op.name.endswith("_bwd")
                           else "attention_fwd_tflops") if kind == "attention" else None
            roof_att_sum += (max(op.flops / (att * 1e12), op.bytes_moved / bw) * 1e3 if att
                             else roof)
            if not full and kind == "gemm":
                continue
            if op.name not in seen:
                ms = b.time_ms(fn)
                clock = b._clock()
                fam = FAMILY.get(op.name, "matmul")
                kernel = names.get(fam, fam)
                if fam == "attention":
                    st = prog.state
                    kernel = f"sdpa {ks.attention_backend(st['q'], st['k'], st['v'])}"
                r = {"workload": wl_name, "op": op.name, "kind": kind, "measured_ms": ms,
                     "roofline_ms": roof, "ratio": ms / roof, "kernel": kernel,
                     "flops": op.flops, "bytes": op.bytes_moved, "measured_in": pname,
                     "sm_clock_mhz_after_timing": clock}
                if kind == "gemm" and op.name not in _DENSE_GEMMS:  # grouped, router
                    r["peak_frac"] = op.flops / peak / (ms * 1e-3)
                elif kind == "gemm":
                    m, k, n = gemm_mkn(op.name, part.dims)
                    assert abs(2 * m * k * n - op.flops) < 1e-6 * op.flops, op.name
                    best, layout, best_fn = best_matmul(b, m, k, n, gemm_cache)
                    r.update({"mkn": [m, k, n], "best_matmul_ms": best,
                              "best_matmul_layout": layout,
                              "vs_best_matmul": interleaved_ratio(b, fn, best_fn),
                              "vs_best_matmul_separate": ms / best,
                              "peak_frac": op.flops / peak / (ms * 1e-3)})
                seen[op.name] = r
            rows.append({**seen[op.name], "partition": pname})
        comp = b.time_ms(prog.run_plain)
        prows.append({"workload": wl_name, "partition": pname, "compute_ms": comp,
                      "roofline_sum_ms": roof_sum, "ratio": comp / roof_sum,
                      # the attention ops at the attention ceiling instead of the GEMM peak
                      "roofline_sum_attention_ceiling_ms": roof_att_sum,
                      "ratio_attention_ceiling": comp / roof_att_sum,
                      "ops": list(prog.op_names), "sm_clock_mhz_after_timing": b._clock()})
        del prog
        torch.cuda.empty_cache()
    if full:  # the power loops, each op once, after every timing of this preset
        powered: set[str] = set()
        for part in parts.values():
            prog = part.build(seed=0)
            for op, fn in zip(part.compute_ops, prog.ops):
                if op.name in seen and op.name not in powered:
                    r = seen[op.name]
                    r.update(b.power(fn, r["measured_ms"], graph=r["kind"] != "attention"))
                    powered.add(op.name)
            del prog
            torch.cuda.empty_cache()
        rows = [{**seen[r["op"]], "partition": r["partition"]} for r in rows]
    return rows, prows


def check_workload(torch: Any, wl_name: str, ks: Any) -> list[dict]:
    """Fused ops vs a float64 evaluation of the reference formulas at preset shapes."""
    from kareus.exec.kernels import ReferenceKernels
    from kareus.exec.torch_partition import _dims
    from kareus.model.workload import Workload

    ref = ReferenceKernels()
    d = _dims(Workload.preset(wl_name, **WORKLOADS[wl_name], **BATCH))
    g = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape: int, scale: float = 1.0) -> Any:
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    def rel(a: Any, r: Any) -> float:
        return float((a.double() - r.double()).norm() / r.double().norm())

    out = []
    x, dy, w = rnd(d.t, d.h), rnd(d.t, d.h), 1 + rnd(d.h, scale=0.1)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    y.backward(dy.double())
    dx, dw = ks.rms_norm_bwd(dy, x, w)
    out += [("rms_norm", rel(ks.rms_norm(x, w), y.detach())), ("rms_norm_bwd.dx", rel(dx, xd.grad)),
            ("rms_norm_bwd.dw", rel(dw, wd.grad) if dw is not None else float("nan"))]
    qkv = rnd(d.t, d.q + 2 * d.kv)
    ang = torch.outer(torch.arange(d.sq, device="cuda", dtype=torch.float64),
                      1.0 / 500000.0 ** (torch.arange(0, d.hd, 2, device="cuda",
                                                      dtype=torch.float64) / d.hd))
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    q, k = ks.rope(qkv, cos, sin, heads=d.heads, kv_heads=d.kvh)
    qr, kr = ref.rope(qkv.double(), cos.double(), sin.double(), heads=d.heads, kv_heads=d.kvh)
    out += [("rope.q", rel(q, qr)), ("rope.k", rel(k, kr))]
    dq, dk, dv = (rnd(d.b, d.sq, n, d.hd) for n in (d.heads, d.kvh, d.kvh))
    out.append(("rope_bwd", rel(ks.rope_bwd(dq, dk, dv, cos, sin),
                                ref.rope_bwd(dq.double(), dk.double(), dv.double(),
                                             cos.double(), sin.double()))))
    gg, uu, da = rnd(d.t, d.f), rnd(d.t, d.f), rnd(d.t, d.f)
    out.append(("swiglu", rel(ks.swiglu(gg, uu), ref.swiglu(gg.double(), uu.double()))))
    dg, du = ks.swiglu_bwd(da, gg, uu)
    rg, ru = ref.swiglu_bwd(da.double(), gg.double(), uu.double())
    out += [("swiglu_bwd.dg", rel(dg, rg)), ("swiglu_bwd.du", rel(du, ru))]
    return [{"workload": wl_name, "op": n, "rel_err": e, "ok": bool(e < 1e-2)} for n, e in out]


def tune(b: Bench, wl_name: str) -> list[dict]:
    """Launch settings of kareus's Triton kernels and single SDPA backends."""
    from kareus.exec.kernels import _triton as kt
    from kareus.exec.kernels.base import _sdpa
    from kareus.exec.torch_partition import _dims
    from kareus.model.workload import Workload

    torch = b.torch
    d = _dims(Workload.preset(wl_name, **WORKLOADS[wl_name], **BATCH))
    bf = torch.bfloat16
    x, dy = (torch.randn(d.t, d.h, device="cuda", dtype=bf) for _ in range(2))
    w = torch.ones(d.h, device="cuda", dtype=bf)
    res = []
    # Programs per SM up to 32 (one program per row block at the smaller widths: no
    # persistence): more blocks in flight per SM for the small shapes.
    for pf in (True, False):
        for pps in (1, 2, 4, 8, 32):
            for rows in (1, 2, 4, 8):
                for nw in (4, 8, 16):
                    if rows * d.h > 16384 or (not pf and (nw != 8 or pps > 2)):
                        continue
                    ms = b.time_ms(lambda: kt.rms_norm_bwd(  # called at once
                        dy, x, w, 1e-5, rows=rows, programs_per_sm=pps,  # noqa: B023
                        num_warps=nw, prefetch=pf))  # noqa: B023
                    res.append({"workload": wl_name, "op": "rms_norm_bwd", "ms": ms,
                                "setting": f"prefetch={pf} pps={pps} rows={rows} warps={nw}"})
    # The dw partials' sum (a second launch, N / sum_block_n programs): the whole op at
    # the default settings with other shapes of the sum.
    for sbn, sbp in ((64, 32), (32, 32), (16, 64), (128, 16), (8, 64), (16, 128), (8, 128)):
        ms = b.time_ms(lambda: kt.rms_norm_bwd(dy, x, w, 1e-5, sum_block_n=sbn,  # noqa: B023
                                               sum_block_p=sbp))  # noqa: B023 - called at once
        res.append({"workload": wl_name, "op": "rms_norm_bwd", "ms": ms,
                    "setting": f"default sum_block_n={sbn} sum_block_p={sbp}"})
    for rows in (None, 1, 2):
        ms = b.time_ms(lambda: kt.rms_norm_fwd(x, w, 1e-5, rows=rows))  # noqa: B023 - called at once
        res.append({"workload": wl_name, "op": "rms_norm", "setting": f"rows={rows}",
                    "ms": ms})
    # Weight gradients computed as (in^T @ dout) and as (dout^T @ in)^T: same values.
    for m_, k_, n_ in ((d.q, d.t, d.h), (d.h, d.t, d.f), (d.f, d.t, d.h),
                       (d.h, d.t, d.q + 2 * d.kv)):
        a_in = torch.randn(k_, m_, device="cuda", dtype=bf)
        a_out = torch.randn(k_, n_, device="cuda", dtype=bf)
        ms1 = b.time_ms(lambda: torch.matmul(a_in.t(), a_out))  # noqa: B023 - called at once
        ms2 = b.time_ms(lambda: torch.matmul(a_out.t(), a_in))  # noqa: B023 - called at once
        res.append({"workload": wl_name, "op": "wgrad", "setting": f"{m_}x{k_}x{n_} in^T@dout",
                    "ms": ms1})
        res.append({"workload": wl_name, "op": "wgrad", "setting": f"{m_}x{k_}x{n_} dout^T@in",
                    "ms": ms2})
    g, u, da = (torch.randn(d.t, d.f, device="cuda", dtype=bf) for _ in range(3))
    for blk, nw in ((1024, 4), (2048, 8), (4096, 8)):
        ms = b.time_ms(lambda: kt.swiglu_bwd(da, g, u, block=blk, num_warps=nw))  # noqa: B023 - called at once
        res.append({"workload": wl_name, "op": "swiglu_bwd", "setting": f"block={blk} warps={nw}",
                    "ms": ms})
        ms = b.time_ms(lambda: kt.swiglu_fwd(g, u, block=blk, num_warps=nw))  # noqa: B023 - called at once
        res.append({"workload": wl_name, "op": "swiglu", "setting": f"block={blk} warps={nw}",
                    "ms": ms})
    qkv = torch.randn(d.t, d.q + 2 * d.kv, device="cuda", dtype=bf)
    v4 = qkv.view(d.b, d.sq, d.heads + 2 * d.kvh, d.hd)
    qv, kv_ = v4[:, :, :d.heads], v4[:, :, d.heads:d.heads + d.kvh]
    cos = torch.randn(d.sq, d.hd, device="cuda", dtype=bf)
    dq = torch.randn(d.b, d.heads, d.sq, d.hd, device="cuda", dtype=bf).transpose(1, 2)
    dk, dv = (torch.randn(d.b, d.kvh, d.sq, d.hd, device="cuda", dtype=bf).transpose(1, 2)
              for _ in range(2))
    # The row grid (the default) and the 3-D grid candidate, forward and backward.
    for grid in kt.ROPE_GRIDS:
        for br, nw in ((8, 4), (16, 4), (32, 4), (64, 8)):
            ms = b.time_ms(lambda: kt.rope_fwd(qv, kv_, cos, cos, block_r=br,  # noqa: B023
                                               num_warps=nw, grid=grid))  # noqa: B023
            res.append({"workload": wl_name, "op": "rope", "ms": ms,
                        "setting": f"grid={grid} block_r={br} warps={nw}"})
            ms = b.time_ms(lambda: kt.rope_bwd(dq, dk, dv, cos, cos,
                                               block_r=br, num_warps=nw,  # noqa: B023
                                               grid=grid))  # noqa: B023 - called at once
            res.append({"workload": wl_name, "op": "rope_bwd", "ms": ms,
                        "setting": f"grid={grid} block_r={br} warps={nw}"})
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(d.b, d.sq, d.heads, d.hd, device="cuda", dtype=bf).transpose(1, 2)
    k = v4[:, :, d.heads:d.heads + d.kvh].transpose(1, 2)
    v = v4[:, :, d.heads + d.kvh:].transpose(1, 2)
    rep = d.heads // d.kvh

    def expanded(q: Any, k: Any, v: Any) -> Any:  # K/V copied to every query head (MHA)
        return _sdpa(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
    # Each backend on the partitions' layout (q, k, v strided views of [b, s, heads, hd]);
    # cuDNN also on contiguous [b, heads, s, hd] copies and with K/V expanded to every
    # query head inside the timed op (the copy and, backward, the sum over the group).
    variants = [(be, "", _sdpa, (q, k, v)) for be in
                ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")]
    variants += [("CUDNN_ATTENTION", " bhsd", _sdpa,
                  tuple(t.contiguous() for t in (q, k, v))),
                 ("CUDNN_ATTENTION", " kv-expanded", expanded, (q, k, v))]
    for be, tag, fn, (q_, k_, v_) in variants:
        try:
            with sdpa_kernel([getattr(SDPBackend, be)]):
                fwd = b.time_ms(lambda: fn(q_, k_, v_))  # noqa: B023 - called at once
                qq, kk, vv = (t.detach().requires_grad_() for t in (q_, k_, v_))
                with torch.enable_grad():
                    o = fn(qq, kk, vv)
                do = torch.randn_like(o)
                bwd = b.time_ms(lambda: torch.autograd.grad(o, (qq, kk, vv), do,  # noqa: B023 - called at once
                                                            retain_graph=True))
            res.append({"workload": wl_name, "op": "attn_core", "setting": be + tag, "ms": fwd})
            res.append({"workload": wl_name, "op": "attn_core_bwd", "setting": be + tag,
                        "ms": bwd})
        except Exception as exc:  # a backend may refuse the shape
            res.append({"workload": wl_name, "op": "attention", "setting": be + tag,
                        "error": str(exc).splitlines()[0][:200]})
    torch.cuda.empty_cache()
    return res


def launch_floor(b: Bench) -> dict[str, float]:
    """The shortest op this method can time: one and two one-element copies (one and two
    kernels, nothing to move), timed as the ops are (after an L2 flush). An op's fixed
    cost over its roofline cannot drop below this."""
    torch = b.torch
    src, dst = torch.ones(1, device="cuda"), torch.empty(1, device="cuda")

    def two() -> None:
        dst.copy_(src)
        dst.copy_(src)
    return {"one_kernel_ms": b.time_ms(lambda: dst.copy_(src)), "two_kernels_ms": b.time_ms(two)}


def attention_ceiling(b: Bench) -> list[dict]:
    """What SDPA's backends reach at one large shape (2 x 8192 tokens, 16 heads of 128,
    causal and not): the attention throughput this GPU and torch can give, beside the
    GEMM peak the rooflines use. Also lists any registered flash-attention implementation
    (``torch.nn.attention.list_flash_attention_impls``, PyTorch >= 2.9)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch = b.torch
    res: list[dict] = []
    try:
        from torch.nn.attention import list_flash_attention_impls
        res.append({"op": "flash_attention_impls",
                    "impls": [str(i) for i in list_flash_attention_impls()]})
    except Exception as exc:  # older PyTorch
        res.append({"op": "flash_attention_impls", "error": str(exc)[:200]})
    bsz, s, h, hd = 2, 8192, 16, 128
    q, k, v = (torch.randn(bsz, h, s, hd, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for causal in (True, False):
        flops = 4.0 * bsz * h * s * s * hd * (0.5 if causal else 1.0)
        for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            try:
                with sdpa_kernel([getattr(SDPBackend, be)]):
                    sdpa = torch.nn.functional.scaled_dot_product_attention
                    fwd = b.time_ms(lambda: sdpa(q, k, v, is_causal=causal),  # noqa: B023
                                    flush=False)
                    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                    with torch.enable_grad():
                        o = sdpa(qq, kk, vv, is_causal=causal)
                    do = torch.randn_like(o)
                    bwd = b.time_ms(lambda: torch.autograd.grad(
                        o, (qq, kk, vv), do, retain_graph=True), flush=False)  # noqa: B023
                res.append({"op": "attention_ceiling", "backend": be, "causal": causal,
                            "shape": [bsz, h, s, hd], "fwd_ms": fwd, "bwd_ms": bwd,
                            "fwd_tflops": flops / fwd / 1e9,
                            "bwd_tflops": 2.5 * flops / bwd / 1e9})
            except Exception as exc:  # a backend may refuse the shape
                res.append({"op": "attention_ceiling", "backend": be, "causal": causal,
                            "error": str(exc).splitlines()[0][:200]})
    torch.cuda.empty_cache()
    return res


#: The launch settings the library uses today, as ``tune`` labels them.
TUNE_DEFAULTS = {"rms_norm": "rows=None",
                 "rms_norm_bwd": "default sum_block_n=16 sum_block_p=64",
                 "rope": "grid=heads block_r=16 warps=4",
                 "rope_bwd": "grid=heads block_r=16 warps=4",
                 "swiglu": "block=2048 warps=8", "swiglu_bwd": "block=2048 warps=8",
                 "attn_core": "CUDNN_ATTENTION", "attn_core_bwd": "CUDNN_ATTENTION"}


def tune_summary(rows: list[dict]) -> list[dict]:
    """Per workload and op of ``tune``'s rows: the library's setting, the fastest one,
    and the default's time over the fastest's (one run decides a default)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["op"] in TUNE_DEFAULTS and "ms" in r:
            groups.setdefault((r["workload"], r["op"]), []).append(r)
    out = []
    for (wl, op), rs in groups.items():
        best = min(rs, key=lambda r: r["ms"])
        default = next((r for r in rs if r["setting"] == TUNE_DEFAULTS[op]), None)
        out.append({"workload": wl, "op": op, "best": best["setting"],
                    "best_ms": best["ms"], "default_ms": default["ms"] if default else None,
                    "default_over_best": default["ms"] / best["ms"] if default else None})
    return out


def machine(torch: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                            "cuda": torch.version.cuda,
                            "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    from kareus.exec.kernels.triton_ops import liger_version

    info["liger_kernel"] = liger_version()
    try:
        import pynvml

        from kareus.profilers.nvml import nvml_device_index

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(nvml_device_index())  # by UUID
        drv = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        info["power_limit_w"] = pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3
        info["sm_clock_mhz_at_start"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        info["max_sm_clock_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
    except Exception as exc:
        info["driver"] = f"unavailable ({exc})"
    return info


def targets(rows: list[dict], prows: list[dict]) -> dict[str, Any]:
    uniq = {(r["workload"], r["op"]): r for r in rows}.values()
    elem = [r for r in uniq if r["kind"] == "elementwise"]
    gemm = [r for r in uniq if r["kind"] == "gemm"]
    miss_e = [f"{r['workload']}/{r['op']} {r['ratio']:.2f}x" for r in elem
              if r["ratio"] > TARGET_ELEMENTWISE]
    # a grouped or router GEMM has no single matmul to be within 5% of: the peak alone
    miss_g = [f"{r['workload']}/{r['op']} {r['peak_frac']:.0%} of peak, "
              + (f"{r['vs_best_matmul']:.2f}x best" if "vs_best_matmul" in r
                 else "no single matmul") for r in gemm
              if r["peak_frac"] < TARGET_GEMM_PEAK
              and r.get("vs_best_matmul", float("inf")) > TARGET_GEMM_BEST]
    miss_p = [f"{p['workload']}/{p['partition']} {p['ratio']:.2f}x" for p in prows
              if p["ratio"] > TARGET_PARTITION]
    return {"elementwise_le_1.5x": {"met": not miss_e, "checked": len(elem), "missed": miss_e},
            "gemm_ge_75pct_peak_or_within_5pct_best": {"met": not miss_g, "checked": len(gemm),
                                                       "missed": miss_g},
            "partition_le_1.2x": {"met": not miss_p, "checked": len(prows), "missed": miss_p}}


DATA_ROW_KEYS = ("kind", "measured_ms", "roofline_ms", "ratio", "kernel", "power_w",
                 "flops", "bytes")


def data_table(res: dict[str, Any], source: str) -> dict[str, Any]:
    """The compact measured table kept under data/: one row per (workload, op), the
    partitions, the ceilings and the machine."""
    rows = {}
    for r in res["rows"]:
        key = (r["workload"], r["op"])
        if key not in rows:
            rows[key] = {"workload": r["workload"], "op": r["op"], "partitions": [],
                         **{k: r.get(k) for k in DATA_ROW_KEYS}}
            if r["kind"] == "gemm":
                rows[key].update({k: r[k] for k in ("mkn", "best_matmul_ms", "peak_frac",
                                                    "vs_best_matmul") if k in r})
        rows[key]["partitions"].append(r["partition"])
    m = res["machine"]
    return {
        "description": "Per-op time, roofline and average power of the runnable partitions' "
                       "kernels on 1x H200 (measured, default clocks; see docs/kernels.md).",
        "source": source, "command": res["command"],
        "gpu": m["gpu"], "driver": m["driver"], "torch": m["torch"], "cuda": m["cuda"],
        "triton": m.get("triton"), "liger_kernel": m.get("liger_kernel"),
        "power_limit_w": m.get("power_limit_w"), "measured_utc": m["date"],
        "kernels": res["kernels"], "batch": res["batch"], "workloads": res["workloads"],
        "gemm_peak_tflops": res["ceilings"]["gemm_peak_tflops"],
        "hbm_tb_s": res["ceilings"]["hbm_tb_s"], "idle_power_w": res.get("idle_power_w"),
        **{k: res["ceilings"][k] for k in ("attention_fwd_tflops", "attention_bwd_tflops")
           if k in res["ceilings"]},
        **({"launch_floor_ms": res["launch_floor"]["one_kernel_ms"]}
           if "launch_floor" in res else {}),
        "rows": list(rows.values()),
        "partitions": [{k: p[k] for k in ("workload", "partition", "compute_ms",
                                          "roofline_sum_ms", "ratio", "ratio_attention_ceiling")
                        if k in p}
                       for p in res["partitions"]],
    }


def measure_floors(b: Bench, ceil: dict[str, float], out: dict[str, Any]) -> None:
    """The launch floor and the attention ceiling (into ``out``); the best causal
    attention throughput, forward and backward, into ``ceil``."""
    out["launch_floor"] = launch_floor(b)
    print(f"launch floor: one kernel {out['launch_floor']['one_kernel_ms'] * 1e3:.1f} us, "
          f"two kernels {out['launch_floor']['two_kernels_ms'] * 1e3:.1f} us", flush=True)
    out["attention_ceiling"] = attention_ceiling(b)
    for r in out["attention_ceiling"]:
        if "fwd_tflops" in r:
            print(f"attention {r['backend']:16s} causal={r['causal']!s:5s} "
                  f"fwd {r['fwd_tflops']:4.0f} TFLOP/s bwd {r['bwd_tflops']:4.0f} TFLOP/s "
                  f"({r['fwd_tflops'] / ceil['gemm_peak_tflops']:.2f} / "
                  f"{r['bwd_tflops'] / ceil['gemm_peak_tflops']:.2f} of the GEMM peak)",
                  flush=True)
        elif r["op"] == "attention_ceiling":
            print(f"attention {r['backend']} causal={r['causal']}: {r['error']}")
    causal = [r for r in out["attention_ceiling"] if r.get("causal") and "fwd_tflops" in r]
    if causal:
        ceil["attention_fwd_tflops"] = max(r["fwd_tflops"] for r in causal)
        ceil["attention_bwd_tflops"] = max(r["bwd_tflops"] for r in causal)


def run_tune(b: Bench, wls: list[str], ceil: dict[str, float], out: dict[str, Any]) -> None:
    """The ``--tune`` stage: launch settings and their summary."""
    t0 = time.time()
    out["tune"] = [r for w in wls for r in tune(b, w)]
    out["tune_summary"] = tune_summary(out["tune"])
    print(f"tune done ({time.time() - t0:.0f} s)", flush=True)
    print(f"{'workload':14s} {'op':14s} {'default ms':>10s} {'best ms':>8s} "
          f"{'ratio':>6s}  best setting")
    for r in out["tune_summary"]:
        dm = f"{r['default_ms']:.4f}" if r["default_ms"] else "-"
        ratio = f"{r['default_over_best']:.3f}" if r["default_over_best"] else "-"
        print(f"{r['workload']:14s} {r['op']:14s} {dm:>10s} {r['best_ms']:8.4f} "
              f"{ratio:>6s}  {r['best']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--data-from", default=None,
                    help="write the data/ table from this result JSON to --json (no GPU)")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--kernels", default="auto", help="kernel set of the main table")
    ap.add_argument("--candidates", default="", help="other kernel sets, comma-separated")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--power-s", type=float, default=1.0)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--tune-only", action="store_true",
                    help="with --tune: stop after the tune (no main table)")
    args = ap.parse_args(argv)
    if args.data_from:
        res = json.loads(Path(args.data_from).read_text())
        Path(args.json).write_text(json.dumps(data_table(res, args.data_from), indent=1) + "\n")
        return 0

    import torch

    from kareus.exec.kernels import get_kernels

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    b = Bench(torch, args.reps, args.power_s)
    ks = get_kernels(None if args.kernels == "auto" else args.kernels)
    wls = [w for w in args.workloads.split(",") if w]
    out: dict[str, Any] = {"command": "python bench/op_roofline.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": machine(torch),
        "kernels": ks.name, "kernel_names": ks.kernel_names(), "batch": BATCH,
        "workloads": {w: WORKLOADS[w] for w in wls}}
    t0 = time.time()

    def save() -> None:  # after every stage, so a run cut short keeps what it measured
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    if args.check:
        out["checks"] = [c for w in wls for c in check_workload(torch, w, ks)]
        bad = [c for c in out["checks"] if not c["ok"]]
        print(f"checks: {len(out['checks']) - len(bad)}/{len(out['checks'])} within 1e-2"
              + (f"; FAILED {bad}" if bad else ""), flush=True)
    ceil = ceilings(b)
    out["ceilings"] = ceil
    print(f"ceilings: {ceil['gemm_peak_tflops']:.0f} TFLOP/s bf16, "
          f"{ceil['hbm_tb_s']:.2f} TB/s ({time.time() - t0:.0f} s)", flush=True)
    if b.nvml is not None:
        time.sleep(0.5)
        e0, t1 = b.energy_j(), time.perf_counter()
        time.sleep(1.0)
        out["idle_power_w"] = (b.energy_j() - e0) / (time.perf_counter() - t1)
    measure_floors(b, ceil, out)
    save()
    if args.tune:
        run_tune(b, wls, ceil, out)
        save()
        if args.tune_only:
            return 0
    rows, prows, cache = [], [], {}
    for w in wls:
        r, p = measure_workload(b, w, ks, ceil, full=True, gemm_cache=cache)
        rows += r
        prows += p
        print(f"{w} measured ({time.time() - t0:.0f} s)", flush=True)
        out["rows"], out["partitions"] = rows, prows
        save()
    out["rows"], out["partitions"] = rows, prows
    out["candidates"] = []
    for name in [c for c in args.candidates.split(",") if c]:
        cks = get_kernels(name)
        for w in wls:
            r, p = measure_workload(b, w, cks, ceil, full=False, gemm_cache=cache)
            uniq = {x["op"]: x for x in r}.values()
            out["candidates"] += [{"kernels": name, **{k: x[k] for k in (
                "workload", "op", "kind", "measured_ms", "roofline_ms", "ratio", "kernel")}}
                for x in uniq]
            out["candidates"] += [{"kernels": name, "partition": x["partition"],
                                   "workload": w, "compute_ms": x["compute_ms"],
                                   "roofline_sum_ms": x["roofline_sum_ms"], "ratio": x["ratio"]}
                                  for x in p]
        print(f"candidate {name} measured ({time.time() - t0:.0f} s)", flush=True)
        save()
    out["targets"] = targets(rows, prows)
    try:
        h = b.handle
        out["machine"]["sm_clock_mhz_at_end"] = b.nvml.nvmlDeviceGetClockInfo(
            h, b.nvml.NVML_CLOCK_SM)
    except Exception:
        pass
    save()

    print(f"\n{'workload':13} {'op':14} {'ms':>7} {'roof':>7} {'ratio':>6} {'W':>5}  kernel")
    for r in {(x["workload"], x["op"]): x for x in rows}.values():
        pw = f"{r['power_w']:.0f}" if r.get("power_w") else "-"
        print(f"{r['workload']:13} {r['op']:14} {r['measured_ms']:7.3f} {r['roofline_ms']:7.3f} "
              f"{r['ratio']:6.2f} {pw:>5}  {r['kernel'][:40]}")
    print(f"\n{'workload':13} {'partition':18} {'ms':>7} {'roofsum':>7} {'ratio':>6} "
          f"{'ratio at the attention ceiling':>30}")
    for p in prows:
        print(f"{p['workload']:13} {p['partition']:18} {p['compute_ms']:7.3f} "
              f"{p['roofline_sum_ms']:7.3f} {p['ratio']:6.2f} {p['ratio_attention_ceiling']:30.2f}")
    for name, t in out["targets"].items():
        print(f"target {name}: {'MET' if t['met'] else 'MISSED'} ({t['checked']} checked) "
              + "; ".join(t["missed"][:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
