"""The emulator's eager and graphed execution against a measured ``bench/host_bound.py`` run.

For every partition row of a ``host_bound`` result (measured on a GPU), the emulated
time of the same partition at the same launch slot under the calibrated emulator (the
shipped profile of the GPU, no noise) in ``execution="eager"`` and ``"graphed"``, and the
ratio eager / graphed next to the measured one: how well the emulator's model of the
host (per-op launch costs, docs/emulator.md) predicts where eager launches hold the GPU
back. Runs on a CPU.

Usage::

    python bench/probes/host_bound_emulated.py bench/results/host_bound_h200.json \\
        --json bench/probes/results/host_bound_emulated_h200.json

Prints a table and writes JSON (``--json``). The SM count of the emulated collective is
16 (the loopback stand-in of the measurement applies none; the ratio hardly depends on it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

#: host_bound's workload labels -> (preset, TP, CP, microbatch size)
WORKLOADS = {
    "llama3.2-3b tp4": ("llama3.2-3b", 4, 1, 8),
    "qwen3-1.7b tp4cp2 mb8": ("qwen3-1.7b", 4, 2, 8),
    "qwen3-1.7b tp4cp2 mb16": ("qwen3-1.7b", 4, 2, 16),
    "llama3.3-70b tp8": ("llama3.3-70b", 8, 1, 8),
}


def compare(result: dict[str, Any], *, gpu: str = "h200-sxm", sms: int = 16
            ) -> list[dict[str, Any]]:
    """One row per measured partition: measured and emulated eager / graphed ratios."""
    from kareus.model.config import ScheduleConfig
    from kareus.model.decoder import QK_NORM_OPS
    from kareus.model.gpu_profile import GPUProfile
    from kareus.model.partition import build_partitions
    from kareus.model.workload import Workload
    from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler

    base = EmulatedGPU.from_profile(GPUProfile.preset(gpu))
    emus = {m: EmulatedProfiler(base, noise=0.0, execution=m) for m in ("eager", "graphed")}
    freq = base.spec.max_clock_mhz
    rows = []
    for r in result["partitions"]:
        preset, tp, cp, mbs = WORKLOADS[r["workload"]]
        wl = Workload.preset(preset, tp=tp, cp=cp, microbatch_size=mbs, seq_len=4096,
                             nanobatches=2)
        part = build_partitions(wl).types[r["partition"]]
        slot = r["slot"]
        if slot is not None and slot not in [s.name for s in part.slots]:
            # measured before the query/key norms were fused with RoPE: the fused op took
            # RoPE's place (and launch slot) in a qk-norm layer's op list
            slot = {old: fused for old, fused in QK_NORM_OPS.values()}.get(slot, slot)
        cfg = ScheduleConfig(freq, sms, slot)
        t = {m: e.ground_truth(part, cfg).time_s for m, e in emus.items()}
        rows.append({"workload": r["workload"], "partition": r["partition"],
                     "measured_eager_over_graphed": r["eager_s"] / r["graphed_s"],
                     "emulated_eager_over_graphed": t["eager"] / t["graphed"],
                     "emulated_eager_s": t["eager"], "emulated_graphed_s": t["graphed"],
                     "measured_eager_s": r["eager_s"], "measured_graphed_s": r["graphed_s"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; write JSON with ``--json``."""
    ap = argparse.ArgumentParser(prog="host_bound_emulated.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path, help="a bench/host_bound.py JSON result")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    result = json.loads(args.result.read_text(encoding="utf-8"))
    rows = compare(result)
    print(f"{'workload':24s} {'partition':16s} {'measured':>9s} {'emulated':>9s}  "
          "(eager / graphed time)")
    for r in rows:
        print(f"{r['workload']:24s} {r['partition']:16s} "
              f"{r['measured_eager_over_graphed']:8.2f}x {r['emulated_eager_over_graphed']:8.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "bench": "host_bound_emulated", "measured": str(args.result),
            "measured_machine": result.get("machine"), "measured_date": result.get("date"),
            "emulated": "shipped h200-sxm profile, noise 0, collective at 16 SMs",
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
