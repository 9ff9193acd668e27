"""The time-cost trade-off on a DAG whose nodes have discrete (time, cost) options.

Each node of a DAG can run at any of its options: a time and a cost. The DAG's time is its
longest path; its cost the sum over nodes. [`solve_time_cost`][kareus.compose.solve_time_cost]
traces the trade-off between the two with the algorithm of Phillips and Dessouky, as Perseus
(SOSP'24) does for pipeline energy:

1. Time is counted in integer units of ``unit_s`` (the iteration composer uses a
   fraction of the shortest time any node can take, 1/100 by default). Each node's
   options are rounded to units; per unit time only the cheapest option is kept, and the
   cost between options is the lower convex hull (the algorithm needs convex costs).
2. Start from the cheapest option of every node.
3. Repeat: on the *critical* sub-graph (nodes and edges on a longest path), find
   the cheapest set of nodes to speed up by one unit (and, possibly, others to
   slow down by one unit) so that every critical path gets one unit shorter. This is a
   minimum s-t cut in which speeding up costs the hull's slope to the left and slowing
   down earns the slope to the right (arc lower bounds); see ``kareus.compose._flow``.
4. Stop when some critical path cannot get shorter.

Each step's durations are *realised* by running every node at the slowest of its
options that fits its planned duration, and the realised solution's time and cost are
evaluated exactly from real (unrounded) durations; callers keep the Pareto set of the
realised solutions, whose times and costs are therefore exact, whatever the unit.

Speed: a minimum cut keeps its cost for as long as every node it speeds up
stays on the same hull segment, every one it slows down stays on its segment, and no
path outside the critical sub-graph becomes critical. We take all those unit steps at
once (checking the last condition by evaluating the longest path, and backing off by
bisection when it fails), which gives the same frontier as one unit per cut in far
fewer cuts. The realised solution changes only where some moving node crosses one of its
options, so only those steps are evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kareus.compose._fastest import FastestSolution, cheapest_at_min_makespan
from kareus.compose._flow import WarmCut, min_cut_lower_bounds
from kareus.errors import ArgumentError
from kareus.model.dag import Dag

__all__ = ["TimeCostResult", "solve_time_cost"]


@attrs.frozen
class _TypeTable:
    """Per-type lookup tables over integer durations ``q0 .. qmax``."""

    q0: int
    qmax: int
    hull_cost: np.ndarray  # convex hull cost at each duration
    ub: np.ndarray  # cost of speeding up by one unit from each duration (big at q0)
    lb: np.ndarray  # saving of slowing down by one unit (0 at qmax)
    room_down: np.ndarray  # unit steps of speed-up left on the current hull segment
    room_up: np.ndarray  # unit steps of slow-down left on the current hull segment
    realized: np.ndarray  # index (into the type's options) of the slowest point that fits
    fastest_twin: np.ndarray  # per option: the fastest option rounded to the same unit time


def _type_table(times_s: np.ndarray, costs: np.ndarray, unit_s: float, big: float) -> _TypeTable:
    q_all = np.maximum(np.rint(times_s / unit_s).astype(np.int64), 1)
    # Cheapest option per unit time, then Pareto in (q, cost).
    order = np.lexsort((costs, q_all))
    qs: list[int] = []
    cs: list[float] = []
    idx: list[int] = []
    for i in order.tolist():
        q, c = int(q_all[i]), float(costs[i])
        if qs and q == qs[-1]:
            continue
        if cs and c >= cs[-1]:
            continue  # dominated by a faster, cheaper option
        qs.append(q)
        cs.append(c)
        idx.append(i)
    # Lower convex hull of (q, c), q ascending, c strictly descending.
    hull: list[int] = []
    for k in range(len(qs)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # Remove b if it lies on or above the segment a -> k.
            cross = (qs[b] - qs[a]) * (cs[k] - cs[a]) - (cs[b] - cs[a]) * (qs[k] - qs[a])
            if cross <= 0:
                hull.pop()
            else:
                break
        hull.append(k)
    q0, qmax = qs[0], qs[-1]
    span = qmax - q0 + 1
    hq = np.array([qs[k] for k in hull], dtype=np.float64)
    hc = np.array([cs[k] for k in hull], dtype=np.float64)
    grid = np.arange(q0, qmax + 1)
    hull_cost = np.interp(grid, hq, hc)
    ub = np.full(span, big)
    ub[1:] = hull_cost[:-1] - hull_cost[1:]
    lb = np.zeros(span)
    lb[:-1] = hull_cost[:-1] - hull_cost[1:]
    verts = np.array([qs[k] for k in hull], dtype=np.int64)
    # Segment containing (d-1, d) has lower vertex = largest vertex <= d-1.
    lower = verts[np.maximum(np.searchsorted(verts, grid - 1, side="right") - 1, 0)]
    room_down = np.where(grid > q0, grid - lower, 0)
    upper_i = np.minimum(np.searchsorted(verts, grid + 1, side="left"), len(verts) - 1)
    room_up = np.where(grid < qmax, verts[upper_i] - grid, 0)
    qarr = np.array(qs)
    realized = np.array(idx, dtype=np.int64)[np.searchsorted(qarr, grid, side="right") - 1]
    # Options that round to the same unit time: the cheapest plans the trade-off, the
    # fastest is realised as an alternative (rounding must not hide a faster option).
    twin = np.arange(len(times_s))
    fastest: dict[int, int] = {}
    for i in np.argsort(times_s, kind="stable").tolist():
        fastest.setdefault(int(q_all[i]), i)
    for i in idx:
        twin[i] = fastest[int(q_all[i])]
    return _TypeTable(q0=q0, qmax=qmax, hull_cost=hull_cost, ub=ub, lb=lb,
                      room_down=room_down.astype(np.int64), room_up=room_up.astype(np.int64),
                      realized=realized, fastest_twin=twin)


@attrs.frozen(kw_only=True)
class TimeCostResult:
    """Realised solutions of a time-cost trade-off, in the order they were found.

    Attributes:
        choices: ``(k, n)`` option index of every node in each realised solution.
        times_s: Exact longest path of each solution.
        costs: Exact total cost of each solution.
        unit_s: The time unit used.
        cuts: Minimum cuts computed.
        steps: Unit steps taken.
        fastest: The cheapest solution at the minimum makespan (the last realised one),
            and how it was found.
    """

    choices: np.ndarray
    times_s: np.ndarray
    costs: np.ndarray
    unit_s: float
    cuts: int
    steps: int
    fastest: FastestSolution | None = None


def solve_time_cost(num_nodes: int, edges: Sequence[tuple[int, int]],  # noqa: C901 - the Phillips-Dessouky loop; its steps share the flattened tables built here
                    node_type: Sequence[int],
                    options: Sequence[tuple[Sequence[float], Sequence[float]]],
                    unit_s: float, *, max_steps: int = 1_000_000,
                    warm_start: bool = True) -> TimeCostResult:
    """The Phillips-Dessouky time-cost trade-off on a DAG whose nodes have discrete options.

    Args:
        num_nodes: Nodes ``0 .. num_nodes - 1``.
        edges: ``(u, v)``: v starts after u ends.
        node_type: The option set of each node (an index into ``options``).
        options: Per option set, ``(times_s, costs)`` of its options.
        unit_s: Time unit of the discretisation.
        max_steps: Safety limit on unit steps.
        warm_start: Compute each minimum cut from the previous flow (fast); ``False``
            rebuilds the network and solves each cut from scratch (a reference for tests).

    Returns:
        Every distinct realised solution met on the way from the cheapest to the fastest,
        with exact times and costs (callers Pareto-filter them).
    """
    if unit_s <= 0:
        raise ArgumentError(f"unit_s must be positive, got {unit_s}")
    dag = Dag(num_nodes, edges)
    n = num_nodes
    types_pos = np.asarray(node_type, dtype=np.int64)[dag.order]  # type of node at position
    opt_t = [np.asarray(t, dtype=np.float64) for t, _ in options]
    opt_c = [np.asarray(c, dtype=np.float64) for _, c in options]
    if any(len(t) == 0 for t in opt_t):
        raise ArgumentError("every option set needs at least one option")
    finite = np.concatenate([np.abs(np.diff(np.sort(c))) for c in opt_c] + [np.ones(1)])
    scale = max(float(finite.max()), 1e-300)
    big = 1e9 * scale
    tables = [_type_table(t, c, unit_s, big) for t, c in zip(opt_t, opt_c)]
    # Flatten per-type tables, indexed by base[type] + d.
    offs = np.cumsum([0] + [tb.qmax - tb.q0 + 1 for tb in tables])
    base = np.array([offs[k] - tb.q0 for k, tb in enumerate(tables)], dtype=np.int64)
    cat = {name: np.concatenate([getattr(tb, name) for tb in tables])
           for name in ("ub", "lb", "room_down", "room_up", "realized")}
    nb = base[types_pos]
    q0 = np.array([tables[k].q0 for k in types_pos], dtype=np.int64)
    qmax = np.array([tables[k].qmax for k in types_pos], dtype=np.int64)
    # Real time / cost of every (type, option), flattened.
    ooffs = np.cumsum([0] + [len(t) for t in opt_t])
    all_t = np.concatenate(opt_t)
    all_c = np.concatenate(opt_c)
    obase = ooffs[types_pos]

    records_choice: list[np.ndarray] = []
    records_t: list[float] = []
    records_c: list[float] = []

    twin_all = np.concatenate([tb.fastest_twin + ooffs[k] for k, tb in enumerate(tables)])

    def record(rows: np.ndarray) -> None:
        # rows: (b, n) option indices (positions order); each is also realised with the
        # fastest twin of every option.
        flat = rows + obase[None, :]
        flat = np.vstack([flat, twin_all[flat]])
        times = dag.makespans(all_t[flat])
        costs = all_c[flat].sum(axis=1)
        for r, tt, cc in zip(flat - obase[None, :], times.tolist(), costs.tolist()):
            records_choice.append(r)
            records_t.append(tt)
            records_c.append(cc)

    def makespan_int(dv: np.ndarray) -> int:
        return dag.makespan(dv.tolist())

    d = qmax.copy()
    T = makespan_int(d)
    t_min = makespan_int(q0)
    cur_real = cat["realized"][nb + d]
    record(cur_real[None, :])
    cuts = steps = 0
    eps = 1e-12 * scale
    warm = WarmCut(dag, big, 1e-9 * scale) if warm_start else None

    while t_min < T and steps < max_steps:
        dl = d.tolist()
        es, tail = dag.heads_tails(dl)
        crit = [es[v] + dl[v] + tail[v] == T for v in range(n)]
        cidx = [v for v in range(n) if crit[v]]
        ub_all = cat["ub"][nb + d]
        lb_all = cat["lb"][nb + d]
        if warm is not None:
            in_s = warm.cut(crit, es, dl, lb_all.tolist(), ub_all.tolist())
            cuts += 1
            if in_s is None:
                break
            fwd = [v for v in cidx if in_s[2 * v] and not in_s[2 * v + 1]]
            bwd = [v for v in cidx if not in_s[2 * v] and in_s[2 * v + 1]]
        else:
            local = {v: i for i, v in enumerate(cidx)}
            m = len(cidx)
            s_node, t_node = 2 * m, 2 * m + 1
            arcs: list[tuple[int, int, float, float]] = []
            for v in cidx:
                i = local[v]
                arcs.append((2 * i, 2 * i + 1, float(lb_all[v]), float(ub_all[v])))
                if es[v] == 0:
                    arcs.append((s_node, 2 * i, 0.0, big))
                if tail[v] == 0:
                    arcs.append((2 * i + 1, t_node, 0.0, big))
            for u, v in dag.edges:
                if crit[u] and crit[v] and es[u] + dl[u] == es[v]:
                    arcs.append((2 * local[u] + 1, 2 * local[v], 0.0, big))
            cut_s = min_cut_lower_bounds(2 * m + 2, arcs, s_node, t_node, big=big, eps=eps)
            cuts += 1
            if cut_s is None:
                break
            fwd = [v for v in cidx if cut_s[2 * local[v]] and not cut_s[2 * local[v] + 1]]
            bwd = [v for v in cidx if not cut_s[2 * local[v]] and cut_s[2 * local[v] + 1]]
        cost = sum(float(ub_all[v]) for v in fwd) - sum(float(lb_all[v]) for v in bwd)
        if not fwd or cost >= big / 2:
            break  # some critical path cannot get shorter
        F = np.array(fwd, dtype=np.int64)
        B = np.array(bwd, dtype=np.int64)
        j = _advance(dag, d, F, B, T, cat, nb)
        if j == 0:
            # Slowing the cut's backward computations would lengthen a path outside the
            # critical sub-graph: speed up the forward ones only (still shortens every
            # critical path; costs a little more than the cut).
            B = B[:0]
            j = _advance(dag, d, F, B, T, cat, nb)
            if j == 0:
                break
        # Realised plans at every step where a moving computation crosses one of its points.
        moving = np.concatenate([F, B])
        sign = np.concatenate([-np.ones(len(F), dtype=np.int64), np.ones(len(B), dtype=np.int64)])
        steps_i = np.arange(1, j + 1)
        dd = d[moving][None, :] + sign[None, :] * steps_i[:, None]
        real = cat["realized"][nb[moving][None, :] + dd]
        prev = np.vstack([cur_real[moving][None, :], real[:-1]])
        changed = np.nonzero((real != prev).any(axis=1))[0]
        if len(changed):
            rows = np.repeat(cur_real[None, :], len(changed), axis=0)
            rows[:, moving] = real[changed]
            record(rows)
        d[F] -= j
        d[B] += j
        cur_real = cat["realized"][nb + d]
        T = makespan_int(d)
        steps += j

    # The frontier's short end: the minimum makespan (every node at its fastest option),
    # reached at the lowest cost (nodes off the critical path relaxed into their slack,
    # exactly: kareus.compose._fastest). The discretised walk can stop a few time units
    # short of it (a unit is a fraction of the shortest node), so it is always offered to
    # the Pareto filter too.
    fastest = cheapest_at_min_makespan(dag, [opt_t[k] for k in types_pos.tolist()],
                                       [opt_c[k] for k in types_pos.tolist()])
    flat = fastest.choices + obase
    records_choice.append(fastest.choices)
    records_t.append(float(dag.makespans(all_t[flat][None, :])[0]))
    records_c.append(float(all_c[flat].sum()))

    # Back to original node ids.
    choices = np.array(records_choice, dtype=np.int64).reshape(-1, n)
    out = np.empty_like(choices)
    out[:, np.asarray(dag.order)] = choices
    return TimeCostResult(choices=out, times_s=np.array(records_t), costs=np.array(records_c),
                          unit_s=float(unit_s), cuts=cuts, steps=steps, fastest=fastest)


def _advance(dag: Dag, d: np.ndarray, F: np.ndarray, B: np.ndarray, T: int,
             cat: dict[str, np.ndarray], nb: np.ndarray) -> int:
    """Largest number of unit steps (>= 0) the cut (F faster, B slower) can be repeated."""
    rooms = [cat["room_down"][nb[F] + d[F]]]
    if len(B):
        rooms.append(cat["room_up"][nb[B] + d[B]])
    k = int(np.concatenate(rooms).min())
    if k <= 0:
        return 0

    def ok(j: int) -> bool:
        dv = d.copy()
        dv[F] -= j
        dv[B] += j
        return dag.makespan(dv.tolist()) <= T - j

    if ok(k):
        return k
    lo, hi = 0, k  # ok(lo) holds (trivially for 0), ok(hi) fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo
