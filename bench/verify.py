"""Predicted against measured: each job tuned on this GPU, then its plan and baselines verified.

For each job and each one-GPU stand-in for its collectives (``--loopbacks``: ``plain``, the
loopback kernel of each collective's bytes, and ``faithful``, which holds each collective's
SM count for the real collective's time from the measured collective curves: its figures
are a STAND-IN's): ``kareus optimize --profiler nvml`` on the GPUs of this run
([`kareus.tune.tune`][kareus.tune.tune]: on one GPU, loopback collectives stand in for the
job's TP x CP group and each partition's energy is scaled to its group), then
``kareus verify`` on its output folder ([`kareus.workflow.verify`][kareus.workflow.verify]: the
tuned plan, Megatron-LM's sequential schedule and nanobatching in the library's training loop,
interleaved repeats, NVML energy scaled to the job the same way). Prints, per job and system,
the composed time and energy beside the measured ones and their ratios, and writes every
report (``--json``). Then a straggler scenario (``--straggler``, ``straggler_scenario``): the
plan paced by a straggler elsewhere in the job, the switch along the frontier
(``TrainingLoop.retarget``) and the same iterations after it, measured. Clocks are never
changed (every step uses the dry-run frequency controller).

Jobs (``--jobs``): ``qwen3-cp2`` (qwen3-1.7b, TP=4 CP=2, 4 microbatches of 8 x 4096) and
``llama-tp2`` (llama3.2-3b, TP=2, the same batch).

Usage (1x H200; ``--time-limit-s``, 420 by default, skips the (job, loopback) units that
would start after it, each recorded as skipped, so one call ends within about 8 minutes)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 1 bench/verify.py --json bench/results/verify_1xh200.json

``--budget``, ``--steps``, ``--repeats``, ``--jobs`` and ``--loopbacks`` trade time for
precision; ``--work`` keeps the tune folders (a second run of the same command resumes the
tunes from their logs and only verifies again).

``--quick``: with a GPU, a short measured run (qwen3-cp2 at 4 of its 28 layers, said in the
output, budget 2, both loopbacks); without one (or with ``--cpu``), a CPU smoke run of the
same path (an emulated optimize of a tiny job, then the verify dry run): its figures are NOT
measurements.
"""

from __future__ import annotations

import argparse
import datetime
import gc
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
    ap.add_argument("--straggler", type=float, default=1.2,
                    help="after verifying, pace the plan by a straggler this many times "
                         "slower and measure the switch along the frontier (<= 1: skip)")
    ap.add_argument("--work", type=Path, default=None,
                    help="folder of the tune outputs (default: a temporary folder)")
    ap.add_argument("--loopbacks", default="plain,faithful",
                    help="one-GPU stand-ins to tune and verify each job with (comma list of "
                         "plain, faithful; default both)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of each job (default: the model's; said in the "
                         "output)")
    ap.add_argument("--time-limit-s", type=float, default=420.0,
                    help="start no (job, loopback) unit after this many seconds, nor one "
                         "that the last unit's duration says would end past it (default "
                         "420); skipped units are recorded")
    ap.add_argument("--quick", action="store_true",
                    help="with a GPU: qwen3-cp2 at 4 layers, budget 2, 2 steps, 1 repeat; "
                         "without one (or --cpu): a CPU smoke run (emulated optimize of a "
                         "tiny job, verify's dry run), NOT a measurement")
    ap.add_argument("--cpu", action="store_true",
                    help="with --quick: the CPU smoke run even where there is a GPU")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    unknown = [j for j in args.jobs.split(",") if j not in JOBS]
    if unknown and not args.quick:
        ap.error(f"--jobs: unknown {unknown}; choose from {list(JOBS)}")
    bad = [m for m in args.loopbacks.split(",") if m not in ("plain", "faithful")]
    if bad or not args.loopbacks:
        ap.error(f"--loopbacks: unknown {bad}; choose from plain, faithful")
    if args.layers is not None and args.layers < 1:
        ap.error("--layers must be >= 1")
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
                "-" if s.get("sm_clock_mhz") is None else f"{s['sm_clock_mhz']:.0f}",
                s.get("energy_method") or "-"])
    return rows


