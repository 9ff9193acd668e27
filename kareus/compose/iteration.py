"""Iteration composition: microbatch frontiers -> the iteration frontier over the pipeline DAG.

Each node of the pipeline DAG (``kareus.model.pipeline``) is one microbatch
computation and can run at any point of its
[`MicrobatchFrontier`][kareus.compose.MicrobatchFrontier]: a time and a dynamic energy. The
iteration time is the DAG's longest path; the iteration energy is the dynamic energy of every
computation plus static power x iteration time x every GPU (GPUs idle in pipeline bubbles still draw
static power, which is why shortening the critical path saves static energy). Work once per
iteration after the pipeline flush (the optimizer step, the data-parallel gradient reduction) is a
``tail`` added to every plan. The composer traces the trade-off between the two, as Perseus
(SOSP'24) does, with the time-cost trade-off algorithm of Phillips and Dessouky
([`solve_time_cost`][kareus.compose.solve_time_cost], in ``kareus.compose._time_cost``).

The frontier's short end is the lowest-energy plan at the minimum iteration time, not
every computation at its fastest point: computations off the critical path run slower
(cheaper) points within their slack, the same time for less energy
(``kareus.compose._fastest``; exact, except for a large slack group, which it relaxes
greedily and says so in ``stats["fastest"]``). Every system composed here, Perseus's
included, gets the same treatment, so no system's maximum-throughput row is inflated.

The time unit comes from the data: ``resolution`` x the shortest time any computation
can take (default 1/100 of it), unless ``unit_s`` is given. The solver's realised
solutions carry exact (unrounded) times and energies; the composer keeps their Pareto
set and turns each into a [`Plan`][kareus.compose.Plan].
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kareus._check import check_number
from kareus.compose._time_cost import solve_time_cost
from kareus.compose.composer import FrontierComposer
from kareus.compose.context import IterationContext, _from_keywords
from kareus.compose.iteration_frontier import IterationFrontier, IterationPoint
from kareus.compose.microbatch_frontier import MicrobatchFrontier
from kareus.compose.plan import MicrobatchChoice, Plan
from kareus.errors import ArgumentError
from kareus.model.pipeline import one_f_one_b
from kareus.search.pareto import pareto_mask

__all__ = ["IterationComposer"]


class IterationComposer(FrontierComposer[Mapping[tuple[int, str], MicrobatchFrontier],
                                         IterationContext, IterationFrontier]):
    """Composes microbatch frontiers into the iteration frontier over a pipeline schedule.

    Args:
        unit_s: Time unit of the discretisation; ``None`` = ``resolution`` x the shortest
            time any microbatch computation can take.
        resolution: Fraction of the shortest computation used as the unit when ``unit_s``
            is ``None``.
    """

    def __init__(self, *, unit_s: float | None = None, resolution: float | None = None) -> None:
        if unit_s is not None:
            unit_s = check_number("unit_s", unit_s, positive=True)
        self.unit_s = unit_s
        self.resolution = 0.01 if resolution is None else check_number("resolution", resolution)
        if not 0 < self.resolution <= 1:
            raise ArgumentError(f"resolution must be in (0, 1], got {self.resolution}")

    def __repr__(self) -> str:
        return f"IterationComposer(unit_s={self.unit_s}, resolution={self.resolution})"

    def compose(self, frontiers: Mapping[tuple[int, str], MicrobatchFrontier],
                context: IterationContext | None = None, /, **fields: Any) -> IterationFrontier:
        """The iteration frontier.

        Args:
            frontiers: ``(stage, phase)`` -> that computation's microbatch frontier.
            context: The static power of every GPU of the job together, the GPU (recorded in
                plans), the pipeline DAG, the per-iteration tail (its time is added to every
                plan's iteration time and its dynamic energy to every plan's; ``None``:
                none), the label and workload recorded in plans
                ([`IterationContext`][kareus.compose.IterationContext]).
            **fields: Deprecated: the context's fields as keywords (``static_power_w=...,
                gpu=..., schedule=...``), as earlier releases took them; there ``schedule``
                may be left out for 1F1B over ``num_microbatches=`` microbatches.

        Returns:
            The Pareto-optimal plans, fastest first; ``stats`` records the time unit, the
            cuts and unit steps taken, the realised plans and the wall time.

        Raises:
            ValueError: a computation of the schedule has no (or an empty) frontier.
            TypeError: a context that is not an IterationContext.
        """
        t_start = time.perf_counter()
        if context is None:  # earlier releases' keywords: 1F1B over num_microbatches
            count = fields.pop("num_microbatches", None)
            if fields.get("schedule") is None:
                if count is None:
                    raise ArgumentError("give schedule= or num_microbatches=")
                fields["schedule"] = one_f_one_b(1 + max(s for s, _ in frontiers), int(count))
        ctx: IterationContext = _from_keywords(IterationContext, context, fields,
                                               "IterationComposer")
        schedule, tail, label = ctx.schedule, ctx.tail, ctx.label
        static_power_w, gpu, workload = ctx.static_power_w, ctx.gpu, ctx.workload
        nodes = schedule.nodes
        index = {c: i for i, c in enumerate(nodes)}
        keys = sorted({(c.stage, c.phase) for c in nodes})
        missing = [k for k in keys if k not in frontiers or not frontiers[k].points]
        if missing:
            raise ArgumentError(f"no microbatch frontier (or an empty one) for {missing}")
        tkey = {k: i for i, k in enumerate(keys)}
        node_type = [tkey[(c.stage, c.phase)] for c in nodes]
        mpts = [frontiers[k].points for k in keys]
        options = [([p.time_s for p in pts], [p.dynamic_energy_j for p in pts]) for pts in mpts]
        unit = self.unit_s
        if unit is None:
            shortest = min(p.time_s for pts in mpts for p in pts)
            if shortest <= 0:
                raise ArgumentError("microbatch computations must take positive time")
            unit = shortest * self.resolution
        edges = [(index[u], index[v]) for u, v in schedule.edges]
        res = solve_time_cost(len(nodes), edges, node_type, options, unit)
        times = res.times_s + (tail.time_s if tail is not None else 0.0)
        costs = res.costs + (tail.dynamic_energy_j if tail is not None else 0.0)
        total = costs + static_power_w * times
        # Pareto filter before building plans.
        pts_arr = np.column_stack([times, total])
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
                        assignment=assignment, time_s=float(times[r]),
                        energy_j=float(total[r]), dynamic_energy_j=float(costs[r]),
                        static_power_w=float(static_power_w), label=label, workload=workload)
            points.append(IterationPoint(time_s=plan.time_s, energy_j=plan.energy_j, plan=plan))
        stats: dict[str, Any] = {"unit_s": res.unit_s, "cuts": res.cuts, "unit_steps": res.steps,
                 "tail_s": tail.time_s if tail is not None else 0.0,
                 "realised_plans": len(res.times_s), "computations": len(nodes),
                 "wall_s": time.perf_counter() - t_start}
        if res.fastest is not None:
            stats["fastest"] = {"relaxed_computations": res.fastest.relaxed,
                                "dynamic_saved_j": res.fastest.fastest_cost - res.fastest.cost,
                                "exact": res.fastest.exact}
        return IterationFrontier.from_points(points, label=label, stats=stats)
