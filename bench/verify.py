"""Predicted against measured: each job tuned on this GPU, then its plan and baselines verified.

For each job: ``kareus optimize --profiler nvml`` on the GPUs of this run
([`kareus.tune.tune`][kareus.tune.tune]: on one GPU, loopback collectives stand in for the
job's TP x CP group and each partition's energy is scaled to its group), then
``kareus verify`` on its output folder ([`kareus.workflow.verify`][kareus.workflow.verify]: the
tuned plan, Megatron-LM's sequential schedule and nanobatching in the library's training loop,
interleaved repeats, NVML energy scaled to the job the same way). Prints, per job and system,
the composed time and energy beside the measured ones and their ratios, and writes every
report (``--json``). Clocks are never changed (both steps use the dry-run frequency controller).

Jobs (``--jobs``): ``qwen3-cp2`` (qwen3-1.7b, TP=4 CP=2, 4 microbatches of 8 x 4096) and
``llama-tp2`` (llama3.2-3b, TP=2, the same batch).

Usage (1x H200, about 6 minutes for both jobs at the defaults)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 1 bench/verify.py --json bench/results/verify_1xh200.json

``--budget``, ``--steps``, ``--repeats`` and ``--jobs`` trade time for precision; ``--work``
keeps the tune folders (a second run of the same command resumes the tunes from their logs
and only verifies again).

``--quick``: a CPU smoke run of the same path (an emulated optimize of a tiny job, then the
verify dry run): its figures are NOT measurements.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast

#: name -> the workload's fields (Workload keyword arguments besides the model).
JOBS: dict[str, dict[str, Any]] = {
    "qwen3-cp2": {"model": "qwen3-1.7b", "tp": 4, "cp": 2},
    "llama-tp2": {"model": "llama3.2-3b", "tp": 2, "cp": 1},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no torch needed)."""
    ap = argparse.ArgumentParser(prog="verify.py", description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default="qwen3-cp2,llama-tp2",
                    help=f"comma-separated, of {', '.join(JOBS)} (default: both)")
    ap.add_argument("--budget", type=int, default=4, help="tune budget per partition type")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3, help="timed iterations per verify run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations per run first")
    ap.add_argument("--repeats", type=int, default=2, help="verify runs per system")
    ap.add_argument("--busy-steps", type=int, default=2,
                    help="queued iterations per system for the GPU-busy fraction (0: skip)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="the check's tolerance (the issue's 5%%; the table shows ratios)")
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the tune outputs (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true",
                    help="a CPU smoke run (emulated optimize of a tiny job, verify's dry run): "
                         "NOT a measurement")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    unknown = [j for j in args.jobs.split(",") if j not in JOBS]
    if unknown and not args.quick:
        ap.error(f"--jobs: unknown {unknown}; choose from {list(JOBS)}")
    if min(args.budget, args.steps, args.repeats) < 1 or args.warmup < 0:
        ap.error("--budget, --steps and --repeats must be >= 1, --warmup >= 0")
    return args


