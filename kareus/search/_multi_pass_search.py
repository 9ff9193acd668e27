"""Multi-pass multi-objective Bayesian search for one partition type's frontier.

Profiling a configuration on real GPUs costs about 13 s (the Kareus paper: a window of
repeated runs read from NVML's energy counter, then a cool-down) and a space holds
thousands of them, so [`MultiPassSearch`][kareus.search.MultiPassSearch] profiles few: a
space-filling initial design, then batches chosen by acquisition passes
(``kareus.search.acquisition``) from surrogate (``kareus.search.surrogate``) predictions of time and
dynamic energy on every configuration not yet measured. It stops at the budget, or earlier when the
measured front stops improving (hypervolume gain below a tolerance over a few batches).

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

The result is a [`PartitionFrontier`][kareus.search.PartitionFrontier]: the measured
Pareto points with their configurations, plus every observation.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kareus._check import check_count, check_number
from kareus._logging import get_logger
from kareus.errors import (
    DATA_ERRORS,
    ArgumentError,
    ArgumentTypeError,
    OutputError,
    data_problem,
)
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.partition import Partition
from kareus.model.profiler import Profiler
from kareus.search._defaults import default_passes, default_surrogate, prior_mean_passes
from kareus.search._features import search_features
from kareus.search._initial_design import default_initial_size
from kareus.search._initial_design import initial_design as initial_design_indices
from kareus.search._log import (
    REMEDY,
    append_record,
    check_header,
    log_header,
    read_log,
    sync_log,
)
from kareus.search._objective_model import ObjectiveModel
from kareus.search._prior_mean import PriorMean
from kareus.search.acquisition import (
    AcquisitionContext,
    AcquisitionPass,
    RandomPass,
    allocate,
)
from kareus.search.pareto import hypervolume, pareto_front, reference_point
from kareus.search.partition_frontier import Observation, PartitionFrontier
from kareus.search.progress import ProgressBar
from kareus.search.surrogate import Surrogate

__all__ = ["MultiPassSearch"]

#: With a prior mean, up to this budget (profiles), batches of this size by default: the
#: model's first guesses are corrected after every few profiles instead of every 8.
_SMALL_BUDGET_BATCH = (32, 4)

_log = get_logger(__name__)


class MultiPassSearch:
    """Ask/tell multi-objective Bayesian search of one partition type's configuration space.

    Args:
        space: The configurations to search (one partition type on one GPU).
        surrogate: Template surrogate for time and dynamic energy (each gets a clone, fitted
            in log space); ``None`` = [`default_surrogate`][kareus.search.default_surrogate] (a
            Gaussian process: mean + posterior spread);
            [`tree_surrogate`][kareus.search.tree_surrogate] is the XGBoost ensemble.
        passes: ``(pass, weight)`` pairs that fill each batch in proportion to their weights;
            ``None`` = [`default_passes`][kareus.search.default_passes] (30/10/20/10/10), or
            with a ``prior_mean`` [`prior_mean_passes`][kareus.search.prior_mean_passes]. A pass
            that cannot fill its share leaves it to the next passes, then to random picks.
        batch_size: Configurations per batch; ``None`` = 8, or 4 with a ``prior_mean`` and a
            budget of at most 32 profiles (at 16 profiles a refit
            after every 4 found more of the saving than after every 8, docs/search.md).
        budget: Profiles in all; ``None`` = 224 (the reference artifact's budget). Capped at
            the space's size.
        initial_size: Profiles of the space-filling initial design; ``None`` =
            [`default_initial_size`][kareus.search.default_initial_size] of the budget (16 from 32
            profiles up, half the budget but at least 8 below), or none with a
            ``prior_mean`` and at least two ``prior`` observations in the space (the
            surrogates start from the model calibrated on them, and the passes choose
            every profile). A resumed search keeps its log's.
        initial_design: ``"maximin"`` ([`maximin_design`][kareus.search.maximin_design],
            space-filling) or
            ``"random"`` (uniform, as the reference artifact does).
        system_configs: Whether the initial design opens with the systems' own
            configurations ([`system_config_indices`][kareus.search.system_config_indices]: the
            maximum clock with the default SM count, sequential and in the first slot) and fills
            the rest of its points with ``initial_design``; ``None`` = yes for
            ``"maximin"``, no for ``"random"``.
        allocation: How leftover batch slots are shared when weights do not divide the
            batch: ``"largest"`` remainders, or ``"last"`` pass (see
            [`allocate`][kareus.search.allocate]).
        seed: Seed of the design, the surrogates and the tie-breaking.
        stop_patience: Stop when the measured front's hypervolume grew by less than
            ``stop_tol`` (relative) over the last ``stop_patience`` batches; ``None`` = never
            stop before the budget.
        stop_tol: Relative hypervolume gain below which the front counts as converged.
        stop: Whether to stop when the rule fires; ``False`` = only record when it fired
            (``converged_at``) and go on to the budget (for benchmarks).
        log: Path of a new JSONL log of every measurement (an existing non-empty file is an
            error: resume it instead).
        resume: Path of a log to continue (replayed, validated, then appended to); if the
            file does not exist yet, a new search starts logging there.
        progress: Show a progress bar on stderr in [`run`][kareus.search.MultiPassSearch.run];
            ``None`` = when stderr is a terminal.
        measured_with: How the measurements are made beyond the space, e.g.
            ``{"execution": "graphed"}`` for an emulator of graph-captured execution:
            recorded in a new log's header; a log that records other values (or none,
            where this is given) is refused on resume.
        prior: Observations of configurations of this space measured before the search
            and paid for elsewhere (the baselines' measurements of the same partition type,
            [`kareus.workflow`][kareus.workflow]): the surrogates learn from them and the
            frontier holds them, no configuration among them is measured again, and they
            do not count toward ``budget``. Those outside the space, and repeats, are
            left out. A new log records them first; a resumed search takes its log's (the
            ones given then are not used), so it continues exactly as it began.
        prior_mean: A model's prediction of every configuration of ``space``
            ([`PriorMean`][kareus.search.PriorMean], e.g. the emulator calibrated to the
            GPU): the surrogates model the residual, measured over predicted, in log space.
            Recorded in a new log's header (its source and digest); resuming a log with
            another prior mean, or with none where the log has one, is refused.

    Raises:
        TypeError: for a space, surrogate or pass of the wrong type.
        ValueError: for bad sizes, a resume log of another search, or an ``initial_size``
            other than the resume log's.
    """

    def __init__(  # noqa: C901 - checks each keyword argument and resolves its default
        self,
        space: ConfigSpace,
        *,
        surrogate: Surrogate | None = None,
        passes: Sequence[tuple[AcquisitionPass, float]] | None = None,
        batch_size: int | None = None,
        budget: int | None = None,
        initial_size: int | None = None,
        initial_design: str = "maximin",
        system_configs: bool | None = None,
        allocation: str = "largest",
        seed: int = 0,
        stop_patience: int | None = 4,
        stop_tol: float = 1e-3,
        stop: bool = True,
        log: str | os.PathLike[str] | None = None,
        resume: str | os.PathLike[str] | None = None,
        progress: bool | None = None,
        measured_with: Mapping[str, str] | None = None,
        prior: Iterable[Observation] = (),
        prior_mean: PriorMean | None = None,
    ) -> None:
        if not isinstance(space, ConfigSpace):
            raise ArgumentTypeError(f"space must be a kareus ConfigSpace, got "
                                    f"{type(space).__name__}")
        if surrogate is not None and not isinstance(surrogate, Surrogate):
            raise ArgumentTypeError(f"surrogate must be a kareus Surrogate, got "
                                    f"{type(surrogate).__name__}")
        self.space = space
        self.seed = check_count("seed", seed, minimum=0)
        self.surrogate = default_surrogate(self.seed) if surrogate is None else surrogate
        if passes is None:
            passes = default_passes() if prior_mean is None else prior_mean_passes()
        self.passes = self._check_passes(passes)
        self.budget = min(224 if budget is None else check_count("budget", budget), len(space))
        if batch_size is not None:
            self.batch_size = check_count("batch_size", batch_size)
        else:
            small = prior_mean is not None and self.budget <= _SMALL_BUDGET_BATCH[0]
            self.batch_size = _SMALL_BUDGET_BATCH[1] if small else 8
        if prior_mean is not None:
            if not isinstance(prior_mean, PriorMean):
                raise ArgumentTypeError(f"prior_mean must be a kareus PriorMean, got "
                                        f"{type(prior_mean).__name__}")
            if len(prior_mean) != len(space):
                raise ArgumentError(f"prior_mean predicts {len(prior_mean)} configurations; "
                                    f"the space has {len(space)}: make it from this space "
                                    "(PriorMean.from_profiler(space, model))")
        self.prior_mean = prior_mean
        if initial_size is not None:
            check_count("initial_size", initial_size)
        if stop_patience is not None:
            check_count("stop_patience", stop_patience)
        check_number("stop_tol", stop_tol, minimum=0)
        resume_records = None
        if resume is not None and Path(resume).exists() and Path(resume).stat().st_size > 0:
            resume_records = read_log(Path(resume))
            check_header(resume_records[0], space, self.seed, Path(resume),
                         measured_with=measured_with,
                         prior_mean=None if prior_mean is None else prior_mean.digest)
        if resume_records is not None:
            # A resumed search keeps the design its log was started with, whatever the
            # budget now (the default size depends on the budget, which may change).
            try:
                logged = int(resume_records[0]["initial_size"])
            except (KeyError, TypeError, ValueError, OverflowError):
                raise OutputError(f"search log {resume}: its header has no valid "
                                  f"initial_size: {REMEDY}") from None
            if initial_size is not None and int(initial_size) != logged:
                raise ArgumentError(f"search log {resume} was started with an initial design of "
                                    f"{logged} profiles, not {initial_size}: resume it with "
                                    "initial_size=None (or the same size)")
            self.initial_size = logged
        elif initial_size is None:
            prior = list(prior)
            usable = {o.config for o in prior if isinstance(o, Observation) and o.config in space}
            # A model's prediction of every configuration, calibrated on the priors, is a
            # better start than a space-filling design: every profile goes to the passes.
            self.initial_size = (0 if prior_mean is not None and len(usable) >= 2
                                 else default_initial_size(self.budget))
        else:
            self.initial_size = min(int(initial_size), self.budget)
        if initial_design not in ("maximin", "random"):
            raise ArgumentError(f"initial_design must be 'maximin' or 'random', got "
                                f"{initial_design!r}")
        if allocation not in ("largest", "last"):
            raise ArgumentError(f"allocation must be 'largest' or 'last', got {allocation!r}")
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
        self._n_prior = 0  # observations told as prior (the first ones)
        self._measured = np.zeros(n, dtype=bool)
        self._pending: list[int] = []
        self._batches = 0  # batches asked so far
        self._fronts: list[np.ndarray] = []  # measured front after each batch
        self._stopped: str | None = None
        self.system_configs = ((initial_design == "maximin") if system_configs is None
                               else bool(system_configs))
        self._initial = initial_design_indices(space, self.initial_size, kind=initial_design,
                                               system_configs=self.system_configs,
                                               seed=self.seed)
        #: Seconds spent in :meth:`ask` per batch (search overhead: fitting, predicting,
        #: choosing), for benchmarks.
        self.ask_seconds: list[float] = []
        #: The pass that chose each configuration asked (config -> pass name).
        self.chosen_by: dict[ScheduleConfig, str] = {}

        self._log_path: Path | None = None
        if log is not None and resume is not None and Path(log) != Path(resume):
            raise ArgumentError("give either log= (a new search) or resume= (continue one), "
                                "or the same path to both")
        if resume_records is not None:
            assert resume is not None
            self._replay(Path(resume), resume_records)
            self._log_path = Path(resume)
            _log.info("resuming the search of %s on %s from %s: %d measurements replayed",
                      space.partition.name, space.gpu.name, resume, self.n_measured)
        else:
            path = resume if resume is not None else log
            if path is not None:
                p = Path(path)
                if p.exists() and p.stat().st_size > 0:
                    raise FileExistsError(f"search log {p} already exists; pass resume={str(p)!r} "
                                          "to continue that search, or choose another path")
                p.parent.mkdir(parents=True, exist_ok=True)
                self._log_path = p
                self._write(log_header(space, seed=self.seed, batch_size=self.batch_size,
                                       budget=self.budget, initial_size=self.initial_size,
                                       measured_with=measured_with,
                                       prior_mean=None if prior_mean is None
                                       else {"source": prior_mean.source,
                                             "digest": prior_mean.digest}))
            self._tell_prior(prior)

    # ---------------------------------------------------------------------- checking
    @staticmethod
    def _check_passes(passes: Sequence[tuple[AcquisitionPass, float]]
                      ) -> list[tuple[AcquisitionPass, float]]:
        out = []
        for item in passes:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ArgumentTypeError("passes must be (AcquisitionPass, weight) pairs, got "
                                        f"{item!r}")
            p, w = item
            if not isinstance(p, AcquisitionPass):
                raise ArgumentTypeError(f"not an AcquisitionPass: {p!r}")
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise ArgumentError(f"pass weight must be a finite number >= 0, got {w!r}")
            out.append((p, float(w)))
        if not out or sum(w for _, w in out) <= 0:
            raise ArgumentError("passes need at least one pass with a positive weight")
        return out

    # ---------------------------------------------------------------------- state
    @property
    def observations(self) -> list[Observation]:
        """Every observation told, in order."""
        return list(self._observations)

    @property
    def n_measured(self) -> int:
        """Observations this search has been told so far (priors not counted)."""
        return len(self._observations) - self._n_prior

    @property
    def n_prior(self) -> int:
        """Prior observations the search began with (see ``prior``)."""
        return self._n_prior

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
        """Whether [`ask`][kareus.search.MultiPassSearch.ask] will return nothing more."""
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
        """The observations so far as a [`PartitionFrontier`][kareus.search.PartitionFrontier]."""
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
        # with priors the budget may exceed what is left unmeasured in the space
        room = min(self.budget - self.n_measured, int((~self._measured).sum()))
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
        off = None if self.prior_mean is None else self.prior_mean.log_values()
        model.fit(self._features[idx], t, e - sp * t, static,
                  offset=None if off is None else (off[0][idx], off[1][idx]))
        prediction = model.predict(self._features, offset=off)
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
            TypeError: if ``measurement`` is not a [`Measurement`][kareus.model.Measurement].
        """
        if not isinstance(measurement, Measurement):
            raise ArgumentTypeError(f"measurement must be a kareus Measurement, got "
                                    f"{type(measurement).__name__}")
        i = self.space.index(config)
        if self._measured[i]:
            raise ArgumentError(f"{config} was already measured; a search never re-measures")
        self._write({"kind": "tell", "n": self.n_measured + 1, "config": config.to_dict(),
                     "measurement": measurement.to_dict()})
        self._record(i, measurement)

    def _tell_prior(self, prior: Iterable[Observation]) -> None:
        for o in prior:
            if not isinstance(o, Observation):
                raise ArgumentTypeError(f"prior must hold kareus Observations, got "
                                        f"{type(o).__name__}")
            if o.config not in self.space:
                continue
            i = self.space.index(o.config)
            if self._measured[i]:
                continue
            self._write({"kind": "prior", "config": o.config.to_dict(),
                         "measurement": o.measurement.to_dict()})
            self._record_prior(i, o.measurement)

    def _record_prior(self, i: int, measurement: Measurement) -> None:
        if len(self._observations) != self._n_prior:
            raise ArgumentError("prior observations come before the search's own")
        self._record(i, measurement)
        self._n_prior += 1

    def tell_many(self, results: Iterable[tuple[ScheduleConfig, Measurement]]) -> None:
        """[`tell`][kareus.search.MultiPassSearch.tell] each ``(config, measurement)`` pair."""
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
    def run(self, profiler: Profiler, partition: Partition | None = None, *,
            progress: bool | None = None) -> PartitionFrontier:
        """Measure with ``profiler`` until done; return the frontier.

        Args:
            profiler: The profiler that measures each configuration asked (emulated, on
                real GPUs, or replaying recorded data).
            partition: The partition to measure; ``None`` = the space's. It must be the
                space's partition type (same name).
            progress: Override the constructor's ``progress``.

        Returns:
            The observations, measured to the budget or until the search stopped.

        Raises:
            TypeError: if ``profiler`` has no ``measure`` method or ``partition`` is not a
                [`Partition`][kareus.model.Partition].
            ValueError: if ``partition`` is not the space's partition type.
        """
        if not callable(getattr(profiler, "measure", None)):
            raise ArgumentTypeError(f"profiler must have a measure(partition, config) method, got "
                                    f"{type(profiler).__name__}")
        part = self.space.partition if partition is None else partition
        if not isinstance(part, Partition):
            raise ArgumentTypeError(f"partition must be a kareus Partition, got "
                                    f"{type(part).__name__}")
        if part.name != self.space.partition.name:
            raise ArgumentError(f"partition {part.name!r} is not the space's partition type "
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
        if self._log_path is not None and self._log_path.exists():
            sync_log(self._log_path)
        return self.frontier()

    def _status(self) -> str:
        front = len(self.frontier().points) if self._observations else 0
        return f"front {front} pts"

    # ---------------------------------------------------------------------- log
    def _write(self, record: dict[str, Any]) -> None:
        if self._log_path is not None:
            append_record(self._log_path, record)

    def _replay(self, path: Path, records: list[dict[str, Any]]) -> None:
        for n, rec in enumerate(records[1:], start=2):
            try:
                self._replay_record(path, rec)
            except OutputError:
                raise
            except DATA_ERRORS as exc:
                raise OutputError(f"search log {path}: record {n} ({rec.get('kind')!r:.20}) "
                                  f"is corrupt: {data_problem(exc)}; {REMEDY}") from None

    def _replay_record(self, path: Path, rec: dict[str, Any]) -> None:
        """Replay one ask or tell record (any error: a corrupt record)."""
        kind = rec.get("kind")
        if kind == "ask":
            self._batches = int(rec["batch"])
            cfgs = [ScheduleConfig.from_dict(c) for c in rec["configs"]]
            self._pending = [self.space.index(c) for c in cfgs
                             if not self._measured[self.space.index(c)]]
            for c, name in zip(cfgs, rec.get("passes", [])):
                self.chosen_by[c] = name
        elif kind == "prior":
            config = ScheduleConfig.from_dict(rec["config"])
            i = self.space.index(config)
            if self._measured[i]:
                raise OutputError(f"search log {path} holds {config} twice: {REMEDY}")
            self._record_prior(i, Measurement.from_dict(rec["measurement"]))
        elif kind == "tell":
            config = ScheduleConfig.from_dict(rec["config"])
            i = self.space.index(config)
            if self._measured[i]:
                raise OutputError(f"search log {path} measures {config} twice: {REMEDY}")
            self._record(i, Measurement.from_dict(rec["measurement"]))
        else:
            raise OutputError(f"search log {path}: unknown record kind {kind!r:.40}: "
                              f"{REMEDY}")

    def __repr__(self) -> str:
        return (f"MultiPassSearch({self.space!r}, {self.n_measured}/{self.budget} measured"
                f"{f' (+{self._n_prior} prior)' if self._n_prior else ''}, "
                f"batch_size={self.batch_size}, seed={self.seed})")
