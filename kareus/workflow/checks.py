"""Every check an ``optimize`` run makes before it measures anything.

The arguments of [`optimize`][kareus.workflow.optimize] (types, the search specification and
the keywords that name its parts, the systems), and [`preflight`][kareus.workflow.preflight]:
the pipeline schedule's name, the parallelism, the memory of every stage, and what the
profiler can measure. A profiler that does not implement ``measure_outside`` is refused here,
in well under a second, not after every search. Also the estimate of a run's length that
``kareus optimize`` says up front ([`estimate_run_s`][kareus.workflow.estimate_run_s]).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from typing import Any

from kareus.compose.systems import (
    SYSTEMS,
)
from kareus.errors import ArgumentError, ArgumentTypeError, OutputError
from kareus.model.gpu import GPUSpec
from kareus.model.memory import MemoryEstimate, check_memory
from kareus.model.pipeline import get_schedule
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search import (
    SearchSpec,
)

__all__ = ["check_arguments", "check_log_dir", "check_parallelism", "estimate_run_s", "preflight", "require_outside_work", "search_spec_of", "system_names"]



def check_arguments(workload: Any, gpu: Any) -> None:
    """``optimize``'s plain arguments, checked before anything runs (the search's are checked
    by [`SearchSpec`][kareus.search.SearchSpec])."""
    if not isinstance(workload, Workload):
        raise ArgumentTypeError(f"workload must be a kareus Workload, got "
                                f"{type(workload).__name__}")
    if gpu is not None and (not isinstance(gpu, str) or not gpu):
        raise ArgumentTypeError(f"gpu must be a GPU preset name such as 'h200-sxm' (or None: the "
                                f"profiler's), got {gpu!r:.40}")


def check_log_dir(log_dir: Any) -> None:
    """``optimize``'s ``log_dir``: a folder path or ``None``, never empty."""
    if log_dir is not None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise ArgumentTypeError(f"log_dir must be a folder path or None, got "
                                    f"{type(log_dir).__name__}")
        if not os.fspath(log_dir):
            raise OutputError("log_dir is empty: name a folder for the logs (or pass None "
                              "for none); an empty path would write into the working folder")


def search_spec_of(search: Any, *, budget: Any, batch_size: Any, seed: Any, surrogate: Any,
                 passes: Any) -> SearchSpec:
    """The search specification ``optimize`` runs: ``search=``, or one made of the keywords
    that name its parts (a keyword that disagrees with ``search=`` is refused)."""
    parts = {"budget": budget, "batch_size": batch_size, "seed": seed, "surrogate": surrogate,
             "passes": passes}
    given = {k: v for k, v in parts.items() if v is not None}
    if search is None:
        return SearchSpec(**given)
    if not isinstance(search, SearchSpec):
        raise ArgumentTypeError(f"search must be a kareus.search.SearchSpec, got "
                                f"{type(search).__name__}")
    clash = sorted(k for k in given if k != "seed" or given[k] != search.seed)
    if clash:
        raise ArgumentError(f"give {', '.join(clash)} in search=SearchSpec(...) or as "
                            f"keywords of optimize, not both")
    return search


def system_names(systems: Sequence[str] | None) -> list[str]:
    """``systems`` checked before any search: ``None`` is all five."""
    if systems is None:
        return list(SYSTEMS)
    if isinstance(systems, (str, bytes)) or not isinstance(systems, Iterable):
        raise ArgumentTypeError(f"systems must be a list of system names (of {', '.join(SYSTEMS)}) "
                                f"or None for all five, got {systems!r:.40}")
    names = list(systems)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ArgumentError(f"unknown system(s) {unknown!r:.80}; known: {', '.join(SYSTEMS)}")
    if not names:
        raise ArgumentError(f"systems is empty: name at least one of {', '.join(SYSTEMS)}, or "
                            "pass None for all five")
    return names


def require_outside_work(profiler: Profiler) -> None:
    """Refuse a profiler that cannot measure the work outside partitions, which composing
    whole iterations needs (the embedding, LM head, loss, pipeline sends, optimizer step).

    Raises:
        ArgumentTypeError: ``profiler.measures_outside_work`` is false; the message names the
            method to implement.
    """
    if not profiler.measures_outside_work:
        raise ArgumentTypeError(
            f"{type(profiler).__name__} does not implement measure_outside(work, freq_mhz, *, "
            f"group_size, comm_sms=None), which composing whole iterations needs (embedding, "
            f"LM head, loss, pipeline sends, optimizer step): implement it (docs/plugins.md), "
            f"or search partition types alone with SearchSpec(...).run(profiler, partition)")


