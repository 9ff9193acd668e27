"""The five systems as restricted spaces through the same composition machinery."""

from __future__ import annotations

import zlib

import attrs
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose import (
    SYSTEMS,
    IterationComposer,
    MicrobatchFrontier,
    baseline_space,
    evaluate_plan,
    kareus_partition_sets,
    kareus_type_key,
    kareus_types,
)
from kareus.model.config import ConfigSpace
from kareus.model.measurement import Measurement
from kareus.model.partition import build_partitions
from kareus.model.workload import Workload
from kareus.workflow import compose_systems, exhaustive_search, measure_outside_work
from tests.compose.conftest import FakeProfiler


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
    # kareus searches the workload's nanobatched types and the unsplit ones (the
    # partitions keep their names; only kareus's keys tell them apart).
    assert sorted(calls) == sorted([*build_partitions(tiny_workload).types,
                                    *build_partitions(tiny_workload.with_(nanobatches=1)).types])
    assert sorted(res.partitions["kareus"]) == sorted(kareus_types(tiny_workload))
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
    from kareus.profilers.emulator import EmulatedProfiler

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


class _SplittingCosts(FakeProfiler):
    """Every partition run pays a fixed 1 ms more (launches, say, at full power): a split
    microbatch runs twice the partitions, and overlap does not win that back."""

    def measure(self, partition, config):
        m = super().measure(partition, config)
        extra_s = 1e-3
        power = m.energy_j / m.time_s
        return Measurement(time_s=m.time_s + extra_s, energy_j=m.energy_j + power * extra_s,
                           static_power_w=m.static_power_w)


def _small_grid_search(p, part):
    space = ConfigSpace(part, p.gpu, freqs_mhz=p.gpu.search_clocks_mhz[::3], comm_sms=[4, 32])
    return exhaustive_search(p, space)


def test_where_splitting_does_not_pay_kareus_runs_unsplit_and_beats_megatron(
        tiny_workload, monkeypatch):
    import kareus.workflow.measure as systems

    prof = _SplittingCosts()
    res = compose_systems(tiny_workload, prof, search=_small_grid_search)
    meg, nb = res["megatron"].points[0], res["nanobatching"].points[0]
    assert nb.time_s > meg.time_s  # nanobatching does not pay here
    fastest = res["kareus"].max_throughput()
    assert fastest.time_s <= meg.time_s * (1 + 1e-9)
    assert fastest.nanobatch_counts == (1,)  # every computation unsplit
    assert all(fastest.nanobatches(k) == 1 for k in fastest.assignment)
    # at Megatron-LM's iteration time kareus spends no more energy than Megatron-LM
    at_meg = [p.energy_j for p in res["kareus"].points if p.time_s <= meg.time_s * (1 + 1e-9)]
    assert min(at_meg) <= meg.energy_j * (1 + 1e-9)
    # every microbatch point knows its nanobatch count; the fastest are unsplit
    for fr in res.microbatch["kareus"].values():
        assert {p.nanobatches for p in fr.points} <= {1, 2}
        assert fr.points[0].nanobatches == 1
    # the plans cost what the frontier says, unsplit computations counted with their types
    p = tiny_workload.parallelism
    pset = build_partitions(tiny_workload)
    freqs = sorted({o.config.freq_mhz for pf in res.partitions["kareus"].values()
                    for o in pf.observations})
    outside = measure_outside_work(prof, pset, freqs)
    tail = prof.measure_outside(pset.iteration, prof.gpu.max_clock_mhz, group_size=p.world_size)
    for pt in (res["kareus"].points[0], res["kareus"].points[-1]):
        t, e, _ = evaluate_plan(pt.plan, frontiers=res.partitions["kareus"], partitions=pset,
                                outside=outside, static_power_w=prof.static_power_w(
                                    p.world_size), tail=tail)
        assert t == pytest.approx(pt.time_s, rel=1e-9) and e == pytest.approx(pt.energy_j,
                                                                             rel=1e-9)
    # Without the unsplit types (kareus as it was), kareus is slower than Megatron-LM here.
    real = systems.kareus_partition_sets
    monkeypatch.setattr(systems, "kareus_partition_sets", lambda wl, b=None: real(wl, b)[:1])
    split_only = compose_systems(tiny_workload, _SplittingCosts(), search=_small_grid_search,
                                 systems=["megatron", "kareus"])
    assert split_only["kareus"].points[0].time_s > meg.time_s
    assert split_only["kareus"].max_throughput().nanobatch_counts == (2,)


