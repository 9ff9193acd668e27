"""The cheapest assignment at the minimum makespan: the fair short end of a frontier.

Running every node of a DAG at its fastest option gives the minimum makespan ``T*``, but
not the cheapest way to reach it: a node off the critical path has *slack* and can run a
slower, cheaper option without delaying anything. For a pipeline this is the difference
between "every microbatch computation at the maximum clock" and Perseus's energy plan at
the maximum throughput: reporting the former as a frequency-planning system's fastest
point overstates every saving measured against it.

``cheapest_at_min_makespan`` solves ``min sum cost(v)  s.t.  makespan <= T*`` exactly:

1. Every node at its fastest option (the cheapest among options of that exact time) gives
   ``T*``, each node's earliest start ``es`` and latest finish ``lf`` (``T*`` less the
   longest path after it, every node fastest).
2. A node with no slack (``lf - es`` equals its fastest time) keeps its fastest option, and
   its start is pinned: any feasible assignment starts it at ``es``. Pinned nodes
   therefore cut the DAG: nodes with slack connected only through pinned ones never
   constrain each other, so each connected group of slack nodes is solved alone.
3. In a group, nodes are assigned in topological order; an assignment is feasible iff
   every node finishes by its ``lf`` (the latest finish with its descendants fastest:
   necessary because descendants only get slower, sufficient because each descendant
   checks its own). A partial assignment is a *label*: the finish times of the assigned
   nodes that still have an unassigned successor, and the cost so far. A label with no
   larger finish time and no larger cost than another dominates it (every completion of
   the other completes it at no more cost), so only non-dominated labels are kept. This
   is an exact dynamic programme; for pipeline DAGs the labels stay few (the open set is
   a narrow band of the schedule).

Labels multiply with the width of the open set: a group that spans many stages with
hundreds of options per node (a deep pipeline whose stages differ) can hold more labels
than ``max_labels`` or need more work than ``max_work``. Such a group is relaxed greedily
instead, to a fixed point: each node in turn (largest possible saving first) takes the
cheapest option that fits its current slack, until no node can move; the result then says
it is not proven optimal (``exact=False``). It is always feasible and never costlier than
every node at its fastest.

Times are compared with a tolerance of ``1e-12 x T*``, so an option that fills a slack
exactly counts as fitting whatever the floating-point summation order.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from kareus.model.dag import Dag

__all__ = ["FastestSolution", "cheapest_at_min_makespan"]


@attrs.frozen(kw_only=True)
class FastestSolution:
    """The cheapest assignment at the minimum makespan.

    Attributes:
        choices: Option index of every node, in topological positions.
        time_s: Its makespan (the minimum, to ``1e-12`` relative).
        cost: Its total cost.
        fastest_cost: The total cost of every node at its fastest option.
        relaxed: Nodes that run slower than their fastest option.
        groups: Connected groups of slack nodes solved.
        max_labels_seen: The most labels any group held at once.
        exact: Whether every group was solved exactly (none relaxed greedily).
    """

    choices: np.ndarray
    time_s: float
    cost: float
    fastest_cost: float
    relaxed: int
    groups: int
    max_labels_seen: int
    exact: bool


def cheapest_at_min_makespan(dag: Dag, times: Sequence[np.ndarray], costs: Sequence[np.ndarray],
                             *, max_labels: int = 2_000, max_work: int = 30_000_000
                             ) -> FastestSolution:
    """The lowest-cost option per node among assignments of minimum makespan.

    Args:
        dag: The DAG.
        times: Per topological position, the times of that node's options.
        costs: Per topological position, the costs of those options.
        max_labels: Most labels a group may hold for the exact search.
        max_work: Most (label, option) pairs a group's exact search may examine; past
            either limit the group is relaxed greedily instead (``exact`` is ``False``).

    Returns:
        The assignment, its makespan and cost, and how it was found.
    """
    n = dag.num_nodes
    fast = [int(np.lexsort((c, t))[0]) for t, c in zip(times, costs)]
    d0 = [float(times[v][fast[v]]) for v in range(n)]
    c0 = [float(costs[v][fast[v]]) for v in range(n)]
    choices = np.array(fast, dtype=np.int64)
    if n == 0:
        return FastestSolution(choices=choices, time_s=0.0, cost=0.0, fastest_cost=0.0,
                               relaxed=0, groups=0, max_labels_seen=0, exact=True)
    t_star = dag.makespan(d0)
    tol = 1e-12 * abs(t_star)
    es, tail = dag.heads_tails(d0)
    lf = [t_star - tail[v] for v in range(n)]
    slack = [lf[v] - es[v] - d0[v] for v in range(n)]
    free = [s > tol for s in slack]
    # Candidate options of each slack node: cheaper than its fastest and within its slack,
    # Pareto-pruned (time up, cost strictly down); option 0 is the fastest.
    cand: list[list[tuple[float, float, int]]] = []
    for v in range(n):
        opts = [(d0[v], c0[v], fast[v])]
        if free[v]:
            t, c = times[v], costs[v]
            for i in np.lexsort((c, t)).tolist():
                ti, ci = float(t[i]), float(c[i])
                if ti <= d0[v] + slack[v] + tol and ci < opts[-1][1]:
                    opts.append((ti, ci, i))
        cand.append(opts)
    # Groups: slack nodes connected by edges between slack nodes (pinned nodes cut).
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in dag.edges:
        if free[u] and free[v]:
            parent[find(u)] = find(v)
    members: dict[int, list[int]] = {}
    for v in range(n):
        if free[v]:
            members.setdefault(find(v), []).append(v)
    groups = [sorted(m) for m in members.values() if any(len(cand[v]) > 1 for v in m)]
    exact = True
    most = 0
    for g in sorted(groups):
        got = _solve_group(dag, g, cand, es, d0, lf, tol, max_labels, max_work)
        if got is None:
            exact = False
            picks = _relax_greedily(dag, g, cand, d0, t_star, tol)
        else:
            picks, seen = got
            most = max(most, seen)
        for v, i in zip(g, picks):
            choices[v] = cand[v][i][2]
    dur = [float(times[v][choices[v]]) for v in range(n)]
    cost = float(sum(float(costs[v][choices[v]]) for v in range(n)))
    return FastestSolution(choices=choices, time_s=float(dag.makespan(dur)), cost=cost,
                           fastest_cost=float(sum(c0)),
                           relaxed=int(sum(choices[v] != fast[v] for v in range(n))),
                           groups=len(groups), max_labels_seen=most, exact=exact)


def _solve_group(dag: Dag, group: list[int], cand: list[list[tuple[float, float, int]]],
                 es: list[float], d0: list[float], lf: list[float], tol: float,
                 max_labels: int, max_work: int) -> tuple[list[int], int] | None:
    """Label-setting over one group, in topological order; returns each member's pick
    (an index into its candidates) and the most labels held, or ``None`` when the labels
    or the work exceed their limits."""
    inside = set(group)
    pos_in = {v: k for k, v in enumerate(group)}
    # Finish time of pinned predecessors (fixed) -> release time of each member.
    release = []
    for v in group:
        ready = 0.0
        for u in dag.preds[v]:
            if u not in inside:
                ready = max(ready, es[u] + d0[u])
        release.append(ready)
    # After which member each member stops being "open" (its last successor in the group),
    # and the finish below which it makes no difference (its successors' releases).
    last_use = [-1] * len(group)
    floor = [np.inf] * len(group)
    for k, v in enumerate(group):
        for w in dag.succs[v]:
            if w in inside:
                last_use[k] = max(last_use[k], pos_in[w])
                floor[k] = min(floor[k], release[pos_in[w]])
    # Labels: finish times of the open members (columns follow `open_ids`), cost, picks.
    open_ids: list[int] = []
    fin = np.zeros((1, 0))
    cost = np.zeros(1)
    picks = np.zeros((1, 0), dtype=np.int64)
    most = 1
    work = 0
    for k, v in enumerate(group):
        col = [open_ids.index(pos_in[u]) for u in dag.preds[v] if u in inside]
        start = np.full(len(cost), release[k])
        if col:
            start = np.maximum(start, fin[:, col].max(axis=1))
        t = np.array([o[0] for o in cand[v]])
        dc = np.array([o[1] for o in cand[v]]) - cand[v][0][1]
        work += len(start) * len(t) * max(fin.shape[1], 1)
        if work > max_work:
            return None
        r, i = np.nonzero(start[:, None] + t[None, :] <= lf[v] + tol)  # the fastest fits
        fin = np.column_stack([fin[r], np.maximum(start[r] + t[i], floor[k])])
        cost = cost[r] + dc[i]
        picks = np.column_stack([picks[r], i])
        open_ids.append(k)
        keep_cols = [j for j, m in enumerate(open_ids) if last_use[m] > k]
        open_ids = [open_ids[j] for j in keep_cols]
        fin = fin[:, keep_cols]
        if fin.shape[1] > 1 and len(cost) > 4 * max_labels:
            return None
        fin, cost, picks = _prune(fin, cost, picks)
        if len(cost) > max_labels:
            return None
        most = max(most, len(cost))
    best = int(np.argmin(cost))
    return picks[best].tolist(), most


def _prune(fin: np.ndarray, cost: np.ndarray, picks: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-dominated labels (no larger finish anywhere and no larger cost), cheapest first."""
    order = np.lexsort((*fin.T[::-1], cost)) if fin.shape[1] else np.argsort(cost, kind="stable")
    fin, cost, picks = fin[order], cost[order], picks[order]
    if fin.shape[1] == 0:
        return fin[:1], cost[:1], picks[:1]
    if fin.shape[1] == 1:  # a staircase: keep each label that finishes before all cheaper
        f = fin[:, 0]
        first = np.ones(len(f), dtype=bool)
        first[1:] = f[1:] < np.minimum.accumulate(f)[:-1]
        return fin[first], cost[first], picks[first]
    # A label is dominated iff some earlier (no costlier) label finishes no later anywhere;
    # dominance is transitive, so comparing with every earlier label, kept or not, is the
    # same as comparing with the kept ones. Blocks of labels are compared at once.
    kept = np.zeros((0, fin.shape[1]))
    keep = np.zeros(len(cost), dtype=bool)
    block = 256
    for a in range(0, len(cost), block):
        f = fin[a:a + block]
        dom = np.zeros(len(f), dtype=bool)
        for b in range(0, len(kept), 4 * block):
            dom |= np.all(kept[None, b:b + 4 * block] <= f[:, None], axis=2).any(axis=1)
        inner = np.all(f[None, :, :] <= f[:, None, :], axis=2)  # inner[j, i]: i dominates j
        dom |= np.tril(inner, k=-1).any(axis=1)
        keep[a:a + block] = ~dom
        kept = np.vstack([kept, f[~dom]])
    return fin[keep], cost[keep], picks[keep]

def _relax_greedily(dag: Dag, group: list[int], cand: list[list[tuple[float, float, int]]],
                    d0: list[float], t_star: float, tol: float) -> list[int]:
    """Each member in turn takes its cheapest candidate that fits its current slack
    (largest saving first), until none moves; returns each member's pick."""
    dur = list(d0)
    pick = {v: 0 for v in group}
    order = sorted(group, key=lambda v: cand[v][-1][1] - cand[v][0][1])
    moved = True
    while moved:
        moved = False
        for v in order:
            es, tail = dag.heads_tails(dur)
            room = t_star - tail[v] - es[v] + tol
            best = pick[v]
            for i in range(len(cand[v]) - 1, pick[v], -1):
                if cand[v][i][0] <= room:
                    best = i
                    break
            if best != pick[v]:
                pick[v] = best
                dur[v] = cand[v][best][0]
                moved = True
    return [pick[v] for v in group]
