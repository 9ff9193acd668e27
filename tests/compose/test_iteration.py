"""Iteration composition: exact on small DAGs, invariants, plans re-evaluated from parts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose._flow import min_cut_lower_bounds
from kareus.compose.baselines import compose_baselines, exhaustive_search
from kareus.compose.iteration import IterationComposer, evaluate_plan, solve_time_cost
from kareus.compose.microbatch import measure_outside_work
from kareus.model.config import ConfigSpace
from kareus.model.pipeline import one_f_one_b
from kareus.search.pareto import hypervolume, pareto_front


def _dag(pp, m):
    sched = one_f_one_b(pp, m)
    nodes = sched.nodes
    idx = {c: i for i, c in enumerate(nodes)}
    keys = sorted({(c.stage, c.phase) for c in nodes})
    return (len(nodes), [(idx[u], idx[v]) for u, v in sched.edges],
            [keys.index((c.stage, c.phase)) for c in nodes], len(keys))


def _brute(n, edges, node_type, options, static):
    from kareus.compose.iteration import _Dag

    dag = _Dag(n, edges)
    rows = np.array(list(itertools.product(*[range(len(options[node_type[v]][0]))
                                             for v in range(n)])))
    dur = np.array([[options[node_type[v]][0][r[v]] for v in range(n)] for r in rows])
    cost = np.array([[options[node_type[v]][1][r[v]] for v in range(n)] for r in rows]).sum(1)
    ms = dag.makespans(dur[:, dag.order])
    return np.column_stack([ms, cost + static * ms])


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000))
def test_exact_on_convex_integer_options(seed):
    """Options on every integer time with convex costs: the PD frontier is the exact one."""
    rng = np.random.default_rng(seed)
    n, edges, node_type, k = _dag(2, 2)
    options = []
    for _ in range(k):
        m = int(rng.integers(2, 4))
        slopes = np.sort(rng.integers(1, 20, size=m - 1))[::-1]
        costs = np.concatenate([[100.0], 100.0 - np.cumsum(slopes)])
        options.append((np.arange(3, 3 + m, dtype=float), costs))
    static = float(rng.uniform(0, 5))
    res = solve_time_cost(n, edges, node_type, options, 1.0)
    ours = pareto_front(np.column_stack([res.times_s, res.costs + static * res.times_s]))
    exact = pareto_front(_brute(n, edges, node_type, options, static))
    assert np.allclose(ours, exact)


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000))
def test_general_options_realisable_and_close_to_exact(seed):
    rng = np.random.default_rng(seed)
    n, edges, node_type, k = _dag(2, 2)
    options = []
    for _ in range(k):
        m = int(rng.integers(2, 4))
        options.append((np.sort(rng.uniform(1, 3, m)), np.sort(rng.uniform(1, 10, m))[::-1]))
    static = float(rng.uniform(0, 3))
    res = solve_time_cost(n, edges, node_type, options, 0.01)
    ours = np.column_stack([res.times_s, res.costs + static * res.times_s])
    exact = _brute(n, edges, node_type, options, static)
    # Every point we report is a real assignment (it is among the brute-force points).
    for p in ours:
        assert np.any(np.all(np.isclose(exact, p), axis=1))
    ref = exact.max(axis=0) * 1.1
    # Discrete, non-convex options make the trade-off a heuristic (exact only on convex
    # hulls); it stays close to the exact frontier.
    assert hypervolume(ours, ref) >= 0.9 * hypervolume(exact, ref)


def test_warm_started_cuts_match_cold_cuts():
    rng = np.random.default_rng(7)
    n, edges, node_type, k = _dag(4, 8)
    options = []
    for _ in range(k):
        t = np.sort(rng.uniform(1, 2, 12))
        options.append((t, 10 / t + rng.uniform(0, 0.3, 12)))
    warm = solve_time_cost(n, edges, node_type, options, 0.02)
    cold = solve_time_cost(n, edges, node_type, options, 0.02, warm_start=False)
    fw = pareto_front(np.column_stack([warm.times_s, warm.costs]))
    fc = pareto_front(np.column_stack([cold.times_s, cold.costs]))
    ref = np.maximum(fw.max(0), fc.max(0)) * 1.05
    assert hypervolume(fw, ref) == pytest.approx(hypervolume(fc, ref), rel=1e-3)


def test_min_cut_with_lower_bounds_small_network():
    # s -> a -> t and s -> b -> t; arc a has bounds [1, 3], arc b [0, 2].
    # Node ids: s=0, a_in=1, a_out=2, b_in=3, b_out=4, t=5.
    arcs = [(0, 1, 0, 1e9), (1, 2, 1.0, 3.0), (2, 5, 0, 1e9),
            (0, 3, 0, 1e9), (3, 4, 0.0, 2.0), (4, 5, 0, 1e9)]
    in_s = min_cut_lower_bounds(6, arcs, 0, 5, big=1e9)
    assert in_s is not None
    assert in_s[1] and not in_s[2] and in_s[3] and not in_s[4]  # cut both op arcs: 3 + 2


@pytest.fixture
def composed(tiny_workload, fake_profiler):
    def search(p, part):
        space = ConfigSpace(part, p.gpu, freqs_mhz=p.gpu.search_clocks_mhz[::2],
                            comm_sms=[2, 8, 32])
        return exhaustive_search(p, space)

    return compose_baselines(tiny_workload, fake_profiler, search=search,
                             systems=["perseus", "kareus"])


def test_frontier_is_monotone_and_plans_reevaluate(composed, tiny_workload, fake_profiler):
    from kareus.model.partition import build_partitions

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
        for pt in fr.points:
            t, e, dyn = evaluate_plan(pt.plan, frontiers=composed.partitions[name],
                                      partitions=pset, outside=outside, static_power_w=static)
            assert t == pytest.approx(pt.time_s, rel=1e-9)
            assert e == pytest.approx(pt.energy_j, rel=1e-9)
            assert dyn == pytest.approx(pt.plan.dynamic_energy_j, rel=1e-9)


def test_select(composed):
    fr = composed["kareus"]
    fast, slow = fr.points[0], fr.points[-1]
    assert fr.max_throughput() is fast.plan
    assert fr.min_energy() is slow.plan
    mid = fr.points[len(fr) // 2]
    assert fr.select(deadline_s=mid.time_s) is mid.plan
    assert fr.select(energy_budget_j=mid.energy_j) is mid.plan
    assert fr.select(deadline_s=10 * slow.time_s) is slow.plan
    with pytest.raises(ValueError, match="no plan meets the deadline"):
        fr.select(deadline_s=fast.time_s * 0.5)
    with pytest.raises(ValueError, match="energy budget"):
        fr.select(energy_budget_j=slow.energy_j * 0.5)
    with pytest.raises(ValueError, match="exactly one"):
        fr.select()
    assert "kareus" in repr(fr) and "time (s)" in fr.summary()


def test_composer_arguments(composed):
    mf = composed.microbatch["kareus"]
    with pytest.raises(ValueError, match="schedule= or num_microbatches="):
        IterationComposer().compose(mf, static_power_w=1.0, gpu="a100-40gb")
    with pytest.raises(ValueError, match="unit_s"):
        IterationComposer(unit_s=0)
    fr = IterationComposer(resolution=0.05).compose(mf, static_power_w=100.0, gpu="a100-40gb",
                                                    num_microbatches=3)
    assert fr.stats["unit_s"] > 0 and len(fr) >= 1


def test_plot_smoke(composed):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    ax = composed["kareus"].plot()
    composed.microbatch["kareus"][(0, "fwd")].plot(ax=None)
    assert ax.get_xlabel().startswith("iteration time")


def test_frontiers_round_trip_through_json(composed, tmp_path):
    from kareus.compose.frontiers import IterationFrontier, MicrobatchFrontier
    from kareus.errors import PlanError

    fr = composed["kareus"]
    path = tmp_path / "frontier.json"
    fr.save(path)
    again = IterationFrontier.load(path)
    assert np.array_equal(again.array(), fr.array())
    assert [p.plan.digest for p in again] == [p.plan.digest for p in fr]
    mf = composed.microbatch["kareus"][(1, "bwd")]
    mf2 = MicrobatchFrontier.from_json(mf.to_json())
    assert mf2.points == mf.points and mf2.by_freq == mf.by_freq
    with pytest.raises(PlanError, match="not a kareus iteration frontier"):
        IterationFrontier.from_json(mf.to_json())
    with pytest.raises(PlanError, match="not valid JSON"):
        IterationFrontier.from_json("{")


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 5))
def test_iteration_frontier_invariants(seed, pp, m):
    """Random microbatch frontiers: the iteration frontier is monotone, and every plan's
    computations, looked up in the microbatch frontiers, give its time and energy."""
    from kareus.compose.frontiers import MicrobatchFrontier, MicrobatchPoint
    from kareus.compose.plan import MicrobatchChoice
    from kareus.model.config import ScheduleConfig

    rng = np.random.default_rng(seed)
    freqs = [1410, 1200, 1050, 900]
    mfs = {}
    for s in range(pp):
        for ph in ("fwd", "bwd"):
            by_freq = {}
            for f in freqs:
                k = int(rng.integers(1, 4))
                ts = np.sort(rng.uniform(1, 2, k)) * 1410 / f * (2 if ph == "bwd" else 1)
                es = np.sort(rng.uniform(5, 10, k))[::-1] * f / 1410
                by_freq[f] = [MicrobatchPoint(time_s=t, dynamic_energy_j=e, choice=MicrobatchChoice(
                    freq_mhz=f, configs={"t": ScheduleConfig(f, i + 1, None)}))
                    for i, (t, e) in enumerate(zip(ts, es))]
            mfs[(s, ph)] = MicrobatchFrontier.from_fronts(s, ph, by_freq)
    static = float(rng.uniform(0, 20))
    fr = IterationComposer(resolution=0.05).compose(mfs, static_power_w=static,
                                                    gpu="a100-40gb", num_microbatches=m)
    a = fr.array()
    assert len(fr) >= 1
    assert np.all(np.diff(a[:, 0]) > 0) and np.all(np.diff(a[:, 1]) < 0)
    sched = one_f_one_b(pp, m)
    for pt in fr.points:
        durations, dyn = {}, 0.0
        for c in sched.nodes:
            ch = pt.plan.choice(c)
            p = next(p for p in mfs[(c.stage, c.phase)].points if p.choice == ch)
            durations[c] = p.time_s
            dyn += p.dynamic_energy_j
        t = sched.makespan(durations)
        assert t == pytest.approx(pt.time_s, rel=1e-9)
        assert dyn + static * t == pytest.approx(pt.energy_j, rel=1e-9)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 3.0))
def test_shortest_time_is_the_all_fastest_makespan(seed, unit_frac):
    """Whatever the time unit, the frontier reaches the makespan of every computation at its
    fastest option (a coarse unit must not leave the short end out of reach)."""
    from kareus.compose.iteration import _Dag

    rng = np.random.default_rng(seed)
    n, edges, node_type, k = _dag(3, 4)
    options = [(rng.uniform(1.0, 3.0, size=4), rng.uniform(1.0, 10.0, size=4)) for _ in range(k)]
    unit = unit_frac * min(float(t.min()) for t, _ in options)
    res = solve_time_cost(n, edges, node_type, options, unit)
    dag = _Dag(n, edges)
    fastest = np.array([options[node_type[v]][0].min() for v in range(n)])
    best = dag.makespans(fastest[dag.order][None, :])[0]
    assert res.times_s.min() == pytest.approx(best, rel=1e-12)