def _joules(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def table(rows: list[list[str]]) -> str:
    """A plain text table of ``ratio_rows``."""
    head = ["job/loopback", "system", "pred s", "meas s", "pred J", "meas J", "time",
            "energy", "busy", "SM MHz", "energy from"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in
                       enumerate(zip(r, widths))) for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _window_energy(meter: Any, t0: float, t1: float, k: int) -> tuple[float | None, str | None]:
    """This GPU's energy per iteration over a window of ``k`` iterations and how it was
    measured (the counter between its steps; NVML's power readings where it did not step;
    ``(None, None)``: not measured)."""
    e, d, counted = meter.energy_between(t0, t1)
    if counted >= 1 and d > 0:
        return e / d * (t1 - t0) / k, getattr(meter, "energy_method", "nvml_counter")
    if hasattr(meter, "mean_power_w"):
        power, _ = meter.mean_power_w(t0, t1)
        if power is not None:
            return power * (t1 - t0) / k, "nvml_power_samples"
    return None, None


def straggler_scenario(folder: Path, *, slowdown: float, steps: int, device: str | None,
                       log: Any, loopback: str = "plain") -> dict[str, Any]:
    """A straggler elsewhere in the job, then the switch along the frontier, measured.

    The tuned plan runs in the training loop, first alone (its iteration time ``T0``),
    then paced by a straggler: the iteration cannot end before ``slowdown x T0`` (on a GPU
    a sleeping kernel of that length on a side stream that the next iteration waits for,
    as a slow replica's gradient reduction would make it wait; on the CPU a host sleep).
    Then ``loop.retarget(stage_slowdown={0: slowdown})`` moves to the lowest-energy point
    that finishes within that pace (Perseus's rule), and the same paced iterations run
    under it. Clocks are never changed (the dry-run controller), so the points differ in
    their SM counts, slots and nanobatching only. Returns times and energies (scaled to the
    job) of each phase, the points' predictions, and the first iteration after each switch
    (unpaced: its capture of the new point's graphs; a switch back captures nothing). Each
    phase runs at least ``steps`` iterations and lasts at least ``min_energy_window_s`` of
    the meter (the energy counter steps inside it); its energy says how it was measured.
    ``loopback``: the one-GPU stand-in (``"faithful"``: a STAND-IN's figures).
    """
    import contextlib

    import torch

    from kareus.compose import IterationFrontier, Plan
    from kareus.exec.nvml_device import min_energy_window_s
    from kareus.workflow.verification import job_measurement, open_job_loop

    plan = Plan.load(folder / "plan.json")
    frontier = IterationFrontier.load(folder / "frontier.json")
    out: dict[str, Any] = {"slowdown": slowdown, "frontier_points": len(frontier)}
    with contextlib.ExitStack() as stack:
        job = open_job_loop(stack, plan, device=device, loopback=loopback)
        loop, meter, cuda = job.loop, job.meter, not job.cpu
        wl = job.workload
        side = torch.cuda.Stream() if cuda else None
        cycles_per_s = 0.0
        if cuda:
            from kareus.exec.device_time import sleep_cycles_per_s

            cycles_per_s = sleep_cycles_per_s()

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def iterations(n: int, pace_s: float) -> list[float]:
            """``n`` iterations, each at least ``pace_s`` long (0: unpaced); their times."""
            times = []
            for _ in range(n):
                if cuda:
                    assert side is not None
                    a, b = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
                    a.record()
                    if pace_s > 0:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            torch.cuda._sleep(int(pace_s * cycles_per_s))
                    loop.step("kareus")
                    if pace_s > 0:
                        torch.cuda.current_stream().wait_stream(side)
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) / 1e3)
                else:
                    t = time.perf_counter()
                    loop.step("kareus")
                    time.sleep(max(0.0, pace_s - (time.perf_counter() - t)))
                    times.append(time.perf_counter() - t)
            return times

        window_s = 0.0 if job.cpu else min_energy_window_s(meter)

        def phase(n: int, pace_s: float) -> dict[str, Any]:
            sync()
            t0 = time.perf_counter()
            times = iterations(n, pace_s)
            while time.perf_counter() - t0 < window_s:  # long enough for the counter
                left = window_s - (time.perf_counter() - t0)
                more = max(1, int(1.05 * left / max(sum(times) / len(times), 1e-6)) + 1)
                times += iterations(max(job.gather(more)), pace_s)
            sync()
            t1 = time.perf_counter()
            k = len(times)
            per_gpu, method = _window_energy(meter, t0, t1, k)
            energy = None
            if per_gpu is not None:
                energy = job_measurement(
                    time_s=sum(times) / k, energy_j=per_gpu, measured_gpus=job.world,
                    job_gpus=wl.parallelism.world_size,
                    job_static_power_w=loop.plan.static_power_w).energy_j
            return {"time_s": sum(times) / k, "energy_j": energy, "energy_method": method,
                    "iterations": k, "window_s": t1 - t0, "times_s": times,
                    "plan": loop.plan.digest[:12], "predicted_time_s": loop.plan.time_s,
                    "predicted_energy_j": loop.plan.energy_j}

        loop.reset()
        iterations(1, 0.0)  # capture, compile
        base = phase(steps, 0.0)
        pace = slowdown * base["time_s"]
        log(f"straggler: the plan alone {base['time_s']:.4f} s/iteration; paced at "
            f"{pace:.4f} s")
        before = phase(steps, pace)
        chosen = loop.retarget(stage_slowdown={0: slowdown}, frontier=frontier)
        # the new point's first iteration, unpaced: its capture (graphs) and first replay
        switch = iterations(1, 0.0)[0]
        after = phase(steps, pace)
        loop.retarget(stage_slowdown={0: 1.0})
        back = iterations(1, 0.0)[0]  # back to the first point: its graphs replayed
        out.update({"loopback": loopback, "stand_in": job.stand_in,
                    "straggler_amount_s": pace - base["time_s"],
                    "alone": base, "paced_before": before, "paced_after": after,
                    "switched_to": {"digest": chosen.digest[:12],
                                    "predicted_time_s": chosen.time_s,
                                    "predicted_energy_j": chosen.energy_j,
                                    "same_point": chosen.digest == plan.digest},
                    "first_iteration_after_switch_s": switch,
                    "first_iteration_after_switch_back_s": back,
                    "executors_built": loop.frontier_switch.built,
                    "measured": not job.cpu})
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    b, a = out["paced_before"], out["paced_after"]
    log(f"straggler {slowdown:g}x: before the switch {b['time_s']:.4f} s, "
        f"{b['energy_j'] or float('nan'):.1f} J; after ({out['switched_to']['digest']}) "
        f"{a['time_s']:.4f} s, {a['energy_j'] or float('nan'):.1f} J"
        + ("" if out["measured"] else "  -- CPU: NOT A MEASUREMENT"))
    return out


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
    found: dict[str, Any] = {}
    for mode in args.loopbacks.split(","):
        rep = verify(out, device="cpu", steps=args.steps, warmup=args.warmup,
                     repeats=args.repeats, tolerance=args.tolerance, log=print,
                     loopback=mode)
        assert rep is not None
        d = rep.to_dict()
        if args.straggler > 1 and mode == args.loopbacks.split(",")[0]:
            d["straggler"] = straggler_scenario(out, slowdown=args.straggler,
                                                steps=args.steps, device="cpu", log=log,
                                                loopback=mode)
        found["tiny-tp2" if mode == "plain" else f"tiny-tp2/{mode}"] = d
    return found


