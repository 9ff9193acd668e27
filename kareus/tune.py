"""Tuning on the target machine: the whole kareus job, measured on the job's own GPUs.

:func:`tune` is what ``kareus optimize --profiler nvml`` runs on every rank under
``torchrun`` (one process per GPU of one pipeline stage's TP x CP group; the stages of a
pipeline run the same partition types, so one group measures them all). It profiles every
partition type of the workload with the multi-pass search through the
:class:`~kareus.exec.nvml.NVMLProfiler`, measures the baselines' configurations and the
work outside partitions, composes the five systems, and writes the same ``results.json``,
``plan.json`` and search logs as the emulated job, plus ``tune.json`` (the machine, the
clocks, the backends, the GPU time).

Every rank must issue the same collectives in the same order. So only rank 0 runs the
search and the composition: :class:`LockstepProfiler` announces each measurement (the
partition, by its index in a :class:`Catalog` every rank builds from the workload, and the
configuration, by value) with one broadcast, then measures it together with the other
ranks, which :func:`follow` the announcements until rank 0 says it is done. Nothing a rank
decides alone changes how many collectives run.

The frequency dimension is the set of clocks the profiler may set: every clock of the
GPU's search grid with ``allow_clock_changes`` (an
:class:`~kareus.exec.frequency.NVMLFrequencyController`, restored on exit), else the GPU's
default clock alone (a :class:`~kareus.exec.frequency.DryRunFrequencyController`, as on
shared machines whose clocks must not change); the output says which. The collective
backend is a dimension where more than one runs on the group (kareus's own SM-capped
kernels and NCCL with capped CTAs), so each partition type's choice is measured.

Resuming: the search logs resume as in the emulated job, and every other measurement
(baselines, outside work) is appended to ``logs/measurements.jsonl`` and served from
there by a later run of the same command; the followers measure whatever rank 0 still
asks for.

A world of one process runs the same path on one GPU with
:class:`~kareus.exec.collectives.LoopbackCollective` (a stand-in that communicates with
nobody): a smoke run of the tuning path, whose figures are not kareus's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kareus._io import write_json_atomic
from kareus._logging import get_logger
from kareus.errors import HardwareError, KareusError
from kareus.exec.nvml import Coordinator
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition, TransformerPartition, build_partitions
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search.partition_frontier import PartitionFrontier
from kareus.workflow import OptimizationResult, manifest_inputs, optimize

__all__ = ["Catalog", "LockstepProfiler", "TuneReport", "follow", "run_lockstep", "tune"]

_log = get_logger(__name__)

#: Announcement words: stop (``[0, ok]``), measure a partition, measure outside work.
_STOP, _MEASURE, _OUTSIDE = 0.0, 1.0, 2.0
_WIDTH = 7
#: The file of every measurement rank 0 made, for resuming (in the log folder).
MEASUREMENTS_NAME = "measurements.jsonl"


def _variants(workload: Workload) -> list[Workload]:
    """The workloads whose partitions the five systems measure (kareus's, without
    nanobatching for the sequential systems, with two nanobatches for nanobatching)."""
    out = [workload, workload.with_(nanobatches=1)]
    if workload.nanobatches < 2:
        out.append(workload.with_(nanobatches=2))
    return out


class Catalog:
    """Every partition type and every outside work a tuning run may measure, in an order
    that every rank derives alike from the workload (so an index names the same thing on
    every rank).

    Args:
        workload: The workload tuned.

    Attributes:
        partitions: ``(partition type, the workload variant it belongs to)``, in order.
        outside: ``(outside work, the workload variant)``, in order (the work outside
            partitions of every stage and phase, and the once-per-iteration work where the
            partition builder models it).
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.partitions: list[tuple[Partition, Workload]] = []
        self.outside: list[tuple[OutsideWork, Workload]] = []
        for wl in _variants(workload):
            pset = build_partitions(wl)
            for part in pset.types.values():
                if all(part != p for p, _ in self.partitions):
                    self.partitions.append((part, wl))
            works = list(pset.outside.values())
            tail = getattr(pset, "iteration", None)  # once per iteration, where modelled
            if isinstance(tail, OutsideWork):
                works.append(tail)
            for work in works:
                if all(work != w for w, _ in self.outside):
                    self.outside.append((work, wl))

    def partition_index(self, partition: Partition) -> int:
        """The index of ``partition`` (a type of one of the variants).

        Raises:
            KeyError: it is none of the workload's partition types.
        """
        for i, (p, _) in enumerate(self.partitions):
            if p is partition or p == partition:
                return i
        raise KeyError(f"partition {partition.name!r} is not a type of {self.workload.describe()}")

    def outside_index(self, work: OutsideWork) -> int:
        """The index of ``work``.

        Raises:
            KeyError: it is none of the workload's outside works.
        """
        for i, (w, _) in enumerate(self.outside):
            if w == work:
                return i
        raise KeyError("outside work not of this workload")


def _encode_config(part: Partition, cfg: ScheduleConfig, backends: Sequence[str]) -> list[float]:
    slots = [s.name for s in part.slots]
    slot = -1 if cfg.launch_slot is None else slots.index(cfg.launch_slot)
    backend = -1 if cfg.backend is None else list(backends).index(cfg.backend)
    return [float(cfg.freq_mhz), float(cfg.comm_sms), float(slot), float(backend)]


def _decode_config(part: Partition, words: Sequence[float], backends: Sequence[str]
                   ) -> ScheduleConfig:
    freq, sms, slot, backend = (int(round(w)) for w in words[:4])
    return ScheduleConfig(freq, sms, None if slot < 0 else part.slots[slot].name,
                          backend=None if backend < 0 else list(backends)[backend])


class LockstepProfiler(Profiler):
    """Rank 0's profiler in a tuning run: announces each measurement, then measures it with
    the other ranks (which run :func:`follow`).

    Measurements made before (``cache``) are answered without measuring again.

    Args:
        inner: This rank's profiler (collective over the group, e.g. an
            :class:`~kareus.exec.nvml.NVMLProfiler`).
        coordinator: Agreement among the ranks (rank 0 is this one).
        catalog: The catalog every rank built from the workload.
        backends: The backend names configurations may carry, in the same order on
            every rank.
        cache: A JSONL file of earlier measurements, read now and appended to.
    """

    def __init__(self, inner: Profiler, *, coordinator: Coordinator, catalog: Catalog,
                 backends: Sequence[str] = (), cache: str | os.PathLike[str] | None = None
                 ) -> None:
        if not isinstance(inner, Profiler):
            raise TypeError(f"inner must be a Profiler, got {type(inner).__name__}")
        if coordinator.rank != 0:
            raise ValueError("the LockstepProfiler runs on rank 0; other ranks call follow()")
        self.inner = inner
        self.gpu = inner.gpu
        self.coord = coordinator
        self.catalog = catalog
        self.backends = tuple(backends)
        self.cache = None if cache is None else Path(cache)
        self._known: dict[str, Measurement] = {}
        self._broken = False
        self._finished = False
        #: Measurements made in this run (not served from the cache).
        self.measured = 0
        if self.cache is not None and self.cache.is_file():
            with open(self.cache, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        rec = json.loads(line)
                        self._known[rec["key"]] = Measurement.from_dict(rec["measurement"])
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a kill: measured again
            _log.info("resuming: %d measurements in %s", len(self._known), self.cache)

    @property
    def known(self) -> int:
        """Measurements made so far, in this run and the runs it resumes."""
        return len(self._known)

    def _remember(self, key: str, m: Measurement) -> None:
        self._known[key] = m
        if self.cache is not None:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"key": key, "measurement": m.to_dict()}) + "\n")

    def _announce(self, words: Sequence[float]) -> None:
        self.coord.broadcast(list(words) + [0.0] * (_WIDTH - len(words)))

    def _collective(self, words: list[float], run: Callable[[], Measurement]) -> Measurement:
        if self._broken or self._finished:
            raise HardwareError("the tuning run's ranks are no longer in step (an earlier "
                                "measurement failed); run the same command again to resume")
        self._announce(words)
        try:
            m = run()
        except BaseException:
            # The group failed together (a measurement's failure is decided collectively):
            # the followers left their loop too, so nothing more is announced.
            self._broken = True
            raise
        self.measured += 1
        return m

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Announce, then measure ``partition`` under ``config`` with every rank."""
        idx = self.catalog.partition_index(partition)
        key = json.dumps(["p", idx, partition.name, config.to_dict()], sort_keys=True)
        if key not in self._known:
            words = [_MEASURE, float(idx), *_encode_config(partition, config, self.backends)]
            self._remember(key, self._collective(
                words, lambda: self.inner.measure(partition, config)))
        return self._known[key]

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Announce, then measure the outside work with every rank."""
        idx = self.catalog.outside_index(work)
        key = json.dumps(["o", idx, int(freq_mhz), int(group_size), comm_sms])
        if key not in self._known:
            words = [_OUTSIDE, float(idx), float(freq_mhz), float(group_size),
                     -1.0 if comm_sms is None else float(comm_sms)]
            self._remember(key, self._collective(words, lambda: self.inner.measure_outside(
                work, int(freq_mhz), group_size=group_size, comm_sms=comm_sms)))
        return self._known[key]

    def static_power_w(self, group_size: int) -> float:
        """The inner profiler's (measured when it started, on every rank)."""
        return self.inner.static_power_w(group_size)

    def space(self, partition: Partition) -> ConfigSpace:
        """The inner profiler's space."""
        return self.inner.space(partition)

    def clocks_mhz(self) -> tuple[int, ...] | None:
        """The inner profiler's clocks."""
        return self.inner.clocks_mhz()

    def finish(self, ok: bool = True) -> None:
        """Tell the followers that the run is over (``ok``: it succeeded). Once."""
        if self._finished or self._broken:
            return
        self._finished = True
        self._announce([_STOP, 1.0 if ok else 0.0])


