"""Assemble the h200-sxm GPU profile from the project's measured files.

Reads (paths relative to the repository; every one measured on H200 SXM):

* ``data/h200_op_roofline.json`` (per-op time, power and kernel of the main kernel set;
  the GEMM peak and HBM bandwidth of the same run), the raw bench file it was trimmed
  from (its ``source``), and ``bench/results/op_roofline_h200.json`` (adds the
  candidate kernel sets: the eager ``reference`` formulas the measured grids ran, and
  plain ``torch``), those that exist;
* ``bench/results/emulator_power_probe_h200.json`` (idle power and clock, power under
  GEMM chains, copies and elementwise kernels at the clocks observed);
* ``data/*_grid*.json`` (the power of GPUs blocked in a receive: static power);
* ``bench/results/collectives_4xh200_nvlink.json``,
  ``bench/results/collectives_2xh200_nvlink.json`` and
  ``bench/results/collectives_2xh200_nvlink_registered.json`` (kareus's kernels, staged
  and on registered buffers, NCCL capped at 1-32 CTAs and uncapped; 1 MiB-256 MiB).

and writes a :class:`kareus.model.gpu_profile.GPUProfile` (versioned JSON with a digest)::

    python bench/build_gpu_profile.py --out kareus/model/profiles/h200_sxm.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kareus.profilers.profile_build import build_gpu_profile

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
COLLECTIVES = ("collectives_4xh200_nvlink.json", "collectives_2xh200_nvlink.json",
               "collectives_2xh200_nvlink_registered.json")


def default_op_tables() -> list[Path]:
    """The data table, the raw run it was made from, and the run with the candidate
    kernel sets (no path twice)."""
    import json

    data = REPO / "data" / "h200_op_roofline.json"
    out = [data]
    if data.exists():
        source = json.loads(data.read_text()).get("source")
        if isinstance(source, str) and source:
            out.append(REPO / source)
    out.append(RESULTS / "op_roofline_h200.json")
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="profile file to write")
    ap.add_argument("--op-table", type=Path, action="append",
                    help="per-op measurement file, repeatable (default: "
                         "data/h200_op_roofline.json, the raw file it names as its source, and "
                         "bench/results/op_roofline_h200.json, those that exist; the first "
                         "gives the main kernel set)")
    ap.add_argument("--require-ops", action="store_true",
                    help="fail if the per-op measurement file does not exist")
    args = ap.parse_args(argv)
    wanted = args.op_table or default_op_tables()
    missing = [p for p in wanted if not p.exists()]
    if args.op_table and missing:
        raise SystemExit(f"{', '.join(map(str, missing))}: not found")
    op_tables = [p for p in wanted if p.exists()]
    if not op_tables and args.require_ops:
        raise SystemExit(f"{', '.join(map(str, wanted))}: not found; measure the per-op "
                         "table with bench/op_roofline.py on one H200 first")
    prof = build_gpu_profile(
        gpu="h200-sxm", power_probe=RESULTS / "emulator_power_probe_h200.json",
        grids=sorted((REPO / "data").glob("*_grid*.json")),
        collectives=[RESULTS / n for n in COLLECTIVES], op_table=op_tables or None, root=REPO)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(args.out)
    print(f"{args.out}: {prof.gpu}, {len(prof.ops)} ops (kernel sets: "
          f"{', '.join(prof.kernel_sets) or 'none'}), {len(prof.collectives)} collective "
          f"points ({', '.join(prof.backends)}), GEMM peak {prof.gemm_peak_tflops:.0f} TFLOP/s, "
          f"HBM {prof.hbm_bandwidth_gbps:.0f} GB/s, idle {prof.idle_power_w:.1f} W, static "
          f"{prof.static_power_w:.1f} W; digest {prof.digest[:12]}")
    for n in prof.notes:
        print(f"  note: {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