def _workload(job: str, args: argparse.Namespace) -> Any:
    """The job's workload at the bench's batch (``--layers``: fewer decoder layers)."""
    import attrs

    from kareus.model.workload import Parallelism, Workload, get_model

    spec = JOBS[job]
    model = get_model(spec["model"])
    if args.layers is not None:
        model = attrs.evolve(model, layers=args.layers)
    return Workload(model=model, parallelism=Parallelism(tp=spec["tp"], cp=spec["cp"]),
                    microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                    num_microbatches=args.microbatches)


def _measured(args: argparse.Namespace, work: Path, log: Any, t_begin: float
              ) -> dict[str, Any]:
    """Tune each job on this GPU with each loopback, then verify its folder (the same
    loopback); the straggler scenario on each job's last loopback. Units that would start
    past ``--time-limit-s`` are skipped and recorded."""
    import torch

    from kareus.tune import tune
    from kareus.workflow import verify

    reports: dict[str, Any] = {}
    modes = args.loopbacks.split(",")
    last_unit_s = 0.0
    for job in args.jobs.split(","):
        wl = _workload(job, args)
        for mode in modes:
            key = f"{job}/{mode}"
            elapsed = time.perf_counter() - t_begin
            if elapsed + last_unit_s > args.time_limit_s:
                log(f"{key}: SKIPPED (time: {elapsed:.0f} s elapsed, the last unit took "
                    f"{last_unit_s:.0f} s, limit {args.time_limit_s:.0f} s)")
                reports[key] = {"skipped": f"time limit {args.time_limit_s:.0f} s",
                                "systems": {}}
                continue
            out = work / job / mode
            t0 = time.perf_counter()
            log(f"{key}: tuning {wl.describe()} ({wl.model.layers} layers, budget "
                f"{args.budget}, {mode} loopback) into {out}")
            tune(wl, out_dir=out, budget=args.budget, progress=False, loopback=mode)
            tune_s = time.perf_counter() - t0
            gc.collect()  # the tune's programs and graphs, before the loop's
            torch.cuda.empty_cache()
            log(f"{key}: tuned in {tune_s:.0f} s; verifying")
            rep = verify(out, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                         busy_steps=args.busy_steps, tolerance=args.tolerance, log=print,
                         loopback=mode)
            gc.collect()
            torch.cuda.empty_cache()
            if rep is not None:
                print(rep.table(), flush=True)
            d = rep.to_dict() if rep is not None else {"systems": {}}
            d["tune_s"] = tune_s
            d["verify_s"] = time.perf_counter() - t0 - tune_s
            d["layers"] = wl.model.layers
            try:
                tj = json.loads((out / "tune.json").read_text())
                d["tune"] = {k: tj.get(k) for k in (
                    "machine", "energy_scope", "static_power_w", "execution", "clock_note",
                    "software", "loopback", "stand_in", "collectives")}
            except (OSError, ValueError):
                d["tune"] = None
            if args.straggler > 1 and mode == modes[-1]:
                d["straggler"] = straggler_scenario(out, slowdown=args.straggler,
                                                    steps=args.steps, device=None, log=log,
                                                    loopback=mode)
            last_unit_s = time.perf_counter() - t0
            d["unit_s"] = last_unit_s
            reports[key] = d
    return reports


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


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
        cpu_smoke = args.quick and (args.cpu or not _has_cuda())
        if args.quick and not cpu_smoke:  # a short measured run
            args.jobs, args.layers = "qwen3-cp2", args.layers or 4
            args.budget, args.steps, args.repeats = min(args.budget, 2), 2, 1
        reports = (_quick(args, work, log) if cpu_smoke
                   else _measured(args, work, log, t_begin))
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    rows = ratio_rows(reports)
    print()
    print(table(rows))
    measured = not cpu_smoke
    print("ratios: measured / predicted (time per iteration; total energy over every GPU of "
          "the job, per iteration)" + ("" if measured else
                                       "  -- CPU SMOKE RUN: NOT A MEASUREMENT"))
    if any(k.endswith("/faithful") for k in reports):
        print("*/faithful rows: STAND-IN (time-faithful loopback: one GPU, no links); each "
              "collective held its SM count for the real collective's time (measured curves "
              "of 2 and 4 H200s, or the emulator's link model: see each job's "
              "'collectives')")
    data = {
        "what": ("kareus verify after kareus optimize --profiler nvml on the same GPU(s): "
                 "composed (predicted) against measured time and energy per iteration, per "
                 "job and system" + ("" if measured else "; CPU SMOKE RUN, NOT A MEASUREMENT")),
        "measured": measured,
        "command": "bench/verify.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "jobs": reports,
        "stand_in": sorted(k for k in reports if k.endswith("/faithful")),
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
