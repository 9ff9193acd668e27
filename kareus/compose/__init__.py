"""Composition of frontiers: partition -> microbatch -> iteration, plans and the systems.

- [`FrontierComposer`][kareus.compose.FrontierComposer]: the role, generic in what a composer takes
  and returns.
- [`MicrobatchComposer`][kareus.compose.MicrobatchComposer]: per frequency, the Pareto sum of the
  partition types' fronts (weighted by instance count) plus the work outside partitions, for each
  (stage, phase) microbatch computation.
- [`IterationComposer`][kareus.compose.IterationComposer]: the iteration frontier over the pipeline
  DAG by the time-cost tradeoff algorithm (Perseus, SOSP'24; Phillips-Dessouky minimum cuts),
  solved by [`solve_time_cost`][kareus.compose.solve_time_cost].
- [`Plan`][kareus.compose.Plan]: a frequency per microbatch computation and a configuration per
  partition type; versioned JSON with a digest. [`evaluate_plan`][kareus.compose.evaluate_plan]
  recomputes a plan's figures from its parts.
- [`compose_systems`][kareus.compose.compose_systems]: the five ``SYSTEMS`` (megatron, nanobatching,
  perseus, nanobatching+perseus and kareus) through the same machinery; kareus composes the
  workload's nanobatched and unsplit partition sets
  ([`kareus_partition_sets`][kareus.compose.kareus_partition_sets]) and takes, per computation, the
  Pareto union of the two.

Modules whose names start with an underscore are implementation; import their public
names from here.

Energy scope: microbatch and iteration energies cover every GPU of the job. Nothing here
touches hardware.
"""

from __future__ import annotations

from kareus.compose._evaluate import evaluate_plan
from kareus.compose._time_cost import TimeCostResult, solve_time_cost
from kareus.compose.composer import FrontierComposer
from kareus.compose.iteration import IterationComposer
from kareus.compose.iteration_frontier import IterationFrontier, IterationPoint
from kareus.compose.microbatch import MicrobatchComposer, measure_outside_work
from kareus.compose.microbatch_frontier import MicrobatchFrontier, MicrobatchPoint
from kareus.compose.plan import PLAN_VERSION, MicrobatchChoice, Plan
from kareus.compose.systems import (
    SYSTEMS,
    AnyIterationComposer,
    AnyMicrobatchComposer,
    SystemsResult,
    baseline_space,
    compose_systems,
    default_search,
    exhaustive_search,
    kareus_partition_sets,
    kareus_type_key,
    kareus_types,
    system_configs,
)

__all__ = [
    "PLAN_VERSION",
    "SYSTEMS",
    "AnyIterationComposer",
    "AnyMicrobatchComposer",
    "FrontierComposer",
    "IterationComposer",
    "IterationFrontier",
    "IterationPoint",
    "MicrobatchChoice",
    "MicrobatchComposer",
    "MicrobatchFrontier",
    "MicrobatchPoint",
    "Plan",
    "SystemsResult",
    "TimeCostResult",
    "baseline_space",
    "compose_systems",
    "default_search",
    "evaluate_plan",
    "exhaustive_search",
    "kareus_partition_sets",
    "kareus_type_key",
    "kareus_types",
    "measure_outside_work",
    "solve_time_cost",
    "system_configs",
]
