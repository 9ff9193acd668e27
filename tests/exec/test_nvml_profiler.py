"""NVMLProfiler (kareus.exec.nvml._profiler) against a fake NVML whose counter steps like
an H200's (but every 20 ms instead of 100 ms, to keep the tests fast)."""

from __future__ import annotations

import statistics
import time

import pytest
from fake_nvml import FakeNVML

from kareus.errors import HardwareError
from kareus.exec.nvml import EnergyMeter, LocalCoordinator, NVMLProfiler, PartitionRunner
from kareus.model.config import ScheduleConfig
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.partition import OpPartition

PART = OpPartition(name="p", compute_ops=[ComputeOp(name="mm", kind=OpKind.GEMM, flops=1e9,
                                                    bytes_moved=1e6)],
                   comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=1e6, group_size=2))


class FakeRunner(PartitionRunner):
    """A 'device' that is busy for step_s per step at a power set per SM count."""

    def __init__(self, nvml: FakeNVML, *, step_s: float = 0.004, busy_w: float = 500.0) -> None:
        self.nvml = nvml
        self.step_s = step_s
        self.busy_w = busy_w
        self.busy_until = time.perf_counter()

    def prepare(self, partition, config):
        extra = self.busy_w + 10.0 * config.comm_sms - self.nvml.devices[0].idle_w
        step_s = self.step_s * (1 + 0.05 * config.comm_sms)

        def step():
            start = max(time.perf_counter(), self.busy_until)
            self.busy_until = start + step_s
            self.nvml.add_busy(0, start, self.busy_until, extra)
        return step

    def synchronize(self):
        delay = self.busy_until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def mark(self):
        return max(self.busy_until, time.perf_counter())

    def elapsed_s(self, a, b):
        return b - a


def make(nvml=None, **kw):
    nvml = nvml or FakeNVML(period_s=0.02)
    meter = EnergyMeter(device_indices=[0], nvml=nvml, poll_interval_s=0.0002)
    runner = FakeRunner(nvml)
    kw.setdefault("warmup_s", 0.03)
    kw.setdefault("window_steps", 5)
    kw.setdefault("max_cooldown_s", 0.2)
    prof = NVMLProfiler(gpu="h200-sxm", runner=runner, meter=meter, **kw)
    return prof, nvml, runner


def test_profiler_measures_energy_per_step():
    prof, nvml, runner = make()
    try:
        rec = prof.measure_record(PART, ScheduleConfig(1980, 4, "mm"))
    finally:
        prof.close()
    step_s = runner.step_s * 1.2
    m = rec.measurement
    assert m.time_s == pytest.approx(step_s, rel=0.02)
    # Power over the measured span is the busy power (+10 W per SM in the fake).
    assert rec.power_w == pytest.approx(540.0, rel=0.05)
    assert m.energy_j == pytest.approx(540.0 * step_s, rel=0.06)
    assert m.static_power_w == pytest.approx(80.0, rel=0.1)  # measured idle (one GPU)
    assert prof.idle_power_w == pytest.approx(80.0, rel=0.1)
    assert rec.window_s >= 4 * 0.02 * 0.9


def test_repeated_measurements_agree():
    prof, nvml, runner = make()
    try:
        es = [prof.measure(PART, ScheduleConfig(1980, 2, "mm")).energy_j for _ in range(4)]
    finally:
        prof.close()
    assert statistics.pstdev(es) / statistics.fmean(es) < 0.03


def test_configurations_are_told_apart():
    prof, *_ = make()
    try:
        a = prof.measure(PART, ScheduleConfig(1980, 1, "mm"))
        b = prof.measure(PART, ScheduleConfig(1980, 8, "mm"))
    finally:
        prof.close()
    assert b.time_s > a.time_s and b.energy_j > a.energy_j


def test_cooldown_waits_for_temperature():
    prof, nvml, _ = make(max_cooldown_s=0.3, cooldown_tolerance_c=2.0)
    try:
        prof.start()
        nvml.devices[0].temp_c = prof.baseline_temp_c + 10  # hot, and stays hot
        rec = prof.measure_record(PART, ScheduleConfig(1980, 4, "mm"))
        assert rec.cooldown_s == pytest.approx(0.3, abs=0.1)
        assert rec.start_temp_c == prof.baseline_temp_c + 10
        nvml.devices[0].temp_c = prof.baseline_temp_c + 1  # within tolerance
        rec = prof.measure_record(PART, ScheduleConfig(1980, 4, "mm"))
        assert rec.cooldown_s < 0.05
    finally:
        prof.close()


def test_static_power_can_be_given():
    prof, *_ = make(static_power_w=300.0)
    try:
        m = prof.measure(PART, ScheduleConfig(1980, 4, None))
        assert m.static_power_w == 300.0
        assert prof.static_power_w(8) == pytest.approx(300.0 * 8)
    finally:
        prof.close()


def test_dead_counter_is_a_hardware_error():
    prof, *_ = make(FakeNVML(counter_moves=False), counter_timeout_s=0.1)
    with pytest.raises(HardwareError, match="did not move"):
        prof.start()
    prof.close()


def test_type_checks():
    nvml = FakeNVML()
    meter = EnergyMeter(device_indices=[0], nvml=nvml)
    with pytest.raises(TypeError, match="PartitionRunner"):
        NVMLProfiler(gpu="h200-sxm", runner=object(), meter=meter)
    with pytest.raises(TypeError, match="EnergyMeter"):
        NVMLProfiler(gpu="h200-sxm", runner=FakeRunner(nvml), meter=object())
    with pytest.raises(TypeError, match="Coordinator"):
        NVMLProfiler(gpu="h200-sxm", runner=FakeRunner(nvml), meter=meter, coordinator=1)
    assert LocalCoordinator().sum([1.0, 2.0]) == [1.0, 2.0]


def test_preheat_sets_a_working_baseline_temperature():
    prof, nvml, _ = make()
    try:
        prof.start()
        idle = prof.baseline_temp_c
        nvml.devices[0].temp_c = idle + 15  # as if heated by the runs
        base = prof.preheat(PART, ScheduleConfig(1980, 4, "mm"), runs=1, settle_s=0.01)
        assert base == idle + 15 and prof.baseline_temp_c == base
        assert prof.records == []  # pre-heat runs are not measurements
    finally:
        prof.close()
