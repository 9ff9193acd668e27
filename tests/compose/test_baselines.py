"""The five systems as restricted spaces through the same composition machinery."""

from __future__ import annotations

import pytest

from kareus.compose.baselines import BASELINES, baseline_space, compose_baselines, exhaustive_search
from kareus.model.config import ConfigSpace
from kareus.model.partition import build_partitions


def _search_calls():
    calls = []

    def search(p, part):
        calls.append(part.name)
        space = ConfigSpace(part, p.gpu, freqs_mhz=p.gpu.search_clocks_mhz[::3],
                            comm_sms=[4, 32])
        return exhaustive_search(p, space)

    return search, calls


def test_all_five_systems(tiny_workload, fake_profiler):
    search, calls = _search_calls()
    res = compose_baselines(tiny_workload, fake_profiler, search=search)
    assert list(res.frontiers) == list(BASELINES)
    gpu = fake_profiler.gpu
    assert sorted(calls) == sorted(build_partitions(tiny_workload).types)
    for name in ("megatron", "nanobatching"):
        fr = res[name]
        assert len(fr) == 1
        plan = fr.max_throughput()
        assert set(plan.frequencies_mhz.values()) == {gpu.max_clock_mhz}
        for cfgs in plan.partition_configs().values():
            assert all(c.comm_sms == gpu.default_comm_sms for c in cfgs)
            if name == "megatron":
                assert all(c.launch_slot is None for c in cfgs)
            else:
                assert all(c.launch_slot is not None for c in cfgs)
    for name in ("perseus", "nanobatching+perseus"):
        fr = res[name]
        assert len(fr) > 1
        plans = [p.plan for p in fr.points]
        assert len({f for p in plans for f in p.frequencies_mhz.values()}) > 1
        for p in plans:
            for cfgs in p.partition_configs().values():
                assert all(c.comm_sms == gpu.default_comm_sms for c in cfgs)
    # Perseus's fastest plan is Megatron's plan: frequency planning starts from it.
    assert res["perseus"].points[0].time_s == pytest.approx(res["megatron"].points[0].time_s)
    assert res["perseus"].points[-1].energy_j < res["megatron"].points[0].energy_j
    assert res["megatron"].max_throughput().workload["nanobatches"] == 1
    text = res.summary()
    assert all(name in text for name in BASELINES)


def test_baseline_space_restrictions(tiny_workload):
    pset = build_partitions(tiny_workload)
    part = next(iter(pset))
    space = baseline_space("nanobatching", part, "a100-40gb")
    assert len(space) == 1 and space.configs[0].launch_slot == part.slots[0].name
    space = baseline_space("nanobatching+perseus", part, "a100-40gb")
    assert len(space) == 18 and space.comm_sms == (32,)
    with pytest.raises(ValueError, match="no restricted space"):
        baseline_space("kareus", part, "a100-40gb")


def test_argument_errors(tiny_workload, fake_profiler):
    with pytest.raises(ValueError, match="unknown system"):
        compose_baselines(tiny_workload, fake_profiler, systems=["zeus"])
    with pytest.raises(TypeError, match="Profiler"):
        compose_baselines(tiny_workload, object())  # type: ignore[arg-type]
