"""What the 4-byte memsets before cuBLAS and cuDNN kernels cost a CUDA graph, and what
removes them.

A profile of the training loop's graphed iteration on one H200 (``bench/host_bound.py
--loop --trace-dir``) shows a ``Memset (Device)`` of 4 bytes right before most cuBLAS
GEMMs and every cuDNN attention forward: 1,916 of 9,920 GPU operations of a sequential
Qwen3-1.7B iteration, 3,372 of 18,884 nanobatched, with more idle GPU time before them
than before any kernel. This probe captures one decoder layer's GEMMs (forward and
backward, the loop's own calls: ``torch.matmul(..., out=)`` and ``addmm_`` to
accumulate) and an attention forward + backward in CUDA graphs, at the shapes of
Qwen3-1.7B TP=4 CP=2 (a nanobatch and a whole microbatch of 8 x 4096), under each
setting, in its own process (settings that are environment variables must be set before
CUDA starts):

* ``default``: as the loop runs.
* ``no_workspace``: ``CUBLASLT_WORKSPACE_SIZE=0`` (torch's cuBLASLt workspace, KiB)
  and ``CUBLAS_WORKSPACE_CONFIG=:0:0`` (the cuBLAS handle's); ``lt_no_workspace`` and
  ``cublas_no_workspace``: each of the two alone.
* ``cublas``: ``torch.backends.cuda.preferred_blas_library("cublas")``.
* ``tunableop``: PyTorch TunableOp picks each GEMM's algorithm by timing (tuned eagerly
  before capture).

Per setting and shape: GPU operations and memsets per replay, GPU-busy fraction of the
replay (``kernel_timeline``), and time per replay (back to back, device events), medians
of rounds that interleave the settings (each round runs every setting once, in order).

Usage (one CUDA GPU)::

    python bench/probes/graph_memset_probe.py --json bench/probes/results/graph_memset_probe_h200.json

Clocks are never changed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
for _p in (_REPO, _REPO / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import host_bound as hb  # noqa: E402  (the same timeline and refusal helpers)

from kareus.exec._graphs import WORKSPACE_FREE  # noqa: E402

#: name -> (environment, preferred BLAS library or None).
SETTINGS: dict[str, tuple[dict[str, str], str | None]] = {
    "default": ({}, None),
    "no_workspace": ({"CUBLASLT_WORKSPACE_SIZE": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"},
                     None),
    "lt_no_workspace": ({"CUBLASLT_WORKSPACE_SIZE": "0"}, None),
    "cublas_no_workspace": ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, None),
    "cublas": ({}, "cublas"),
    "tunableop": ({"PYTORCH_TUNABLEOP_ENABLED": "1", "PYTORCH_TUNABLEOP_TUNING": "1",
                   "PYTORCH_TUNABLEOP_VERBOSE": "0"}, None),
}

#: (label, model preset, TP) of the GEMM shapes.
MODELS = {"qwen3": ("qwen3-1.7b", 4), "llama3b": ("llama3.2-3b", 4),
          "llama70b": ("llama3.3-70b", 8)}


def _dims(model: str) -> dict[str, int]:
    """One TP rank's GEMM widths of ``model`` (a ``MODELS`` label)."""
    from kareus.model.workload import get_model

    name, tp = MODELS[model]
    a = get_model(name)
    q, kv = a.heads // tp * a.head_dim, a.kv_heads // tp * a.head_dim
    return {"hidden": a.hidden, "qkv": q + 2 * kv, "q": q, "ffn": a.ffn // tp,
            "heads": a.heads // tp, "head_dim": a.head_dim}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(prog="graph_memset_probe.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the settings")
    ap.add_argument("--layers", type=int, default=4, help="layers of GEMMs per graph")
    ap.add_argument("--replays", type=int, default=20, help="timed replays per graph")
    ap.add_argument("--tokens", default="8192,16384", help="token counts (rows) to probe")
    ap.add_argument("--models", default="qwen3", help=f"GEMM shapes of: {', '.join(MODELS)}")
    ap.add_argument("--no-attention", action="store_true", help="GEMMs only")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="settings to run")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _gemm_body(torch: Any, t: int, layers: int, d: dict[str, int]) -> Any:
    """One decoder layer's GEMMs per layer (forward, then backward), as the loop calls
    them, at widths ``d`` (``_dims``)."""
    dev, dt = "cuda", torch.bfloat16
    hid, qkv, q, f = d["hidden"], d["qkv"], d["q"], d["ffn"]

    def r(*shape: int) -> Any:
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    w = [{"qkv": r(hid, qkv), "o": r(q, hid), "g": r(hid, f), "u": r(hid, f),
          "d": r(f, hid)} for _ in range(layers)]
    g = [{k: torch.zeros_like(v) for k, v in wl.items()} for wl in w]
    xn, attn, xn2, a, dy = r(t, hid), r(t, q), r(t, hid), r(t, f), r(t, hid)
    dg, du, dqkv = r(t, f), r(t, f), r(t, qkv)
    out_h = torch.empty(t, hid, device=dev, dtype=dt)

    def body() -> None:
        for wl, gl in zip(w, g):
            torch.matmul(xn, wl["qkv"])
            torch.matmul(attn, wl["o"], out=out_h)
            torch.matmul(xn2, wl["g"])
            torch.matmul(xn2, wl["u"])
            torch.matmul(a, wl["d"], out=out_h)
            torch.matmul(dy, wl["d"].t())
            gl["d"].addmm_(a.t(), dy)
            torch.matmul(dg, wl["g"].t(), out=out_h)
            out_h.addmm_(du, wl["u"].t())
            gl["g"].addmm_(xn2.t(), dg)
            gl["u"].addmm_(xn2.t(), du)
            torch.matmul(dy, wl["o"].t())
            gl["o"].addmm_(attn.t(), dy)
            torch.matmul(dqkv, wl["qkv"].t(), out=out_h)
            gl["qkv"].addmm_(xn.t(), dqkv)

    return body


