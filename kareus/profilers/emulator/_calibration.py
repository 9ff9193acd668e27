"""Calibrating the emulated GPU from a measured ``GPUProfile``.

The presets' op model is a roofline with a few efficiency constants: right for the kernels
it describes (the fused ones), wrong for others. A measured profile holds, per op of the
runnable partitions, the time of the kernel that ran and its average power over a loop of
it alone. ``calibrate`` turns each record into two factors on the op model:

* **time factor** ``k_t``: the measured time, less the fixed cost of timing one op alone
  (``TIMED_FLOOR_S``), over the model's work time of the same op alone on all SMs at
  the maximum clock (the op is timed in short bursts, each after an L2 flush: at the boost
  clock, the power limit does not act within a few hundred microseconds).
  The calibrated op multiplies every term of its roofline (compute cycles, tensor feed,
  HBM bytes) by ``k_t``, so its time is ``k_t`` times the model's at every clock and SM
  count, and an eager kernel that moves more bytes than the fused one also demands the
  HBM bandwidth and the energy of those bytes;
* **power factor** ``k_p``: multiplies the op's own dynamic power (busy SMs, tensor
  cores, HBM) so that the model reproduces the measured loop power at the clock the loop
  ran at: the SM clock sampled during the loop where the record has it (``kareus
  calibrate`` samples it); otherwise, when the loop ran at the timed speed
  (``power_busy_fraction`` >= 0.97), the maximum clock, and when it ran slower (the
  GEMMs: 0.82-0.89 on H200, the 700 W limit lowering the clock), the clock at which the
  calibrated model's time equals the loop's time per run. This is how the power-capped measurements, which
  sit at several clocks, enter: each gives one point of the op's power at a clock set by
  the hardware, read back through the model's V/f curve (itself fitted to the GEMM
  chains measured at 1500, 1725 and 1980 MHz on H200, docs/emulator.md).

Ops measured without power (the candidate kernel sets) take the power factor of the same
op in the profile's main kernel set, else the median of their kind. Ops the profile does
not hold (another partition, the work outside partitions) take the median factors of
their kind (GEMM, attention, memory-bound) in the profile's main kernel set. A record's factors
transfer to the same op at other shapes (another TP degree, batch): the op model carries
the shape, the factor what the model misses about the kernel; among several records of
one op (several workloads) the one nearest in size is used.

Where the profile has the host time of an op's eager launch (``OpProfile.host_s``,
measured by ``kareus calibrate``), ``host_costs`` turns it into the emulator's host
cost of that op (``EmulatedGPU.host_costs``): per (partition, op), the median over
the workloads measured, and per op name, the median over partitions.

The profile also gives the HBM bandwidth (the model's ``hbm_efficiency``), the idle power,
the power of a GPU waiting on communication (the static power, kareus's accounting
constant) and of one spinning block at the maximum clock (the model's uncore power), and
the collective curves: per backend, collective and group size, the per-SM rate and link
limit fitted to the measured SM-capped points (the smallest message of at least 64 MiB).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kareus.model.gpu_profile import GPUProfile, GPUProfileError, OpProfile
from kareus.model.ops import ComputeOp
from kareus.model.partition import build_partitions
from kareus.model.workload import Workload
from kareus.profilers.emulator._opmodel import (
    OpCalibration,
    _op_work_time,
    _prep_op,
    profile_kind,
)

__all__ = ["OpCalibration", "PROFILE_BATCH", "PROFILE_WORKLOADS", "TIMED_FLOOR_S", "comm_curves",
           "fit_comm_curve", "host_costs", "op_calibrations", "profile_workload",
           "profile_workload_key"]

#: Workload shapes of profile records named by a bare preset name: the shapes at which
#: ``bench/op_roofline.py`` (and ``kareus calibrate`` by default) measure each preset.
PROFILE_WORKLOADS: dict[str, dict[str, Any]] = {
    "llama3.2-3b": {"tp": 4},
    "qwen3-1.7b": {"tp": 4, "cp": 2},
    "llama3.3-70b": {"tp": 8},
}
#: Batch of those records: microbatch 8 x 4096 tokens in 2 nanobatches.
PROFILE_BATCH: dict[str, Any] = {"microbatch_size": 8, "seq_len": 4096, "nanobatches": 2}

#: The fixed cost in an op timed alone as ``kareus calibrate`` and ``bench/op_roofline.py``
#: time it (CUDA events around one run after an L2 flush), seconds: a one-element copy
#: timed that way took 3.5-4.0 us on 1x H200 (median 3.8 us of four runs, ``launch_floor``
#: in ``bench/results/op_roofline_h200_*.json``, ``launch_floor_ms`` in
#: ``data/h200_op_roofline.json``). Inside a stream, or replayed from a graph, an op pays
#: the smaller gap between kernels instead (:attr:`EmulatedGPU.launch_overhead_s`).
TIMED_FLOOR_S = 3.8e-6

# Loop runs at or above this fraction of the timed speed ran at the maximum clock.
_UNTHROTTLED = 0.97
# Comm curve fit: messages of at least this size (the saturated regime the model describes).
_COMM_FIT_MIN_BYTES = 64 * 2**20
#: Profile backend names for the emulator's ``comm_backend`` choices.
COMM_BACKENDS: dict[str, str] = {"own": "own", "nccl": "nccl_capped"}


def profile_workload_key(model: str, *, tp: int, cp: int = 1, microbatch_size: int,
                         seq_len: int, nanobatches: int) -> str:
    """The workload name of a profile record: the bare preset name at the default
    shapes (``PROFILE_WORKLOADS``, ``PROFILE_BATCH``), else
    ``"model tp=.. cp=.. mbs=.. seq=.. nb=.."``."""
    par = {"tp": tp, **({"cp": cp} if cp != 1 else {})}
    batch = {"microbatch_size": microbatch_size, "seq_len": seq_len, "nanobatches": nanobatches}
    if PROFILE_WORKLOADS.get(model) == par and batch == PROFILE_BATCH:
        return model
    return (f"{model} tp={tp} cp={cp} mbs={microbatch_size} seq={seq_len} "
            f"nb={nanobatches}")


def profile_workload(key: str) -> Any:
    """The [`Workload`][kareus.model.Workload] a profile record's workload names.

    Raises:
        GPUProfileError: the name is neither a preset of ``PROFILE_WORKLOADS`` nor of
            the form written by ``profile_workload_key``.
    """
    parts = key.split()
    if not parts:
        raise GPUProfileError("profile record with an empty workload name")
    model, rest = parts[0], parts[1:]
    if not rest:
        if model not in PROFILE_WORKLOADS:
            raise GPUProfileError(
                f"profile workload {key!r}: a bare name must be one of "
                f"{', '.join(PROFILE_WORKLOADS)} (measured at their default shapes); name "
                "others 'model tp=.. cp=.. mbs=.. seq=.. nb=..'")
        shapes: dict[str, Any] = {**PROFILE_WORKLOADS[model], **PROFILE_BATCH}
        return Workload.preset(model, **shapes)
    names = {"tp": "tp", "cp": "cp", "mbs": "microbatch_size", "seq": "seq_len",
             "nb": "nanobatches"}
    kw: dict[str, Any] = {}
    for item in rest:
        k, _, v = item.partition("=")
        if k not in names or not v.isdigit():
            raise GPUProfileError(f"profile workload {key!r}: cannot read {item!r} (expected "
                                  "tp=, cp=, mbs=, seq=, nb= with whole numbers)")
        kw[names[k]] = int(v)
    return Workload.preset(model, **kw)


# ----------------------------------------------------------------------------- op factors


def _model_ops(profile: GPUProfile) -> dict[tuple[str, str, str], ComputeOp]:
    """The op model of every (workload, partition, op) the profile measured."""
    out: dict[tuple[str, str, str], ComputeOp] = {}
    for wl in sorted({o.workload for o in profile.ops}):
        parts = build_partitions(profile_workload(wl))
        for p in parts:
            for op in p.compute_ops:
                out[(wl, p.name, op.name)] = op
    return out


def _op_power_terms(gpu: Any, prepped: Any, f_mhz: float) -> tuple[float, float, float]:
    """(work time, power without the op's own dynamic part, the op's own dynamic power)
    of one prepared op alone on all SMs at ``f_mhz`` (the simulation's power formula)."""
    f_hz = f_mhz * 1e6
    s = gpu.sm_count
    t = _op_work_time(prepped, s, f_hz, gpu.hbm_bytes_per_s, gpu._issue_per_sm_cycle)
    scale = gpu.dynamic_scale(f_mhz)
    base = gpu.spec.idle_power_w + gpu.uncore_power_w * scale
    own = gpu.sm_busy_power_w * scale * prepped.activity
    if prepped.tensor:
        own += gpu.tensor_power_w * scale * (prepped.tensor_flops / t) / (s * prepped.fpc * f_hz)
    own += gpu.hbm_energy_pj_per_byte * 1e-12 * prepped.bytes / t
    return t, base, own


def _fit_op(gpu: Any, op: ComputeOp, rec: OpProfile) -> tuple[float, float | None]:
    """(time factor, power factor or None) of one measured op on the uncalibrated ``gpu``."""
    fmax = gpu.spec.max_clock_mhz
    base = _prep_op(gpu, op)
    work, _, _ = _op_power_terms(gpu, base, fmax)
    # Timed in bursts at the maximum clock: the fixed cost of timing one op is not scaled.
    k_t = max(rec.time_s - TIMED_FLOOR_S, 0.05 * work) / work
    if rec.power_w is None:
        return k_t, None
    scaled = attrs.evolve(base, cycles=base.cycles * k_t, bytes=base.bytes * k_t,
                          feed_sm_s=base.feed_sm_s * k_t)
    f = float(fmax)
    busy = rec.power_busy_fraction
    if rec.freq_mhz is not None:
        # The SM clock sampled during the loop: the power was drawn there.
        f = float(min(gpu.spec.clocks_mhz, key=lambda c: abs(c - rec.freq_mhz)))
    elif busy is not None and busy < _UNTHROTTLED:
        # The loop ran slower than the timed runs: find the clock where it took that long.
        target = (rec.time_s - TIMED_FLOOR_S) / busy
        clocks = gpu.spec.clocks_mhz
        lo, hi = 0, len(clocks) - 1
        while lo < hi:  # the highest clock whose time is at least the target
            mid = (lo + hi + 1) // 2
            if _op_power_terms(gpu, scaled, clocks[mid])[0] >= target:
                lo = mid
            else:
                hi = mid - 1
        f = float(clocks[lo])
    _, p0, own = _op_power_terms(gpu, scaled, f)
    if own <= 0:
        return k_t, None
    return k_t, max(0.05, (rec.power_w - p0) / own)


def op_calibrations(gpu: Any, profile: GPUProfile,  # noqa: C901 - one pass over the measured records with the fallbacks the docstring lists
                    kernels: str | Sequence[str] | None = None) -> tuple[OpCalibration, ...]:
    """Per-op and per-kind factors of ``profile`` on the uncalibrated ``gpu``.

    Args:
        gpu: The uncalibrated [`EmulatedGPU`][kareus.profilers.EmulatedGPU] the factors refer to.
        profile: The measured profile.
        kernels: The kernel set whose records to use, or several in order of priority
            (default: the profile's main set). For each measured (workload, partition, op)
            the first set holding it wins, then the main set (an eager set re-measures
            only the ops it changes). Records without power take the power factor of the
            same (partition, op) in the main set (median over workloads), else their
            kind's. One default per kind (``partition`` ``"*"``), from the main set, serves
            ops the profile does not hold.

    Raises:
        GPUProfileError: a kernel set the profile does not hold.
    """
    sets = ((profile.kernel_set,) if kernels is None
            else (kernels,) if isinstance(kernels, str) else tuple(kernels))
    for ks in sets:
        if ks not in profile.kernel_sets:
            raise GPUProfileError(f"GPU profile of {profile.gpu} has no kernel set {ks!r}; it "
                                  f"has {', '.join(map(repr, profile.kernel_sets)) or 'none'}")
    models = _model_ops(profile)
    fitted: dict[tuple[str, str, str, str], tuple[float, float | None, float]] = {}
    for rec in profile.ops:
        op = models.get((rec.workload, rec.partition, rec.op))
        if op is None:
            continue  # the op model has no such op (another version of the builder)
        k_t, k_p = _fit_op(gpu, op, rec)
        fitted[(rec.workload, rec.partition, rec.op, rec.kernels)] = (
            k_t, k_p, gpu.op_time_s(op, gpu.spec.max_clock_mhz))
    main = {k[:3]: v for k, v in fitted.items() if k[3] == profile.kernel_set}
    chosen: dict[tuple[str, str, str], tuple[float, float | None, float, str]] = {}
    for ks in (*sets, profile.kernel_set):
        for (wl, part, name, k), (k_t, k_p, model_s) in fitted.items():
            if k == ks and (wl, part, name) not in chosen:
                chosen[(wl, part, name)] = (k_t, k_p, model_s, f"{wl}/{ks}")
    main_power: dict[tuple[str, str], list[float]] = {}
    for (_, part, name), (_, k_p, _) in main.items():
        if k_p is not None:
            main_power.setdefault((part, name), []).append(k_p)
    filled: dict[tuple[str, str, str], tuple[float, float | None, float, str]] = {}
    for key, (k_t, k_p, model_s, src) in chosen.items():
        if k_p is None and key[1:] in main_power:
            k_p = statistics.median(main_power[key[1:]])
            src += f" (power: {profile.kernel_set})"
        filled[key] = (k_t, k_p, model_s, src)
    # Kind defaults (ops the profile does not hold: other partitions, outside work) from
    # the main set: those ops run the production kernels whatever set the partitions use.
    by_kind: dict[str, list[tuple[float, float | None]]] = {}
    for key, (k_t, k_p, _) in main.items():
        by_kind.setdefault(profile_kind(models[key].kind), []).append((k_t, k_p))
    kind_defaults: dict[str, tuple[float, float]] = {}
    for kind, vals in by_kind.items():
        pw = [p for _, p in vals if p is not None]
        kind_defaults[kind] = (statistics.median(t for t, _ in vals),
                               statistics.median(pw) if pw else 1.0)
    out = []
    for (wl, part, name), (k_t, k_p, model_s, src) in sorted(filled.items()):
        if k_p is None:
            k_p = kind_defaults[profile_kind(models[(wl, part, name)].kind)][1]
            src += " (power: kind median)"
        out.append(OpCalibration(part, name, round(k_t, 6), round(k_p, 6), model_s, src))
    for kind, (k_t, k_p) in sorted(kind_defaults.items()):
        out.append(OpCalibration("*", kind, round(k_t, 6), round(k_p, 6), 0.0,
                                 f"median of the {kind} ops measured "
                                 f"({profile.kernel_set})"))
    return tuple(out)


def host_costs(profile: GPUProfile, kernels: str | Sequence[str] | None = None
               ) -> tuple[tuple[str, str, float, str], ...]:
    """The host costs of eager launches measured in ``profile``, as
    ``EmulatedGPU.host_costs`` records ``(partition, op, host_s, source)``.

    For each (partition, op), the median over workloads of the first kernel set (in the
    order of ``kernels``, then the main set) that measured its host cost; and for each op
    name, ``("*", op, ...)``, the median of those over partitions (the same call launched
    from another partition type). Empty for a profile without host costs.
    """
    sets = ((profile.kernel_set,) if kernels is None
            else (kernels,) if isinstance(kernels, str) else tuple(kernels))
    by_set: dict[tuple[str, str, str], list[float]] = {}
    for rec in profile.ops:
        if rec.host_s is not None:
            by_set.setdefault((rec.kernels, rec.partition, rec.op), []).append(rec.host_s)
    chosen: dict[tuple[str, str], tuple[float, str]] = {}
    for ks in (*sets, profile.kernel_set):
        for (k, part, name), vals in sorted(by_set.items()):
            if k == ks and (part, name) not in chosen:
                chosen[(part, name)] = (statistics.median(vals), ks)
    out = [(part, name, round(v, 9), f"measured ({ks}): {profile.host_method}")
           for (part, name), (v, ks) in sorted(chosen.items())]
    names: dict[str, list[float]] = {}
    for (_, name), (v, _) in chosen.items():
        names.setdefault(name, []).append(v)
    out += [("*", name, round(statistics.median(vals), 9),
             f"measured, median over partitions: {profile.host_method}")
            for name, vals in sorted(names.items())]
    return tuple(out)


# ----------------------------------------------------------------------------- collectives


def fit_comm_curve(points: Mapping[int, float], *, p: float = 2.0
                   ) -> tuple[float, float, float]:
    """Fit ``R(s) = ((s r)^-p + L^-p)^(-1/p)`` to measured bus GB/s per SM count.

    Args:
        points: ``{comm_sms: bus GB/s}``.
        p: Saturation sharpness (the model's ``comm_saturation_p``).

    Returns:
        ``(r GB/s per SM, L GB/s, rms relative error)``, by a coarse-to-fine grid search
        minimising the mean squared relative error.

    Raises:
        GPUProfileError: fewer than two SM counts.
    """
    s = np.array(sorted(points), dtype=float)
    y = np.array([points[int(k)] for k in s], dtype=float)
    if len(s) < 2:
        raise GPUProfileError("a collective curve needs at least two SM counts")

    def err(r: np.ndarray, link: np.ndarray) -> np.ndarray:
        pred = ((s[None, None, :] * r[:, None, None]) ** -p + link[None, :, None] ** -p) ** (-1 / p)
        return np.mean((pred / y - 1.0) ** 2, axis=2)

    r_lo, r_hi = 0.5, 200.0
    l_lo, l_hi = 10.0, 2000.0
    best = (1.0, 100.0, math.inf)
    for _ in range(4):
        rs = np.geomspace(r_lo, r_hi, 120)
        ls = np.geomspace(l_lo, l_hi, 120)
        e = err(rs, ls)
        i, j = np.unravel_index(int(np.argmin(e)), e.shape)
        best = (float(rs[i]), float(ls[j]), float(e[i, j]))
        r_lo, r_hi = rs[max(i - 2, 0)], rs[min(i + 2, len(rs) - 1)]
        l_lo, l_hi = ls[max(j - 2, 0)], ls[min(j + 2, len(ls) - 1)]
    return round(best[0], 2), round(best[1], 1), round(math.sqrt(best[2]), 4)


def comm_curves(profile: GPUProfile, backend: str) -> tuple[tuple[str, int, float, float], ...]:
    """Collective curves ``(kind, group size, GB/s per SM, link GB/s)`` of one backend of
    the profile (``"own"`` or ``"nccl"``), fitted to its SM-capped points of the smallest
    measured message of at least 64 MiB (the partitions' collectives are 24-200 MiB; the
    benches measured 1, 8, 64 and 256 MiB)."""
    name = COMM_BACKENDS.get(backend)
    if name is None:
        raise GPUProfileError(f"comm_backend must be one of {', '.join(COMM_BACKENDS)} to take "
                              f"curves from a profile, got {backend!r}")
    groups: dict[tuple[str, int], dict[int, list[float]]] = {}
    mine = [c for c in profile.collectives if c.backend == name and c.comm_sms is not None]
    sizes = sorted({c.size_bytes for c in mine if c.size_bytes >= _COMM_FIT_MIN_BYTES})
    for c in mine:
        if not sizes or c.size_bytes != sizes[0] or c.comm_sms is None:
            continue
        groups.setdefault((c.collective, c.group_size), {}).setdefault(
            c.comm_sms, []).append(c.bus_gbps)
    out = []
    for (kind, g), pts in sorted(groups.items()):
        if len(pts) < 2:
            continue
        r, link, _ = fit_comm_curve({s: statistics.median(v) for s, v in pts.items()})
        out.append((kind, g, r, link))
    return tuple(out)
