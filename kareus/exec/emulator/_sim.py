"""The event-driven simulation of one GPU's compute stream and communication stream.

While the collective runs, its SMs are taken from the computation; HBM bandwidth is
shared in proportion to the kernels' demands when they ask for more than the memory
delivers. Rates are recomputed at every event (a kernel or a kernel's phase starts or
ends), so a partition needs a few dozen events at most.

The collective launched with op k gets its SMs when op k starts if its stream has high
priority (:attr:`EmulatedGPU.comm_priority` ``"high"``), and once op k's thread blocks have
all been dispatched if not (``"normal"``): in the limit of many waves that an op without a
shape implies, at op k's end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs

from kareus.exec.emulator._gpu import EmulatedGPU, _Op, _op_work_time
from kareus.model.ops import CommKind, CommOp

__all__ = ["EmulationTrace"]


@attrs.frozen(kw_only=True)
class EmulationTrace:
    """What one emulated run of a partition (or of outside work) looked like, for one GPU.

    Attributes:
        time_s: Wall time.
        energy_j: Energy of one GPU, static included.
        freq_mhz: The clock it ran at (the requested one, or lower if the power limit bit).
        requested_freq_mhz: The clock asked for.
        power_limited: Whether the power limit lowered the clock.
        average_power_w: energy_j / time_s, one GPU.
        compute_end_s: When the last computation op ended.
        comm_start_s: When the collective started (``None`` without one).
        comm_end_s: When the collective ended (``None`` without one).
        exposed_comm_s: Time the collective ran with no computation beside it.
        op_times_s: Duration of each computation op (launch gap included), in order.
    """

    time_s: float
    energy_j: float
    freq_mhz: int
    requested_freq_mhz: int
    power_limited: bool
    average_power_w: float
    compute_end_s: float
    comm_start_s: float | None
    comm_end_s: float | None
    exposed_comm_s: float
    op_times_s: tuple[float, ...]


class _Collective(NamedTuple):
    """A collective as :meth:`_Sim.run` takes it."""

    bus_bytes: float
    sms: int
    start_op: int | None  # index of the op it launches with; None: after all computation
    hbm_bytes_per_bus_byte: float
    kind: str
    group_size: int


@attrs.define
class _RunningCollective:
    """The collective on the communication stream while :meth:`_Sim.run` advances it."""

    latency_left_s: float  # start-up phase (launch gap + handshake) still to run
    bus_bytes_left: float
    sms: float
    hbm_bytes_per_bus_byte: float
    kind: str
    group_size: int


def _collective(gpu: EmulatedGPU, comm: CommOp, sms: int, start: int | None) -> _Collective:
    """A collective for :meth:`_Sim.run`. Ring all-gather moves fewer local HBM bytes per
    bus byte (write what arrives, read it to forward) than all-reduce and reduce-scatter
    (which also read the local operand): 2/3 of ``comm_hbm_bytes_per_bus_byte``."""
    factor = gpu.comm_hbm_bytes_per_bus_byte
    if comm.kind is CommKind.ALL_GATHER:
        factor *= 2.0 / 3.0
    return _Collective(comm.bus_bytes, sms, start, factor, comm.kind.value, comm.group_size)


class _Sim:
    """Event-driven simulation of a compute stream and a communication stream on one GPU."""

    __slots__ = ("gpu", "ops", "S", "hbm", "issue", "gap", "p_static")

    def __init__(self, gpu: EmulatedGPU, ops: Sequence[_Op]) -> None:
        self.gpu = gpu
        self.ops = tuple(ops)
        self.S = gpu.sm_count
        self.hbm = gpu.hbm_bytes_per_s
        self.issue = gpu._issue_per_sm_cycle
        self.gap = gpu.launch_overhead_s
        self.p_static = gpu.spec.idle_power_w

    def run(self, f_mhz: float, comms: Sequence[_Collective],  # noqa: C901 - the event loop of the overlap simulation: rates change at each event over one shared state
            detail: bool = False) -> tuple[float, float, dict[str, Any] | None]:
        """Simulate.

        Args:
            f_mhz: SM clock.
            comms: The collectives; at most one may overlap (``start_op`` set); those
                with ``start_op=None`` run one after another at the end. The overlapped
                one starts with op ``start_op`` at high stream priority, at that op's end
                at normal priority (:attr:`EmulatedGPU.comm_priority`; launched with the
                last op, it then runs after the computation).
            detail: Whether to return per-op timings.

        Returns:
            (time_s, energy_j of one GPU, details or None).
        """
        gpu = self.gpu
        f_hz = f_mhz * 1e6
        scale = gpu.dynamic_scale(f_mhz)
        p_busy = gpu.sm_busy_power_w * scale / self.S  # per busy SM
        p_tensor = gpu.tensor_power_w * scale  # full chip at 100 % tensor use
        p_uncore = gpu.uncore_power_w * scale
        e_hbm = gpu.hbm_energy_pj_per_byte * 1e-12
        e_link = gpu.link_energy_pj_per_byte * 1e-12
        comm_act = gpu.comm_sm_activity
        tensor_slow = 1.0 + gpu.tensor_interference
        S, hbm, issue, gap = self.S, self.hbm, self.issue, self.gap
        ops = self.ops
        n = len(ops)

        # Comm queue: one overlapped (with a start index) and the rest sequential at the end.
        overlapped = [c for c in comms if c.start_op is not None]
        tail = [c for c in comms if c.start_op is None]
        if len(overlapped) > 1:
            raise ValueError("at most one collective may overlap the computation")

        t = 0.0
        energy = 0.0
        op_times: list[float] = []
        comm_start: float | None = None
        comm_end: float | None = None
        exposed = 0.0

        # Compute stream state.
        i = 0
        in_gap = n > 0
        gap_left = gap
        work_left = 1.0  # fraction of op i's work left
        op_start = 0.0

        # Comm stream state: the pending overlapped collective, the active one with phase.
        pending_overlap = overlapped[0] if overlapped else None
        # The op whose start the overlapped collective starts with: its slot's op at high
        # priority; at normal priority the slot op's blocks are dispatched first, and the
        # collective gets SMs at the start of that op's last wave, taken as its end (the
        # many-wave limit, EmulatedGPU.comm_priority): the start of the next op's launch.
        launch_op = -1
        if pending_overlap is not None and pending_overlap.start_op is not None:
            launch_op = pending_overlap.start_op + (1 if gpu.comm_priority == "normal" else 0)
        active: _RunningCollective | None = None
        comm_rate0_cache: dict[tuple[int, bool, str, int], float] = {}

        def comm_rate0(c: _RunningCollective, beside_tensor: bool) -> float:
            key = (int(c.sms), beside_tensor, c.kind, c.group_size)
            r = comm_rate0_cache.get(key)
            if r is None:
                r = gpu.comm_bus_rate(key[0], f_mhz, beside_tensor=beside_tensor,
                                      kind=c.kind, group_size=c.group_size)
                comm_rate0_cache[key] = r
            return r

        def start_comm(c: _Collective) -> _RunningCollective:
            return _RunningCollective(gap + gpu.comm_latency_s, c.bus_bytes, float(c.sms),
                                      c.hbm_bytes_per_bus_byte, c.kind, c.group_size)

        while True:
            # Launch the overlapped collective when op at its slot starts.
            if (pending_overlap is not None and i < n and in_gap and gap_left == gap
                    and i == launch_op):
                active = start_comm(pending_overlap)
                pending_overlap = None
                comm_start = t
            compute_active = i < n
            if not compute_active and active is None:
                if pending_overlap is not None:  # launch op past the end: run after
                    tail.insert(0, pending_overlap)
                    pending_overlap = None
                if tail:
                    active = start_comm(tail.pop(0))
                    if comm_start is None:
                        comm_start = t
                    continue
                break
            comm_sms = int(active.sms) if active is not None else 0
            hbm_per_bus = active.hbm_bytes_per_bus_byte if active is not None else 0.0
            comm_transfer = active is not None and active.latency_left_s <= 0.0
            sms_c = S - comm_sms
            # Demands at full HBM.
            power = self.p_static + p_uncore
            dt_compute = math.inf
            dt_comm = math.inf
            op_rate = 0.0
            op = ops[i] if compute_active else None
            comm_rate = (comm_rate0(active, op is not None and op.tensor and not in_gap)
                         if comm_transfer and active is not None else 0.0)
            if comm_rate * hbm_per_bus > hbm:  # never more than HBM can feed
                comm_rate = hbm / hbm_per_bus
            if op is not None and not in_gap:
                t_op = _op_work_time(op, sms_c, f_hz, hbm, issue)
                op_demand = op.bytes / t_op
                comm_demand = comm_rate * hbm_per_bus
                if comm_demand > 0.0 and op_demand + comm_demand > hbm:
                    share = hbm / (op_demand + comm_demand)
                    t_op = _op_work_time(op, sms_c, f_hz, op_demand * share, issue)
                    comm_rate *= share
                if op.tensor and active is not None:
                    t_op *= tensor_slow
                op_rate = 1.0 / t_op
                dt_compute = work_left * t_op
                # Power of the op (its own dynamic part, times its calibrated factor).
                sm_frac = sms_c / S
                p_op = p_busy * sms_c * op.activity
                if op.tensor:
                    util = (op.tensor_flops * op_rate) / (sms_c * op.fpc * f_hz)
                    p_op += p_tensor * sm_frac * util
                p_op += e_hbm * op.bytes * op_rate
                power += p_op * op.power_scale
            elif op is not None:
                dt_compute = gap_left
            if active is not None:
                power += p_busy * comm_sms * comm_act
                if comm_transfer:
                    dt_comm = active.bus_bytes_left / comm_rate
                    power += (e_hbm * hbm_per_bus + e_link) * comm_rate
                else:
                    dt_comm = active.latency_left_s
            dt = dt_compute if dt_compute < dt_comm else dt_comm
            if dt == math.inf:  # pragma: no cover - defensive
                raise RuntimeError("emulator made no progress")
            t += dt
            energy += power * dt
            if active is not None and not compute_active:
                exposed += dt
            # Advance the compute stream.
            if op is not None:
                if in_gap:
                    gap_left -= dt
                    if dt == dt_compute or gap_left <= 1e-15:
                        in_gap = False
                        gap_left = 0.0
                else:
                    work_left -= dt * op_rate
                    if dt == dt_compute or work_left <= 1e-12:
                        op_times.append(t - op_start)
                        i += 1
                        op_start = t
                        in_gap = i < n
                        gap_left = gap
                        work_left = 1.0
            # Advance the comm stream.
            if active is not None:
                if not comm_transfer:
                    active.latency_left_s -= dt
                    if dt == dt_comm or active.latency_left_s <= 1e-15:
                        active.latency_left_s = 0.0
                else:
                    active.bus_bytes_left -= dt * comm_rate
                    if dt == dt_comm or active.bus_bytes_left <= 1e-6:
                        active = None
                        comm_end = t
        details = None
        if detail:
            details = {"op_times_s": tuple(op_times), "comm_start_s": comm_start,
                       "comm_end_s": comm_end, "exposed_comm_s": exposed,
                       "compute_end_s": op_start if n else 0.0}
        return t, energy, details
