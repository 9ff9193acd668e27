"""The emulated GPU's physical model: op times (a soft roofline at the running clock),
collective rates (per-SM throughput saturating at the link), and power (static plus
activity x f x V(f)^2), with the constants of the presets.

The constants of the presets, where each comes from, and the calibration against the
measured H200 probe are in ``docs/emulator.md``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kareus.errors import ArgumentError
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.gpu_profile import GPUProfile, GPUProfileError, shipped_profiles
from kareus.model.ops import CommKind, CommOp, ComputeOp
from kareus.profilers.emulator._calibration import comm_curves, host_costs, op_calibrations
from kareus.profilers.emulator._comm import CommCurve, _comm_curves
from kareus.profilers.emulator._host import (
    EXECUTIONS,
    MAX_HOST_S,
    HostCost,
    collective_host_s,
    host_cost_s,
    host_costs_tuple,
)
from kareus.profilers.emulator._opmodel import OpCalibration, _op_work_time, _prep_op

__all__ = ["EmulatedGPU"]




def _pos(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ArgumentError(f"EmulatedGPU.{attribute.name} must be a finite number > 0, "
                            f"got {value!r}")


def _nonneg(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ArgumentError(f"EmulatedGPU.{attribute.name} must be a finite number >= 0, "
                            f"got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ArgumentError(f"EmulatedGPU.{attribute.name} must be in (0, 1], got {value!r}")


COMM_PRIORITIES = ("high", "normal")


#: The stream priority of measurements that record none: every measurement made before the
#: tools recorded it ran the collectives at the CUDA default, normal priority.
UNRECORDED_PRIORITY = "normal"


def measured_priority(data: Mapping[str, Any], override: str | None = None
                      ) -> tuple[str, str]:
    """The stream priority to emulate measured ``data`` at, and where it comes from.

    ``override`` (``"high"`` or ``"normal"``; ``None`` or ``"measured"``: none) if given,
    else the data's ``"comm_priority"`` field, else ``UNRECORDED_PRIORITY``.

    Raises:
        ValueError: ``override`` or the recorded value is not a priority.
    """
    if override not in (None, "measured"):
        if override not in COMM_PRIORITIES:
            raise ArgumentError(f"comm_priority {override!r}; expected high, normal or measured")
        return str(override), "--comm-priority"
    recorded = data.get("comm_priority")
    if recorded is not None:
        if recorded not in COMM_PRIORITIES:
            raise ArgumentError(f"the measured data have comm_priority {recorded!r}; expected "
                                "'high' or 'normal'")
        return str(recorded), "recorded in the data"
    return UNRECORDED_PRIORITY, "not recorded: the data predate the option (normal)"


def _priority(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in COMM_PRIORITIES:
        raise ArgumentError(f"EmulatedGPU.{attribute.name} must be 'high' or 'normal', got "
                            f"{value!r}")


def _execution(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in EXECUTIONS:
        raise ArgumentError(f"EmulatedGPU.{attribute.name} must be 'graphed' or 'eager', got "
                            f"{value!r}")


def _host_seconds(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value < MAX_HOST_S):
        raise ArgumentError(f"EmulatedGPU.{attribute.name} must be a finite number of seconds "
                            f"in [0, {MAX_HOST_S}), got {value!r}")


def _comm_curves_tuple(value: Iterable[Sequence[Any]]) -> tuple[CommCurve, ...]:
    """The converter of ``EmulatedGPU.comm_curves``: records from 4-tuples."""
    return tuple(CommCurve(str(k), int(g), float(r), float(lk)) for k, g, r, lk in value)


def _op_calibration_tuple(value: Iterable[Sequence[Any]]) -> tuple[OpCalibration, ...]:
    """The converter of ``EmulatedGPU.op_calibration``: records from 6-tuples."""
    out = []
    for part, op, k_t, k_p, model_s, src in value:
        if not (k_t > 0 and k_p >= 0 and math.isfinite(k_t) and math.isfinite(k_p)):
            raise ArgumentError(f"EmulatedGPU.op_calibration: factors of {part}/{op} must be "
                                f"finite, time > 0 and power >= 0, got {k_t!r}, {k_p!r}")
        out.append(OpCalibration(str(part), str(op), float(k_t), float(k_p), float(model_s),
                                 str(src)))
    return tuple(out)


#: The collective whose curve an all-to-all without a measured curve of its own takes
#: (``EmulatedGPU.comm_curve``): the all-gather's, a copy to the peers without reduction.
#: A stated, uncalibrated model until all-to-all points are measured (``kareus calibrate``
#: on several GPUs).
ALL_TO_ALL_STAND_IN = {CommKind.ALL_TO_ALL.value: CommKind.ALL_GATHER.value}


@attrs.frozen(kw_only=True)
class EmulatedGPU:
    """The physical model of one GPU: the datasheet [`GPUSpec`][kareus.model.GPUSpec] plus model constants.

    Use [`from_spec`][kareus.profilers.EmulatedGPU.from_spec] (or
    [`preset`][kareus.profilers.EmulatedGPU.preset]) for the constants documented in
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
        launch_overhead_s: GPU-side gap before each kernel on a stream whose launches are
            enqueued ahead of it (graph replay, or an eager host running ahead), seconds:
            2 us, measured on H200 (a one-element copy queued right behind another adds
            1.7-2.2 us). The host's own cost per launch is separate (``execution``).
        comm_gb_per_s_per_sm: Bus bandwidth (GB/s, nccl-tests convention) one SM of a collective
            moves at the maximum clock.
        comm_link_gb_per_s: Bus bandwidth at which collectives saturate (the NVLink limit), GB/s.
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
        comm_curves: Measured collective curves that override ``comm_gb_per_s_per_sm`` and
            ``comm_link_gb_per_s`` per (collective kind, group size): entries
            ``CommCurve`` records ``(kind, group_size, gb_per_s_per_sm, link_gb_per_s)``
            (plain 4-tuples are converted). A collective uses the entry of
            its kind and group size, else the entry of its kind with the nearest group size,
            else the two scalar fields.
        network_gb_per_s: Inter-node bandwidth per GPU, one direction, GB/s: what limits
            pipeline sends and collectives that cross nodes (0.9 of the line rate of one
            NIC per GPU; see docs/emulator.md).
        network_latency_s: Start-up latency of an inter-node transfer, seconds.
        op_calibration: Per-op factors from a measured GPU profile
            ([`from_profile`][kareus.profilers.EmulatedGPU.from_profile]): ``OpCalibration`` records
            ``(partition, op, time_factor, power_factor, model_s, source)``; an op of a partition
            type with a record uses it, any other op its kind's default (``partition == "*"``).
            Empty: the op model as is.
        calibration: How this model was calibrated (``""``: the preset's constants).
        comm_priority: The stream priority the collective runs at, relative to the
            computation: ``"high"`` (default; what kareus's executor does) or ``"normal"``.
            Not a fitted constant but a rule of the block scheduler: it dispatches the
            waiting thread blocks of a higher-priority stream first, and at equal priority
            those of the kernel that came first. At ``"high"`` a collective launched with
            op k takes its SMs when op k starts. At ``"normal"`` it gets SMs only once op
            k's blocks have all been dispatched, i.e. at the start of op k's last wave.
            [`ComputeOp`][kareus.model.ComputeOp] carries FLOPs and bytes but no shape, so
            an op's block count (a GEMM's output tiles, an elementwise op's bytes per block)
            cannot be derived without inventing a tile or block size; the emulator takes
            the limit of many waves, where the last wave begins at the op's end: the
            collective starts when op k ends, as if launched with op k+1 at high priority,
            and launched with the last op it runs after the computation (sequential). (The
            MLP GEMMs of the measured 2x H200 grids have 1536-2048 output tiles of 128x256,
            11.6-15.5 waves on 132 SMs: their last wave begins 6-8% of the GEMM before its
            end.)
        execution: How the host feeds the GPU (``kareus.profilers.emulator._host``):
            ``"graphed"`` (default; what the executor runs on a GPU): a run of a partition is
            one CUDA-graph launch of ``graph_launch_s`` and its kernels run back to back;
            ``"eager"``: the host issues every op and the collective in program order at its
            own cost (``host_costs``, else the defaults by kind), and an op starts when
            both its stream and the host are there.
        graph_launch_s: Host seconds per graph launch (one per run of a partition or of
            outside work): 5 us, an estimate ("a few us"); hidden behind the GPU whenever the
            run takes longer.
        host_costs: Host seconds per eager launch, measured
            ([`from_profile`][kareus.profilers.EmulatedGPU.from_profile] takes them from a profile's
            ``host_s``) or set by hand: ``HostCost`` records ``(partition, op, host_s, source)``
            (plain 4-tuples are converted); ops without one use ``DEFAULT_HOST_COSTS`` by kind.
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
    comm_gb_per_s_per_sm: float = attrs.field(validator=_pos)
    comm_link_gb_per_s: float = attrs.field(validator=_pos)
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
    comm_curves: tuple[CommCurve, ...] = attrs.field(default=(), converter=_comm_curves_tuple)
    network_gb_per_s: float = attrs.field(default=22.5, validator=_pos)
    network_latency_s: float = attrs.field(default=10e-6, validator=_nonneg)
    op_calibration: tuple[OpCalibration, ...] = attrs.field(default=(),
                                                            converter=_op_calibration_tuple)
    calibration: str = attrs.field(default="")
    comm_priority: str = attrs.field(default="high", validator=_priority)
    execution: str = attrs.field(default="graphed", validator=_execution)
    graph_launch_s: float = attrs.field(default=5e-6, validator=_host_seconds)
    host_costs: tuple[HostCost, ...] = attrs.field(default=(), converter=host_costs_tuple)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, gpu: str | GPUSpec, *, comm_backend: str | None = None,
                  comm_priority: str = "high", **overrides: Any) -> EmulatedGPU:
        """The model of ``gpu`` with the documented default constants.

        Known presets (``a100-40gb``, ``h100-sxm``, ``h200-sxm``) get their own constants;
        any other [`GPUSpec`][kareus.model.GPUSpec] gets generic ones derived from its datasheet
        fields. Keyword arguments override single constants.

        Args:
            gpu: Preset name or [`GPUSpec`][kareus.model.GPUSpec].
            comm_backend: Whose collective kernels to model: ``"own"`` (kareus's SM-capped
                kernels, measured on H200), ``"nccl"`` (NCCL capped with min/max CTAs,
                measured on H200), or ``"custom"`` (only the scalar ``comm_gb_per_s_per_sm``
                and ``comm_link_gb_per_s``). ``None``: ``"custom"`` if either scalar is
                overridden, else ``"own"``.
            comm_priority: The collective's stream priority, ``"high"`` or ``"normal"``
                ([`comm_priority`][kareus.profilers.EmulatedProfiler.comm_priority]).
        """
        spec = get_gpu(gpu)
        if comm_backend is None:
            comm_backend = ("custom" if {"comm_gb_per_s_per_sm", "comm_link_gb_per_s"} & set(overrides)
                            else "own")
        if comm_backend not in ("own", "nccl", "custom"):
            raise ArgumentError(f"comm_backend must be 'own', 'nccl' or 'custom', got "
                                f"{comm_backend!r}")
        base = _default_constants(spec)
        base["comm_curves"] = () if comm_backend == "custom" else _comm_curves(spec, comm_backend)
        base["comm_priority"] = comm_priority
        base.update(overrides)
        return cls(spec=spec, **base)

    @classmethod
    def preset(cls, name: str, *, comm_backend: str | None = None,
               **overrides: Any) -> EmulatedGPU:
        """Alias of [`from_spec`][kareus.profilers.EmulatedGPU.from_spec] for a preset name."""
        return cls.from_spec(name, comm_backend=comm_backend, **overrides)

    @classmethod
    def from_profile(cls, profile: Any, *, comm_backend: str = "own",
                     kernels: str | Sequence[str] | None = None, comm_priority: str = "high",
                     **overrides: Any) -> EmulatedGPU:
        """The model of a GPU calibrated from a measured profile.

        Starts from the preset of ``profile.gpu`` and takes from the profile: per-op time
        and power factors (``kareus.profilers.emulator._calibration``), the HBM bandwidth,
        the idle power, the static power (a GPU waiting on communication), the uncore
        power (one spinning block at the maximum clock, else static minus idle), the
        collective curves of ``comm_backend`` fitted to its measured points, and the host
        cost of each op's eager launch where it was measured (``host_costs``).

        Args:
            profile: A ``GPUProfile``, a path to a profile
                file, or the GPU name of a profile shipped with kareus (``"h200-sxm"``).
            comm_backend: ``"own"`` (kareus's SM-capped kernels) or ``"nccl"`` (NCCL capped
                with min/max CTAs): whose measured collective curves to use.
            kernels: The kernel set whose per-op measurements to use, or several in order
                of priority (default: the profile's main set, e.g. ``"triton"``;
                ``"reference"`` for the eager formulas the first measured grids ran); ops
                no listed set holds use the main set's records.
            comm_priority: The collective's stream priority, ``"high"`` or ``"normal"``
                ([`comm_priority`][kareus.profilers.EmulatedProfiler.comm_priority]; not part of the
                calibration).
            **overrides: Constants to override after calibration.

        Raises:
            GPUProfileError: the profile cannot be read, has no such kernel set or backend.
        """
        if not isinstance(profile, GPUProfile):
            text = str(profile)
            profile = (GPUProfile.preset(text) if text in shipped_profiles()
                       else GPUProfile.load(text))
        base = cls.from_spec(profile.gpu, comm_backend="custom", comm_priority=comm_priority)
        if base.sm_count != profile.sm_count:
            raise GPUProfileError(f"GPU profile of {profile.gpu} was measured with "
                                  f"{profile.sm_count} SMs; the preset has {base.sm_count}")
        spinning = [lp for lp in profile.load_powers if lp.load == "one spinning block"
                    and lp.freq_mhz == base.spec.max_clock_mhz]
        # The idle floor is power at the idle clock; a reading taken before the clock came
        # down (at the maximum clock, or above a spinning block's power) is not one: the
        # preset's floor stays then.
        idle = profile.idle_power_w
        settled = (profile.idle_freq_mhz is None
                   or profile.idle_freq_mhz < base.spec.max_clock_mhz) and not (
            spinning and idle >= spinning[0].power_w)
        if not settled:
            idle = base.spec.idle_power_w
        uncore = (spinning[0].power_w - idle if spinning else profile.static_power_w - idle)
        spec = attrs.evolve(base.spec, idle_power_w=round(idle, 3),
                            static_power_w=round(max(profile.static_power_w, idle), 3))
        hbm_eff = min(1.0, profile.hbm_bandwidth_gbps / base.spec.hbm_bandwidth_gbps)
        curves = comm_curves(profile, comm_backend)
        if not curves:
            raise GPUProfileError(f"GPU profile of {profile.gpu} has no SM-capped collective "
                                  f"points of backend {comm_backend!r} (64 MiB or more)")
        gpu = attrs.evolve(base, spec=spec, hbm_efficiency=round(hbm_eff, 4),
                           uncore_power_w=round(max(uncore, 0.0), 3), comm_curves=curves)
        ks = (profile.kernel_set if kernels is None
              else kernels if isinstance(kernels, str) else "+".join(kernels))
        cal = op_calibrations(gpu, profile, kernels)
        gpu = attrs.evolve(gpu, op_calibration=cal, host_costs=host_costs(profile, kernels),
                           calibration=f"profile {profile.gpu} digest {profile.digest[:12]}, "
                                       f"kernels {ks}, collectives {comm_backend}"
                                       + ("" if settled else ", idle: the preset's (the "
                                          "profile's reading was not at the idle clock)"))
        return gpu.with_(**overrides) if overrides else gpu

    def with_(self, **changes: Any) -> EmulatedGPU:
        """A copy with some constants changed (validated again)."""
        return attrs.evolve(self, **changes)

    #: The constants [`perturbed`][kareus.profilers.EmulatedGPU.perturbed] scales (fractions
    #: are capped at 1).
    PERTURBED = ("gemm_efficiency", "attention_efficiency", "vector_efficiency",
                 "tensor_feed_tflops", "hbm_efficiency", "mem_knee_fraction",
                 "comm_gb_per_s_per_sm", "comm_link_gb_per_s", "comm_freq_exponent",
                 "comm_sm_activity", "comm_interference", "sm_busy_power_w", "tensor_power_w",
                 "mem_op_sm_activity", "uncore_power_w", "hbm_energy_pj_per_byte",
                 "voltage_floor")

    def perturbed(self, seed: int, *, spread: float = 0.1) -> EmulatedGPU:
        """Another GPU of the same kind, as far from this model as a model is from the GPU.

        For testing what uses this model as a *prior* (a search's prior mean,
        [`kareus.search.PriorMean`][kareus.search.PriorMean]) honestly on the emulator:
        measuring with the model itself would make the prior exactly right. Each constant
        of ``PERTURBED`` (op efficiencies, the HBM and tensor feed rates, the collectives'
        per-SM and link rates, whose measured curves are scaled alike, their clock
        exponent and interference, every power term, the voltage floor) is multiplied by
        its own factor ``exp(spread x z)`` with ``z`` standard normal, seeded by ``seed``
        (fractions capped at 1); ``tensor_interference`` gains ``spread x |z|`` (a
        slow-down the model may not know of); and each op kind (GEMM, attention,
        elementwise) without a calibration of its own, and each op calibrated from a
        profile, gets a time factor ``exp(spread / 2 x z)`` and a power factor
        ``exp(spread x z)``. The datasheet
        (clocks, SMs, power limit, static power) is kept.

        Args:
            seed: Seed of the factors (one perturbed GPU per seed).
            spread: Standard deviation of the log factors (0.1: about 10% per constant;
                the calibrated model is within a few per cent of the measured grids,
                docs/emulator.md).

        Returns:
            The perturbed model; its ``calibration`` says how it was made.
        """
        import numpy as np

        if not (isinstance(spread, (int, float)) and math.isfinite(spread) and spread >= 0):
            raise ArgumentError(f"spread must be a finite number >= 0, got {spread!r}")
        rng = np.random.default_rng([int(seed), 0x5EED])
        changes: dict[str, Any] = {}
        for name in self.PERTURBED:
            value = getattr(self, name) * math.exp(spread * rng.standard_normal())
            fraction = attrs.fields_dict(type(self))[name].validator is _fraction
            changes[name] = min(value, 1.0) if fraction else value
        changes["tensor_interference"] = (self.tensor_interference
                                          + spread * abs(rng.standard_normal()))
        rate = changes["comm_gb_per_s_per_sm"] / self.comm_gb_per_s_per_sm
        link = changes["comm_link_gb_per_s"] / self.comm_link_gb_per_s
        changes["comm_curves"] = tuple(
            CommCurve(c.kind, c.group_size, c.gb_per_s_per_sm * rate, c.link_gb_per_s * link)
            for c in self.comm_curves)
        def factors() -> tuple[float, float]:
            return (math.exp(spread / 2 * rng.standard_normal()),
                    math.exp(spread * rng.standard_normal()))

        records = []
        for c in self.op_calibration:  # each calibrated op its own factors
            tf, pf = factors()
            records.append(OpCalibration(c.partition, c.op, c.time_factor * tf,
                                         c.power_factor * pf, c.model_s, c.source))
        have = {c.op for c in self.op_calibration if c.partition == "*"}
        for kind in ("gemm", "attention", "elementwise"):
            tf, pf = factors()
            if kind not in have:
                records.append(OpCalibration("*", kind, tf, pf, 0.0, "perturbed"))
        changes["op_calibration"] = tuple(records)
        note = f"perturbed (seed {int(seed)}, spread {spread:g})"
        changes["calibration"] = f"{self.calibration}, {note}" if self.calibration else note
        return attrs.evolve(self, **changes)

    # ------------------------------------------------------------------ physics helpers
    @property
    def name(self) -> str:
        """The GPU's preset name."""
        return self.spec.name

    @property
    def sm_count(self) -> int:
        """SMs of the GPU."""
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
        """(bus GB/s per SM at the maximum clock, link limit GB/s) of a collective.

        An all-to-all without a curve of its own (no measured all-to-all curve ships with
        kareus) takes the all-gather's of the same group size (``ALL_TO_ALL_STAND_IN``):
        both copy ``(g-1)/g`` of the message to the peers over NVLink without reducing,
        one direct transfer per peer through the NVSwitch. Uncalibrated: docs/emulator.md."""
        if kind is not None and self.comm_curves:
            k = CommKind(kind).value
            same = [c for c in self.comm_curves if c.kind == k]
            if not same and k in ALL_TO_ALL_STAND_IN:
                same = [c for c in self.comm_curves if c.kind == ALL_TO_ALL_STAND_IN[k]]
            if same:
                g = int(group_size) if group_size is not None else same[0].group_size
                best = min(same, key=lambda c: (abs(c.group_size - g), -c.group_size))
                return best.gb_per_s_per_sm, best.link_gb_per_s
        return self.comm_gb_per_s_per_sm, self.comm_link_gb_per_s

    def comm_bus_rate(self, sms: int, freq_mhz: float, *, beside_tensor: bool = False,
                      kind: str | CommKind | None = None, group_size: int | None = None
                      ) -> float:
        """Bus bytes per second of a collective on ``sms`` SMs at ``freq_mhz`` (no HBM
        contention); ``beside_tensor``: while a GEMM or attention kernel runs beside it;
        ``kind`` and ``group_size`` select a measured curve (``comm_curves``)."""
        gb_per_s, link_gb_per_s = self.comm_curve(kind, group_size)
        per_sm = gb_per_s * 1e9 * (freq_mhz / self.spec.max_clock_mhz) ** self.comm_freq_exponent
        if beside_tensor:
            per_sm /= 1.0 + self.comm_interference
        p = self.comm_saturation_p
        link = link_gb_per_s * 1e9
        return ((sms * per_sm) ** -p + link ** -p) ** (-1.0 / p)

    def comm_time_s(self, comm: CommOp, sms: int, freq_mhz: float) -> float:
        """Time of ``comm`` alone on ``sms`` SMs at ``freq_mhz`` (latency + transfer)."""
        rate = self.comm_bus_rate(sms, freq_mhz, kind=comm.kind, group_size=comm.group_size)
        return self.launch_overhead_s + self.comm_latency_s + comm.bus_bytes / rate

    def op_time_s(self, op: ComputeOp, freq_mhz: float, sms: int | None = None, *,
                  partition: str | None = None) -> float:
        """Time of ``op`` alone on ``sms`` SMs (default all) at ``freq_mhz``, launch included;
        ``partition``: the partition type it belongs to (selects its calibration)."""
        prep = _prep_op(self, op, partition)
        s = self.sm_count if sms is None else sms
        return self.launch_overhead_s + _op_work_time(prep, s, freq_mhz * 1e6,
                                                      self.hbm_bytes_per_s, self._issue_per_sm_cycle)

    def host_s(self, op: ComputeOp, partition: str | None = None) -> float:
        """Host seconds of one eager launch of ``op`` (of partition type ``partition``):
        ``host_costs``, else the default of its kind
        (``host_cost_s``)."""
        return host_cost_s(self.host_costs, partition, op)

    @property
    def collective_host_s(self) -> float:
        """Host seconds of one eager launch of a collective at its slot."""
        return collective_host_s(self.host_costs)

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
        launch_overhead_s=2e-6,  # measured H200: a queued second kernel adds 1.7-2.2 us
        # Fallbacks for collectives without a curve: kareus's all-reduce on 4x H200, scaled.
        comm_gb_per_s_per_sm=round(25.1 * (fmax / 1980.0) ** 0.25, 2),
        comm_link_gb_per_s=round(301.0 * spec.nvlink_bandwidth_gbps / 900.0, 1),
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
            network_gb_per_s=22.5,  # DGX A100: one 200 Gb/s HDR NIC per GPU, x 0.9
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
            network_gb_per_s=45.0,  # DGX H100 / H200: one 400 Gb/s NIC per GPU, x 0.9
        )
    return generic
