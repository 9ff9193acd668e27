"""Iteration composition: microbatch frontiers -> the iteration frontier over the pipeline DAG.

Each node of the pipeline DAG (:mod:`kareus.model.pipeline`) is one microbatch
computation and can run at any point of its :class:`MicrobatchFrontier`: a time and a
dynamic energy. The iteration time is the DAG's longest path; the iteration energy is
the dynamic energy of every computation plus static power x iteration time x every GPU
(GPUs idle in pipeline bubbles still draw static power, which is why shortening the
critical path saves static energy). The composer traces the trade-off between the two,
as Perseus does, with the time-cost trade-off algorithm of Phillips and Dessouky:

1. Time is counted in integer units. The unit comes from the data: ``resolution`` x the
   shortest time any computation can take (default 1/100 of it), unless ``unit_s`` is
   given. Each computation's points are rounded to units; per unit time only the
   cheapest point is kept, and the cost between points is the lower convex hull (the
   algorithm needs convex costs).
2. Start from the lowest-energy point of every computation.
3. Repeat: on the *critical* sub-graph (computations and edges on a longest path), find
   the cheapest set of computations to speed up by one unit (and, possibly, others to
   slow down by one unit) so that every critical path gets one unit shorter. This is a
   minimum s-t cut in which speeding up costs the hull's slope to the left and slowing
   down earns the slope to the right (arc lower bounds); see :mod:`kareus.compose._flow`.
4. Stop when some critical path cannot get shorter.

Each step's durations are *realised* by running every computation at the slowest of
its points that fits its planned duration, and the realised plan's time and energy are
evaluated exactly from real (unrounded) durations; the frontier is the Pareto set of
the realised plans. Reported times and energies are therefore exact, whatever the unit.

Speed: a minimum cut keeps its cost for as long as every computation it speeds up
stays on the same hull segment, every one it slows down stays on its segment, and no
path outside the critical sub-graph becomes critical. We take all those unit steps at
once (checking the last condition by evaluating the longest path, and backing off by
bisection when it fails), which gives the same frontier as one unit per cut in far
fewer cuts. The realised plan changes only where some moving computation crosses one of
its points, so only those steps are evaluated.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kareus.compose._flow import min_cut_lower_bounds
from kareus.compose.base import FrontierComposer
from kareus.compose.frontiers import IterationFrontier, IterationPoint, MicrobatchFrontier
from kareus.compose.plan import MicrobatchChoice, Plan
from kareus.model.pipeline import Computation, PipelineSchedule, one_f_one_b
from kareus.search.pareto import pareto_mask

__all__ = ["IterationComposer", "TimeCostResult", "evaluate_plan", "solve_time_cost"]


# ----------------------------------------------------------------------------- DAG helpers


class _Dag:
    """A DAG relabelled in topological order, with list and numpy views for longest paths."""

    def __init__(self, n: int, edges: Sequence[tuple[int, int]]) -> None:
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        for u, v in edges:
            preds[v].append(u)
            succs[u].append(v)
        indeg = [len(p) for p in preds]
        ready = [v for v in range(n) if indeg[v] == 0]
        order: list[int] = []
        while ready:
            u = ready.pop()
            order.append(u)
            for v in succs[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if len(order) != n:
            raise ValueError("the graph has a cycle")
        self.n = n
        self.order = order  # topological order of original ids
        pos = [0] * n
        for i, v in enumerate(order):
            pos[v] = i
        self.pos = np.array(pos, dtype=np.int64)
        # Everything below is in topological positions.
        self.preds = [sorted(pos[u] for u in preds[v]) for v in order]
        self.succs = [sorted(pos[w] for w in succs[v]) for v in order]
        self.edges = [(pos[u], pos[v]) for u, v in edges]
        # Levels for batched (numpy) longest paths.
        level = [0] * n
        for v in range(n):
            for u in self.preds[v]:
                level[v] = max(level[v], level[u] + 1)
        self._levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        by_level: dict[int, list[int]] = {}
        for v in range(n):
            if self.preds[v]:
                by_level.setdefault(level[v], []).append(v)
        for lv in sorted(by_level):
            nodes = by_level[lv]
            src: list[int] = []
            starts: list[int] = []
            for v in nodes:
                starts.append(len(src))
                src.extend(self.preds[v])
            self._levels.append((np.array(nodes), np.array(src), np.array(starts)))
        self.sinks = np.array([v for v in range(n) if not self.succs[v]])

    def makespans(self, dur: np.ndarray) -> np.ndarray:
        """Longest path of each row of ``dur`` (shape ``(b, n)``, topological positions)."""
        dur = np.atleast_2d(dur)
        es = np.zeros_like(dur)
        ef = dur.copy()
        for nodes, src, starts in self._levels:
            es[:, nodes] = np.maximum.reduceat(ef[:, src], starts, axis=1)
            ef[:, nodes] = es[:, nodes] + dur[:, nodes]
        return ef[:, self.sinks].max(axis=1)

    def makespan(self, d: list[int]) -> int:
        """Longest path with integer durations ``d`` (topological positions)."""
        ef = [0] * self.n
        for v in range(self.n):
            m = 0
            for u in self.preds[v]:
                if ef[u] > m:
                    m = ef[u]
            ef[v] = m + d[v]
        return max(ef)

    def heads_tails(self, d: list[int]) -> tuple[list[int], list[int]]:
        """Earliest start and longest tail after the end of every node (integer durations)."""
        n = self.n
        es = [0] * n
        for v in range(n):
            m = 0
            for u in self.preds[v]:
                x = es[u] + d[u]
                if x > m:
                    m = x
            es[v] = m
        tail = [0] * n
        for v in range(n - 1, -1, -1):
            m = 0
            for w in self.succs[v]:
                x = d[w] + tail[w]
                if x > m:
                    m = x
            tail[v] = m
        return es, tail


class _WarmCut:
    """Minimum cuts of successive critical networks, warm-started from the previous flow.

    The network is the whole DAG in activity-on-arc form (node v = arc 2v -> 2v+1, each
    DAG edge a dummy arc, plus source and sink arcs), built once. Each call switches on
    the arcs of the current critical sub-graph, sets their bounds, clamps the previous
    flow into them (repairing the few imbalances this causes with augmenting paths),
    then augments from s to t. Between consecutive steps of the trade-off almost every
    arc keeps a feasible flow (a computation sped up sits at its upper bound, whose new
    lower bound is that same slope), so few augmenting paths are needed per cut.

    Written here, not taken from a library: kareus's run-time dependencies are closed
    (numpy, attrs, xgboost, nvidia-ml-py); scipy and networkx are not among them.
    """

    def __init__(self, dag: _Dag, big: float, eps: float) -> None:
        n = dag.n
        self.n, self.big, self.eps = n, big, eps
        self.s, self.t = 2 * n, 2 * n + 1
        frm: list[int] = []
        to: list[int] = []
        for v in range(n):  # op arcs: ids 0 .. n-1
            frm.append(2 * v)
            to.append(2 * v + 1)
        self.edge_arc0 = len(frm)
        for u, v in dag.edges:
            frm.append(2 * u + 1)
            to.append(2 * v)
        self.src_arcs: list[tuple[int, int]] = []
        self.sink_arcs: list[tuple[int, int]] = []
        for v in range(n):
            if not dag.preds[v]:
                self.src_arcs.append((len(frm), v))
                frm.append(self.s)
                to.append(2 * v)
            if not dag.succs[v]:
                self.sink_arcs.append((len(frm), v))
                frm.append(2 * v + 1)
                to.append(self.t)
        A = len(frm)
        self.frm, self.to = frm, to
        self.x = [0.0] * A
        self.lb = [0.0] * A
        self.ub = [big] * A
        self.active = [False] * A
        self.out_adj: list[list[int]] = [[] for _ in range(2 * n + 2)]
        self.in_adj: list[list[int]] = [[] for _ in range(2 * n + 2)]
        for a in range(A):
            self.out_adj[frm[a]].append(a)
            self.in_adj[to[a]].append(a)
        self.edges = dag.edges

    # Residual search: returns parent pointers (arc, direction) of the BFS tree.
    def _bfs(self, starts: list[int], targets: set[int] | None, stop: int | None
             ) -> tuple[list[int], int | None]:
        """Breadth-first search in the residual network; ``par[w]`` = arc id + 1 (reached
        forward) or -(arc id + 1) (reached backward), 0 for a start, None for unreached."""
        x, lb, ub, active, eps = self.x, self.lb, self.ub, self.active, self.eps
        frm, to, out_adj, in_adj = self.frm, self.to, self.out_adj, self.in_adj
        par: list = [None] * (2 * self.n + 2)
        for w in starts:
            par[w] = 0
        q = deque(starts)
        tg = targets if targets is not None else ()
        while q:
            w = q.popleft()
            for a in out_adj[w]:
                if active[a]:
                    z = to[a]
                    if par[z] is None and ub[a] - x[a] > eps:
                        par[z] = a + 1
                        if z == stop or z in tg:
                            return par, z
                        q.append(z)
            for a in in_adj[w]:
                if active[a]:
                    z = frm[a]
                    if par[z] is None and x[a] - lb[a] > eps:
                        par[z] = -(a + 1)
                        if z == stop or z in tg:
                            return par, z
                        q.append(z)
        return par, None

    def _path(self, par: list, end: int) -> list[tuple[int, int]]:
        path = []
        w = end
        while par[w]:
            p = par[w]
            if p > 0:
                a = p - 1
                path.append((a, 1))
                w = self.frm[a]
            else:
                a = -p - 1
                path.append((a, -1))
                w = self.to[a]
        return path

    def _residual(self, a: int, sgn: int) -> float:
        return self.ub[a] - self.x[a] if sgn == 1 else self.x[a] - self.lb[a]

    def _push(self, path: list[tuple[int, int]], f: float) -> None:
        for a, sgn in path:
            self.x[a] += f * sgn

    def cut(self, crit: list[bool], es: list[int], dl: list[int],
            lb_node: list[float], ub_node: list[float]) -> list[bool] | None:
        """Source side (per AOA node) of a minimum cut, or None (no feasible flow / unbounded)."""
        n, eps, big = self.n, self.eps, self.big
        x, lb, ub, active, frm, to = self.x, self.lb, self.ub, self.active, self.frm, self.to
        excess: dict[int, float] = {}

        def setx(a: int, new: float) -> None:
            delta = new - x[a]
            if delta != 0.0:
                x[a] = new
                excess[to[a]] = excess.get(to[a], 0.0) + delta
                excess[frm[a]] = excess.get(frm[a], 0.0) - delta

        for v in range(n):
            if crit[v]:
                active[v] = True
                lb[v], ub[v] = lb_node[v], ub_node[v]
                if x[v] < lb[v]:
                    setx(v, lb[v])
                elif x[v] > ub[v]:
                    setx(v, ub[v])
            else:
                active[v] = False
                if x[v] != 0.0:
                    setx(v, 0.0)
        a = self.edge_arc0
        for u, v in self.edges:
            on = crit[u] and crit[v] and es[u] + dl[u] == es[v]
            active[a] = on
            if not on and x[a] != 0.0:
                setx(a, 0.0)
            a += 1
        for a, v in self.src_arcs:
            active[a] = crit[v]
            if not crit[v] and x[a] != 0.0:
                setx(a, 0.0)
        for a, v in self.sink_arcs:
            active[a] = crit[v]
            if not crit[v] and x[a] != 0.0:
                setx(a, 0.0)
        # Repair imbalances (s and t are free: they absorb and supply any amount).
        excess.pop(self.s, None)
        excess.pop(self.t, None)
        for w in [w for w, e in excess.items() if e > eps]:
            while excess.get(w, 0.0) > eps:
                deficits = {z for z, e in excess.items() if e < -eps}
                parent, end = self._bfs([w], deficits | {self.s, self.t}, None)
                if end is None:
                    return None
                path = self._path(parent, end)
                f = min([excess[w]] + [self._residual(a, sg) for a, sg in path])
                if end in deficits:
                    f = min(f, -excess[end])
                self._push(path, f)
                excess[w] -= f
                if end in excess:
                    excess[end] += f
        for z in [z for z, e in excess.items() if e < -eps]:
            while excess.get(z, 0.0) < -eps:
                parent, end = self._bfs([self.s, self.t], {z}, None)
                if end is None:
                    return None
                path = self._path(parent, end)
                f = min([-excess[z]] + [self._residual(a, sg) for a, sg in path])
                self._push(path, f)
                excess[z] += f
        # Augment s -> t.
        while True:
            parent, end = self._bfs([self.s], None, self.t)
            if end is None:
                break
            path = self._path(parent, end)
            f = min(self._residual(a, sg) for a, sg in path)
            if f >= big / 2:
                return None  # unbounded: some critical path cannot get shorter
            self._push(path, f)
        return [p is not None for p in parent]


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
    """

    choices: np.ndarray
    times_s: np.ndarray
    costs: np.ndarray
    unit_s: float
    cuts: int
    steps: int


