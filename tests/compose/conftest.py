"""Fakes for composition tests: a deterministic analytic profiler and tiny workloads."""

from __future__ import annotations

import pytest

from kareus.compose import SystemsResult
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.gpu import get_gpu
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search import PartitionFrontier
from kareus.workflow import compose_systems, exhaustive_search


class FakeProfiler(Profiler):
    """Closed-form time and energy: faster at high clocks, overlap hides communication,
    more SMs speed the collective up but slow the computation. Deterministic."""

    def __init__(self, gpu: str = "a100-40gb") -> None:
        self.gpu = get_gpu(gpu)
        self.calls = 0

    def _compute(self, partition: Partition) -> float:
        return sum(op.flops for op in partition.compute_ops) / 1e14 + 1e-5 * len(
            partition.compute_ops)

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        self.calls += 1
        g = self.gpu
        f = config.freq_mhz / g.max_clock_mhz
        comp = self._compute(partition) / f * (1 + config.comm_sms / g.sm_count)
        comm = partition.comm_op.bus_bytes / 2e11 * (8 / min(config.comm_sms, 8)) ** 0.5
        if config.launch_slot is None:
            t = comp + comm
        else:
            slot = partition.slot(config.launch_slot)
            frac = slot.index / max(len(partition.compute_ops), 1)
            t = max(comp, comp * frac + comm) + 2e-6
        group = partition.comm_op.group_size
        dyn_power = 250.0 * f ** 2.5 + 2.0 * config.comm_sms
        static = g.static_power_w * group
        return Measurement(time_s=t, energy_j=(dyn_power * group + static) * t,
                           static_power_w=static)

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        f = freq_mhz / self.gpu.max_clock_mhz
        t = sum(op.flops for op in work.ops) / 1e14 / f + 1e-5 * len(work.comms)
        static = self.gpu.static_power_w * group_size
        return Measurement(time_s=t, energy_j=(200.0 * f ** 2.5 * group_size + static) * t,
                           static_power_w=static)


@pytest.fixture
def fake_profiler() -> FakeProfiler:
    return FakeProfiler()


@pytest.fixture
def tiny_workload() -> Workload:
    return Workload.preset("qwen3-1.7b", tp=2, pp=2, dp=2, microbatch_size=2, seq_len=1024,
                           num_microbatches=3, nanobatches=2)


@pytest.fixture
def composed(tiny_workload: Workload, fake_profiler: FakeProfiler) -> SystemsResult:
    """Perseus and kareus composed on the tiny workload, each partition type measured
    exhaustively over a small grid (every other clock, three SM counts)."""

    def search(p: Profiler, part: Partition) -> PartitionFrontier:
        space = ConfigSpace(part, p.gpu, freqs_mhz=p.gpu.search_clocks_mhz[::2],
                            comm_sms=[2, 8, 32])
        return exhaustive_search(p, space)

    return compose_systems(tiny_workload, fake_profiler, search=search,
                           systems=["perseus", "kareus"])
