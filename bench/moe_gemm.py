"""Grouped expert GEMMs of a mixture of experts against the GPU's bf16 peak: PyTorch's
grouped matmul (``torch._grouped_mm``, one kernel for every local expert) against a loop of
``torch.matmul`` (one GEMM per expert), at the per-rank shapes the partition model costs.

A rank of an expert-parallel group of ``ep`` runs its ``experts / ep`` local SwiGLU experts
on the rows it receives: the gate/up projection (``rows x hidden @ hidden x 2 ffn`` per
expert), the down projection (``rows x ffn @ ffn x hidden``), and in the backward each one's
data and weight gradients. The shapes come from kareus's runnable partitions
(``RunnableTransformerPartition.dims.moe``: ``routing_imbalance x tokens x top-k`` rows on
the busiest rank, spread evenly over the local experts, as the partition model costs
them), for the workload presets ``qwen3-30b-a3b`` (128 experts, top-8, 16 local at EP=8)
and ``mixtral-8x7b`` (8 experts, top-2, one local at EP=8: the loop is one GEMM), at
``--microbatch-size`` x ``--seq-len`` tokens in ``--nanobatches``.

Each GEMM is timed with CUDA events over ``--repeats`` runs after warm-up (the median of
``--rounds`` rounds), on both paths, through ``TorchKernels``' ``grouped_mm`` /
``grouped_mm_wgrad`` with ``grouped_gemm`` forced; TFLOP/s and the fraction of the GPU
preset's dense bf16 peak (``--gpu``, by default the preset of the device's name) are
printed per GEMM and path. ``--smoke`` runs the same code on the CPU at tiny shapes in
float32 (wall time; a check of the code path, not a measurement).

Usage (one GPU; changes no GPU setting)::

    python bench/moe_gemm.py --json bench/results/moe_gemm_h200.json
    python bench/moe_gemm.py --smoke --json /tmp/moe_gemm_smoke.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b")
PATHS = ("grouped_mm", "loop")
#: (name, what it multiplies): the six grouped GEMMs of a SwiGLU expert layer
GEMMS = ("gate_up", "down", "down_dgrad", "down_wgrad", "gate_up_dgrad", "gate_up_wgrad")


def expert_shapes(preset: str, *, ep: int, microbatch_size: int, seq_len: int,
                  nanobatches: int, imbalance: float) -> dict[str, Any]:
    """One rank's expert shapes, from the runnable partitions of the preset at ``ep``."""
    from kareus.exec import runnable_partitions
    from kareus.model.workload import Workload

    wl = Workload.preset(preset, dp=ep, ep=ep, microbatch_size=microbatch_size,
                         seq_len=seq_len, nanobatches=nanobatches,
                         routing_imbalance=imbalance)
    part = next(p for p in runnable_partitions(wl).values()
                if any(op.name == "expert_gate_up" for op in p.compute_ops))
    md = part.dims.moe
    return {"preset": preset, "ep": ep, "hidden": wl.model.hidden, "ffn": md.fe,
            "local_experts": md.local, "rows": md.rows, "counts": list(md.local_counts),
            "tokens": md.tm, "top_k": md.k}


def smoke_shapes() -> list[dict[str, Any]]:
    """Tiny shapes for a CPU run: uneven groups and an empty one."""
    return [{"preset": "smoke", "ep": 2, "hidden": 64, "ffn": 32, "local_experts": 4,
             "rows": 96, "counts": [40, 0, 24, 32], "tokens": 48, "top_k": 2}]


def _operands(torch: Any, shape: dict[str, Any], dtype: Any, device: Any) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(0)
    L, h, f, r = shape["local_experts"], shape["hidden"], shape["ffn"], shape["rows"]

    def rnd(*s: int, scale: float = 1.0) -> Any:
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    return {"x": rnd(r, h), "w1": rnd(L, h, 2 * f, scale=h ** -0.5),
            "w2": rnd(L, f, h, scale=f ** -0.5), "a": rnd(r, f), "dy": rnd(r, h),
            "dh": rnd(r, 2 * f)}


def _gemm_calls(ks: Any, ops: dict[str, Any], counts: Any) -> dict[str, tuple[Any, float]]:
    """Per GEMM: a zero-argument call and its FLOPs."""
    x, w1, w2, a, dy, dh = (ops[k] for k in ("x", "w1", "w2", "a", "dy", "dh"))
    r, h = x.shape
    f = a.shape[1]
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    return {
        "gate_up": (lambda: ks.grouped_mm(x, w1, counts), 2.0 * r * h * 2 * f),
        "down": (lambda: ks.grouped_mm(a, w2, counts), 2.0 * r * f * h),
        "down_dgrad": (lambda: ks.grouped_mm(dy, w2t, counts), 2.0 * r * h * f),
        "down_wgrad": (lambda: ks.grouped_mm_wgrad(a, dy, counts), 2.0 * r * f * h),
        "gate_up_dgrad": (lambda: ks.grouped_mm(dh, w1t, counts), 2.0 * r * 2 * f * h),
        "gate_up_wgrad": (lambda: ks.grouped_mm_wgrad(x, dh, counts), 2.0 * r * h * 2 * f),
    }