def ratio_rows(reports: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per job and system: predicted and measured time and total energy, ratios."""
    rows = []
    for job, rep in reports.items():
        for name, s in rep["systems"].items():
            m, p, r = s["measured"], s["predicted"], s["ratios"]
            rows.append([
                job, name, f"{p['time_s']:.4f}",
                f"{s['measured_time_s']:.4f}", _joules(p["total_j"]),
                "-" if m is None else _joules(m["total_j"]),
                f"{r['time_s']:.3f}" if r["time_s"] is not None else "-",
                f"{r['total_j']:.3f}" if r["total_j"] is not None else "-",
                "-" if s.get("gpu_busy") is None else f"{s['gpu_busy']:.2f}",
                "-" if s.get("sm_clock_mhz") is None else f"{s['sm_clock_mhz']:.0f}"])
    return rows


def _joules(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def table(rows: list[list[str]]) -> str:
    """A plain text table of ``ratio_rows``."""
    head = ["job", "system", "pred s", "meas s", "pred J", "meas J", "time", "energy",
            "busy", "SM MHz"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _quick(args: argparse.Namespace, work: Path, log: Any) -> dict[str, Any]:
    """The CPU smoke run: a tiny job optimized on the emulator, then verify's dry run."""
    import torch

    from kareus.model.workload import ModelArch, Parallelism, Workload
    from kareus.workflow import optimize, verify

    torch.set_num_threads(1)
    arch = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8,
                     ffn=64, vocab=50)
    wl = Workload(model=arch, parallelism=Parallelism(tp=2, cp=1), microbatch_size=2,
                  seq_len=8, num_microbatches=2, nanobatches=2)
    out = work / "tiny-tp2"
    optimize(wl, "h200-sxm", budget=min(args.budget, 4), seed=0,
             progress=False).save(out, figure=False)
    rep = verify(out, device="cpu", steps=args.steps, warmup=args.warmup,
                 repeats=args.repeats, tolerance=args.tolerance, log=print)
    assert rep is not None
    return {"tiny-tp2": rep.to_dict()}


def _measured(args: argparse.Namespace, work: Path, log: Any) -> dict[str, Any]:
    """Tune each job on this GPU, then verify its folder."""
    import torch

    from kareus.model.workload import Parallelism, Workload, get_model
    from kareus.tune import tune
    from kareus.workflow import verify

    reports: dict[str, Any] = {}
    for job in args.jobs.split(","):
        spec = JOBS[job]
        wl = Workload(model=get_model(spec["model"]),
                      parallelism=Parallelism(tp=spec["tp"], cp=spec["cp"]),
                      microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                      num_microbatches=args.microbatches)
        out = work / job
        t0 = time.perf_counter()
        log(f"{job}: tuning {wl.describe()} (budget {args.budget}) into {out}")
        tune(wl, out_dir=out, budget=args.budget, progress=False)
        tune_s = time.perf_counter() - t0
        torch.cuda.empty_cache()
        log(f"{job}: tuned in {tune_s:.0f} s; verifying")
        rep = verify(out, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                     busy_steps=args.busy_steps, tolerance=args.tolerance, log=print)
        torch.cuda.empty_cache()
        if rep is None:  # not rank 0
            continue
        print(rep.table(), flush=True)
        d = rep.to_dict()
        d["tune_s"] = tune_s
        d["verify_s"] = time.perf_counter() - t0 - tune_s
        try:
            tj = json.loads((out / "tune.json").read_text())
            d["tune"] = {k: tj.get(k) for k in ("machine", "energy_scope", "static_power_w",
                                                "execution", "clock_note", "software")}
        except (OSError, ValueError):
            d["tune"] = None
        reports[job] = d
    return reports


def main(argv: list[str] | None = None) -> int:
    """Tune and verify each job (or the CPU smoke run); print the table, write the JSON."""
    args = parse_args(argv)
    t_begin = time.perf_counter()

    def log(msg: str) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}", flush=True)

    with tempfile.TemporaryDirectory(prefix="kareus-verify-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        reports = _quick(args, work, log) if args.quick else _measured(args, work, log)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    rows = ratio_rows(reports)
    print()
    print(table(rows))
    measured = not args.quick
    print("ratios: measured / predicted (time per iteration; total energy over every GPU of "
          "the job, per iteration)" + ("" if measured else
                                       "  -- CPU SMOKE RUN: NOT A MEASUREMENT"))
    data = {
        "what": ("kareus verify after kareus optimize --profiler nvml on the same GPU(s): "
                 "composed (predicted) against measured time and energy per iteration, per "
                 "job and system" + ("" if measured else "; CPU SMOKE RUN, NOT A MEASUREMENT")),
        "measured": measured,
        "command": "bench/verify.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "jobs": reports,
        "table": rows,
        "elapsed_s": time.perf_counter() - t_begin,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
