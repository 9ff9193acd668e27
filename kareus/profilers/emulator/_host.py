"""The host that feeds the emulated GPU: eager launches or CUDA-graph replay.

A GPU runs only what the host has enqueued. PyTorch launched eagerly costs host time per
op: measured on one H200 with torch 2.11 (``data/host_launch_h200.json``, earlier
measurements of this project by the bench), 4 us for ``torch.empty``, 10 us for
``torch.add``, 21-35 us for a Triton kernel launch, 12-24 us for a cuBLAS GEMM through
torch, 59-85 us for SDPA forward and 100-148 us backward, 70-128 us for RoPE and 61-117 us
for an RMSNorm forward. A small model's partition runs for less GPU time than its launches
take, and the GPU waits on the host. Replayed from a CUDA graph, the same work costs one
launch of a few microseconds and the kernels run back to back.

The emulator models both (``EmulatedGPU.execution``):

* ``"graphed"`` (the default; what the executor runs on a GPU): one graph launch per run
  of a partition, every kernel enqueued at once; the kernels keep only the GPU-side gap
  between them (``EmulatedGPU.launch_overhead_s``);
* ``"eager"``: the host issues the partition's ops and its collective in program order
  (the collective at its launch slot, before the slot's op; sequential: after the last
  op), each at its own host cost (``host_cost_s``); an op starts at the later of its
  stream being ready and the host having issued it. The simulation
  (``kareus.profilers.emulator._sim``) carries the host as a third resource beside the
  two streams.

Host costs come from a measured GPU profile where it has them (``kareus calibrate``
records the host time per eager call of every op it times: ``EmulatedGPU.host_costs``),
else from ``DEFAULT_HOST_COSTS``, by op kind. Every default says where it comes from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from kareus.errors import ArgumentError
from kareus.model.ops import ComputeOp

__all__ = ["DEFAULT_HOST_COSTS", "EXECUTIONS", "HostCost", "host_cost_s", "host_key"]

#: The execution modes the emulator models: CUDA-graph replay and eager launches.
EXECUTIONS = ("graphed", "eager")

#: Host costs longer than this are refused: a call that takes a second or more was
#: blocked (a synchronisation), not launching.
MAX_HOST_S = 1.0


class HostCost(NamedTuple):
    """The host time of one eager launch of an op (or of a kind of op).

    Attributes:
        partition: Partition type name; ``"*"`` for any partition.
        op: The op's name; with ``partition == "*"``, an op name (that op in any partition)
            or a kind key of ``DEFAULT_HOST_COSTS`` (``"gemm"``, ``"attention_bwd"``,
            ``"collective"``, ...).
        host_s: Host seconds per eager call.
        source: Where the figure comes from.
    """

    partition: str
    op: str
    host_s: float
    source: str


_H200 = "measured on one H200, torch 2.11, by kareus calibrate / the bench " \
        "(data/host_launch_h200.json)"

#: Host seconds per eager call by kind key (:func:`host_key`), with their sources: the
#: middle of the measured range where one was measured (``data/host_launch_h200.json``),
#: else an estimate built from measured pieces. ``"collective"`` is the launch of the
#: collective at its slot (an event record, a stream wait, the kernel launch).
DEFAULT_HOST_COSTS: tuple[HostCost, ...] = (
    HostCost("*", "gemm", 18e-6, f"cuBLAS GEMMs through torch: 12-24 us, {_H200}"),
    HostCost("*", "attention", 72e-6, f"SDPA forward: 59-85 us, {_H200}"),
    HostCost("*", "attention_bwd", 124e-6, f"SDPA backward: 100-148 us, {_H200}"),
    HostCost("*", "norm", 89e-6, f"RMSNorm forward (liger-kernel): 61-117 us, {_H200}"),
    HostCost("*", "norm_bwd", 89e-6, "estimate: as the RMSNorm forward (not measured)"),
    HostCost("*", "rope", 99e-6, f"RoPE: 70-128 us, {_H200}"),
    HostCost("*", "rope_bwd", 99e-6, "estimate: as the RoPE forward (not measured)"),
    HostCost("*", "activation", 25e-6, "estimate: one Triton launch with few arguments "
             f"(21 us) and an output allocation (torch.empty, 4 us), {_H200}"),
    HostCost("*", "elementwise", 10e-6, f"torch.add: 10 us, {_H200}"),
    HostCost("*", "embedding", 10e-6, "estimate: one torch op, as torch.add (10 us, "
             "measured)"),
    HostCost("*", "loss", 35e-6, "estimate: one Triton launch with many arguments "
             "(35 us with 30, measured)"),
    HostCost("*", "collective", 20e-6, "estimate: an event record, a stream wait and the "
             "collective's launch (C++ extension or ProcessGroupNCCL); not measured"),
)


def host_key(op: ComputeOp) -> str:
    """The kind key of ``op`` in ``DEFAULT_HOST_COSTS``: its kind, with ``_bwd`` for a
    backward op (name ending in ``_bwd``) of a kind whose backward launch differs."""
    kind = op.kind.value
    if op.name.endswith("_bwd") and f"{kind}_bwd" in _DEFAULTS:
        return f"{kind}_bwd"
    return kind


_DEFAULTS = {c.op: c for c in DEFAULT_HOST_COSTS}


def host_cost_s(costs: Sequence[HostCost], partition: str | None, op: ComputeOp) -> float:
    """Host seconds of one eager launch of ``op`` in ``partition``.

    The first that exists: a record of the same (partition, op name), of the op name in
    any partition (``"*"``), of its kind key (``"*"``, ``host_key``), else the
    default of ``DEFAULT_HOST_COSTS`` (unknown kinds: ``"elementwise"``'s).
    """
    key = host_key(op)
    best: HostCost | None = None
    rank = 4
    for c in costs:
        if c.partition == partition and c.op == op.name:
            return c.host_s
        if c.partition == "*" and c.op == op.name and rank > 1:
            best, rank = c, 1
        elif c.partition == "*" and c.op == key and rank > 2:
            best, rank = c, 2
    if best is not None:
        return best.host_s
    return _DEFAULTS.get(key, _DEFAULTS.get(op.kind.value, _DEFAULTS["elementwise"])).host_s


def collective_host_s(costs: Sequence[HostCost]) -> float:
    """Host seconds of one eager launch of a collective (a ``"*"``/``"collective"`` record,
    else the default)."""
    for c in costs:
        if c.partition == "*" and c.op == "collective":
            return c.host_s
    return _DEFAULTS["collective"].host_s


def host_costs_tuple(value: Iterable[Sequence[Any]]) -> tuple[HostCost, ...]:
    """The converter of ``EmulatedGPU.host_costs``: records from 4-tuples, checked."""
    out = []
    for item in value:
        part, op, seconds, src = item
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not math.isfinite(seconds) or not 0 < seconds < MAX_HOST_S):
            raise ArgumentError(f"EmulatedGPU.host_costs: the host cost of {part}/{op} must be "
                                f"a finite number of seconds in (0, {MAX_HOST_S}), got "
                                f"{seconds!r}")
        out.append(HostCost(str(part), str(op), float(seconds), str(src)))
    return tuple(out)
