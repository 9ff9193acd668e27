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


def test_a_tiny_job_composes_to_the_same_energy_in_a_world_of_one_and_of_two(tmp_path):
    # the whole tune (every partition type, the baselines, the outside work) composed into
    # the iteration: a world of one standing in for TP=2 and a world of the two GPUs agree
    from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
    from kareus.model.partition import OpPartition
    from kareus.model.workload import ModelArch, Parallelism, Workload
    from kareus.tune import run_lockstep

    arch = ModelArch(name="tiny", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                     ffn=512, vocab=1000)
    wl = Workload(model=arch, parallelism=Parallelism(tp=2), microbatch_size=2, seq_len=256,
                  num_microbatches=2, nanobatches=2)

    def outside(work, sms):  # the outside work: a GEMM and a collective over the group
        return OpPartition(name="outside", compute_ops=[ComputeOp(
            name="mm", kind=OpKind.GEMM, flops=1e9, bytes_moved=1e6)],
            comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=1e6, group_size=2))

    def prof(coord):
        nvml = FakeNVML(period_s=0.01, idle_w=80.0)
        meter = EnergyMeter(device_indices=[0], nvml=nvml, poll_interval_s=0.0002)
        return NVMLProfiler(gpu="h200-sxm", runner=FakeRunner(nvml, step_s=0.002),
                            meter=meter, coordinator=coord, warmup_s=0.01, window_steps=3,
                            max_cooldown_s=0.05, static_power_w=100.0 * coord.world_size,
                            outside=outside, comm_sms=[4, 8])

    def run(n):
        world = ThreadWorld(n)
        reports: list = [None] * n
        errors: list = [None] * n

        def rank(r):
            coord = LocalCoordinator() if n == 1 else ThreadCoordinator(world, r)
            p = prof(coord)
            try:
                reports[r] = run_lockstep(wl, profiler=p, coordinator=coord,
                                          out_dir=tmp_path / f"w{n}", budget=2,
                                          progress=False, systems=["megatron", "kareus"])
            except BaseException as exc:  # reported to the test
                errors[r] = exc
            finally:
                p.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert errors == [None] * n
        return reports[0].result

    one, two = run(1).systems(), run(2).systems()
    assert set(one) == set(two) and "megatron" in one
    for system in one:  # the iteration composed over the job's 2 GPUs
        a, b = one[system], two[system]
        assert a.time_s == pytest.approx(b.time_s, rel=0.05), system
        assert a.total_j == pytest.approx(b.total_j, rel=0.08), system
        assert a.static_j == pytest.approx(b.static_j, rel=0.05), system
