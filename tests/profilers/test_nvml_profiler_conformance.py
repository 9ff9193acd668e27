"""NVMLProfiler against the Profiler role's conformance suite, measuring a fake device whose
energy counter steps like an H200's (fake_nvml.py; the runner of test_nvml_profiler.py)."""

from __future__ import annotations

from fake_nvml import FakeNVML
from test_nvml_profiler import FakeRunner

from kareus.profilers.nvml import EnergyMeter, NVMLProfiler
from kareus.testing import ProfilerConformance


class TestNVMLProfilerConformance(ProfilerConformance):
    # Built without outside= (the fake runner has no outside work), NVMLProfiler measures
    # partitions alone and says so (measures_outside_work is False; tested below).
    skip_checks = ("outside_work",)

    def make_profiler(self):
        nvml = FakeNVML(period_s=0.02)
        meter = EnergyMeter(device_indices=[0], nvml=nvml, poll_interval_s=0.0002)
        return NVMLProfiler(gpu="h200-sxm", runner=FakeRunner(nvml), meter=meter,
                            warmup_s=0.03, window_steps=5, max_cooldown_s=0.2)


def test_measures_outside_work_only_with_outside():
    nvml = FakeNVML(period_s=0.02)
    meter = EnergyMeter(device_indices=[0], nvml=nvml, poll_interval_s=0.0002)
    plain = NVMLProfiler(gpu="h200-sxm", runner=FakeRunner(nvml), meter=meter)
    assert plain.measures_outside_work is False
    given = NVMLProfiler(gpu="h200-sxm", runner=FakeRunner(nvml), meter=meter,
                         outside=lambda work, sms: None)
    assert given.measures_outside_work is True
