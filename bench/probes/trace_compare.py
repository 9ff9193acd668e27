"""GPU time by kernel category in two Chrome traces of one iteration, side by side.

``bench/host_bound.py --loop --trace-dir DIR`` writes each profiled loop iteration as a
Chrome trace. This script sums, for two of them (e.g. the sequential and the nanobatched
schedule, both graphed), the GPU operations and their time per category (GEMMs,
attention, the loopback collective, torch element-wise ops, copies, memsets, each of
kareus's Triton kernels), so that what a schedule's extra time is made of can be read
off: more, smaller kernels (counts), slower ones (time), or idle GPU (``host_bound.py``'s
``gaps``).

Usage::

    python bench/probes/trace_compare.py A.json.gz B.json.gz [--json OUT]

Runs on any machine (reads files only).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

#: Trace event categories that are GPU operations.
GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def category(name: str) -> str:
    """The category of a GPU operation, from its name."""
    low = name.lower()
    if "memset" in low:
        return "memset"
    if "nvjet" in low or "gemm" in low or "splitk" in low:
        return "gemm (cuBLAS)"
    if "sdpa" in low or "cudnn" in low or "flash" in low or "fmha" in low:
        return "attention"
    if "aunaryfunctor" in low:
        return "scalar multiply (the loopback all-reduce)"
    if name.startswith("_"):
        return f"triton {name}"
    if "copy" in low or "memcpy" in low:
        return "copies"
    if "functor_add" in low:
        return "torch add"
    return "other"


def read(path: Path) -> list[dict[str, Any]]:
    """The GPU operations of a Chrome trace (``.json`` or ``.json.gz``)."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]


def by_category(ops: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """category -> (operations, GPU seconds)."""
    out: dict[str, list[float]] = {}
    for e in ops:
        rec = out.setdefault(category(str(e["name"])), [0, 0.0])
        rec[0] += 1
        rec[1] += float(e["dur"]) / 1e6
    return {k: (int(n), t) for k, (n, t) in out.items()}


def compare(a: dict[str, tuple[int, float]],
            b: dict[str, tuple[int, float]]) -> list[dict[str, Any]]:
    """Rows per category, largest time difference (b - a) first."""
    rows = [{"category": k, "ops_a": a.get(k, (0, 0.0))[0], "gpu_s_a": a.get(k, (0, 0.0))[1],
             "ops_b": b.get(k, (0, 0.0))[0], "gpu_s_b": b.get(k, (0, 0.0))[1]}
            for k in set(a) | set(b)]
    for r in rows:
        r["diff_s"] = r["gpu_s_b"] - r["gpu_s_a"]
    return sorted(rows, key=lambda r: -abs(r["diff_s"]))


def main(argv: list[str] | None = None) -> int:
    """Print the table; write JSON with ``--json``."""
    ap = argparse.ArgumentParser(prog="trace_compare.py", description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="the first trace (the reference)")
    ap.add_argument("b", type=Path, help="the second trace")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    rows = compare(by_category(read(args.a)), by_category(read(args.b)))
    print(f"{'category':44s} {'ops A':>6s} {'ms A':>8s} {'ops B':>6s} {'ms B':>8s} "
          f"{'B - A ms':>9s}")
    for r in rows:
        print(f"{r['category'][:44]:44s} {r['ops_a']:6d} {1e3 * r['gpu_s_a']:8.2f} "
              f"{r['ops_b']:6d} {1e3 * r['gpu_s_b']:8.2f} {1e3 * r['diff_s']:9.2f}")
    ta, tb = (sum(r[k] for r in rows) for k in ("gpu_s_a", "gpu_s_b"))
    print(f"{'total GPU time':44s} {'':6s} {1e3 * ta:8.2f} {'':6s} {1e3 * tb:8.2f} "
          f"{1e3 * (tb - ta):9.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "bench": "trace_compare", "a": str(args.a), "b": str(args.b),
            "command": " ".join(["python", "bench/probes/trace_compare.py", *(argv or sys.argv[1:])]),
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
