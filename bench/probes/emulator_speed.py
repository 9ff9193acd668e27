"""Speed of EmulatedProfiler.measure() on preset partitions.

The search benchmarks call ``measure()`` many thousands of times, so one call must stay
well under 2 ms. For every partition type of a few preset workloads this times:

* ``first``: the first call for each configuration (an event simulation, plus the
  power-limit search where the clock must come down), over every configuration of the
  partition's default :class:`~kareus.model.config.ConfigSpace`, on a fresh profiler;
* ``repeat``: the same configurations measured again (cached noise-free result + noise).

Usage::

    python bench/probes/emulator_speed.py --json bench/probes/results/emulator_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from kareus.model.config import ConfigSpace
from kareus.model.partition import build_partitions
from kareus.model.workload import Workload
from kareus.profilers.emulator import EmulatedProfiler

CASES = [
    ("a100-40gb", "llama3.2-3b", dict(tp=4, microbatch_size=8, seq_len=4096)),
    ("a100-40gb", "qwen3-1.7b", dict(tp=4, cp=2, microbatch_size=8, seq_len=8192)),
    ("h200-sxm", "llama3.3-70b", dict(tp=8, pp=4, microbatch_size=4, seq_len=4096)),
]


def bench(limit: int | None) -> list[dict[str, object]]:
    rows = []
    for gpu, model, kw in CASES:
        wl = Workload.preset(model, **kw)
        for part in build_partitions(wl):
            space = ConfigSpace(part, gpu)
            configs = space.configs if limit is None else space.configs[:: max(1, len(space) // limit)]
            prof = EmulatedProfiler(gpu, seed=0)
            t0 = time.perf_counter()
            for c in configs:
                prof.measure(part, c)
            first = (time.perf_counter() - t0) / len(configs)
            t0 = time.perf_counter()
            for c in configs:
                prof.measure(part, c)
            repeat = (time.perf_counter() - t0) / len(configs)
            rows.append({"gpu": gpu, "workload": wl.describe(), "partition": part.name,
                         "ops": len(part.compute_ops), "configs": len(configs),
                         "first_call_ms": round(first * 1e3, 4),
                         "repeat_call_ms": round(repeat * 1e3, 4)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--limit", type=int, default=None,
                    help="measure about this many configurations per partition (default: all)")
    args = ap.parse_args(argv)
    rows = bench(args.limit)
    print(f"{'gpu':>9} {'partition':>16} {'ops':>3} {'configs':>7} {'first ms':>9} "
          f"{'repeat ms':>9}  workload")
    for r in rows:
        print(f"{r['gpu']:>9} {r['partition']:>16} {r['ops']:>3} {r['configs']:>7} "
              f"{r['first_call_ms']:9.4f} {r['repeat_call_ms']:9.4f}  {r['workload']}")
    firsts = [float(r["first_call_ms"]) for r in rows]  # type: ignore[arg-type]
    summary = {"first_call_ms_median": round(statistics.median(firsts), 4),
               "first_call_ms_max": round(max(firsts), 4),
               "repeat_call_ms_median": round(statistics.median(
                   float(r["repeat_call_ms"]) for r in rows), 4),  # type: ignore[arg-type]
               "target_ms": 2.0}
    summary["meets_target"] = summary["first_call_ms_max"] <= 2.0
    print(f"first call: median {summary['first_call_ms_median']} ms, max "
          f"{summary['first_call_ms_max']} ms; repeat: median {summary['repeat_call_ms_median']}"
          f" ms (target <= 2 ms per call)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        res = {"what": "wall time of one EmulatedProfiler.measure() call, pure Python",
               "machine": f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}),"
                          f" shared with other jobs; Python {platform.python_version()}",
               "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
               **summary, "rows": rows}
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
