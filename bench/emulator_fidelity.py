"""Fidelity of the emulated GPU against every measured configuration grid in ``data/``.

For each measured grid (a JSON file written by ``bench/h200_study.py``: by default every
``data/*_grid*.json``, today the two TP=2 grids on 2x H200; a TP=4 grid is picked up as
soon as it lands there), every measured configuration is emulated and compared:

* **median relative error** of time and of energy over every measured row of the grid
  (grid points, the search's points, repeats and the Megatron-LM / nanobatching
  baselines). Energy is total energy of one run of the partition summed over the
  partition's GPUs (its TP x CP group, as the grid's NVML counters were summed), static
  and idle power included; the emulated energy has the same scope
  (``EmulatedProfiler.ground_truth``, whose Measurement covers ``partition.group_gpus``);
* **Spearman rank correlation** (``scipy.stats.spearmanr``) between measured and emulated
  time, and energy, among the overlapped grid configurations of each partition type (grid
  rows with a launch slot; one row per configuration);
* **the emulator's pick**: the grid configuration with the lowest emulated energy (and
  the one with the lowest emulated time), and its *measured* energy (time) against the
  lowest measured, in percent (0% = the emulator picked the measured best);
* **savings**: the best grid configuration's saving over the Megatron-LM (half of its
  whole-microbatch run), sequential and default-nanobatching baselines, measured and
  emulated, each side against its own baseline (does the emulator overstate what
  overlap saves?).

Targets (issue 16): median error <= 8% in time and energy; Spearman >= 0.9; the pick
within 2% of the measured best in energy and in time.

**Measurement floor.** Where two grids measured the same workload on the same machine
(today the two TP=2 grids, on 6 common SM caps x 6 slots), they are compared with each
other in the same way (``measurement_floor``; the pick column is the worse of the two
directions): no emulator can agree with one measurement better than a second
measurement of the same configurations does.

The emulator is the GPU preset named in the grid (``h200-sxm``) with the collective
curves of the backend the grid ran (NCCL capped with ``min_ctas = max_ctas``:
``comm_backend="nccl"``) and nothing else changed; NCCL's own CTA choice (``comm_sms``
null) is taken as the preset's ``default_comm_sms`` (32). The ``megatron`` row is the
whole microbatch without nanobatching (a partition built with ``nanobatches=1``).
``--gpu-profile PATH`` asks for the emulator calibrated from a measured
:class:`kareus.model.gpu_profile.GPUProfile` instead (``EmulatedGPU.from_profile(path,
comm_backend="nccl")``; ``--gpu-profile h200-sxm`` names the profile shipped with kareus);
until the emulator has that constructor it stops with a message saying so.

**Stream priority.** Each grid is emulated at the stream priority its collectives ran at
(:attr:`kareus.profilers.EmulatedGPU.comm_priority`): the grid's ``"comm_priority"`` field
(``bench/h200_study.py --comm-priority`` records it), else ``"normal"``: every grid
measured before that option ran its collectives at normal priority, where a collective
launched with an op gets SMs only once that op's blocks are all dispatched.
``--comm-priority high|normal`` emulates every grid at that priority instead.

The grids ran the runnable partitions' eager kernels of the time (hand-written RMSNorm and
RoPE, copied K/V before SDPA): the emulated ops are fused. A calibrated emulator must take
its per-op inputs from measurements of the kernels that ran.

``--residuals PATH`` also writes, per measured row, measured and emulated time, energy, SM
clock and power per GPU, the emulated timeline, the emulated time at the measured clock
(power limit off), and the residuals (emulated / measured - 1) by launch slot and CTA
count, with the launch-slot shift check (:func:`shifted_slot`, evaluated at high priority)
and the agreement of the residual pattern between grids of the same workload
(docs/fidelity.md, "Where fwd_mlp's ranking departs").

Usage (CPU, a few seconds)::

    python bench/emulator_fidelity.py --json bench/results/emulator_fidelity.json
    python bench/emulator_fidelity.py --gpu-profile h200-sxm \
        --residuals bench/results/emulator_fidelity_residuals.json
    python bench/emulator_fidelity.py --gpu-profile h200-sxm --comm-priority high \
        --residuals bench/results/emulator_fidelity_residuals_high.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import attrs
from scipy.stats import pearsonr, spearmanr

from kareus._io import read_json, write_json_atomic
from kareus.model import Partition, ScheduleConfig, Workload, build_partitions
from kareus.model.gpu import get_gpu
from kareus.model.gpu_profile import GPUProfile, GPUProfileError, OpProfile, shipped_profiles
from kareus.model.ops import OpKind
from kareus.profilers import EmulatedGPU, EmulatedProfiler
from kareus.profilers.emulator import measured_priority, profile_workload_key

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"median_rel_err_max": 0.08, "spearman_min": 0.9, "pick_regret_max": 0.02}


class GridError(ValueError):
    """A grid file that this bench cannot read."""


def default_grids() -> list[Path]:
    """Every measured configuration grid in ``data/`` (files named ``*_grid*.json``)."""
    return sorted((REPO / "data").glob("*_grid*.json"))


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


# What each measured grid's attention ran (docs/fidelity.md): the first grid copied K and V
# to every head before SDPA, the second handed grouped K/V to SDPA (``enable_gqa``), both
# on PyTorch 2.11's default SDPA dispatch. bench/probes/sdpa_gqa_probe.py timed both at the grids'
# TP=2 shapes on one H200 (bench/probes/results/sdpa_gqa_probe_h200.json).
SDPA_PROBE = REPO / "bench" / "probes" / "results" / "sdpa_gqa_probe_h200.json"
AS_RUN_ATTENTION = {
    "h200_llama3b_tp2_grid.json": ("sdpa_repeat_interleave_ms",
                                   "SDPA default dispatch, K/V copied to every head"),
    "h200_llama3b_tp2_grid13.json": ("sdpa_enable_gqa_ms",
                                     "SDPA default dispatch, grouped K/V (enable_gqa)"),
}
AS_RUN = "as-run"


def load_profile(profile: Path) -> tuple[GPUProfile, str]:
    """The measured profile (a file, or the name of one shipped with kareus) and its label."""
    if not profile.exists() and str(profile) in shipped_profiles():
        return GPUProfile.preset(str(profile)), f"the shipped profile {profile}"
    return GPUProfile.load(profile), _rel(profile)  # validates (typed GPUProfileError)


def as_run_profile(prof: GPUProfile, grid: Path, workload: Workload,
                   recorded: str | None = None) -> tuple[GPUProfile, tuple[str, ...], str]:
    """The profile and the kernel sets to calibrate with, in order, for the kernels this
    grid ran. A grid that records its kernel set (``recorded``) gets that set. The two
    TP=2 grids ran the eager formulas before the fused kernels existed: for them the
    profile gains the measurement of their attention (the SDPA probe at the grids' shapes),
    then the eager ``reference`` set (RMSNorm, RoPE, SwiGLU), then the main set. Any other
    grid ran the runnable partitions' default kernels: the profile's main set."""
    if recorded:
        return prof, (recorded,), f"kernel set {recorded!r} (recorded in the grid)"
    entry = AS_RUN_ATTENTION.get(grid.name)
    if entry is None:
        return prof, (), f"kernel set {prof.kernel_set!r} (the default kernels)"
    sets: tuple[str, ...] = ("reference",) if "reference" in prof.kernel_sets else ()
    if not SDPA_PROBE.exists():
        return prof, sets, "reference set (no attention measurement of this grid's kernel)"
    probe = read_json(SDPA_PROBE, error=GridError, what="SDPA probe")
    key, what = entry
    w = workload
    rec = OpProfile(
        workload=profile_workload_key(w.model.name, tp=w.parallelism.tp, cp=w.parallelism.cp,
                                      microbatch_size=w.microbatch_size, seq_len=w.seq_len,
                                      nanobatches=w.nanobatches),
        partition="fwd_attn", op="attn_core", kind="attention", time_s=probe[key] * 1e-3,
        kernel=f"{what}, torch {probe.get('torch', '?')}", kernels=AS_RUN)
    return (attrs.evolve(prof, ops=(*prof.ops, rec)), (AS_RUN, *sets),
            f"attention: {what} ({_rel(SDPA_PROBE)}: {probe[key]:.3f} ms at the grid's shapes); "
            "norm, RoPE, SwiGLU: reference set")


def make_emulator(gpu: str, profile: Path | None, kernels: str | None = None,
                  grid: Path | None = None, workload: Workload | None = None,
                  recorded: str | None = None, comm_priority: str = "high"
                  ) -> tuple[EmulatedGPU, str]:
    """The emulated GPU compared with a grid, and how it was made (for the JSON).

    ``kernels``: the profile's kernel set to calibrate ops with; ``"as-run"`` (the default
    with a profile): per grid, the measurements of the kernels that grid ran
    (:func:`as_run_profile`). ``comm_priority``: the collective's stream priority
    (:attr:`EmulatedGPU.comm_priority`), not named in the description."""
    if profile is None:
        return (EmulatedGPU.from_spec(gpu, comm_backend="nccl", comm_priority=comm_priority),
                f"preset {gpu} (uncalibrated), NCCL's measured collective curves")
    prof, where = load_profile(profile)
    digest = prof.digest[:12]
    if (kernels or AS_RUN) == AS_RUN and grid is not None and workload is not None:
        prof, sets, how = as_run_profile(prof, grid, workload, recorded)
    else:
        sets, how = ((kernels,) if kernels else ()), f"kernel set {kernels or prof.kernel_set!r}"
    emu = EmulatedGPU.from_profile(prof, comm_backend="nccl", kernels=sets or None,
                                   comm_priority=comm_priority)
    return emu, (f"calibrated from {where} (digest {digest}): per-op measurements ({how}); "
                 "NCCL-capped collective curves fitted to its points")


def _workload(w: dict[str, Any]) -> Workload:
    return Workload.preset(w["model"], tp=w["tp"], cp=w.get("cp", 1), pp=w.get("pp", 1),
                           dp=w.get("dp", 1), microbatch_size=w["microbatch_size"],
                           seq_len=w["seq_len"], nanobatches=w["nanobatches"])


def _median_abs(xs: list[float]) -> float:
    return statistics.median(abs(x) for x in xs)


def _spearman(a: list[float], b: list[float]) -> float | None:
    if len(a) < 3:
        return None
    rho = spearmanr(a, b).statistic
    return None if rho != rho else float(rho)  # NaN (a constant column) -> None


def _cfg(r: dict[str, Any]) -> str:
    slot = r["launch_slot"] or "sequential"
    return f"{r['comm_sms'] if r['comm_sms'] is not None else 'nccl-default'} CTAs, {slot}"


def evaluate_grid(path: Path, gpu_name: str, profile: Path | None = None,
                  kernels: str | None = None, detail: bool = False,
                  comm_priority: str | None = None) -> dict[str, Any]:
    """Emulate every measured row of the grid file ``path``; errors, ranks and picks.
    ``comm_priority``: emulate at this stream priority instead of the grid's
    (:func:`kareus.profilers.emulator.measured_priority`).
    ``detail``: each row also gets the average power per GPU on both sides, the emulated
    timeline (collective start and end, end of the computation), the emulated time and
    power at the measured clock and the launch-slot shift check (:func:`shifted_slot`),
    for ``--residuals``."""
    data = read_json(path, error=GridError, what="measured grid")
    for key in ("workload", "measurements", "gpu"):
        if key not in data:
            raise GridError(f"measured grid {path} has no {key!r}: it is not a file written "
                            "by bench/h200_study.py")
    if data["gpu"] != gpu_name:
        raise GridError(f"measured grid {path} ran on {data['gpu']}, the emulator models "
                        f"{gpu_name}")
    workload = _workload(data["workload"])
    recorded = data.get("kernels") or (data.get("software") or {}).get("kernels")
    priority, priority_from = measured_priority(data, comm_priority)
    gpu, how = make_emulator(gpu_name, profile, kernels, path, workload,
                             recorded if isinstance(recorded, str) else None, priority)
    parts = build_partitions(workload)
    whole = build_partitions(workload.with_(nanobatches=1))
    prof = EmulatedProfiler(gpu, noise=0.0)
    free = EmulatedProfiler(gpu, noise=0.0, power_limit=False) if detail else None
    # The slot-shift check evaluates the emulator at high priority (its meaning before the
    # priority rule: the collective taking its SMs at the shifted slot).
    high = (prof if gpu.comm_priority == "high"
            else EmulatedProfiler(gpu.with_(comm_priority="high"), noise=0.0))
    rows: list[dict[str, Any]] = []
    for m in data["measurements"]:
        if "measurement" not in m:
            continue  # a failed measurement
        c = m["config"]
        sms = gpu.spec.default_comm_sms if c["comm_sms"] is None else int(c["comm_sms"])
        part = (whole if m["kind"] == "megatron" else parts)[m["partition"]]
        cfg = ScheduleConfig(int(c["freq_mhz"]), sms, c["launch_slot"])
        emu = prof.ground_truth(part, cfg)  # energy over partition.group_gpus GPUs
        trace = prof.trace(part, cfg)
        clock = trace.freq_mhz
        meas = m["measurement"]
        if detail:
            extra = _row_detail(prof, free, part, cfg, trace, emu, meas, m.get("sm_clock_mhz"),
                                high)
        rows.append({
            "kind": m["kind"], "partition": m["partition"], "comm_sms": c["comm_sms"],
            "launch_slot": c["launch_slot"], "gpus": part.group_gpus,
            "measured_ms": meas["time_s"] * 1e3, "emulated_ms": emu.time_s * 1e3,
            "measured_j": meas["energy_j"], "emulated_j": emu.energy_j,
            "measured_clock_mhz": m.get("sm_clock_mhz"), "emulated_clock_mhz": clock,
            "time_rel_err": emu.time_s / meas["time_s"] - 1.0,
            "energy_rel_err": emu.energy_j / meas["energy_j"] - 1.0,
            **(extra if detail else {})})
    partitions: dict[str, Any] = {}
    for name in sorted({r["partition"] for r in rows}):
        mine = [r for r in rows if r["partition"] == name]
        grid = [r for r in mine if r["kind"] == "grid"]
        over = [r for r in grid if r["launch_slot"] is not None]
        res: dict[str, Any] = {
            "n_rows": len(mine), "n_grid": len(grid), "n_overlapped": len(over),
            "time_median_abs_rel_err": _median_abs([r["time_rel_err"] for r in mine]),
            "energy_median_abs_rel_err": _median_abs([r["energy_rel_err"] for r in mine]),
            "time_median_rel_err_signed": statistics.median(r["time_rel_err"] for r in mine),
            "energy_median_rel_err_signed": statistics.median(r["energy_rel_err"]
                                                              for r in mine),
            "spearman_time_overlapped": _spearman([r["measured_ms"] for r in over],
                                                  [r["emulated_ms"] for r in over]),
            "spearman_energy_overlapped": _spearman([r["measured_j"] for r in over],
                                                    [r["emulated_j"] for r in over]),
        }
        for obj, key in (("energy", "j"), ("time", "ms")):
            # Error left after dividing out this partition's median ratio: shape, not level.
            sc = statistics.median(r[f"emulated_{key}"] / r[f"measured_{key}"] for r in mine)
            res[f"{obj}_median_abs_rel_err_after_scale"] = _median_abs(
                [r[f"emulated_{key}"] / sc / r[f"measured_{key}"] - 1.0 for r in mine])
        # Average power per GPU (energy / time / GPUs), median over the rows.
        for side in ("measured", "emulated"):
            res[f"power_per_gpu_w_median_{side}"] = statistics.median(
                r[f"{side}_j"] / (r[f"{side}_ms"] * 1e-3) / r["gpus"] for r in mine)
        clocks = [(r["measured_clock_mhz"], r["emulated_clock_mhz"]) for r in mine
                  if r["measured_clock_mhz"]]
        res["clock_mhz_median_measured"] = statistics.median(c[0] for c in clocks)
        res["clock_mhz_median_emulated"] = statistics.median(c[1] for c in clocks)
        for obj, key in (("energy", "j"), ("time", "ms")):
            best_m = min(grid, key=lambda r, k=key: r[f"measured_{k}"])
            best_e = min(grid, key=lambda r, k=key: r[f"emulated_{k}"])
            res[f"pick_{obj}"] = {
                "emulator_pick": _cfg(best_e), "measured_best": _cfg(best_m),
                f"pick_measured_{key}": best_e[f"measured_{key}"],
                f"best_measured_{key}": best_m[f"measured_{key}"],
                "regret": best_e[f"measured_{key}"] / best_m[f"measured_{key}"] - 1.0}
        res["savings"] = _savings(mine, grid)
        partitions[name] = res
    # Energy error left after dividing out one global scale factor (the median ratio):
    # how much of the error is a level, how much is shape.
    scale = statistics.median(r["emulated_j"] / r["measured_j"] for r in rows)
    tscale = statistics.median(r["emulated_ms"] / r["measured_ms"] for r in rows)
    overall = {
        "n_rows": len(rows),
        "time_median_abs_rel_err": _median_abs([r["time_rel_err"] for r in rows]),
        "energy_median_abs_rel_err": _median_abs([r["energy_rel_err"] for r in rows]),
        "energy_scale_median": scale,
        "energy_median_abs_rel_err_after_scale": _median_abs(
            [r["emulated_j"] / scale / r["measured_j"] - 1.0 for r in rows]),
        "time_scale_median": tscale,
        "time_median_abs_rel_err_after_scale": _median_abs(
            [r["emulated_ms"] / tscale / r["measured_ms"] - 1.0 for r in rows]),
    }
    overall["targets"] = _targets(overall, partitions)
    return {"grid": _rel(path), "emulator": how, "comm_priority": priority,
            "comm_priority_from": priority_from, "machine": data.get("machine"),
            "measured_with": data.get("command"), "software": data.get("software"),
            "workload": workload.describe(),
            "energy_scope": f"total energy of one partition run over its {rows[0]['gpus']} "
                            "GPUs (TP x CP group), static included",
            "overall": overall, "partitions": partitions, "rows": rows}


# Ops whose kernels fill every SM with more than one wave of blocks: a collective launched
# with one may not get SMs before the op's last wave (the launch-slot shift check).
_GPU_FILLING = (OpKind.GEMM, OpKind.ATTENTION)
FEW_CTAS = 6  # --residuals: "few" CTAs are at most this many, "many" more


def shifted_slot(part: Partition, slot: str | None) -> str | None:
    """The launch-slot shift check: the slot at which the collective would start if,
    launched with a GEMM or attention kernel, it got SMs only once that kernel's blocks
    were all dispatched, i.e. with the next op (after the last op: sequential). Other slots
    are kept. Evaluating the emulator at high priority at this slot changes no constant. The
    check reads the emulated op's kind, not the first kernel that ran at the slot (in the
    first TP=2 grid ``attn_core`` began with a copy of K and V, so the shift does not apply
    there). The emulator's rule for normal priority (``EmulatedGPU.comm_priority``) goes
    further: every op, memory-bound ones too, delays the collective to its end."""
    if slot is None:
        return None
    names = [s.name for s in sorted(part.slots, key=lambda s: s.index)]
    i = names.index(slot)
    if part.compute_ops[i].kind not in _GPU_FILLING:
        return slot
    return names[i + 1] if i + 1 < len(names) else None


def _row_detail(prof: EmulatedProfiler, free: Any, part: Partition, cfg: ScheduleConfig,
                trace: Any, emu: Any, meas: dict[str, float],
                clock: float | None, high: EmulatedProfiler) -> dict[str, Any]:
    """Per-row detail for ``--residuals`` (see :func:`evaluate_grid`); ``free``: the
    emulator without its power limit, run at the supported clock nearest the measured
    one (``clock``): the row's time and power were the power model right at that clock;
    ``high``: the emulator at high stream priority, for the slot-shift check."""
    g = part.group_gpus
    at: Any = None
    if clock:
        f = min(prof.gpu.clocks_mhz, key=lambda c: abs(c - clock))
        at = free.ground_truth(part, ScheduleConfig(f, cfg.comm_sms, cfg.launch_slot))
    sh = shifted_slot(part, cfg.launch_slot)
    alt = (emu if sh == cfg.launch_slot and high is prof else high.ground_truth(
        part, ScheduleConfig(cfg.freq_mhz, cfg.comm_sms, sh)))
    order = [s.name for s in sorted(part.slots, key=lambda s: s.index)]
    ms = 1e3
    return {
        "slot_index": len(order) if cfg.launch_slot is None else order.index(cfg.launch_slot),
        "measured_power_w_per_gpu": meas["energy_j"] / meas["time_s"] / g,
        "emulated_power_w_per_gpu": emu.energy_j / emu.time_s / g,
        "emulated_comm_start_ms": None if trace.comm_start_s is None else trace.comm_start_s * ms,
        "emulated_comm_end_ms": None if trace.comm_end_s is None else trace.comm_end_s * ms,
        "emulated_compute_end_ms": trace.compute_end_s * ms,
        "emulated_exposed_comm_ms": trace.exposed_comm_s * ms,
        "shifted_slot": sh, "shifted_emulated_ms": alt.time_s * ms,
        "shifted_emulated_j": alt.energy_j,
        "shifted_time_rel_err": alt.time_s / meas["time_s"] - 1.0,
        "shifted_energy_rel_err": alt.energy_j / meas["energy_j"] - 1.0,
        "clock_matched_time_rel_err": None if at is None else at.time_s / meas["time_s"] - 1.0,
        "emulated_power_w_per_gpu_at_measured_clock": (None if at is None
                                                       else at.energy_j / at.time_s / g)}


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def residual_summary(g: dict[str, Any], few: int = FEW_CTAS) -> dict[str, Any]:
    """Residuals (emulated / measured - 1) of one evaluated grid (``detail=True``) by
    launch slot and SM count, per partition: the slot x CTA matrices, the medians per slot
    for few (<= ``few``) and many CTAs with the clocks and powers of both sides, and
    Spearman among overlapped configurations as emulated and with the slot shift."""
    out: dict[str, Any] = {}
    for name in sorted({r["partition"] for r in g["rows"]}):
        grid = [r for r in g["rows"] if r["partition"] == name and r["kind"] == "grid"
                and r["comm_sms"] is not None]
        over = [r for r in grid if r["launch_slot"] is not None]
        slots = sorted({(r["slot_index"], r["launch_slot"] or "sequential") for r in grid})
        ctas = sorted({r["comm_sms"] for r in grid})
        res: dict[str, Any] = {"ctas": ctas, "slots": [s for _, s in slots]}
        for obj in ("time", "energy"):
            res[f"{obj}_rel_err"] = {s: {str(r["comm_sms"]): r[f"{obj}_rel_err"] for r in grid
                                         if (r["launch_slot"] or "sequential") == s}
                                     for _, s in slots}
        bands: dict[str, Any] = {}
        for _, s in slots:
            mine = [r for r in grid if (r["launch_slot"] or "sequential") == s]
            bands[s] = {}
            for band, rs in (("few", [r for r in mine if r["comm_sms"] <= few]),
                             ("many", [r for r in mine if r["comm_sms"] > few])):
                bands[s][band] = {"n": len(rs), **{
                    k: _med([r[k] for r in rs if r[k] is not None]) for k in (
                        "time_rel_err", "energy_rel_err", "shifted_time_rel_err",
                        "shifted_energy_rel_err", "clock_matched_time_rel_err",
                        "measured_clock_mhz", "emulated_clock_mhz", "measured_power_w_per_gpu",
                        "emulated_power_w_per_gpu")}}
        res["by_slot"] = bands
        # Rows the power limit slowed (measured clock below the maximum): the level.
        fmax = max(r["emulated_clock_mhz"] for r in g["rows"])
        lim = [r for r in grid if r["measured_clock_mhz"] and r["measured_clock_mhz"] < fmax - 30]
        res["power_limited"] = {"n": len(lim), **{k: _med([r[k] for r in lim]) for k in (
            "measured_clock_mhz", "emulated_clock_mhz", "measured_power_w_per_gpu",
            "emulated_power_w_per_gpu", "emulated_power_w_per_gpu_at_measured_clock",
            "time_rel_err", "clock_matched_time_rel_err")}}
        for obj, key in (("time", "ms"), ("energy", "j")):
            m = [r[f"measured_{key}"] for r in over]
            res[f"spearman_{obj}"] = _spearman(m, [r[f"emulated_{key}"] for r in over])
            res[f"spearman_{obj}_slot_shift"] = _spearman(
                m, [r[f"shifted_emulated_{key}"] for r in over])
        out[name] = res
    return out


def cross_grid_residuals(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Whether two evaluated grids of the same workload show the same residual pattern:
    Pearson and Spearman of the per-configuration residuals over their common overlapped
    configurations (close to 1: a real effect of the configuration; near 0: noise)."""
    def keyed(g: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
        return {(r["partition"], r["comm_sms"], r["launch_slot"]): r for r in g["rows"]
                if r["kind"] == "grid" and r["launch_slot"] is not None}

    ka, kb = keyed(a), keyed(b)
    out: dict[str, Any] = {"grids": [a["grid"], b["grid"]], "partitions": {}}
    for name in sorted({k[0] for k in set(ka) & set(kb)}):
        keys = sorted((k for k in set(ka) & set(kb) if k[0] == name), key=str)
        res: dict[str, Any] = {"n_common_overlapped": len(keys)}
        for obj in ("time", "energy"):
            x = [ka[k][f"{obj}_rel_err"] for k in keys]
            y = [kb[k][f"{obj}_rel_err"] for k in keys]
            res[f"{obj}_residual_pearson"] = (float(pearsonr(x, y).statistic)
                                              if len(keys) >= 3 else None)
            res[f"{obj}_residual_spearman"] = _spearman(x, y)
        out["partitions"][name] = res
    return out


def residuals(res: dict[str, Any], few: int = FEW_CTAS) -> dict[str, Any]:
    """The ``--residuals`` result of a :func:`run` with ``detail=True``."""
    grids = res["grids"]
    pairs = [cross_grid_residuals(a, b) for i, a in enumerate(grids) for b in grids[i + 1:]
             if (a["workload"], a["machine"]) == (b["workload"], b["machine"])]
    return {
        "what": "residuals emulated / measured - 1 per measured row (EMULATED on a CPU vs "
                "MEASURED grids), by launch slot and CTA count; the slot-shift check "
                "evaluates the emulator at high stream priority at the next op's slot where "
                "the configured slot's op is a GEMM or attention kernel (the last op: "
                "sequential); no constant changed",
        "emulator": res["emulator"], "comm_priority": res["comm_priority"],
        "few_ctas_max": few,
        "grids": [{"grid": g["grid"], "comm_priority": g["comm_priority"],
                   "partitions": residual_summary(g, few),
                   "rows": g["rows"]} for g in grids],
        "cross_grid": pairs}


def print_residuals(r: dict[str, Any]) -> None:
    """Print the medians per slot, few and many CTAs, and the rank checks."""
    few = r["few_ctas_max"]
    for g in r["grids"]:
        for name, p in g["partitions"].items():
            print(f"{Path(g['grid']).name} {name}: median residual, emulated/measured - 1 "
                  f"(time, energy; shifted time), clock MHz measured/emulated; "
                  f"few <= {few} CTAs | many")
            for s in p["slots"]:
                cells = []
                for band in ("few", "many"):
                    b = p["by_slot"][s][band]
                    if not b["n"]:
                        cells.append(f"{'':41s}")
                        continue
                    cells.append(f"{_pct(b['time_rel_err'])} {_pct(b['energy_rel_err'])}; "
                                 f"{_pct(b['shifted_time_rel_err'])}  "
                                 f"{b['measured_clock_mhz']:4.0f}/{b['emulated_clock_mhz']:4.0f}")
                print(f"  {s:10s} {cells[0]} | {cells[1]}")
            lim = p["power_limited"]
            if lim["n"]:
                print(f"  {lim['n']} power-limited rows: clock {lim['measured_clock_mhz']:.0f} "
                      f"measured, {lim['emulated_clock_mhz']:.0f} emulated; W per GPU "
                      f"{lim['measured_power_w_per_gpu']:.0f} measured, "
                      f"{lim['emulated_power_w_per_gpu']:.0f} emulated, "
                      f"{lim['emulated_power_w_per_gpu_at_measured_clock']:.0f} emulated at the "
                      f"measured clock; time residual {_pct(lim['time_rel_err'])}, at the "
                      f"measured clock {_pct(lim['clock_matched_time_rel_err'])}")
            print(f"  Spearman time / energy: {p['spearman_time']:.3f} / "
                  f"{p['spearman_energy']:.3f}; with the slot shift "
                  f"{p['spearman_time_slot_shift']:.3f} / {p['spearman_energy_slot_shift']:.3f}")
    for c in r["cross_grid"]:
        a, b = (Path(x).name for x in c["grids"])
        for name, v in c["partitions"].items():
            print(f"residuals of {a} vs {b}, {name}, {v['n_common_overlapped']} common "
                  f"overlapped configurations: Pearson time {v['time_residual_pearson']:.2f}, "
                  f"energy {v['energy_residual_pearson']:.2f}")


def _savings(mine: list[dict[str, Any]], grid: list[dict[str, Any]]) -> dict[str, Any]:
    """Saving of the best grid configuration over each baseline, measured and emulated
    (each side's own best against its own baseline): does the emulator overstate what
    overlap saves? Megatron-LM runs the whole microbatch, so half of it is compared."""
    out: dict[str, Any] = {}
    for kind, factor in (("megatron", 0.5), ("seq_default", 1.0), ("nanobatch", 1.0)):
        base = [r for r in mine if r["kind"] == kind]
        if not base:
            continue
        b = base[0]
        entry: dict[str, Any] = {}
        for obj, key in (("energy", "j"), ("time", "ms")):
            sides = {}
            for side in ("measured", "emulated"):
                best = min(r[f"{side}_{key}"] for r in grid)
                sides[side] = 1.0 - best / (b[f"{side}_{key}"] * factor)
            entry[f"{obj}_saving_measured"] = sides["measured"]
            entry[f"{obj}_saving_emulated"] = sides["emulated"]
            entry[f"{obj}_saving_ratio"] = (sides["emulated"] / sides["measured"]
                                            if sides["measured"] > 0 else None)
        out[f"best_vs_{kind}"] = entry
    return out


def _targets(overall: dict[str, Any], partitions: dict[str, Any]) -> dict[str, bool]:
    t = TARGETS
    sp = [v for p in partitions.values()
          for v in (p["spearman_time_overlapped"], p["spearman_energy_overlapped"])]
    return {
        "median_time_err_le_8pct": overall["time_median_abs_rel_err"] <= t["median_rel_err_max"],
        "median_energy_err_le_8pct": (overall["energy_median_abs_rel_err"]
                                      <= t["median_rel_err_max"]),
        "spearman_ge_0.9_every_partition": all(v is not None and v >= t["spearman_min"]
                                               for v in sp),
        "pick_within_2pct_energy_every_partition": all(
            p["pick_energy"]["regret"] <= t["pick_regret_max"] for p in partitions.values()),
        "pick_within_2pct_time_every_partition": all(
            p["pick_time"]["regret"] <= t["pick_regret_max"] for p in partitions.values()),
    }


def measurement_floor(a: Path, b: Path) -> dict[str, Any] | None:
    """Two measured grids of the same workload on the same machine, compared with each
    other as the emulator is compared with one: what agreement the measurement itself
    reaches (median difference, Spearman among overlapped configurations, the measured
    value in ``b`` of ``a``'s best configuration and the reverse). ``None`` when the two
    grids do not share a workload and machine or have fewer than 3 common configurations."""
    da = read_json(a, error=GridError, what="measured grid")
    db = read_json(b, error=GridError, what="measured grid")
    if (da.get("workload"), da.get("machine")) != (db.get("workload"), db.get("machine")):
        return None

    def grid(d: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, float]]:
        return {(m["partition"], m["config"]["comm_sms"], m["config"]["launch_slot"]):
                m["measurement"] for m in d["measurements"]
                if m["kind"] == "grid" and "measurement" in m}

    ga, gb = grid(da), grid(db)
    out: dict[str, Any] = {"grids": [_rel(a), _rel(b)], "partitions": {}}
    for name in sorted({k[0] for k in ga} & {k[0] for k in gb}):
        keys = sorted((k for k in set(ga) & set(gb) if k[0] == name), key=str)
        over = [k for k in keys if k[2] is not None]
        if len(keys) < 3:
            continue
        res: dict[str, Any] = {"n_common": len(keys), "n_overlapped": len(over)}
        for obj, f in (("time", "time_s"), ("energy", "energy_j")):
            res[f"{obj}_median_abs_rel_diff"] = _median_abs(
                [gb[k][f] / ga[k][f] - 1.0 for k in keys])
            res[f"spearman_{obj}_overlapped"] = _spearman([ga[k][f] for k in over],
                                                          [gb[k][f] for k in over])
            best_a = min(keys, key=lambda k, f=f: ga[k][f])
            best_b = min(keys, key=lambda k, f=f: gb[k][f])
            res[f"pick_{obj}_regret_a_in_b"] = gb[best_a][f] / gb[best_b][f] - 1.0
            res[f"pick_{obj}_regret_b_in_a"] = ga[best_b][f] / ga[best_a][f] - 1.0
        out["partitions"][name] = res
    return out if out["partitions"] else None


