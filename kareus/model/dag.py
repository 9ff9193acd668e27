"""Directed acyclic graphs of timed nodes: topological order and longest paths.

A pipeline schedule (``kareus.model.pipeline``) is a DAG whose nodes are microbatch
computations and whose edges say "v starts after u ends". With a duration per node, the
time of the whole DAG (its *makespan*) is its longest path. The iteration composer
evaluates many longest paths per second, so [`Dag`][kareus.model.Dag] relabels the nodes once in a
topological order (every edge goes from a lower to a higher position) and keeps the
predecessor and successor lists in those positions; longest paths are then one forward
sweep, and a batch of duration vectors is swept at once with numpy, level by level.

Methods that take durations expect them in *topological positions*
(``durations[dag.order]`` converts from node ids); ``Dag.order`` maps back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from kareus.errors import ArgumentError

__all__ = ["Dag"]

_Num = TypeVar("_Num", int, float)


class Dag:
    """A DAG on nodes ``0 .. num_nodes - 1``, relabelled in topological order.

    Args:
        num_nodes: Number of nodes.
        edges: ``(u, v)`` node-id pairs: v starts after u ends.

    Attributes:
        num_nodes: Number of nodes.
        order: Node ids in topological order (``order[position] = node id``).
        pos: Topological position of every node id (``pos[node id] = position``).
        preds: Predecessors of every position, as sorted positions.
        succs: Successors of every position, as sorted positions.
        edges: The edges in positions, in the order given.
        sinks: Positions without successors.

    Raises:
        ValueError: The graph has a cycle.
    """

    def __init__(self, num_nodes: int, edges: Sequence[tuple[int, int]]) -> None:
        n = int(num_nodes)
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
            raise ArgumentError("the graph has a cycle")
        self.num_nodes = n
        self.order = order
        pos = [0] * n
        for i, v in enumerate(order):
            pos[v] = i
        self.pos = np.array(pos, dtype=np.int64)
        self.preds = [sorted(pos[u] for u in preds[v]) for v in order]
        self.succs = [sorted(pos[w] for w in succs[v]) for v in order]
        self.edges = [(pos[u], pos[v]) for u, v in edges]
        # Levels (longest chain of predecessors) for batched longest paths.
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

    def __repr__(self) -> str:
        return f"Dag(num_nodes={self.num_nodes}, edges={len(self.edges)})"

    def makespans(self, durations: np.ndarray) -> np.ndarray:
        """Longest path for each row of a batch of durations.

        Args:
            durations: Shape ``(b, num_nodes)`` (or ``(num_nodes,)``), in topological
                positions.

        Returns:
            Shape ``(b,)``: the longest path of each row.
        """
        dur = np.atleast_2d(durations)
        es = np.zeros_like(dur)
        ef = dur.copy()
        for nodes, src, starts in self._levels:
            es[:, nodes] = np.maximum.reduceat(ef[:, src], starts, axis=1)
            ef[:, nodes] = es[:, nodes] + dur[:, nodes]
        return ef[:, self.sinks].max(axis=1)

    def makespan(self, durations: Sequence[_Num]) -> _Num:
        """Longest path for one duration per node (topological positions).

        Integer durations (time units) give an exact integer; float durations a float.
        """
        ef: list[_Num] = [0] * self.num_nodes
        for v in range(self.num_nodes):
            m: _Num = 0
            for u in self.preds[v]:
                if ef[u] > m:
                    m = ef[u]
            ef[v] = m + durations[v]
        return max(ef)

    def heads_tails(self, durations: Sequence[_Num]) -> tuple[list[_Num], list[_Num]]:
        """Earliest start of every node, and the longest path after its end.

        Args:
            durations: One duration per node, in topological positions.

        Returns:
            ``(heads, tails)`` in topological positions; a node is on a longest path when
            ``heads[v] + durations[v] + tails[v]`` equals the makespan.
        """
        n = self.num_nodes
        es: list[_Num] = [0] * n
        for v in range(n):
            m: _Num = 0
            for u in self.preds[v]:
                x = es[u] + durations[u]
                if x > m:
                    m = x
            es[v] = m
        tail: list[_Num] = [0] * n
        for v in range(n - 1, -1, -1):
            m = 0
            for w in self.succs[v]:
                x = durations[w] + tail[w]
                if x > m:
                    m = x
            tail[v] = m
        return es, tail
