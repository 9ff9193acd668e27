"""Plan evaluation: a plan's iteration time and energy, recomputed from its parts.

The composers build a plan's figures bottom-up (partition fronts -> microbatch points ->
the longest path of the pipeline DAG). [`evaluate_plan`][kareus.compose.evaluate_plan] recomputes
them from the partition observations, the partition counts and the outside work, independently of
the composers' Pareto sums and the time-cost solver, so tests and benchmarks can check that a
plan costs what its frontier says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kareus.compose.plan import Plan
from kareus.compose.systems import kareus_type_key
from kareus.errors import ArgumentError
from kareus.model.measurement import Measurement
from kareus.model.partition import PartitionSet, build_partitions
from kareus.model.pipeline import Computation, PipelineSchedule, one_f_one_b
from kareus.search import Observation, PartitionFrontier

__all__ = ["evaluate_plan"]


def evaluate_plan(plan: Plan, *, frontiers: Mapping[str, PartitionFrontier],
                  partitions: PartitionSet,
                  outside: Mapping[tuple[int, str], Mapping[int, Measurement]] | None,
                  static_power_w: float, energy_scale: float | None = None,
                  schedule: PipelineSchedule | None = None,
                  tail: Measurement | None = None,
                  outside_of: Mapping[int, Mapping[tuple[int, str], Mapping[int, Measurement]]]
                  | None = None) -> tuple[float, float, float]:
    """Re-evaluate a plan from its parts: partition measurements, counts and outside work.

    Each computation's time is ``sum count x partition time + outside time`` at its
    frequency and configurations (the partition observations are looked up by
    configuration in ``frontiers``); the iteration time is the schedule's longest path;
    the energy is every computation's dynamic energy (scaled by ``energy_scale``, default
    the DP degree) plus ``static_power_w`` x time.

    A computation whose choice splits the microbatch in another number of nanobatches than
    ``partitions``'s workload (kareus's unsplit computations) counts the partition types of
    that split, whose frontiers ``frontiers`` holds under
    [`kareus_type_key`][kareus.compose.kareus_type_key] (``<type>@n1``), as kareus's partition
    frontiers are keyed.

    Args:
        plan: The plan.
        frontiers: Partition type key -> its frontier (the observations the plan chose).
        partitions: The partition set of the plan's workload (counts per phase).
        outside: Measurements of the work outside partitions per ``(stage, phase)`` and
            frequency; ``None`` = no outside work.
        static_power_w: Static power of every GPU of the job together.
        energy_scale: Multiplier from a partition measurement's scope (one TP x CP group)
            to every GPU of the stage; ``None`` = the DP degree.
        schedule: The pipeline DAG; ``None`` = 1F1B over the plan's stages and
            microbatches.
        tail: The per-iteration work after the pipeline flush over every GPU (as the
            iteration composer was given it); ``None`` = none.
        outside_of: Nanobatch count -> the outside work measured for that split, for
            choices of another count than ``partitions``'s workload. Needed where the
            outside work depends on the count: a workload of unchained layers
            (``Workload.chained_layers=False``), whose bare computations and exposed
            collectives are outside work; otherwise ``outside`` serves every count.

    Returns:
        ``(time_s, energy_j, dynamic_energy_j)``.
    """
    scale = (float(partitions.workload.parallelism.dp) if energy_scale is None
             else float(energy_scale))
    if schedule is None:
        schedule = one_f_one_b(plan.num_stages, plan.num_microbatches)
    lookup: dict[tuple[str, Any], Observation] = {}
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
    base = partitions.workload
    counts_of: dict[int | None, dict[str, dict[str, int]]] = {None: partitions.counts,
                                                             base.nanobatches: partitions.counts}
    durations: dict[Computation, float] = {}
    dyn = 0.0
    for c in schedule.nodes:
        ch = plan.choice(c)
        n = ch.nanobatches
        if n not in counts_of:
            counts_of[n] = build_partitions(base.with_(nanobatches=n)).counts
        table = _outside_table(outside, outside_of, base, n, c)
        t = e = 0.0
        for tname, count in counts_of[n][c.phase].items():
            if count <= 0:
                continue
            key = tname if n is None else kareus_type_key(tname, n, base)
            o = lookup[(key, ch.config(tname))]
            t += count * o.time_s
            e += count * o.dynamic_energy_j
        if table is not None:
            m = table[(c.stage, c.phase)][ch.freq_mhz]
            t += m.time_s
            e += m.dynamic_energy_j
        durations[c] = t
        dyn += e * scale
    time_s = schedule.makespan(durations)
    if tail is not None:
        time_s += tail.time_s
        dyn += tail.dynamic_energy_j
    return time_s, dyn + static_power_w * time_s, dyn


def _outside_table(outside: Any, outside_of: Any, base: Any, n: int | None,
                   c: Computation) -> Any:
    """The outside work of computation ``c`` split into ``n`` nanobatches: ``outside``, or
    that split's from ``outside_of`` where the workload's own count is another.

    Raises:
        ArgumentError: unchained layers (outside work that depends on the split) and no
            outside work of that split given.
    """
    if outside is None or n is None or n == base.nanobatches:
        return outside
    if outside_of is not None and n in outside_of:
        return outside_of[n]
    if not base.chained_layers:
        raise ArgumentError(
            f"the plan's {c.phase} computation of microbatch {c.microbatch} splits into {n} "
            "nanobatches; its workload's layers are unchained, whose outside work depends on "
            f"the split: pass outside_of={{{n}: ...}} (the outside work of that split, "
            "measured)")
    return outside
