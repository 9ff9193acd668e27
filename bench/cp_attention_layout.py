"""Causal attention per context-parallel rank: Megatron-Core's load-balanced chunks (kareus's
layout) against CP contiguous chunks (kareus's layout before), on one GPU.

A CP step waits for its slowest rank. With contiguous chunks rank ``r`` holds tokens
``[r s/CP, (r+1) s/CP)`` and attends to every key before them: the last rank has most of the
causal work. With Megatron-Core's layout rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r``
of ``2 x CP``, the same work on every rank. This bench times, for every CP rank, the
attention forward and backward of its queries over the all-gathered keys and values
(grouped-query heads, bf16), each layout on the kernels kareus runs
(``kareus.exec._cp_attention``: one causal piece per chunk, the square piece through the
kernel set's attention and the others through the flash-attention op called directly, causal
aligned to the lower right; the contiguous chunk is one such piece), and prints each rank's
time and the slowest rank's per layout.

* Shapes: the query/KV heads per TP rank and head dim of the presets (qwen3-1.7b TP=4:
  4 query heads over 2 KV heads of 128; llama3.2-3b TP=4: 6 over 2), 4,096 tokens a
  sequence, nanobatches of 4 sequences, CP = 2 and 4.
* Time: CUDA events around the forward and the backward, the median of ``--rounds`` runs
  after warm-up (on ``--device cpu``, a smoke run of the same code at tiny shapes, wall
  time, not a measurement).

Usage (one GPU; changes no GPU setting)::

    python bench/cp_attention_layout.py --json bench/results/cp_attention_layout_h200.json
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

#: (label, query heads per TP rank, KV heads per TP rank, head dim)
SHAPES = [("qwen3-1.7b tp4", 4, 2, 128), ("llama3.2-3b tp4", 6, 2, 128)]
LAYOUTS = ("load_balanced", "contiguous")


def _pieces(layout: str, seq: int, cp: int, rank: int) -> tuple[Any, ...]:
    from kareus.exec._cp_attention import _Piece, attention_pieces

    if layout == "load_balanced":
        return attention_pieces(seq // cp, cp, rank)
    n = seq // cp  # one chunk: the queries of [r n, (r+1) n) over keys [0, (r+1) n)
    return (_Piece(0, n, (rank + 1) * n),)


def _time_rank(torch: Any, ks: Any, layout: str, q: Any, k: Any, v: Any, do: Any, cp: int,
               rank: int, rounds: int) -> tuple[float, float]:
    """Median forward and backward time (s) of one rank's attention."""
    from kareus.exec._cp_attention import cp_attention, cp_attention_bwd

    seq = k.shape[2]
    pieces = _pieces(layout, seq, cp, rank)
    ql, dol = q[:, :, : seq // cp], do[:, :, : seq // cp]
    cuda = q.device.type == "cuda"

    def fwd() -> Any:
        return cp_attention(ks, ql, k, v, pieces, keep=True)[1]

    def bwd(saved: Any) -> Any:
        return cp_attention_bwd(dol, saved, pieces, keys=seq)

    for _ in range(3):  # warm-up
        bwd(fwd())
    f_times, b_times = [], []
    for _ in range(rounds):
        if cuda:
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            saved = fwd()
            e[1].record()
            bwd(saved)
            e[2].record()
            torch.cuda.synchronize()
            f_times.append(e[0].elapsed_time(e[1]) / 1e3)
            b_times.append(e[1].elapsed_time(e[2]) / 1e3)
        else:
            t0 = time.perf_counter()
            saved = fwd()
            t1 = time.perf_counter()
            bwd(saved)
            t2 = time.perf_counter()
            f_times.append(t1 - t0)
            b_times.append(t2 - t1)
    return statistics.median(f_times), statistics.median(b_times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--cps", default="2,4")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch

    from kareus.exec.kernels import get_kernels

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ks = get_kernels(None if device.type == "cuda" else "torch")
    shapes = [("tiny", 4, 2, 8)] if args.tiny else SHAPES
    seq = 32 if args.tiny else args.seq
    rows = []
    print(f"{'shape':<18}{'CP':>3}{'layout':>15}  per-rank fwd+bwd ms{'':>14}slowest ms")
    for label, heads, kvh, hd in shapes:
        for cp in (int(c) for c in args.cps.split(",")):
            g = torch.Generator(device=device).manual_seed(0)

            def rnd(*shape: int, gen: Any = g) -> Any:
                return torch.randn(*shape, generator=gen, device=device).to(dtype)

            b = args.batch
            # keys and values of the whole sequence, by position; queries and output
            # gradient of one rank's tokens (the values do not change the kernels' time)
            k, v = rnd(b, kvh, seq, hd), rnd(b, kvh, seq, hd)
            q = rnd(b, seq // cp, heads, hd).transpose(1, 2)
            do = rnd(b, seq // cp, heads, hd).transpose(1, 2)
            for layout in LAYOUTS:
                per_rank = [_time_rank(torch, ks, layout, q, k, v, do, cp, r, args.rounds)
                            for r in range(cp)]
                totals = [f + bw for f, bw in per_rank]
                row = {"shape": label, "cp": cp, "layout": layout, "seq": seq, "batch": b,
                       "heads": heads, "kv_heads": kvh, "head_dim": hd,
                       "fwd_s": [f for f, _ in per_rank], "bwd_s": [bw for _, bw in per_rank],
                       "slowest_s": max(totals)}
                rows.append(row)
                print(f"{label:<18}{cp:>3}{layout:>15}  "
                      f"{' '.join(f'{t * 1e3:6.3f}' for t in totals):<32}"
                      f"{max(totals) * 1e3:8.3f}")
    for label, *_ in shapes:
        for cp in (int(c) for c in args.cps.split(",")):
            lb, ct = (next(r["slowest_s"] for r in rows if r["shape"] == label
                           and r["cp"] == cp and r["layout"] == lay) for lay in LAYOUTS)
            print(f"{label} CP={cp}: slowest rank, contiguous / load-balanced = {ct / lb:.2f}x")
    if args.json:
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                           else platform.processor() or "cpu"),
                "torch": torch.__version__, "dtype": str(dtype), "rounds": args.rounds,
                "measured": device.type == "cuda" and not args.tiny}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