def run(grids: list[Path], gpu_profile: Path | None, gpu_name: str = "h200-sxm",
        kernels: str | None = None, detail: bool = False,
        comm_priority: str | None = None) -> dict[str, Any]:
    """Evaluate the emulator on ``grids``; the result written by ``--json`` (``detail``:
    rows with the fields :func:`residuals` needs; ``comm_priority``: every grid at this
    stream priority instead of its own, :func:`kareus.profilers.emulator.measured_priority`)."""
    _, how = make_emulator(gpu_name, gpu_profile, kernels)
    floors = [f for i, a in enumerate(grids) for b in grids[i + 1:]
              if (f := measurement_floor(a, b)) is not None]
    return {
        "what": "emulator fidelity: EMULATED (CPU) vs MEASURED grids (data/); per grid the "
                "median abs. relative error of time and energy over every measured row, "
                "Spearman among overlapped grid configurations, and the measured value of "
                "the emulator's best grid configuration vs the measured best",
        "emulator": how, "machine": "emulated, CPU",
        "comm_priority": comm_priority or "per grid: recorded, else normal",
        "nccl_default_ctas": get_gpu(gpu_name).default_comm_sms, "targets": TARGETS,
        "grids": [evaluate_grid(p, gpu_name, gpu_profile, kernels, detail, comm_priority)
                  for p in grids],
        "measurement_floor": floors}


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{x * 100:5.1f}%"


