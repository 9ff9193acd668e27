"""How fast is the per-head query/key RMSNorm before RoPE (Qwen3's attention input), unfused
and fused, against HBM bandwidth?

Three ways to run it on the packed QKV projection, forward and backward, at Qwen3-1.7B's
head shapes:

* ``torch``: ``TorchKernels``' composition (a copy of the packed QKV, the two per-head norms
  through ``torch.nn.functional.rms_norm`` on strided slices, then RoPE), what the training
  loop's layer ran before the fused kernel;
* ``triton-unfused``: the same composition on kareus's Triton norm and RoPE kernels
  (``KernelSet.qk_norm_rope``'s default);
* ``triton-fused``: ``TritonKernels.qk_norm_rope`` (one launch forward, one plus a reduction
  backward: ``kareus/exec/kernels/_triton_head_norm.py``).

Each is timed with CUDA events over repeats, launched one by one (``eager``: host time
shows where the GPU outruns the host) and replayed from a CUDA graph (``graphed``: GPU
time, as the training loop's graphs run it), all interleaved in rounds; the table gives
the median time and the bandwidth of the minimum traffic (forward: read q and k,
write q and k; backward: read dq, dk, dv and the pre-norm q and k, write dQKV), against the
GPU's HBM bandwidth. Checks first that the fused forward equals the unfused Triton one bit
for bit and the backward agrees within bf16 rounding. Needs a CUDA GPU; changes no clock.

    python bench/probes/qk_norm_rope.py --json bench/probes/results/qk_norm_rope_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

#: name -> (tokens per nanobatch, query heads, KV heads) of one rank, head_dim 128
SHAPES = {
    "qwen3-1.7b tp4 cp2 (8192 tokens)": (8192, 4, 2),
    "qwen3-1.7b tp1 (8192 tokens)": (8192, 16, 8),
    "qwen3-1.7b tp1 (32768 tokens)": (32768, 16, 8),
}
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


def _hbm(name: str) -> float | None:
    return next((v for k, v in HBM_TBPS.items() if k in name), None)


def _time(torch: Any, fn: Any, reps: int, graph: Any = None) -> float:
    """Milliseconds per call: ``reps`` calls launched one by one (host time included when
    the GPU outruns the host), or replays of ``graph`` holding ``reps`` calls (GPU time)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    if graph is not None:
        graph.replay()
    else:
        for _ in range(reps):
            fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _graph(torch: Any, fn: Any, reps: int) -> Any:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--reps", type=int, default=50, help="calls timed per round (default 50)")
    ap.add_argument("--json", metavar="PATH", help="write the full result here")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("qk_norm_rope: needs a CUDA GPU", file=sys.stderr)
        return 2
    from kareus.exec.kernels import KernelSet, TorchKernels, _triton_head_norm
    from kareus.exec.kernels.triton_ops import TritonKernels

    dev, dt, hd = torch.device("cuda"), torch.bfloat16, 128
    gpu = torch.cuda.get_device_name()
    hbm = _hbm(gpu)
    tri, tor = TritonKernels(), TorchKernels()
    ways = {
        "torch": (tor.qk_norm_rope, tor.qk_norm_rope_bwd),
        "triton-unfused": (lambda *a, **k: KernelSet.qk_norm_rope(tri, *a, **k),
                           lambda *a, **k: KernelSet.qk_norm_rope_bwd(tri, *a, **k)),
        "triton-fused": (tri.qk_norm_rope, tri.qk_norm_rope_bwd),
        "triton-fused-bs64": (
            lambda *a, **k: _triton_head_norm.qk_norm_rope_fwd(*a, block_s=64, **k),
            lambda *a, **k: _triton_head_norm.qk_norm_rope_bwd(*a, block_s=64, **k)),
    }
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    for shape, (t, h, kv) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(t + h)
        qkv = (torch.randn(t, (h + 2 * kv) * hd, device=dev, generator=g) * 3).to(dt)
        wq = (1 + 0.1 * torch.randn(hd, device=dev, generator=g)).to(dt)
        wk = (1 + 0.1 * torch.randn(hd, device=dev, generator=g)).to(dt)
        seq = 4096 if t % 4096 == 0 else t
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev).float() / hd))
        ang = torch.outer(torch.arange(seq, device=dev).float(), inv)
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(dt), ang.sin().to(dt)
        b = t // seq
        dq = torch.randn(b, h, seq, hd, device=dev, generator=g).to(dt).transpose(1, 2)
        dk = torch.randn(b, kv, seq, hd, device=dev, generator=g).to(dt).transpose(1, 2)
        dv = torch.randn(b, kv, seq, hd, device=dev, generator=g).to(dt).transpose(1, 2)
        kw = {"heads": h, "kv_heads": kv, "eps": 1e-6}
        fused = ways["triton-fused"][0](qkv, wq, wk, cos, sin, **kw)
        unfused = ways["triton-unfused"][0](qkv, wq, wk, cos, sin, **kw)
        fb = ways["triton-fused"][1](dq, dk, dv, qkv, wq, wk, cos, sin, eps=1e-6)
        ub = ways["triton-unfused"][1](dq, dk, dv, qkv, wq, wk, cos, sin, eps=1e-6)

        def rel(a: Any, r: Any) -> float:
            return float((a.float() - r.float()).norm() / r.float().norm())

        checks.append({"shape": shape,
                       "forward_bitwise_equal": bool(torch.equal(fused[0], unfused[0])
                                                     and torch.equal(fused[1], unfused[1])),
                       "forward_rel": {"q": rel(fused[0], unfused[0]),
                                       "k": rel(fused[1], unfused[1])},
                       "backward_rel": {"dqkv": rel(fb[0], ub[0]), "dwq": rel(fb[1], ub[1]),
                                        "dwk": rel(fb[2], ub[2])}})
        el = 2  # bytes per bf16 element
        fwd_bytes = 2 * t * (h + kv) * hd * el
        bwd_bytes = (t * (h + 2 * kv) * hd + t * (h + kv) * hd + t * (h + 2 * kv) * hd) * el
        times: dict[tuple[str, str, str], list[float]] = {}
        fargs, bargs = (qkv, wq, wk, cos, sin), (dq, dk, dv, qkv, wq, wk, cos, sin)
        calls = {(name, "fwd"): (lambda fwd=fwd, a=fargs, kw=kw: fwd(*a, **kw))
                 for name, (fwd, _) in ways.items()}
        calls.update({(name, "bwd"): (lambda bwd=bwd, a=bargs: bwd(*a, eps=1e-6))
                      for name, (_, bwd) in ways.items()})
        graphs = {key: _graph(torch, fn, args.reps) for key, fn in calls.items()}
        for _ in range(args.rounds):
            for (name, phase), fn in calls.items():
                times.setdefault((name, phase, "eager"), []).append(
                    _time(torch, fn, args.reps))
                times.setdefault((name, phase, "graphed"), []).append(
                    _time(torch, fn, args.reps, graphs[(name, phase)]))
        del graphs
        for (name, phase, how), ts in times.items():
            ms = statistics.median(ts)
            nbytes = fwd_bytes if phase == "fwd" else bwd_bytes
            tbps = nbytes / (ms * 1e-3) / 1e12
            rows.append({"shape": shape, "way": name, "phase": phase, "launch": how, "ms": ms,
                         "ms_all": ts, "min_bytes": nbytes, "tb_per_s": tbps,
                         "hbm_fraction": tbps / hbm if hbm else None})
    print(f"{gpu}; HBM {hbm} TB/s; median of {args.rounds} interleaved rounds x {args.reps}")
    print(f"{'shape':34s} {'way':17s} {'phase':5s} {'launch':7s} {'ms':>8s} {'TB/s':>6s} "
          f"{'of HBM':>6s}")
    for r in rows:
        frac = f"{r['hbm_fraction']:.0%}" if r["hbm_fraction"] is not None else "-"
        print(f"{r['shape']:34s} {r['way']:17s} {r['phase']:5s} {r['launch']:7s} "
              f"{r['ms']:8.4f} {r['tb_per_s']:6.2f} {frac:>6s}")
    for c in checks:
        print(f"check {c['shape']}: forward bitwise {c['forward_bitwise_equal']} (rel "
              + ", ".join(f"{k} {v:.1e}" for k, v in c["forward_rel"].items())
              + "), backward " + ", ".join(f"{k} rel {v:.1e}"
                                           for k, v in c["backward_rel"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rounds": args.rounds,
                       "reps": args.reps, "rows": rows, "checks": checks}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