def solve_time_cost(num_nodes: int, edges: Sequence[tuple[int, int]],
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
        raise ValueError(f"unit_s must be positive, got {unit_s}")
    dag = _Dag(num_nodes, edges)
    n = num_nodes
    types_pos = np.asarray(node_type, dtype=np.int64)[dag.order]  # type of node at position
    opt_t = [np.asarray(t, dtype=np.float64) for t, _ in options]
    opt_c = [np.asarray(c, dtype=np.float64) for _, c in options]
    if any(len(t) == 0 for t in opt_t):
        raise ValueError("every option set needs at least one option")
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
    warm = _WarmCut(dag, big, 1e-9 * scale) if warm_start else None

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

    # The all-fastest assignment bounds the frontier's short end exactly; the discretised
    # walk can stop a few time units short of it (a unit is a fraction of the shortest
    # computation), so it is always offered to the Pareto filter too.
    fastest_opt = [int(np.lexsort((c, t))[0]) for t, c in zip(opt_t, opt_c)]
    record(np.array([fastest_opt[k] for k in types_pos], dtype=np.int64)[None, :])

    # Back to original node ids.
    choices = np.array(records_choice, dtype=np.int64).reshape(-1, n)
    out = np.empty_like(choices)
    out[:, np.asarray(dag.order)] = choices
    return TimeCostResult(choices=out, times_s=np.array(records_t), costs=np.array(records_c),
                          unit_s=float(unit_s), cuts=cuts, steps=steps)


def _advance(dag: _Dag, d: np.ndarray, F: np.ndarray, B: np.ndarray, T: int,
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


# ----------------------------------------------------------------------------- composer


class IterationComposer(FrontierComposer):
    """Composes microbatch frontiers into the iteration frontier over a pipeline schedule.

    Args:
        unit_s: Time unit of the discretisation; ``None`` = ``resolution`` x the shortest
            time any microbatch computation can take.
        resolution: Fraction of the shortest computation used as the unit when ``unit_s``
            is ``None``.
    """

    def __init__(self, *, unit_s: float | None = None, resolution: float | None = None) -> None:
        if unit_s is not None and not unit_s > 0:
            raise ValueError(f"unit_s must be positive, got {unit_s}")
        self.unit_s = unit_s
        self.resolution = 0.01 if resolution is None else float(resolution)
        if not 0 < self.resolution <= 1:
            raise ValueError(f"resolution must be in (0, 1], got {self.resolution}")

    def __repr__(self) -> str:
        return f"IterationComposer(unit_s={self.unit_s}, resolution={self.resolution})"

    def compose(self, frontiers: Mapping[tuple[int, str], MicrobatchFrontier], /, *,  # type: ignore[override]
                static_power_w: float, gpu: str, schedule: PipelineSchedule | None = None,
                num_microbatches: int | None = None, label: str = "",
                workload: dict[str, Any] | None = None) -> IterationFrontier:
        """The iteration frontier.

        Args:
            frontiers: ``(stage, phase)`` -> that computation's microbatch frontier.
            static_power_w: Static power of every GPU of the job together.
            gpu: GPU preset name (recorded in plans).
            schedule: The pipeline DAG; ``None`` = 1F1B over the stages of ``frontiers``
                and ``num_microbatches`` microbatches.
            num_microbatches: Needed when ``schedule`` is ``None``.
            label: Recorded in the frontier and its plans (e.g. ``"kareus"``).
            workload: Workload description recorded in plans.
        """
        t_start = time.perf_counter()
        if schedule is None:
            if num_microbatches is None:
                raise ValueError("give schedule= or num_microbatches=")
            pp = 1 + max(s for s, _ in frontiers)
            schedule = one_f_one_b(pp, int(num_microbatches))
        if not isinstance(schedule, PipelineSchedule):
            raise TypeError(f"schedule must be a PipelineSchedule, got {type(schedule).__name__}")
        if static_power_w < 0:
            raise ValueError("static_power_w must be >= 0")
        nodes = schedule.nodes
        index = {c: i for i, c in enumerate(nodes)}
        keys = sorted({(c.stage, c.phase) for c in nodes})
        missing = [k for k in keys if k not in frontiers or not frontiers[k].points]
        if missing:
            raise ValueError(f"no microbatch frontier (or an empty one) for {missing}")
        tkey = {k: i for i, k in enumerate(keys)}
        node_type = [tkey[(c.stage, c.phase)] for c in nodes]
        mpts = [frontiers[k].points for k in keys]
        options = [([p.time_s for p in pts], [p.dynamic_energy_j for p in pts]) for pts in mpts]
        unit = self.unit_s
        if unit is None:
            shortest = min(p.time_s for pts in mpts for p in pts)
            if shortest <= 0:
                raise ValueError("microbatch computations must take positive time")
            unit = shortest * self.resolution
        edges = [(index[u], index[v]) for u, v in schedule.edges]
        res = solve_time_cost(len(nodes), edges, node_type, options, unit)
        total = res.costs + static_power_w * res.times_s
        # Pareto filter before building plans.
        pts_arr = np.column_stack([res.times_s, total])
        mask = pareto_mask(pts_arr)
        points: list[IterationPoint] = []
        for r in np.nonzero(mask)[0].tolist():
            row = res.choices[r]
            used: dict[MicrobatchChoice, int] = {}
            assignment: dict[str, int] = {}
            for c, i in zip(nodes, row.tolist()):
                ch = mpts[node_type[index[c]]][i].choice
                assignment[c.key()] = used.setdefault(ch, len(used))
            plan = Plan(gpu=gpu, schedule=schedule.name, num_stages=schedule.num_stages,
                        num_microbatches=schedule.num_microbatches, choices=list(used),
                        assignment=assignment, time_s=float(res.times_s[r]),
                        energy_j=float(total[r]), dynamic_energy_j=float(res.costs[r]),
                        static_power_w=float(static_power_w), label=label, workload=workload)
            points.append(IterationPoint(time_s=plan.time_s, energy_j=plan.energy_j, plan=plan))
        stats = {"unit_s": res.unit_s, "cuts": res.cuts, "unit_steps": res.steps,
                 "realised_plans": len(res.times_s), "computations": len(nodes),
                 "wall_s": time.perf_counter() - t_start}
        return IterationFrontier.from_points(points, label=label, stats=stats)


def evaluate_plan(plan: Plan, *, frontiers: Mapping[str, Any], partitions: Any,
                  outside: Mapping[tuple[int, str], Mapping[int, Any]] | None,
                  static_power_w: float, energy_scale: float | None = None,
                  schedule: PipelineSchedule | None = None) -> tuple[float, float, float]:
    """Re-evaluate a plan from its parts: partition measurements, counts and outside work.

    Each computation's time is ``sum count x partition time + outside time`` at its
    frequency and configurations (the partition observations are looked up by
    configuration in ``frontiers``); the iteration time is the schedule's longest path;
    the energy is every computation's dynamic energy (scaled by ``energy_scale``, default
    the DP degree) plus ``static_power_w`` x time.

    Returns:
        ``(time_s, energy_j, dynamic_energy_j)``.
    """
    scale = (float(partitions.workload.parallelism.dp) if energy_scale is None
             else float(energy_scale))
    if schedule is None:
        schedule = one_f_one_b(plan.num_stages, plan.num_microbatches)
    lookup: dict[tuple[str, Any], Any] = {}
    for tname, pf in frontiers.items():
        for o in reversed(pf.observations):
            lookup[(tname, o.config)] = o
        for f in {o.config.freq_mhz for o in pf.observations}:
            # The observations composition uses: measured front points first, predicted
            # ones only for configurations without a measured front point.
            for o in pf.front_at(f, include_predicted=True):
                lookup[(tname, o.config)] = o
            for o in pf.front_at(f):
                lookup[(tname, o.config)] = o
    durations: dict[Computation, float] = {}
    dyn = 0.0
    for c in schedule.nodes:
        ch = plan.choice(c)
        t = e = 0.0
        for tname, count in partitions.counts[c.phase].items():
            if count <= 0:
                continue
            o = lookup[(tname, ch.config(tname))]
            t += count * o.time_s
            e += count * o.dynamic_energy_j
        if outside is not None:
            m = outside[(c.stage, c.phase)][ch.freq_mhz]
            t += m.time_s
            e += m.dynamic_energy_j
        durations[c] = t
        dyn += e * scale
    time_s = schedule.makespan(durations)
    return time_s, dyn + static_power_w * time_s, dyn
