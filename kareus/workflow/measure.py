"""The one place that measures: kareus's searches, the baselines' spaces, the outside work, the tail.

The layers below only compute: the search layer decides what to measure next
([`SearchSpec`][kareus.search.SearchSpec], [`MultiPassSearch`][kareus.search.MultiPassSearch]) and
the compose layer composes what was measured ([`compose_measured`][kareus.compose.compose_measured]).
Everything that calls a [`Profiler`][kareus.model.Profiler] for the systems compared runs here:

1. [`search_types`][kareus.workflow.search_types]: kareus's search of every partition type, one
   after another or as tasks of a ``concurrent.futures`` pool
   ([`kareus.workflow.pools`][kareus.workflow.pools]), each with its search log.
2. [`measure_systems`][kareus.workflow.measure_systems]: per system, its partition frontiers
   (kareus's searched, the baselines' restricted spaces measured exhaustively,
   [`exhaustive_search`][kareus.workflow.exhaustive_search]), the work outside partitions at the
   clocks they use ([`measure_outside_work`][kareus.workflow.measure_outside_work]) and the
   per-iteration tail, all through one cache so that a configuration measured once serves every
   system; the result is a [`SystemsMeasurements`][kareus.compose.SystemsMeasurements].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from kareus.compose.context import OutsideTable
from kareus.compose.systems import (
    MeasuredSet,
    MeasuredSystem,
    PartitionBuilder,
    SearchFn,
    SystemsMeasurements,
    baseline_space,
    kareus_partition_sets,
    kareus_type_key,
    system_configs,
    system_workload,
)
from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition, PartitionSet, build_partitions
from kareus.model.profiler import Profiler, ProfilerWrapper
from kareus.model.workload import Workload
from kareus.search import (
    Observation,
    PartitionFrontier,
    SearchSpec,
    search_log_path,
)
from kareus.workflow.checks import require_outside_work, system_names

__all__ = ["baseline_priors", "exhaustive_search", "measure_outside_work", "measure_systems",
           "partition_builder", "search_types"]



def partition_builder(partitions: PartitionSet | PartitionBuilder | None,
                      workload: Workload) -> PartitionBuilder:
    """How every workload variant the systems compose is cut into partitions.

    Args:
        partitions: ``None`` = [`build_partitions`][kareus.model.build_partitions]; a
            ``PartitionSet`` of ``workload`` = those partitions for ``workload`` itself (its
            other variants, the unsplit set kareus searches too and the baselines' nanobatch
            counts, are built by ``build_partitions``); a callable ``workload ->
            PartitionSet`` = used for every variant.
        workload: The workload optimised.

    Returns:
        The builder.

    Raises:
        ArgumentTypeError: neither; or a builder that returns something else than a
            PartitionSet (when called).
        ArgumentError: a PartitionSet of another workload.
    """
    if partitions is None:
        return build_partitions
    if isinstance(partitions, PartitionSet):
        if partitions.workload != workload:
            raise ArgumentError(f"partitions were built for {partitions.workload.describe()}, "
                                f"not for the workload optimised, {workload.describe()}")
        for name, part in partitions.types.items():
            if not isinstance(part, Partition):
                raise ArgumentTypeError(f"partitions.types[{name!r}] must be a kareus "
                                        f"Partition, got {type(part).__name__}")
        given = partitions
        return lambda wl: given if wl == given.workload else build_partitions(wl)
    if callable(partitions):
        build = partitions

        def checked(wl: Workload) -> PartitionSet:
            pset = build(wl)
            if not isinstance(pset, PartitionSet):
                raise ArgumentTypeError(f"partitions({wl.describe()}) must return a "
                                        f"PartitionSet, got {type(pset).__name__}")
            return pset
        return checked
    raise ArgumentTypeError(f"partitions must be a PartitionSet, a function workload -> "
                            f"PartitionSet, or None, got {type(partitions).__name__}")


def exhaustive_search(profiler: Profiler, space: ConfigSpace) -> PartitionFrontier:
    """Measure every configuration of ``space`` once.

    Args:
        profiler: Measures the space's partition.
        space: The configurations.

    Returns:
        The frontier over every measurement.
    """
    obs = [Observation(config=c, measurement=profiler.measure(space.partition, c))
           for c in space.configs]
    return PartitionFrontier.from_observations(space.partition.name, space.gpu.name, obs)


def measure_outside_work(profiler: Profiler, partitions: PartitionSet,
                         freqs_mhz: Sequence[int], *, comm_sms: int | None = None
                         ) -> dict[tuple[int, str], dict[int, Measurement]]:
    """Measure the work outside partitions of every stage and phase at every frequency.

    Identical work (e.g. the empty outside work of middle stages) is measured once; empty
    work costs nothing. Measurements cover one stage's TP x CP group.

    Args:
        profiler: Measures the work.
        partitions: The workload's partition set (its ``outside`` work per stage and phase).
        freqs_mhz: Frequencies to measure at.
        comm_sms: SM count of the outside collectives; ``None`` = the profiler's default.

    Returns:
        ``outside[(stage, phase)][freq_mhz]``: the measurement.

    Raises:
        ArgumentTypeError: ``profiler`` is not a Profiler, or cannot measure outside work.
    """
    if not isinstance(profiler, Profiler):
        raise ArgumentTypeError(f"profiler must be a kareus Profiler, got "
                                f"{type(profiler).__name__}")
    p = partitions.workload.parallelism
    group = p.tp * p.cp
    static = profiler.static_power_w(group)
    cache: dict[tuple[OutsideWork, int], Measurement] = {}
    out: dict[tuple[int, str], dict[int, Measurement]] = {}
    for key, work in partitions.outside.items():
        row: dict[int, Measurement] = {}
        for f in freqs_mhz:
            if not work.ops and not work.comms:
                row[int(f)] = Measurement(time_s=0.0, energy_j=0.0, static_power_w=static)
                continue
            ck = (work, int(f))
            if ck not in cache:
                cache[ck] = profiler.measure_outside(work, int(f), group_size=group,
                                                     comm_sms=comm_sms)
            row[int(f)] = cache[ck]
        out[key] = row
    return out


class _SharedMeasurements(ProfilerWrapper):
    """One measurement per (partition, configuration) for all the systems compared.

    The systems' spaces overlap (Megatron-LM's configuration is Perseus's at the maximum
    clock, and kareus's space holds them all). Measuring the same run twice would let
    measurement noise, not the system, decide which one wins, and would waste profiles on
    real GPUs; so the first measurement of a configuration serves every system.
    """

    def __init__(self, inner: Profiler) -> None:
        super().__init__(inner)
        self._runs: dict[Any, Measurement] = {}
        self._outside: dict[Any, Measurement] = {}

    @staticmethod
    def _key(partition: Partition) -> Any:
        try:
            hash(partition)
        except TypeError:
            return id(partition)
        return partition

    def remember(self, partition: Partition, frontier: PartitionFrontier) -> None:
        """Take the measured observations of a search already made."""
        for o in frontier.measured():
            self._runs.setdefault((self._key(partition), o.config), o.measurement)

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        key = (self._key(partition), config)
        if key not in self._runs:
            self._runs[key] = self.inner.measure(partition, config)
        return self._runs[key]

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        key = (work, int(freq_mhz), int(group_size), comm_sms)
        if key not in self._outside:
            self._outside[key] = self.inner.measure_outside(work, freq_mhz,
                                                            group_size=group_size,
                                                            comm_sms=comm_sms)
        return self._outside[key]


def baseline_priors(profiler: Profiler, workload: Workload, types: Mapping[str, Partition], *,
                    systems: Sequence[str], freqs_mhz: Sequence[int] | None = None,
                    partitions: PartitionSet | PartitionBuilder | None = None,
                    log_dir: Path | None = None) -> dict[str, list[Observation]]:
    """The baselines' measurements of kareus's partition types, made before kareus's search
    so that it starts from them (``MultiPassSearch``'s ``prior``).

    Each baseline measures its restricted space of a partition type exhaustively
    ([`baseline_space`][kareus.compose.baseline_space]: Perseus and nanobatching + Perseus
    sweep every clock of the default schedule), and those types are kareus's too (the
    unsplit set is the sequential systems', the workload's own set the nanobatching
    systems'). The comparison needs those measurements anyway; made first, they teach
    kareus's search how each type's time and energy move with the clock before it spends
    its budget, and [`measure_systems`][kareus.workflow.measure_systems] then reuses them
    (kareus's frontiers hold them) instead of measuring again.

    Args:
        profiler: Measures.
        workload: The workload optimised.
        types: kareus's partition types by key
            ([`kareus_types`][kareus.compose.kareus_types]).
        systems: The systems compared (only the baselines among them measure).
        freqs_mhz: The frequency-planning baselines' clocks; ``None`` = the GPU's grid.
        partitions: How workloads are cut ([`partition_builder`][kareus.workflow.partition_builder]).
        log_dir: The run's search logs: a type whose log already holds records takes its
            priors from there on resume, so it is not measured again here.

    Returns:
        Key -> the observations (empty lists left out).
    """
    build = partition_builder(partitions, workload)
    grid = None if freqs_mhz is None else list(freqs_mhz)
    shared = _SharedMeasurements(profiler)
    out: dict[str, list[Observation]] = {}
    for name in system_names(systems):
        if name == "kareus":
            continue
        wl = system_workload(name, workload)
        for tname in build(wl).types:
            key = kareus_type_key(tname, wl.nanobatches, workload)
            if key not in types:
                continue
            if log_dir is not None:
                log = search_log_path(log_dir, key)
                if log.exists() and log.stat().st_size > 0:
                    continue
            space = baseline_space(name, types[key], profiler.gpu, grid)
            seen = {o.config for o in out.get(key, [])}
            obs = [Observation(config=c, measurement=shared.measure(types[key], c))
                   for c in space.configs if c not in seen]
            out.setdefault(key, []).extend(obs)
    return {k: v for k, v in out.items() if v}


def search_types(profiler: Profiler, types: Mapping[str, Partition], search: SearchSpec, *,
                 log_dir: Path | None = None, progress: bool | None = False,
                 pool: Executor | None = None, pset: PartitionSet | None = None,
                 priors: Mapping[str, Sequence[Observation]] | None = None,
                 prior_model: Profiler | None = None
                 ) -> dict[str, PartitionFrontier]:
    """kareus's search of every partition type, by key, as ``search`` says.

    Args:
        profiler: Measures.
        types: The partition types by key (the key names the search log,
            ``search-<key>.jsonl``).
        search: How each type is searched.
        log_dir: Where the search logs go (an existing log is resumed); ``None`` = none.
        progress: Each search's progress bar (``None``: on a terminal).
        pool: Run each search as a task of this ``concurrent.futures.Executor``
            ([`kareus.workflow.pools`][kareus.workflow.pools]); ``None`` = one after another here.
        pset: The workload's partition set, with ``pool``: each task reads the GPUs it needs
            from its workload.
        priors: Observations each type's search starts from, by key, outside its budget
            ([`baseline_priors`][kareus.workflow.baseline_priors]).
        prior_model: A noise-free model of the GPU whose prediction of every configuration
            is each search's prior mean ([`SearchSpec.run`][kareus.search.SearchSpec.run]);
            ``None`` = none.

    Returns:
        Key -> the type's frontier.
    """
    priors = {} if priors is None else priors
    if pool is not None:
        from kareus.workflow.pools import run_searches

        if pset is None:
            raise ArgumentError("search_types(pool=...) needs pset= (the GPUs of each task)")
        frontiers, _ = run_searches(pool, profiler, pset, search=search, log_dir=log_dir,
                                    types=types, priors=priors, prior_model=prior_model)
        return frontiers
    return {key: search.run(profiler, part,
                            log=None if log_dir is None else search_log_path(log_dir, key),
                            progress=progress, prior=tuple(priors.get(key, ())),
                            prior_model=prior_model)
            for key, part in types.items()}


def _anchors(profiler: Profiler, pset: PartitionSet, frontiers: Mapping[str, PartitionFrontier]
             ) -> dict[str, PartitionFrontier] | None:
    """kareus's frontiers of one partition set restricted to the systems' own configurations
    ([`system_configs`][kareus.compose.system_configs]: Megatron-LM's sequential and
    nanobatching's first-slot launch, at the maximum clock with NCCL's SM count), which its
    searches measure first; ``None`` when a type lacks them (a search of its own that skips
    them). Filters what was measured; measures nothing."""
    restricted: dict[str, PartitionFrontier] = {}
    for tname, pf in frontiers.items():
        anchors = set(system_configs(profiler.space(pset.types[tname])))
        obs = [o for o in pf.measured() if o.config in anchors]
        if not obs:
            return None
        restricted[tname] = PartitionFrontier.from_observations(pf.partition, pf.gpu, obs)
    return restricted


def measure_systems(workload: Workload, profiler: Profiler, *,
                    search: SearchSpec | SearchFn | None = None,
                    systems: Sequence[str] | None = None,
                    freqs_mhz: Sequence[int] | None = None,
                    kareus_frontiers: Mapping[str, PartitionFrontier] | None = None,
                    partitions: PartitionSet | PartitionBuilder | None = None
                    ) -> SystemsMeasurements:
    """Measure what the systems' composition needs; compose nothing.

    kareus first, so that its searches' measurements serve the restricted spaces too; per
    system and partition set: the partition frontiers (kareus's given or searched, the
    baselines' spaces exhaustively), then the outside work at the clocks they use; then the
    system's per-iteration tail at the default clock. One measurement per (partition,
    configuration) and per (outside work, clock) serves every system.

    Args:
        workload: The training workload (needs TP >= 2 or CP >= 2).
        profiler: Measures partitions and the work outside them.
        search: How kareus's full space is searched per partition type: a
            [`SearchSpec`][kareus.search.SearchSpec] or any ``search(profiler, partition) ->
            PartitionFrontier``; ``None`` = ``SearchSpec()``.
        systems: Which of ``SYSTEMS`` to measure; ``None`` = all five.
        freqs_mhz: Frequencies of the frequency-planning systems; ``None`` = the GPU's
            search grid.
        kareus_frontiers: Partition frontiers already searched for kareus, by
            [`kareus_type_key`][kareus.compose.kareus_type_key] (skips their search).
        partitions: How the workload is cut into partitions
            ([`partition_builder`][kareus.workflow.partition_builder]); ``None`` = the
            default.

    Returns:
        What every system measured, for [`compose_measured`][kareus.compose.compose_measured].

    Raises:
        ArgumentTypeError: a profiler that is not a Profiler or cannot measure outside work,
            a search that is not callable or returns something else than a PartitionFrontier.
        ArgumentError: an unknown system name.
    """
    if not isinstance(workload, Workload):
        raise ArgumentTypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if not isinstance(profiler, Profiler):
        raise ArgumentTypeError(f"profiler must be a kareus Profiler, got "
                                f"{type(profiler).__name__}")
    names = system_names(systems)
    search_fn: SearchFn = SearchSpec() if search is None else search
    if not callable(search_fn):
        raise ArgumentTypeError("search must be a SearchSpec or callable as "
                                "search(profiler, partition)")
    require_outside_work(profiler)
    build = partition_builder(partitions, workload)
    gpu = profiler.gpu
    p = workload.parallelism
    static_w = profiler.static_power_w(p.world_size)
    grid = list(gpu.search_clocks_mhz if freqs_mhz is None else freqs_mhz)
    cache: dict[Workload, PartitionSet] = {}
    shared = _SharedMeasurements(profiler)
    measured: dict[str, MeasuredSystem] = {}
    for name in sorted(names, key=lambda n: n != "kareus"):
        wl = system_workload(name, workload)
        if name == "kareus":
            psets = tuple(cache.setdefault(ps.workload, ps)
                          for ps in kareus_partition_sets(workload, build))
        else:
            if wl not in cache:
                cache[wl] = build(wl)
            psets = (cache[wl],)
        keyed: dict[str, PartitionFrontier] = {}
        sets: list[MeasuredSet] = []
        for pset in psets:
            n = pset.workload.nanobatches
            set_pfs: dict[str, PartitionFrontier] = {}
            for tname, part in pset.types.items():
                if name == "kareus":
                    key = kareus_type_key(tname, n, workload)
                    set_pfs[tname] = keyed[key] = _kareus_frontier(
                        key, part, shared, search_fn, kareus_frontiers)
                else:
                    set_pfs[tname] = keyed[tname] = exhaustive_search(
                        shared, baseline_space(name, part, gpu, grid))
            used = sorted({o.config.freq_mhz for pf in set_pfs.values()
                           for o in pf.observations}, reverse=True)
            outside: OutsideTable = measure_outside_work(shared, pset, used)
            sets.append(MeasuredSet(
                partitions=pset, frontiers=set_pfs, outside=outside,
                anchors=_anchors(shared, pset, set_pfs) if name == "kareus" else None))
        iteration = psets[0].iteration
        # Optimizer step and DP gradient reduction, at the default (maximum) clock, over
        # every GPU of the job; the same for every system.
        tail = None if iteration.empty else shared.measure_outside(
            iteration, gpu.max_clock_mhz, group_size=p.world_size)
        measured[name] = MeasuredSystem(name=name, workload=wl, sets=tuple(sets),
                                        frontiers=keyed, tail=tail)
    if "kareus" in measured and len(measured) > 1:
        measured["kareus"] = _with_every_measured_configuration(shared, measured)
    return SystemsMeasurements(workload=workload, gpu=gpu.name, static_power_w=static_w,
                               systems={n: measured[n] for n in names})


def _with_every_measured_configuration(shared: _SharedMeasurements,
                                       measured: Mapping[str, MeasuredSystem]) -> MeasuredSystem:
    """kareus's measurements with every configuration the baselines measured of the same
    partition types added: kareus's space holds the baselines' configurations (each
    baseline's space is a restriction of it), and they are measured already, so they enter
    kareus's partition frontiers and its composition at no cost.

    Each of kareus's partition sets then also carries, as its ``anchors``, the baselines'
    own measurements of it alone (Perseus's clocks x Megatron-LM's schedule for the unsplit
    set, nanobatching + Perseus's for the split one): composed on their own, they give the
    baselines' own microbatch and iteration frontiers, so kareus's frontier, the Pareto union
    of its candidates, holds every baseline's points at any search budget. A set no baseline
    measured keeps the anchors its searches measured (the systems' own configurations at the
    maximum clock)."""
    kareus = measured["kareus"]
    keyed = dict(kareus.frontiers)
    sets = []
    for mset in kareus.sets:
        pset = mset.partitions
        others: dict[str, list[Observation]] = {t: [] for t in pset.types}
        for name, system in measured.items():
            if name == "kareus":
                continue
            for bset in system.sets:
                if bset.partitions is pset:
                    for tname in pset.types:
                        others[tname] += bset.frontiers[tname].measured()
        if not all(others.values()):
            sets.append(mset)
            continue
        frontiers: dict[str, PartitionFrontier] = {}
        anchors: dict[str, PartitionFrontier] = {}
        for tname, pf in mset.frontiers.items():
            seen = {o.config for o in pf.measured()}
            extra: list[Observation] = []
            for o in others[tname]:
                if o.config not in seen:
                    seen.add(o.config)
                    extra.append(o)
            frontiers[tname] = PartitionFrontier.from_observations(
                pf.partition, pf.gpu, [*pf.observations, *extra])
            own = {o.config: o for o in others[tname]}
            anchors[tname] = PartitionFrontier.from_observations(pf.partition, pf.gpu,
                                                                 list(own.values()))
            for key, kf in kareus.frontiers.items():
                if kf is pf:
                    keyed[key] = frontiers[tname]
        used = sorted({o.config.freq_mhz for pf in frontiers.values()
                       for o in pf.observations}, reverse=True)
        sets.append(MeasuredSet(partitions=pset, frontiers=frontiers,
                                outside=measure_outside_work(shared, pset, used),
                                anchors=anchors))
    return MeasuredSystem(name="kareus", workload=kareus.workload, sets=tuple(sets),
                          frontiers=keyed, tail=kareus.tail)


def _kareus_frontier(key: str, part: Partition, shared: _SharedMeasurements,
                     search_fn: SearchFn,
                     given: Mapping[str, PartitionFrontier] | None) -> PartitionFrontier:
    """Kareus's frontier of one partition type: the one given under ``key`` (its
    measurements then serve the baselines too), else a search."""
    if given is not None and key in given:
        shared.remember(part, given[key])
        return given[key]
    pf = search_fn(shared, part)
    if not isinstance(pf, PartitionFrontier):
        raise ArgumentTypeError(f"search returned {type(pf).__name__}, expected a "
                                f"PartitionFrontier")
    return pf
