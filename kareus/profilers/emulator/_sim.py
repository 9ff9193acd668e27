"""The event-driven simulation of one GPU's compute stream and communication stream, fed
by its host.

While the collective runs, its SMs are taken from the computation; HBM bandwidth is
shared in proportion to the kernels' demands when they ask for more than the memory
delivers. Rates are recomputed at every event (a kernel or a kernel's phase starts or
ends, or the host issues what a stream waits for), so a partition needs a few dozen
events at most.

The collective launched with op k gets its SMs when op k starts if its stream has high
priority (``EmulatedGPU.comm_priority`` ``"high"``), and once op k's thread blocks have
all been dispatched if not (``"normal"``): in the limit of many waves that an op without a
shape implies, at op k's end.

**The host** is the third resource (``kareus.profilers.emulator._host``). It issues the
work in program order: the ops, with the overlapped collective just before the op of its
slot (the executor records an event after op k-1, makes the communication stream wait on
it, launches the collective, then op k) and the sequential collectives after the last op.
Eagerly every item costs its own host time; graph-captured, one graph launch issues them
all. An op starts at the later of its stream being ready and its issue; the collective at
the later of op k-1's end and its issue (at normal priority, if op k is already running
by then, at op k's end). So a host slower than the GPU leaves the GPU waiting between
kernels, a collective launched eagerly can start before the op it is launched with, and
a partition split in nanobatches pays its launches twice.

A partition is measured as it is on a GPU: repeated back to back, its time is the time
per run in the steady state (``_Sim.run``). The host runs ahead of the GPU by a lead
``L`` when a run starts. If the GPU takes longer per run than the host's issue time ``H``,
the lead grows from run to run until nothing waits on the host (GPU-bound: the time is the
GPU's alone); otherwise the runs settle at the lead where a run takes exactly ``H``
(host-bound), which the simulation finds by the fixed-point iteration
``L <- L + T(L) - H`` (``T`` falls by at most as much as ``L`` grows, so it converges from
below, in one or two steps when the last kernels wait on the host).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs

from kareus.model.ops import CommKind, CommOp
from kareus.profilers.emulator._gpu import EmulatedGPU
from kareus.profilers.emulator._opmodel import _Op, _op_work_time

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
        op_times_s: Duration of each computation op (the wait for the host and the launch
            gap included), in order.
        execution: ``"graphed"`` or ``"eager"`` (``EmulatedGPU.execution``).
        host_s: Host time per run: the graph launch, or the eager launches of every op and
            collective.
        host_bound: Whether the run is set by the host (it takes ``host_s``; the GPU waits
            on the host in between).
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
    execution: str = "graphed"
    host_s: float = 0.0
    host_bound: bool = False


class _Collective(NamedTuple):
    """A collective as ``_Sim.run`` takes it."""

    bus_bytes: float
    sms: int
    start_op: int | None  # index of the op it launches with; None: after all computation
    hbm_bytes_per_bus_byte: float
    kind: str
    group_size: int
    host_s: float = 0.0  # host seconds of its eager launch


@attrs.define
class _RunningCollective:
    """The collective on the communication stream while ``_Sim.run`` advances it."""

    latency_left_s: float  # start-up phase (launch gap + handshake) still to run
    bus_bytes_left: float
    sms: float
    hbm_bytes_per_bus_byte: float
    kind: str
    group_size: int


def _collective(gpu: EmulatedGPU, comm: CommOp, sms: int, start: int | None) -> _Collective:
    """A collective for ``_Sim.run``. Ring all-gather moves fewer local HBM bytes per
    bus byte (write what arrives, read it to forward) than all-reduce and reduce-scatter
    (which also read the local operand): 2/3 of ``comm_hbm_bytes_per_bus_byte``; so does
    an all-to-all (read what it sends, write what arrives)."""
    factor = gpu.comm_hbm_bytes_per_bus_byte
    if comm.kind in (CommKind.ALL_GATHER, CommKind.ALL_TO_ALL):
        factor *= 2.0 / 3.0
    return _Collective(comm.bus_bytes, sms, start, factor, comm.kind.value, comm.group_size,
                       gpu.collective_host_s)


#: Fixed-point steps of the host lead at most (one or two suffice in practice).
_MAX_LEAD_STEPS = 30
#: Host issues this close to now count as done (rounding of event times).
_HOST_EPS_S = 1e-12


class _Sim:
    """Event-driven simulation of a compute stream and a communication stream on one GPU,
    fed by its host."""

    __slots__ = ("gpu", "ops", "S", "hbm", "issue", "gap", "p_static", "eager", "graph_s")

    def __init__(self, gpu: EmulatedGPU, ops: Sequence[_Op]) -> None:
        self.gpu = gpu
        self.ops = tuple(ops)
        self.S = gpu.sm_count
        self.hbm = gpu.hbm_bytes_per_s
        self.issue = gpu._issue_per_sm_cycle
        self.gap = gpu.launch_overhead_s
        self.p_static = gpu.spec.idle_power_w
        self.eager = gpu.execution == "eager"
        self.graph_s = gpu.graph_launch_s

    def host_s(self, comms: Sequence[_Collective]) -> float:
        """Host time of one run: the graph launch, or every op's and collective's eager
        launch."""
        if not self.eager:
            return self.graph_s
        return sum(o.host_s for o in self.ops) + sum(c.host_s for c in comms)

    def run(self, f_mhz: float, comms: Sequence[_Collective], detail: bool = False
            ) -> tuple[float, float, dict[str, Any] | None]:
        """Time and energy per run of back-to-back runs in the steady state (see the module
        docstring): the GPU's own time when it is slower than its host, else the host's
        time per run, with the GPU waiting on it.

        Args:
            f_mhz: SM clock.
            comms: The collectives (``_run_once``).
            detail: Whether to return per-op timings (also ``host_s``, ``host_bound``,
                ``lead_s``).

        Returns:
            (time_s, energy_j of one GPU, details or None).
        """
        host = self.host_s(comms)
        t, e, d = self._run_once(f_mhz, comms, detail, None)
        if t >= host:  # GPU-bound: the host runs ahead, nothing waits on it
            if d is not None:
                d.update(host_s=host, host_bound=False, lead_s=None)
            return t, e, d
        lead = 0.0
        for _ in range(_MAX_LEAD_STEPS):
            t, e, d = self._run_once(f_mhz, comms, detail, lead)
            over = t - host
            if over <= 1e-12 + 1e-9 * host:
                break
            lead += over
        if t < host:  # the GPU idles until the host has issued the next run
            scale = self.gpu.dynamic_scale(f_mhz)
            e += (self.p_static + self.gpu.uncore_power_w * scale) * (host - t)
            t = host
        if d is not None:
            d.update(host_s=host, host_bound=True, lead_s=lead)
        return t, e, d

    def _issue_times(self, comms: Sequence[_Collective], lead: float | None
                     ) -> tuple[list[float] | None, list[float] | None]:
        """When the host has issued each op and each collective (in the order of
        ``comms``), relative to the run's start on the GPU; ``None``: the host is ahead."""
        if lead is None:
            return None, None
        n = len(self.ops)
        if not self.eager:
            at = self.graph_s - lead
            return [at] * n, [at] * len(comms)
        by_op: dict[int, list[int]] = {}
        tail = []
        for j, c in enumerate(comms):
            if c.start_op is not None and c.start_op < n:
                by_op.setdefault(c.start_op, []).append(j)
            else:
                tail.append(j)
        op_at = [0.0] * n
        comm_at = [0.0] * len(comms)
        h = -lead
        for k, op in enumerate(self.ops):
            for j in by_op.get(k, ()):
                h += comms[j].host_s
                comm_at[j] = h
            h += op.host_s
            op_at[k] = h
        for j in tail:
            h += comms[j].host_s
            comm_at[j] = h
        return op_at, comm_at

    def _run_once(self, f_mhz: float, comms: Sequence[_Collective],  # noqa: C901 - the event loop of the overlap simulation: rates change at each event over one shared state
                  detail: bool, lead: float | None
                  ) -> tuple[float, float, dict[str, Any] | None]:
        """Simulate one run.

        Args:
            f_mhz: SM clock.
            comms: The collectives; at most one may overlap (``start_op`` set); those
                with ``start_op=None`` run one after another at the end. The overlapped
                one starts with op ``start_op`` at high stream priority, at that op's end
                at normal priority (``EmulatedGPU.comm_priority``; launched with the
                last op, it then runs after the computation), and never before the host
                has issued it.
            detail: Whether to return per-op timings.
            lead: How far ahead of the GPU the host starts issuing this run, seconds
                (``None``: so far ahead that nothing waits on it).

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
        normal = gpu.comm_priority == "normal"

        # Comm queue: one overlapped (with a start index) and the rest sequential at the end.
        if sum(1 for c in comms if c.start_op is not None) > 1:
            raise ValueError("at most one collective may overlap the computation")
        op_at, comm_at = self._issue_times(comms, lead)
        overlapped = [(c, None if comm_at is None else comm_at[j])
                      for j, c in enumerate(comms) if c.start_op is not None]
        tail = [(c, None if comm_at is None else comm_at[j])
                for j, c in enumerate(comms) if c.start_op is None]

        t = 0.0
        energy = 0.0
        op_times: list[float] = []
        comm_start: float | None = None
        comm_end: float | None = None
        exposed = 0.0

        # Compute stream state: op i waits for the host (waiting), then runs its launch gap
        # (in_gap), then its work.
        i = 0
        waiting = n > 0 and op_at is not None and op_at[0] > 0.0
        in_gap = n > 0
        gap_left = gap
        work_left = 1.0  # fraction of op i's work left
        op_start = 0.0

        # Comm stream state: the pending overlapped collective (and when the host issues
        # it), the active one with its phase.
        pending: _Collective | None = None
        pending_at: float | None = None
        k = n
        if overlapped:
            pending, pending_at = overlapped[0]
            assert pending.start_op is not None
            k = pending.start_op
            if k >= n:  # a slot past the last op: after the computation
                tail.insert(0, overlapped[0])
                pending = None
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
            # Launch the overlapped collective: once ops 0..k-1 are done and the host has
            # issued it; at normal priority op k's blocks go first unless op k still waits
            # on the host.
            issued = pending_at is None or t >= pending_at - _HOST_EPS_S
            if (pending is not None and i >= k and issued
                    and (not normal or i > k or waiting)):
                active = start_comm(pending)
                pending = None
                comm_start = t
            compute_active = i < n
            if not compute_active and active is None and pending is None:
                if tail:
                    nxt, at = tail[0]
                    if at is not None and at > t:  # the host has not issued it yet
                        energy += (self.p_static + p_uncore) * (at - t)
                        t = at
                    tail.pop(0)
                    active = start_comm(nxt)
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
            dt_host = math.inf
            op_rate = 0.0
            op = ops[i] if compute_active else None
            running = op is not None and not waiting and not in_gap
            comm_rate = (comm_rate0(active, op is not None and op.tensor and running)
                         if comm_transfer and active is not None else 0.0)
            if comm_rate * hbm_per_bus > hbm:  # never more than HBM can feed
                comm_rate = hbm / hbm_per_bus
            if op is not None and running:
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
            elif op is not None and waiting:
                assert op_at is not None
                dt_compute = max(op_at[i] - t, 0.0)
            elif op is not None:
                dt_compute = gap_left
            if pending is not None and pending_at is not None and pending_at - t > _HOST_EPS_S:
                dt_host = pending_at - t
            if active is not None:
                power += p_busy * comm_sms * comm_act
                if comm_transfer:
                    dt_comm = active.bus_bytes_left / comm_rate
                    power += (e_hbm * hbm_per_bus + e_link) * comm_rate
                else:
                    dt_comm = active.latency_left_s
            dt = min(dt_compute, dt_comm, dt_host)
            if dt == math.inf:  # pragma: no cover - defensive
                raise RuntimeError("emulator made no progress")
            t += dt
            energy += power * dt
            if active is not None and not compute_active:
                exposed += dt
            # Advance the compute stream.
            if op is not None:
                if waiting:
                    if dt == dt_compute or (op_at is not None and t >= op_at[i]):
                        waiting = False
                elif in_gap:
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
                        waiting = in_gap and op_at is not None and op_at[i] > t
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
