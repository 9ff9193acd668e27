"""A subclass of each search- and composition-side role plugged into ``kareus.optimize`` on the
emulator: a Partition, an AcquisitionPass, a FrontierComposer of each level and a Profiler. Small
workloads and budgets: each test runs in a few seconds."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import pytest

from kareus.compose import (
    IterationComposer,
    IterationContext,
    IterationFrontier,
    MicrobatchComposer,
    MicrobatchContext,
    MicrobatchFrontier,
)
from kareus.errors import ArgumentError, ArgumentTypeError, OutputError
from kareus.model import (
    ConfigSpace,
    Measurement,
    Partition,
    PartitionSet,
    Profiler,
    ScheduleConfig,
    Workload,
    build_partitions,
)
from kareus.model.ops import CommOp, ComputeOp
from kareus.model.partition import OutsideWork
from kareus.profilers.emulator import EmulatedProfiler
from kareus.search import AcquisitionContext, AcquisitionPass, PartitionFrontier, SearchSpec
from kareus.workflow import optimize

WL = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                     num_microbatches=4)
SYSTEMS = ["megatron", "kareus"]
KW: dict[str, Any] = {"budget": 6, "seed": 1, "progress": False, "systems": SYSTEMS}


@pytest.fixture(scope="module")
def reference():
    """The run with every default, to compare with."""
    return optimize(WL, "h200-sxm", **KW)


# -------------------------------------------------------------------------- Partition


class MyPartition(Partition):
    """A user's own partition type: it wraps a built one (the emulator needs only the ops)."""

    def __init__(self, inner: Partition) -> None:
        self._inner = inner

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def compute_ops(self) -> tuple[ComputeOp, ...]:
        return self._inner.compute_ops

    @property
    def comm_op(self) -> CommOp:
        return self._inner.comm_op

    @property
    def overlappable(self) -> bool:
        return self._inner.overlappable

    @property
    def group_gpus(self) -> int:
        return self._inner.group_gpus


def _mine(workload: Workload) -> PartitionSet:
    pset = build_partitions(workload)
    return attrs.evolve(pset, types={n: MyPartition(p) for n, p in pset.types.items()})


class Recording(Profiler):
    """A user's own profiler: the emulator underneath, recording what it was asked."""

    def __init__(self, gpu: str = "h200-sxm", seed: int = 1) -> None:
        self._emulator = EmulatedProfiler(gpu, seed=seed)
        self.gpu = self._emulator.gpu
        self.partition_types: set[type] = set()
        self.outside = 0

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        self.partition_types.add(type(partition))
        return self._emulator.measure(partition, config)

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        self.outside += 1
        return self._emulator.measure_outside(work, freq_mhz, group_size=group_size,
                                              comm_sms=comm_sms)


def test_a_partition_builder_of_your_own_reaches_every_search(reference):
    prof = Recording()
    res = optimize(WL, profiler=prof, partitions=_mine, **KW)
    assert prof.partition_types == {MyPartition}  # kareus's searches and the baseline's
    assert all(isinstance(p, MyPartition) for p in res.partitions.types.values())
    assert prof.outside > 0  # the outside work and the tail went through it too
    # the same ops, so the same figures as the built partitions
    assert res.to_dict()["frontiers"] == reference.to_dict()["frontiers"]


def test_a_partition_set_of_your_own_is_searched_for_its_workload(tmp_path):
    prof = Recording()
    res = optimize(WL, profiler=prof, partitions=_mine(WL), log_dir=tmp_path, **KW)
    assert MyPartition in prof.partition_types
    assert all(isinstance(p, MyPartition) for p in res.partitions.types.values())
    # the manifest records the set by what it holds: the same set (another object) resumes
    again = optimize(WL, profiler=Recording(), partitions=_mine(WL), log_dir=tmp_path, **KW)
    assert again.to_dict() == res.to_dict()
    with pytest.raises(ArgumentError, match="built for"):
        optimize(WL, profiler=Recording(), partitions=_mine(WL.with_(seq_len=2048)), **KW)
    with pytest.raises(ArgumentTypeError, match="partitions must be"):
        optimize(WL, profiler=Recording(), partitions=3, **KW)  # type: ignore[arg-type]


# --------------------------------------------------------------------- AcquisitionPass


class CheapestClockPass(AcquisitionPass):
    """A user's own pass: the available candidates at the lowest predicted energy."""

    #: Batches picked by every copy (each search gets its own copy of the pass).
    batches = 0

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        type(self).batches += 1
        idx = np.flatnonzero(context.available)
        order = np.argsort(context.prediction.dynamic_energy_j[idx], kind="stable")
        return idx[order[:k]].astype(np.int64)


def test_passes_of_your_own_reach_every_search(tmp_path):
    kw = {**KW, "budget": 10, "systems": ["kareus"]}  # 8 profiles of initial design, 2 of passes
    mine = CheapestClockPass()
    res = optimize(WL, "h200-sxm", passes=[mine], log_dir=tmp_path, **kw)
    assert CheapestClockPass.batches >= len(res.profiles)  # every type's search used it
    default = optimize(WL, "h200-sxm", **kw)
    assert res.to_dict()["frontiers"] != default.to_dict()["frontiers"]
    again = optimize(WL, "h200-sxm", search=SearchSpec(budget=10, seed=1, passes=[(mine, 1.0)]),
                     progress=False, systems=["kareus"])
    assert again.to_dict()["frontiers"] == res.to_dict()["frontiers"]
    # the manifest records the passes: the folder refuses a run with the default mix
    with pytest.raises(OutputError, match="passes"):
        optimize(WL, "h200-sxm", log_dir=tmp_path, **kw)


