"""Search for partition frontiers: Pareto utilities, surrogates, acquisition, the optimizer.

- ``pareto``: Pareto filter, exact 2-D hypervolume and hypervolume
  improvement.
- [`Surrogate`][kareus.search.Surrogate]
  ([`GaussianProcessSurrogate`][kareus.search.GaussianProcessSurrogate], the default;
  [`XGBoostSurrogate`][kareus.search.XGBoostSurrogate],
  [`BootstrapEnsemble`][kareus.search.BootstrapEnsemble]): models of time and dynamic energy over
  the physical features of a configuration.
- [`AcquisitionPass`][kareus.search.AcquisitionPass]
  ([`HypervolumePass`][kareus.search.HypervolumePass],
  [`UncertaintyPass`][kareus.search.UncertaintyPass], ...): each picks part of a batch from the
  predictions and the measured front.
- [`MultiPassSearch`][kareus.search.MultiPassSearch]: the ask/tell optimizer, with a JSONL log that
  a killed search resumes from; its result is a
  [`PartitionFrontier`][kareus.search.PartitionFrontier] (``partition_frontier``). Its parts: the
  features ([`search_features`][kareus.search.search_features]), the initial design
  ([`maximin_design`][kareus.search.maximin_design], opened by
  [`system_config_indices`][kareus.search.system_config_indices], sized by
  [`default_initial_size`][kareus.search.default_initial_size]), the defaults
  ([`default_passes`][kareus.search.default_passes],
  [`prior_mean_passes`][kareus.search.prior_mean_passes],
  [`reference_passes`][kareus.search.reference_passes],
  [`default_surrogate`][kareus.search.default_surrogate],
  [`tree_surrogate`][kareus.search.tree_surrogate]).
- [`SearchSpec`][kareus.search.SearchSpec]: how every partition type is searched (budget, batch
  size, seed, surrogate, passes), one value for every place a search runs: ``kareus.optimize``,
  the systems' composition, a tuning run, the tasks of a pool or a Ray cluster.
- [`smoothed_frontier`][kareus.search.smoothed_frontier]: a frontier's measured configurations
  valued by surrogates fitted on all of them, so that composition chooses by values that
  pool the noise out (``optimize(smooth=True)``).

Import from here: the modules with a leading underscore are implementation modules, one
concern each; ``surrogate`` and ``acquisition`` hold
the two role contracts a plug-in subclasses. Nothing here touches hardware.
"""

from __future__ import annotations

from kareus.search._bootstrap_ensemble import BootstrapEnsemble
from kareus.search._defaults import (
    SURROGATES,
    default_passes,
    default_surrogate,
    prior_mean_passes,
    reference_passes,
    tree_surrogate,
)
from kareus.search._features import EXTRA_COLUMNS_FROM, search_features
from kareus.search._gaussian_process import GaussianProcessSurrogate
from kareus.search._initial_design import (
    default_initial_size,
    maximin_design,
    system_config_indices,
)
from kareus.search._log import LOG_FORMAT, LOG_VERSION, prior_count
from kareus.search._multi_pass_search import MultiPassSearch
from kareus.search._objective_model import ObjectiveModel, ObjectivePrediction
from kareus.search._prior_mean import PriorMean
from kareus.search._smoothing import smoothed_frontier
from kareus.search._spec import (
    DEFAULT_BUDGET,
    SearchSpec,
    execution_of,  # noqa: F401 (deprecated: profiler.execution)
    resolve_surrogate,
    search_log_path,
)
from kareus.search._xgboost_surrogate import XGBoostSurrogate
from kareus.search.acquisition import (
    AcquisitionContext,
    AcquisitionPass,
    ClockSweepPass,
    FastestPass,
    HingePass,
    HypervolumePass,
    NeighbourhoodPass,
    RandomPass,
    UncertaintyPass,
    allocate,
)
from kareus.search.pareto import (
    hypervolume,
    hypervolume_improvement,
    pareto_front,
    pareto_mask,
    reference_point,
)
from kareus.search.partition_frontier import Observation, PartitionFrontier
from kareus.search.surrogate import Surrogate

__all__ = [
    "DEFAULT_BUDGET",
    "EXTRA_COLUMNS_FROM",
    "LOG_FORMAT",
    "LOG_VERSION",
    "SURROGATES",
    "AcquisitionContext",
    "AcquisitionPass",
    "BootstrapEnsemble",
    "ClockSweepPass",
    "FastestPass",
    "GaussianProcessSurrogate",
    "HingePass",
    "HypervolumePass",
    "MultiPassSearch",
    "NeighbourhoodPass",
    "ObjectiveModel",
    "ObjectivePrediction",
    "Observation",
    "PartitionFrontier",
    "PriorMean",
    "RandomPass",
    "SearchSpec",
    "Surrogate",
    "UncertaintyPass",
    "XGBoostSurrogate",
    "allocate",
    "default_initial_size",
    "default_passes",
    "default_surrogate",
    "prior_mean_passes",
    "hypervolume",
    "hypervolume_improvement",
    "maximin_design",
    "pareto_front",
    "pareto_mask",
    "reference_passes",
    "reference_point",
    "resolve_surrogate",
    "search_features",
    "prior_count",
    "search_log_path",
    "smoothed_frontier",
    "system_config_indices",
    "tree_surrogate",
]
