"""Plan evaluation: every plan of a composed frontier costs what the frontier says."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.compose import evaluate_plan
from kareus.model.partition import build_partitions
from kareus.workflow import measure_outside_work


def test_frontier_is_monotone_and_plans_reevaluate(composed, tiny_workload, fake_profiler):
    p = tiny_workload.parallelism
    static = fake_profiler.static_power_w(p.world_size)
    for name, wl in (("kareus", tiny_workload), ("perseus", tiny_workload.with_(nanobatches=1))):
        fr = composed[name]
        assert len(fr) >= 2
        a = fr.array()
        assert np.all(np.diff(a[:, 0]) > 0) and np.all(np.diff(a[:, 1]) < 0)
        pset = build_partitions(wl)
        freqs = sorted({o.config.freq_mhz for pf in composed.partitions[name].values()
                        for o in pf.observations})
        outside = measure_outside_work(fake_profiler, pset, freqs)
        tail = fake_profiler.measure_outside(pset.iteration, fake_profiler.gpu.max_clock_mhz,
                                             group_size=p.world_size)
        assert tail.time_s > 0  # the optimizer step
        for pt in fr.points:
            t, e, dyn = evaluate_plan(pt.plan, frontiers=composed.partitions[name],
                                      partitions=pset, outside=outside, static_power_w=static,
                                      tail=tail)
            assert t == pytest.approx(pt.time_s, rel=1e-9)
            assert e == pytest.approx(pt.energy_j, rel=1e-9)
            assert dyn == pytest.approx(pt.plan.dynamic_energy_j, rel=1e-9)


def test_energy_scale_multiplies_dynamic_energy(composed, tiny_workload, fake_profiler):
    pset = build_partitions(tiny_workload)
    freqs = sorted({o.config.freq_mhz for pf in composed.partitions["kareus"].values()
                    for o in pf.observations})
    outside = measure_outside_work(fake_profiler, pset, freqs)
    plan = composed["kareus"].max_throughput()
    kw = dict(frontiers=composed.partitions["kareus"], partitions=pset, outside=outside,
              static_power_w=0.0)
    t1, _, dyn1 = evaluate_plan(plan, energy_scale=1.0, **kw)
    t3, _, dyn3 = evaluate_plan(plan, energy_scale=3.0, **kw)
    assert t1 == t3
    assert dyn3 == pytest.approx(3 * dyn1)


def test_plans_of_unchained_layers_reevaluate_with_each_split_s_outside_work(
        tiny_workload, fake_profiler):
    # Layers run one by one (chained_layers=False): each layer's bare first unit and exposed
    # last collective are outside work, which depends on the nanobatch count, so a plan's
    # unsplit computations re-evaluate with the unsplit set's outside work (outside_of), and
    # the composed plans cost what their frontier says. (The fake profiler's outside work is
    # not physical; the emulated cost of unchained layers is tests/model's.)
    from kareus.model import ConfigSpace
    from kareus.workflow import compose_systems, exhaustive_search

    wl = tiny_workload.with_(chained_layers=False)

    def search(p, part):
        space = ConfigSpace(part, p.gpu, freqs_mhz=p.gpu.search_clocks_mhz[::2],
                            comm_sms=[2, 8, 32])
        return exhaustive_search(p, space)

    res = compose_systems(wl, fake_profiler, search=search, systems=["kareus"])
    fr = res["kareus"]
    p = wl.parallelism
    static = fake_profiler.static_power_w(p.world_size)
    freqs = sorted({o.config.freq_mhz for pf in res.partitions["kareus"].values()
                    for o in pf.observations})
    pset, whole = build_partitions(wl), build_partitions(wl.with_(nanobatches=1))
    outside = measure_outside_work(fake_profiler, pset, freqs)
    outside_of = {1: measure_outside_work(fake_profiler, whole, freqs)}
    assert outside != outside_of[1]  # the split's bare units and exposed collectives
    tail = fake_profiler.measure_outside(pset.iteration, fake_profiler.gpu.max_clock_mhz,
                                         group_size=p.world_size)
    mixed = 0
    for pt in fr.points:
        kw = dict(frontiers=res.partitions["kareus"], partitions=pset, outside=outside,
                  static_power_w=static, tail=tail)
        t, e, _ = evaluate_plan(pt.plan, outside_of=outside_of, **kw)
        assert t == pytest.approx(pt.time_s, rel=1e-9)
        assert e == pytest.approx(pt.energy_j, rel=1e-9)
        if any(ch.nanobatches == 1 for ch in pt.plan.choices):
            mixed += 1
            with pytest.raises(ValueError, match="outside_of"):
                evaluate_plan(pt.plan, **kw)
    if not mixed:  # no composed plan runs unsplit computations here: one that does
        from kareus.testing import make_workload_plan

        with pytest.raises(ValueError, match="outside_of"):
            evaluate_plan(make_workload_plan(
                wl, unsplit_microbatches=range(wl.num_microbatches)), **kw)
