"""The emulated GPU: a physical time and power model, and the embedded default profiler.

Every user without the exact GPU, every CI run, the demo and every 70B-scale study
runs on this model, so it is built as a performance model, not a lookup table:

* **Computation kernels** (roofline at the running clock). An op with ``F`` FLOPs and
  ``B`` HBM bytes on ``s`` SMs at clock ``f`` needs ``F / (eff * flops_per_clock_per_sm
  * s * f)`` of compute time (tensor cores for GEMM and attention at an efficiency below
  peak, CUDA cores for the rest) and ``B / bw`` of memory time, where ``bw`` is the
  smaller (smoothly) of the op's share of the achievable HBM bandwidth and what ``s`` SMs
  can issue at ``f`` (a per-SM issue limit puts a *knee* in frequency: above it
  memory-bound ops are nearly flat in frequency). Tensor-core kernels also have a
  clock-independent feed time (the L2 and crossbar feed the tensor cores at a rate that
  does not follow the SM clock; measured on H200, GEMMs reach 0.82 of the clock's peak at
  1500 MHz and 0.74 at 1980 MHz). The terms combine as a p-norm close to the roofline's
  max, plus a fixed launch overhead per kernel.
* **Communication kernels** move ``CommOp.bus_bytes`` at a rate that grows with their SM
  count and saturates at the effective link bandwidth: ``1/R = ((s r(f))^-p + L^-p)^(1/p)``
  with a per-SM throughput ``r(f) = r0 (f/f_max)^alpha`` (mildly frequency dependent),
  after a fixed start-up latency. They also read and write HBM (a few bytes per bus byte).
* **Overlap** is an event-driven simulation of the computation stream and the
  communication stream. While the collective runs, its SMs are taken from the
  computation; HBM bandwidth is shared in proportion to the kernels' demands when they
  ask for more than the memory delivers. Beside a tensor-core kernel the collective's
  per-SM rate drops, and the tensor-core kernel runs slower than its SM share alone
  explains (both measured on H200). Rates are recomputed at every event (a kernel
  or a kernel's phase starts or ends), so a partition needs a few dozen events at most.
  The collective starts together with the op of its launch slot (or after all
  computation, when sequential).
* **Power** = idle power + dynamic. Dynamic SM power is activity x f x V(f)^2 with V(f)
  flat below a floor clock and linear above it (a tensor-core term for GEMM/attention, a
  busy-SM term for every kernel, an uncore term while anything runs), plus HBM energy
  per byte and link energy per byte. When the average power of the (repeated) work
  exceeds the board power limit, the emulated GPU lowers its own clock to the highest
  supported clock under the limit, as real GPUs do (FACTS.md: H200 at 700 W ran at
  1485-1710 MHz under heavy overlapped load). The requested clock is an upper bound.
* **Noise**: seeded multiplicative measurement noise on time and energy, deterministic
  per (seed, call count); ``noise=0`` gives the noise-free ground truth.

Scope: a partition's :class:`~kareus.model.measurement.Measurement` covers every GPU of
the partition's group. All ranks of a collective are symmetric, so the emulator
simulates one rank and multiplies its energy (and the static power) by the group's GPU
count: the profiler's ``group_gpus`` argument if given, else ``partition.group_gpus``
(the TP x CP GPUs of a stage for partitions built by ``build_partitions``; the
collective's group by default), else ``partition.comm_op.group_size``.

The constants of the presets, where each comes from, and the calibration against the
measured H200 probe are in ``docs/emulator.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kareus.errors import UnknownSlotError
from kareus.model.config import ScheduleConfig
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.measurement import Measurement
from kareus.model.ops import CommKind, CommOp, ComputeOp
from kareus.model.partition import OutsideWork, Partition
from kareus.model.profiler import Profiler

__all__ = ["EmulatedGPU", "EmulatedProfiler", "EmulationTrace"]

# p of the p-norm that combines compute time and memory time of an op (a soft roofline max).
_ROOFLINE_P = 4.0
# p of the soft minimum between an op's bandwidth share and what its SMs can issue.
_ISSUE_P = 4.0


def _pos(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"EmulatedGPU.{attribute.name} must be a finite number > 0, got {value!r}")


def _nonneg(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"EmulatedGPU.{attribute.name} must be a finite number >= 0, got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"EmulatedGPU.{attribute.name} must be in (0, 1], got {value!r}")


@attrs.frozen(kw_only=True)
class EmulatedGPU:
    """The physical model of one GPU: the datasheet :class:`GPUSpec` plus model constants.

    Use :meth:`from_spec` (or :meth:`preset`) for the constants documented in
    ``docs/emulator.md``; pass any field to override it (``attrs.evolve`` works too).

    Attributes:
        spec: The GPU's datasheet description (SMs, clocks, peaks, power limit, idle and
            static power). ``idle_power_w`` is the floor of the power model;
            ``static_power_w`` is only the accounting constant of Measurements.
        tensor_flops_per_clock_per_sm: Dense bf16 tensor-core FLOPs per SM per clock
            (A100: 2048, Hopper: 4096).
        vector_flops_per_clock_per_sm: CUDA-core FLOPs per SM per clock (FP32 FMA x 2).
        gemm_efficiency: Achieved fraction of the clock's tensor peak for GEMMs, before the
            feed ceiling (``tensor_feed_tflops``) lowers it at high clocks.
        attention_efficiency: The same for attention kernels.
        tensor_feed_tflops: FLOP rate (all SMs, TFLOP/s) at which the memory hierarchy (L2,
            crossbar) can feed the tensor cores, independent of the SM clock: tensor-core
            kernels lose efficiency as the clock rises towards it (measured on H200: 0.82
            of the clock's peak at 1500 MHz, 0.74 at 1980 MHz).
        vector_efficiency: Achieved fraction of the CUDA-core peak for other kernels.
        hbm_efficiency: Achievable fraction of the datasheet HBM bandwidth.
        mem_knee_fraction: Clock (as a fraction of the maximum) at which all SMs can just
            issue enough memory traffic to saturate HBM; memory-bound ops slow down below it.
        launch_overhead_s: Gap per kernel on a stream (launch and tail), seconds.
        comm_gbps_per_sm: Bus bandwidth (GB/s, nccl-tests convention) one SM of a collective
            moves at the maximum clock.
        comm_link_gbps: Bus bandwidth at which collectives saturate (the NVLink limit), GB/s.
        comm_saturation_p: Sharpness of the saturation (p of the p-norm; large = hard min).
        comm_latency_s: Start-up latency of a collective (handshake with the peers), seconds.
        comm_freq_exponent: ``alpha`` of the per-SM throughput's clock dependence ``(f/f_max)^alpha``.
        comm_hbm_bytes_per_bus_byte: Local HBM bytes read and written per bus byte.
        comm_sm_activity: Busy-SM power of a communication SM relative to a computing SM.
        comm_interference: Slow-down of a collective's per-SM throughput while a tensor-core
            kernel (GEMM, attention) runs beside it: the per-SM rate is divided by
            ``1 + comm_interference`` (L2 and crossbar queueing lengthen the latency that
            a latency-bound copy loop waits on). Link saturation is not affected.
        tensor_interference: The other direction: a tensor-core kernel runs
            ``1 + tensor_interference`` times slower (beyond losing the collective's SMs)
            while a collective runs beside it (shared L2 and crossbar).
        sm_busy_power_w: Dynamic power of all SMs busy (non-tensor part) at the maximum clock
            and voltage, watts.
        tensor_power_w: Additional dynamic power of all SMs' tensor cores at 100% use, at
            the maximum clock and voltage, watts.
        mem_op_sm_activity: Busy-SM activity of memory-bound kernels (they mostly stall).
        uncore_power_w: Dynamic power of the L2, crossbar and clocks while any kernel runs, at
            the maximum clock and voltage, watts.
        hbm_energy_pj_per_byte: HBM energy (DRAM, PHY, controller, on-chip movement) per byte.
        link_energy_pj_per_byte: NVLink energy per bus byte (both ends).
        voltage_floor: V(f) / V(f_max) at and below the floor clock.
        voltage_floor_clock_fraction: The floor clock as a fraction of the maximum clock.
        comm_curves: Measured collective curves that override ``comm_gbps_per_sm`` and
            ``comm_link_gbps`` per (collective kind, group size): entries
            ``(kind, group_size, gbps_per_sm, link_gbps)``. A collective uses the entry of
            its kind and group size, else the entry of its kind with the nearest group size,
            else the two scalar fields.
    """

    spec: GPUSpec = attrs.field(converter=get_gpu)
    tensor_flops_per_clock_per_sm: float = attrs.field(validator=_pos)
    vector_flops_per_clock_per_sm: float = attrs.field(validator=_pos)
    gemm_efficiency: float = attrs.field(validator=_fraction)
    attention_efficiency: float = attrs.field(validator=_fraction)
    tensor_feed_tflops: float = attrs.field(validator=_pos)
    vector_efficiency: float = attrs.field(validator=_fraction)
    hbm_efficiency: float = attrs.field(validator=_fraction)
    mem_knee_fraction: float = attrs.field(validator=_fraction)
    launch_overhead_s: float = attrs.field(validator=_nonneg)
    comm_gbps_per_sm: float = attrs.field(validator=_pos)
    comm_link_gbps: float = attrs.field(validator=_pos)
    comm_saturation_p: float = attrs.field(validator=_pos)
    comm_latency_s: float = attrs.field(validator=_nonneg)
    comm_freq_exponent: float = attrs.field(validator=_nonneg)
    comm_hbm_bytes_per_bus_byte: float = attrs.field(validator=_nonneg)
    comm_sm_activity: float = attrs.field(validator=_fraction)
    comm_interference: float = attrs.field(validator=_nonneg)
    tensor_interference: float = attrs.field(validator=_nonneg)
    sm_busy_power_w: float = attrs.field(validator=_nonneg)
    tensor_power_w: float = attrs.field(validator=_nonneg)
    mem_op_sm_activity: float = attrs.field(validator=_fraction)
    uncore_power_w: float = attrs.field(validator=_nonneg)
    hbm_energy_pj_per_byte: float = attrs.field(validator=_nonneg)
    link_energy_pj_per_byte: float = attrs.field(validator=_nonneg)
    voltage_floor: float = attrs.field(validator=_fraction)
    voltage_floor_clock_fraction: float = attrs.field(validator=_fraction)
    comm_curves: tuple[tuple[str, int, float, float], ...] = attrs.field(
        default=(), converter=lambda v: tuple((str(k), int(g), float(r), float(lk))
                                              for k, g, r, lk in v))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, gpu: str | GPUSpec, *, comm_backend: str | None = None,
                  **overrides: Any) -> EmulatedGPU:
        """The model of ``gpu`` with the documented default constants.

        Known presets (``a100-40gb``, ``h100-sxm``, ``h200-sxm``) get their own constants;
        any other :class:`GPUSpec` gets generic ones derived from its datasheet fields.
        Keyword arguments override single constants.

        Args:
            gpu: Preset name or :class:`GPUSpec`.
            comm_backend: Whose collective kernels to model: ``"own"`` (kareus's SM-capped
                kernels, measured on H200), ``"nccl"`` (NCCL capped with min/max CTAs,
                measured on H200), or ``"custom"`` (only the scalar ``comm_gbps_per_sm``
                and ``comm_link_gbps``). ``None``: ``"custom"`` if either scalar is
                overridden, else ``"own"``.
        """
        spec = get_gpu(gpu)
        if comm_backend is None:
            comm_backend = ("custom" if {"comm_gbps_per_sm", "comm_link_gbps"} & set(overrides)
                            else "own")
        if comm_backend not in ("own", "nccl", "custom"):
            raise ValueError(f"comm_backend must be 'own', 'nccl' or 'custom', got "
                             f"{comm_backend!r}")
        base = _default_constants(spec)
        base["comm_curves"] = () if comm_backend == "custom" else _comm_curves(spec, comm_backend)
        base.update(overrides)
        return cls(spec=spec, **base)

    @classmethod
    def preset(cls, name: str, *, comm_backend: str | None = None,
               **overrides: Any) -> EmulatedGPU:
        """Alias of :meth:`from_spec` for a preset name."""
        return cls.from_spec(name, comm_backend=comm_backend, **overrides)

    def with_(self, **changes: Any) -> EmulatedGPU:
        """A copy with some constants changed (validated again)."""
        return attrs.evolve(self, **changes)

    # ------------------------------------------------------------------ physics helpers
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def sm_count(self) -> int:
        return self.spec.sm_count

    @property
    def hbm_bytes_per_s(self) -> float:
        """Achievable HBM bandwidth, bytes per second."""
        return self.spec.hbm_bandwidth_gbps * 1e9 * self.hbm_efficiency

    def voltage_fraction(self, freq_mhz: float) -> float:
        """V(f) / V(f_max): flat at ``voltage_floor`` below the floor clock, linear above."""
        fmax = self.spec.max_clock_mhz
        f0 = self.voltage_floor_clock_fraction * fmax
        if freq_mhz <= f0 or fmax <= f0:
            return self.voltage_floor
        return self.voltage_floor + (1.0 - self.voltage_floor) * (freq_mhz - f0) / (fmax - f0)

    def dynamic_scale(self, freq_mhz: float) -> float:
        """(f / f_max) x (V(f) / V(f_max))^2: dynamic power relative to the maximum clock."""
        v = self.voltage_fraction(freq_mhz)
        return freq_mhz / self.spec.max_clock_mhz * v * v

    def comm_curve(self, kind: str | CommKind | None = None, group_size: int | None = None
                   ) -> tuple[float, float]:
        """(bus GB/s per SM at the maximum clock, link limit GB/s) of a collective."""
        if kind is not None and self.comm_curves:
            k = CommKind(kind).value
            same = [c for c in self.comm_curves if c[0] == k]
            if same:
                g = int(group_size) if group_size is not None else same[0][1]
                best = min(same, key=lambda c: (abs(c[1] - g), -c[1]))
                return best[2], best[3]
        return self.comm_gbps_per_sm, self.comm_link_gbps

    def comm_bus_rate(self, sms: int, freq_mhz: float, *, beside_tensor: bool = False,
                      kind: str | CommKind | None = None, group_size: int | None = None
                      ) -> float:
        """Bus bytes per second of a collective on ``sms`` SMs at ``freq_mhz`` (no HBM
        contention); ``beside_tensor``: while a GEMM or attention kernel runs beside it;
        ``kind`` and ``group_size`` select a measured curve (:attr:`comm_curves`)."""
        gbps, link_gbps = self.comm_curve(kind, group_size)
        per_sm = gbps * 1e9 * (freq_mhz / self.spec.max_clock_mhz) ** self.comm_freq_exponent
        if beside_tensor:
            per_sm /= 1.0 + self.comm_interference
        p = self.comm_saturation_p
        link = link_gbps * 1e9
        return ((sms * per_sm) ** -p + link ** -p) ** (-1.0 / p)

    def comm_time_s(self, comm: CommOp, sms: int, freq_mhz: float) -> float:
        """Time of ``comm`` alone on ``sms`` SMs at ``freq_mhz`` (latency + transfer)."""
        rate = self.comm_bus_rate(sms, freq_mhz, kind=comm.kind, group_size=comm.group_size)
        return self.launch_overhead_s + self.comm_latency_s + comm.bus_bytes / rate

    def op_time_s(self, op: ComputeOp, freq_mhz: float, sms: int | None = None) -> float:
        """Time of ``op`` alone on ``sms`` SMs (default all) at ``freq_mhz``, launch included."""
        prep = _prep_op(self, op)
        s = self.sm_count if sms is None else sms
        return self.launch_overhead_s + _op_work_time(prep, s, freq_mhz * 1e6,
                                                      self.hbm_bytes_per_s, self._issue_per_sm_cycle)

    @property
    def _issue_per_sm_cycle(self) -> float:
        # Bytes per SM per clock that saturate HBM exactly at the knee clock on all SMs.
        return self.hbm_bytes_per_s / (self.sm_count * self.mem_knee_fraction
                                       * self.spec.max_clock_mhz * 1e6)


def _default_constants(spec: GPUSpec) -> dict[str, Any]:
    """Model constants for ``spec`` (see docs/emulator.md for the sources)."""
    fmax = spec.max_clock_mhz
    generic: dict[str, Any] = dict(
        tensor_flops_per_clock_per_sm=spec.bf16_peak_tflops * 1e12 / (spec.sm_count * fmax * 1e6),
        vector_flops_per_clock_per_sm=128.0,
        gemm_efficiency=0.9,
        attention_efficiency=0.65,
        tensor_feed_tflops=spec.bf16_peak_tflops,
        vector_efficiency=0.5,
        hbm_efficiency=0.88,
        mem_knee_fraction=0.45,
        launch_overhead_s=3e-6,
        # Fallbacks for collectives without a curve: kareus's all-reduce on 4x H200, scaled.
        comm_gbps_per_sm=round(25.1 * (fmax / 1980.0) ** 0.25, 2),
        comm_link_gbps=round(301.0 * spec.nvlink_bandwidth_gbps / 900.0, 1),
        comm_saturation_p=2.0,
        comm_latency_s=10e-6,
        comm_freq_exponent=0.25,
        comm_hbm_bytes_per_bus_byte=3.0,
        comm_sm_activity=0.6,
        comm_interference=0.15,  # measured H200 (docs/emulator.md)
        tensor_interference=0.0,
        sm_busy_power_w=0.35 * spec.power_limit_w,
        tensor_power_w=0.7 * spec.power_limit_w,
        mem_op_sm_activity=0.57,
        uncore_power_w=max(spec.static_power_w - spec.idle_power_w, 0.06 * spec.power_limit_w),
        hbm_energy_pj_per_byte=60.0,
        link_energy_pj_per_byte=40.0,
        voltage_floor=0.81,
        voltage_floor_clock_fraction=0.5,
    )
    name = spec.name
    if name == "a100-40gb":
        generic.update(
            tensor_flops_per_clock_per_sm=2048.0,  # 108 x 2048 x 1.41 GHz = 312 TFLOP/s
            vector_flops_per_clock_per_sm=128.0,  # 19.5 TFLOP/s FP32
            gemm_efficiency=0.90,  # with the feed ceiling: 0.80 of peak at 1410 MHz
            attention_efficiency=0.70,  # with the feed ceiling: 0.66 at 1410 MHz
            tensor_feed_tflops=320.0,
            hbm_efficiency=0.88,
            sm_busy_power_w=103.0,
            tensor_power_w=193.0,
            uncore_power_w=30.0,  # static 85 W (blocked in a receive at 1410) - idle 55 W
        )
    elif name in ("h100-sxm", "h200-sxm"):
        generic.update(
            tensor_flops_per_clock_per_sm=4096.0,  # 132 x 4096 x 1.83 GHz = 989 TFLOP/s
            vector_flops_per_clock_per_sm=256.0,  # 67 TFLOP/s FP32 at 1.98 GHz
            gemm_efficiency=0.90,  # measured H200, with the feed ceiling (docs/emulator.md)
            attention_efficiency=0.55,
            tensor_feed_tflops=956.0,  # measured H200: GEMM 668 / 756 / 795 TF/s at 1500-1980
            hbm_efficiency=0.87 if name == "h200-sxm" else 0.88,  # H200: elementwise 4.07 TB/s
            mem_knee_fraction=0.40,  # measured H200: one SM copies ~76 GB/s (read + write)
            tensor_interference=0.135,  # measured H200: GEMMs beside SM-holding kernels
            sm_busy_power_w=340.0,
            tensor_power_w=686.0,
            uncore_power_w=42.6,  # measured H200: one spinning block at 1980 MHz = 120.6 W
        )
    return generic


# Collective curves measured on H200 (bench/results/collectives_{4,2}xh200_nvlink.json,
# fitted by bench/emulator_comm_tables.py on the 64 MiB rows): (kind, group size,
# bus GB/s per SM at the maximum clock, link limit GB/s).
_H200_COMM: dict[str, tuple[tuple[str, int, float, float], ...]] = {
    "own": (("all_reduce", 4, 25.1, 301.0), ("all_gather", 4, 19.3, 259.0),
            ("reduce_scatter", 4, 20.8, 257.0), ("all_reduce", 2, 10.9, 216.0),
            ("all_gather", 2, 11.9, 239.0), ("reduce_scatter", 2, 10.8, 208.0)),
    "nccl": (("all_reduce", 4, 25.3, 365.0), ("all_gather", 4, 19.9, 325.0),
             ("reduce_scatter", 4, 26.0, 304.0), ("all_reduce", 2, 21.1, 324.0),
             ("all_gather", 2, 15.2, 268.0), ("reduce_scatter", 2, 18.4, 236.0)),
}


# Per-SM throughput of the A100 case study's collective kernels relative to kareus's own
# (512-thread blocks, measured on H200, clock-scaled). Nothing was measured on an A100
# here; the one A100 observation is FACTS.md's case study (Llama 3.2 3B fwd_attn, TP=4,
# 1410 MHz, 1024-thread blocks): 4 communication SMs hid the 96 MiB all-reduce inside the
# computation and were energy-optimal, so 3 SMs did not hide it. In this model that bounds
# the all-reduce rate to [35.8, 48.3) GB/s per SM at 1410 MHz (bench/emulator_a100_case_study.py
# finds the bounds by bisection); the factor puts it near the geometric middle (41.6):
# 1.80 x 23.06 = 41.5 GB/s, and it scales every A100 curve (all kinds, group sizes)
# alike: the same kernel design.
_A100_KERNEL_FACTOR = 1.80


def _comm_curves(spec: GPUSpec, backend: str) -> tuple[tuple[str, int, float, float], ...]:
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
    return tuple((k, g, round(r * clock, 2), round(lk * link, 1)) for k, g, r, lk in curves)


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


def _prep_op(gpu: EmulatedGPU, op: ComputeOp) -> _Op:
    kind = op.kind.value
    if kind == "gemm":
        eff, fpc, tensor = gpu.gemm_efficiency, gpu.tensor_flops_per_clock_per_sm, True
    elif kind == "attention":
        eff, fpc, tensor = gpu.attention_efficiency, gpu.tensor_flops_per_clock_per_sm, True
    else:
        eff, fpc, tensor = gpu.vector_efficiency, gpu.vector_flops_per_clock_per_sm, False
    activity = 1.0 if tensor else gpu.mem_op_sm_activity
    feed = (op.flops * gpu.sm_count / (gpu.tensor_feed_tflops * 1e12)) if tensor else 0.0
    return _Op(cycles=op.flops / (eff * fpc), bytes=float(op.bytes_moved), tensor=tensor,
               tensor_flops=float(op.flops) if tensor else 0.0, fpc=fpc, activity=activity,
               feed_sm_s=feed)


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


# ----------------------------------------------------------------------------- simulation


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


def _comm_tuple(gpu: EmulatedGPU, comm: CommOp, sms: int, start: int | None
                ) -> tuple[float, int, int | None, float, str, int]:
    """A collective for :meth:`_Sim.run`. Ring all-gather moves fewer local HBM bytes per
    bus byte (write what arrives, read it to forward) than all-reduce and reduce-scatter
    (which also read the local operand): 2/3 of ``comm_hbm_bytes_per_bus_byte``."""
    factor = gpu.comm_hbm_bytes_per_bus_byte
    if comm.kind is CommKind.ALL_GATHER:
        factor *= 2.0 / 3.0
    return (comm.bus_bytes, sms, start, factor, comm.kind.value, comm.group_size)


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

    def run(self, f_mhz: float, comms: Sequence[tuple[float, int, int | None, float, str, int]],
            detail: bool = False) -> tuple[float, float, dict[str, Any] | None]:
        """Simulate.

        Args:
            f_mhz: SM clock.
            comms: Collectives as (bus bytes, SMs, start op index or None = after all ops,
                HBM bytes per bus byte);
                at most one may overlap; those with ``None`` run one after another at the end.
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
        overlapped = [c for c in comms if c[2] is not None]
        tail = [c for c in comms if c[2] is None]
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

        # Comm stream state: a list of pending (bus, sms), the active one with phase.
        pending_overlap = overlapped[0] if overlapped else None
        # [latency_left, bus_left, sms, hbm_per_bus, kind, group_size]
        active: list[Any] | None = None
        comm_rate0_cache: dict[tuple[int, bool, str, int], float] = {}

        def comm_rate0(c: list[Any], beside_tensor: bool) -> float:
            key = (int(c[2]), beside_tensor, c[4], c[5])
            r = comm_rate0_cache.get(key)
            if r is None:
                r = gpu.comm_bus_rate(key[0], f_mhz, beside_tensor=beside_tensor,
                                      kind=c[4], group_size=c[5])
                comm_rate0_cache[key] = r
            return r

        def start_comm(c: tuple[float, int, int | None, float, str, int]) -> list[Any]:
            return [gap + gpu.comm_latency_s, c[0], float(c[1]), c[3], c[4], c[5]]

        while True:
            # Launch the overlapped collective when op at its slot starts.
            if (pending_overlap is not None and i < n and in_gap and gap_left == gap
                    and i == pending_overlap[2]):
                active = start_comm(pending_overlap)
                pending_overlap = None
                comm_start = t
            compute_active = i < n
            if not compute_active and active is None:
                if pending_overlap is not None:  # slot index past the end: run after
                    tail.insert(0, pending_overlap)
                    pending_overlap = None
                if tail:
                    active = start_comm(tail.pop(0))
                    if comm_start is None:
                        comm_start = t
                    continue
                break
            comm_sms = int(active[2]) if active is not None else 0
            hbm_per_bus = active[3] if active is not None else 0.0
            comm_transfer = active is not None and active[0] <= 0.0
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
                # Power of the op.
                sm_frac = sms_c / S
                power += p_busy * sms_c * op.activity
                if op.tensor:
                    util = (op.tensor_flops * op_rate) / (sms_c * op.fpc * f_hz)
                    power += p_tensor * sm_frac * util
                power += e_hbm * op.bytes * op_rate
            elif op is not None:
                dt_compute = gap_left
            if active is not None:
                power += p_busy * comm_sms * comm_act
                if comm_transfer:
                    dt_comm = active[1] / comm_rate
                    power += (e_hbm * hbm_per_bus + e_link) * comm_rate
                else:
                    dt_comm = active[0]
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
                    active[0] -= dt
                    if dt == dt_comm or active[0] <= 1e-15:
                        active[0] = 0.0
                else:
                    active[1] -= dt * comm_rate
                    if dt == dt_comm or active[1] <= 1e-6:
                        active = None
                        comm_end = t
        details = None
        if detail:
            details = {"op_times_s": tuple(op_times), "comm_start_s": comm_start,
                       "comm_end_s": comm_end, "exposed_comm_s": exposed,
                       "compute_end_s": op_start if n else 0.0}
        return t, energy, details


# ----------------------------------------------------------------------------- profiler


@attrs.frozen
class _Prepared:
    partition: Partition
    sim: _Sim
    slot_index: dict[str, int]
    bus_bytes: float
    group_gpus: int
    results: dict[tuple[int, int, str | None], tuple[float, float, int]] = attrs.field(
        factory=dict)


class EmulatedProfiler(Profiler):
    """The embedded default profiler: measures partitions on an :class:`EmulatedGPU`.

    Args:
        gpu: An :class:`EmulatedGPU`, a :class:`GPUSpec` or a preset name (``None``: the
            ``a100-40gb`` preset).
        noise: Relative standard deviation of the multiplicative measurement noise on
            energy (default 1%); ``0`` gives the noise-free ground truth.
        time_noise: Relative standard deviation of the noise on time; ``None`` = a quarter
            of ``noise`` (on real GPUs time scatters far less than NVML energy: FACTS.md).
        seed: Seed of the noise. The noise of the n-th measurement depends only on
            ``(seed, n)``, so a run is reproducible.
        group_gpus: GPUs a partition's measurement covers: an int, a callable
            ``partition -> int``, or ``None``: ``partition.group_gpus`` (for partitions
            built by ``build_partitions``, the stage's TP x CP GPUs), else the collective's
            group size.
        power_limit: Whether the emulated GPU lowers its clock above its power limit
            (default True, as real GPUs do).

    Scope: a partition's Measurement covers every GPU of its group: per-GPU energy x GPUs,
    and static power x GPUs (the ranks of a collective are symmetric).
    """

    def __init__(
        self,
        gpu: EmulatedGPU | GPUSpec | str | None = None,
        *,
        noise: float = 0.01,
        time_noise: float | None = None,
        seed: int = 0,
        group_gpus: int | Callable[[Partition], int] | None = None,
        power_limit: bool = True,
    ) -> None:
        if gpu is None:
            gpu = "a100-40gb"
        if isinstance(gpu, (str, GPUSpec)):
            gpu = EmulatedGPU.from_spec(gpu)
        if not isinstance(gpu, EmulatedGPU):
            raise TypeError(f"gpu must be an EmulatedGPU, GPUSpec or preset name, got "
                            f"{type(gpu).__name__}")
        for label, value in (("noise", noise), ("time_noise", time_noise)):
            if value is not None and not (isinstance(value, (int, float)) and 0 <= value < 0.5):
                raise ValueError(f"{label} must be in [0, 0.5), got {value!r}")
        if (group_gpus is not None and not callable(group_gpus)
                and (not isinstance(group_gpus, int) or group_gpus < 1)):
            raise ValueError(f"group_gpus must be a positive int, a callable or None, "
                             f"got {group_gpus!r}")
        self.emulated_gpu: EmulatedGPU = gpu
        self.gpu: GPUSpec = gpu.spec
        self.noise = float(noise)
        self.time_noise = 0.25 * self.noise if time_noise is None else float(time_noise)
        self.seed = int(seed)
        self.group_gpus = group_gpus
        self.power_limit = bool(power_limit)
        self.calls = 0
        self._prepared: dict[int, _Prepared] = {}
        self._op_cache: dict[ComputeOp, _Op] = {}
        self._clocks = self.gpu.clocks_mhz

    # ------------------------------------------------------------------ public API
    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Emulate one run of ``partition`` under ``config`` (noisy unless ``noise=0``).

        Raises:
            TypeError: ``partition`` or ``config`` has the wrong type.
            UnsupportedFrequencyError, InvalidSMCountError, UnknownSlotError: ``config``
                does not fit the GPU or the partition.
        """
        prep = self._prepare(partition)
        if not isinstance(config, ScheduleConfig):
            raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
        key = (config.freq_mhz, config.comm_sms, config.launch_slot)
        res = prep.results.get(key)
        if res is None:
            self._check(prep, config)
            res = self._emulate(prep, config)
            if len(prep.results) > 100_000:
                prep.results.clear()
            prep.results[key] = res
        time_s, energy_gpu, _ = res
        g = prep.group_gpus
        return self._noisy(time_s, energy_gpu * g, self.gpu.static_power_w * g)

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Emulate work outside partitions: its ops, then its collectives, no overlap.

        Args:
            work: The ops and collectives.
            freq_mhz: Requested SM clock (the power limit may lower it).
            group_size: GPUs the measurement covers (energy and static power scale with it).
            comm_sms: SMs of each collective (``None``: the GPU's default, NCCL's CTA count).
        """
        if not isinstance(work, OutsideWork):
            raise TypeError(f"work must be an OutsideWork, got {type(work).__name__}")
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        self._check_freq(int(freq_mhz))
        sms = self.gpu.default_comm_sms if comm_sms is None else int(comm_sms)
        self._check_sms(sms)
        if not work.ops and not work.comms:
            return self._noisy(0.0, 0.0, self.gpu.static_power_w * group_size)
        sim = _Sim(self.emulated_gpu, [self._op(o) for o in work.ops])
        comms = [_comm_tuple(self.emulated_gpu, c, sms, None) for c in work.comms]
        time_s, energy, _ = self._run_limited(sim, int(freq_mhz), comms)[:3]
        return self._noisy(time_s, energy * group_size, self.gpu.static_power_w * group_size)

    def static_power_w(self, group_size: int) -> float:
        """Static power of ``group_size`` GPUs."""
        return self.gpu.static_power_w * group_size

    def trace(self, partition: Partition, config: ScheduleConfig) -> EmulationTrace:
        """The noise-free emulated run of ``partition`` under ``config``, for one GPU, with
        its effective clock, collective timing and per-op times (does not count as a call)."""
        prep = self._prepare(partition)
        self._check(prep, config)
        comms = self._comms(prep, config)
        time_s, energy, f_eff, limited = self._run_limited(prep.sim, config.freq_mhz, comms)
        _, _, d = prep.sim.run(f_eff, comms, detail=True)
        assert d is not None
        return EmulationTrace(
            time_s=time_s, energy_j=energy, freq_mhz=f_eff, requested_freq_mhz=config.freq_mhz,
            power_limited=limited, average_power_w=energy / time_s if time_s else 0.0,
            compute_end_s=d["compute_end_s"], comm_start_s=d["comm_start_s"],
            comm_end_s=d["comm_end_s"], exposed_comm_s=d["exposed_comm_s"],
            op_times_s=d["op_times_s"])

    def ground_truth(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """The noise-free measurement (does not advance the noise stream)."""
        prep = self._prepare(partition)
        self._check(prep, config)
        time_s, energy, _ = self._emulate(prep, config)
        g = prep.group_gpus
        return Measurement(time_s=time_s, energy_j=energy * g,
                           static_power_w=self.gpu.static_power_w * g)

    def reset_noise(self, seed: int | None = None) -> None:
        """Restart the noise stream (call count 0), optionally with a new seed."""
        self.calls = 0
        if seed is not None:
            self.seed = int(seed)

    # ------------------------------------------------------------------ internals
    def _op(self, op: ComputeOp) -> _Op:
        p = self._op_cache.get(op)
        if p is None:
            p = _prep_op(self.emulated_gpu, op)
            self._op_cache[op] = p
        return p

    def _prepare(self, partition: Partition) -> _Prepared:
        prep = self._prepared.get(id(partition))
        if prep is not None and prep.partition is partition:
            return prep
        if not isinstance(partition, Partition):
            raise TypeError(f"partition must be a kareus Partition, got "
                            f"{type(partition).__name__}")
        ops = [self._op(o) for o in partition.compute_ops]
        slot_index = {s.name: s.index for s in partition.slots}
        gg = self._group_gpus(partition)
        prep = _Prepared(partition=partition, sim=_Sim(self.emulated_gpu, ops),
                         slot_index=slot_index, bus_bytes=partition.comm_op.bus_bytes,
                         group_gpus=gg)
        if len(self._prepared) > 4096:
            self._prepared.clear()
        self._prepared[id(partition)] = prep
        return prep

    def _group_gpus(self, partition: Partition) -> int:
        if callable(self.group_gpus):
            g = int(self.group_gpus(partition))
            if g < 1:
                raise ValueError(f"group_gpus({partition.name!r}) returned {g}; need >= 1")
            return g
        if isinstance(self.group_gpus, int):
            return self.group_gpus
        own = getattr(partition, "group_gpus", None)
        if isinstance(own, int) and own >= 1:
            return own
        return int(partition.comm_op.group_size)

    def _check_freq(self, f: int) -> None:
        self.gpu.check_clock(f)

    def _check_sms(self, s: int) -> None:
        self.gpu.check_comm_sms(s)

    def _check(self, prep: _Prepared, config: ScheduleConfig) -> None:
        if not isinstance(config, ScheduleConfig):
            raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
        self._check_freq(config.freq_mhz)
        self._check_sms(config.comm_sms)
        if config.launch_slot is not None and config.launch_slot not in prep.slot_index:
            names = ", ".join(prep.slot_index) or "none (sequential only)"
            raise UnknownSlotError(
                f"partition {prep.partition.name!r} has no launch slot {config.launch_slot!r}; "
                f"its slots: {names} (or launch_slot=None for sequential)")

    def _comms(self, prep: _Prepared, config: ScheduleConfig
               ) -> list[tuple[float, int, int | None, float, str, int]]:
        idx = None if config.launch_slot is None else prep.slot_index[config.launch_slot]
        return [_comm_tuple(self.emulated_gpu, prep.partition.comm_op, config.comm_sms, idx)]

    def _emulate(self, prep: _Prepared, config: ScheduleConfig) -> tuple[float, float, int]:
        time_s, energy, f_eff, _ = self._run_limited(prep.sim, config.freq_mhz,
                                                     self._comms(prep, config))
        return time_s, energy, f_eff

    def _run_limited(self, sim: _Sim, freq_mhz: int,
                     comms: list[tuple[float, int, int | None, float, str, int]]
                     ) -> tuple[float, float, int, bool]:
        """Run at ``freq_mhz``, or at the highest supported clock under the power limit."""
        t, e, _ = sim.run(freq_mhz, comms)
        limit = self.gpu.power_limit_w
        if not self.power_limit or t <= 0 or e <= limit * t:
            return t, e, freq_mhz, False
        clocks = self._clocks
        lo, hi = 0, clocks.index(freq_mhz) - 1  # search clocks[lo..hi] for the highest fit
        best: tuple[float, float, int] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            tm, em, _ = sim.run(clocks[mid], comms)
            if em <= limit * tm:
                best = (tm, em, clocks[mid])
                lo = mid + 1
            else:
                hi = mid - 1
        if best is None:  # even the lowest clock is over the limit: run there
            tm, em, _ = sim.run(clocks[0], comms)
            best = (tm, em, clocks[0])
        return best[0], best[1], best[2], True

    def _noisy(self, time_s: float, energy_j: float, static_w: float) -> Measurement:
        n = self.calls
        self.calls += 1
        if self.noise > 0 or self.time_noise > 0:
            z = np.random.default_rng((self.seed, n)).standard_normal(2)
            time_s *= max(0.5, 1.0 + self.time_noise * float(z[0]))
            energy_j *= max(0.5, 1.0 + self.noise * float(z[1]))
        return Measurement(time_s=time_s, energy_j=energy_j, static_power_w=static_w)

    def __repr__(self) -> str:
        return (f"EmulatedProfiler({self.gpu.name}, noise={self.noise}, seed={self.seed}, "
                f"calls={self.calls})")