def test_kareus_frontier_is_never_worse_than_either_partition_set_alone(tiny_workload,
                                                                        monkeypatch):
    import kareus.workflow.measure as systems

    def kareus_front(sets):
        real = systems.kareus_partition_sets
        with monkeypatch.context() as m:
            m.setattr(systems, "kareus_partition_sets", lambda wl, b=None: sets(real(wl, b)))
            return compose_systems(tiny_workload, FakeProfiler(), search=_small_grid_search,
                                   systems=["kareus"])["kareus"]

    both = kareus_front(lambda s: s)
    for alone in (kareus_front(lambda s: s[:1]), kareus_front(lambda s: s[1:])):
        for pt in alone.points:  # weakly dominated by a point of the union
            assert any(q.time_s <= pt.time_s * (1 + 1e-12) and
                       q.energy_j <= pt.energy_j * (1 + 1e-12) for q in both.points)


def test_a_workload_of_one_nanobatch_searches_one_set(tiny_workload):
    one = tiny_workload.with_(nanobatches=1)
    assert len(kareus_partition_sets(one)) == 1
    assert list(kareus_types(one)) == list(build_partitions(one).types)
    search, calls = _search_calls()
    res = compose_systems(one, FakeProfiler(), search=search, systems=["megatron", "kareus"])
    assert sorted(calls) == sorted(build_partitions(one).types)
    assert set(res.partitions["kareus"]) == set(build_partitions(one).types)
    # its one set, and the systems' own configurations (Megatron-LM's plan) alone
    assert res["kareus"].stats["compositions"] == 2
    meg = res["megatron"].points[0]
    assert any(q.time_s <= meg.time_s * (1 + 1e-12) and q.energy_j <= meg.energy_j * (1 + 1e-12)
               for q in res["kareus"].points)
    for pt in res["kareus"].points:
        assert pt.plan.nanobatch_counts == (1,)


def test_unsplit_type_keys_do_not_collide(tiny_workload):
    keys = kareus_types(tiny_workload)
    split = build_partitions(tiny_workload).types
    unsplit = build_partitions(tiny_workload.with_(nanobatches=1)).types
    assert len(keys) == len(split) + len(unsplit)
    assert set(split) & set(unsplit)  # fwd_mlp is both: the keys tell them apart
    assert {k for k in keys if "@" not in k} == set(split)
    assert {k for k in keys if k.endswith("@n1")} == {f"{n}@n1" for n in unsplit}
    for k, part in keys.items():
        assert part.name == k.split("@")[0]
    assert kareus_type_key("fwd_mlp", 1, tiny_workload) == "fwd_mlp@n1"
    assert kareus_type_key("fwd_mlp", 2, tiny_workload) == "fwd_mlp"


def test_a_composer_that_records_another_count_is_refused(tiny_workload):
    from kareus.compose import MicrobatchComposer

    class _Wrong(MicrobatchComposer):
        def compose(self, frontiers, context, /):
            out = super().compose(frontiers, context)
            return {k: MicrobatchFrontier.from_fronts(fr.stage, fr.phase, {
                f: [attrs.evolve(p, choice=attrs.evolve(p.choice, nanobatches=7)) for p in ps]
                for f, ps in fr.by_freq.items()}) for k, fr in out.items()}

    with pytest.raises(ValueError, match="choices of \\[7\\] nanobatches"):
        compose_systems(tiny_workload, FakeProfiler(), search=_small_grid_search,
                        systems=["kareus"], microbatch_composer=_Wrong())


def test_a_composer_that_leaves_the_count_out_gets_its_sets(tiny_workload):
    from kareus.compose import MicrobatchComposer

    class _Silent(MicrobatchComposer):
        def compose(self, frontiers, context, /):
            out = super().compose(frontiers, context)
            return {k: MicrobatchFrontier.from_fronts(fr.stage, fr.phase, {
                f: [attrs.evolve(p, choice=attrs.evolve(p.choice, nanobatches=None))
                    for p in ps] for f, ps in fr.by_freq.items()}) for k, fr in out.items()}

    res = compose_systems(tiny_workload, _SplittingCosts(), search=_small_grid_search,
                          systems=["kareus"], microbatch_composer=_Silent())
    assert res["kareus"].max_throughput().nanobatch_counts == (1,)


