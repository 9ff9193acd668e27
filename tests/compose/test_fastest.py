"""The fair short end: each system's fastest point is its lowest-energy plan at its minimum
iteration time, checked against brute force on small random DAGs and pipelines."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose import (
    SYSTEMS,
    IterationComposer,
    IterationContext,
    MicrobatchChoice,
    MicrobatchFrontier,
    MicrobatchPoint,
    solve_time_cost,
)
from kareus.compose._fastest import cheapest_at_min_makespan
from kareus.model.config import ScheduleConfig
from kareus.model.dag import Dag
from kareus.model.pipeline import gpipe, one_f_one_b
from kareus.search.pareto import pareto_front

FREQS = (1410, 1305, 1200, 1095, 990)


def _options(system: str, rng: np.random.Generator, integer: bool
             ) -> tuple[np.ndarray, np.ndarray]:
    """One computation type's (times, dynamic energies), shaped like the system's choices:
    one point at the maximum clock (Megatron-LM, nanobatching), a frequency ladder
    (Perseus, nanobatching + Perseus), or an irregular Pareto set (kareus's joint space)."""
    base = float(rng.integers(2, 8)) if integer else float(rng.uniform(1.0, 6.0))
    if system in ("megatron", "nanobatching"):
        k = 1
    else:
        k = int(rng.integers(1, 4))
    if system in ("perseus", "nanobatching+perseus"):
        f = np.array(FREQS[:k], dtype=float) / FREQS[0]
        t = base / f
        e = 10.0 * base * f ** 2
    else:
        t = base + np.sort(rng.uniform(0.0, 3.0, size=k))
        e = 10.0 * base - np.sort(rng.uniform(0.0, 8.0, size=k))[::-1] * (k > 1)
    if integer:
        t, e = np.round(t), np.round(e)
    return t, e


def _brute(dag: Dag, times: list[np.ndarray], costs: list[np.ndarray]
           ) -> tuple[float, float]:
    """Minimum makespan and the minimum cost among assignments that reach it (positions)."""
    rows = np.array(list(itertools.product(*[range(len(t)) for t in times])))
    dur = np.array([[times[v][r[v]] for v in range(len(times))] for r in rows])
    cost = np.array([[costs[v][r[v]] for v in range(len(times))] for r in rows]).sum(axis=1)
    ms = dag.makespans(dur)
    t_min = float(ms.min())
    return t_min, float(cost[ms <= t_min * (1 + 1e-12)].min())


@pytest.mark.parametrize("system", SYSTEMS)
@settings(max_examples=110, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_short_end_is_cheapest_at_min_time_on_random_dags(system, seed):
    """Random DAG (1-7 nodes, 1-4 option sets), options shaped as the system's: the solver's
    fastest realised solution takes the brute-force minimum time at the brute-force
    minimum cost for that time (exact: integer or real times)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.35]
    kinds = int(rng.integers(1, 5))
    integer = bool(seed % 2)
    options = [_options(system, rng, integer) for _ in range(kinds)]
    node_type = [int(rng.integers(0, kinds)) for _ in range(n)]
    res = solve_time_cost(n, edges, node_type, options, unit_s=0.05)
    dag = Dag(n, edges)
    times = [options[node_type[v]][0] for v in dag.order]
    costs = [options[node_type[v]][1] for v in dag.order]
    t_min, c_min = _brute(dag, times, costs)
    static = float(rng.uniform(0.0, 3.0))
    front = pareto_front(np.column_stack([res.times_s, res.costs + static * res.times_s]))
    assert front[0, 0] == pytest.approx(t_min, rel=1e-12)
    assert front[0, 1] == pytest.approx(c_min + static * t_min, rel=1e-12, abs=1e-9)
    assert res.fastest is not None and res.fastest.exact
    assert res.fastest.cost == pytest.approx(c_min, rel=1e-12, abs=1e-9)


def _frontier(system: str, key: tuple[int, str], rng: np.random.Generator
              ) -> MicrobatchFrontier:
    t, e = _options(system, rng, integer=False)
    by_freq = {}
    for i, (ti, ei) in enumerate(zip(t.tolist(), e.tolist())):
        f = FREQS[i]
        choice = MicrobatchChoice(freq_mhz=f, configs={"attn": ScheduleConfig(f, 16, None)})
        by_freq[f] = [MicrobatchPoint(time_s=ti, dynamic_energy_j=ei, choice=choice)]
    return MicrobatchFrontier.from_fronts(key[0], key[1], by_freq)


@pytest.mark.parametrize("system", SYSTEMS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_composer_fastest_plan_is_cheapest_at_min_time(system, seed):
    """The iteration composer on small 1F1B and GPipe pipelines: its maximum-throughput plan
    is the brute-force lowest-energy plan at the brute-force minimum iteration time."""
    rng = np.random.default_rng(seed)
    make = one_f_one_b if seed % 2 else gpipe
    sched = make(2, int(rng.integers(1, 3)))
    keys = sorted({(c.stage, c.phase) for c in sched.nodes})
    mf = {k: _frontier(system, k, rng) for k in keys}
    static = float(rng.uniform(0.0, 5.0))
    fr = IterationComposer().compose(mf, IterationContext(static_power_w=static, gpu="a100-40gb",
                                                          schedule=sched, label=system))
    nodes = sched.nodes
    idx = {c: i for i, c in enumerate(nodes)}
    dag = Dag(len(nodes), [(idx[u], idx[v]) for u, v in sched.edges])
    pts = [mf[(nodes[v].stage, nodes[v].phase)].points for v in dag.order]
    t_min, c_min = _brute(dag, [np.array([p.time_s for p in q]) for q in pts],
                          [np.array([p.dynamic_energy_j for p in q]) for q in pts])
    fast = fr.points[0]
    assert fast.time_s == pytest.approx(t_min, rel=1e-12)
    assert fast.plan.dynamic_energy_j == pytest.approx(c_min, rel=1e-12, abs=1e-9)
    assert fast.energy_j == pytest.approx(c_min + static * t_min, rel=1e-12, abs=1e-9)


def test_relaxation_example_saves_energy_at_same_time():
    """Two parallel branches, one shorter: the short branch slows into its slack."""
    dag = Dag(3, [(0, 2), (1, 2)])
    times = [np.array([4.0]), np.array([1.0, 2.0, 5.0]), np.array([1.0])]
    costs = [np.array([10.0]), np.array([9.0, 4.0, 1.0]), np.array([3.0])]
    sol = cheapest_at_min_makespan(dag, [times[v] for v in dag.order],
                                   [costs[v] for v in dag.order])
    assert sol.time_s == 5.0 and sol.exact
    assert sol.fastest_cost == 22.0 and sol.cost == 17.0 and sol.relaxed == 1


def test_large_group_falls_back_greedily_but_stays_feasible():
    """A deep pipeline with many options per computation: past the exact search's limits
    the group is relaxed greedily, at the minimum time, never costlier than all-fastest."""
    rng = np.random.default_rng(3)
    sched = one_f_one_b(4, 8)
    nodes = sched.nodes
    idx = {c: i for i, c in enumerate(nodes)}
    dag = Dag(len(nodes), [(idx[u], idx[v]) for u, v in sched.edges])
    per = {}
    for c in nodes:
        k = (c.stage, c.phase)
        if k not in per:
            t = np.sort(rng.uniform(1.0, 2.0, size=40)) * (1 + 0.3 * c.stage)
            per[k] = (t, np.sort(rng.uniform(1.0, 9.0, size=40))[::-1])
    times = [per[(nodes[v].stage, nodes[v].phase)][0] for v in dag.order]
    costs = [per[(nodes[v].stage, nodes[v].phase)][1] for v in dag.order]
    sol = cheapest_at_min_makespan(dag, times, costs, max_labels=50, max_work=10_000)
    t_min = dag.makespan([float(t.min()) for t in times])
    assert not sol.exact
    assert sol.time_s <= t_min * (1 + 1e-12)
    assert sol.cost < sol.fastest_cost
    exact = cheapest_at_min_makespan(dag, times, costs)
    assert exact.cost <= sol.cost + 1e-9
