"""Pipeline schedules as DAGs of microbatch computations.

A node is one computation ``(stage, microbatch, phase)`` with phase ``"fwd"`` or
``"bwd"``. Edges are of two kinds: *data* edges (the forward of microbatch m on stage
s feeds stage s+1; the backward on stage s+1 feeds stage s; the last stage's backward
follows its forward) and *order* edges (each stage runs its computations one at a
time, in the schedule's order). The iteration composer finds the critical path of
this DAG for each choice of per-computation time.

[`one_f_one_b`][kareus.model.one_f_one_b] builds the 1F1B schedule (PipeDream-Flush): stage s runs
``min(pp - s - 1, M)`` warm-up forwards, then alternates one forward and one backward,
then drains the remaining backwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs

from kareus._check import check_count
from kareus.errors import ArgumentError, UnknownPresetError
from kareus.model.dag import Dag

__all__ = ["Computation", "PipelineSchedule", "get_schedule", "one_f_one_b", "gpipe"]


@attrs.frozen(order=True)
class Computation:
    """One microbatch computation on one pipeline stage."""

    stage: int
    microbatch: int
    phase: str

    def __attrs_post_init__(self) -> None:
        if self.phase not in ("fwd", "bwd"):
            raise ArgumentError(f"phase must be 'fwd' or 'bwd', got {self.phase!r}")

    def key(self) -> str:
        """Compact string form, e.g. ``"s0.m3.fwd"`` (used in plan files)."""
        return f"s{self.stage}.m{self.microbatch}.{self.phase}"

    @classmethod
    def from_key(cls, key: str) -> Computation:
        """Parse [`key`][kareus.model.Computation.key] output (``ValueError`` if it is not one)."""
        s, m, phase = key.split(".")
        if not (s.startswith("s") and m.startswith("m")):
            raise ArgumentError(f"not a computation key: {key!r}")
        return cls(int(s[1:]), int(m[1:]), phase)


@attrs.frozen
class PipelineSchedule:
    """A DAG of computations.

    Attributes:
        name: e.g. ``"1f1b"``.
        num_stages: Pipeline stages.
        num_microbatches: Microbatches per iteration.
        stage_orders: For each stage, its computations in execution order.
        edges: ``(u, v)`` pairs: v may start only after u ends (data and order edges).
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_orders: tuple[tuple[Computation, ...], ...]
    edges: tuple[tuple[Computation, Computation], ...]

    @property
    def nodes(self) -> list[Computation]:
        """Every computation, stage by stage in execution order."""
        return [c for order in self.stage_orders for c in order]

    def __iter__(self) -> Iterator[Computation]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return sum(len(o) for o in self.stage_orders)

    def dag(self) -> Dag:
        """The schedule as a [`Dag`][kareus.model.Dag] over node indices (the
        positions in [`nodes`][kareus.model.PipelineSchedule.nodes])."""
        index = {c: i for i, c in enumerate(self.nodes)}
        return Dag(len(index), [(index[u], index[v]) for u, v in self.edges])

    def topological_order(self) -> list[Computation]:
        """Nodes in an order compatible with every edge.

        Raises:
            ValueError: The schedule has a cycle.
        """
        nodes = self.nodes
        try:
            dag = self.dag()
        except ValueError:
            raise ArgumentError(f"schedule {self.name!r} has a cycle") from None
        return [nodes[i] for i in dag.order]

    def makespan(self, durations: Mapping[Computation, float]) -> float:
        """Length of the longest path when each computation takes ``durations[c]``."""
        dag = self.dag()
        nodes = self.nodes
        return float(dag.makespan([float(durations[nodes[i]]) for i in dag.order]))


def _data_edges(pp: int, m: int) -> list[tuple[Computation, Computation]]:
    edges = []
    for mb in range(m):
        for s in range(pp - 1):
            edges.append((Computation(s, mb, "fwd"), Computation(s + 1, mb, "fwd")))
            edges.append((Computation(s + 1, mb, "bwd"), Computation(s, mb, "bwd")))
        edges.append((Computation(pp - 1, mb, "fwd"), Computation(pp - 1, mb, "bwd")))
    return edges


def _build(name: str, pp: int, m: int, orders: list[list[Computation]]) -> PipelineSchedule:
    edges = _data_edges(pp, m)
    for order in orders:
        edges.extend(zip(order[:-1], order[1:]))
    unique = list(dict.fromkeys(edges))
    sched = PipelineSchedule(name=name, num_stages=pp, num_microbatches=m,
                             stage_orders=tuple(tuple(o) for o in orders), edges=tuple(unique))
    sched.topological_order()  # raises on a cycle
    return sched


#: Bounds of a schedule's size: far above any job, low enough that building its DAG ends.
MAX_STAGES = 4096
MAX_MICROBATCHES = 1_000_000


def _check(pp: int, m: int) -> None:
    check_count("num_stages", pp, maximum=MAX_STAGES)
    check_count("num_microbatches", m, maximum=MAX_MICROBATCHES)


def one_f_one_b(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """The 1F1B schedule as a DAG."""
    pp, m = num_stages, num_microbatches
    _check(pp, m)
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        order = [Computation(s, i, "fwd") for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order.append(Computation(s, f, "fwd"))
            f += 1
            order.append(Computation(s, b, "bwd"))
            b += 1
        order.extend(Computation(s, i, "bwd") for i in range(b, m))
        orders.append(order)
    return _build("1f1b", pp, m, orders)


def gpipe(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: all forwards, then all backwards in reverse microbatch order."""
    pp, m = num_stages, num_microbatches
    _check(pp, m)
    orders = [[Computation(s, i, "fwd") for i in range(m)]
              + [Computation(s, i, "bwd") for i in reversed(range(m))] for s in range(pp)]
    return _build("gpipe", pp, m, orders)


_SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def get_schedule(name: str, num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """A schedule by name (``"1f1b"`` or ``"gpipe"``, in any case)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in _SCHEDULES:
        raise UnknownPresetError("pipeline schedule", str(name), sorted(_SCHEDULES))
    return _SCHEDULES[key](num_stages, num_microbatches)