def test_a_search_specification_is_the_keywords_in_one_value(reference):
    res = optimize(WL, "h200-sxm", search=SearchSpec(budget=6, seed=1), progress=False,
                   systems=SYSTEMS)
    assert res.to_dict() == reference.to_dict()
    same_seed = optimize(WL, "h200-sxm", search=SearchSpec(budget=6, seed=1), seed=1,
                         progress=False, systems=SYSTEMS)
    assert same_seed.to_dict() == reference.to_dict()
    with pytest.raises(ArgumentError, match="budget in search=SearchSpec"):
        optimize(WL, search=SearchSpec(budget=6), budget=8)
    with pytest.raises(ArgumentError, match="seed"):
        optimize(WL, search=SearchSpec(seed=1), seed=2)
    with pytest.raises(ArgumentTypeError, match="SearchSpec"):
        optimize(WL, search={"budget": 6})  # type: ignore[arg-type]


# ---------------------------------------------------------------- FrontierComposers


class SlowerMicrobatches(MicrobatchComposer):
    """A user's microbatch composer: the default's frontiers, every point 1 ms slower."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[MicrobatchContext] = []

    def compose(self, frontiers: Mapping[str, PartitionFrontier],
                context: MicrobatchContext | None = None, /, **fields: Any
                ) -> dict[tuple[int, str], MicrobatchFrontier]:
        assert context is not None
        self.contexts.append(context)
        out = super().compose(frontiers, context)
        return {k: MicrobatchFrontier.from_fronts(fr.stage, fr.phase, {
            f: [attrs.evolve(p, time_s=p.time_s + 1e-3) for p in ps]
            for f, ps in fr.by_freq.items()}) for k, fr in out.items()}


class Delegating(IterationComposer):
    """A user's iteration composer that delegates with the context it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.tails: list[Measurement | None] = []

    def compose(self, frontiers: Mapping[tuple[int, str], MicrobatchFrontier],
                context: IterationContext | None = None, /, **fields: Any) -> IterationFrontier:
        assert context is not None
        self.tails.append(context.tail)
        return super().compose(frontiers, context)


def test_composers_of_your_own_at_both_levels(reference):
    mb, it = SlowerMicrobatches(), Delegating()
    res = optimize(WL, "h200-sxm", microbatch_composer=mb, iteration_composer=it, **KW)
    assert mb.contexts and all(c.outside is not None for c in mb.contexts)
    # the per-iteration tail reaches a delegating composer: nothing is dropped on the way
    assert it.tails and all(t is not None and t.time_s > 0 for t in it.tails)
    assert res.kareus.points[0].time_s > reference.kareus.points[0].time_s
    plain = optimize(WL, "h200-sxm", iteration_composer=Delegating(), **KW)
    assert plain.to_dict() == reference.to_dict()  # delegating changes nothing


def test_a_composer_written_for_keyword_contexts_is_refused_where_it_is_defined():
    with pytest.raises(TypeError, match=r"compose must take \(frontiers, context, /\)"):
        class _Old(IterationComposer):  # the keyword form of earlier releases
            def compose(self, frontiers, /, **context):  # type: ignore[override]
                return super().compose(frontiers, **context)


# -------------------------------------------------------------------------- Profiler


class PartitionsOnly(Profiler):
    """A user's profiler that implements only the abstract ``measure``."""

    def __init__(self) -> None:
        self.gpu = EmulatedProfiler("h200-sxm").gpu
        self.calls = 0

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        self.calls += 1
        return Measurement(time_s=1e-3, energy_j=1.0, static_power_w=100.0)


def test_a_profiler_without_measure_outside_is_refused_before_measuring():
    prof = PartitionsOnly()
    assert not prof.measures_outside_work and Recording().measures_outside_work
    start = time.monotonic()
    with pytest.raises(ArgumentTypeError, match=r"implement measure_outside\(work, freq_mhz"):
        optimize(WL, profiler=prof, **KW)
    assert time.monotonic() - start < 1.0
    assert prof.calls == 0
    from kareus.workflow import compose_systems

    with pytest.raises(ArgumentTypeError, match="measure_outside"):
        compose_systems(WL, prof)
    assert prof.calls == 0
    # a partition search alone needs no more than measure
    part = next(iter(build_partitions(WL).types.values()))
    assert len(SearchSpec(budget=3).run(prof, part).measured()) == 3


def test_the_testing_fake_profiler_drives_optimize():
    from kareus.testing import FakeProfiler

    res = optimize(WL, profiler=FakeProfiler("h200-sxm"), **KW)
    assert res.kareus.points[0].time_s <= res.frontiers["megatron"].points[0].time_s * 1.0001


def test_a_recorder_measures_outside_work_when_what_it_wraps_does():
    from kareus.profilers.replay import RecordingProfiler

    assert RecordingProfiler(Recording()).measures_outside_work
    assert not RecordingProfiler(PartitionsOnly()).measures_outside_work


def test_the_command_line_checks_memory_once(tmp_path, monkeypatch):
    import kareus.workflow.checks as orchestrate
    from kareus.cli import main

    calls = []
    real = orchestrate.check_memory
    monkeypatch.setattr(orchestrate, "check_memory",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    orchestrate._memory.cache_clear()
    argv = ["optimize", "--workload", "qwen3-1.7b", "--gpu", "h200-sxm", "--tp", "2", "--pp",
            "2", "--microbatches", "4", "--microbatch-size", "2", "--seq-len", "1024",
            "--budget", "4", "--quiet", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert len(calls) == 1


def test_space_of_a_partition_of_your_own():
    part = MyPartition(next(iter(build_partitions(WL).types.values())))
    space = ConfigSpace(part, "h200-sxm")
    assert len(space) > 0
