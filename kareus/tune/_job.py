"""The tuning job over a built profiler: what rank 0 runs, writes and reports.

``run_lockstep`` is the part of a tuning run that needs no GPU: on rank 0 it runs
[`optimize`][kareus.workflow.optimize] (or, for a smoke run, only some partition types' searches)
through a ``LockstepProfiler``, and writes the same ``results.json``,
``plan.json`` and search logs as the emulated job, plus ``tune.json`` (the machine, the
clocks, the backends, the GPU time of every run of the command); the other ranks
``follow``. It returns a ``TuneReport``.

Resuming: the search logs resume as in the emulated job, and every other measurement
(baselines, outside work) is appended to ``logs/measurements.jsonl``
(``MEASUREMENTS_NAME``) and served from there by a later run of the same command; the
followers measure whatever rank 0 still asks for. A run that stops early still records its
GPU time in ``tune.json``.

``tune.json`` also says how the GPUs were fed: ``execution`` (``"graphed"`` where the
executor captured each step into CUDA graphs, as training runs, ``"eager"`` otherwise) and
``host_bound``, the measurements whose GPU was busy less than 90% of their window
(``HOST_BOUND_BUSY``), lowest first: their figures are of the host's
launches as much as of the partition.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kareus._io import write_json_atomic
from kareus.errors import ArgumentError
from kareus.model.partition import build_partitions
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.profilers.nvml import HOST_BOUND_BUSY, Coordinator
from kareus.search import PartitionFrontier, SearchSpec, search_log_path
from kareus.tune._lockstep import Catalog, LockstepProfiler, follow
from kareus.workflow import OptimizationResult, manifest_inputs, optimize

__all__ = ["MEASUREMENTS_NAME", "TuneReport", "run_lockstep"]


#: The file of every measurement rank 0 made, for resuming (in the log folder).
MEASUREMENTS_NAME = "measurements.jsonl"


@attrs.frozen(kw_only=True)
class TuneReport:
    """What a tuning run did (rank 0's view).

    Attributes:
        result: The composed result (``None`` when only some partition types were searched).
        frontiers: Each searched partition type's frontier.
        paths: Files written.
        wall_s: Wall time of the run on rank 0.
        world_size: GPUs (ranks) that measured.
        gpu_time_s: ``wall_s x world_size``: the GPU time the run held.
        measured: Measurements made in this run (not served from a resumed log).
        info: What ``tune.json`` records (clocks, backends, machine).
        execution: How the steps fed the GPUs: ``"graphed"`` (CUDA-graph replays) or
            ``"eager"``; ``None``: the profiler does not say.
        host_bound: The measurements whose GPU was busy less than
            ``HOST_BOUND_BUSY`` of their window (``tune.json``'s
            ``host_bound``).
    """

    result: OptimizationResult | None
    frontiers: dict[str, PartitionFrontier]
    paths: dict[str, Path]
    wall_s: float
    world_size: int
    gpu_time_s: float
    measured: int
    info: dict[str, Any]
    execution: str | None = None
    host_bound: tuple[dict[str, Any], ...] = ()


def run_lockstep(workload: Workload, *, profiler: Profiler, coordinator: Coordinator,
                 out_dir: str | os.PathLike[str], backends: Sequence[str] = (),
                 types: Sequence[str] | None = None, budget: int = 16,
                 batch_size: int | None = None, seed: int = 0, schedule: str = "1f1b",
                 surrogate: Any = None, systems: Sequence[str] | None = None,
                 search: SearchSpec | None = None,
                 fresh: bool = False, progress: bool | None = None,
                 deadline_s: float | None = None, energy_budget_j: float | None = None,
                 info: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 started: float | None = None) -> TuneReport | None:
    """The tuning run over an already built profiler, on every rank (rank 0 leads).

    Rank 0 runs [`optimize`][kareus.workflow.optimize] (or, with ``types``, only those types'
    searches) through a ``LockstepProfiler`` and writes the outputs into ``out_dir``;
    the other ranks ``follow``. Hardware-free: ``tune`` builds the NVML profiler,
    tests pass fakes.

    Args:
        workload: The workload.
        profiler: This rank's profiler (collective over the group).
        coordinator: Agreement among the ranks.
        out_dir: Output folder (rank 0 writes it).
        backends: Backend names configurations may carry.
        types: Search only these partition types and write their frontiers
            (``frontiers.json``) instead of composing; ``None`` = the whole job.
        budget, batch_size, seed, schedule, surrogate, systems, fresh, progress: As
            [`optimize`][kareus.workflow.optimize].
        search: The search specification; ``None`` = one made of ``budget``,
            ``batch_size``, ``seed`` and ``surrogate`` (given, it replaces them). The
            partition types' searches of a run with ``types`` use it as the whole job's do.
        deadline_s, energy_budget_j: The plan chosen (at most one; default the fastest).
        info: Extra facts for ``tune.json`` (machine, clocks, backends).
        clock: Time source.
        started: When the run began by ``clock`` (setting up the GPUs included); ``None``
            = now.

    ``tune.json`` keeps one entry per run of the command in ``runs`` (a resumed run adds
    one), and the GPU time of them all in ``gpu_time_s``.

    Returns:
        The report on rank 0, ``None`` on the other ranks.
    """
    from kareus.workflow.outdir import guarded_folder

    t0 = clock() if started is None else started
    if search is None:
        search = SearchSpec(budget=budget, batch_size=batch_size, seed=seed, surrogate=surrogate)
    catalog = Catalog(workload)
    world = coordinator.world_size
    if coordinator.rank != 0:
        follow(profiler, coordinator=coordinator, catalog=catalog, backends=backends)
        return None
    out = Path(out_dir)
    cache = out / "logs" / MEASUREMENTS_NAME
    leader = LockstepProfiler(profiler, coordinator=coordinator, catalog=catalog,
                              backends=backends, cache=None)
    ok = False
    try:
        inputs = manifest_inputs(workload, leader, budget=search.budget,
                                 batch_size=search.batch_size, seed=search.seed,
                                 schedule=schedule, surrogate=search.surrogate, systems=systems,
                                 passes=search.passes)
        inputs["tuning"] = {"types": None if types is None else list(types),
                            "backends": list(backends),
                            "clocks_mhz": list(leader.clocks_mhz() or ()),
                            "world_size": world}
        with guarded_folder(out, inputs, fresh=fresh, what="--out"):
            if fresh and cache.exists():
                cache.unlink()
            leader = LockstepProfiler(profiler, coordinator=coordinator, catalog=catalog,
                                      backends=backends, cache=cache)
            paths: dict[str, Path] = {"tune": out / "tune.json"}
            result: OptimizationResult | None = None
            frontiers: dict[str, PartitionFrontier] = {}
            try:
                if types is None:
                    result = optimize(workload, profiler=leader, search=search,
                                      log_dir=out / "logs", schedule=schedule, systems=systems,
                                      progress=progress)
                    frontiers = result.partition_frontiers()
                    plan = result.select(deadline_s=deadline_s,
                                         energy_budget_j=energy_budget_j)
                    paths.update(result.save(out, plan=plan))
                else:
                    frontiers = _search_types(leader, catalog, types, search,
                                              log_dir=out / "logs", progress=progress)
                    paths["frontiers"] = out / "frontiers.json"
                    write_json_atomic(paths["frontiers"], {
                        "note": "partition frontiers of the types searched; not composed "
                                "(the other types were not measured)",
                        "frontiers": {n: f.to_dict() for n, f in frontiers.items()}})
                ok = True
            finally:  # a run that stopped early still counts its GPU time
                wall = clock() - t0
                report_info = _write_tune_json(
                    paths["tune"], info, workload=workload, world=world, backends=backends,
                    types=types, leader=leader, frontiers=frontiers, wall_s=wall,
                    completed=ok)
    finally:
        leader.finish(ok)
    return TuneReport(result=result, frontiers=frontiers, paths=paths, wall_s=wall,
                      world_size=world, gpu_time_s=wall * world, measured=leader.measured,
                      info=report_info, execution=report_info.get("execution"),
                      host_bound=tuple(report_info.get("host_bound", ())))


def _write_tune_json(path: Path, info: dict[str, Any] | None, *, workload: Workload,
                     world: int, backends: Sequence[str], types: Sequence[str] | None,
                     leader: LockstepProfiler, frontiers: dict[str, PartitionFrontier],
                     wall_s: float, completed: bool) -> dict[str, Any]:
    """Write ``tune.json``: the facts of the run, and this run added to the earlier ones."""
    runs = _earlier_runs(path)
    runs.append({**{k: v for k, v in (info or {}).items()
                    if k in ("date", "command", "machine")},
                 "measured": leader.measured, "wall_s": wall_s, "gpu_time_s": wall_s * world,
                 "completed": completed})
    data = dict(info or {})
    modes = leader.executions
    if data.get("execution") is None and modes:
        data["execution"] = modes[0] if len(modes) == 1 else "mixed"
    data.update({
        "workload": workload.to_dict(), "world_size": world, "backends": list(backends),
        "types": None if types is None else list(types),
        "measurements": leader.known, "gpu_time_s": sum(r["gpu_time_s"] for r in runs),
        "runs": runs,
        "host_bound_threshold": HOST_BOUND_BUSY,
        "host_bound": leader.host_bound(),
        "profiles_per_partition_type": {n: len(f.measured()) for n, f in frontiers.items()}})
    write_json_atomic(path, data)
    return data


def _earlier_runs(path: Path) -> list[dict[str, Any]]:
    """The ``runs`` of an existing ``tune.json`` (a resumed run adds to them)."""
    try:
        runs = json.loads(path.read_text(encoding="utf-8")).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in runs if isinstance(r, dict) and "gpu_time_s" in r]


def _search_types(profiler: Profiler, catalog: Catalog, types: Sequence[str],
                  search: SearchSpec, *, log_dir: Path, progress: bool | None
                  ) -> dict[str, PartitionFrontier]:
    """The searches of some partition types alone, each as the whole job searches it."""
    pset = build_partitions(catalog.workload)
    unknown = [t for t in types if t not in pset.types]
    if unknown:
        raise ArgumentError(f"unknown partition type(s) {unknown}; {catalog.workload.describe()} "
                            f"has {list(pset.types)}")
    log_dir.mkdir(parents=True, exist_ok=True)
    return {name: search.run(profiler, pset.types[name], log=search_log_path(log_dir, name),
                             progress=progress) for name in types}
