"""Partition searches as tasks of any ``concurrent.futures.Executor``.

``optimize(workload, executor=pool)`` hands each partition type's search to ``pool`` as one
task (:class:`SearchTask`, a picklable callable): a thread or process pool on one machine,
:class:`~kareus.interop.ray.RayExecutor` on a Ray cluster, or submitit's ``AutoExecutor`` on
Slurm. kareus schedules nothing itself: the engine decides where and when each task runs.

**Logs.** A task may run on another machine, so it never writes into the run's folder. It
receives the type's existing search log (if any) as text, resumes from it in a private
temporary folder, and returns the full log with its frontier; the caller writes it back as
``search-<type>.jsonl`` in the run's log folder, and appends one line per task (type, host,
process, wall time, profiles) to ``tasks.jsonl`` there. A killed run resumes as a serial one
does.

**Same result as a serial run.** A search's choices depend only on its seed and on what it
measures. Real GPUs and recorded measurements give each configuration's measurement
independently of the other searches, so tasks may run in any order. The emulated GPU
(:class:`~kareus.exec.EmulatedProfiler`) draws the noise of its n-th measurement from
``(seed, n)``, counted over *all* searches of the run (its ``calls``): in a serial run, a
type's noise starts where the previous types' searches left the count. Each task therefore
gets a copy of the profiler whose count starts at the offset the serial run would have; the
offsets are predicted (every earlier search runs its whole budget) and checked when the tasks
return, in order: a task whose offset turns out wrong (an earlier search stopped early) is
run again with the now-known offset. The frontiers, logs and the profiler's final count are
then exactly those of the serial run (``tests/test_workflow_executor.py`` checks it with
thread and process pools and with Ray).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import attrs

from kareus._io import write_text_atomic
from kareus.model.partition import Partition, PartitionSet
from kareus.model.profiler import Profiler
from kareus.search.partition_frontier import PartitionFrontier
from kareus.search.surrogate import Surrogate

__all__ = ["SearchTask", "SearchTaskResult", "run_searches", "task_gpus"]


def _noise_position(profiler: Profiler) -> int | None:
    """The profiler's position in a shared noise stream (the emulator's ``calls``), or
    ``None`` when its measurements do not depend on how many it made before."""
    calls = getattr(profiler, "calls", None)
    return calls if isinstance(calls, int) and not isinstance(calls, bool) else None


def task_gpus(profiler: Profiler, partition: Partition, gpus_per_stage: int) -> int:
    """GPUs a search task needs: none for the emulated GPU or recorded measurements, else
    the partition's profiling group (its TP x CP GPUs)."""
    from kareus.exec.emulator import EmulatedProfiler
    from kareus.exec.replay import ReplayProfiler

    if isinstance(profiler, (EmulatedProfiler, ReplayProfiler)):
        return 0
    needs = getattr(profiler, "uses_gpus", True)
    return int(gpus_per_stage) if needs else 0


@attrs.frozen(kw_only=True)
class SearchTaskResult:
    """What one search task returns.

    Attributes:
        name: The partition type.
        frontier: Its searched frontier.
        log_text: The whole search log (JSONL) after the task, or ``None`` without logs.
        noise_offset: The profiler's noise-stream position the task started at (``None``:
            the profiler has none).
        noise_used: Measurements that advanced the noise stream.
        host: Where the task ran (host name).
        pid: The process that ran it.
        wall_s: The task's wall time.
    """

    name: str
    frontier: PartitionFrontier
    log_text: str | None
    noise_offset: int | None
    noise_used: int
    host: str
    pid: int
    wall_s: float

    def log_record(self, attempt: int) -> dict[str, Any]:
        """One line of ``tasks.jsonl``."""
        return {"type": self.name, "attempt": attempt, "host": self.host, "pid": self.pid,
                "wall_s": round(self.wall_s, 3), "profiles": len(self.frontier.measured()),
                "noise_offset": self.noise_offset, "noise_used": self.noise_used}


@attrs.frozen(kw_only=True)
class SearchTask:
    """One partition type's search, as a picklable callable (``task()`` runs it).

    Attributes:
        name: The partition type.
        partition: The partition.
        profiler: A private copy of the profiler (its noise stream at ``noise_offset``).
        budget, batch_size, seed, surrogate: As :func:`kareus.workflow.optimize` takes them.
        resume_text: The type's existing search log, or ``None`` (no logs).
        log: Whether to keep a log at all.
        num_gpus: GPUs the task needs (its profiling group; 0 on the emulator); engines
            that place tasks on GPUs (:class:`~kareus.interop.ray.RayExecutor`) read it.
    """

    name: str
    partition: Partition
    profiler: Profiler
    budget: int
    batch_size: int | None
    seed: int
    surrogate: Surrogate | None
    resume_text: str | None
    log: bool
    num_gpus: int = 0

    def __call__(self) -> SearchTaskResult:
        from kareus.search import MultiPassSearch
        from kareus.workflow import _search_type  # the serial path's search

        start = time.monotonic()
        before = _noise_position(self.profiler)
        with tempfile.TemporaryDirectory(prefix="kareus-task-") as tmp:
            log = None
            if self.log:
                log = Path(tmp) / f"search-{self.name}.jsonl"
                if self.resume_text:
                    log.write_text(self.resume_text, encoding="utf-8")
            frontier = _search_type(MultiPassSearch, self.profiler, self.partition,
                                    budget=self.budget, batch_size=self.batch_size,
                                    seed=self.seed, log=log, progress=False,
                                    surrogate=self.surrogate)
            text = log.read_text(encoding="utf-8") if log is not None and log.exists() else None
        after = _noise_position(self.profiler)
        used = 0 if before is None or after is None else after - before
        return SearchTaskResult(name=self.name, frontier=frontier, log_text=text,
                                noise_offset=before, noise_used=used, host=socket.gethostname(),
                                pid=os.getpid(), wall_s=time.monotonic() - start)


