"""Collective curves of the emulated GPU: measured per-SM throughput and link limits.

Each curve gives, for one collective kind and group size, the bus bandwidth one SM moves
at the maximum clock and the bus bandwidth at which the collective saturates (both in
GB/s, nccl-tests convention). The H200 curves are measured; other GPUs are scaled.
"""

from __future__ import annotations

from typing import NamedTuple

from kareus.model.gpu import GPUSpec

__all__ = ["CommCurve"]


class CommCurve(NamedTuple):
    """A collective's measured rate curve on one GPU (see ``EmulatedGPU.comm_curves``).

    Attributes:
        kind: Collective kind (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``).
        group_size: GPUs in the group.
        gb_per_s_per_sm: Bus GB/s one SM moves at the maximum clock.
        link_gb_per_s: Bus GB/s at which the collective saturates.
    """

    kind: str
    group_size: int
    gb_per_s_per_sm: float
    link_gb_per_s: float


# Collective curves measured on H200 (bench/results/collectives_{4,2}xh200_nvlink.json,
# fitted by bench/probes/emulator_comm_tables.py on the 64 MiB rows): (kind, group size,
# bus GB/s per SM at the maximum clock, link limit GB/s).
_H200_COMM: dict[str, tuple[CommCurve, ...]] = {
    "own": (CommCurve("all_reduce", 4, 25.1, 301.0), CommCurve("all_gather", 4, 19.3, 259.0),
            CommCurve("reduce_scatter", 4, 20.8, 257.0), CommCurve("all_reduce", 2, 10.9, 216.0),
            CommCurve("all_gather", 2, 11.9, 239.0), CommCurve("reduce_scatter", 2, 10.8, 208.0)),
    "nccl": (CommCurve("all_reduce", 4, 25.3, 365.0), CommCurve("all_gather", 4, 19.9, 325.0),
             CommCurve("reduce_scatter", 4, 26.0, 304.0), CommCurve("all_reduce", 2, 21.1, 324.0),
             CommCurve("all_gather", 2, 15.2, 268.0), CommCurve("reduce_scatter", 2, 18.4, 236.0)),
}


# Per-SM throughput of the A100 case study's collective kernels relative to kareus's own
# (512-thread blocks, measured on H200, clock-scaled). Nothing was measured on an A100
# here; the one A100 observation is the case study of the Kareus paper ("Kareus: Joint
# Reduction of Dynamic and Static Energy in Large Model Training": Llama 3.2 3B fwd_attn, TP=4,
# 1410 MHz, 1024-thread blocks): 4 communication SMs hid the 96 MiB all-reduce inside the
# computation and were energy-optimal, so 3 SMs did not hide it. In this model that bounds
# the all-reduce rate to [35.8, 48.3) GB/s per SM at 1410 MHz (bench/probes/emulator_a100_case_study.py
# finds the bounds by bisection); the factor puts it near the geometric middle (41.6):
# 1.80 x 23.06 = 41.5 GB/s, and it scales every A100 curve (all kinds, group sizes)
# alike: the same kernel design.
_A100_KERNEL_FACTOR = 1.80


def _comm_curves(spec: GPUSpec, backend: str) -> tuple[CommCurve, ...]:
    """Collective curves for ``spec``: measured on H200 (H100: the same NVLink 4 and SMs);
    other GPUs scale the per-SM rate by the clock (``(f_max / 1980)^0.25``, as a
    latency-bound copy loop) and the link limit by the NVLink bandwidth (an estimate).
    The ``a100-40gb`` preset's own-kernel rates are further scaled to its published case
    study (``_A100_KERNEL_FACTOR``)."""
    curves = _H200_COMM[backend]
    if spec.name in ("h100-sxm", "h200-sxm"):
        return curves
    clock = (spec.max_clock_mhz / 1980.0) ** 0.25
    if spec.name == "a100-40gb" and backend == "own":
        clock *= _A100_KERNEL_FACTOR
    link = spec.nvlink_bandwidth_gbps / 900.0
    return tuple(CommCurve(k, g, round(r * clock, 2), round(lk * link, 1))
                 for k, g, r, lk in curves)
