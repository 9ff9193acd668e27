"""Microbatch composition: partition frontiers -> the frontier of each microbatch computation.

A microbatch computation (the forward or the backward of one pipeline stage for one
microbatch) runs ``counts[phase][type]`` instances of each partition type, plus some
work outside partitions (embedding, LM head, loss) run sequentially. It runs at one
frequency, and all instances of a type share one configuration. So, for each frequency
f, its time and dynamic energy are::

    sum over types of count(type) x (time, dynamic energy) of the type's chosen point at f
    + (time, dynamic energy) of the outside work at f

Choosing one point per type is a Cartesian product; we never form it. Types are added
one at a time (a Minkowski sum of two Pareto sets) and the result is pruned to its
Pareto points after each addition, which is exact: a combination that uses a dominated
partial sum is itself dominated. Work is O(sum of |front_k| x |partial front|) per
frequency instead of the product of the front sizes.

Every choice records the nanobatch count of the partition set it was composed from
(``partitions.workload.nanobatches``). Kareus composes two sets, the workload's nanobatched
types and its unsplit (one nanobatch) types, and takes the Pareto union of the two
frontiers of each computation
([`kareus.compose.compose_measured`][kareus.compose.compose_measured],
[`MicrobatchFrontier.union`][kareus.compose.MicrobatchFrontier.union]).

By default only measured points are used; a frequency at which a type has no
measurement is skipped. With ``include_predicted=True`` the surrogate's predicted
points stand in for such types, and the resulting microbatch points are marked
``predicted``.

Energy scope: a partition measurement covers one TP x CP group (the GPUs of one stage
of one data-parallel replica); microbatch energies are scaled by ``energy_scale``
(default: the workload's DP degree) to cover every GPU of the stage in the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from kareus.compose.composer import FrontierComposer
from kareus.compose.context import MicrobatchContext, OutsideTable, _from_keywords
from kareus.compose.microbatch_frontier import MicrobatchFrontier, MicrobatchPoint
from kareus.compose.plan import MicrobatchChoice
from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model.partition import PartitionSet
from kareus.search import Observation, PartitionFrontier
from kareus.search.pareto import pareto_mask

__all__ = ["MicrobatchComposer", "OutsideTable", "pareto_sum"]


def _prune(t: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Indices of the Pareto points of (t, e), sorted by t (first of exact duplicates kept)."""
    kept = np.flatnonzero(pareto_mask(np.column_stack([t, e])))
    return kept[np.argsort(t[kept], kind="stable")]


