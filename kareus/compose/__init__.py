"""Composition of frontiers: partition -> microbatch -> iteration, plans and baselines.

- :class:`MicrobatchComposer`: per frequency, the Pareto sum of the partition types'
  fronts (weighted by instance count) plus the work outside partitions, for each
  (stage, phase) microbatch computation.
- :class:`IterationComposer`: the iteration frontier over the pipeline DAG by the
  time-cost tradeoff algorithm (Perseus; Phillips-Dessouky minimum cuts).
- :class:`Plan`: a frequency per microbatch computation and a configuration per partition
  type; versioned JSON with a digest.
- :func:`compose_baselines`: megatron, nanobatching, perseus, nanobatching+perseus and
  kareus through the same machinery.

Energy scope: microbatch and iteration energies cover every GPU of the job. Nothing here
touches hardware.
"""

from __future__ import annotations

from kareus.compose.base import FrontierComposer
from kareus.compose.baselines import (
    BASELINES,
    BaselineResult,
    baseline_space,
    compose_baselines,
    default_search,
    exhaustive_search,
)
from kareus.compose.frontiers import (
    IterationFrontier,
    IterationPoint,
    MicrobatchFrontier,
    MicrobatchPoint,
)
from kareus.compose.iteration import IterationComposer, evaluate_plan, solve_time_cost
from kareus.compose.microbatch import MicrobatchComposer, measure_outside_work
from kareus.compose.plan import PLAN_VERSION, MicrobatchChoice, Plan

__all__ = [
    "BASELINES",
    "PLAN_VERSION",
    "BaselineResult",
    "FrontierComposer",
    "IterationComposer",
    "IterationFrontier",
    "IterationPoint",
    "MicrobatchChoice",
    "MicrobatchComposer",
    "MicrobatchFrontier",
    "MicrobatchPoint",
    "Plan",
    "baseline_space",
    "compose_baselines",
    "default_search",
    "evaluate_plan",
    "exhaustive_search",
    "measure_outside_work",
    "solve_time_cost",
]