class _Skewed(FakeProfiler):
    """The fake GPU with a fixed cost per partition run and per-partition skews of time and
    energy: where splitting pays and where it does not, and everything between."""

    def __init__(self, overhead_s: float, skew: int) -> None:
        super().__init__()
        self.overhead_s, self.skew = overhead_s, skew

    def measure(self, partition, config):
        m = super().measure(partition, config)
        key = f"{partition.name} {len(partition.slots)} {config} {self.skew}".encode()
        h = zlib.crc32(key) % 1000 / 1000
        t = m.time_s * (1 + 0.2 * h) + self.overhead_s
        power = m.energy_j / m.time_s * (1 + 0.1 * (1 - h))
        return Measurement(time_s=t, energy_j=power * t, static_power_w=m.static_power_w)


@settings(max_examples=10, deadline=None)
@given(overhead_s=st.sampled_from([0.0, 2e-4, 1e-3, 5e-3]), skew=st.integers(0, 10**6))
def test_kareus_is_never_worse_than_megatron_or_nanobatching(overhead_s, skew):
    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, dp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=3, nanobatches=2)  # tiny_workload
    res = compose_systems(wl, _Skewed(overhead_s, skew), search=_small_grid_search,
                          systems=["megatron", "nanobatching", "kareus"])
    kareus = res["kareus"].points
    for name in ("megatron", "nanobatching"):
        (pt,) = res[name].points
        assert kareus[0].time_s <= pt.time_s * (1 + 1e-12)
        # their plans lie in kareus's space and its searches measure them
        assert any(q.time_s <= pt.time_s * (1 + 1e-12) and q.energy_j <= pt.energy_j * (1 + 1e-12)
                   for q in kareus), name


class _FasterButCostlier(_SplittingCosts):
    """Splitting does not pay, and any SM count but NCCL's default is 0.1% faster and 5%
    costlier: the fastest plan is not Megatron-LM's, and does not dominate it."""

    def measure(self, partition, config):
        default = attrs.evolve(config, comm_sms=self.gpu.default_comm_sms)
        m = super().measure(partition, default)
        if config == default:
            return m
        return Measurement(time_s=m.time_s * 0.999, energy_j=m.energy_j * 1.05,
                           static_power_w=m.static_power_w)


class _FastestOnly(IterationComposer):
    """An iteration composer that sees only each computation's fastest point: a stand-in
    for one that misses points (the default works on a time grid)."""

    def compose(self, frontiers, context, /):
        fastest = {k: MicrobatchFrontier.from_fronts(fr.stage, fr.phase, {
            fr.points[0].freq_mhz: [fr.points[0]]}) for k, fr in frontiers.items()}
        return super().compose(fastest, context)


def test_megatrons_plan_is_on_kareus_frontier_whatever_the_composer_misses(tiny_workload,
                                                                           monkeypatch):
    import kareus.workflow.measure as systems

    def run():
        return compose_systems(tiny_workload, _FasterButCostlier(), search=_small_grid_search,
                               systems=["megatron", "kareus"], iteration_composer=_FastestOnly())

    def dominated(res):
        (meg,) = res["megatron"].points
        return any(q.time_s <= meg.time_s * (1 + 1e-12) and q.energy_j <= meg.energy_j
                   for q in res["kareus"].points)

    res = run()
    assert dominated(res)
    meg_plan = res["megatron"].points[0].plan
    assert any(p.plan.partition_configs() == meg_plan.partition_configs()
               and p.plan.nanobatch_counts == (1,) for p in res["kareus"].points)
    with monkeypatch.context() as m:  # without the systems' own configurations composed
        m.setattr(systems, "_anchors", lambda *a, **k: None)
        m.setattr(systems, "_with_every_measured_configuration",
                  lambda shared, measured: measured["kareus"])
        assert not dominated(run())
