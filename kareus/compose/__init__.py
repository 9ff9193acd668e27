"""Composition of frontiers: partition -> microbatch -> iteration, plans and the systems.

- [`FrontierComposer`][kareus.compose.FrontierComposer]: the role, generic in what a composer takes,
  its context ([`MicrobatchContext`][kareus.compose.MicrobatchContext],
  [`IterationContext`][kareus.compose.IterationContext]: one frozen object per level) and what it
  returns.
- [`MicrobatchComposer`][kareus.compose.MicrobatchComposer]: per frequency, the Pareto sum of the
  partition types' fronts (weighted by instance count) plus the work outside partitions, for each
  (stage, phase) microbatch computation.
- [`IterationComposer`][kareus.compose.IterationComposer]: the iteration frontier over the pipeline
  DAG by the time-cost tradeoff algorithm (Perseus, SOSP'24; Phillips-Dessouky minimum cuts),
  solved by [`solve_time_cost`][kareus.compose.solve_time_cost].
- [`Plan`][kareus.compose.Plan]: a frequency per microbatch computation and a configuration per
  partition type; versioned JSON with a digest. [`evaluate_plan`][kareus.compose.evaluate_plan]
  recomputes a plan's figures from its parts.
- [`compose_measured`][kareus.compose.compose_measured]: the five ``SYSTEMS`` (megatron,
  nanobatching, perseus, nanobatching+perseus and kareus) through the same machinery, from their
  measurements ([`SystemsMeasurements`][kareus.compose.SystemsMeasurements]); kareus composes the
  workload's nanobatched and unsplit partition sets
  ([`kareus_partition_sets`][kareus.compose.kareus_partition_sets]) and takes, per computation, the
  Pareto union of the two.

This package only composes: nothing here measures. The measuring (searches, the baselines'
exhaustive spaces, the outside work, the tail) is done in the workflow layer
([`kareus.workflow.measure_systems`][kareus.workflow.measure_systems],
[`kareus.workflow.compose_systems`][kareus.workflow.compose_systems]).

Modules whose names start with an underscore are implementation; import their public
names from here.

Energy scope: microbatch and iteration energies cover every GPU of the job. Nothing here
touches hardware.
"""

from __future__ import annotations

from kareus.compose._evaluate import evaluate_plan
from kareus.compose._time_cost import TimeCostResult, solve_time_cost
from kareus.compose.composer import FrontierComposer
from kareus.compose.context import IterationContext, MicrobatchContext, OutsideTable
from kareus.compose.iteration import IterationComposer
from kareus.compose.iteration_frontier import IterationFrontier, IterationPoint
from kareus.compose.microbatch import MicrobatchComposer
from kareus.compose.microbatch_frontier import MicrobatchFrontier, MicrobatchPoint
from kareus.compose.plan import PLAN_VERSION, MicrobatchChoice, Plan
from kareus.compose.systems import (
    SYSTEMS,
    AnyIterationComposer,
    AnyMicrobatchComposer,
    MeasuredSet,
    MeasuredSystem,
    PartitionBuilder,
    SearchFn,
    SystemsMeasurements,
    SystemsResult,
    baseline_space,
    compose_measured,
    kareus_partition_sets,
    kareus_type_key,
    kareus_types,
    system_configs,
    system_workload,
)

__all__ = [
    "PLAN_VERSION",
    "SYSTEMS",
    "AnyIterationComposer",
    "AnyMicrobatchComposer",
    "FrontierComposer",
    "IterationComposer",
    "IterationContext",
    "IterationFrontier",
    "IterationPoint",
    "MeasuredSet",
    "MeasuredSystem",
    "MicrobatchChoice",
    "MicrobatchComposer",
    "MicrobatchContext",
    "MicrobatchFrontier",
    "MicrobatchPoint",
    "OutsideTable",
    "PartitionBuilder",
    "Plan",
    "SearchFn",
    "SystemsMeasurements",
    "SystemsResult",
    "TimeCostResult",
    "baseline_space",
    "compose_measured",
    "evaluate_plan",
    "kareus_partition_sets",
    "kareus_type_key",
    "kareus_types",
    "solve_time_cost",
    "system_configs",
    "system_workload",
]

#: Names that measure, moved out of this package (it only composes), and where they are now.
_MOVED = {"compose_systems": "kareus.workflow", "default_search": "kareus.search.SearchSpec",
          "exhaustive_search": "kareus.workflow", "measure_outside_work": "kareus.workflow"}


def __getattr__(name: str) -> object:
    """Say where a name that measures went: ``kareus.compose`` only composes."""
    if name in _MOVED:
        where = _MOVED[name]
        how = ("SearchSpec() is the default search: from kareus.search import SearchSpec"
               if name == "default_search" else f"from {where} import {name}")
        raise ImportError(f"kareus.compose.{name} measures, and kareus.compose only composes: "
                          f"{how}")
    raise AttributeError(f"module 'kareus.compose' has no attribute {name!r}")
