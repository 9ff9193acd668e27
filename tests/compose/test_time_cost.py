"""The time-cost trade-off solver: exact on convex options, close to exact otherwise,
warm-started cuts equal cold ones, the fast end always reached."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.compose import TimeCostResult, solve_time_cost
from kareus.model.dag import Dag
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
    dag = Dag(n, edges)
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


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.05, 3.0))
def test_shortest_time_is_the_all_fastest_makespan(seed, unit_frac):
    """Whatever the time unit, the frontier reaches the makespan of every computation at its
    fastest option (a coarse unit must not leave the short end out of reach)."""
    rng = np.random.default_rng(seed)
    n, edges, node_type, k = _dag(3, 4)
    options = [(rng.uniform(1.0, 3.0, size=4), rng.uniform(1.0, 10.0, size=4)) for _ in range(k)]
    unit = unit_frac * min(float(t.min()) for t, _ in options)
    res = solve_time_cost(n, edges, node_type, options, unit)
    dag = Dag(n, edges)
    fastest = np.array([options[node_type[v]][0].min() for v in range(n)])
    best = dag.makespans(fastest[dag.order][None, :])[0]
    assert res.times_s.min() == pytest.approx(best, rel=1e-12)


def test_result_maps_back_to_node_ids():
    """Choices are reported per original node id, whatever the topological relabelling."""
    # Nodes 0 <- 1 <- 2 (edges point backwards in id order), one fast costly option and
    # one slow cheap option each.
    options = [([1.0, 2.0], [10.0, 1.0]), ([1.0, 3.0], [20.0, 1.0])]
    res = solve_time_cost(3, [(2, 1), (1, 0)], [0, 1, 0], options, 0.5)
    assert isinstance(res, TimeCostResult)
    assert res.choices.shape[1] == 3
    for row, t, c in zip(res.choices, res.times_s, res.costs):
        types = [0, 1, 0]
        assert t == pytest.approx(sum(options[types[v]][0][k] for v, k in enumerate(row)))
        assert c == pytest.approx(sum(options[types[v]][1][k] for v, k in enumerate(row)))
    assert res.times_s.min() == pytest.approx(3.0)  # all fastest
    assert res.times_s.max() == pytest.approx(7.0)  # all cheapest


def test_argument_errors():
    with pytest.raises(ValueError, match="unit_s"):
        solve_time_cost(1, [], [0], [([1.0], [1.0])], 0.0)
    with pytest.raises(ValueError, match="at least one option"):
        solve_time_cost(1, [], [0], [([], [])], 0.1)
