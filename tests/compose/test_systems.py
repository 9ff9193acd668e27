"""The five systems as restricted spaces through the same composition machinery."""

from __future__ import annotations

import pytest

from kareus.compose import SYSTEMS, baseline_space, compose_systems, exhaustive_search
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
    res = compose_systems(tiny_workload, fake_profiler, search=search)
    assert list(res.frontiers) == list(SYSTEMS)
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
    assert all(name in text for name in SYSTEMS)


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
        compose_systems(tiny_workload, fake_profiler, systems=["zeus"])
    with pytest.raises(TypeError, match="Profiler"):
        compose_systems(tiny_workload, object())  # type: ignore[arg-type]


def test_systems_share_measurements_of_the_same_run(tiny_workload):
    from kareus.exec.emulator import EmulatedProfiler

    noisy = EmulatedProfiler("a100-40gb", noise=0.05, seed=7)
    search, _ = _search_calls()
    res = compose_systems(tiny_workload, noisy, search=search)
    # Megatron-LM's plan is among Perseus's plans (all computations at the maximum clock):
    # with one measurement per configuration, Perseus is never slower than Megatron-LM at its
    # fastest, whatever the noise (a noisy measurement of the pipeline sends at a lower
    # clock can make Perseus's fastest plan a little faster still).
    meg, per = res["megatron"].points[0], res["perseus"].points[0]
    assert per.time_s <= meg.time_s * (1 + 1e-9)
    assert min(p.energy_j for p in res["perseus"].points
               if p.time_s <= meg.time_s * (1 + 1e-9)) <= meg.energy_j * (1 + 1e-9)
    # Each (partition, configuration) was measured once: the nanobatching systems' max-clock
    # first-slot configuration appears with one measurement in both.
    nb = res.partitions["nanobatching"]
    nbp = res.partitions["nanobatching+perseus"]
    for t, pf in nb.items():
        (obs,) = pf.observations
        twin = [o for o in nbp[t].observations if o.config == obs.config]
        assert [o.measurement for o in twin] == [obs.measurement]