def _attention_body(torch: Any, t: int, backend: str, d: dict[str, int]) -> Any:
    """Causal attention forward and backward (the direct ops kareus's loop calls; K and V
    with as many heads as Q, which both backends take)."""
    from kareus.exec.kernels import attention_backward, attention_forward

    b, s = t // 2048, 2048
    q = torch.randn(b, d["heads"], s, d["head_dim"], device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(k)
    do = torch.randn_like(q)

    def body() -> None:
        saved = attention_forward(q, k, v, backend=f"{backend}_attention", fallback=None)
        attention_backward(do, saved)

    return body


def _measure(torch: Any, body: Any, replays: int) -> dict[str, Any]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ops = hb.profiled_kernels(torch, graph.replay)
    tl = hb.kernel_timeline(ops, top=6)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return {"replay_ms": a.elapsed_time(b) / replays, "ops": tl["kernels"],
            "memsets": sum(1 for *_, n in ops if "memset" in n.lower()),
            "busy": tl["busy"], "idle_us": 1e6 * (tl.get("idle_s") or 0.0),
            "top_idle": tl.get("top_kernels", [])[:4]}


def child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One setting's measurements (in its own process)."""
    import torch

    blas = SETTINGS[name][1]
    if blas is not None:
        torch.backends.cuda.preferred_blas_library(blas)
    out: dict[str, Any] = {}
    for model in args.models.split(","):
        d = _dims(model)
        for t in (int(x) for x in args.tokens.split(",")):
            out[f"{model} gemms t={t}"] = _measure(torch, _gemm_body(torch, t, args.layers, d),
                                                   args.replays)
            for backend in () if args.no_attention else ("cudnn", "flash"):
                case = f"{model} attention {backend} t={t}"
                try:
                    out[case] = _measure(torch, _attention_body(torch, t, backend, d),
                                         args.replays)
                except Exception as exc:  # a backend this build lacks
                    out[case] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every setting in its own process, rounds interleaved; exit 2 without a GPU."""
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args)))
        return 0
    torch = hb.cuda_torch("graph_memset_probe.py")
    if torch is None:
        return 2
    names = [n for n in args.settings.split(",") if n]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        for n in names:
            env = {k: v for k, v in os.environ.items() if k not in WORKSPACE_FREE}
            env.update(SETTINGS[n][0])  # only the setting's own variables
            cmd = [sys.executable, __file__, "--child", n, "--layers", str(args.layers),
                   "--replays", str(args.replays), "--tokens", args.tokens,
                   "--models", args.models, *(["--no-attention"] if args.no_attention else [])]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if p.returncode != 0:
                print(f"{n}: exit {p.returncode}: {p.stderr.strip()[-300:]}", flush=True)
                continue
            runs[n].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {rnd + 1}: {n} done", flush=True)
    rows = []
    for n, rs in runs.items():
        for case in (rs[0] if rs else {}):
            ok = [r[case] for r in rs if "error" not in r[case]]
            if not ok:
                rows.append({"setting": n, "case": case, "error": rs[0][case]["error"]})
                continue
            rows.append({"setting": n, "case": case,
                         "replay_ms": statistics.median(r["replay_ms"] for r in ok),
                         "ops": ok[0]["ops"], "memsets": ok[0]["memsets"],
                         "busy": statistics.median(r["busy"] for r in ok),
                         "idle_us": statistics.median(r["idle_us"] for r in ok),
                         "top_idle": ok[0]["top_idle"], "rounds": len(ok)})
    base = {r["case"]: r.get("replay_ms") for r in rows if r["setting"] == "default"}
    print(f"\n{'setting':16s} {'case':32s} {'ms/replay':>9s} {'x dflt':>7s} {'ops':>5s} "
          f"{'memsets':>7s} {'busy':>6s} {'idle us':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['setting']:16s} {r['case']:32s} {r['error']}")
            continue
        ref = base.get(r["case"])
        print(f"{r['setting']:16s} {r['case']:32s} {r['replay_ms']:9.3f} "
              f"{r['replay_ms'] / ref if ref else float('nan'):7.3f} {r['ops']:5d} "
              f"{r['memsets']:7d} {100 * r['busy']:5.1f}% {r['idle_us']:8.1f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "bench": "graph_memset_probe",
            "command": " ".join(["python", "bench/probes/graph_memset_probe.py",
                                 *(argv or sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": "1x H200" if "H200" in torch.cuda.get_device_name() else
            torch.cuda.get_device_name(), **hb._versions(),
            "method": __doc__.split("Usage")[0].strip(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
