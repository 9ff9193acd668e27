"""Smoothed values of measured configurations: what composition should choose by.

Each configuration of a search is measured once, with noise (about 1% on the emulator, a
few tenths of a per cent on the measured H200 grids). A frontier keeps, at each clock, the
lowest measured energy among many nearly equal configurations: the luckiest draw, not the
best configuration. The more a search measures, the more of its front is selected noise,
and the composition, which picks one configuration per type and clock, picks it again.

[`smoothed_frontier`][kareus.search.smoothed_frontier] values every *measured*
configuration of a frontier by the surrogates fitted on all of the type's measurements (the
posterior mean at that configuration): it pools a configuration's own measurement with its
neighbours' (nearby clocks and SM counts, which a Gaussian process weighs by its learnt
length scales), so the noise averages out. Only configurations that were measured are kept,
so the frontier is still made of configurations paid for; their values are estimates from
measurements, not single measurements.
"""

from __future__ import annotations

import numpy as np

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model.config import ConfigSpace
from kareus.model.measurement import Measurement
from kareus.search._defaults import default_surrogate
from kareus.search._features import search_features
from kareus.search._objective_model import ObjectiveModel
from kareus.search._prior_mean import PriorMean
from kareus.search.partition_frontier import Observation, PartitionFrontier
from kareus.search.surrogate import Surrogate

__all__ = ["smoothed_frontier"]


def smoothed_frontier(frontier: PartitionFrontier, space: ConfigSpace, *,
                      prior_mean: PriorMean | None = None, surrogate: Surrogate | None = None,
                      seed: int = 0, keep_time: bool = False) -> PartitionFrontier:
    """``frontier`` with every measured configuration valued by surrogates fitted on all of
    its measurements.

    Time and dynamic energy are fitted in log space
    ([`ObjectiveModel`][kareus.search.ObjectiveModel]), as the search fits them, to the
    residual from ``prior_mean`` when one is given; each configuration's smoothed time and
    dynamic energy are the posterior means at it, and its total energy is recombined with its
    own measured static power. A configuration measured twice is fitted with both
    measurements and kept once.

    Args:
        frontier: A type's frontier (measured observations only).
        space: The type's configurations (every observation's configuration must be one).
        prior_mean: The search's prior mean, if it had one (predictions of ``space``).
        surrogate: The surrogate template; ``None`` =
            [`default_surrogate`][kareus.search.default_surrogate].
        seed: Seeds the surrogates' clones (the result is deterministic for a seed).
        keep_time: Keep each configuration's measured time (only its dynamic energy
            smoothed; its total energy recombined with the measured time).

    Returns:
        A frontier of the same configurations, in the order first measured, with smoothed
        values; a frontier of fewer than two measurements is returned as it is.

    Raises:
        ArgumentError: a predicted observation, a configuration outside ``space``, or a
            prior mean of another size than ``space``.
        ArgumentTypeError: ``frontier`` or ``prior_mean`` of the wrong type.
    """
    if not isinstance(frontier, PartitionFrontier):
        raise ArgumentTypeError(f"frontier must be a kareus PartitionFrontier, got "
                                f"{type(frontier).__name__}")
    if prior_mean is not None and not isinstance(prior_mean, PriorMean):
        raise ArgumentTypeError(f"prior_mean must be a kareus PriorMean, got "
                                f"{type(prior_mean).__name__}")
    if prior_mean is not None and len(prior_mean) != len(space):
        raise ArgumentError(f"prior_mean predicts {len(prior_mean)} configurations; the space "
                            f"has {len(space)}: give the prediction of this space")
    if any(o.predicted for o in frontier.observations):
        raise ArgumentError(f"smoothed_frontier: {frontier.partition!r} holds predicted "
                            "observations; smooth a frontier of measurements only")
    obs = list(frontier.observations)
    if len(obs) < 2:
        return frontier
    try:
        idx = np.array([space.index(o.config) for o in obs], dtype=np.int64)
    except (KeyError, ValueError) as exc:
        raise ArgumentError(f"smoothed_frontier: a configuration of {frontier.partition!r} is "
                            f"not in the space given ({exc}); give the type's own space") from exc
    t = np.array([o.time_s for o in obs])
    e = np.array([o.energy_j for o in obs])
    sp = np.array([o.measurement.static_power_w for o in obs])
    feats = search_features(space)
    off = None if prior_mean is None else prior_mean.log_values()
    model = ObjectiveModel(default_surrogate(seed) if surrogate is None else surrogate,
                           seed=seed)
    model.fit(feats[idx], t, e - sp * t, float(np.median(sp)),
              offset=None if off is None else (off[0][idx], off[1][idx]))
    first: dict[int, int] = {}
    for k, i in enumerate(idx):
        first.setdefault(int(i), k)
    rows = np.array(list(first), dtype=np.int64)
    pred = model.predict(feats[rows], offset=None if off is None
                         else (off[0][rows], off[1][rows]))
    smoothed = []
    for i, pt, pd in zip(rows, pred.time_s, pred.dynamic_energy_j):
        o = obs[first[int(i)]]
        s = o.measurement.static_power_w
        if keep_time:
            pt = o.time_s
        smoothed.append(Observation(config=o.config, measurement=Measurement(
            time_s=float(pt), energy_j=float(pt * s + max(float(pd), 0.0)),
            static_power_w=s)))
    return PartitionFrontier.from_observations(frontier.partition, frontier.gpu, smoothed)
