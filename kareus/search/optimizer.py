"""Multi-pass multi-objective Bayesian search for one partition type's frontier.

Profiling a configuration on real GPUs costs about 13 s (FACTS.md) and a space
holds thousands of them, so :class:`MultiPassSearch` profiles few: a space-filling
initial design, then batches chosen by :mod:`acquisition passes
<kareus.search.acquisition>` from :mod:`surrogate <kareus.search.surrogate>`
predictions of time and dynamic energy on every configuration not yet measured.
It stops at the budget, or earlier when the measured front stops improving
(hypervolume gain below a tolerance over a few batches).

The core is ask/tell, so real GPUs, the emulator and recorded data drive the same
optimizer::

    search = MultiPassSearch(space, budget=128, seed=0, log="fwd_attn.jsonl")
    while batch := search.ask():
        search.tell_many([(c, profiler.measure(partition, c)) for c in batch])
    frontier = search.frontier()

or simply ``frontier = search.run(profiler)``. Every measurement is appended to a
versioned JSONL log as it is told; ``resume=PATH`` replays a log (validating that it
belongs to the same partition, GPU, space and seed) and continues where the search
stopped: nothing is measured twice and nothing told is lost. Configurations asked
but not yet told when the search was killed are asked again first, so a resumed
search makes exactly the choices an uninterrupted one would have made.

The result is a :class:`~kareus.search.frontier.PartitionFrontier`: the measured
Pareto points with their configurations, plus every observation.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kareus._version import __version__
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.partition import Partition
from kareus.search._progress import ProgressBar
from kareus.search.acquisition import (
    AcquisitionContext,
    AcquisitionPass,
    HingePass,
    HypervolumePass,
    NeighbourhoodPass,
    RandomPass,
    UncertaintyPass,
    allocate,
)
from kareus.search.frontier import Observation, PartitionFrontier
from kareus.search.pareto import hypervolume, pareto_front, reference_point
from kareus.search.surrogate import (
    BootstrapEnsemble,
    GaussianProcessSurrogate,
    ObjectiveModel,
    Surrogate,
    XGBoostSurrogate,
)

__all__ = [
    "LOG_FORMAT",
    "LOG_VERSION",
    "SURROGATES",
    "MultiPassSearch",
    "anchor_indices",
    "default_passes",
    "default_surrogate",
    "facts_passes",
    "maximin_design",
    "search_features",
    "tree_surrogate",
]

LOG_FORMAT = "kareus-search-log"
LOG_VERSION = 1


def default_passes() -> list[tuple[AcquisitionPass, float]]:
    """kareus's default pass mix: 30/10/20/10/10.

    30% hypervolume improvement in (time, total energy), 10% in (time, dynamic energy),
    20% exploitation near the front (:class:`~kareus.search.acquisition.NeighbourhoodPass`),
    10% exploration by bootstrap uncertainty in its optimistic form (hypervolume
    improvement in (time, total energy) of the point two ensemble spreads below the
    mean), 10% bisection toward the fewest SMs that keep a front configuration's time
    (:class:`~kareus.search.acquisition.HingePass`). Every hypervolume score is taken
    against the *denoised* front (the predicted values of the measured configurations).
    In batches of 8 that is 3/1/2/1/1.

    FACTS.md's mix (:func:`facts_passes`) is four passes in shares 40/20/20/20: the same
    first two, then lowest predicted time (= hypervolume in (time, static energy)) and the
    largest spread alone. On the emulator with 1% noise the passes here found better
    fronts with the same profiles, and giving the hinge pass its batch slot from the
    dynamic-energy pass did better in median and mean than every 40/20/20/20 arrangement
    of these passes that was tried (docs/search.md); pass ``passes=facts_passes()`` for
    the published mix.
    """
    return [(HypervolumePass("total", front="denoised"), 0.3),
            (HypervolumePass("dynamic", front="denoised"), 0.1),
            (NeighbourhoodPass(), 0.2),
            (HypervolumePass("total", front="denoised", optimism=2.0), 0.1),
            (HingePass(), 0.1)]


def facts_passes() -> list[tuple[AcquisitionPass, float]]:
    """FACTS.md's pass mix: 40% hypervolume improvement in (time, total energy), 20% in (time,
    dynamic energy), 20% in (time, static energy) (= lowest predicted time beyond the
    fastest measured point), 20% uncertainty, all against the measured front."""
    return [(HypervolumePass("total"), 0.4), (HypervolumePass("dynamic"), 0.2),
            (HypervolumePass("static"), 0.2), (UncertaintyPass(), 0.2)]


def default_surrogate(seed: int = 0) -> Surrogate:
    """The default surrogate template: a :class:`GaussianProcessSurrogate` (Matern 5/2,
    one length scale per feature) on ConfigSpace's physical features, columns 0-4 of
    :func:`search_features` (MHz, SMs, slot position, slot log intensity, sequential), with
    the SM count on a log scale.

    On the emulator with 1% noise it finds better fronts with the same profiles than the
    tree ensemble (:func:`tree_surrogate`, the default before): over the benchmark's 28
    partitions a median hypervolume ratio of 0.993 against 0.987 after 64 profiles
    (docs/search.md). A GP interpolates between the SM counts it measured and pools
    neighbouring clocks; trees predict a plateau there and cannot tell where the time
    stops falling. ``seed`` is accepted for symmetry (the GP's fit is deterministic).
    """
    return GaussianProcessSurrogate(features=(0, 1, 2, 3, 4), log_features=(1,), seed=seed)


def tree_surrogate(seed: int = 0) -> Surrogate:
    """The tree ensemble: a :class:`BootstrapEnsemble` of five :class:`XGBoostSurrogate`
    on 80% subsamples (as FACTS.md's reference artifact), each with a linear trend in
    frequency (feature column 0) under its trees. It reads every column of
    :func:`search_features`, including the SM-per-clock ratios and the hide balance
    that help trees follow the diagonal ridge of the best SM count."""
    return BootstrapEnsemble(base=XGBoostSurrogate(trend_features=(0,)), n_models=5,
                             fraction=0.8, seed=seed)


#: Surrogate templates by name (``seed -> Surrogate``), for ``optimize(surrogate=...)``,
#: ``kareus optimize --surrogate`` and the benchmarks.
SURROGATES: dict[str, Callable[[int], Surrogate]] = {"gp": default_surrogate,
                                                     "trees": tree_surrogate}


# ------------------------------------------------------------------------ features


def search_features(space: ConfigSpace) -> np.ndarray:
    """The surrogates' features, one row per configuration of ``space``.

    Columns: 0-4 ConfigSpace's physical features (MHz, SMs, slot position, slot log
    intensity, sequential); 5 the SM count per relative clock, ``comm_sms x max MHz /
    MHz``; 6 the hide balance (:func:`_hide_balance`); 7 the SM count per relative clock
    squared, ``comm_sms x (max MHz / MHz)^2``.

    Whether a collective hides behind the computation is a balance between its speed
    (about proportional to its SMs until the link saturates) and the computation's
    (about proportional to the clock), so the best SM count grows with the clock: a
    diagonal ridge in (MHz, SMs), which axis-aligned trees need many splits to follow
    and which is a single threshold in the ratio. How fast it grows depends on the
    partition: on the emulated A100, ``qwen3-1.7b``'s attention all-reduces want 29 SMs
    at 1410 MHz and 11 at 900 MHz (about clock^2.2), other partitions the same few SMs at
    every clock. Columns 5 and 7 are that ridge for an exponent of 1 and of 2; the trees
    split on whichever lines the data up. The hide balance also accounts for the launch
    slot and for how compute-bound the overlapped ops are.
    """
    base = space.features()
    rel = max(space.freqs_mhz) / base[:, 0]
    return np.column_stack([base, base[:, 1] * rel, _hide_balance(space),
                            base[:, 1] * rel ** 2])


def _hide_balance(space: ConfigSpace) -> np.ndarray:
    """log(rough collective time / rough computation time from the launch slot on).

    A datasheet-only estimate, per configuration: the collective's bus bytes over its SM
    count (its speed grows with SMs until the link saturates, and weakly with the clock),
    against the roofline time of the ops from the slot to the end at that clock (the
    compute-bound part scales with 1/clock, the memory-bound part does not). The
    collective hides where this crosses a partition-specific constant, the same for every
    clock and slot, so the trees find the hinge with one split on it instead of one per
    (clock, slot). Sequential configurations get one more than the largest value.
    """
    part, gpu = space.partition, space.gpu
    comm = part.comm_op
    out = np.zeros(len(space), dtype=np.float64)
    if comm is None or not part.compute_ops:
        return out
    fmax = float(gpu.max_clock_mhz)
    peak = gpu.bf16_peak_tflops * 1e12
    hbm = gpu.hbm_bandwidth_gbps * 1e9
    comp = np.array([op.flops / peak for op in part.compute_ops])
    mem = np.array([op.bytes_moved / hbm for op in part.compute_ops])
    start = {s.name: s.index for s in part.slots}
    bus = max(float(comm.bus_bytes), 1.0)
    seq = np.zeros(len(space), dtype=bool)
    for i, c in enumerate(space.configs):
        if c.launch_slot is None:
            seq[i] = True
            continue
        k = start[c.launch_slot]
        scale = fmax / c.freq_mhz
        t_after = float(np.maximum(comp[k:] * scale, mem[k:]).sum()) or 1e-12
        out[i] = math.log(bus * scale ** 0.25 / c.comm_sms / t_after)
    if seq.any():
        out[seq] = (out[~seq].max() + 1.0) if (~seq).any() else 0.0
    return out


# ------------------------------------------------------------------------ initial design


def _unit_coordinates(space: ConfigSpace) -> np.ndarray:
    """Each configuration as (freq, SMs, slot) in [0, 1] x [0, 1] x slot index.

    Both frequency and SM count are linear. (A logarithmic SM scale, which samples the
    small SM counts where a collective's speed changes fastest more densely, gave worse
    16-point designs on the emulator: most of those configurations leave the collective
    exposed and are far from the front; docs/search.md.)
    """
    cfgs = space.configs
    f = np.array([c.freq_mhz for c in cfgs], dtype=float)
    s = np.array([c.comm_sms for c in cfgs], dtype=float)
    slot_of = {name: i for i, name in enumerate(space.slots)}
    sl = np.array([slot_of[c.launch_slot] for c in cfgs], dtype=float)

    def unit(v: np.ndarray) -> np.ndarray:
        span = v.max() - v.min()
        return (v - v.min()) / span if span > 0 else np.zeros_like(v)

    return np.column_stack([unit(f), unit(s), sl])


def maximin_design(space: ConfigSpace, n: int, *, seed: int = 0, tries: int = 64) -> list[int]:
    """A space-filling design of ``n`` distinct configurations (indices into ``space.configs``).

    Latin-hypercube samples in (frequency, SM count), with launch slots (sequential
    included) balanced so each appears ``n // slots`` or ``n // slots + 1`` times; of
    ``tries`` such designs, the one whose closest pair of points is farthest apart
    (maximin; a differing slot counts as distance 1) is kept.

    Args:
        space: The configuration space.
        n: Points (capped at the space's size).
        seed: Random seed.
        tries: Candidate designs to choose among.
    """
    n = min(int(n), len(space))
    if n <= 0:
        return []
    rng = np.random.default_rng([seed, 7919])
    coords = _unit_coordinates(space)
    freqs = np.array(sorted(set(coords[:, 0])))
    sms = np.array(sorted(set(coords[:, 1])))
    n_slots = len(space.slots)
    # Lookup from (freq level, sm level, slot) to config index.
    fi = np.searchsorted(freqs, coords[:, 0])
    si = np.searchsorted(sms, coords[:, 1])
    grid = np.full((len(freqs), len(sms), n_slots), -1, dtype=np.int64)
    grid[fi, si, coords[:, 2].astype(int)] = np.arange(len(coords))

    def nearest_level(levels: np.ndarray, x: np.ndarray) -> np.ndarray:
        return np.abs(levels[None, :] - x[:, None]).argmin(axis=1)

    best: list[int] | None = None
    best_score = -np.inf
    for _ in range(max(1, tries)):
        uf = (rng.permutation(n) + rng.random(n)) / n
        us = (rng.permutation(n) + rng.random(n)) / n
        slots = rng.permutation(np.resize(rng.permutation(n_slots), n))
        f_lv = nearest_level(freqs, uf)
        s_lv = nearest_level(sms, us)
        idx = grid[f_lv, s_lv, slots]
        chosen: list[int] = []
        used: set[int] = set()
        for i, j in enumerate(idx):
            if j < 0 or int(j) in used:
                # Collision on a coarse grid: the closest unused configuration.
                d = ((coords[:, 0] - freqs[f_lv[i]]) ** 2 + (coords[:, 1] - sms[s_lv[i]]) ** 2
                     + (coords[:, 2] != slots[i]))
                d[list(used)] = np.inf
                j = int(np.argmin(d))
            used.add(int(j))
            chosen.append(int(j))
        pts = coords[chosen]
        if n < 2:
            return chosen
        diff = pts[:, None, :2] - pts[None, :, :2]
        dist = np.sqrt((diff ** 2).sum(-1) + (pts[:, None, 2] != pts[None, :, 2]))
        np.fill_diagonal(dist, np.inf)
        score = float(dist.min())
        if score > best_score:
            best, best_score = chosen, score
    assert best is not None
    return best


def anchor_indices(space: ConfigSpace) -> list[int]:
    """The configurations a training job runs without kareus, where they lie in ``space``
    (indices into ``space.configs``): the maximum clock with the GPU's default SM count
    for communication (NCCL's), sequential and launched in the first slot.

    They are what Megatron-LM and nanobatching run (``kareus.compose.baselines.anchor_configs``
    returns them), and the fastest end of a front is often at the maximum
    clock, where the surrogates, which see time nearly flat in frequency once a
    collective is exposed, would not look: a front missing its fastest point loses much
    of its hypervolume.
    """
    g = space.gpu
    f = g.max_clock_mhz if g.max_clock_mhz in space.freqs_mhz else max(space.freqs_mhz)
    sms = g.default_comm_sms if g.default_comm_sms in space.comm_sms else max(space.comm_sms)
    slots = [sl for sl in space.slots if sl is not None]
    cands = [ScheduleConfig(f, sms, None)] + ([ScheduleConfig(f, sms, slots[0])] if slots
                                               else [])
    return [space.index(c) for c in cands if c in space]


# ---------------------------------------------------------------------------- the search


def _space_description(space: ConfigSpace) -> dict[str, Any]:
    return {"freqs_mhz": list(space.freqs_mhz), "comm_sms": list(space.comm_sms),
            "slots": list(space.slots)}


class MultiPassSearch:
    """Ask/tell multi-objective Bayesian search of one partition type's configuration space.

    Args:
        space: The configurations to search (one partition type on one GPU).
        surrogate: Template surrogate for time and dynamic energy (each gets a clone, fitted
            in log space); ``None`` = :func:`default_surrogate` (a Gaussian process: mean
            + posterior spread); :func:`tree_surrogate` is the XGBoost ensemble.
        passes: ``(pass, weight)`` pairs that fill each batch in proportion to their weights;
            ``None`` = :func:`default_passes` (30/10/20/10/10). A pass that cannot fill
            its share leaves it to the next passes, then to random picks.
        batch_size: Configurations per batch; ``None`` = 8.
        budget: Profiles in all; ``None`` = 224 (the reference artifact's budget). Capped at
            the space's size.
        initial_size: Profiles of the space-filling initial design; ``None`` = 16.
        initial_design: ``"maximin"`` (:func:`maximin_design`, space-filling) or
            ``"random"`` (uniform, as the reference artifact does).
        anchors: Whether the initial design starts with :func:`anchor_indices` (the
            maximum clock with the default SM count, sequential and in the first slot)
            and fills the rest of its points with the space-filling design; ``None`` =
            yes for ``"maximin"``, no for ``"random"``.
        allocation: How leftover batch slots are shared when weights do not divide the
            batch: ``"largest"`` remainders, or ``"last"`` pass (see
            :func:`~kareus.search.acquisition.allocate`).
        seed: Seed of the design, the surrogates and the tie-breaking.
        stop_patience: Stop when the measured front's hypervolume grew by less than
            ``stop_tol`` (relative) over the last ``stop_patience`` batches; ``None`` = never
            stop before the budget.
        stop_tol: Relative hypervolume gain below which the front counts as converged.
        stop: Whether to stop when the rule fires; ``False`` = only record when it fired
            (:attr:`converged_at`) and go on to the budget (for benchmarks).
        log: Path of a new JSONL log of every measurement (an existing non-empty file is an
            error: resume it instead).
        resume: Path of a log to continue (replayed, validated, then appended to); if the
            file does not exist yet, a new search starts logging there.
        progress: Show a progress bar on stderr in :meth:`run`; ``None`` = when stderr is a
            terminal.

    Raises:
        TypeError: for a space, surrogate or pass of the wrong type.
        ValueError: for bad sizes, or a resume log of another search.
    """

    def __init__(
        self,
        space: ConfigSpace,
        *,
        surrogate: Surrogate | None = None,
        passes: Sequence[tuple[AcquisitionPass, float]] | None = None,
        batch_size: int | None = None,
        budget: int | None = None,
        initial_size: int | None = None,
        initial_design: str = "maximin",
        anchors: bool | None = None,
        allocation: str = "largest",
        seed: int = 0,
        stop_patience: int | None = 4,
        stop_tol: float = 1e-3,
        stop: bool = True,
        log: str | os.PathLike[str] | None = None,
        resume: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
    ) -> None:
        if not isinstance(space, ConfigSpace):
            raise TypeError(f"space must be a kareus ConfigSpace, got {type(space).__name__}")
        if surrogate is not None and not isinstance(surrogate, Surrogate):
            raise TypeError(f"surrogate must be a kareus Surrogate, got "
                            f"{type(surrogate).__name__}")
        self.space = space
        self.seed = int(seed)
        self.surrogate = default_surrogate(self.seed) if surrogate is None else surrogate
        self.passes = self._check_passes(default_passes() if passes is None else passes)
        self.batch_size = 8 if batch_size is None else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.budget = min(224 if budget is None else int(budget), len(space))
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self.initial_size = min(16 if initial_size is None else int(initial_size),
                                self.budget)
        if self.initial_size < 1:
            raise ValueError(f"initial_size must be >= 1, got {initial_size}")
        if stop_patience is not None and stop_patience < 1:
            raise ValueError(f"stop_patience must be >= 1 or None, got {stop_patience}")
        if stop_tol < 0:
            raise ValueError(f"stop_tol must be >= 0, got {stop_tol}")
        if initial_design not in ("maximin", "random"):
            raise ValueError(f"initial_design must be 'maximin' or 'random', got "
                             f"{initial_design!r}")
        if allocation not in ("largest", "last"):
            raise ValueError(f"allocation must be 'largest' or 'last', got {allocation!r}")
        self.initial_design = initial_design
        self.allocation = allocation
        self.stop_patience = stop_patience
        self.stop_tol = float(stop_tol)
        self.stop = bool(stop)
        #: Profiles measured when the stop rule first fired (None: it has not).
        self.converged_at: int | None = None
        self.progress = progress

        n = len(space)
        self._features = search_features(space)
        self._observations: list[Observation] = []
        self._measured = np.zeros(n, dtype=bool)
        self._pending: list[int] = []
        self._batches = 0  # batches asked so far
        self._fronts: list[np.ndarray] = []  # measured front after each batch
        self._stopped: str | None = None
        self.anchors = (initial_design == "maximin") if anchors is None else bool(anchors)
        anchor = anchor_indices(space)[:self.initial_size] if self.anchors else []
        rest = self.initial_size - len(anchor)
        if rest <= 0:
            design: list[int] = []
        elif initial_design == "maximin":
            design = [i for i in maximin_design(space, rest, seed=self.seed) if i not in anchor]
            if len(design) < rest:  # the design hit an anchor: top up from a larger one
                more = maximin_design(space, rest + len(anchor), seed=self.seed)
                design += [i for i in more if i not in anchor and i not in design]
        else:
            rng = np.random.default_rng([self.seed, 104729])
            free = np.setdiff1d(np.arange(n), anchor) if anchor else n
            design = [int(i) for i in rng.choice(free, rest, replace=False)]
        self._initial = anchor + design[:rest]
        #: Seconds spent in :meth:`ask` per batch (search overhead: fitting, predicting,
        #: choosing), for benchmarks.
        self.ask_seconds: list[float] = []
        #: The pass that chose each configuration asked (config -> pass name).
        self.chosen_by: dict[ScheduleConfig, str] = {}

        self._log_path: Path | None = None
        if log is not None and resume is not None and Path(log) != Path(resume):
            raise ValueError("give either log= (a new search) or resume= (continue one), "
                             "or the same path to both")
        if resume is not None and Path(resume).exists() and Path(resume).stat().st_size > 0:
            self._replay(Path(resume))
            self._log_path = Path(resume)
        else:
            path = resume if resume is not None else log
            if path is not None:
                p = Path(path)
                if p.exists() and p.stat().st_size > 0:
                    raise FileExistsError(f"search log {p} already exists; pass resume={str(p)!r} "
                                          "to continue that search, or choose another path")
                p.parent.mkdir(parents=True, exist_ok=True)
                self._log_path = p
                self._write(self._header())

    # ---------------------------------------------------------------------- checking
    @staticmethod
    def _check_passes(passes: Sequence[tuple[AcquisitionPass, float]]
                      ) -> list[tuple[AcquisitionPass, float]]:
        out = []
        for item in passes:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError("passes must be (AcquisitionPass, weight) pairs, got "
                                f"{item!r}")
            p, w = item
            if not isinstance(p, AcquisitionPass):
                raise TypeError(f"not an AcquisitionPass: {p!r}")
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ValueError(f"pass weight must be a finite number >= 0, got {w!r}")
            out.append((p, float(w)))
        if not out or sum(w for _, w in out) <= 0:
            raise ValueError("passes need at least one pass with a positive weight")
        return out

    # ---------------------------------------------------------------------- state
    @property
    def observations(self) -> list[Observation]:
        """Every observation told, in order."""
        return list(self._observations)

    @property
    def n_measured(self) -> int:
        return len(self._observations)

    @property
    def pending(self) -> list[ScheduleConfig]:
        """Configurations asked but not told yet."""
        return [self.space.configs[i] for i in self._pending]

    @property
    def stopped_reason(self) -> str | None:
        """Why the search is done (``"budget"``, ``"converged"``, ``"exhausted"``), or None."""
        if self._stopped is not None:
            return self._stopped
        if self.n_measured >= self.budget:
            return "budget"
        if self._measured.all():
            return "exhausted"
        return None

    @property
    def done(self) -> bool:
        """Whether :meth:`ask` will return nothing more."""
        return not self._pending and self.stopped_reason is not None

    @property
    def hypervolume_history(self) -> list[float]:
        """Hypervolume of the measured front in (time, total energy) after each batch since
        the initial design, all against the reference point 1.1 x the worst time and energy
        of the latest front."""
        if not self._fronts:
            return []
        ref = reference_point(self._fronts[-1], 0.1)
        return [hypervolume(f, ref) for f in self._fronts]

    def frontier(self) -> PartitionFrontier:
        """The observations so far as a :class:`PartitionFrontier`."""
        return PartitionFrontier.from_observations(self.space.partition.name,
                                                   self.space.gpu.name, self._observations)

    # ---------------------------------------------------------------------- ask
    def ask(self) -> list[ScheduleConfig]:
        """The next batch to measure (empty when done).

        Configurations already asked and not yet told are returned again (once every
        one of them is told, a new batch is chosen). No configuration already measured
        is ever returned.
        """
        if self._pending:
            return self.pending
        if self.stopped_reason is not None:
            return []
        start = time.perf_counter()
        room = self.budget - self.n_measured
        if self.n_measured < self.initial_size:
            k = min(room, self.initial_size - self.n_measured)
            picks = [i for i in self._initial if not self._measured[i]][:k]
            if len(picks) < k:  # told configurations outside the design took its places
                rng = np.random.default_rng([self.seed, self._batches, 1])
                free = np.flatnonzero(~self._measured)
                free = free[~np.isin(free, picks)]
                picks += [int(i) for i in rng.choice(free, size=k - len(picks), replace=False)]
            names = ["initial"] * len(picks)
        else:
            k = min(room, self.batch_size)
            picks, names = self._choose(k)
        self._batches += 1
        self._pending = list(picks)
        for i, name in zip(picks, names):
            self.chosen_by[self.space.configs[i]] = name
        self.ask_seconds.append(time.perf_counter() - start)
        self._write({"kind": "ask", "batch": self._batches,
                     "configs": [self.space.configs[i].to_dict() for i in picks],
                     "passes": names})
        return self.pending

    def _context(self) -> AcquisitionContext:
        obs = self._observations
        idx = np.array([self.space.index(o.config) for o in obs], dtype=np.int64)
        t = np.array([o.time_s for o in obs])
        e = np.array([o.energy_j for o in obs])
        sp = np.array([o.measurement.static_power_w for o in obs])
        static = float(np.median(sp))
        model = ObjectiveModel(self.surrogate, seed=self.seed * 7919 + self._batches)
        model.fit(self._features[idx], t, e - sp * t, static)
        prediction = model.predict(self._features)
        available = ~self._measured
        available[self._pending] = False
        rng = np.random.default_rng([self.seed, self._batches])
        return AcquisitionContext(prediction=prediction, available=available,
                                  observed_time_s=t, observed_energy_j=e,
                                  observed_static_power_w=sp, rng=rng,
                                  features=self._features, observed_index=idx)

    def _choose(self, k: int) -> tuple[list[int], list[str]]:
        ctx = self._context()
        k = min(k, int(ctx.available.sum()))
        shares = allocate([w for _, w in self.passes], k, remainder=self.allocation)
        picks: list[int] = []
        names: list[str] = []
        carry = 0
        for (p, _), share in zip(self.passes, shares):
            want = share + carry
            got = self._run_pass(p, ctx, want)
            ctx = ctx.with_chosen(got)
            picks += got
            names += [p.name] * len(got)
            carry = want - len(got)
        if len(picks) < k:
            got = self._run_pass(RandomPass(), ctx, k - len(picks))
            picks += got
            names += ["random"] * len(got)
        return picks, names

    @staticmethod
    def _run_pass(p: AcquisitionPass, ctx: AcquisitionContext, k: int) -> list[int]:
        if k <= 0:
            return []
        got = [int(i) for i in np.asarray(p.select(ctx, k)).reshape(-1)]
        # Defend the never-re-measure guarantee against a faulty third-party pass.
        out: list[int] = []
        seen: set[int] = set()
        for i in got[:k]:
            if 0 <= i < ctx.n_candidates and ctx.available[i] and i not in seen:
                out.append(i)
                seen.add(i)
        return out

    # ---------------------------------------------------------------------- tell
    def tell(self, config: ScheduleConfig, measurement: Measurement) -> None:
        """Record the measurement of ``config`` (appended to the log first).

        Raises:
            ValueError: if ``config`` is not in the space or was already measured.
            TypeError: if ``measurement`` is not a :class:`Measurement`.
        """
        if not isinstance(measurement, Measurement):
            raise TypeError(f"measurement must be a kareus Measurement, got "
                            f"{type(measurement).__name__}")
        i = self.space.index(config)
        if self._measured[i]:
            raise ValueError(f"{config} was already measured; a search never re-measures")
        self._write({"kind": "tell", "n": self.n_measured + 1, "config": config.to_dict(),
                     "measurement": measurement.to_dict()})
        self._record(i, measurement)

    def tell_many(self, results: Iterable[tuple[ScheduleConfig, Measurement]]) -> None:
        """:meth:`tell` each ``(config, measurement)`` pair."""
        for c, m in results:
            self.tell(c, m)

    def _record(self, i: int, measurement: Measurement) -> None:
        self._observations.append(Observation(config=self.space.configs[i],
                                              measurement=measurement))
        self._measured[i] = True
        if i in self._pending:
            self._pending.remove(i)
            if not self._pending:
                self._batch_done()

    def _batch_done(self) -> None:
        if self.n_measured < self.initial_size:
            return
        pts = np.array([(o.time_s, o.energy_j) for o in self._observations])
        self._fronts.append(pareto_front(pts))
        p = self.stop_patience
        if p is not None and len(self._fronts) > p + 1:
            # Gain of the measured front over the last p batches, against a reference point
            # just beyond the current front (1.1 x its worst time and energy): the front's
            # own scale, so a small front's improvements are not drowned by the area the
            # initial design's worst points span.
            now, before = self._fronts[-1], self._fronts[-1 - p]
            ref = reference_point(now, 0.1)
            hv_now = hypervolume(now, ref)
            gain = (hv_now - hypervolume(before, ref)) / hv_now if hv_now > 0 else 0.0
            if gain < self.stop_tol and self.converged_at is None:
                self.converged_at = self.n_measured
            if gain < self.stop_tol and self.stop:
                self._stopped = "converged"

    # ---------------------------------------------------------------------- run
    def run(self, profiler: Any, partition: Partition | None = None, *,
            progress: bool | None = None) -> PartitionFrontier:
        """Measure with ``profiler`` until done; return the frontier.

        Args:
            profiler: A :class:`kareus.exec.Profiler` (anything with
                ``measure(partition, config) -> Measurement``).
            partition: The partition to measure; ``None`` = the space's. It must be the
                space's partition type (same name).
            progress: Override the constructor's ``progress``.
        """
        if not callable(getattr(profiler, "measure", None)):
            raise TypeError(f"profiler must have a measure(partition, config) method, got "
                            f"{type(profiler).__name__}")
        part = self.space.partition if partition is None else partition
        if not isinstance(part, Partition):
            raise TypeError(f"partition must be a kareus Partition, got {type(part).__name__}")
        if part.name != self.space.partition.name:
            raise ValueError(f"partition {part.name!r} is not the space's partition type "
                             f"{self.space.partition.name!r}")
        show = self.progress if progress is None else progress
        bar = ProgressBar(self.budget, desc=f"{part.name} on {self.space.gpu.name}",
                          enabled=show)
        bar.update(self.n_measured)
        with bar:
            while batch := self.ask():
                for c in batch:
                    self.tell(c, profiler.measure(part, c))
                    bar.update(1, status=self._status())
            if self.stopped_reason == "converged":
                bar.set_status(self._status() + " (converged)")
        return self.frontier()

    def _status(self) -> str:
        front = len(self.frontier().points) if self._observations else 0
        return f"front {front} pts"

    # ---------------------------------------------------------------------- log
    def _header(self) -> dict[str, Any]:
        return {"kind": "header", "format": LOG_FORMAT, "version": LOG_VERSION,
                "kareus_version": __version__,
                "partition": self.space.partition.name, "gpu": self.space.gpu.name,
                "space": _space_description(self.space), "seed": self.seed,
                "batch_size": self.batch_size, "budget": self.budget,
                "initial_size": self.initial_size,
                "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def _write(self, record: dict[str, Any]) -> None:
        if self._log_path is None:
            return
        with open(self._log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _replay(self, path: Path) -> None:
        raw = path.read_bytes()
        lines = raw.split(b"\n")
        records: list[dict[str, Any]] = []
        good_bytes = 0
        for k, line in enumerate(lines):
            if not line.strip():
                good_bytes += len(line) + (1 if k < len(lines) - 1 else 0)
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if k == len(lines) - 1:  # a record cut short by the kill: drop it
                    break
                raise ValueError(f"search log {path} is corrupt at line {k + 1}") from None
            good_bytes += len(line) + (1 if k < len(lines) - 1 else 0)
        if good_bytes < len(raw):
            with open(path, "r+b") as f:
                f.truncate(good_bytes)
        if not records or records[0].get("kind") != "header":
            raise ValueError(f"{path} is not a kareus search log (no header line)")
        self._check_header(records[0], path)
        for rec in records[1:]:
            kind = rec.get("kind")
            if kind == "ask":
                self._batches = int(rec["batch"])
                cfgs = [ScheduleConfig.from_dict(c) for c in rec["configs"]]
                self._pending = [self.space.index(c) for c in cfgs
                                 if not self._measured[self.space.index(c)]]
                for c, name in zip(cfgs, rec.get("passes", [])):
                    self.chosen_by[c] = name
            elif kind == "tell":
                config = ScheduleConfig.from_dict(rec["config"])
                i = self.space.index(config)
                if self._measured[i]:
                    raise ValueError(f"search log {path} measures {config} twice")
                self._record(i, Measurement.from_dict(rec["measurement"]))
            else:
                raise ValueError(f"search log {path}: unknown record kind {kind!r}")

    def _check_header(self, head: dict[str, Any], path: Path) -> None:
        if head.get("format") != LOG_FORMAT:
            raise ValueError(f"{path} is not a kareus search log")
        if head.get("version") != LOG_VERSION:
            raise ValueError(f"search log {path} has version {head.get('version')}; this "
                             f"kareus reads version {LOG_VERSION}")
        mine = {"partition": self.space.partition.name, "gpu": self.space.gpu.name,
                "space": _space_description(self.space), "seed": self.seed}
        for key, value in mine.items():
            if head.get(key) != value:
                raise ValueError(f"search log {path} belongs to another search: its {key} is "
                                 f"{head.get(key)!r}, this search's is {value!r}")

    def __repr__(self) -> str:
        return (f"MultiPassSearch({self.space!r}, {self.n_measured}/{self.budget} measured, "
                f"batch_size={self.batch_size}, seed={self.seed})")
