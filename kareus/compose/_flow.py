"""Maximum flow and minimum cuts, with lower bounds on arc flows.

The iteration composer needs a minimum s-t cut of a small network at every step of the
time-cost trade-off. Written here (Dinic's algorithm on plain Python lists) rather than
taken from a library because kareus's run-time dependencies are closed: numpy, attrs,
xgboost and nvidia-ml-py, no scipy and no networkx. The networks are small (the critical
sub-graph of a pipeline DAG), where Dinic's BFS levels plus blocking flows are fast.

A cut ``(S, T)`` of a network whose arcs carry lower bounds ``lb`` and upper bounds
``ub`` has capacity ``sum ub(S -> T arcs) - sum lb(T -> S arcs)``; the minimum is found
as the maximum feasible flow (Hoffman): first a feasible flow from the lower bounds
(excesses routed from a super source to a super sink, with a t -> s arc of unbounded
capacity), then augment s -> t in the residual network, and the nodes reachable from s
in the final residual network form S.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["FlowNetwork", "min_cut_lower_bounds"]


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