@functools.lru_cache(maxsize=16)
def _memory(workload: Workload, gpu: GPUSpec, schedule: str) -> MemoryEstimate:
    """``check_memory``, once per (workload, GPU, schedule): its inputs are frozen values, so
    the command line's early check and ``optimize``'s are one check."""
    return check_memory(workload, gpu, schedule=schedule)


def preflight(workload: Workload, profiler: Profiler, *, schedule: str = "1f1b") -> MemoryEstimate:
    """Every check [`optimize`][kareus.workflow.optimize] makes before its first measurement.

    The pipeline schedule's name, the parallelism (TP = CP = 1 leaves nothing to schedule),
    what the profiler can measure (``measure_outside`` for whole iterations) and the memory
    (``kareus.model.memory.check_memory``). Cheap (well under a second) and idempotent: the
    memory check of a (workload, GPU, schedule) runs once per process, so a caller that checks
    early (the ``kareus`` command, before it makes its output folder) and then calls
    ``optimize`` checks once.

    Args:
        workload: The workload.
        profiler: What will measure.
        schedule: Pipeline schedule name (``"1f1b"``, ``"gpipe"``).

    Returns:
        The memory estimate per GPU.

    Raises:
        UnknownPresetError: an unknown schedule.
        WorkloadError: TP = CP = 1, or a workload that does not fit in the GPU's memory.
        ArgumentTypeError: a profiler that is not a Profiler, or that cannot measure the work
            outside partitions.
    """
    if not isinstance(profiler, Profiler):
        raise ArgumentTypeError(f"profiler must be a kareus Profiler, got "
                                f"{type(profiler).__name__}")
    get_schedule(schedule, 1, 1)  # raises UnknownPresetError early
    check_parallelism(workload)  # before the memory check: more parallelism is the answer
    require_outside_work(profiler)
    try:
        hash((workload, profiler.gpu))
    except TypeError:  # a GPU spec of one's own that does not hash: checked every time
        return check_memory(workload, profiler.gpu, schedule=schedule)
    return _memory(workload, profiler.gpu, schedule)


def check_parallelism(workload: Workload) -> None:
    """Refuse a workload with no collective to schedule (TP = CP = 1 and no expert
    parallelism, what ``Workload.preset(name)`` gives)."""
    from kareus.errors import WorkloadError

    p = workload.parallelism
    if p.tp == 1 and p.cp == 1 and p.ep == 1:
        raise WorkloadError(
            f"{workload.describe()}: with TP=1 and CP=1 no layer has a collective to overlap, "
            f"and kareus schedules collectives; give the workload tensor or context "
            f"parallelism, e.g. Workload.preset({workload.model.name!r}, tp=4, pp=2)")


# The estimate of a run's length (emulated profiler, GP surrogate), fitted to runs of the
# README job on a 2-core CPU (budget 96 and 300: 960 profiles in 5.9 s, 2,004 in 16.8 s;
# 8, 32 and 128 microbatches: 5.9, 7.2 and 67.6 s): per partition type with n profiles,
# a x n + b x n^4 seconds (the GP refits every batch); composing C microbatch computations
# for the five systems, c x C^2 seconds.
_EST_S_PER_PROFILE = 5e-3
_EST_S_PER_PROFILE4 = 4e-10
_EST_S_PER_COMPUTATION2 = 2.4e-4


def estimate_run_s(workload: Workload, profiler: Profiler, budget: int) -> float:
    """Roughly how many seconds an ``optimize`` run takes on a 2-core CPU with the emulated
    profiler (its searches at ``budget`` profiles per type, and the composition); a real
    profiler adds its measuring time. ``kareus optimize`` says it up front for a long run
    and refuses one estimated at more than two days."""
    from kareus.model.partition import build_partitions

    pset = build_partitions(workload)
    counts = [min(budget, len(profiler.space(p))) for p in pset.types.values()]
    computations = 2 * workload.parallelism.pp * workload.num_microbatches
    return (sum(_EST_S_PER_PROFILE * n + _EST_S_PER_PROFILE4 * float(n) ** 4 for n in counts)
            + _EST_S_PER_COMPUTATION2 * float(computations) ** 2)
