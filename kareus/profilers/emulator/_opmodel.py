"""The emulator's op model: an op reduced to roofline terms, its work time, and the
calibration factors a measured GPU profile puts on it.

Both ``_gpu`` (the emulated GPU, which runs ops through this model) and ``_calibration``
(which fits the factors by running the uncalibrated model against measured records)
build on it; it imports neither, so the dependency runs one way.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import attrs

from kareus.model.ops import ComputeOp, OpKind

# p of the p-norm that combines compute time and memory time of an op (a soft roofline max).
_ROOFLINE_P = 4.0
# p of the soft minimum between an op's bandwidth share and what its SMs can issue.
_ISSUE_P = 4.0

#: Token rows of one output tile of a grouped GEMM (the M tile of the Hopper grouped-GEMM
#: kernels of CUTLASS / Transformer Engine: 128): each expert's GEMM computes whole tiles,
#: so its rows are padded up to a multiple (``grouped_gemm_efficiency``).
GROUPED_GEMM_TILE_ROWS = 128


def grouped_gemm_efficiency(group_rows: float) -> float:
    """The fraction of a grouped GEMM's tensor-core work that is useful: each group's
    ``group_rows`` token rows (tokens per expert) padded up to whole tiles of
    ``GROUPED_GEMM_TILE_ROWS`` rows, ``rows / (tiles x tile rows)``; 1 for an op that is
    not grouped (``group_rows == 0``). A stated, uncalibrated model: no grouped GEMM was
    measured yet; it captures the loss of small experts (8 rows of 128: 6%) and nothing
    of the kernel's scheduling of many groups."""
    if group_rows <= 0:
        return 1.0
    tiles = math.ceil(group_rows / GROUPED_GEMM_TILE_ROWS)
    return group_rows / (tiles * GROUPED_GEMM_TILE_ROWS)


class OpCalibration(NamedTuple):
    """Factors on the op model of one op (see the module docstring).

    Attributes:
        partition: Partition type name (``"fwd_attn"``); ``"*"`` for a kind default.
        op: Op name within the partition; for a kind default, the kind (``"gemm"``,
            ``"attention"``, ``"elementwise"``).
        time_factor: Measured time over the model's at the maximum clock.
        power_factor: Multiplier of the op's dynamic power.
        model_s: The model's time of the measured op (for picking the record nearest in
            size among several workloads); 0 for kind defaults.
        source: Where the factors come from (``"workload/kernel set"`` or a note).
    """

    partition: str
    op: str
    time_factor: float
    power_factor: float
    model_s: float
    source: str


def profile_kind(kind: OpKind | str) -> str:
    """The profile's op kind (gemm, attention, elementwise) of an [`OpKind`][kareus.model.OpKind]."""
    k = OpKind(kind)
    if k is OpKind.GEMM:
        return "gemm"
    if k is OpKind.ATTENTION:
        return "attention"
    return "elementwise"


def lookup(calibrations: tuple[OpCalibration, ...], partition: str | None, op: ComputeOp,
           model_s: float) -> OpCalibration | None:
    """The factors for ``op`` of ``partition``: the record of the same (partition, op)
    nearest in model time, else the kind default, else ``None``."""
    same = [c for c in calibrations if c.partition == partition and c.op == op.name]
    if same:
        return min(same, key=lambda c: abs(math.log(max(c.model_s, 1e-12) / max(model_s, 1e-12))))
    kind = profile_kind(op.kind)
    for c in calibrations:
        if c.partition == "*" and c.op == kind:
            return c
    return None


# ----------------------------------------------------------------------------- ops


@attrs.frozen
class _Op:
    """An op reduced to what the simulation needs."""

    cycles: float  # SM-clock cycles of compute work summed over SMs (flops / (eff x fpc))
    bytes: float
    tensor: bool
    tensor_flops: float  # flops on tensor cores (for power)
    fpc: float  # peak flops per SM per clock of the unit it runs on
    activity: float  # busy-SM activity
    feed_sm_s: float  # SM-seconds at the clock-independent feed ceiling (0: none)
    power_scale: float = 1.0  # multiplier of the op's own dynamic power (calibration)
    host_s: float = 0.0  # host seconds of one eager launch


def _prep_op(gpu: Any, op: ComputeOp, partition: str | None = None) -> _Op:
    """The op as the simulation takes it; with ``EmulatedGPU.op_calibration``, every
    term of its roofline is multiplied by the time factor and its own dynamic power by
    the power factor of its record (``partition``, op name) or its kind.

    ``gpu`` is an ``EmulatedGPU`` (not imported here: it builds on this module)."""
    kind = op.kind.value
    if kind == "gemm":
        eff, fpc, tensor = gpu.gemm_efficiency, gpu.tensor_flops_per_clock_per_sm, True
    elif kind == "attention":
        eff, fpc, tensor = gpu.attention_efficiency, gpu.tensor_flops_per_clock_per_sm, True
    else:
        eff, fpc, tensor = gpu.vector_efficiency, gpu.vector_flops_per_clock_per_sm, False
    activity = 1.0 if tensor else gpu.mem_op_sm_activity
    # the tensor cores' work: a grouped GEMM computes whole tiles of each expert's rows
    flops = op.flops / grouped_gemm_efficiency(op.group_rows) if op.group_rows else op.flops
    feed = (flops * gpu.sm_count / (gpu.tensor_feed_tflops * 1e12)) if tensor else 0.0
    out = _Op(cycles=flops / (eff * fpc), bytes=float(op.bytes_moved), tensor=tensor,
              tensor_flops=float(flops) if tensor else 0.0, fpc=fpc, activity=activity,
              feed_sm_s=feed, host_s=gpu.host_s(op, partition))
    if not gpu.op_calibration:
        return out
    model_s = _op_work_time(out, gpu.sm_count, gpu.spec.max_clock_mhz * 1e6,
                            gpu.hbm_bytes_per_s, gpu._issue_per_sm_cycle) + gpu.launch_overhead_s
    cal = lookup(gpu.op_calibration, partition, op, model_s)
    if cal is None:
        return out
    k = cal.time_factor
    return attrs.evolve(out, cycles=out.cycles * k, bytes=out.bytes * k,
                        feed_sm_s=out.feed_sm_s * k, power_scale=cal.power_factor)


def _op_work_time(op: _Op, sms: float, f_hz: float, bw_share: float, issue_per_sm_cycle: float
                  ) -> float:
    """Work time of an op on ``sms`` SMs at ``f_hz`` with ``bw_share`` bytes/s of HBM."""
    q = _ROOFLINE_P
    tc = op.cycles / (sms * f_hz)
    acc = tc ** q
    if op.feed_sm_s > 0.0:
        acc += (op.feed_sm_s / sms) ** q
    if op.bytes > 0:
        issue = sms * issue_per_sm_cycle * f_hz
        p = _ISSUE_P
        bw = (bw_share ** -p + issue ** -p) ** (-1.0 / p)
        acc += (op.bytes / bw) ** q
    return acc ** (1.0 / q)
