"""Partition searches as tasks of any ``concurrent.futures.Executor``.

``optimize(workload, pool=pool)`` hands each partition type's search to ``pool`` as one
task ([`SearchTask`][kareus.workflow.pools.SearchTask], a picklable callable): a thread or process
pool on one machine, [`RayExecutor`][kareus.workflow.ray.RayExecutor] on a Ray cluster, or submitit's
``AutoExecutor`` on Slurm. kareus schedules nothing itself: the engine decides where and when each
task runs.

**One search specification.** A task searches as the run's
[`SearchSpec`][kareus.search.SearchSpec] says ([`SearchSpec.run`][kareus.search.SearchSpec.run]),
the very call a serial run makes, so the pool changes where a search runs, never what it does.

**Logs.** A task may run on another machine, so it never writes into the run's folder. It
receives the type's existing search log (if any) as text, resumes from it in a private
temporary folder, and returns the full log with its frontier; the caller writes it back as
``search-<type>.jsonl`` in the run's log folder, and appends one line per task (type, host,
process, wall time, profiles) to ``tasks.jsonl`` there. A killed run resumes as a serial one
does.

**Same result as a serial run.** A search's choices depend only on its seed and on what it
measures, and every profiler measures a configuration independently of the other searches:
real GPUs and recorded measurements by nature, the emulated GPU
([`EmulatedProfiler`][kareus.profilers.EmulatedProfiler]) because its noise is drawn from ``(seed, what
is measured, its repeat index)`` by hashing, never from a stream shared by the run. Each task
gets its own copy of the profiler and tasks may run in any order, anywhere: the frontiers
and logs are exactly those of the serial run (``tests/workflow/test_workflow_executor.py`` checks it
with thread and process pools and with Ray), and the profiler's call count is advanced by
the measurements the tasks made.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import attrs

from kareus._io import write_text_atomic
from kareus.errors import ArgumentTypeError
from kareus.model.partition import Partition, PartitionSet
from kareus.model.profiler import Profiler
from kareus.search import (
    Observation,
    PartitionFrontier,
    SearchSpec,
    prior_count,
    search_log_path,
)

__all__ = ["SearchTask", "SearchTaskResult", "run_searches", "task_gpus"]


def task_gpus(profiler: Profiler, partition: Partition, gpus_per_stage: int) -> int:
    """GPUs a search task needs: the partition's profiling group (its TP x CP GPUs) for a
    profiler that [`uses_gpus`][kareus.model.Profiler.uses_gpus], else none (the emulated GPU,
    recorded measurements)."""
    return int(gpus_per_stage) if profiler.uses_gpus else 0


@attrs.frozen(kw_only=True)
class SearchTaskResult:
    """What one search task returns.

    Attributes:
        name: The partition type.
        frontier: Its searched frontier.
        log_text: The whole search log (JSONL) after the task, or ``None`` without logs.
        noise_offset: The profiler's call count when the task started (``None``: the
            profiler keeps none); for the record only, nothing depends on it.
        noise_used: Measurements the task's profiler made.
        host: Where the task ran (host name).
        pid: The process that ran it.
        wall_s: The task's wall time.
        priors: Observations the search started from (not its profiles).
    """

    name: str
    frontier: PartitionFrontier
    log_text: str | None
    noise_offset: int | None
    noise_used: int
    host: str
    pid: int
    wall_s: float
    priors: int = 0

    def log_record(self, attempt: int) -> dict[str, Any]:
        """One line of ``tasks.jsonl``."""
        return {"type": self.name, "attempt": attempt, "host": self.host, "pid": self.pid,
                "wall_s": round(self.wall_s, 3),
                "profiles": len(self.frontier.measured()) - self.priors,
                "noise_offset": self.noise_offset, "noise_used": self.noise_used}


@attrs.frozen(kw_only=True)
class SearchTask:
    """One partition type's search, as a picklable callable (``task()`` runs it).

    Attributes:
        name: The partition type.
        partition: The partition.
        profiler: A private copy of the profiler.
        search: How the type is searched (the run's search specification).
        resume_text: The type's existing search log, or ``None`` (no logs).
        log: Whether to keep a log at all.
        num_gpus: GPUs the task needs (its profiling group; 0 on the emulator); engines
            that place tasks on GPUs ([`RayExecutor`][kareus.workflow.ray.RayExecutor]) read it.
        prior: Observations the search starts from, outside its budget.
        prior_model: The model whose prediction is the surrogates' prior mean, or ``None``.
    """

    name: str
    partition: Partition
    profiler: Profiler
    search: SearchSpec
    resume_text: str | None
    log: bool
    num_gpus: int = 0
    prior: tuple[Observation, ...] = ()
    prior_model: Profiler | None = None

    def __call__(self) -> SearchTaskResult:
        start = time.monotonic()
        before = self.profiler.measurement_count
        with tempfile.TemporaryDirectory(prefix="kareus-task-") as tmp:
            log = None
            if self.log:
                log = search_log_path(tmp, self.name)
                if self.resume_text:
                    log.write_text(self.resume_text, encoding="utf-8")
            frontier = self.search.run(self.profiler, self.partition, log=log, progress=False,
                                       prior=self.prior, prior_model=self.prior_model)
            text = log.read_text(encoding="utf-8") if log is not None and log.exists() else None
            priors = prior_count(log) if log is not None else len(self.prior)
        after = self.profiler.measurement_count
        used = 0 if before is None or after is None else after - before
        return SearchTaskResult(name=self.name, frontier=frontier, log_text=text,
                                noise_offset=before, noise_used=used, host=socket.gethostname(),
                                pid=os.getpid(), wall_s=time.monotonic() - start,
                                priors=priors)


def run_searches(executor: Executor, profiler: Profiler, pset: PartitionSet, *,
                 search: SearchSpec, log_dir: Path | None,
                 types: Mapping[str, Partition] | None = None,
                 priors: Mapping[str, Sequence[Observation]] | None = None,
                 prior_model: Profiler | None = None
                 ) -> tuple[dict[str, PartitionFrontier], dict[str, int]]:
    """Run every partition type's search as a task of ``executor``; see the module doc.

    Args:
        executor: Runs the tasks (``optimize(pool=...)``).
        profiler: Measures (as [`kareus.workflow.optimize`][kareus.workflow.optimize] takes it).
        search: How every type is searched.
        pset: The workload's partition set (its workload sets the GPUs a task needs).
        log_dir: The run's log folder (``search-<key>.jsonl`` per type), or ``None``.
        types: The partition types to search, by key (the key names the task and its
            log); ``None`` = ``pset.types``
            ([`kareus.compose.kareus_types`][kareus.compose.kareus_types] gives kareus's, the
            unsplit types included).
        priors: Observations each type's search starts from, by key.
        prior_model: The model whose prediction is every search's prior mean
            ([`SearchSpec.run`][kareus.search.SearchSpec.run]), or ``None``.

    Returns:
        ``(frontiers, profiles)`` per type, as a serial run gives them; ``profiler``'s call
        count is advanced by the measurements the tasks made.

    Raises:
        TypeError: ``executor`` is not a ``concurrent.futures.Executor``.
        Exception: whatever a task raised (re-raised here).
    """
    if not isinstance(executor, Executor):
        raise ArgumentTypeError(f"executor must be a concurrent.futures.Executor (a thread or "
                                f"process pool, kareus.workflow.ray.RayExecutor, submitit's "
                                f"AutoExecutor), got {type(executor).__name__}")
    parts: Mapping[str, Partition] = pset.types if types is None else types
    names = list(parts)
    base = profiler.measurement_count
    gpus = pset.workload.parallelism.gpus_per_stage
    futures = {}
    for name in names:
        path = None if log_dir is None else search_log_path(log_dir, name)
        resume = path.read_text(encoding="utf-8") if path is not None and path.exists() \
            else None
        task = SearchTask(name=name, partition=parts[name], profiler=copy.deepcopy(profiler),
                          search=search, resume_text=resume, log=log_dir is not None,
                          num_gpus=task_gpus(profiler, parts[name], gpus),
                          prior=tuple((priors or {}).get(name, ())),
                          prior_model=None if prior_model is None
                          else copy.deepcopy(prior_model))
        futures[name] = executor.submit(task)
    final = {n: f.result() for n, f in futures.items()}
    records = [final[n].log_record(1) for n in names]
    if base is not None:
        profiler.advance_measurements(sum(r.noise_used for r in final.values()))
    if log_dir is not None:
        for n in names:
            log_text = final[n].log_text
            if log_text is not None:
                write_text_atomic(search_log_path(log_dir, n), log_text)
        with open(log_dir / "tasks.jsonl", "a", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    frontiers = {n: final[n].frontier for n in names}
    return frontiers, {n: len(frontiers[n].measured()) - final[n].priors for n in names}
