"""The A100 case study of the Kareus paper on the emulator, and where the A100 preset's collective
throughput comes from (emulated).

Nothing was measured on an A100 for kareus. The one A100 observation is the Kareus paper's
case study: Llama 3.2 3B forward attention, TP=4, 1410 MHz, the all-reduce launched with
Linear 1 (qkv): 2 communication SMs left it exposed, 4 SMs hid it inside the computation
and were energy-optimal (so 3 did not hide it: 3 would have taken fewer SMs from the
computation). This bench finds, by bisection on the emulator, the per-SM all-reduce rate
at which ``k`` SMs just hide the collective, for k = 2, 3, 4; the case study puts the rate
in ``[rate(4), rate(3))``. It then reports the preset's rate (``_A100_KERNEL_FACTOR`` x
the clock-scaled H200 own-kernel rate) and the energy at 2-6 and 20 SMs, so a reader can
see that the preset sits inside the bounds and what follows from it.

Then it reproduces the case study's rows and findings with the preset (noise off, energy
over the 4 GPUs): the schedules at 1410 MHz, the slot that is energy-optimal at 1410 and
at 1100 MHz, and the best overlapped schedule against Megatron-LM's sequential one and
against nanobatching (all-reduce launched with the first op, NCCL's default 32 CTAs).

Last, why 20 SMs cost more than 4 at qkv (the comm's SM-seconds taken from the computation,
the extra time at static and uncore power, the comm SMs' own power), and how the finding
moves when uncertain A100 constants change (``sensitivity`` in the JSON): each case
overrides constants through ``EmulatedGPU.from_spec(..., field=value)`` (the tensor
interference at the values measured on H200, 0.135 and 0.58; the comm interference; the
comm SMs' activity; the link limit; the power constants) and is run twice: with the
preset's per-SM rate, and with the rate re-derived by the bisection above under that
case's constants (the geometric middle of its ``[rate(4), rate(3))``), so that the
case-study input "4 SMs hide, 3 do not" holds again. No preset constant is changed.
``--set FIELD=VALUE`` (repeatable) runs the whole bench with such overrides.

Usage::

    python bench/probes/emulator_a100_case_study.py --json bench/probes/results/emulator_a100_case_study.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kareus.model.config import ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.workload import Workload
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler

FREQ_MHZ = 1410
SLOT = "qkv"


def _partition():
    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096)
    return build_partitions(wl)["fwd_attn"]


def _gpu(rate_gbps: float, link_gbps: float | None = None, **overrides: Any) -> EmulatedGPU:
    """The a100-40gb preset with one scalar all-reduce curve (``rate``, ``link``) and
    ``overrides`` (the partition's only collective is the 4-GPU all-reduce)."""
    if link_gbps is not None:
        overrides["comm_link_gb_per_s"] = link_gbps
    return EmulatedGPU.from_spec("a100-40gb", comm_backend="custom",
                                 comm_gb_per_s_per_sm=rate_gbps, **overrides)


def _exposed_s(part, rate_gbps: float, sms: int, link_gbps: float | None = None,
               **overrides: Any) -> float:
    prof = EmulatedProfiler(_gpu(rate_gbps, link_gbps, **overrides), noise=0.0)
    return prof.trace(part, ScheduleConfig(FREQ_MHZ, sms, SLOT)).exposed_comm_s


def hide_rate_gbps(part, sms: int, lo: float = 1.0, hi: float = 500.0,
                   link_gbps: float | None = None, **overrides: Any) -> float:
    """Smallest per-SM bus rate (GB/s at 1410 MHz) at which ``sms`` SMs leave no exposed
    communication (geometric bisection to 1e-6 relative); ``link_gbps`` and ``overrides``
    change the preset's link limit and constants."""
    if _exposed_s(part, hi, sms, link_gbps, **overrides) > 0:
        raise RuntimeError(f"{sms} SMs expose the collective even at {hi} GB/s per SM")
    while hi / lo > 1 + 1e-6:
        mid = math.sqrt(lo * hi)
        if _exposed_s(part, mid, sms, link_gbps, **overrides) > 0:
            lo = mid
        else:
            hi = mid
    return hi


def _best(prof, part, freq: int, slots, sms=range(1, 31)):
    return min(((prof.measure(part, ScheduleConfig(freq, k, slot)).energy_j, k, slot)
                for slot in slots for k in sms), key=lambda x: x[0])


def why_20_costs_more(prof: EmulatedProfiler, part, k_lo: int = 4, k_hi: int = 20
                      ) -> dict[str, float]:
    """Where the energy difference between ``k_hi`` and ``k_lo`` SMs at qkv goes (4 GPUs).

    ``static_uncore``: the longer run at idle + uncore power; ``comm_sms``: the comm SMs'
    busy power over the collective's run; ``rest``: the computation's dynamic power, HBM
    and link energy (the work is the same; it moves with the clock-independent terms).
    """
    gpu = prof.emulated_gpu
    scale = gpu.dynamic_scale(FREQ_MHZ)
    static_w = gpu.spec.idle_power_w + gpu.uncore_power_w * scale
    out: dict[str, float] = {}
    parts = {}
    for k in (k_lo, k_hi):
        tr = prof.trace(part, ScheduleConfig(FREQ_MHZ, k, SLOT))
        comm_s = tr.comm_end_s - tr.comm_start_s
        parts[k] = {"time_s": tr.time_s, "energy_j": tr.energy_j * 4, "comm_s": comm_s,
                    "comm_sm_s": k * comm_s,
                    "static_uncore_j": static_w * tr.time_s * 4,
                    "comm_sms_j": (gpu.sm_busy_power_w * scale / gpu.sm_count * k
                                   * gpu.comm_sm_activity * comm_s * 4),
                    "qkv_s": tr.op_times_s[[s.name for s in part.slots].index(SLOT)]}
        out.update({f"{key}_{k}": v for key, v in parts[k].items()})
    d = {key: parts[k_hi][key] - parts[k_lo][key] for key in parts[k_lo]}
    out.update({"delta_energy_j": d["energy_j"], "delta_time_s": d["time_s"],
                "delta_static_uncore_j": d["static_uncore_j"],
                "delta_comm_sms_j": d["comm_sms_j"],
                "delta_rest_j": d["energy_j"] - d["static_uncore_j"] - d["comm_sms_j"],
                "extra_comm_sm_s": d["comm_sm_s"],
                "extra_comm_sm_s_over_all_sms": d["comm_sm_s"] / gpu.sm_count})
    return out


def _case(part, rate: float, link: float, overrides: dict[str, Any]) -> dict[str, Any]:
    prof = EmulatedProfiler(_gpu(rate, link, **overrides), noise=0.0)
    slots = [s.name for s in part.slots]
    e = {k: prof.measure(part, ScheduleConfig(FREQ_MHZ, k, SLOT)).energy_j for k in range(1, 31)}
    e_all, k_all, slot_all = _best(prof, part, FREQ_MHZ, slots)
    exposed = {k: prof.trace(part, ScheduleConfig(FREQ_MHZ, k, SLOT)).exposed_comm_s
               for k in (3, 4)}
    return {"rate_gbps_per_sm": rate, "energy_4_j": e[4], "energy_20_j": e[20],
            "e20_over_e4": e[20] / e[4] - 1, "four_beats_twenty": e[4] < e[20],
            "optimal_sms_qkv": min(e, key=e.get), "optimal_all_slots": [k_all, slot_all],
            "optimal_all_slots_energy_j": e_all,
            "exposed_3_ms": exposed[3] * 1e3, "exposed_4_ms": exposed[4] * 1e3}


def sensitivity(part, rate: float, link: float) -> list[dict[str, Any]]:
    """The 4-vs-20-SM finding under changed constants (module docstring)."""
    pre = EmulatedGPU.from_spec("a100-40gb")
    cases: list[tuple[str, dict[str, Any], float]] = [
        ("preset", {}, link),
        ("tensor interference 0.135 (H200, SM-holding kernels)", {"tensor_interference": 0.135},
         link),
        ("tensor interference 0.58 (H200, NCCL fit)", {"tensor_interference": 0.58}, link),
        ("comm interference 0", {"comm_interference": 0.0}, link),
        ("comm interference 0.3", {"comm_interference": 0.3}, link),
        ("comm SM activity 1.0", {"comm_sm_activity": 1.0}, link),
        ("link limit x1.5", {}, link * 1.5),
        ("link limit x0.75", {}, link * 0.75),
        ("busy-SM and tensor power x1.3", {"sm_busy_power_w": pre.sm_busy_power_w * 1.3,
                                           "tensor_power_w": pre.tensor_power_w * 1.3}, link),
        ("uncore power x2", {"uncore_power_w": pre.uncore_power_w * 2}, link),
    ]
    out = []
    for label, ov, lk in cases:
        b4 = hide_rate_gbps(part, 4, link_gbps=lk, **ov)
        b3 = hide_rate_gbps(part, 3, link_gbps=lk, **ov)
        out.append({"case": label, "overrides": ov, "link_gbps": lk,
                    "hide_bounds_gbps_per_sm": [b4, b3],
                    "preset_rate": _case(part, rate, lk, ov),
                    "rederived_rate": _case(part, math.sqrt(b4 * b3), lk, ov)})
    return out


def tensor_interference_thresholds(part, rate: float, link: float, step: float = 0.005,
                                   top: float = 0.6) -> dict[str, dict[str, float | None]]:
    """Per rate choice (the preset's, re-derived): the smallest tensor interference (on a
    ``step`` grid) at which 20 SMs cost no more than 4 at qkv, and the largest at which 4
    SMs are still the optimum at qkv over 1-30 SMs."""
    out: dict[str, dict[str, float | None]] = {}
    for name in ("preset_rate", "rederived_rate"):
        crossover: float | None = None
        four_optimal_up_to = 0.0
        still_four = True
        for i in range(int(round(top / step)) + 1):
            d = round(i * step, 6)
            r = rate
            if name == "rederived_rate":
                r = math.sqrt(hide_rate_gbps(part, 4, link_gbps=link, tensor_interference=d)
                              * hide_rate_gbps(part, 3, link_gbps=link, tensor_interference=d))
            c = _case(part, r, link, {"tensor_interference": d})
            still_four = still_four and c["optimal_sms_qkv"] == 4
            if still_four:
                four_optimal_up_to = d
            if not c["four_beats_twenty"]:
                crossover = d
                break
        out[name] = {"twenty_no_worse_than_four_from": crossover,
                     "four_sms_optimal_up_to": four_optimal_up_to}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override an EmulatedGPU constant for the whole run (sensitivity "
                         "studies; repeatable)")
    ap.add_argument("--no-sensitivity", action="store_true",
                    help="skip the table of the 4-vs-20-SM finding under changed constants")
    args = ap.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        field, _, value = item.partition("=")
        overrides[field.strip()] = float(value)

    part = _partition()
    link_override = overrides.pop("comm_link_gb_per_s", None)
    bounds = {k: hide_rate_gbps(part, k, link_gbps=link_override, **overrides)
              for k in (2, 3, 4)}
    rate, link = EmulatedGPU.from_spec("a100-40gb").comm_curve("all_reduce", 4)
    rate = overrides.pop("comm_gb_per_s_per_sm", rate)
    link = link_override if link_override is not None else link
    preset = _gpu(rate, link, **overrides)
    prof = EmulatedProfiler(preset, noise=0.0)
    if overrides or link_override is not None:
        print(f"overrides: {overrides}, link {link} GB/s, rate {rate} GB/s per SM")
    inside = bounds[4] <= rate < bounds[3]

    print("A100 all-reduce (4 GPUs) per-SM rate that just hides the fwd_attn all-reduce "
          "(emulated, 1410 MHz, qkv slot):")
    print("| SMs | hide rate (GB/s per SM) |")
    print("|---|---|")
    for k, r in bounds.items():
        print(f"| {k} | {r:.2f} |")
    print(f"\npreset rate {rate:.2f} GB/s per SM (link {link:.1f} GB/s); case-study bounds "
          f"[{bounds[4]:.2f}, {bounds[3]:.2f}): {'inside' if inside else 'OUTSIDE'}")

    slots = [s.name for s in part.slots]
    e_opt, k_opt, slot_opt = _best(prof, part, FREQ_MHZ, slots)
    rows = [("2 SMs, qkv", 2, "qkv"), ("3 SMs, qkv", 3, "qkv"), ("4 SMs, qkv", 4, "qkv"),
            ("6 SMs, qkv", 6, "qkv"), ("20 SMs, qkv", 20, "qkv"),
            ("4 SMs, attn_norm", 4, "attn_norm"), ("4 SMs, rope", 4, "rope"),
            (f"{k_opt} SMs, {slot_opt} (energy-optimal at 1410 MHz)", k_opt, slot_opt),
            ("32 SMs, sequential (Megatron-LM)", 32, None),
            ("32 SMs, attn_norm (nanobatching)", 32, "attn_norm")]
    table = []
    print("\n| configuration (1410 MHz) | time (ms) | energy (J, 4 GPUs) | exposed comm (ms) |")
    print("|---|---|---|---|")
    for label, k, slot in rows:
        tr = prof.trace(part, ScheduleConfig(FREQ_MHZ, k, slot))
        e = prof.measure(part, ScheduleConfig(FREQ_MHZ, k, slot)).energy_j
        table.append(dict(label=label, comm_sms=k, slot=slot, time_s=tr.time_s, energy_j=e,
                          exposed_comm_s=tr.exposed_comm_s))
        print(f"| {label} | {tr.time_s * 1e3:.3f} | {e:.3f} | {tr.exposed_comm_s * 1e3:.3f} |")

    f_low = preset.spec.nearest_clock(1100)
    e_low, k_low, slot_low = _best(prof, part, f_low, slots)
    gap = {f: _best(prof, part, f, ["rope"])[0] / _best(prof, part, f, ["qkv"])[0] - 1
           for f in (FREQ_MHZ, f_low)}
    by = {r["label"]: r for r in table}
    best = by[rows[7][0]]
    seq, nano = by[rows[8][0]], by[rows[9][0]]
    findings = {
        "energy_optimal_sms_1410": k_opt, "energy_optimal_slot_1410": slot_opt,
        "energy_optimal_sms_1100": k_low, "energy_optimal_slot_1100": slot_low,
        "freq_1100_mhz": f_low,
        "rope_vs_qkv_gap": {str(f): g for f, g in gap.items()},
        "vs_sequential": {"energy_saving": 1 - best["energy_j"] / seq["energy_j"],
                          "time_saving": 1 - best["time_s"] / seq["time_s"]},
        "vs_nanobatching": {"energy_saving": 1 - best["energy_j"] / nano["energy_j"],
                            "time_saving": 1 - best["time_s"] / nano["time_s"]},
    }
    print(f"\nenergy-optimal at 1410 MHz: {k_opt} SMs, {slot_opt}; at {f_low} MHz: "
          f"{k_low} SMs, {slot_low}")
    print(f"rope vs qkv (best of each): {gap[FREQ_MHZ]:+.2%} at 1410, {gap[f_low]:+.2%} at "
          f"{f_low} MHz")
    for name in ("vs_sequential", "vs_nanobatching"):
        v = findings[name]
        print(f"best {name.replace('_', ' ')}: {v['energy_saving']:.1%} less energy, "
              f"{v['time_saving']:.1%} less time")

    why = why_20_costs_more(prof, part)
    print(f"\n20 vs 4 SMs at qkv: {why['delta_energy_j'] * 1e3:+.1f} mJ, "
          f"{why['delta_time_s'] * 1e6:+.1f} us (qkv {why['qkv_s_4'] * 1e3:.3f} -> "
          f"{why['qkv_s_20'] * 1e3:.3f} ms); the collective runs {why['comm_s_4'] * 1e3:.3f} -> "
          f"{why['comm_s_20'] * 1e3:.3f} ms and takes {why['comm_sm_s_4'] * 1e3:.2f} -> "
          f"{why['comm_sm_s_20'] * 1e3:.2f} SM-ms from the computation "
          f"(+{why['extra_comm_sm_s_over_all_sms'] * 1e6:.0f} us of the whole GPU); energy: "
          f"static + uncore {why['delta_static_uncore_j'] * 1e3:+.1f} mJ, comm SMs "
          f"{why['delta_comm_sms_j'] * 1e3:+.1f} mJ, rest {why['delta_rest_j'] * 1e3:+.1f} mJ")
    sens = [] if args.no_sensitivity else sensitivity(part, rate, link)
    thresholds = ({} if args.no_sensitivity or overrides
                  else tensor_interference_thresholds(part, rate, link))
    if sens:
        print("\n| case | 4-SM bounds (GB/s per SM) | E20/E4 - 1, preset rate | optimum (qkv; "
              "all slots) | E20/E4 - 1, re-derived rate | optimum (qkv; all slots) |")
        print("|---|---|---|---|---|---|")
    for c in sens:
        a, b = c["preset_rate"], c["rederived_rate"]
        print(f"| {c['case']} | [{c['hide_bounds_gbps_per_sm'][0]:.1f}, "
              f"{c['hide_bounds_gbps_per_sm'][1]:.1f}) | {a['e20_over_e4']:+.2%} | "
              f"{a['optimal_sms_qkv']}; {a['optimal_all_slots'][0]} {a['optimal_all_slots'][1]} | "
              f"{b['e20_over_e4']:+.2%} ({b['rate_gbps_per_sm']:.1f}) | {b['optimal_sms_qkv']}; "
              f"{b['optimal_all_slots'][0]} {b['optimal_all_slots'][1]} |")
    for name, v in thresholds.items():
        print(f"tensor interference, {name.replace('_', ' ')}: 4 SMs optimal at qkv up to "
              f"{v['four_sms_optimal_up_to']}, 20 SMs no worse than 4 from "
              f"{v['twenty_no_worse_than_four_from']}")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "emulated": True,
            "partition": "llama3.2-3b fwd_attn, TP=4, mbs 8, seq 4096, 2 nanobatches",
            "freq_mhz": FREQ_MHZ, "slot": SLOT,
            "hide_rate_gbps_per_sm": {str(k): r for k, r in bounds.items()},
            "preset_rate_gbps_per_sm": rate, "preset_link_gbps": link,
            "preset_inside_bounds": inside,
            "overrides": {**overrides, **({"comm_link_gb_per_s": link_override}
                                          if link_override is not None else {})},
            "rows": table, "findings": findings,
            "why_20_sms_cost_more_than_4": why, "sensitivity": sens,
            "tensor_interference_thresholds": thresholds,
        }, indent=2) + "\n")
    return 0 if inside else 1


if __name__ == "__main__":
    sys.exit(main())
