"""The energy meter's step-edge reads (kareus.profilers.nvml._meter) on a fake NVML."""

from __future__ import annotations

import time

import pytest
from fake_nvml import FakeNVML

from kareus.profilers.nvml import EnergyMeter
from kareus.profilers.nvml._meter import _Edge


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
        assert n >= 56  # 60 steps, less any at the ends seen late (not used as ends)
        assert e / dt == pytest.approx(100.0, rel=0.05)
        assert m.step_period_s() == pytest.approx(0.01, rel=0.2)
        parts = m.split_powers_w(t0, time.perf_counter(), 3)
        assert len(parts) == 3 and all(p == pytest.approx(100.0, rel=0.15) for p in parts)


def _meter_with_edges(edges: list[tuple[float, int, float]]) -> EnergyMeter:
    m = EnergyMeter(device_indices=[0], nvml=FakeNVML(period_s=0.01, idle_w=100.0),
                    poll_interval_s=0.0005)
    m._edges[0] = [_Edge(t, mj, blur) for t, mj, blur in edges]
    return m


def test_a_step_seen_late_does_not_bound_the_span():
    # Counter steps every 20 ms at 100 W (2,000 mJ a step), seen 0.6 ms after the last
    # read, except the last, seen 26 ms late (the polling thread kept off the CPU): its
    # host time is 26 ms after the step, its energy exact.
    edges = [(0.020 * k + 0.0006, 2000 * k, 0.0006) for k in range(8)]
    edges.append((0.020 * 8 + 0.026, 2000 * 8, 0.026))
    m = _meter_with_edges(edges)
    e, dt, n = m.energy_between(0.0, 1.0)
    assert e / dt == pytest.approx(100.0, rel=1e-9) and n == 7
    naive = (edges[-1][1] - edges[0][1]) / 1000 / (edges[-1][0] - edges[0][0])
    assert naive == pytest.approx(86.3, abs=0.1)  # what the late end would have given
    assert all(p == pytest.approx(100.0) for p in m.split_powers_w(0.0, 1.0, 3))


def test_evenly_timed_steps_keep_the_widest_span():
    # Every step seen ~5 ms late (the thread waiting for the GIL each time): none is an
    # outlier, so the span runs from the first step to the last, as before.
    edges = [(0.1 * k + 0.005, 10_000 * k, 0.005 + 0.0001 * (k % 3)) for k in range(6)]
    e, dt, n = _meter_with_edges(edges).energy_between(0.0, 1.0)
    assert n == 5 and dt == pytest.approx(0.5, abs=1e-3)


def test_the_profiler_sees_only_sharply_timed_steps():
    edges = [(0.1 * k, 10_000 * k, 0.0006) for k in range(5)]
    edges[2] = (0.2 + 0.03, 20_000, 0.03)  # seen 30 ms late
    m = _meter_with_edges(edges)
    assert [mj for _, mj in m.timed_edges(0.0, 1.0)] == [0, 10_000, 30_000, 40_000]
    assert [mj for _, mj in m.timed_edges(0.35, 1.0)] == [40_000]  # one step: kept


def test_the_step_period_ignores_the_first_read_and_late_steps():
    # Steps every 150 ms. The thread's first read (a value, not a step) came 10 ms before
    # the first step; then steps seen alternately late and on time on a busy CPU: the
    # median gap over every read, the first included, would say 80 ms.
    first = _Edge(0.140, 0, 0.0005, step=False)
    seen = [(0.150, 0.0005), (0.300 + 0.070, 0.080), (0.450 + 0.0004, 0.0004),
            (0.600 + 0.070, 0.080), (0.750 + 0.0004, 0.0004)]
    m = _meter_with_edges([])
    m._edges[0] = [first] + [_Edge(t, 1000 * (k + 1), blur)
                             for k, (t, blur) in enumerate(seen)]
    times = [0.140] + [t for t, _ in seen]
    raw = sorted(b - a for a, b in zip(times, times[1:]))
    assert raw[len(raw) // 2] == pytest.approx(0.0804)  # what the old estimate gave
    # no two consecutive sharp steps: the mean gap over the steps
    assert m.step_period_s() == pytest.approx(0.150, rel=0.01)
    sharp = [_Edge(0.150 * k, 1000 * k, 0.0005) for k in range(1, 5)]
    m._edges[0] = [first, *sharp]
    assert m.step_period_s() == pytest.approx(0.150)
    m._edges[0] = [first, sharp[0]]
    assert m.step_period_s() is None  # one step: no period yet
