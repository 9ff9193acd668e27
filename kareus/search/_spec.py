"""One search specification: how kareus searches a partition type, wherever the search runs.

[`SearchSpec`][kareus.search.SearchSpec] is to kareus what ``optuna.create_study(sampler=...,
pruner=...)`` is to Optuna: the search-side roles and settings in one value, handed to whatever runs
the searches. [`kareus.optimize`][kareus.workflow.optimize] (``search=``), the five systems'
composition ([`kareus.workflow.compose_systems`][kareus.workflow.compose_systems]), a tuning run on
the job's own GPUs (``kareus.tune``) and the tasks of a ``concurrent.futures`` pool or a Ray cluster
([`kareus.workflow.pools`][kareus.workflow.pools]) all build their
[`MultiPassSearch`][kareus.search.MultiPassSearch] from it, through
[`SearchSpec.search`][kareus.search.SearchSpec.search] or
[`SearchSpec.run`][kareus.search.SearchSpec.run], so the same specification gives the same search
everywhere (before it, three places built the search, each with its own defaults).

What it holds changes the numbers a search finds (the budget, the batch size, the seed, the
surrogate, the acquisition passes); where the search log goes (``log_dir``), whether progress is
shown and which profiler measures are the caller's.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kareus.errors import ArgumentError, ArgumentTypeError, ConfigError
from kareus.model.config import ConfigSpace
from kareus.model.partition import Partition
from kareus.model.profiler import Profiler
from kareus.search._defaults import SURROGATES
from kareus.search._multi_pass_search import MultiPassSearch
from kareus.search._prior_mean import PriorMean
from kareus.search.acquisition import AcquisitionPass
from kareus.search.partition_frontier import Observation, PartitionFrontier
from kareus.search.surrogate import Surrogate

__all__ = ["DEFAULT_BUDGET", "SearchSpec", "resolve_surrogate",
           "search_log_path"]

#: Profiles per partition type when a specification does not say (``kareus optimize``'s
#: ``--budget`` default).
DEFAULT_BUDGET = 96

Passes = tuple[tuple[AcquisitionPass, float], ...]


def resolve_surrogate(surrogate: Surrogate | str | None, seed: int = 0) -> Surrogate | None:
    """A surrogate template from a name (a key of ``kareus.search.SURROGATES``: ``"gp"``,
    ``"trees"``), an instance, or ``None`` (the search's default).

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor a [`Surrogate`][kareus.search.Surrogate].
    """
    if surrogate is None or isinstance(surrogate, Surrogate):
        return surrogate
    if isinstance(surrogate, str):
        if surrogate not in SURROGATES:
            raise ArgumentError(f"unknown surrogate {surrogate!r}: use one of "
                                f"{tuple(SURROGATES)}, or pass a kareus.search.Surrogate")
        return SURROGATES[surrogate](seed)
    raise ArgumentTypeError(f"surrogate must be a name {tuple(SURROGATES)} or a kareus Surrogate, "
                            f"got {type(surrogate).__name__}")


def _passes(value: Any) -> Passes | None:
    """``passes`` as ``(pass, weight)`` pairs: a bare pass weighs 1."""
    if value is None:
        return None
    if isinstance(value, AcquisitionPass):
        value = [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"passes must be a list of AcquisitionPasses or (pass, weight) "
                                f"pairs, got {type(value).__name__}")
    pairs = [(item, 1.0) if isinstance(item, AcquisitionPass) else item for item in value]
    return tuple(MultiPassSearch._check_passes(pairs))


def _whole(label: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{label} must be a whole number, got {value!r:.40} "
                                f"({type(value).__name__})")


def execution_of(profiler: Profiler) -> str | None:
    """Deprecated: ``profiler.execution`` ([`Profiler.execution`][kareus.model.Profiler.execution])
    says it, through any wrappers."""
    import warnings

    warnings.warn("kareus.search.execution_of(profiler) is deprecated: read profiler.execution",
                  DeprecationWarning, stacklevel=2)
    return profiler.execution


def search_log_path(log_dir: str | os.PathLike[str], key: str) -> Path:
    """Where the search of the partition type keyed ``key`` logs in ``log_dir``:
    ``search-<key>.jsonl``."""
    return Path(log_dir) / f"search-{key}.jsonl"


@attrs.frozen(kw_only=True)
class SearchSpec:
    """How every partition type is searched: one value for every place a search runs.

    Attributes:
        budget: Profiles per partition type (capped at the size of the type's space; the
            search may stop earlier once its measured front stops improving).
        batch_size: Profiles per search batch; ``None`` = the search's default (8).
        seed: Seed of the searches' initial design, surrogates and tie-breaking.
        surrogate: The searches' surrogate: ``None`` or ``"gp"`` = the default Gaussian
            process ([`default_surrogate`][kareus.search.default_surrogate]), ``"trees"`` = the
            XGBoost ensemble ([`tree_surrogate`][kareus.search.tree_surrogate]), or a
            [`Surrogate`][kareus.search.Surrogate] template of your own (each search fits clones
            of it).
        passes: The acquisition passes that fill each batch: ``(pass, weight)`` pairs or bare
            [`AcquisitionPass`][kareus.search.AcquisitionPass]es (weight 1 each); ``None`` =
            [`default_passes`][kareus.search.default_passes]. Every search gets its own copy,
            so a pass that keeps state between batches starts afresh on each type.

    Raises:
        TypeError: a field of the wrong type.
        ArgumentError: ``budget`` below 1.
        ConfigError: a negative ``seed``.
        ValueError: an unknown surrogate name, a batch size below 1, pass weights that are
            negative or all zero.

    Examples:
        >>> from kareus.search import HypervolumePass, SearchSpec
        >>> spec = SearchSpec(budget=32, seed=1, passes=[HypervolumePass("total")])
        >>> spec.passes[0][1]
        1.0
    """

    budget: int = DEFAULT_BUDGET
    batch_size: int | None = None
    seed: int = 0
    surrogate: Surrogate | str | None = None
    passes: Passes | None = attrs.field(default=None, converter=_passes)

    def __attrs_post_init__(self) -> None:
        _whole("budget", self.budget)
        _whole("seed", self.seed)
        _whole("batch_size", self.batch_size, optional=True)
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0 (it seeds the searches and the emulator's "
                              f"noise), got {self.seed}")
        if self.budget < 1:
            raise ArgumentError(f"budget must be at least 1 profile per partition type, got "
                                f"{self.budget}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ArgumentError(f"batch_size must be >= 1, got {self.batch_size}")
        resolve_surrogate(self.surrogate, self.seed)  # an unknown name fails here, not later

    def surrogate_template(self) -> Surrogate | None:
        """The surrogate template the searches clone (``None``: the search's default)."""
        return resolve_surrogate(self.surrogate, self.seed)

    def search(self, space: ConfigSpace, *, log: str | os.PathLike[str] | None = None,
               progress: bool | None = False, measured_with: dict[str, str] | None = None,
               prior: Sequence[Observation] = (),
               prior_mean: PriorMean | None = None) -> MultiPassSearch:
        """A new search of ``space`` as this specification says.

        Args:
            space: The partition type's configurations.
            log: The search log: resumed if it exists, started otherwise; ``None`` = none.
            progress: Show a progress bar (``None``: on a terminal).
            measured_with: How the measurements are made beyond the space (recorded in the
                log's header, [`MultiPassSearch`][kareus.search.MultiPassSearch]).
            prior: Observations paid for elsewhere that the search starts from, outside
                its budget (``MultiPassSearch``'s ``prior``).
            prior_mean: A model's prediction of every configuration of ``space``, the
                surrogates' prior mean (``MultiPassSearch``'s ``prior_mean``).

        Returns:
            The search, ready to ask or to run.
        """
        return MultiPassSearch(space, budget=min(self.budget, len(space)),
                               batch_size=self.batch_size, seed=self.seed, resume=log,
                               progress=progress, surrogate=self.surrogate_template(),
                               passes=None if self.passes is None else copy.deepcopy(
                                   list(self.passes)),
                               measured_with=measured_with, prior=prior,
                               prior_mean=prior_mean)

    def run(self, profiler: Profiler, partition: Partition, *,
            log: str | os.PathLike[str] | None = None, progress: bool | None = False,
            prior: Sequence[Observation] = (),
            prior_model: Profiler | None = None) -> PartitionFrontier:
        """Search ``partition``'s space (``profiler.space(partition)``) with ``profiler``.

        The log's header records how the profiler feeds its GPU
        ([`Profiler.execution`][kareus.model.Profiler.execution]), so a log of the other mode is
        refused.

        Args:
            profiler: Measures.
            partition: The partition type.
            log: The search log (resumed if it exists); ``None`` = none.
            progress: Show a progress bar (``None``: on a terminal).
            prior: Observations of the type measured already, outside the budget
                (``MultiPassSearch``'s ``prior``).
            prior_model: A noise-free model of the GPU (e.g. the calibrated emulator) whose
                prediction of every configuration is the surrogates' prior mean
                ([`PriorMean.from_profiler`][kareus.search.PriorMean.from_profiler]);
                ``None`` = none.

        Returns:
            The type's frontier.
        """
        execution = profiler.execution
        space = profiler.space(partition)
        search = self.search(space, log=log, progress=progress,
                             measured_with=None if execution is None
                             else {"execution": execution}, prior=prior,
                             prior_mean=None if prior_model is None
                             else PriorMean.from_profiler(space, prior_model))
        return search.run(profiler, partition)

    def __call__(self, profiler: Profiler, partition: Partition) -> PartitionFrontier:
        """``run(profiler, partition)`` without a log or progress: a specification is a
        search function, ``search(profiler, partition) -> PartitionFrontier``."""
        return self.run(profiler, partition)
