"""Search for partition frontiers: Pareto utilities, surrogates, acquisition, the optimizer.

- :mod:`~kareus.search.pareto`: Pareto filter, exact 2-D hypervolume and hypervolume
  improvement.
- :class:`Surrogate` (:class:`GaussianProcessSurrogate`, the default;
  :class:`XGBoostSurrogate`, :class:`BootstrapEnsemble`): models of time and dynamic
  energy over the physical features of a configuration.
- :class:`AcquisitionPass` (:class:`HypervolumePass`, :class:`UncertaintyPass`, ...): each
  picks part of a batch from the predictions and the measured front.
- :class:`MultiPassSearch`: the ask/tell optimizer, with a JSONL log that a killed search
  resumes from; its result is a :class:`PartitionFrontier`.

Nothing here touches hardware.
"""

from __future__ import annotations

from kareus.search.acquisition import (
    AcquisitionContext,
    AcquisitionPass,
    FastestPass,
    HingePass,
    HypervolumePass,
    NeighbourhoodPass,
    RandomPass,
    UncertaintyPass,
    allocate,
)
from kareus.search.frontier import Observation, PartitionFrontier
from kareus.search.optimizer import (
    LOG_FORMAT,
    LOG_VERSION,
    SURROGATES,
    MultiPassSearch,
    anchor_indices,
    default_passes,
    default_surrogate,
    facts_passes,
    maximin_design,
    search_features,
    tree_surrogate,
)
from kareus.search.pareto import (
    hypervolume,
    hypervolume_improvement,
    pareto_front,
    pareto_mask,
    reference_point,
)
from kareus.search.surrogate import (
    BootstrapEnsemble,
    GaussianProcessSurrogate,
    ObjectiveModel,
    ObjectivePrediction,
    Surrogate,
    XGBoostSurrogate,
)

__all__ = [
    "LOG_FORMAT",
    "LOG_VERSION",
    "SURROGATES",
    "AcquisitionContext",
    "AcquisitionPass",
    "BootstrapEnsemble",
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
    "RandomPass",
    "Surrogate",
    "UncertaintyPass",
    "XGBoostSurrogate",
    "allocate",
    "anchor_indices",
    "default_passes",
    "default_surrogate",
    "facts_passes",
    "hypervolume",
    "hypervolume_improvement",
    "maximin_design",
    "pareto_front",
    "pareto_mask",
    "reference_point",
    "search_features",
    "tree_surrogate",
]
