"""Validate the emulator on a measured grid it was not calibrated on.

``data/h200_llama3b_tp2_grid.json`` (measured by ``bench/h200_study.py`` on 2x H200,
NVLink, default clocks, NCCL with min_ctas = max_ctas = comm_sms): Llama 3.2 3B
``fwd_attn`` and ``fwd_mlp`` partitions at TP=2 (microbatch 8, sequence 4096, two
nanobatches), energy summed over the 2 GPUs. Every measured configuration (the grid of
comm SMs x launch slots, the search's points, repeats and the baselines) is emulated on the
``h200-sxm`` preset with NCCL's measured collective curves for 2 GPUs
(``comm_backend="nccl"``, from ``bench/collectives.py``) and the interference constants
fitted by ``bench/probes/emulator_calibration.py`` on the 4-GPU probe (nothing is fitted to this
grid).
NCCL's own CTA choice (``comm_sms`` null) is taken as 32, as in the calibration. The
``megatron`` baseline is the whole microbatch without nanobatching (a partition built with
``nanobatches=1``), emulated as such.

Stream priority (:attr:`~kareus.profilers.emulator.EmulatedGPU.comm_priority`): the grid is
emulated at the priority its collectives ran at, its ``"comm_priority"`` field
(``bench/h200_study.py --comm-priority`` records it), else ``"normal"`` (this grid predates
the option and ran NCCL at normal priority: a collective launched with op k starts when op
k ends); ``--comm-priority high|normal`` emulates it at that priority instead
(``measured``, the default: as measured).

Usage::

    python bench/probes/emulator_validation_tp2.py --json bench/probes/results/emulator_validation_tp2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from kareus.model.config import ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.workload import Workload
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler, measured_priority

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "h200_llama3b_tp2_grid.json"
CALIBRATION = REPO / "bench" / "probes" / "results" / "emulator_calibration.json"


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def run(args: argparse.Namespace) -> dict[str, object]:
    data = json.loads(DATA.read_text())
    wl = data["workload"]
    workload = Workload.preset(wl["model"], tp=wl["tp"], cp=wl["cp"], pp=wl["pp"],
                               dp=wl["dp"], microbatch_size=wl["microbatch_size"],
                               seq_len=wl["seq_len"], nanobatches=wl["nanobatches"])
    parts = build_partitions(workload)
    whole = build_partitions(workload.with_(nanobatches=1))
    consts = json.loads(CALIBRATION.read_text())["gpu_constants"]
    # NCCL's measured curves for 2 GPUs (bench/results/collectives_2xh200_nvlink.json) and
    # the interference constants fitted on the 4-GPU probe's NCCL runs.
    overrides = {k: consts[k] for k in ("comm_interference", "tensor_interference")}
    backend = "nccl"
    if args.preset_comm:
        overrides, backend = {}, "own"
    priority, priority_from = measured_priority(data, args.comm_priority)
    gpu = EmulatedGPU.from_spec("h200-sxm", comm_backend=backend, comm_priority=priority,
                                **overrides)
    prof = EmulatedProfiler(gpu, noise=0.0)  # scope: the stage's TP GPUs, as measured
    rows = []
    for m in data["measurements"]:
        c = m["config"]
        sms = args.nccl_default_ctas if c["comm_sms"] is None else int(c["comm_sms"])
        part = (whole if m["kind"] == "megatron" else parts)[m["partition"]]
        tr = prof.trace(part, ScheduleConfig(int(c["freq_mhz"]), sms, c["launch_slot"]))
        energy = tr.energy_j * part.group_gpus
        meas = m["measurement"]
        rows.append({
            "kind": m["kind"], "partition": m["partition"], "comm_sms": c["comm_sms"],
            "launch_slot": c["launch_slot"],
            "measured_ms": round(meas["time_s"] * 1e3, 4), "emulated_ms": round(tr.time_s * 1e3, 4),
            "measured_j": round(meas["energy_j"], 4), "emulated_j": round(energy, 4),
            "measured_clock_mhz": m.get("sm_clock_mhz"), "emulated_clock_mhz": tr.freq_mhz,
            "time_rel_err": round(tr.time_s / meas["time_s"] - 1, 4),
            "energy_rel_err": round(energy / meas["energy_j"] - 1, 4)})
    out: dict[str, object] = {
        "what": "emulated (h200-sxm preset + NCCL constants fitted on the 4-GPU probe, noise off) "
                "vs measured (data/h200_llama3b_tp2_grid.json, 2x H200); energy over the 2 GPUs",
        "machine": "2-core CPU, emulated", "nccl_default_ctas": args.nccl_default_ctas,
        "comm_backend": backend, "overrides": overrides,
        "comm_priority": priority, "comm_priority_from": priority_from}
    summary = {}
    for name in ("fwd_attn", "fwd_mlp", "all"):
        sel = [r for r in rows if name == "all" or r["partition"] == name]
        grid = [r for r in sel if r["kind"] == "grid"]
        best_m = min(grid, key=lambda r: r["measured_j"])
        best_e = min(grid, key=lambda r: r["emulated_j"])
        summary[name] = {
            "n": len(sel),
            "time_median_abs_rel_err": round(statistics.median(abs(r["time_rel_err"]) for r in sel), 4),
            "energy_median_abs_rel_err": round(statistics.median(abs(r["energy_rel_err"])
                                                                 for r in sel), 4),
            "time_spearman": round(spearman([r["measured_ms"] for r in sel],
                                            [r["emulated_ms"] for r in sel]), 3),
            "energy_spearman": round(spearman([r["measured_j"] for r in sel],
                                              [r["emulated_j"] for r in sel]), 3),
            "grid_best_measured": [best_m["comm_sms"], best_m["launch_slot"], best_m["measured_j"]],
            "grid_best_emulated": [best_e["comm_sms"], best_e["launch_slot"], best_e["emulated_j"],
                                   "its measured energy", best_e["measured_j"]],
            "regret_of_emulated_best": round(best_e["measured_j"] / best_m["measured_j"] - 1, 4),
        }
    out["summary"] = summary
    out["rows"] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--nccl-default-ctas", type=int, default=32)
    ap.add_argument("--preset-comm", action="store_true",
                    help="model kareus's own kernels (the preset) instead of NCCL")
    ap.add_argument("--comm-priority", choices=("high", "normal", "measured"),
                    default="measured",
                    help="stream priority to emulate the grid at (default measured: the "
                         "grid's 'comm_priority', else normal, as it ran)")
    args = ap.parse_args(argv)
    res = run(args)
    print(f"at {res['comm_priority']} stream priority ({res['comm_priority_from']})")
    print(f"{'kind':>11} {'part':>8} {'sms':>4} {'slot':>9} | {'ms meas':>7} {'ms emu':>7} "
          f"{'err':>6} | {'J meas':>6} {'J emu':>6} {'err':>6} | {'MHz m':>6} {'MHz e':>5}")
    for r in res["rows"]:  # type: ignore[union-attr]
        print(f"{r['kind']:>11} {r['partition']:>8} {str(r['comm_sms']):>4} "
              f"{str(r['launch_slot']):>9} | {r['measured_ms']:7.3f} {r['emulated_ms']:7.3f} "
              f"{r['time_rel_err']:+6.1%} | {r['measured_j']:6.3f} {r['emulated_j']:6.3f} "
              f"{r['energy_rel_err']:+6.1%} | {r['measured_clock_mhz'] or 0:6.0f} "
              f"{r['emulated_clock_mhz']:5d}")
    for k, v in res["summary"].items():  # type: ignore[union-attr]
        print(k, v)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        res["command"] = "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])])
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
