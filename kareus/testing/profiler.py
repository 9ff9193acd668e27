"""A fake profiler and the conformance suite of the Profiler role.

* [`FakeProfiler`][kareus.testing.FakeProfiler] - a cheap analytic
  [`Profiler`][kareus.model.Profiler]: roofline op times, a communication kernel that speeds up with
  its SM count until the link saturates, a walk through the computation after the launch slot with
  fewer SMs and some HBM contention, and power that grows with frequency and voltage. It is a toy
  (the calibrated model is [`kareus.profilers.emulator.EmulatedProfiler`][kareus.profilers.EmulatedProfiler]),
  but it has the shape that matters to a search: a real time-energy trade-off across frequencies and
  SM counts, slots that matter, and seeded multiplicative noise. It measures the work outside
  partitions too (closed form, without noise), so it drives ``kareus.optimize`` end to end.
* [`check_profiler`][kareus.testing.check_profiler], ``PROFILER_CHECKS`` and the pytest mix-in
  [`ProfilerConformance`][kareus.testing.ProfilerConformance] - conformance checks for any profiler.

This module imports neither pytest nor any hardware library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kareus._check import check_count, check_number
from kareus.errors import ArgumentTypeError
from kareus.model.config import ScheduleConfig
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.measurement import Measurement
from kareus.model.ops import CommKind
from kareus.model.partition import OutsideWork, Partition
from kareus.model.profiler import Profiler
from kareus.testing._suite import _add_tests, _run_checks

__all__ = ["PROFILER_CHECKS", "FakeProfiler", "ProfilerConformance", "check_profiler"]


# -------------------------------------------------------------------------- FakeProfiler


class FakeProfiler(Profiler):
    """A cheap analytic profiler for tests (not calibrated; see the module docstring).

    Args:
        gpu: GPU preset name or spec.
        noise: Relative standard deviation of multiplicative noise on time and energy
            (0 = deterministic).
        seed: Seed of the noise.

    Attributes:
        calls: Every ``(partition name, config)`` measured, in order.
    """

    def __init__(self, gpu: str | GPUSpec = "a100-40gb", *, noise: float = 0.0,
                 seed: int = 0) -> None:
        self.noise = check_number("noise", noise, minimum=0)
        self.seed = check_count("seed", seed, minimum=0)
        self.gpu = get_gpu(gpu)
        self._rng = np.random.default_rng(seed)
        self.calls: list[tuple[str, ScheduleConfig]] = []

    @property
    def uses_gpus(self) -> bool:
        """``False``: a formula on the CPU."""
        return False

    def identity(self) -> dict[str, Any]:
        """The class, the noise and its seed."""
        return {**super().identity(), "noise": self.noise, "seed": self.seed}

    # Model constants (per GPU): per-SM copy throughput and comm power, as fractions.
    _PER_SM_GB_PER_S = 18.0
    _MEM_CONTENTION = 0.35

    def _op_time(self, flops: float, nbytes: float, f: float, sms: int,
                 compute_bound: bool, contended: bool) -> float:
        g = self.gpu
        fr = f / g.max_clock_mhz
        compute = flops / (g.bf16_peak_tflops * 1e12 * (sms / g.sm_count) * fr)
        bw = g.hbm_bandwidth_gbps * 1e9 * min(1.0, 0.55 + 0.45 * fr)
        if contended:
            bw /= 1.0 + self._MEM_CONTENTION * (0.4 if compute_bound else 1.0)
        return max(compute, nbytes / bw) + 4e-6

    def _comm_time(self, partition: Partition, sms: int, f: float) -> float:
        c = partition.comm_op
        g = c.group_size
        factor = 2.0 * (g - 1) / g if c.kind is CommKind.ALL_REDUCE else (g - 1) / g
        rate = min(self.gpu.nvlink_bandwidth_gbps / 2, self._PER_SM_GB_PER_S * sms) * 1e9
        rate *= 0.8 + 0.2 * f / self.gpu.max_clock_mhz
        return c.bytes * factor / rate + 8e-6

    def _simulate(self, partition: Partition, config: ScheduleConfig) -> tuple[float, float]:
        g = self.gpu
        f, s = float(config.freq_mhz), int(config.comm_sms)
        ops = partition.compute_ops
        t_comm = self._comm_time(partition, s, f)
        fr = f / g.max_clock_mhz
        volt = 0.65 + 0.35 * fr
        p_compute = (g.power_limit_w - g.static_power_w) * 0.9 * fr * volt ** 2
        p_comm = 40.0 * min(s, 32) / 32 * volt ** 2 + 25.0
        busy_compute = 0.0
        if config.launch_slot is None:
            t = sum(self._op_time(op.flops, op.bytes_moved, f, g.sm_count, op.compute_bound,
                                  False) for op in ops)
            busy_compute = t
            total = t + t_comm
        else:
            start = partition.slot(config.launch_slot).index
            total = 0.0
            for op in ops[:start]:
                total += self._op_time(op.flops, op.bytes_moved, f, g.sm_count,
                                       op.compute_bound, False)
            busy_compute = total
            left = t_comm
            for op in ops[start:]:
                if left <= 0:
                    d = self._op_time(op.flops, op.bytes_moved, f, g.sm_count,
                                      op.compute_bound, False)
                else:
                    slow = self._op_time(op.flops, op.bytes_moved, f, g.sm_count - s,
                                         op.compute_bound, True)
                    comm_rate = 1.0 / (1.0 + (0.25 if not op.compute_bound else 0.05))
                    if left >= slow * comm_rate:
                        d = slow
                        left -= slow * comm_rate
                    else:
                        frac = left / comm_rate / slow
                        fast = self._op_time(op.flops, op.bytes_moved, f, g.sm_count,
                                             op.compute_bound, False)
                        d = slow * frac + fast * (1 - frac)
                        left = 0.0
                total += d
                busy_compute += d
            total += max(left, 0.0)
        n = partition.comm_op.group_size
        dynamic = n * (p_compute * busy_compute + p_comm * t_comm)
        energy = total * g.static_power_w * n + dynamic
        return total, energy

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Model ``partition`` under ``config`` (scope: the partition's group of GPUs)."""
        if not isinstance(partition, Partition):
            raise ArgumentTypeError(f"partition must be a kareus Partition, got "
                                    f"{type(partition).__name__}")
        self.space(partition).validate(config)  # typed ConfigErrors for impossible configs
        self.calls.append((partition.name, config))
        t, e = self._simulate(partition, config)
        if self.noise > 0:
            t *= float(np.exp(self._rng.normal(0.0, self.noise)))
            e *= float(np.exp(self._rng.normal(0.0, self.noise)))
        n = partition.comm_op.group_size
        return Measurement(time_s=t, energy_j=e, static_power_w=self.gpu.static_power_w * n)

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Model work outside partitions at ``freq_mhz``: its ops with every SM, then its
        collectives and pipeline send (no noise; scope: ``group_size`` GPUs)."""
        g = self.gpu
        f = float(freq_mhz)
        sms = g.default_comm_sms if comm_sms is None else int(comm_sms)
        t_ops = sum(self._op_time(op.flops, op.bytes_moved, f, g.sm_count, op.compute_bound,
                                  False) for op in work.ops)
        rate = min(g.nvlink_bandwidth_gbps / 2, self._PER_SM_GB_PER_S * sms) * 1e9
        t_comm = sum(c.bytes / rate + 8e-6 for c in work.comms) + work.p2p_bytes / rate
        fr = f / g.max_clock_mhz
        volt = 0.65 + 0.35 * fr
        p_compute = (g.power_limit_w - g.static_power_w) * 0.9 * fr * volt ** 2
        t = t_ops + t_comm
        dynamic = group_size * (p_compute * t_ops + 40.0 * volt ** 2 * t_comm)
        static = g.static_power_w * group_size
        return Measurement(time_s=t, energy_j=static * t + dynamic, static_power_w=static)

    def __repr__(self) -> str:
        return f"FakeProfiler({self.gpu.name!r}, noise={self.noise}, seed={self.seed})"


# -------------------------------------------------------------------- profiler conformance


def _default_partition() -> Partition:
    from kareus.model.partition import build_partitions
    from kareus.model.workload import Workload

    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=2, seq_len=1024)
    return build_partitions(wl)["fwd_attn"]


def _sample_configs(profiler: Profiler, partition: Partition, k: int = 6) -> list[ScheduleConfig]:
    space = profiler.space(partition)
    cfgs = space.configs
    idx = np.unique(np.linspace(0, len(cfgs) - 1, min(k, len(cfgs))).round().astype(int))
    picks = [cfgs[i] for i in idx]
    seq = [c for c in cfgs if c.launch_slot is None]
    if seq and seq[0] not in picks:
        picks.append(seq[0])
    return picks


def _check_profiler_type(make: Callable[[], Profiler], partition: Partition) -> None:
    from kareus.model.config import ConfigSpace

    p = make()
    assert isinstance(p, Profiler), f"factory returned {type(p).__name__}, not a Profiler"
    assert isinstance(p.gpu, GPUSpec), "profiler.gpu must be a GPUSpec"
    space = p.space(partition)
    assert isinstance(space, ConfigSpace) and len(space) > 0, \
        "space(partition) must return a non-empty ConfigSpace"
    assert space.partition.name == partition.name, "space(partition) is of another partition"


def _check_profiler_measurements(make: Callable[[], Profiler], partition: Partition) -> None:
    p = make()
    for c in _sample_configs(p, partition):
        m = p.measure(partition, c)
        assert isinstance(m, Measurement), f"measure must return a Measurement, got {type(m)}"
        assert m.time_s > 0 and m.energy_j > 0, f"{c}: time and energy must be > 0, got {m}"
        assert m.static_power_w > 0, f"{c}: static_power_w must be > 0"


def _check_profiler_static_power(make: Callable[[], Profiler], partition: Partition) -> None:
    p = make()
    for g in (1, 2, 4, 8):
        w = p.static_power_w(g)
        assert np.isfinite(w) and w > 0, f"static_power_w({g}) must be finite and > 0, got {w}"
    assert p.static_power_w(8) > p.static_power_w(1), "more GPUs must draw more static power"


def _check_profiler_rejects_bad_configs(make: Callable[[], Profiler],
                                        partition: Partition) -> None:
    from kareus.errors import ConfigError

    p = make()
    good = _sample_configs(p, partition, 1)[0]
    bad = [ScheduleConfig(good.freq_mhz, p.gpu.sm_count + 5, good.launch_slot),
           ScheduleConfig(good.freq_mhz, 0, good.launch_slot),
           ScheduleConfig(p.gpu.max_clock_mhz + 1, good.comm_sms, good.launch_slot),
           ScheduleConfig(good.freq_mhz, good.comm_sms, "no-such-slot")]
    for c in bad:
        try:
            p.measure(partition, c)
        except ConfigError:
            continue
        raise AssertionError(f"measure must raise a kareus ConfigError for {c}")


def _check_profiler_outside_work(make: Callable[[], Profiler], partition: Partition) -> None:
    from kareus.errors import ConfigError

    p = make()
    assert p.measures_outside_work, (
        f"{type(p).__name__}.measures_outside_work is false: kareus.optimize composes whole "
        f"iterations and needs measure_outside(work, freq_mhz, *, group_size, comm_sms=None) "
        f"(it refuses the profiler before measuring); implement it, or skip "
        f"('outside_work',) for a profiler meant for partition searches alone")
    work = OutsideWork(ops=partition.compute_ops[:1])
    try:
        m = p.measure_outside(work, p.gpu.max_clock_mhz, group_size=partition.group_gpus)
    except ConfigError:
        return  # a typed refusal of work it cannot measure (a replay of what was not recorded)
    assert isinstance(m, Measurement), \
        f"measure_outside must return a Measurement, got {type(m).__name__}"
    assert m.time_s > 0 and m.energy_j > 0 and m.static_power_w > 0, \
        f"outside work: time, energy and static power must be > 0, got {m}"


#: Name -> check, for profilers (each takes a factory of new profilers and a partition).
PROFILER_CHECKS: dict[str, Callable[[Callable[[], Profiler], Partition], None]] = {
    "type": _check_profiler_type,
    "measurements": _check_profiler_measurements,
    "static_power": _check_profiler_static_power,
    "rejects_bad_configs": _check_profiler_rejects_bad_configs,
    "outside_work": _check_profiler_outside_work,
}


def check_profiler(make: Callable[[], Profiler], *, partition: Partition | None = None,
                   skip: tuple[str, ...] = ()) -> None:
    """Run every profiler conformance check on profilers made by ``make``.

    Args:
        make: Returns a new profiler each call.
        partition: A partition the profiler can measure; ``None`` = a small Llama 3.2 3B
            forward-attention partition at TP=4.
        skip: Names (keys of ``PROFILER_CHECKS``) to skip.

    Raises:
        AssertionError: naming the first check that fails.
    """
    part = _default_partition() if partition is None else partition
    _run_checks("profiler", PROFILER_CHECKS, skip, make, part)


class ProfilerConformance:
    """Mix-in: subclass in a ``Test*`` class and implement [`make_profiler`][kareus.testing.ProfilerConformance.make_profiler] (and
    optionally [`make_partition`][kareus.testing.ProfilerConformance.make_partition]); pytest then
    runs one test per check."""

    skip_checks: tuple[str, ...] = ()

    def make_profiler(self) -> Profiler:
        """A new profiler (implement it in the subclass)."""
        raise NotImplementedError("implement make_profiler() to return a new profiler")

    def make_partition(self) -> Partition:
        """A partition the profiler can measure; by default a small Llama 3.2 3B
        forward-attention partition at TP=4."""
        return _default_partition()


_add_tests(ProfilerConformance, PROFILER_CHECKS,
           lambda self: (self.make_profiler, self.make_partition()))
