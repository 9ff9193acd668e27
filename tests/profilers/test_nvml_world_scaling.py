"""A world of one and a world of N agree on what a workload costs when every GPU draws the
same (issue: energies scaled right on every world size).

The NVML profiler measures each partition on the GPUs of its world and states the figure
for the partition's whole group (TP x CP GPUs) and the outside work for its scope: a world
of one (loopback groups standing in) scales the one GPU's energy and static power to the
group; a world of the group's size sums its GPUs and scales nothing. Here each world's
GPUs are fake NVML devices drawing the same power: the two worlds' measurements, and so
everything composed from them, agree (time as measured; energy and static power by GPU
count).
"""

from __future__ import annotations

import threading

import attrs
import pytest
from fake_nvml import FakeNVML
from test_nvml_profiler import PART, FakeRunner
from test_tune import ThreadCoordinator, ThreadWorld

from kareus.model.config import ScheduleConfig
from kareus.profilers.nvml import EnergyMeter, LocalCoordinator, NVMLProfiler

CFG = ScheduleConfig(1980, 4, "mm")


def _profiler(coordinator):
    # the static power is given for the profiler's whole group (its world): 100 W per GPU
    nvml = FakeNVML(period_s=0.02, idle_w=80.0)
    meter = EnergyMeter(device_indices=[0], nvml=nvml, poll_interval_s=0.0002)
    return NVMLProfiler(gpu="h200-sxm", runner=FakeRunner(nvml), meter=meter,
                        coordinator=coordinator, warmup_s=0.03, window_steps=5,
                        max_cooldown_s=0.2, static_power_w=100.0 * coordinator.world_size)


def _measure(world_size: int, partition):
    """Rank 0's record of ``partition`` measured in a world of ``world_size`` threads."""
    if world_size == 1:
        prof = _profiler(LocalCoordinator())
        try:
            return prof.measure_record(partition, CFG)
        finally:
            prof.close()
    world = ThreadWorld(world_size)
    records: list = [None] * world_size
    errors: list = [None] * world_size

    def rank(r: int) -> None:
        prof = _profiler(ThreadCoordinator(world, r))
        try:
            records[r] = prof.measure_record(partition, CFG)
        except BaseException as exc:  # reported to the test
            errors[r] = exc
        finally:
            prof.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [None] * world_size
    return records[0]


@pytest.mark.parametrize("group", [2, 4])
def test_a_world_of_one_and_a_world_of_the_group_agree(group):
    part = attrs.evolve(PART, name=f"p{group}",
                        comm_op=attrs.evolve(PART.comm_op, group_size=group))
    one = _measure(1, part)
    many = _measure(group, part)
    assert (one.measured_gpus, one.scope_gpus) == (1, group)
    assert (many.measured_gpus, many.scope_gpus) == (group, group)
    a, b = one.measurement, many.measurement
    assert a.time_s == pytest.approx(b.time_s, rel=0.05)
    assert a.energy_j == pytest.approx(b.energy_j, rel=0.08)
    # static power: 100 W per GPU, every GPU of the group
    assert a.static_power_w == pytest.approx(b.static_power_w) == pytest.approx(100.0 * group)
    assert a.dynamic_energy_j == pytest.approx(b.dynamic_energy_j, rel=0.12)
