"""Fit the emulator's collective model to measured SM-capped collective bandwidths.

Reads ``bench/results/collectives_{4,2}xh200_nvlink.json`` (measured by
``bench/collectives.py`` on 4x and 2x H200, NVLink) and, for every backend (kareus's own
kernels, NCCL capped at the same CTA count), collective and group size, fits the
emulator's throughput curve ``R(s) = ((s r)^-2 + L^-2)^-1/2`` (bus GB/s) to the rows of
one message size by least squares on relative error over s = 1..32 SMs. The printed
table is what ``kareus.profilers.emulator`` carries as ``_H200_COMM`` (per-SM throughput at the
maximum clock ``r`` and link limit ``L``).

Usage::

    python bench/probes/emulator_comm_tables.py --json bench/probes/results/emulator_comm_tables.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results/
FILES = ("collectives_4xh200_nvlink.json", "collectives_2xh200_nvlink.json")
KIND = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}


def fit(points: dict[int, float]) -> tuple[float, float, float]:
    """(r, L, rms relative error) for bus GB/s measured at SM counts ``points``."""
    best: tuple[float, float, float] | None = None
    s = np.array(sorted(points), dtype=float)
    y = np.array([points[int(k)] for k in s])
    for r in np.arange(5.0, 60.0, 0.1):
        for link in np.arange(100.0, 600.0, 1.0):
            pred = ((s * r) ** -2 + link ** -2) ** -0.5
            err = float(np.mean((pred / y - 1.0) ** 2))
            if best is None or err < best[2]:
                best = (float(r), float(link), err)
    assert best is not None
    return round(best[0], 1), round(best[1], 0), round(math.sqrt(best[2]), 4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--size-mib", type=int, default=64)
    args = ap.parse_args(argv)
    table = []
    for name in FILES:
        d = json.loads((RESULTS / name).read_text())
        g = int(d["world_size"])
        for backend in ("own", "nccl_capped"):
            for op in KIND:
                pts = {int(r["sms"]): float(r["busbw_gbps"]) for r in d["rows"]
                       if r["backend"] == backend and r["op"] == op
                       and r["size_bytes"] == args.size_mib << 20 and r["sms"] is not None}
                if not pts:
                    continue
                r, link, rms = fit(pts)
                table.append({"backend": "own" if backend == "own" else "nccl", "kind": op,
                              "group_size": g, "gbps_per_sm": r, "link_gbps": link,
                              "rms_rel_err": rms, "measured": pts, "source": name})
    print(f"{'backend':>7} {'kind':>15} {'g':>2} {'r GB/s/SM':>9} {'L GB/s':>7} {'rms':>6}")
    for t in table:
        print(f"{t['backend']:>7} {t['kind']:>15} {t['group_size']:>2} {t['gbps_per_sm']:9.1f} "
              f"{t['link_gbps']:7.0f} {t['rms_rel_err']:6.3f}")
    if args.json:
        out = {"what": f"fitted collective curves (bus GB/s) from measured {args.size_mib} MiB rows",
               "machine": "2-core CPU (fit); data measured on 4x / 2x H200",
               "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
               "table": table}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
