"""Acquisition passes: which configurations to profile next.

Each batch of a [`MultiPassSearch`][kareus.search.MultiPassSearch] is filled by several
*passes*, each with its share of the batch. A pass looks at the surrogates'
predictions for every candidate configuration and at the measured points, and
picks its candidates:

* [`HypervolumePass`][kareus.search.HypervolumePass] - hypervolume improvement of each candidate's
  *predicted* point over the measured front, in (time, total energy), (time, dynamic energy) or
  (time, static energy). The last is a front of one point (static energy is static
  power x time), so that pass rewards being faster than the fastest measured point.
  This is the hypervolume improvement of the predicted mean, not an expectation
  over the prediction's uncertainty; with ``optimism > 0`` it scores an optimistic
  point (mean lowered by ``optimism`` spreads) instead; with ``front="denoised"`` it
  scores against the front of the *predicted* values of the measured configurations.
* [`NeighbourhoodPass`][kareus.search.NeighbourhoodPass] - exploitation: the same score, among
  configurations one knob away from the front's (any other frequency, a few SM steps, any other
  slot).
* [`HingePass`][kareus.search.HingePass] - bisection toward the fewest SMs that keep a front
  configuration's time: at the front's clock and slot, halfway between its SM count
  and the next smaller one measured.
* [`UncertaintyPass`][kareus.search.UncertaintyPass] - the candidates the surrogates agree on least
  (largest bootstrap spread): exploration.
* [`FastestPass`][kareus.search.FastestPass] - lowest predicted time (the reference artifact's third
  pass).
* [`RandomPass`][kareus.search.RandomPass] - uniform random, for baselines and tests.

No pass picks a candidate that is not ``available`` in the context (measured, pending
or already chosen for this batch by an earlier pass), nor one candidate twice.

Conformance: [`kareus.testing.check_acquisition_pass`][kareus.testing.check_acquisition_pass] checks
any subclass.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import attrs
import numpy as np

from kareus._check import check_count, check_number
from kareus.errors import ArgumentError
from kareus.search._features import EXTRA_COLUMNS_FROM
from kareus.search._objective_model import ObjectivePrediction
from kareus.search.pareto import (
    hypervolume_improvement,
    pareto_front,
    pareto_mask,
    reference_point,
)

__all__ = [
    "AcquisitionContext",
    "AcquisitionPass",
    "ClockSweepPass",
    "FastestPass",
    "HingePass",
    "HypervolumePass",
    "NeighbourhoodPass",
    "RandomPass",
    "UncertaintyPass",
    "allocate",
]

_ENERGIES = ("total", "dynamic", "static")


def _as_index_array(values: object, n: int, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ArgumentError(f"{name} indices must be in 0..{n - 1}")
    return arr


@attrs.frozen(kw_only=True)
class AcquisitionContext:
    """What a pass sees when it picks.

    Attributes:
        prediction: Predicted objectives of every candidate (n candidates).
        available: Boolean mask (n,): candidates a pass may pick.
        observed_time_s: Measured times (m,).
        observed_energy_j: Measured total energies (m,).
        observed_static_power_w: Static power of each measurement (m,).
        chosen: Indices already chosen for this batch by earlier passes (their
            predicted points may be treated as if measured).
        rng: Random generator for tie-breaking and random passes.
        features: Features of every candidate (n, d), or ``None``.
        observed_index: Candidate index of each measured point (m,), ``-1`` where a
            measured point is not a candidate; ``None`` if unknown.
    """

    prediction: ObjectivePrediction
    available: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=bool))
    observed_time_s: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=float))
    observed_energy_j: np.ndarray = attrs.field(converter=lambda a: np.asarray(a, dtype=float))
    observed_static_power_w: np.ndarray = attrs.field(
        converter=lambda a: np.asarray(a, dtype=float))
    chosen: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int64),
                                     converter=lambda a: np.asarray(a, dtype=np.int64))
    rng: np.random.Generator = attrs.field(factory=lambda: np.random.default_rng(0))
    features: np.ndarray | None = None
    observed_index: np.ndarray | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.prediction)
        if self.available.shape != (n,):
            raise ArgumentError(f"available must have shape ({n},), got {self.available.shape}")
        m = len(self.observed_time_s)
        if self.observed_energy_j.shape != (m,) or self.observed_static_power_w.shape != (m,):
            raise ArgumentError("observed_time_s, observed_energy_j and observed_static_power_w "
                             "must have the same length")
        _as_index_array(self.chosen, n, "chosen")
        if self.features is not None and (self.features.ndim != 2 or len(self.features) != n):
            raise ArgumentError(f"features must have shape ({n}, d)")
        if self.observed_index is not None and np.shape(self.observed_index) != (m,):
            raise ArgumentError(f"observed_index must have shape ({m},)")

    @property
    def n_candidates(self) -> int:
        """Candidates in the context (rows of the predictions)."""
        return len(self.prediction)

    def observed(self, energy: str) -> np.ndarray:
        """Measured points (m, 2) in (time, ``energy``) with energy total/dynamic/static."""
        static = self.observed_static_power_w * self.observed_time_s
        if energy == "total":
            e = self.observed_energy_j
        elif energy == "dynamic":
            e = self.observed_energy_j - static
        elif energy == "static":
            e = static
        else:
            raise ArgumentError(f"energy must be one of {_ENERGIES}, got {energy!r}")
        return np.column_stack([self.observed_time_s, e])

    def with_chosen(self, chosen: Sequence[int] | np.ndarray) -> AcquisitionContext:
        """A copy in which ``chosen`` are also chosen (and no longer available)."""
        add = np.asarray(chosen, dtype=np.int64)
        available = self.available.copy()
        available[add] = False
        return attrs.evolve(self, available=available,
                            chosen=np.concatenate([self.chosen, add]))


class AcquisitionPass(abc.ABC):
    """Picks candidates for one share of a batch.

    Subclasses implement [`select`][kareus.search.AcquisitionPass.select]. A pass must return at
    most ``k`` distinct indices of available candidates (fewer only if fewer are available), and
    must not modify the context.
    """

    @abc.abstractmethod
    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """Indices (into the context's candidates) of up to ``k`` candidates, best first."""

    @property
    def name(self) -> str:
        """Short label for logs and tables."""
        return type(self).__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _top_k(score: np.ndarray, available: np.ndarray, k: int, rng: np.random.Generator
           ) -> np.ndarray:
    """Indices of the k highest scores among available candidates, ties broken at random."""
    idx = np.flatnonzero(available)
    if k <= 0 or idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    jitter = rng.random(idx.size)
    order = np.lexsort((jitter, -score[idx]))
    return idx[order[:k]].astype(np.int64)


def _epsilon_distance(cand: np.ndarray, front: np.ndarray) -> np.ndarray:
    """Multiplicative distance of each candidate to a front (0 for non-dominated ones):
    min over front points f of max(c_x / f_x, c_y / f_y) - 1, floored at 0."""
    if len(front) == 0:
        return np.zeros(len(cand))
    f = np.maximum(front, 1e-300)
    ratio = np.maximum(cand[:, None, 0] / f[None, :, 0], cand[:, None, 1] / f[None, :, 1])
    return np.maximum(ratio.min(axis=1) - 1.0, 0.0)


class HypervolumePass(AcquisitionPass):
    """Hypervolume improvement of predicted points over the measured front.

    The objectives are (time, ``energy``). Candidates whose predicted point the front
    dominates score by how far the front dominates them (closest first), so the pass
    always fills its share.

    Args:
        energy: ``"total"``, ``"dynamic"`` or ``"static"`` energy.
        greedy: Pick one candidate at a time and add its predicted point to the front
            before scoring the next (so one batch spreads along the front rather than
            piling onto one region); ``False`` = the top ``k`` scores against the
            measured front alone. Candidates chosen by earlier passes of the same batch
            join the front when ``greedy``.
        optimism: Score the point ``optimism`` spreads below the mean in log space
            (time and dynamic energy each); 0 = the mean (needs no spread).
        margin: Reference point = (1 + margin) x the worst measured value of each objective.
        front: ``"measured"`` = the front of the measured values; ``"denoised"`` = the
            front of the *predicted* values of the measured configurations (the surrogate
            averages noise out; a point measured with lucky noise then no longer hides
            the candidates around it). Needs ``observed_index`` in the context, else
            falls back to ``"measured"``.
    """

    def __init__(self, energy: str = "total", *, greedy: bool = True, optimism: float = 0.0,
                 margin: float = 0.1, front: str = "measured") -> None:
        if front not in ("measured", "denoised"):
            raise ArgumentError(f"front must be 'measured' or 'denoised', got {front!r}")
        self.front = front
        if energy not in _ENERGIES:
            raise ArgumentError(f"energy must be one of {_ENERGIES}, got {energy!r}")
        check_number("optimism", optimism, minimum=0)
        check_number("margin", margin, positive=True)
        self.energy = energy
        self.greedy = bool(greedy)
        self.optimism = float(optimism)
        self.margin = float(margin)

    @property
    def name(self) -> str:
        """``hv-<energy>``, with ``-optimistic<k>`` when optimistic."""
        return f"hv-{self.energy}" + (f"-optimistic{self.optimism:g}" if self.optimism else "")

    def predicted_points(self, context: AcquisitionContext) -> np.ndarray:
        """The scored point of each candidate: (n, 2) in (time, energy)."""
        p = context.prediction
        t, d = p.time_s, p.dynamic_energy_j
        if self.optimism > 0:
            if p.time_spread is not None:
                t = t * np.exp(-self.optimism * p.time_spread)
            if p.dynamic_spread is not None:
                d = d * np.exp(-self.optimism * p.dynamic_spread)
        if self.energy == "total":
            e = t * p.static_power_w + d
        elif self.energy == "dynamic":
            e = d
        else:
            e = t * p.static_power_w
        return np.column_stack([t, e])

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """The ``k`` available candidates of largest hypervolume improvement."""
        available = context.available.copy()
        if k <= 0 or not available.any():
            return np.zeros(0, dtype=np.int64)
        pts = self.predicted_points(context)
        observed = context.observed(self.energy)
        where = context.observed_index
        if self.front == "denoised" and where is not None and len(where) and (where >= 0).all():
            p = context.prediction
            t, d = p.time_s[where], p.dynamic_energy_j[where]
            e = {"total": t * p.static_power_w + d, "dynamic": d,
                 "static": t * p.static_power_w}[self.energy]
            observed = np.column_stack([t, e])
        if len(observed) == 0:
            # Nothing measured: no front to improve on; the fastest predicted first.
            return _top_k(-pts[:, 0], available, k, context.rng)
        ref = reference_point(observed, self.margin)
        front = pareto_front(observed)
        if self.greedy and context.chosen.size:
            front = pareto_front(np.vstack([front, pts[context.chosen]]))
        picks: list[int] = []
        rounds = k if self.greedy else 1
        for _ in range(rounds):
            if not available.any():
                break
            score = self._score(pts, front, ref)
            take = _top_k(score, available, 1 if self.greedy else k, context.rng)
            picks.extend(int(i) for i in take)
            available[take] = False
            if self.greedy:
                front = pareto_front(np.vstack([front, pts[take]]))
        return np.asarray(picks, dtype=np.int64)

    @staticmethod
    def _score(pts: np.ndarray, front: np.ndarray, ref: np.ndarray) -> np.ndarray:
        hvi = hypervolume_improvement(pts, front, ref)
        # Positive improvements rank above every dominated candidate; dominated ones rank
        # by closeness to the front.
        return np.where(hvi > 0, hvi, -_epsilon_distance(pts, front) - 1e-300)

    def __repr__(self) -> str:
        return (f"HypervolumePass(energy={self.energy!r}, greedy={self.greedy}, "
                f"optimism={self.optimism})")


def _front_centres(context: AcquisitionContext, front: str) -> list[int]:
    """Candidate indices of the measured configurations on the front in (time, total
    energy) or in (time, dynamic energy), on their predicted values when ``front`` is
    ``"denoised"``. Needs ``observed_index``."""
    where = context.observed_index
    assert where is not None
    centres: set[int] = set()
    for e in ("total", "dynamic"):
        pts = context.observed(e)
        if front == "denoised":
            p = context.prediction
            t, d = p.time_s[where], p.dynamic_energy_j[where]
            pts = np.column_stack([t, t * p.static_power_w + d if e == "total" else d])
        centres |= {int(i) for i in where[pareto_mask(pts)]}
    return sorted(centres)


class NeighbourhoodPass(AcquisitionPass):
    """Exploitation: hypervolume improvement among the neighbours of the front's configurations.

    A partition's front holds about one point per clock frequency, and neighbouring
    frequencies share nearly the same best SM count and slot; tree surrogates predict
    in plateaus, so a pass over the whole space picks at random among many candidates
    that look alike. This pass looks only near the front: at configurations that differ
    from a configuration on the front of the measured ones in exactly one knob (a group
    of feature columns), by at most that knob's ``steps`` distinct values (``None``: any
    value). Feature columns in no knob (derived features) are ignored. The front is taken
    in (time, total energy) and in (time, dynamic energy), on the *predicted* values of
    the measured configurations (``front="denoised"``) so that a point measured with
    lucky noise does not pull the search to it. Neighbours
    are ranked as [`HypervolumePass`][kareus.search.HypervolumePass] ranks candidates; when fewer
    than ``k`` are available (or the context has no ``features`` / ``observed_index``), the rest of
    the share falls back to that plain hypervolume pass over every candidate.

    Args:
        energy: ``"total"``, ``"dynamic"`` or ``"static"``: the objective of the ranking.
        knobs: Feature column groups, one per knob; ``None`` = ConfigSpace's features:
            frequency (0), SM count (1), launch slot (2, 3, 4), and, in a space of several
            collective backends, the backend (the columns from
            ``EXTRA_COLUMNS_FROM`` on, any value).
        steps: Radius per knob in distinct values, ``None`` = any value; ``None`` =
            ``(None, 4, None)``: any frequency (a sweep), SM count +-4 steps, any slot.
        front: ``"denoised"`` or ``"measured"`` (see
            [`HypervolumePass`][kareus.search.HypervolumePass]).
    """

    def __init__(self, energy: str = "total", *,
                 knobs: Sequence[Sequence[int]] | None = None,
                 steps: Sequence[int | None] | None = None, front: str = "denoised") -> None:
        self._default_knobs = knobs is None
        self.knobs = tuple(tuple(int(c) for c in k) for k in (knobs or ((0,), (1,), (2, 3, 4))))
        self.steps = tuple(steps) if steps is not None else (
            (None, 4, None) if knobs is None else (None,) * len(self.knobs))
        if len(self.steps) != len(self.knobs):
            raise ArgumentError("steps needs one radius per knob")
        if any(st is not None and st < 1 for st in self.steps):
            raise ArgumentError(f"steps must be >= 1 or None, got {self.steps}")
        self._hv = HypervolumePass(energy, front=front)
        self.energy = energy
        self.front = front

    @property
    def name(self) -> str:
        """``local``."""
        return "local"

    def neighbours(self, context: AcquisitionContext) -> list[np.ndarray]:
        """Per knob, the mask (n,) of available neighbours of the front's configurations
        along that knob."""
        n = context.n_candidates
        feats, where = context.features, context.observed_index
        knobs, steps = self.knobs, self.steps
        if self._default_knobs and feats is not None and feats.shape[1] > EXTRA_COLUMNS_FROM:
            knobs = (*knobs, tuple(range(EXTRA_COLUMNS_FROM, feats.shape[1])))
            steps = (*steps, None)
        masks = [np.zeros(n, dtype=bool) for _ in knobs]
        if feats is None or where is None or len(where) == 0 or (where < 0).any():
            return masks
        ranks = np.column_stack([np.unique(feats[:, c], return_inverse=True)[1]
                                 for c in range(feats.shape[1])])
        cols = sorted({j for knob in knobs for j in knob if j < feats.shape[1]})
        for c in _front_centres(context, self.front):
            same = feats == feats[c]
            for m, knob, radius in zip(masks, knobs, steps):
                others = [j for j in cols if j not in knob]
                near = same[:, others].all(axis=1) if others else np.ones(n, dtype=bool)
                if radius is not None:
                    for j in knob:
                        near &= np.abs(ranks[:, j] - ranks[c, j]) <= radius
                m |= near
        return [m & context.available for m in masks]

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """Up to ``k`` available neighbours of the front, best improvement first."""
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        masks = self.neighbours(context)
        picks: list[int] = []
        ctx = context
        # Round robin over the knobs, so that one knob's neighbours (say, the sweep over
        # frequencies) cannot crowd out another's (a step in SM count); it starts at a
        # random knob, since a small share may not get round them all.
        start = int(context.rng.integers(len(masks))) if masks else 0
        masks = masks[start:] + masks[:start]
        while len(picks) < k and any(m.any() for m in masks):
            for m in masks:
                if len(picks) >= k:
                    break
                m &= ctx.available
                if not m.any():
                    continue
                got = self._hv.select(attrs.evolve(ctx, available=m), 1)
                picks.extend(int(i) for i in got)
                ctx = ctx.with_chosen(got)
        if len(picks) < k:
            picks.extend(int(i) for i in self._hv.select(ctx, k - len(picks)))
        return np.asarray(picks, dtype=np.int64)

    def __repr__(self) -> str:
        return (f"NeighbourhoodPass(energy={self.energy!r}, knobs={self.knobs}, "
                f"steps={self.steps}, front={self.front!r})")


class HingePass(AcquisitionPass):
    """Exploitation along the SM axis: bisection toward the hinge.

    At one clock and launch slot, a partition's time over the collective's SM count is a
    hinge: with too few SMs the collective outlasts the computation beside it and the
    time falls about as 1/SMs; once it hides, every further SM is taken from the
    computation and the time rises slowly (0.1-0.3% per SM on the emulator). The
    front's configuration at that clock sits at or just past the corner. Past it, the
    differences are under the profiling noise and tree surrogates predict a plateau, so
    the hypervolume passes pick among "equally good" SM counts at random and a search
    can settle several SMs above the corner for good.

    This pass proposes, for each configuration on the front (of the *predicted* values
    of the measured configurations, in time against total and against dynamic energy),
    the SM count halfway between its own and the next smaller one measured at the same
    clock and slot (half its own when none is measured). Repeated over batches this
    bisects the gap until the SM count just below a front configuration has been
    measured: the corner is then bracketed by measurements, not by the surrogate. The
    largest gaps go first (ties at random). Only the SM count moves; the gap is counted in
    the distinct SM values of the space. When it has fewer than ``k`` proposals, the
    rest of its share is filled by [`HypervolumePass`][kareus.search.HypervolumePass] in (time,
    total energy).

    Args:
        sm_column: Feature column of the SM count.
        group_columns: Feature columns that must match the front configuration's (clock
            and launch slot): ConfigSpace's frequency (0) and slot features (2, 3, 4).
        extra_group_from: Every column from this one on must match too (``None``: none):
            by default ``EXTRA_COLUMNS_FROM``, so that in a space of
            several collective backends the bisection stays within one backend, whose
            hinge is its own.
        front: ``"denoised"`` or ``"measured"`` (see
            [`HypervolumePass`][kareus.search.HypervolumePass]).
    """

    def __init__(self, *, sm_column: int = 1, group_columns: Sequence[int] = (0, 2, 3, 4),
                 extra_group_from: int | None = EXTRA_COLUMNS_FROM,
                 front: str = "denoised") -> None:
        self.sm_column = int(sm_column)
        self.group_columns = tuple(int(c) for c in group_columns)
        self.extra_group_from = None if extra_group_from is None else int(extra_group_from)
        if self.sm_column in self.group_columns or (
                self.extra_group_from is not None and self.sm_column >= self.extra_group_from):
            raise ArgumentError("sm_column cannot also be a group column")
        self._hv = HypervolumePass("total", front=front)
        self.front = front

    @property
    def name(self) -> str:
        """``hinge``."""
        return "hinge"

    def proposals(self, context: AcquisitionContext) -> np.ndarray:
        """The bisection candidates, largest gap first (ties in random order)."""
        feats, where = context.features, context.observed_index
        if (feats is None or where is None or len(where) == 0 or (where < 0).any()
                or max((self.sm_column, *self.group_columns)) >= feats.shape[1]):
            return np.zeros(0, dtype=np.int64)
        levels = np.unique(feats[:, self.sm_column])
        rank = np.searchsorted(levels, feats[:, self.sm_column])
        measured = np.zeros(context.n_candidates, dtype=bool)
        measured[where] = True
        cols = list(self.group_columns)
        if self.extra_group_from is not None:
            cols += [j for j in range(self.extra_group_from, feats.shape[1]) if j not in cols]
        found: dict[int, float] = {}
        for c in _front_centres(context, self.front):
            group = (feats[:, cols] == feats[c, cols]).all(axis=1)
            below = rank[group & measured & (rank < rank[c])]
            lower = int(below.max()) if below.size else -1
            gap = int(rank[c]) - lower
            if gap <= 1:
                continue  # the SM count just below is measured: the corner is bracketed
            mid = (rank[c] + lower + 1) // 2 if lower >= 0 else rank[c] // 2
            mid = min(max(int(mid), lower + 1), int(rank[c]) - 1)
            j = np.flatnonzero(group & (rank == mid) & context.available)
            if j.size:
                found[int(j[0])] = max(found.get(int(j[0]), 0), gap)
        if not found:
            return np.zeros(0, dtype=np.int64)
        idx = np.fromiter(found, dtype=np.int64)
        gaps = np.fromiter(found.values(), dtype=float)
        order = np.lexsort((context.rng.random(idx.size), -gaps))
        return idx[order]

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """The bisection candidates first, then the hypervolume pass's picks."""
        if k <= 0 or not context.available.any():
            return np.zeros(0, dtype=np.int64)
        picks = [int(i) for i in self.proposals(context)[:k]]
        if len(picks) < k:
            rest = self._hv.select(context.with_chosen(picks), k - len(picks))
            picks.extend(int(i) for i in rest)
        return np.asarray(picks, dtype=np.int64)

    def __repr__(self) -> str:
        return (f"HingePass(sm_column={self.sm_column}, group_columns={self.group_columns}, "
                f"extra_group_from={self.extra_group_from}, front={self.front!r})")


class UncertaintyPass(AcquisitionPass):
    """The candidates with the largest predicted spread (exploration).

    The spread is sqrt(time spread^2 + dynamic-energy spread^2), each relative (log
    space). Without a spread (a surrogate that gives none) it picks uniformly at random.
    """

    @property
    def name(self) -> str:
        """``uncertainty``."""
        return "uncertainty"

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """The ``k`` available candidates of largest spread (random without one)."""
        spread = context.prediction.spread
        if spread is None:
            return RandomPass().select(context, k)
        return _top_k(np.asarray(spread, dtype=float), context.available, k, context.rng)


class FastestPass(AcquisitionPass):
    """The candidates with the lowest predicted time."""

    @property
    def name(self) -> str:
        """``fastest``."""
        return "fastest"

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """The ``k`` available candidates of lowest predicted time."""
        return _top_k(-context.prediction.time_s, context.available, k, context.rng)


class RandomPass(AcquisitionPass):
    """Uniformly random available candidates."""

    @property
    def name(self) -> str:
        """``random``."""
        return "random"

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """``k`` available candidates drawn uniformly with the context's rng."""
        idx = np.flatnonzero(context.available)
        if k <= 0 or idx.size == 0:
            return np.zeros(0, dtype=np.int64)
        return context.rng.choice(idx, size=min(k, idx.size), replace=False).astype(np.int64)


class ClockSweepPass(AcquisitionPass):
    """Each clock's own front in (time, dynamic energy): what the microbatch composer takes.

    The composer sums, at each clock frequency, the fronts of every partition type in
    (time, *dynamic* energy) ([`MicrobatchComposer`][kareus.compose.MicrobatchComposer]), so
    a type needs good measured configurations at every clock the plans run, not only where
    its front in (time, total energy) lies. This pass scores each candidate by the
    hypervolume its predicted point adds to the front of the configurations measured *at its
    own clock* (their predicted values, denoised), relative to that clock's reference point
    ((1 + ``margin``) x its worst measured time and dynamic energy) so clocks weigh alike,
    and picks greedily: each pick joins its clock's front before the next is scored, so a
    batch spreads over the clocks where the model predicts the largest gain instead of
    piling onto one. A clock with nothing measured scores against the reference
    (1 + ``margin``) x its best predicted time and dynamic energy. Column 0 of the context's
    ``features`` is the clock (MHz, as ``search_features`` gives); without ``features``
    or ``observed_index`` it falls back to
    [`HypervolumePass("dynamic")`][kareus.search.HypervolumePass].

    Args:
        margin: Reference point of each clock's front, as a fraction beyond its worst point.
    """

    def __init__(self, *, margin: float = 0.1) -> None:
        check_number("margin", margin, positive=True)
        self.margin = float(margin)

    @property
    def name(self) -> str:
        """``clock-sweep``."""
        return "clock-sweep"

    def select(self, context: AcquisitionContext, k: int) -> np.ndarray:
        """Up to ``k`` available candidates, greedily by relative hypervolume improvement of
        their clock's front in (time, dynamic energy)."""
        available = context.available.copy()
        if k <= 0 or not available.any():
            return np.zeros(0, dtype=np.int64)
        where = context.observed_index
        if context.features is None or where is None or (len(where) and (where < 0).any()):
            return HypervolumePass("dynamic", front="denoised").select(context, k)
        p = context.prediction
        pts = np.column_stack([p.time_s, p.dynamic_energy_j])
        clock = np.asarray(context.features[:, 0])
        fronts: dict[float, np.ndarray] = {}
        refs: dict[float, np.ndarray] = {}
        members: dict[float, np.ndarray] = {}
        for f in np.unique(clock):
            members[f] = np.flatnonzero(clock == f)
            measured = where[clock[where] == f]
            chosen = context.chosen[clock[context.chosen] == f]
            known = np.concatenate([measured, chosen])
            fronts[f] = pareto_front(pts[known]) if known.size else np.zeros((0, 2))
            # the reference of the clock's measured front (of what was chosen with nothing
            # measured there; of its best predicted values with neither)
            refs[f] = (reference_point(pts[measured if measured.size else known], self.margin)
                       if known.size else (1 + self.margin) * pts[members[f]].min(axis=0))
        score = np.full(len(pts), -np.inf)

        def rescore(f: float) -> None:
            i = members[f]
            ref, front = refs[f], fronts[f]
            hvi = hypervolume_improvement(pts[i], front, ref) / float(ref[0] * ref[1])
            score[i] = np.where(hvi > 0, hvi, -_epsilon_distance(pts[i], front) - 1.0)

        for f in members:
            rescore(f)
        picks: list[int] = []
        for _ in range(k):
            if not available.any():
                break
            take = _top_k(score, available, 1, context.rng)
            i = int(take[0])
            picks.append(i)
            available[i] = False
            f = clock[i]
            fronts[f] = pareto_front(np.vstack([fronts[f], pts[[i]]]))
            rescore(f)
        return np.asarray(picks, dtype=np.int64)

    def __repr__(self) -> str:
        return f"ClockSweepPass(margin={self.margin})"


def allocate(weights: Sequence[float], k: int, *, remainder: str = "largest") -> list[int]:
    """Split ``k`` slots by ``weights``.

    Each share gets the floor of its exact share; the slots left over go, with
    ``remainder="largest"``, to the largest fractional parts (ties to the earlier pass),
    or, with ``remainder="last"``, all to the last pass (the reference artifact's rule:
    "the rest" is exploration).

    >>> allocate([0.4, 0.2, 0.2, 0.2], 32)
    [13, 7, 6, 6]
    >>> allocate([0.4, 0.2, 0.2, 0.2], 32, remainder="last")
    [12, 6, 6, 8]
    """
    if remainder not in ("largest", "last"):
        raise ArgumentError(f"remainder must be 'largest' or 'last', got {remainder!r}")
    w = np.asarray(weights, dtype=float)
    if w.ndim != 1 or w.size == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise ArgumentError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    k = check_count("k", k, minimum=0)
    exact = w / w.sum() * k
    counts = np.floor(exact + 1e-9).astype(int)
    rest = k - int(counts.sum())
    if rest > 0 and remainder == "last":
        counts[-1] += rest
    elif rest > 0:
        frac = exact - counts
        order = np.lexsort((np.arange(w.size), -np.round(frac, 9)))
        for i in order[:rest]:
            counts[i] += 1
    return [int(c) for c in counts]
