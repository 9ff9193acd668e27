"""Maximum flow and minimum cuts, with lower bounds on arc flows.

The iteration composer needs a minimum s-t cut of a small network at every step of the
time-cost trade-off. Written here (Dinic's algorithm on plain Python lists) rather than
taken from a library because none of kareus's run-time dependencies offers it for these
networks: scipy's ``csgraph.maximum_flow`` takes integer capacities only, and networkx is
not a dependency. The networks are small (the critical
sub-graph of a pipeline DAG), where Dinic's BFS levels plus blocking flows are fast.

A cut ``(S, T)`` of a network whose arcs carry lower bounds ``lb`` and upper bounds
``ub`` has capacity ``sum ub(S -> T arcs) - sum lb(T -> S arcs)``; the minimum is found
as the maximum feasible flow (Hoffman): first a feasible flow from the lower bounds
(excesses routed from a super source to a super sink, with a t -> s arc of unbounded
capacity), then augment s -> t in the residual network, and the nodes reachable from s
in the final residual network form S.

Two solvers: ``min_cut_lower_bounds`` builds a network and cuts it from scratch
(simple; the reference in tests), and ``WarmCut`` keeps one network for the whole
pipeline DAG and computes the minimum cut of each successive critical sub-graph from the
previous flow (what [`solve_time_cost`][kareus.compose.solve_time_cost] uses by default).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kareus.model.dag import Dag

__all__ = ["FlowNetwork", "WarmCut", "min_cut_lower_bounds"]


class FlowNetwork:
    """A residual network for Dinic's maximum-flow algorithm.

    Arcs are stored in pairs: arc ``e`` and its reverse ``e ^ 1``.
    """

    def __init__(self, num_nodes: int, eps: float = 1e-12) -> None:
        self.n = num_nodes
        self.eps = eps
        self.adj: list[list[int]] = [[] for _ in range(num_nodes)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add_arc(self, u: int, v: int, cap: float) -> int:
        """Add arc u -> v with capacity ``cap``; returns its id."""
        e = len(self.to)
        self.to.append(v)
        self.cap.append(float(cap))
        self.to.append(u)
        self.cap.append(0.0)
        self.adj[u].append(e)
        self.adj[v].append(e + 1)
        return e

    def _levels(self, s: int) -> list[int]:
        level = [-1] * self.n
        level[s] = 0
        q = deque([s])
        to, cap, adj, eps = self.to, self.cap, self.adj, self.eps
        while q:
            u = q.popleft()
            lu = level[u] + 1
            for e in adj[u]:
                v = to[e]
                if level[v] < 0 and cap[e] > eps:
                    level[v] = lu
                    q.append(v)
        return level

    def _blocking_flow(self, s: int, t: int, level: list[int]) -> float:
        to, cap, adj, eps = self.to, self.cap, self.adj, self.eps
        it = [0] * self.n
        path: list[int] = []
        total = 0.0
        u = s
        while True:
            if u == t:
                f = min(cap[e] for e in path)
                total += f
                cut = len(path)
                for i, e in enumerate(path):
                    cap[e] -= f
                    cap[e ^ 1] += f
                    if cut == len(path) and cap[e] <= eps:
                        cut = i
                del path[cut:]
                u = to[path[-1]] if path else s
                continue
            a = adj[u]
            i = it[u]
            nxt = -1
            lu = level[u] + 1
            while i < len(a):
                e = a[i]
                if cap[e] > eps and level[to[e]] == lu:
                    nxt = e
                    break
                i += 1
            it[u] = i
            if nxt < 0:
                if u == s:
                    return total
                level[u] = -1  # dead end: never visit again in this phase
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1
                continue
            path.append(nxt)
            u = to[nxt]

    def max_flow(self, s: int, t: int) -> float:
        """Augment a maximum flow from s to t; returns the flow added."""
        total = 0.0
        while True:
            level = self._levels(s)
            if level[t] < 0:
                return total
            total += self._blocking_flow(s, t, level)

    def reachable(self, s: int) -> list[bool]:
        """Nodes reachable from s through arcs with residual capacity."""
        return [lv >= 0 for lv in self._levels(s)]


def min_cut_lower_bounds(num_nodes: int, arcs: Sequence[tuple[int, int, float, float]],
                         s: int, t: int, *, big: float, eps: float = 1e-12
                         ) -> list[bool] | None:
    """Source side of a minimum s-t cut of a network with lower and upper arc bounds.

    Args:
        num_nodes: Nodes ``0 .. num_nodes - 1``.
        arcs: ``(u, v, lb, ub)`` with ``0 <= lb <= ub``; use ``big`` for an unbounded arc.
        s, t: Source and sink.
        big: The capacity standing for "unbounded".
        eps: Residual capacities at or below it count as zero.

    Returns:
        ``in_s[v]`` for every node, or ``None`` when no feasible flow exists.
    """
    ss, tt = num_nodes, num_nodes + 1
    net = FlowNetwork(num_nodes + 2, eps)
    excess = [0.0] * num_nodes
    for u, v, lb, ub in arcs:
        net.add_arc(u, v, max(ub - lb, 0.0))
        if lb > 0:
            excess[v] += lb
            excess[u] -= lb
    back = net.add_arc(t, s, big)
    need = 0.0
    for v, x in enumerate(excess):
        if x > eps:
            net.add_arc(ss, v, x)
            need += x
        elif x < -eps:
            net.add_arc(v, tt, -x)
    if need > 0:
        got = net.max_flow(ss, tt)
        if got < need - max(eps, 1e-9 * need):
            return None
    # Drop the t -> s arc (its flow is part of the s-t flow) and maximise s -> t.
    net.cap[back] = 0.0
    net.cap[back ^ 1] = 0.0
    net.max_flow(s, t)
    return net.reachable(s)[:num_nodes]


class WarmCut:
    """Minimum cuts of successive critical networks, warm-started from the previous flow.

    The network is the whole DAG in activity-on-arc form (node v = arc 2v -> 2v+1, each
    DAG edge a dummy arc, plus source and sink arcs), built once. Each call switches on
    the arcs of the current critical sub-graph, sets their bounds, clamps the previous
    flow into them (repairing the few imbalances this causes with augmenting paths),
    then augments from s to t. Between consecutive steps of the trade-off almost every
    arc keeps a feasible flow (a computation sped up sits at its upper bound, whose new
    lower bound is that same slope), so few augmenting paths are needed per cut.

    Args:
        dag: The DAG whose critical sub-graphs are cut.
        big: Capacity standing for "unbounded".
        eps: Flows below this are zero.
    """

    def __init__(self, dag: Dag, big: float, eps: float) -> None:
        n = dag.num_nodes
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

    def cut(self, crit: list[bool], es: list[int], dl: list[int],  # noqa: C901 - one min-cut's inner loop over local aliases; split, it loses the speed it exists for
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
