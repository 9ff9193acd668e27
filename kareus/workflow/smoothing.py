"""kareus's composition on smoothed values (``optimize(smooth=True)``).

Every configuration is measured once, with noise, and composition picks, per partition type
and clock, the configuration of least measured energy within its time: among many nearly
equal configurations, the luckiest measurement. Valued noise-free, such a plan saves less
than it claims, and more so the more a search measured (`bench/baseline_dominance.py
--score selected`, docs/search.md). [`smooth_kareus`][kareus.workflow.smooth_kareus] values
each configuration kareus's searches (and the baselines, for the same types) measured by
[`smoothed_frontier`][kareus.search.smoothed_frontier] before composition, so plans are
chosen by values from which the surrogates have pooled the noise out. The baselines keep
their measurements, and kareus's anchors (each baseline's own measurements of a partition
set, composed on their own) keep theirs, so kareus's frontier still holds every baseline
point.
"""

from __future__ import annotations

import attrs

from kareus.compose.systems import MeasuredSet, SystemsMeasurements
from kareus.model.profiler import Profiler
from kareus.search import PartitionFrontier, PriorMean, Surrogate, smoothed_frontier

__all__ = ["smooth_kareus"]


def smooth_kareus(measured: SystemsMeasurements, profiler: Profiler, *,
                  prior_model: Profiler | None = None, surrogate: Surrogate | None = None,
                  seed: int = 0) -> SystemsMeasurements:
    """``measured`` with kareus's partition frontiers smoothed, everything else as it was.

    Args:
        measured: What the systems measured ([`measure_systems`][kareus.workflow.measure_systems]).
        profiler: The profiler that measured (gives each type's space).
        prior_model: The searches' prior model, if any: each type is smoothed around its
            prediction, as its search modelled it.
        surrogate: The searches' surrogate template; ``None`` = the default.
        seed: The searches' seed.

    Returns:
        The measurements, kareus's frontiers (in its sets and by key) smoothed; a
        measurement without kareus is returned as it is.
    """
    kareus = measured.systems.get("kareus")
    if kareus is None:
        return measured
    done: dict[int, PartitionFrontier] = {}
    sets: list[MeasuredSet] = []
    for mset in kareus.sets:
        fronts = {}
        for tname, pf in mset.frontiers.items():
            if id(pf) not in done:
                space = profiler.space(mset.partitions.types[tname])
                mean = (None if prior_model is None
                        else PriorMean.from_profiler(space, prior_model))
                done[id(pf)] = smoothed_frontier(pf, space, prior_mean=mean,
                                                 surrogate=surrogate, seed=seed)
            fronts[tname] = done[id(pf)]
        sets.append(attrs.evolve(mset, frontiers=fronts))
    keyed = {key: done.get(id(pf), pf) for key, pf in kareus.frontiers.items()}
    systems = dict(measured.systems)
    systems["kareus"] = attrs.evolve(kareus, sets=tuple(sets), frontiers=keyed)
    return attrs.evolve(measured, systems=systems)
