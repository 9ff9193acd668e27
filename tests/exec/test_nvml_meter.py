"""The energy meter's step-edge reads (kareus.exec.nvml._meter) on a fake NVML."""

from __future__ import annotations

import time

import pytest
from fake_nvml import FakeNVML

from kareus.exec.nvml import EnergyMeter


def test_meter_records_counter_steps_and_power():
    # Robust on a loaded machine: the window is counted in observed counter steps (60, not a
    # fixed sleep that a starved polling thread may fill with few steps), long enough that a
    # poll delayed by a busy CPU (measured: up to ~15 ms beside three busy processes on
    # 2 cores) moves the power of a third of it by under 8%; the tolerances are unchanged.
    nvml = FakeNVML(period_s=0.01, idle_w=100.0)
    with EnergyMeter(device_indices=[0], nvml=nvml, poll_interval_s=0.0002) as m:
        t0 = time.perf_counter()
        m.wait_edges(61, timeout_s=60.0)
        e, dt, n = m.energy_between(t0, time.perf_counter())
        assert n >= 60
        assert e / dt == pytest.approx(100.0, rel=0.05)
        assert m.step_period_s() == pytest.approx(0.01, rel=0.2)
        parts = m.split_powers_w(t0, time.perf_counter(), 3)
        assert len(parts) == 3 and all(p == pytest.approx(100.0, rel=0.15) for p in parts)
