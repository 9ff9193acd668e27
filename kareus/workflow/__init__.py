"""The top floor: an ``optimize`` run from its checks to its saved result, one module a step.

- ``kareus.workflow.run``: [`optimize`][kareus.workflow.optimize] (the whole
  pipeline in one call) and [`prepare`][kareus.workflow.prepare] (its checks, returning an
  [`OptimizationRun`][kareus.workflow.OptimizationRun] that runs later; the command line uses it
  to say how long a run takes and to guard its folder before the first measurement).
- ``kareus.workflow.checks``: every check before measuring
  ([`preflight`][kareus.workflow.preflight]).
- ``kareus.workflow.measure``: the one place that measures
  ([`search_types`][kareus.workflow.search_types],
  [`measure_systems`][kareus.workflow.measure_systems]).
- ``kareus.workflow.compose``:
  [`compose_systems`][kareus.workflow.compose_systems], the five systems side by side.
- ``kareus.workflow.result``:
  [`OptimizationResult`][kareus.workflow.OptimizationResult] (table, plan, plot, files).
- [`kareus.workflow.outdir`][kareus.workflow.outdir]: guarded output folders (manifest, lock).
- [`kareus.workflow.pools`][kareus.workflow.pools]: partition searches as tasks of any
  ``concurrent.futures.Executor``, and [`kareus.workflow.ray`][kareus.workflow.ray]: a pool whose
  tasks are Ray tasks (``kareus[ray]``).
- [`kareus.workflow.verification`][kareus.workflow.verification]:
  [`verify`][kareus.workflow.verify] (``kareus verify``: a plan and its baselines run in the
  training loop on the job's GPUs, predicted against measured) and
  [`PlanCheck`][kareus.workflow.PlanCheck] (the same check around a user's own loop).

The layers below only search and compose; this package is the one place that measures, and the
command line (``kareus.cli``) only parses, calls it and prints.
"""

from __future__ import annotations

from kareus.search import resolve_surrogate
from kareus.workflow.checks import estimate_run_s, preflight, require_outside_work
from kareus.workflow.compose import compose_systems
from kareus.workflow.measure import (
    baseline_priors,
    exhaustive_search,
    measure_outside_work,
    measure_systems,
    partition_builder,
    search_types,
)
from kareus.workflow.outdir import manifest_inputs
from kareus.workflow.result import (
    OptimizationResult,
    SystemSummary,
    iso_energy_time_saving,
    iso_time_energy_saving,
)
from kareus.workflow.run import OptimizationRun, optimize, prepare
from kareus.workflow.smoothing import smooth_kareus
from kareus.workflow.verification import (
    Figures,
    PlanCheck,
    SystemCheck,
    VerifyReport,
    verify,
)

__all__ = [
    "Figures",
    "OptimizationResult",
    "OptimizationRun",
    "PlanCheck",
    "SystemCheck",
    "SystemSummary",
    "VerifyReport",
    "compose_systems",
    "estimate_run_s",
    "baseline_priors",
    "exhaustive_search",
    "iso_energy_time_saving",
    "iso_time_energy_saving",
    "manifest_inputs",
    "measure_outside_work",
    "measure_systems",
    "optimize",
    "partition_builder",
    "preflight",
    "prepare",
    "require_outside_work",
    "resolve_surrogate",
    "smooth_kareus",
    "search_types",
    "verify",
]