def _logged_measurements(text: str | None) -> int:
    """Measurements already in a search log (a resumed search does not redo them)."""
    if not text:
        return 0
    n = 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "measurement" in rec:
            n += 1
    return n


def _predicted_use(profiler: Profiler, partition: Partition, budget: int,
                   resume_text: str | None) -> int:
    """Measurements a search is predicted to make: its whole budget (capped by its space),
    less what its log already holds."""
    return max(0, min(budget, len(profiler.space(partition))) - _logged_measurements(resume_text))


def run_searches(executor: Executor, profiler: Profiler, pset: PartitionSet, *, budget: int,  # noqa: C901 - submit, collect and replay the noise stream in the serial order, with the argument checks
                 batch_size: int | None, seed: int, log_dir: Path | None,
                 surrogate: Surrogate | None) -> tuple[dict[str, PartitionFrontier],
                                                       dict[str, int]]:
    """Run every partition type's search as a task of ``executor``; see the module doc.

    Returns:
        ``(frontiers, profiles)`` per type, as a serial run gives them; ``profiler``'s noise
        stream is left where the serial run would leave it.

    Raises:
        TypeError: ``executor`` is not a ``concurrent.futures.Executor``.
        Exception: whatever a task raised (re-raised here).
    """
    if not isinstance(executor, Executor):
        raise TypeError(f"executor must be a concurrent.futures.Executor (a thread or process "
                        f"pool, kareus.interop.ray.RayExecutor, submitit's AutoExecutor), got "
                        f"{type(executor).__name__}")
    names = list(pset.types)
    parts: Mapping[str, Partition] = pset.types
    base = _noise_position(profiler)
    resume: dict[str, str | None] = {}
    for name in names:
        path = None if log_dir is None else log_dir / f"search-{name}.jsonl"
        resume[name] = path.read_text(encoding="utf-8") if path is not None and path.exists() \
            else None
    predicted = {n: _predicted_use(profiler, parts[n], budget, resume[n]) for n in names}
    gpus = pset.workload.parallelism.gpus_per_stage
    final: dict[str, SearchTaskResult] = {}
    attempts: dict[str, int] = dict.fromkeys(names, 0)
    records: list[dict[str, Any]] = []
    while len(final) < len(names):
        pending = [n for n in names if n not in final]
        offsets: dict[str, int | None] = {}
        pos = None if base is None else base + sum(final[n].noise_used for n in final)
        for n in pending:
            offsets[n] = pos
            if pos is not None:
                pos += predicted[n]
        futures = {}
        for n in pending:
            copy_ = copy.deepcopy(profiler)
            if offsets[n] is not None:
                copy_.calls = offsets[n]  # type: ignore[attr-defined]
            task = SearchTask(name=n, partition=parts[n], profiler=copy_, budget=budget,
                              batch_size=batch_size, seed=seed, surrogate=surrogate,
                              resume_text=resume[n], log=log_dir is not None,
                              num_gpus=task_gpus(profiler, parts[n], gpus))
            attempts[n] += 1
            futures[n] = executor.submit(task)
        results = {n: f.result() for n, f in futures.items()}
        # Accept, in order, every task whose offset is what the serial run would have had.
        pos = None if base is None else base + sum(final[n].noise_used for n in final)
        for n in pending:
            res = results[n]
            records.append(res.log_record(attempts[n]))
            if pos is not None and res.noise_offset != pos:
                break
            final[n] = res
            if pos is not None:
                pos += res.noise_used
        for n in pending:  # better predictions for the next round
            if n not in final:
                predicted[n] = results[n].noise_used
    if base is not None:
        profiler.calls = base + sum(r.noise_used for r in final.values())  # type: ignore[attr-defined]
    if log_dir is not None:
        for n in names:
            log_text = final[n].log_text
            if log_text is not None:
                write_text_atomic(log_dir / f"search-{n}.jsonl", log_text)
        with open(log_dir / "tasks.jsonl", "a", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    frontiers = {n: final[n].frontier for n in names}
    return frontiers, {n: len(frontiers[n].measured()) for n in names}