def _time_s(torch: Any, fn: Any, *, cuda: bool, repeats: int, rounds: int,
            warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / repeats)
        else:
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append((time.perf_counter() - t0) / repeats)
    return statistics.median(times)


def run(shapes: list[dict[str, Any]], *, device: str, dtype_name: str, peak_tflops: float,
        repeats: int, rounds: int, warmup: int) -> list[dict[str, Any]]:
    """Time every GEMM of every shape on both paths; one row per (shape, GEMM, path)."""
    import torch

    from kareus.exec.kernels import TorchKernels

    cuda = device.startswith("cuda")
    dtype = getattr(torch, dtype_name)
    rows = []
    for shape in shapes:
        ops = _operands(torch, shape, dtype, device)
        results: dict[tuple[str, str], Any] = {}
        for path in PATHS:
            ks = TorchKernels()
            ks.grouped_gemm = path
            # each path reads its counts without a host round trip
            counts = (torch.tensor(shape["counts"], device=device) if path == "grouped_mm"
                      else list(shape["counts"]))
            for name, (fn, flops) in _gemm_calls(ks, ops, counts).items():
                results[(name, path)] = fn()
                t = _time_s(torch, fn, cuda=cuda, repeats=repeats, rounds=rounds,
                            warmup=warmup)
                tflops = flops / t / 1e12
                rows.append({"preset": shape["preset"], "ep": shape["ep"], "gemm": name,
                             "path": path, "rows": shape["rows"],
                             "local_experts": shape["local_experts"],
                             "hidden": shape["hidden"], "ffn": shape["ffn"],
                             "flops": flops, "time_s": t, "tflops": tflops,
                             "roofline_fraction": tflops / peak_tflops})
        for name in GEMMS:  # both paths computed the same products
            a, b = (results[(name, p)].float() for p in PATHS)
            err = float((a - b).norm() / b.norm().clamp_min(1e-30))
            for row in rows[-2 * len(GEMMS):]:
                if row["gemm"] == name:
                    row["rel_diff_between_paths"] = err
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'preset':<15}{'EP':>3} {'gemm':<14}{'path':<11}{'rows':>8}{'L':>4}"
            f"{'time ms':>10}{'TFLOP/s':>9}{'of peak':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['preset']:<15}{r['ep']:>3} {r['gemm']:<14}{r['path']:<11}"
                     f"{r['rows']:>8}{r['local_experts']:>4}{r['time_s'] * 1e3:>10.3f}"
                     f"{r['tflops']:>9.1f}{r['roofline_fraction']:>9.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--nanobatches", type=int, default=2)
    ap.add_argument("--imbalance", type=float, default=1.0,
                    help="Workload.routing_imbalance: the busiest rank's rows over the mean")
    ap.add_argument("--gpu", default=None, help="GPU preset for the bf16 peak (default: "
                    "detected from the device name; h200-sxm with --smoke)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU in float32 (a code-path check, not a "
                    "measurement)")
    ap.add_argument("--json", default=None, help="write the rows and the setup here")
    args = ap.parse_args(argv)

    import torch

    from kareus.model.gpu import get_gpu

    if args.smoke:
        device, dtype_name = "cpu", "float32"
        shapes = smoke_shapes()
        gpu_name = args.gpu or "h200-sxm"
        repeats, rounds, warmup = 2, 1, 1
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 2
        device, dtype_name = "cuda", "bfloat16"
        shapes = [expert_shapes(p, ep=args.ep, microbatch_size=args.microbatch_size,
                                seq_len=args.seq_len, nanobatches=args.nanobatches,
                                imbalance=args.imbalance) for p in args.presets]
        if args.gpu is None:
            from kareus.tune import detect_gpu_preset

            gpu_name = detect_gpu_preset(torch.cuda.get_device_name())
        else:
            gpu_name = args.gpu
        repeats, rounds, warmup = args.repeats, args.rounds, args.warmup
    peak = get_gpu(gpu_name).bf16_peak_tflops
    rows = run(shapes, device=device, dtype_name=dtype_name, peak_tflops=peak,
               repeats=repeats, rounds=rounds, warmup=warmup)
    print(_table(rows))
    print(f"(bf16 peak of {gpu_name}: {peak:g} TFLOP/s"
          + ("; --smoke: CPU wall time in float32, not a measurement)" if args.smoke else ")"))
    if args.json:
        out = {"bench": "moe_gemm", "smoke": args.smoke, "device": (
                   torch.cuda.get_device_name() if device == "cuda" else platform.processor()
                   or platform.machine()),
               "gpu_preset": gpu_name, "bf16_peak_tflops": peak, "dtype": dtype_name,
               "torch": torch.__version__, "shapes": shapes, "rows": rows,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "argv": sys.argv[1:]}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