def follow(inner: Profiler, *, coordinator: Coordinator, catalog: Catalog,
           backends: Sequence[str] = ()) -> int:
    """The other ranks' side of a tuning run: measure what rank 0 announces, until it stops.

    Args:
        inner: This rank's profiler.
        coordinator: Agreement among the ranks.
        catalog: The catalog every rank built from the workload.
        backends: The backend names, in rank 0's order.

    Returns:
        Measurements made.

    Raises:
        HardwareError: rank 0 stopped because its run failed.
    """
    count = 0
    while True:
        words = coordinator.broadcast([0.0] * _WIDTH)
        cmd = words[0]
        if cmd == _STOP:
            if words[1] <= 0:
                raise HardwareError("rank 0's tuning run failed (its output says why); this "
                                    "rank stopped with it")
            return count
        if cmd == _MEASURE:
            part, _ = catalog.partitions[int(round(words[1]))]
            inner.measure(part, _decode_config(part, words[2:], backends))
        elif cmd == _OUTSIDE:
            work, _ = catalog.outside[int(round(words[1]))]
            sms = int(round(words[4]))
            inner.measure_outside(work, int(round(words[2])), group_size=int(round(words[3])),
                                  comm_sms=None if sms < 0 else sms)
        else:
            raise HardwareError(f"unknown announcement {words!r} from rank 0")
        count += 1


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
    """

    result: OptimizationResult | None
    frontiers: dict[str, PartitionFrontier]
    paths: dict[str, Path]
    wall_s: float
    world_size: int
    gpu_time_s: float
    measured: int
    info: dict[str, Any]


def run_lockstep(workload: Workload, *, profiler: Profiler, coordinator: Coordinator,
                 out_dir: str | os.PathLike[str], backends: Sequence[str] = (),
                 types: Sequence[str] | None = None, budget: int = 16,
                 batch_size: int | None = None, seed: int = 0, schedule: str = "1f1b",
                 surrogate: Any = None, systems: Sequence[str] | None = None,
                 fresh: bool = False, progress: bool | None = None,
                 deadline_s: float | None = None, energy_budget_j: float | None = None,
                 info: dict[str, Any] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 started: float | None = None) -> TuneReport | None:
    """The tuning run over an already built profiler, on every rank (rank 0 leads).

    Rank 0 runs :func:`~kareus.workflow.optimize` (or, with ``types``, only those types'
    searches) through a :class:`LockstepProfiler` and writes the outputs into ``out_dir``;
    the other ranks :func:`follow`. Hardware-free: :func:`tune` builds the NVML profiler,
    tests pass fakes.

    Args:
        workload: The workload.
        profiler: This rank's profiler (collective over the group).
        coordinator: Agreement among the ranks.
        out_dir: Output folder (rank 0 writes it).
        backends: Backend names configurations may carry.
        types: Search only these partition types and write their frontiers
            (``frontiers.json``) instead of composing; ``None`` = the whole job.
        budget, batch_size, seed, schedule, surrogate, systems, fresh, progress: As for
            :func:`~kareus.workflow.optimize`.
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
    from kareus._outdir import guarded_folder

    t0 = clock() if started is None else started
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
        inputs = manifest_inputs(workload, leader, budget=budget, batch_size=batch_size,
                                 seed=seed, schedule=schedule, surrogate=surrogate,
                                 systems=systems)
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
                    result = optimize(workload, profiler=leader, budget=budget,
                                      batch_size=batch_size, seed=seed, log_dir=out / "logs",
                                      schedule=schedule, surrogate=surrogate, systems=systems,
                                      progress=progress)
                    frontiers = result.partition_frontiers()
                    plan = result.select(deadline_s=deadline_s,
                                         energy_budget_j=energy_budget_j)
                    paths.update(result.save(out, plan=plan))
                else:
                    frontiers = _search_types(leader, catalog, types, budget=budget,
                                              batch_size=batch_size, seed=seed,
                                              log_dir=out / "logs", progress=progress,
                                              surrogate=surrogate)
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
                      info=report_info)


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
    data.update({
        "workload": workload.to_dict(), "world_size": world, "backends": list(backends),
        "types": None if types is None else list(types),
        "measurements": leader.known, "gpu_time_s": sum(r["gpu_time_s"] for r in runs),
        "runs": runs,
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


def _search_types(profiler: Profiler, catalog: Catalog, types: Sequence[str], *, budget: int,
                  batch_size: int | None, seed: int, log_dir: Path, progress: bool | None,
                  surrogate: Any) -> dict[str, PartitionFrontier]:
    from kareus.search import MultiPassSearch
    from kareus.workflow import resolve_surrogate

    pset = build_partitions(catalog.workload)
    unknown = [t for t in types if t not in pset.types]
    if unknown:
        raise ValueError(f"unknown partition type(s) {unknown}; {catalog.workload.describe()} "
                         f"has {list(pset.types)}")
    log_dir.mkdir(parents=True, exist_ok=True)
    template = resolve_surrogate(surrogate, seed)
    out = {}
    for name in types:
        part = pset.types[name]
        space = profiler.space(part)
        search = MultiPassSearch(space, budget=min(budget, len(space)), batch_size=batch_size,
                                 seed=seed, resume=log_dir / f"search-{name}.jsonl",
                                 progress=progress, surrogate=template)
        out[name] = search.run(profiler, part)
    return out


# --------------------------------------------------------------------------- hardware


def tuning_backends(env: Any, wanted: Sequence[str] | None,
                    build: dict[str, Callable[[], Any]], *,
                    group_sizes: Sequence[int] | None = None
                    ) -> tuple[dict[str, Any], dict[str, str]]:
    """The collective backends a tuning run searches: each of ``build`` (name -> its
    constructor, in order) that ``wanted`` names (``None``: all) and that can run in the
    agreed environment ``env`` on every group its collectives use (``group_sizes``: the TP
    and CP degrees above 1; ``None`` = the environment's whole world), built.

    Construction is collective (every rank builds the same backends in the same order); a
    failure on one rank only (an IPC mapping) stops the job, as NCCL's would.

    Returns:
        ``(backends by name, why each other one cannot run)``.

    Raises:
        HardwareError: none can run; the message says why for each.
        ValueError: ``wanted`` names a backend that is not in ``build``.
    """
    from kareus.exec.collectives import backend_unavailable_reason

    unknown = sorted(set(wanted or ()) - set(build))
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown} for tuning: use {sorted(build)}")
    named: dict[str, Any] = {}
    notes: dict[str, str] = {}
    for name, make in build.items():
        if wanted is not None and name not in wanted:
            continue
        sizes = [env.world_size] if group_sizes is None else list(group_sizes)
        why = next((w for n in sizes if (w := backend_unavailable_reason(
            name, dataclasses.replace(env, world_size=n))) is not None), None)
        if why is None:
            try:
                named[name] = make()
            except KareusError as exc:
                why = str(exc)
        if why is not None:
            notes[name] = why
    if not named:
        raise HardwareError("no capped collective backend runs on this group: "
                            + "; ".join(f"{n}: {w}" for n, w in notes.items()))
    return named, notes


def detect_gpu_preset(device_name: str) -> str:
    """The GPU preset of a CUDA device name (``"NVIDIA H200"`` -> ``"h200-sxm"``).

    Raises:
        HardwareError: no preset matches; pass ``--gpu``.
    """
    name = device_name.lower()
    for key, preset in (("h200", "h200-sxm"), ("h100", "h100-sxm"), ("a100", "a100-40gb")):
        if key in name:
            return preset
    raise HardwareError(f"no GPU preset for {device_name!r}: pass --gpu (see `kareus gpus`) "
                        "or --gpu-file")


def tune(workload: Workload, *, out_dir: str | os.PathLike[str], gpu: str | None = None,
         budget: int = 16, batch_size: int | None = None, seed: int = 0,
         schedule: str = "1f1b", surrogate: Any = None, systems: Sequence[str] | None = None,
         types: Sequence[str] | None = None, fresh: bool = False,
         progress: bool | None = None, allow_clock_changes: bool = False,
         backends: Sequence[str] | None = None, comm_sms: Sequence[int] | None = None,
         kernels: Any = None, deadline_s: float | None = None,
         energy_budget_j: float | None = None,
         profiler_options: dict[str, Any] | None = None) -> TuneReport | None:
    """Tune ``workload`` on this job's GPUs; call it on every rank (under ``torchrun``).

    The world is one pipeline stage's TP x CP group (``world_size == tp x cp``), or one
    process (a smoke run of the path with :class:`~kareus.exec.collectives.LoopbackCollective`).

    Args:
        workload: The workload.
        out_dir: Output folder (rank 0 writes ``results.json``, ``plan.json``, ``tune.json``
            and ``logs/``).
        gpu: GPU preset; ``None`` = detected from the device name.
        budget: Profiles per partition type.
        batch_size, seed, schedule, surrogate, systems, fresh, progress: As for
            :func:`~kareus.workflow.optimize`.
        types: Only these partition types (no composition), e.g. a smoke run.
        allow_clock_changes: Search the clocks with an
            :class:`~kareus.exec.frequency.NVMLFrequencyController` (needs root; never on
            shared machines). Otherwise the clocks stay as they are and only the default
            clock is measured.
        backends: Backends to search among ``"own"`` and ``"nccl_capped"``; ``None`` =
            every one that runs on this group (``"loopback"`` alone in a world of one).
            Each is built per TP and CP group (:func:`kareus.exec.train.make_collectives`).
        comm_sms: SM counts to search; ``None`` = 2, 4, 8, 16, 24, 32 and the GPU's default
            (each NCCL cap is a communicator of its own).
        kernels: The runnable partitions' kernel set (``None``: the library's choice).
        deadline_s, energy_budget_j: The plan chosen (at most one).
        profiler_options: Keyword arguments of :class:`~kareus.exec.nvml.NVMLProfiler`
            (``warmup_s``, ``window_steps``, ...).

    Returns:
        The report on rank 0, ``None`` elsewhere.

    Raises:
        HardwareError: no GPU, no NVML, a world that is not the workload's group.
    """
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise HardwareError("--profiler nvml measures on GPUs through PyTorch: install it "
                            "(pip install 'kareus[torch]') on a machine with NVIDIA GPUs") from exc

    from kareus.exec.collectives import LoopbackCollective, probe_collective_environment
    from kareus.exec.executor import TorchExecutor
    from kareus.exec.frequency import (
        DryRunFrequencyController,
        NVMLFrequencyController,
    )
    from kareus.exec.nvml import (
        EnergyMeter,
        LocalCoordinator,
        NVMLProfiler,
        TorchDistributedCoordinator,
        TorchPartitionRunner,
    )
    t_begin = time.monotonic()
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")  # no multicast
    if not torch.cuda.is_available():
        raise HardwareError("no CUDA GPU visible: tuning on the machine needs its GPUs (use "
                            "the emulated profiler without them)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    owns_group = not dist.is_initialized() and "WORLD_SIZE" in os.environ
    if owns_group:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = workload.parallelism.tp * workload.parallelism.cp
    if world not in (1, group):
        raise HardwareError(f"{world} processes for a TP x CP group of {group}: run one process "
                            f"per GPU of one stage (torchrun --nproc_per_node {group}), or one "
                            "for a smoke run")
    coord: Coordinator = TorchDistributedCoordinator() if world > 1 else LocalCoordinator()
    device_name = torch.cuda.get_device_name()
    gpu_name = gpu or detect_gpu_preset(device_name)
    from kareus.model.gpu import get_gpu

    spec = get_gpu(gpu_name)

    # Collective backends: every one that runs on this group, the same on every rank.
    if world == 1:
        named: dict[str, Any] = {"loopback": LoopbackCollective()}
        notes: dict[str, str] = {}
        default: Any = named["loopback"]
    else:
        # One backend per TP and CP group (all-reduces over TP, all-gathers and
        # reduce-scatters over CP), as the training loop runs them.
        from kareus.exec.train import TorchParallelGroups, make_collectives

        p = workload.parallelism
        groups = TorchParallelGroups(tp=p.tp)
        made: dict[str, Any] = {}

        def maker(name: str) -> Callable[[], Any]:
            def make() -> Any:
                made[name] = make_collectives(groups, backend=name)
                return made[name][0]
            return make

        named, notes = tuning_backends(probe_collective_environment(), backends,
                                       {n: maker(n) for n in ("own", "nccl_capped")},
                                       group_sizes=[n for n in (p.tp, p.cp) if n > 1])
        default = made[next(iter(named))][1]  # each group's collectives, NCCL's own CTAs
    names = list(named)
    primary = named.get("nccl_capped", named[names[0]])  # the baselines' NCCL where it runs
    executor = TorchExecutor(collective=primary, backends=named, default_collective=default)

    resolve, outside = _runnables(Catalog(workload), kernels)
    runner = TorchPartitionRunner(executor, seed=1234, resolve=resolve)
    if allow_clock_changes:
        controller: Any = NVMLFrequencyController(gpu=spec)
    else:
        controller = DryRunFrequencyController(gpu=spec)
    sms = sorted({*(comm_sms or (2, 4, 8, 16, 24, 32)), spec.default_comm_sms})
    meter = EnergyMeter()
    prof = NVMLProfiler(gpu=spec, runner=runner, meter=meter, coordinator=coord,
                        frequency=controller, comm_sms=sms, backends=names, outside=outside,
                        **(profiler_options or {}))
    say = (lambda msg: print(f"kareus: {msg}", file=sys.stderr, flush=True)) \
        if coord.rank == 0 else (lambda msg: None)
    say(f"tuning {workload.describe()} on {world}x {device_name} ({spec.name}); backends "
        f"{names}" + (f" (not available: {notes})" if notes else "")
        + ("; a world of one: LoopbackCollective stands in for communication (smoke run)"
           if world == 1 else ""))
    say(prof.clock_note)
    try:
        with contextlib.ExitStack() as stack:
            if allow_clock_changes:
                stack.callback(controller.close)
            prof.start()
            say(f"energy counter steps every {1e3 * (prof.step_period_s or 0):.0f} ms; static "
                f"power {prof.static_power_w():.0f} W over {world} GPU(s)")
            _preheat(prof, resolve, Catalog(workload), names, say)
            import pynvml

            info = {
                "machine": f"{world}x {device_name}",
                "software": {"torch": torch.__version__,
                             "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                             "cuda": torch.version.cuda},
                "gpu": spec.name, "clocks_controlled": prof.clocks_controlled,
                "clocks_mhz": list(prof.freqs_mhz), "clock_note": prof.clock_note,
                "comm_sms": sms, "backends_unavailable": notes,
                "static_power_w": prof.static_power_w(),
                "counter_step_s": prof.step_period_s,
                "smoke_run": world == 1,
                "command": _command(),
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
            }
            report = run_lockstep(workload, profiler=prof, coordinator=coord, out_dir=out_dir,
                                  backends=names if len(names) > 1 else (), types=types,
                                  budget=budget, batch_size=batch_size, seed=seed,
                                  schedule=schedule, surrogate=surrogate, systems=systems,
                                  fresh=fresh, progress=progress, deadline_s=deadline_s,
                                  energy_budget_j=energy_budget_j, info=info,
                                  started=t_begin)
    finally:
        prof.close()
        for backend in named.values():
            with contextlib.suppress(Exception):
                backend.close()
        if owns_group:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    wall = time.monotonic() - t_begin
    if report is not None:
        say(f"GPU time: {wall:.1f} s x {world} GPU(s) = {wall * world:.1f} GPU-s "
            f"({report.measured} measurements, {len(prof.records)} on this rank)")
        report = attrs.evolve(report, wall_s=wall, gpu_time_s=wall * world)
    return report


def _preheat(prof: Any, resolve: Callable[[Partition], Any], catalog: Catalog,
             names: Sequence[str], say: Callable[[str], None]) -> None:
    """Run the first partition type a few times on every rank and take the GPUs' working
    temperature as the cool-down baseline (else each candidate would wait for the idle
    temperature, which a loaded GPU does not reach in its cool-down time)."""
    part = catalog.partitions[0][0]
    gpu = prof.gpu
    slot = part.slots[0].name if part.slots else None
    cfg = ScheduleConfig(gpu.max_clock_mhz, gpu.default_comm_sms, slot,
                         backend=names[-1] if len(names) > 1 else None)
    try:
        temp = prof.preheat(resolve(part), cfg)
    except HardwareError as exc:  # decided on every rank together
        say(f"pre-heating failed ({exc}); the cool-down baseline stays the idle temperature")
        return
    say(f"pre-heated on {part.name}: cool-down baseline {temp:.0f} C")


def _runnables(catalog: Catalog, kernels: Any) -> tuple[Callable[[Partition], Any],
                                                        Callable[[OutsideWork, int | None], Any]]:
    """How the NVML profiler gets kernels: each catalogued partition type as one
    :class:`~kareus.exec.torch_partition.RunnableTransformerPartition` (made once), and
    outside work as :class:`~kareus.exec.outside_work.RunnableOutsideWork`."""
    from kareus.exec.outside_work import RunnableOutsideWork
    from kareus.exec.torch_partition import RunnableTransformerPartition

    made: dict[int, Any] = {}

    def resolve(part: Partition) -> Any:
        idx = catalog.partition_index(part)
        if idx not in made:
            p, wl = catalog.partitions[idx]
            if not isinstance(p, TransformerPartition):  # the partition builder's type
                raise TypeError(f"partition {p.name!r} is not a TransformerPartition")
            made[idx] = RunnableTransformerPartition(p, wl, kernels=kernels)
        return made[idx]

    def outside(work: OutsideWork, sms: int | None) -> Any:
        wl = catalog.outside[catalog.outside_index(work)][1]
        return RunnableOutsideWork(work, wl, comm_sms=sms, kernels=kernels)

    return resolve, outside


def _command() -> str:
    """This process's command line, as the user typed it (``kareus ...`` under torchrun)."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("kareus/__main__.py", "kareus/cli.py")):
        argv[0] = "kareus"
    return " ".join(argv)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