def print_table(res: dict[str, Any]) -> None:
    """Print one line per grid and partition."""
    print(f"emulator: {res['emulator']} (EMULATED) vs MEASURED grids")
    for g in res["grids"]:
        print(f"  {Path(g['grid']).name}: {g['emulator']}; collective at "
              f"{g['comm_priority']} stream priority ({g['comm_priority_from']})")
    print(f"{'grid':34s} {'part':8s} {'n':>4s} | {'t err':>6s} {'E err':>6s} | "
          f"{'rho t':>5s} {'rho E':>5s} | {'pick E':>6s} {'pick t':>6s}")
    for g in res["grids"]:
        name = Path(g["grid"]).name
        for p, v in g["partitions"].items():
            rt, re_ = v["spearman_time_overlapped"], v["spearman_energy_overlapped"]
            print(f"{name:34s} {p:8s} {v['n_rows']:4d} | "
                  f"{_pct(v['time_median_abs_rel_err'])} {_pct(v['energy_median_abs_rel_err'])}"
                  f" | {rt if rt is None else round(rt, 2)!s:>5s} "
                  f"{re_ if re_ is None else round(re_, 2)!s:>5s} | "
                  f"{_pct(v['pick_energy']['regret'])} {_pct(v['pick_time']['regret'])}")
            for k, sv in v["savings"].items():
                print(f"{'':34s}   {k:22s} saving E {_pct(sv['energy_saving_measured'])} "
                      f"measured, {_pct(sv['energy_saving_emulated'])} emulated; T "
                      f"{_pct(sv['time_saving_measured'])} / {_pct(sv['time_saving_emulated'])}")
        o = g["overall"]
        print(f"{name:34s} {'all':8s} {o['n_rows']:4d} | {_pct(o['time_median_abs_rel_err'])} "
              f"{_pct(o['energy_median_abs_rel_err'])} | energy err after one scale "
              f"({o['energy_scale_median']:.3f}): {_pct(o['energy_median_abs_rel_err_after_scale'])}")
        met = [k for k, ok in o["targets"].items() if ok]
        missed = [k for k, ok in o["targets"].items() if not ok]
        print(f"  targets met: {', '.join(met) or 'none'}; missed: {', '.join(missed) or 'none'}")
    for f in res["measurement_floor"]:
        a, b = (Path(x).name for x in f["grids"])
        print(f"MEASURED vs MEASURED, common grid configurations of {a} and {b}:")
        for p, v in f["partitions"].items():
            rt, re_ = v["spearman_time_overlapped"], v["spearman_energy_overlapped"]
            print(f"{'  (measurement floor)':34s} {p:8s} {v['n_common']:4d} | "
                  f"{_pct(v['time_median_abs_rel_diff'])} "
                  f"{_pct(v['energy_median_abs_rel_diff'])} | "
                  f"{rt if rt is None else round(rt, 2)!s:>5s} "
                  f"{re_ if re_ is None else round(re_, 2)!s:>5s} | "
                  f"{_pct(max(v['pick_energy_regret_a_in_b'], v['pick_energy_regret_b_in_a']))} "
                  f"{_pct(max(v['pick_time_regret_a_in_b'], v['pick_time_regret_b_in_a']))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the full result here")
    ap.add_argument("--grid", type=Path, action="append",
                    help="a measured grid file (repeatable; default: every data/*_grid*.json)")
    ap.add_argument("--gpu-profile", type=Path,
                    help="a measured GPUProfile JSON to calibrate the emulator with, or the "
                         "name of a shipped one (h200-sxm)")
    ap.add_argument("--kernels", default=None,
                    help="with --gpu-profile: the kernel set whose per-op measurements "
                         "calibrate the ops; default 'as-run': per grid, the kernels that "
                         "grid ran (its attention from the SDPA probe, the eager 'reference' "
                         "set for norm, RoPE and SwiGLU)")
    ap.add_argument("--residuals", type=Path,
                    help="also write per-row measured and emulated time, energy, clock and "
                         "power, the emulated timeline, and the residuals by launch slot and "
                         "CTA count with the slot-shift check and their agreement between "
                         "grids, here")
    ap.add_argument("--comm-priority", choices=("high", "normal"), default=None,
                    help="emulate every grid with its collectives at this stream priority "
                         "(default: per grid, its recorded 'comm_priority', else normal: the "
                         "grids measured before bench/h200_study.py recorded it)")
    args = ap.parse_args(argv)
    grids = args.grid or default_grids()
    if not grids:
        raise SystemExit("no measured grid found: pass --grid PATH")
    try:
        res = run(grids, args.gpu_profile, kernels=args.kernels,
                  detail=args.residuals is not None, comm_priority=args.comm_priority)
    except (GPUProfileError, GridError) as exc:
        raise SystemExit(str(exc)) from None
    print_table(res)
    command = "python bench/emulator_fidelity.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    if args.residuals:
        resid = residuals(res)
        print_residuals(resid)
        resid["command"] = command
        args.residuals.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.residuals, resid)
    if args.json:
        res["command"] = command
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