def pareto_sum(fronts: Sequence[tuple[np.ndarray, np.ndarray]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pareto front of all sums picking one point from each front, with the picks.

    Args:
        fronts: ``(times, energies)`` arrays of each front (any points; dominated ones are
            dropped on the way).

    Returns:
        ``(times, energies, picks)``: the Pareto sums sorted by time, and for each, the
        index picked in every input front (shape ``(n, len(fronts))``).
    """
    if not fronts:
        return np.zeros(1), np.zeros(1), np.zeros((1, 0), dtype=np.int64)
    t0, e0 = (np.asarray(a, dtype=np.float64) for a in fronts[0])
    keep = _prune(t0, e0)
    T, E = t0[keep], e0[keep]
    picks = keep[:, None].astype(np.int64)
    for t_k, e_k in fronts[1:]:
        t_k = np.asarray(t_k, dtype=np.float64)
        e_k = np.asarray(e_k, dtype=np.float64)
        k_keep = _prune(t_k, e_k)
        t_k, e_k = t_k[k_keep], e_k[k_keep]
        st = (T[:, None] + t_k[None, :]).ravel()
        se = (E[:, None] + e_k[None, :]).ravel()
        sel = _prune(st, se)
        i, j = np.divmod(sel, len(t_k))
        T, E = st[sel], se[sel]
        picks = np.concatenate([picks[i], k_keep[j][:, None]], axis=1)
    return T, E, picks


class MicrobatchComposer(
        FrontierComposer[Mapping[str, PartitionFrontier], MicrobatchContext,
                         dict[tuple[int, str], MicrobatchFrontier]]):
    """Composes partition frontiers into each microbatch computation's frontier.

    Args:
        include_predicted: Use surrogate-predicted points for a type at frequencies where
            it has no measurement (the microbatch points built on them are marked
            ``predicted``). Default: measured points only.
        freqs_mhz: Frequencies to compose at; ``None`` = every frequency any frontier has.
    """

    def __init__(self, *, include_predicted: bool = False,
                 freqs_mhz: Sequence[int] | None = None) -> None:
        self.include_predicted = bool(include_predicted)
        self.freqs_mhz = None if freqs_mhz is None else tuple(int(f) for f in freqs_mhz)

    def __repr__(self) -> str:
        return (f"MicrobatchComposer(include_predicted={self.include_predicted}, "
                f"freqs_mhz={self.freqs_mhz})")

    def _type_front(self, pf: PartitionFrontier, freq: int) -> tuple[list[Observation], bool]:
        obs = pf.front_at(freq, energy="dynamic")
        if obs or not self.include_predicted:
            return obs, False
        pred = [o for o in pf.front_at(freq, energy="dynamic", include_predicted=True)
                if o.predicted]
        return pred, True

    def compose(self, frontiers: Mapping[str, PartitionFrontier],  # noqa: C901 - per phase: the stage-independent sums per frequency, then each stage with its outside work
                context: MicrobatchContext | None = None, /, **fields: Any
                ) -> dict[tuple[int, str], MicrobatchFrontier]:
        """The frontier of every microbatch computation ``(stage, phase)``.

        Args:
            frontiers: Partition type name -> its frontier (every type the counts use).
            context: The partition set (types, counts, outside work), the measured outside
                work per ``(stage, phase)`` and frequency (``None`` there: none counted) and
                the energy scale ([`MicrobatchContext`][kareus.compose.MicrobatchContext]).
            **fields: Deprecated: the context's fields as keywords (``partitions=...,
                outside=...``), as earlier releases took them.

        Returns:
            ``(stage, phase)`` -> the microbatch frontier of that computation.

        Raises:
            ValueError: a type the counts use has no frontier, or a computation has no
                frequency at which every type has a point.
            TypeError: a frontier that is not a PartitionFrontier, or a context that is not
                a MicrobatchContext.
        """
        ctx: MicrobatchContext = _from_keywords(MicrobatchContext, context, fields,
                                                "MicrobatchComposer")
        partitions: PartitionSet = ctx.partitions
        outside: OutsideTable | None = ctx.outside
        for name, pf in frontiers.items():
            if not isinstance(pf, PartitionFrontier):
                raise ArgumentTypeError(f"frontier of {name!r} must be a PartitionFrontier, "
                                        f"got {type(pf).__name__}")
        scale = ctx.scale
        pp = partitions.workload.parallelism.pp
        nanobatches = partitions.workload.nanobatches  # recorded in every choice
        out: dict[tuple[int, str], MicrobatchFrontier] = {}
        for phase in ("fwd", "bwd"):
            counts = {t: c for t, c in sorted(partitions.counts[phase].items()) if c > 0}
            missing = [t for t in counts if t not in frontiers]
            if missing:
                raise ArgumentError(f"no partition frontier for type(s) {missing} "
                                    f"(needed by the {phase} computations)")
            freqs = self.freqs_mhz
            if freqs is None:
                fs: set[int] = set()
                for t in counts:
                    fs.update(o.config.freq_mhz for o in frontiers[t].observations
                              if self.include_predicted or not o.predicted)
                freqs = tuple(sorted(fs, reverse=True))
            # Stage-independent part: sum over partition types at each frequency.
            per_freq: dict[int, tuple[np.ndarray, np.ndarray, list[MicrobatchChoice]]] = {}
            for f in freqs:
                type_obs: list[list[Observation]] = []
                type_pred: list[bool] = []
                for t in counts:
                    obs, pred = self._type_front(frontiers[t], f)
                    if not obs:
                        break
                    type_obs.append(obs)
                    type_pred.append(pred)
                else:
                    arrays = [(np.array([o.time_s for o in obs]) * c,
                               np.array([o.dynamic_energy_j for o in obs]) * c)
                              for obs, c in zip(type_obs, counts.values())]
                    T, E, picks = pareto_sum(arrays)
                    names = list(counts)
                    cfgs = [[(n, o.config) for o in obs] for n, obs in zip(names, type_obs)]
                    preds = [[pk or o.predicted for o in obs]
                             for obs, pk in zip(type_obs, type_pred)]
                    choices = []
                    for row in picks.tolist():
                        choices.append(MicrobatchChoice._trusted(
                            f, tuple(c[i] for c, i in zip(cfgs, row)),
                            any(p[i] for p, i in zip(preds, row)), nanobatches))
                    per_freq[f] = (T, E, choices)
            built: dict[tuple[tuple[int, float, float], ...], MicrobatchFrontier] = {}
            for stage in range(pp):
                # Stages whose outside work costs the same share one frontier's points.
                sig = tuple((f, outside[(stage, phase)][f].time_s,
                             outside[(stage, phase)][f].dynamic_energy_j)
                            if outside is not None and f in outside[(stage, phase)]
                            else (f, -1.0, -1.0) for f in per_freq)
                if sig in built:
                    out[(stage, phase)] = attrs.evolve(built[sig], stage=stage)
                    continue
                by_freq: dict[int, list[MicrobatchPoint]] = {}
                for f, (T, E, choices) in per_freq.items():
                    if outside is not None:
                        row = outside[(stage, phase)]
                        if f not in row:
                            continue
                        m = row[f]
                        ot, oe = m.time_s, m.dynamic_energy_j
                    else:
                        ot, oe = 0.0, 0.0
                    by_freq[f] = [MicrobatchPoint(time_s=t + ot, dynamic_energy_j=(e + oe) * scale,
                                                  choice=ch)
                                  for t, e, ch in zip(T.tolist(), E.tolist(), choices)]
                if not by_freq:
                    raise ArgumentError(f"stage {stage} {phase}: no frequency at which every "
                                        f"partition type ({', '.join(counts)}) has a point")
                out[(stage, phase)] = built[sig] = MicrobatchFrontier.from_fronts(stage, phase,
                                                                                 by_freq)
        return out
