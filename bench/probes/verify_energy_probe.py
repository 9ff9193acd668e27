"""Why does the one-GPU tune's composed energy miss what ``kareus verify`` measures?

On 1x H200 (``bench/results/verify_quick_1xh200.json``: qwen3-1.7b TP=4 CP=2 at 4 layers, 4
microbatches of 8 x 4096) the composed iteration time held within 0.974-0.996 of the
measured one, but the measured total energy was 1.046-1.091 of the composed one, in every
system. For a one-stage job the composed total energy does not depend on the static power
(``static x T`` is added back to the partitions' ``E - static x t``, and with one stage
``T`` is the sum of the ``t``: ``tests/compose/test_one_stage_energy.py``), so the miss is
in what was measured, not in the static/dynamic split. This probe measures, in one process
on one GPU and in one run, the pieces a one-GPU tune composes for one system and the
training loop that ``kareus verify`` runs, each two ways, so the miss can be placed:

* **tune**: each partition type (at the system's own configuration), the work outside
  partitions (forward and backward) and the per-iteration tail, measured as the tune
  measures them ([`NVMLProfiler`][kareus.profilers.NVMLProfiler]: a 0.4 s warm-up, then
  about six counter steps);
* **steady**: the same programs run back to back for ``--settle-s``, then a window of
  ``--window-s`` (the power limiter and the temperature settled, many counter steps);
* **mix**: one decoder layer's partitions of one microbatch (forward, recomputation,
  backward) back to back as one step, and a whole microbatch (its outside work and every
  layer), steady: additivity of the programs beside each other (the power limit acts on
  the average over the mix: in ``bench/results/emulator_power_probe_h200.json`` GEMMs took
  12% less time and about 9% more energy each at 75% duty beside spin gaps (taken at a
  spinning block's 121 W) than back to back at the limit; caches);
* **loop**: the library's training loop at ``--layers`` and ``--small-layers`` layers,
  as ``kareus verify`` measures it (1 warm-up iteration, a window of ~0.75 s, two
  repeats; at ``--layers`` also after ``--settle-s`` of warm-up iterations) and steady
  (``--settle-s`` then ``--window-s``; the weights reset every 6 iterations, as verify's
  runs are); each depth beside its composition, and the two depths give the loop's
  energy per layer (slope) and outside the layers (intercept).

Everything is per GPU (the one measured) per iteration, before any scaling to the job.
The table ``compare`` sets each measured piece beside its composition from the tune's and
the steady measurements. How to read it:

* ``loop verify / loop steady`` far from 1: verify's short windows are not the steady
  state; ``loop verify, warm`` (the same window after ``--settle-s`` of warm-up) near 1
  then says it is the transient after verify's one warm-up iteration and idle wait (power
  limiter, clocks), still far says it is the window itself (its start locked to a counter
  step: NVML's readings sampling the iteration's phases unevenly);
* ``loop steady / composed steady`` vs ``loop verify / composed tune``: what remains
  once both sides are steady;
* ``per layer`` vs ``outside + tail``: the miss is in the layers (partitions) or in the
  work outside them (embedding, LM head, loss, optimizer: the outside work's stand-in
  programs are not the loop's code);
* ``mix / sum of singles`` (a layer, a microbatch) above 1 in energy, below in time, with
  a higher SM clock in the mix: the programs are not additive under the power limit
  (alone, a hot program is throttled; beside cooler ones it runs at a higher clock and
  draws more): a composition of programs measured alone misses it;
* ``loop steady / (M x microbatch mix + tail)`` far from 1: the loop's code (or data)
  differs from the tune's programs (e.g. the outside work's stand-in kernels);
* per type, ``tune / steady`` far from 1: the tune's short window is not steady.

Usage (1x H200; about 3 minutes; clocks are never changed)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --standalone --nproc_per_node 1 bench/probes/verify_energy_probe.py \\
        --json bench/probes/results/verify_energy_probe_h200.json

``--schedule nanobatching`` probes the nanobatching system instead of Megatron-LM's
sequential one; ``--loopback faithful`` the time-faithful stand-in (a STAND-IN's figures).

``--emulated`` (no GPU, seconds): the emulator's estimate of the power limit's coupling
for the same job, every piece limited alone (as composed) against the whole iteration
limited as one mix, at ``--layers`` and ``--small-layers`` (``--gpu calibrated``: the
H200 model calibrated on its shipped profile). EMULATED figures: its collectives are the
real ones' model, not the loopback stand-ins::

    python bench/probes/verify_energy_probe.py --emulated --gpu calibrated \\
        --json bench/probes/results/verify_energy_probe_emulated.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast

#: Iterations of the loop between weight resets in a steady window (verify's runs are one
#: warm-up iteration and about five timed ones from the initial weights).
RESET_EVERY = 6


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (no torch needed)."""
    ap = argparse.ArgumentParser(prog="verify_energy_probe.py",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the job")
    ap.add_argument("--small-layers", type=int, default=1,
                    help="a second depth of the loop, for its energy per layer (< --layers)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--schedule", choices=("sequential", "nanobatching"),
                    default="sequential",
                    help="the system probed: Megatron-LM's sequential schedule (unsplit "
                         "partitions, sequential) or nanobatching (first-slot launch)")
    ap.add_argument("--loopback", choices=("plain", "faithful"), default="plain")
    ap.add_argument("--settle-s", type=float, default=1.0,
                    help="back-to-back running before each steady window")
    ap.add_argument("--window-s", type=float, default=2.0, help="each steady window")
    ap.add_argument("--emulated", action="store_true",
                    help="no GPU: the emulator's estimate of the power limit's coupling for "
                         "the same job (every piece limited alone, as composed, against the "
                         "whole iteration limited as one mix), at --layers and "
                         "--small-layers; EMULATED figures, not measurements")
    ap.add_argument("--gpu", default="h200-sxm",
                    help="with --emulated: the GPU preset, or 'calibrated' (its shipped "
                         "measured profile, NCCL curves)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    if not 1 <= args.small_layers < args.layers:
        ap.error("--small-layers must be >= 1 and below --layers")
    if args.settle_s < 0 or args.window_s < 0.5:
        ap.error("--settle-s must be >= 0 and --window-s >= 0.5 (the counter steps every "
                 "~0.1 s)")
    return args


# ------------------------------------------------------------------ arithmetic (no GPU)


def per_layer_counts(counts: Mapping[str, Mapping[str, int]], layers: int
                     ) -> dict[str, int]:
    """Instances of each partition type one decoder layer runs per microbatch (forward,
    recomputation and backward together), from ``PartitionSet.counts`` of ``layers``
    layers."""
    out: dict[str, int] = {}
    for phase in ("fwd", "bwd"):
        for name, c in counts.get(phase, {}).items():
            if c % layers:
                raise ValueError(f"{phase} {name}: {c} instances over {layers} layers")
            out[name] = out.get(name, 0) + c // layers
    return out


def mix_order(counts: Mapping[str, Mapping[str, int]], layers: int) -> list[str]:
    """One layer's partitions of one microbatch: the forward computation's types, then
    the backward computation's (with full recomputation its forward types too), each as
    often as one layer runs it, in the partition set's order."""
    return [name for phase in ("fwd", "bwd") for name, c in counts.get(phase, {}).items()
            for _ in range(c // layers)]


def microbatch_order(counts: Mapping[str, Mapping[str, int]], layers: int) -> list[str]:
    """One microbatch's forward and backward computations as the tune's programs: the
    forward's outside work (``"outside:fwd"``) and every layer's forward partitions, then
    the backward's outside work and every layer's backward-computation partitions."""
    out = []
    for phase in ("fwd", "bwd"):
        one = [name for name, c in counts.get(phase, {}).items() for _ in range(c // layers)]
        out += [f"outside:{phase}", *one * layers]
    return out


def summed(alone: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> dict[str, Any]:
    """Time and energy of ``order``'s programs measured alone, summed, and their mean SM
    clock weighted by time."""
    t = sum(alone[n]["time_s"] for n in order)
    clocked = [(alone[n]["time_s"], alone[n].get("sm_clock_mhz")) for n in order]
    known = [(w, c) for w, c in clocked if c]
    return {"time_s": t, "energy_j": sum(alone[n]["energy_j"] for n in order),
            "sm_clock_mhz": (sum(w * c for w, c in known) / sum(w for w, _ in known)
                             if known else None)}


def composed(singles: Mapping[str, Mapping[str, float]], per_layer: Mapping[str, int], *,
             layers: int, microbatches: int, outside: Mapping[str, Mapping[str, float]],
             tail: Mapping[str, float] | None) -> dict[str, float]:
    """One iteration of a one-stage job composed as the tune composes it (per GPU): every
    microbatch runs ``per_layer`` instances of each type per layer and the outside work of
    both phases; the tail once. Also its parts: ``layer`` (one layer, every microbatch) and
    ``outside`` (the outside work of every microbatch plus the tail)."""
    def piece(key: str) -> tuple[float, float]:
        layer = sum(n * singles[t][key] for t, n in per_layer.items())
        out = sum(w[key] for w in outside.values())
        return microbatches * layer, microbatches * out + (tail[key] if tail else 0.0)

    lt, ot = piece("time_s")
    le, oe = piece("energy_j")
    return {"time_s": layers * lt + ot, "energy_j": layers * le + oe,
            "layer_time_s": lt, "layer_energy_j": le, "outside_time_s": ot,
            "outside_energy_j": oe}


def regression(small: Mapping[str, float], big: Mapping[str, float], small_layers: int,
               big_layers: int) -> dict[str, float]:
    """The loop's time and energy per layer (slope) and outside the layers (intercept)
    from two depths."""
    d = big_layers - small_layers
    out = {}
    for key in ("time_s", "energy_j"):
        slope = (big[key] - small[key]) / d
        out[f"layer_{key}"] = slope
        out[f"outside_{key}"] = big[key] - slope * big_layers
    return out


def _mean(xs: Sequence[float | None]) -> float | None:
    """The mean of the values that are there (``None`` without any)."""
    got = [x for x in xs if x is not None]
    return statistics.fmean(got) if got else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` (``None`` where either is missing or ``b`` is 0)."""
    return None if a is None or not b else a / b


def compare_rows(data: Mapping[str, Any]) -> list[list[str]]:
    """The ``compare`` table: each measured piece against its compositions."""
    tune, steady = data["composed"]["tune"], data["composed"]["steady"]
    lv, ls = data["loop"]["verify"], data["loop"]["steady"]
    reg = data["loop"]["regression"]
    mix = data["mix"]
    rows = []

    def row(what: str, meas: Mapping[str, Any], ref: Mapping[str, Any], tkey: str,
            ekey: str, ref_label: str) -> None:
        rt, re_ = ratio(meas[tkey], ref[tkey]), ratio(meas[ekey], ref[ekey])
        rows.append([what, ref_label, f"{meas[tkey] * 1e3:.2f}", f"{ref[tkey] * 1e3:.2f}",
                     f"{meas[ekey]:.2f}", f"{ref[ekey]:.2f}",
                     "-" if rt is None else f"{rt:.3f}", "-" if re_ is None else f"{re_:.3f}",
                     _mhz(meas.get("sm_clock_mhz")), _mhz(ref.get("sm_clock_mhz"))])

    big = f"loop L={data['options']['layers']}"
    row(f"{big} verify", lv, tune, "time_s", "energy_j", "composed tune")
    row(f"{big} steady", ls, steady, "time_s", "energy_j", "composed steady")
    if data.get("composed_small"):
        row(f"loop L={data['options']['small_layers']} steady", data["loop"]["small"]["steady"],
            data["composed_small"]["steady"], "time_s", "energy_j", "composed steady")
    row(f"{big} verify", lv, ls, "time_s", "energy_j", "loop steady")
    if data["loop"].get("verify_warm"):
        row(f"{big} verify, warm", data["loop"]["verify_warm"], ls, "time_s", "energy_j",
            "loop steady")
    row("composed tune", tune, steady, "time_s", "energy_j", "composed steady")
    row("per layer (loop)", reg, steady, "layer_time_s", "layer_energy_j", "composed steady")
    row("outside+tail (loop)", reg, steady, "outside_time_s", "outside_energy_j",
        "composed steady")
    row("layer mix", mix["mix"], mix["singles"], "time_s", "energy_j", "sum of singles")
    if data.get("mix_microbatch"):
        mb = data["mix_microbatch"]
        row("microbatch mix", mb["mix"], mb["singles"], "time_s", "energy_j",
            "sum of singles")
        row(f"{big} steady", ls, data["programs_iteration"], "time_s", "energy_j",
            "M x microbatch mix + tail")
    for name, t in data["types"].items():
        row(f"{name}", t["tune"], t["steady"], "time_s", "energy_j", "steady")
    for name, t in data["outside"].items():
        row(f"outside {name}", t["tune"], t["steady"], "time_s", "energy_j", "steady")
    return rows


def findings(data: Mapping[str, Any]) -> list[str]:
    """One line per question the probe answers, with the figure that answers it (energy
    and time ratios, measured / reference; the docstring says how to read them)."""
    def r(a: Mapping[str, Any], b: Mapping[str, Any], key: str) -> str:
        x = ratio(a.get(key), b.get(key))
        return "-" if x is None else f"{x:.3f}"

    tune, steady = data["composed"]["tune"], data["composed"]["steady"]
    lv, ls = data["loop"]["verify"], data["loop"]["steady"]
    reg, mix = data["loop"]["regression"], data["mix"]
    per_type = [ratio(t["tune"]["energy_j"], t["steady"]["energy_j"])
                for t in [*data["types"].values(), *data["outside"].values()]]
    known = [x for x in per_type if x is not None]
    lines = [
        f"the miss as verify sees it: loop (verify's window) / composed (tune's "
        f"measurements): energy {r(lv, tune, 'energy_j')}, time {r(lv, tune, 'time_s')}",
        f"verify's window: loop verify / loop steady: energy {r(lv, ls, 'energy_j')}, time "
        f"{r(lv, ls, 'time_s')} (far from 1: verify's short window is not the steady "
        "state); after a long warm-up: energy "
        f"{r(data['loop'].get('verify_warm') or {}, ls, 'energy_j')} (near 1: the "
        "transient after verify's one warm-up iteration; still far: the window's start "
        "locked to a counter step, NVML sampling the iteration's phases unevenly)",
        f"the tune's window: composed tune / composed steady: energy "
        f"{r(tune, steady, 'energy_j')}; per piece {min(known):.3f}-{max(known):.3f}"
        if known else "the tune's window: -",
        f"steady against steady: loop / composed: energy {r(ls, steady, 'energy_j')}, time "
        f"{r(ls, steady, 'time_s')}",
        f"where: per layer {r(reg, steady, 'layer_energy_j')} (time "
        f"{r(reg, steady, 'layer_time_s')}), outside the layers "
        f"{r(reg, steady, 'outside_energy_j')} (time {r(reg, steady, 'outside_time_s')}); "
        "a split that assumes each piece costs the same at both depths: compare the loop's "
        f"SM clocks, {_mhz((data['loop'].get('small') or {}).get('steady', {}).get('sm_clock_mhz'))}"
        f" and {_mhz(ls.get('sm_clock_mhz'))} MHz (they differ where the power limit "
        "averages over a different mix)",
        f"additivity: one layer's partitions back to back / alone, summed: energy "
        f"{r(mix['mix'], mix['singles'], 'energy_j')}, time "
        f"{r(mix['mix'], mix['singles'], 'time_s')}, SM clock "
        f"{_mhz(mix['mix'].get('sm_clock_mhz'))} against {_mhz(mix['singles'].get('sm_clock_mhz'))}"
        " MHz",
    ]
    if data.get("mix_microbatch"):
        mb, prog = data["mix_microbatch"], data["programs_iteration"]
        lines += [
            f"additivity over a microbatch (outside work included): energy "
            f"{r(mb['mix'], mb['singles'], 'energy_j')}, time "
            f"{r(mb['mix'], mb['singles'], 'time_s')}, SM clock "
            f"{_mhz(mb['mix'].get('sm_clock_mhz'))} against "
            f"{_mhz(mb['singles'].get('sm_clock_mhz'))} MHz (above 1 with a higher clock: "
            "the power limit averages over the mix, not over each program)",
            f"the loop's code against the tune's programs: loop steady / (M x microbatch mix "
            f"+ tail): energy {r(ls, prog, 'energy_j')}, time {r(ls, prog, 'time_s')}"]
    return lines


def _mhz(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def table(rows: list[list[str]]) -> str:
    """A plain text table of ``compare_rows``."""
    head = ["measured", "against", "ms", "ref ms", "J", "ref J", "time", "energy",
            "MHz", "ref MHz"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths))) for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------ the emulator (CPU)


def emulated_coupling(args: argparse.Namespace, layers: int) -> dict[str, Any]:
    """The emulator's answer to "is a composition of pieces each measured under the power
    limit additive?" for the probed job at ``layers`` layers (per GPU per iteration).

    ``alone``: every piece (partition, outside work, tail) emulated at the maximum clock
    with the power limit acting on it alone (as each is measured, and then composed);
    ``mix``: the pieces emulated without the limit at one common clock, the highest at
    which the iteration's average power is within the limit (the limit acting on the
    average over the iteration, as the power probe measured it doing over a few ms).
    EMULATED figures."""
    import attrs

    from kareus.model.config import ScheduleConfig
    from kareus.model.partition import OutsideWork, build_partitions
    from kareus.model.workload import Parallelism, Workload, get_model
    from kareus.profilers import EmulatedGPU, EmulatedProfiler

    gpu: Any = (EmulatedGPU.from_profile("h200-sxm", comm_backend="nccl")
                if args.gpu == "calibrated" else args.gpu)
    wl = Workload(model=attrs.evolve(get_model(args.model), layers=layers),
                  parallelism=Parallelism(tp=args.tp, cp=args.cp),
                  microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                  num_microbatches=args.microbatches)
    pset = build_partitions(wl.with_(nanobatches=1) if args.schedule == "sequential" else wl)
    free = EmulatedProfiler(gpu, noise=0.0, power_limit=False, group_gpus=1)
    limited = EmulatedProfiler(gpu, noise=0.0, power_limit=True, group_gpus=1)
    spec = free.gpu
    m = wl.num_microbatches
    # (instances per iteration, a partition and its launch slot, or outside work)
    pieces: list[tuple[int, Any, str | None]] = []
    for phase in ("fwd", "bwd"):
        for name, c in pset.counts[phase].items():
            part = pset.types[name]
            slot = (part.slots[0].name if args.schedule == "nanobatching" and part.slots
                    else None)
            pieces.append((m * c, part, slot))
        pieces.append((m, pset.outside[(0, phase)], None))
    if not pset.iteration.empty:
        pieces.append((1, pset.iteration, None))

    def total(prof: Any, f: int) -> tuple[float, float]:
        t = e = 0.0
        for n, what, slot in pieces:
            got = (prof.measure_outside(what, f, group_size=1) if isinstance(what, OutsideWork)
                   else prof.measure(what, ScheduleConfig(f, spec.default_comm_sms, slot)))
            t, e = t + n * got.time_s, e + n * got.energy_j
        return t, e

    ta, ea = total(limited, spec.max_clock_mhz)
    mix_f, (tb, eb) = spec.max_clock_mhz, total(free, spec.max_clock_mhz)
    for f in sorted(spec.clocks_mhz, reverse=True):
        mix_f, (tb, eb) = f, total(free, f)
        if eb <= spec.power_limit_w * tb:
            break
    return {"layers": layers, "power_limit_w": spec.power_limit_w,
            "alone": {"time_s": ta, "energy_j": ea, "power_w": ea / ta},
            "mix": {"time_s": tb, "energy_j": eb, "power_w": eb / tb, "sm_clock_mhz": mix_f},
            "time_ratio": tb / ta, "energy_ratio": eb / ea}


def emulated_lines(found: Sequence[Mapping[str, Any]], label: str) -> list[str]:
    """One line per depth of ``emulated_coupling``."""
    return [f"EMULATED ({label}), {d['layers']} layer(s): pieces limited alone "
            f"{1e3 * d['alone']['time_s']:.1f} ms {d['alone']['energy_j']:.2f} J "
            f"({d['alone']['power_w']:.0f} W); one mix at {d['mix']['sm_clock_mhz']} MHz "
            f"{1e3 * d['mix']['time_s']:.1f} ms {d['mix']['energy_j']:.2f} J "
            f"({d['mix']['power_w']:.0f} W): mix / alone time {d['time_ratio']:.3f}, "
            f"energy {d['energy_ratio']:.3f}" for d in found]


# ------------------------------------------------------------------ measuring (GPU)


def steady(step: Callable[[], Any], meter: Any, *, settle_s: float, window_s: float,
           sync: Callable[[], None]) -> dict[str, Any]:
    """``step`` back to back for ``settle_s``, then a window of at least ``window_s``:
    time and energy per step (this GPU; the counter's steps inside the window), power,
    the window's mean SM clock, its sub-windows' powers and the temperature after."""
    sync()
    t = time.perf_counter()
    for _ in range(2):
        step()
    sync()
    est = max((time.perf_counter() - t) / 2, 1e-6)
    for _ in range(math.ceil(settle_s / est)):
        step()
    sync()
    n = max(3, math.ceil(window_s / est))
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    t1 = time.perf_counter()
    while t1 - t0 < window_s:  # the first steps' pace was off: a few more
        more = max(1, math.ceil((window_s - (t1 - t0)) * n / (t1 - t0)))
        for _ in range(more):
            step()
        n += more
        sync()
        t1 = time.perf_counter()
    e, d, counted = meter.energy_between(t0, t1)
    if counted < 1 or d <= 0:
        raise RuntimeError(f"NVML's energy counter did not step inside a {t1 - t0:.2f} s "
                           "window: pass a longer --window-s")
    power = e / d
    return {"time_s": (t1 - t0) / n, "energy_j": power * (t1 - t0) / n,
            "power_w": power, "steps": n, "window_s": t1 - t0, "counter_steps": counted,
            "sm_clock_mhz": meter.mean_sm_clock_mhz(t0, t1),
            "sub_powers_w": meter.split_powers_w(t0, t1, 4),
            "temp_c": max(meter.temperatures_c())}


def _runs_figures(recs: Sequence[Any]) -> dict[str, Any]:
    """Verify's figures of some runs (``measure_runs``' records): mean time, energy and SM
    clock per iteration (this GPU), and the runs."""
    return {"time_s": statistics.fmean(r.time_s for r in recs),
            "energy_j": _mean([r.energy_j for r in recs]),
            "sm_clock_mhz": _mean([r.sm_clock_mhz for r in recs]),
            "runs": [r.to_dict() for r in recs]}


def _tune_figures(rec: Any) -> dict[str, Any]:
    """A profiler record's figures per GPU measured (before the scaling to the group)."""
    m = rec.measurement
    e1 = m.energy_j * rec.measured_gpus / rec.scope_gpus
    return {"time_s": m.time_s, "energy_j": e1, "power_w": rec.power_w / rec.measured_gpus,
            "sm_clock_mhz": rec.sm_clock_mhz, "gpu_busy": rec.gpu_busy,
            "window_s": rec.window_s, "temp_c": rec.start_temp_c}


def _measure(args: argparse.Namespace, log: Callable[[str], None],  # noqa: C901 - the probe's steps in order
             out: dict[str, Any]) -> dict[str, Any]:
    """Every measurement of the probe, filled into ``out`` as it goes (a failure leaves
    what was measured before it there)."""
    import attrs
    import torch

    from kareus.exec import DryRunFrequencyController, RunnableTransformerPartition, TorchExecutor
    from kareus.exec.nvml_device import min_energy_window_s
    from kareus.exec.outside_work import RunnableOutsideWork
    from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives, measure_runs
    from kareus.model.config import ScheduleConfig
    from kareus.model.gpu import get_gpu
    from kareus.model.partition import build_partitions
    from kareus.model.workload import Parallelism, Workload, get_model
    from kareus.profilers.nvml import EnergyMeter, NVMLProfiler, TorchPartitionRunner
    from kareus.tune import detect_gpu_preset, one_gpu_backends

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.cuda.get_device_name()
    spec = get_gpu(detect_gpu_preset(device))

    def job(layers: int) -> Workload:
        return Workload(model=attrs.evolve(get_model(args.model), layers=layers),
                        parallelism=Parallelism(tp=args.tp, cp=args.cp),
                        microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                        num_microbatches=args.microbatches)

    wl = job(args.layers)
    system_wl = wl.with_(nanobatches=1) if args.schedule == "sequential" else wl
    pset = build_partitions(system_wl)
    f, sms = spec.max_clock_mhz, spec.default_comm_sms

    def config(part: Any) -> ScheduleConfig:
        slot = part.slots[0].name if args.schedule == "nanobatching" and part.slots else None
        return ScheduleConfig(f, sms, slot)

    named, default, note = one_gpu_backends(wl, loopback=args.loopback, gpu=spec.name)
    executor = TorchExecutor(collective=named["loopback"], backends=named,
                             default_collective=default)
    runnables: dict[str, Any] = {}

    def resolve(part: Any) -> Any:
        if part.name not in runnables:
            runnables[part.name] = RunnableTransformerPartition(part, system_wl)
        return runnables[part.name]

    def outside_runnable(work: Any, comm_sms: int | None) -> Any:
        return RunnableOutsideWork(work, system_wl, comm_sms=comm_sms)

    meter = EnergyMeter()
    prof_runner = TorchPartitionRunner(executor, seed=1234, resolve=resolve)
    prof = NVMLProfiler(gpu=spec, runner=prof_runner,
                        meter=meter, frequency=DryRunFrequencyController(gpu=spec),
                        comm_sms=[sms], outside=outside_runnable)
    sync = torch.cuda.synchronize
    out.update({"device": device, "gpu": spec.name, "collectives": note})
    try:
        prof.start()
        out["idle_power_w"] = prof.idle_power_w
        out["counter_step_s"] = prof.step_period_s
        first = next(iter(pset.types.values()))
        out["preheat_baseline_c"] = prof.preheat(first, config(first))
        log(f"static (idle) {prof.idle_power_w:.1f} W; counter every "
            f"{1e3 * (prof.step_period_s or 0):.0f} ms; pre-heated to "
            f"{out['preheat_baseline_c']:.0f} C")

        def own_runner(name: str) -> Any:
            r = TorchPartitionRunner(executor, seed=1234, resolve=resolve)
            r.SEQUENCE = f"probe:{name}"  # its own graphs, held beside the others'
            return r

        # 1. each partition type: as the tune measures it, then steady
        types: dict[str, Any] = {}
        steps: dict[str, Callable[[], None]] = {}
        for name, part in pset.types.items():
            rec = prof.measure_record(part, config(part))
            steps[name] = own_runner(name).prepare(part, config(part))
            types[name] = {"tune": _tune_figures(rec),
                           "steady": steady(steps[name], meter, settle_s=args.settle_s,
                                            window_s=args.window_s, sync=sync)}
            log(f"{name}: tune {1e3 * types[name]['tune']['time_s']:.3f} ms "
                f"{types[name]['tune']['energy_j']:.4f} J; steady "
                f"{1e3 * types[name]['steady']['time_s']:.3f} ms "
                f"{types[name]['steady']['energy_j']:.4f} J")
        out["types"] = types

        # 2. the work outside partitions and the tail
        outside: dict[str, Any] = {}
        group = wl.parallelism.tp * wl.parallelism.cp
        works = {"fwd": pset.outside[(0, "fwd")], "bwd": pset.outside[(0, "bwd")]}
        if not pset.iteration.empty:
            works["tail"] = pset.iteration
        for name, work in works.items():
            scope = wl.parallelism.world_size if name == "tail" else group
            prof.measure_outside(work, f, group_size=scope)
            orec = prof.last_record
            assert orec is not None
            part = outside_runnable(work, None)
            steps[f"outside:{name}"] = own_runner(f"outside-{name}").prepare(
                part, ScheduleConfig(f, sms, None))
            outside[name] = {"tune": _tune_figures(orec),
                             "steady": steady(steps[f"outside:{name}"], meter,
                                              settle_s=args.settle_s, window_s=args.window_s,
                                              sync=sync)}
            log(f"outside {name}: tune {outside[name]['tune']['energy_j']:.3f} J, steady "
                f"{outside[name]['steady']['energy_j']:.3f} J")
        out["outside"] = outside

        # 3. one layer's partitions of one microbatch back to back (steady)
        per_layer = per_layer_counts(pset.counts, args.layers)
        seq = mix_order(pset.counts, args.layers)

        def mix_step() -> None:
            for n in seq:
                steps[n]()

        alone = {**{n: t["steady"] for n, t in types.items()},
                 **{f"outside:{n}": o["steady"] for n, o in outside.items()}}
        mixed = steady(mix_step, meter, settle_s=args.settle_s, window_s=args.window_s,
                       sync=sync)
        out["mix"] = {"order": seq, "mix": mixed, "singles": summed(alone, seq)}
        log(f"layer mix {mixed['energy_j']:.3f} J against "
            f"{out['mix']['singles']['energy_j']:.3f} J alone, summed")
        # ... and a whole microbatch (its outside work and every layer, forward then
        # backward), the loop's computations made of the tune's programs
        mb_seq = microbatch_order(pset.counts, args.layers)

        def mb_step() -> None:
            for n in mb_seq:
                steps[n]()

        mb = steady(mb_step, meter, settle_s=args.settle_s, window_s=args.window_s, sync=sync)
        out["mix_microbatch"] = {"order": mb_seq, "mix": mb, "singles": summed(alone, mb_seq)}
        log(f"microbatch mix {mb['energy_j']:.3f} J against "
            f"{out['mix_microbatch']['singles']['energy_j']:.3f} J alone, summed")

        # 4. the composition, from either measurement
        tail = outside.get("tail")
        out["composed"], out["composed_small"] = {}, {}
        for how in ("tune", "steady"):
            for key, depth in (("composed", args.layers), ("composed_small", args.small_layers)):
                c: dict[str, Any] = composed(
                    {n: t[how] for n, t in types.items()}, per_layer, layers=depth,
                    microbatches=args.microbatches,
                    outside={k: v[how] for k, v in outside.items() if k != "tail"},
                    tail=tail[how] if tail else None)
                c["sm_clock_mhz"] = _mean([t[how]["sm_clock_mhz"] for t in types.values()])
                out[key][how] = c
        prof_runner.release()

        # 5. the training loop, as verify runs it and steady, at two depths
        window = min_energy_window_s(meter)
        loops: dict[str, Any] = {}
        verify_warm: dict[str, Any] | None = None
        for layers in (args.small_layers, args.layers):
            lwl = job(layers)
            times = None
            if args.loopback == "faithful":
                from kareus.profilers.collective_times import EmulatedCollectiveTimes

                times = EmulatedCollectiveTimes(spec.name)
            groups = LoopbackGroups(tp=args.tp, cp=args.cp)  # as verify sets the loop up
            capped, dflt, _ = make_collectives(groups, backend="loopback", caps=(sms,),
                                               loopback=args.loopback, times=times)
            loop = TrainingLoop(workload=lwl, groups=groups, collective=capped,
                                default_collective=dflt)
            loop.reset()
            loop.step(args.schedule)  # capture, compile
            sync()
            recs = measure_runs(loop, [(args.schedule, 0), (args.schedule, 1)], steps=2,
                                warmup=1, meter=meter, min_window_s=window)
            verify = _runs_figures(recs)
            if layers == args.layers:  # verify's window after a long warm-up
                warm = max(1, math.ceil(args.settle_s / verify["time_s"]))
                verify_warm = _runs_figures(measure_runs(
                    loop, [(args.schedule, 0), (args.schedule, 1)], steps=2, warmup=warm,
                    meter=meter, min_window_s=window))
                verify_warm["warmup_iterations"] = warm
            count = [0]

            def loop_step(loop: Any = loop, count: list[int] = count) -> None:
                if count[0] % RESET_EVERY == 0:
                    loop.reset()
                count[0] += 1
                loop.step(args.schedule)

            loop.reset()
            st = steady(loop_step, meter, settle_s=args.settle_s, window_s=args.window_s,
                        sync=sync)
            loops[str(layers)] = {"verify": verify, "steady": st}
            log(f"loop {layers} layer(s): verify {1e3 * verify['time_s']:.2f} ms "
                f"{verify['energy_j'] or float('nan'):.2f} J; steady "
                f"{1e3 * st['time_s']:.2f} ms {st['energy_j'] or float('nan'):.2f} J")
            del loop
            torch.cuda.empty_cache()
        big, small = loops[str(args.layers)], loops[str(args.small_layers)]
        out["loop"] = {"verify": big["verify"], "verify_warm": verify_warm,
                       "steady": big["steady"],
                       "small": small,
                       "regression": regression(small["steady"], big["steady"],
                                                args.small_layers, args.layers)}
        t_mb = out["mix_microbatch"]["mix"]
        out["programs_iteration"] = {
            k: args.microbatches * t_mb[k] + (tail["steady"][k] if tail else 0.0)
            for k in ("time_s", "energy_j")}
        out["programs_iteration"]["sm_clock_mhz"] = t_mb.get("sm_clock_mhz")
    finally:
        prof.close()
        for backend in named.values():
            with contextlib.suppress(Exception):  # best effort
                backend.close()
    return out


def _emulated_main(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--emulated``: the emulator's coupling estimate at both depths; print, write."""
    found = [emulated_coupling(args, n) for n in (args.small_layers, args.layers)]
    lines = emulated_lines(found, args.gpu)
    print("\n".join(lines))
    data = {"what": ("EMULATED, not measured: the emulator's estimate of how far a "
                     "composition of pieces each under the power limit alone (as the tune "
                     "measures and composes them) is from the iteration under one limit "
                     "(as the loop runs), per GPU per iteration"),
            "measured": False,
            "command": "bench/probes/verify_energy_probe.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(args).items()},
            "depths": found, "lines": lines}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table, write the JSON."""
    args = parse_args(argv)
    if args.emulated:
        return _emulated_main(args, argv)
    try:
        import torch
        cuda = bool(torch.cuda.is_available())
    except ImportError:
        cuda = False
    if not cuda:
        print("verify_energy_probe.py: no CUDA GPU; this probe measures on one (see --help)",
              file=sys.stderr)
        return 2
    t_begin = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}", flush=True)

    data: dict[str, Any] = {}
    error = None
    try:
        _measure(args, log, data)
    except Exception as exc:  # keep what was measured before the failure
        import traceback

        error = f"{type(exc).__name__}: {exc}"
        data["traceback"] = traceback.format_exc()
        print(data["traceback"], file=sys.stderr, flush=True)
        log(f"FAILED: {error}")
    data["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data["what"] = ("verify's energy miss placed (issue 36): per GPU per iteration, the "
                    "loop as verify measures it and steady, against the tune's composition "
                    "of the partitions, outside work and tail measured as the tune does and "
                    "steady" + ("; STAND-IN (time-faithful loopback)"
                                if args.loopback == "faithful" else ""))
    data["command"] = "bench/probes/verify_energy_probe.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    data["date_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds")
    data["elapsed_s"] = time.perf_counter() - t_begin
    if error is None:
        rows = compare_rows(data)
        data["table"] = rows
        print()
        print(table(rows))
        print("per GPU (the one measured) per iteration; ratios: measured / reference")
        data["findings"] = findings(data)
        print()
        print("\n".join(data["findings"]))
    else:
        data["error"] = error
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1, default=str) + "\n")
        print(f"wrote {args.json}" + (" (PARTIAL: the run failed)" if error else ""))
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
