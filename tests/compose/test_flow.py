"""Minimum cuts with lower bounds: the from-scratch solver and the warm-started one."""

from __future__ import annotations

import numpy as np

from kareus.compose._flow import WarmCut, min_cut_lower_bounds
from kareus.model.dag import Dag


def test_min_cut_with_lower_bounds_small_network():
    # s -> a -> t and s -> b -> t; arc a has bounds [1, 3], arc b [0, 2].
    # Node ids: s=0, a_in=1, a_out=2, b_in=3, b_out=4, t=5.
    arcs = [(0, 1, 0, 1e9), (1, 2, 1.0, 3.0), (2, 5, 0, 1e9),
            (0, 3, 0, 1e9), (3, 4, 0.0, 2.0), (4, 5, 0, 1e9)]
    in_s = min_cut_lower_bounds(6, arcs, 0, 5, big=1e9)
    assert in_s is not None
    assert in_s[1] and not in_s[2] and in_s[3] and not in_s[4]  # cut both op arcs: 3 + 2


def test_min_cut_prefers_the_cheaper_side():
    # Two op arcs in series (a then b): cutting either shortens the path; b is cheaper.
    # Node ids: s=0, a_in=1, a_out=2, b_in=3, b_out=4, t=5.
    arcs = [(0, 1, 0, 1e9), (1, 2, 0.0, 5.0), (2, 3, 0, 1e9), (3, 4, 0.0, 2.0), (4, 5, 0, 1e9)]
    in_s = min_cut_lower_bounds(6, arcs, 0, 5, big=1e9)
    assert in_s is not None
    assert in_s[1] and in_s[2] and in_s[3] and not in_s[4]


def test_infeasible_lower_bounds_give_none():
    # s -> a carries at most 1, but a -> t must carry at least 5.
    arcs = [(0, 1, 0.0, 1.0), (1, 2, 5.0, 6.0)]
    assert min_cut_lower_bounds(3, arcs, 0, 2, big=1e9) is None


def _cold_side(dag, crit, es, d, lb, ub, big):
    """The from-scratch cut of the critical sub-graph, as the solver builds it."""
    cidx = [v for v in range(dag.num_nodes) if crit[v]]
    local = {v: i for i, v in enumerate(cidx)}
    m = len(cidx)
    s, t = 2 * m, 2 * m + 1
    _, tail = dag.heads_tails(d)
    arcs = []
    for v in cidx:
        arcs.append((2 * local[v], 2 * local[v] + 1, lb[v], ub[v]))
        if es[v] == 0:
            arcs.append((s, 2 * local[v], 0.0, big))
        if tail[v] == 0:
            arcs.append((2 * local[v] + 1, t, 0.0, big))
    for u, v in dag.edges:
        if crit[u] and crit[v] and es[u] + d[u] == es[v]:
            arcs.append((2 * local[u] + 1, 2 * local[v], 0.0, big))
    side = min_cut_lower_bounds(2 * m + 2, arcs, s, t, big=big)
    return None if side is None else {v: (side[2 * local[v]], side[2 * local[v] + 1])
                                      for v in cidx}


def test_warm_cut_matches_a_cold_cut_on_a_diamond():
    # 0 -> {1, 2} -> 3, all on the critical path (equal durations).
    dag = Dag(4, [(0, 1), (0, 2), (1, 3), (2, 3)])
    d = [1, 2, 2, 1]
    es, tail = dag.heads_tails(d)
    T = dag.makespan(d)
    crit = [es[v] + d[v] + tail[v] == T for v in range(4)]
    assert all(crit)
    big = 1e9
    lb = [0.0, 0.0, 0.0, 0.0]
    ub = [9.0, 1.0, 2.0, 5.0]
    warm = WarmCut(dag, big, 1e-9)
    side = warm.cut(crit, es, d, lb, ub)
    assert side is not None
    warm_side = {v: (side[2 * v], side[2 * v + 1]) for v in range(4)}
    cold = _cold_side(dag, crit, es, d, lb, ub, big)
    forward = sorted(v for v, (a, b) in warm_side.items() if a and not b)
    assert forward == sorted(v for v, (a, b) in cold.items() if a and not b)
    # Speeding up both middle nodes (1 + 2) beats either end (9 or 5).
    assert forward == [1, 2]
    assert np.isclose(sum(ub[v] for v in forward), 3.0)
