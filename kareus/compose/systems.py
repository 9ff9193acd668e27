"""The five systems compared, as restricted configuration spaces run through one machinery.

Every system below is a restriction of kareus's configuration space, measured with the
same profiler and composed with the same [`MicrobatchComposer`][kareus.compose.MicrobatchComposer]
and [`IterationComposer`][kareus.compose.IterationComposer], so differences come only from what each
may choose:

========================  ===========  ==================  ====================  ===============
system                    nanobatches  launch              communication SMs     frequency
========================  ===========  ==================  ====================  ===============
``megatron``              1            sequential          ``default_comm_sms``  maximum clock
``nanobatching``          n            first slot          ``default_comm_sms``  maximum clock
``perseus``               1            sequential          ``default_comm_sms``  per computation
``nanobatching+perseus``  n            first slot          ``default_comm_sms``  per computation
``kareus``                n or 1, per  searched (n),       searched              jointly
                          computation  sequential (1)                            searched
========================  ===========  ==================  ====================  ===============

The sequential systems run the workload without nanobatching (``nanobatches=1``): each
microbatch's collectives follow the computation that produces their input, as in
Megatron-LM. The nanobatching systems split each microbatch in the workload's number of
nanobatches n (2 if the workload has 1) and launch every collective with the first
computation op it may overlap. The restricted spaces are small, so they are measured
exhaustively; kareus's full space is searched by an injectable search function (by
default [`kareus.search.MultiPassSearch`][kareus.search.MultiPassSearch]).

Kareus's space holds unsplit execution too, so that where nanobatching does not pay
(small partitions whose split costs more than the overlap hides) kareus is never worse
than Megatron-LM: with a workload of n >= 2 nanobatches it searches two partition sets
([`kareus_partition_sets`][kareus.compose.kareus_partition_sets]), the workload's nanobatched types
(frequency x communication SMs x launch slot, plus sequential) and the unsplit types of
``workload.with_(nanobatches=1)`` (frequency x communication SMs, sequential: Megatron-LM's
and Perseus's space with the SM count searched too). Both sets are composed with the same
microbatch composer, each on its own, and each computation's microbatch frontier is the
Pareto union of the two ([`MicrobatchFrontier.union`][kareus.compose.MicrobatchFrontier.union]);
every point's choice records its nanobatch count, so a plan may run some computations split and
others unsplit. The union is taken here rather than inside the composer because a computation runs
one split throughout (its partition types are those of the split), so the space is exactly the union
of two single-split compositions, and any [`FrontierComposer`][kareus.compose.FrontierComposer] of
one partition set keeps working unchanged. The unsplit types share their names with Megatron-LM's
(and some with the nanobatched types: ``fwd_mlp``), so kareus keys them ``<type>@n1``
([`kareus_type_key`][kareus.compose.kareus_type_key]) in its partition frontiers, its search logs
(``search-<type>@n1.jsonl``) and results; the partitions themselves keep their names, so
profilers and recordings see the same partitions Megatron-LM's baseline measures, and one
measurement serves both. A workload of one nanobatch has one set, as before. Kareus's
iteration frontier is the Pareto union of the iteration compositions of the union, of each
set alone and of the systems' own configurations alone (``_compose_iteration`` says why):
the iteration composer is a heuristic, and this keeps kareus's frontier never worse than
either set alone, nor than Megatron-LM's and nanobatching's plans.

Energy scope: iteration energies cover every GPU of the job (see
[`kareus.compose`][kareus.compose]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kareus.compose.composer import FrontierComposer
from kareus.compose.iteration import IterationComposer
from kareus.compose.iteration_frontier import IterationFrontier
from kareus.compose.microbatch import MicrobatchComposer, measure_outside_work
from kareus.compose.microbatch_frontier import MicrobatchFrontier
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.gpu import GPUSpec
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition, PartitionSet, build_partitions
from kareus.model.pipeline import PipelineSchedule, one_f_one_b
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search import MultiPassSearch, Observation, PartitionFrontier, system_config_indices

__all__ = ["SYSTEMS", "AnyIterationComposer", "AnyMicrobatchComposer", "SearchFn",
           "SystemsResult", "baseline_space", "compose_systems", "default_search",
           "exhaustive_search", "kareus_partition_sets", "kareus_type_key", "kareus_types",
           "system_configs"]

#: Names of the five systems, in the order they are reported (the four baselines, then kareus).
SYSTEMS = ("megatron", "nanobatching", "perseus", "nanobatching+perseus", "kareus")

#: Any composer of partition frontiers into the microbatch frontiers of every
#: ``(stage, phase)``; called as ``compose(frontiers, partitions=..., outside=...)``.
AnyMicrobatchComposer = FrontierComposer[Mapping[str, PartitionFrontier],
                                         dict[tuple[int, str], MicrobatchFrontier]]

#: Any composer of microbatch frontiers into an iteration frontier; called as
#: ``compose(frontiers, static_power_w=..., gpu=..., schedule=..., label=..., workload=...)``
#: and, when its ``compose`` takes it, ``tail=`` (the per-iteration work after the flush).
AnyIterationComposer = FrontierComposer[Mapping[tuple[int, str], MicrobatchFrontier],
                                        IterationFrontier]

#: ``search(profiler, partition) -> PartitionFrontier``: how kareus's full space is searched.
SearchFn = Callable[[Profiler, Partition], PartitionFrontier]

def _takes_tail(composer: object) -> bool:
    """Whether an iteration composer's ``compose`` takes ``tail=``."""
    import inspect

    try:
        return "tail" in inspect.signature(composer.compose).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return False


_SEQUENTIAL = ("megatron", "perseus")
_FIXED_CLOCK = ("megatron", "nanobatching")


def system_configs(space: ConfigSpace) -> list[ScheduleConfig]:
    """The baselines' own configurations at the maximum clock that lie in ``space``.

    Sequential and launched with the first slot, both with NCCL's default SM count.
    [`MultiPassSearch`][kareus.search.MultiPassSearch] starts its initial design with them
    ([`system_config_indices`][kareus.search.system_config_indices]), so kareus's front starts from
    what Megatron-LM and nanobatching run and can only improve on it (its space holds theirs).

    Args:
        space: A partition type's configuration space.

    Returns:
        Those configurations of ``space``, in the order the search tries them.
    """
    return [space.configs[i] for i in system_config_indices(space)]


def default_search(profiler: Profiler, partition: Partition) -> PartitionFrontier:
    """Kareus's search of one partition type's full space.

    [`MultiPassSearch`][kareus.search.MultiPassSearch], whose initial design starts with the
    baselines' configurations ([`system_configs`][kareus.compose.system_configs]).

    Args:
        profiler: Measures the partition.
        partition: The partition type.

    Returns:
        The partition type's frontier.
    """
    return MultiPassSearch(profiler.space(partition)).run(profiler, partition, progress=False)


class _SharedMeasurements(Profiler):
    """One measurement per (partition, configuration) for all the systems compared.

    The systems' spaces overlap (Megatron-LM's configuration is Perseus's at the maximum
    clock, and kareus's space holds them all). Measuring the same run twice would let
    measurement noise, not the system, decide which one wins, and would waste profiles on
    real GPUs; so the first measurement of a configuration serves every system.
    """

    def __init__(self, inner: Profiler) -> None:
        self.inner = inner
        self.gpu = inner.gpu
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

    def static_power_w(self, group_size: int) -> float:
        return self.inner.static_power_w(group_size)

    def space(self, partition: Partition) -> ConfigSpace:
        return self.inner.space(partition)


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


def baseline_space(name: str, partition: Partition, gpu: str | GPUSpec,
                   freqs_mhz: Sequence[int] | None = None) -> ConfigSpace:
    """The restricted configuration space of a baseline (not ``kareus``) for one type.

    Args:
        name: One of the four baselines of ``SYSTEMS``.
        partition: The partition type.
        gpu: GPU preset name or spec.
        freqs_mhz: Frequencies of the frequency-planning baselines; ``None`` = the GPU's
            search grid.

    Returns:
        The space the baseline may choose from (see the table in the module docstring).

    Raises:
        ValueError: ``name`` is ``"kareus"`` or not a system.
    """
    if name not in SYSTEMS or name == "kareus":
        raise ValueError(f"no restricted space for {name!r}; baselines: {SYSTEMS[:-1]}")
    space = ConfigSpace(partition, gpu, freqs_mhz=freqs_mhz)
    g = space.gpu
    freqs = [g.max_clock_mhz] if name in _FIXED_CLOCK else list(space.freqs_mhz)
    if name in _SEQUENTIAL or not partition.slots:
        slots: list[str | None] = [None]
    else:
        slots = [partition.slots[0].name]
    return ConfigSpace(partition, g, freqs_mhz=freqs, comm_sms=[g.default_comm_sms],
                       slots=[s for s in slots if s is not None],
                       include_sequential=None in slots)


def kareus_partition_sets(workload: Workload) -> tuple[PartitionSet, ...]:
    """The partition sets kareus searches and composes for a workload.

    Args:
        workload: The training workload.

    Returns:
        The workload's own set and, when it splits microbatches (``nanobatches >= 2``), the
        unsplit set of ``workload.with_(nanobatches=1)`` after it.

    Raises:
        WorkloadError: the workload has no collective to schedule (TP = CP = 1).
    """
    sets = [build_partitions(workload)]
    if workload.nanobatches > 1:
        sets.append(build_partitions(workload.with_(nanobatches=1)))
    return tuple(sets)


def kareus_type_key(partition_type: str, nanobatches: int, workload: Workload) -> str:
    """The key of a partition type among kareus's partition frontiers and search logs.

    The workload's own (nanobatched) types keep their names, so logs of earlier runs
    resume as they are; a type of another split is ``<type>@n<nanobatches>`` (the unsplit
    ``fwd_mlp`` is ``fwd_mlp@n1``), as the same name may mean another partition there.

    Args:
        partition_type: The type's name in its partition set.
        nanobatches: The nanobatch count of its set.
        workload: The workload optimised.

    Returns:
        The key.
    """
    if nanobatches == workload.nanobatches:
        return partition_type
    return f"{partition_type}@n{nanobatches}"


def kareus_types(workload: Workload) -> dict[str, Partition]:
    """Every partition type kareus searches, by its key ([`kareus_type_key`][kareus.compose.kareus_type_key]): the
    workload's own types first, then the unsplit ones.

    Args:
        workload: The training workload.

    Returns:
        Key -> partition.
    """
    return {kareus_type_key(name, pset.workload.nanobatches, workload): part
            for pset in kareus_partition_sets(workload) for name, part in pset.types.items()}


def _with_nanobatches(frontiers: Mapping[tuple[int, str], MicrobatchFrontier], n: int
                      ) -> dict[tuple[int, str], MicrobatchFrontier]:
    """``frontiers`` with every choice recording ``n`` nanobatches (a composer of one
    partition set may leave it out: it is then the set's count).

    Raises:
        ValueError: a choice records another count than its set's.
    """
    out: dict[tuple[int, str], MicrobatchFrontier] = {}
    for key, fr in frontiers.items():
        counts = {p.choice.nanobatches for ps in fr.by_freq.values() for p in ps}
        if counts - {None, n}:
            raise ValueError(f"the microbatch composer gave stage {key[0]} {key[1]} choices "
                             f"of {sorted(c for c in counts if c is not None)} nanobatches "
                             f"from the partition set of {n}")
        if counts <= {n}:
            out[key] = fr
            continue
        by_freq = {f: [p if p.choice.nanobatches == n else
                       attrs.evolve(p, choice=attrs.evolve(p.choice, nanobatches=n))
                       for p in ps] for f, ps in fr.by_freq.items()}
        out[key] = MicrobatchFrontier.from_fronts(fr.stage, fr.phase, by_freq)
    return out


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
        raise TypeError(f"search returned {type(pf).__name__}, expected a PartitionFrontier")
    return pf


def _union(frontiers: Sequence[Mapping[tuple[int, str], MicrobatchFrontier]]
           ) -> dict[tuple[int, str], MicrobatchFrontier]:
    """Per computation, the Pareto union of several sets' microbatch frontiers."""
    if len(frontiers) == 1:
        return dict(frontiers[0])
    return {key: MicrobatchFrontier.union([f[key] for f in frontiers if key in f])
            for key in frontiers[0]}


def _anchored(mbc: AnyMicrobatchComposer, profiler: Profiler, pset: PartitionSet,
              frontiers: Mapping[str, PartitionFrontier],
              outside: Mapping[tuple[int, str], Mapping[int, Measurement]]
              ) -> list[dict[tuple[int, str], MicrobatchFrontier]]:
    """The microbatch frontiers of one partition set composed from kareus's own
    measurements of the systems' configurations alone
    ([`system_configs`][kareus.compose.system_configs]: Megatron-LM's sequential and nanobatching's
    first-slot launch, at the maximum clock with NCCL's SM count), which its searches measure first;
    ``[]`` when a type lacks them (a search of its own that skips them)."""
    restricted: dict[str, PartitionFrontier] = {}
    for tname, pf in frontiers.items():
        anchors = set(system_configs(profiler.space(pset.types[tname])))
        obs = [o for o in pf.measured() if o.config in anchors]
        if not obs:
            return []
        restricted[tname] = PartitionFrontier.from_observations(pf.partition, pf.gpu, obs)
    made = mbc.compose(restricted, partitions=pset, outside=outside)
    return [_with_nanobatches(made, pset.workload.nanobatches)]


def _compose_iteration(itc: AnyIterationComposer,
                       candidates: Sequence[Mapping[tuple[int, str], MicrobatchFrontier]],
                       **kwargs: Any) -> IterationFrontier:
    """The iteration frontier of a system: of its microbatch frontiers, or, for kareus, the
    Pareto union of the iteration frontiers composed from several candidates.

    Kareus's candidates: the union of its partition sets' microbatch frontiers (each
    computation split or unsplit), each set's alone, and the systems' own configurations
    alone (``_anchored``). The union's microbatch frontiers hold every other
    candidate's points, but the iteration composer is a heuristic on a time grid
    ([`IterationComposer`][kareus.compose.IterationComposer]): composing a superset may find a plan
    a little worse at some iteration times than composing a subset (0.05% of the energy at a few
    times of the README's job), and a plan whose computations differ from the fastest by less than
    one time unit may be missed (Megatron-LM's own plan, 0.5% below kareus's energy at its time
    on an eager emulated H200 at qwen3-1.7b TP=4). With every candidate composed, kareus's
    frontier is never worse than with either set alone, nor than Megatron-LM's and
    nanobatching's own plans, which its space holds and its searches measure. The union is
    composed first, so it wins exact ties; ``stats`` are its composition's, with the number
    of compositions and their total wall time.
    """
    frs = [itc.compose(c, **kwargs) for c in candidates]
    if len(frs) == 1:
        return frs[0]
    stats = {**frs[0].stats, "compositions": len(frs)}
    if all(isinstance(f.stats.get("wall_s"), float) for f in frs):
        stats["wall_s"] = sum(f.stats["wall_s"] for f in frs)
    return IterationFrontier.from_points([pt for f in frs for pt in f.points],
                                         label=frs[0].label, stats=stats)


def _system_partition_sets(name: str, workload: Workload,
                           cache: dict[Workload, PartitionSet]) -> tuple[PartitionSet, ...]:
    """The partition sets a system composes (kareus: [`kareus_partition_sets`][kareus.compose.kareus_partition_sets]), built
    once per workload variant so that the systems share them."""
    if name == "kareus":
        sets = kareus_partition_sets(workload)
        return tuple(cache.setdefault(ps.workload, ps) for ps in sets)
    wl = _system_workload(name, workload)
    if wl not in cache:
        cache[wl] = build_partitions(wl)
    return (cache[wl],)


def _system_workload(name: str, workload: Workload) -> Workload:
    if name in _SEQUENTIAL:
        return workload.with_(nanobatches=1)
    if name == "kareus" or workload.nanobatches >= 2:
        return workload
    return workload.with_(nanobatches=2)


@attrs.frozen(kw_only=True)
class SystemsResult:
    """The iteration frontiers of the systems compared, and what they were built from.

    Attributes:
        workload: The workload.
        gpu: GPU preset name.
        frontiers: System name -> its iteration frontier.
        microbatch: System name -> its microbatch frontiers per ``(stage, phase)`` (for
            kareus, the Pareto union over its partition sets).
        partitions: System name -> its partition frontiers per type (for kareus, keyed by
            [`kareus_type_key`][kareus.compose.kareus_type_key]: the unsplit types as
            ``<type>@n1``).
    """

    workload: Workload
    gpu: str
    frontiers: dict[str, IterationFrontier]
    microbatch: dict[str, dict[tuple[int, str], MicrobatchFrontier]]
    partitions: dict[str, dict[str, PartitionFrontier]]

    def __getitem__(self, name: str) -> IterationFrontier:
        return self.frontiers[name]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.frontiers)

    def summary(self) -> str:
        """A table: each system's fastest and lowest-energy plans, and its energy at the
        fastest Megatron-LM iteration time (iso-time), where it can meet it."""
        ref = self.frontiers.get("megatron")
        t_ref = ref.points[0].time_s if ref is not None and len(ref) else None
        lines = [f"{self.workload.describe()} on {self.gpu} (iteration energy: all GPUs)",
                 f"  {'system':<22} {'plans':>5} {'fastest s':>10} {'J':>11} "
                 f"{'min-energy s':>12} {'J':>11} {'J @ megatron time':>18}"]
        for name, fr in self.frontiers.items():
            if not len(fr):
                lines.append(f"  {name:<22} {'-':>5}")
                continue
            f, e = fr.points[0], fr.points[-1]
            iso = "-"
            if t_ref is not None:
                ok = [p.energy_j for p in fr.points if p.time_s <= t_ref * (1 + 1e-9)]
                iso = f"{min(ok):.1f}" if ok else "-"
            lines.append(f"  {name:<22} {len(fr):>5} {f.time_s:>10.4f} {f.energy_j:>11.1f} "
                         f"{e.time_s:>12.4f} {e.energy_j:>11.1f} {iso:>18}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"SystemsResult({self.workload.describe()} on {self.gpu}: "
                f"{', '.join(self.frontiers)})")


def compose_systems(workload: Workload, profiler: Profiler, *,
                    search: SearchFn | None = None,
                    systems: Sequence[str] | None = None,
                    freqs_mhz: Sequence[int] | None = None,
                    schedule: Callable[[int, int], PipelineSchedule] | None = None,
                    microbatch_composer: AnyMicrobatchComposer | None = None,
                    iteration_composer: AnyIterationComposer | None = None,
                    kareus_frontiers: Mapping[str, PartitionFrontier] | None = None,
                    ) -> SystemsResult:
    """Iteration frontiers of the five systems for one workload and one profiler.

    Args:
        workload: The training workload (needs TP >= 2 or CP >= 2).
        profiler: Measures partitions and the work outside them.
        search: How kareus's full space is searched per partition type; ``None`` =
            [`default_search`][kareus.compose.default_search] (MultiPassSearch).
        systems: Which of ``SYSTEMS`` to compose; ``None`` = all five.
        freqs_mhz: Frequencies of the frequency-planning systems; ``None`` = the GPU's
            search grid.
        schedule: ``(stages, microbatches) -> PipelineSchedule``; ``None`` = 1F1B.
        microbatch_composer: Any [`FrontierComposer`][kareus.compose.FrontierComposer] of partition
            frontiers into microbatch frontiers, called as ``compose(frontiers, partitions=...,
            outside=...)``; ``None`` = [`MicrobatchComposer`][kareus.compose.MicrobatchComposer].
        iteration_composer: Any [`FrontierComposer`][kareus.compose.FrontierComposer] of microbatch
            frontiers into an iteration frontier, called as ``compose(frontiers, static_power_w=...,
            gpu=..., schedule=..., label=..., workload=...)``; ``None`` =
            [`IterationComposer`][kareus.compose.IterationComposer].
        kareus_frontiers: Partition frontiers already searched for kareus, by
            [`kareus_type_key`][kareus.compose.kareus_type_key] (skips their search).

    Writes nothing: [kareus.optimize][] wraps it with search logs, and its result's
    ``save(out)`` writes ``results.json`` and ``plan.json``.

    Returns:
        Every system's iteration frontier, microbatch frontiers and partition frontiers.

    Raises:
        TypeError: an argument of the wrong type (a profiler that is not a Profiler, a
            composer that is not a FrontierComposer, a search that returns something else
            than a PartitionFrontier).
        ValueError: an unknown system name.

    Examples:
        Megatron-LM and Perseus on the emulator (neither searches kareus's space):

        >>> import kareus
        >>> workload = kareus.Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2,
        ...                                   seq_len=1024, num_microbatches=4)
        >>> result = kareus.compose_systems(workload, kareus.EmulatedProfiler("h200-sxm"),
        ...                                 systems=["megatron", "perseus"])
        >>> sorted(result.frontiers)
        ['megatron', 'perseus']
        >>> megatron, perseus = result.frontiers["megatron"], result.frontiers["perseus"]
        >>> perseus.points[-1].energy_j < megatron.points[0].energy_j
        True
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if not isinstance(profiler, Profiler):
        raise TypeError(f"profiler must be a kareus Profiler, got {type(profiler).__name__}")
    names = list(SYSTEMS if systems is None else systems)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    search_fn = default_search if search is None else search
    if not callable(search_fn):
        raise TypeError("search must be callable as search(profiler, partition)")
    mbc: AnyMicrobatchComposer = (MicrobatchComposer() if microbatch_composer is None
                                  else microbatch_composer)
    itc: AnyIterationComposer = (IterationComposer() if iteration_composer is None
                                 else iteration_composer)
    for what, comp in (("microbatch_composer", mbc), ("iteration_composer", itc)):
        if not isinstance(comp, FrontierComposer):
            raise TypeError(f"{what} must be a kareus FrontierComposer, "
                            f"got {type(comp).__name__}")
    make_schedule = one_f_one_b if schedule is None else schedule
    gpu = profiler.gpu
    p = workload.parallelism
    static_w = profiler.static_power_w(p.world_size)
    sched = make_schedule(p.pp, workload.num_microbatches)
    grid = list(gpu.search_clocks_mhz if freqs_mhz is None else freqs_mhz)

    frontiers: dict[str, IterationFrontier] = {}
    micro: dict[str, dict[tuple[int, str], MicrobatchFrontier]] = {}
    parts_out: dict[str, dict[str, PartitionFrontier]] = {}
    pset_cache: dict[Workload, PartitionSet] = {}
    shared = _SharedMeasurements(profiler)
    profiler = shared
    # kareus first, so its search's measurements serve the restricted spaces too.
    for name in sorted(names, key=lambda n: n != "kareus"):
        wl = _system_workload(name, workload)
        psets = _system_partition_sets(name, workload, pset_cache)
        pfs: dict[str, PartitionFrontier] = {}
        composed: list[dict[tuple[int, str], MicrobatchFrontier]] = []
        anchored: list[dict[tuple[int, str], MicrobatchFrontier]] = []
        for pset in psets:
            n = pset.workload.nanobatches
            set_pfs: dict[str, PartitionFrontier] = {}
            for tname, part in pset.types.items():
                if name == "kareus":
                    key = kareus_type_key(tname, n, workload)
                    set_pfs[tname] = pfs[key] = _kareus_frontier(
                        key, part, shared, search_fn, kareus_frontiers)
                else:
                    set_pfs[tname] = pfs[tname] = exhaustive_search(
                        profiler, baseline_space(name, part, gpu, grid))
            used = sorted({o.config.freq_mhz for pf in set_pfs.values()
                           for o in pf.observations}, reverse=True)
            outside = measure_outside_work(profiler, pset, used)
            made = mbc.compose(set_pfs, partitions=pset, outside=outside)
            composed.append(_with_nanobatches(made, n) if name == "kareus" else made)
            if name == "kareus":
                anchored += _anchored(mbc, shared, pset, set_pfs, outside)
        # kareus: each computation split or unsplit, whichever is on the front
        mf = _union(composed)
        pset = psets[0]
        extra: dict[str, Any] = {}
        if not pset.iteration.empty and _takes_tail(itc):
            # Optimizer step and DP gradient reduction, at the default (maximum) clock,
            # over every GPU of the job; the same for every system.
            extra["tail"] = profiler.measure_outside(pset.iteration, gpu.max_clock_mhz,
                                                     group_size=p.world_size)
        candidates = [mf, *composed] if len(composed) > 1 else [mf]
        if anchored:
            candidates.append(_union(anchored))
        frontiers[name] = _compose_iteration(
            itc, candidates, static_power_w=static_w, gpu=gpu.name, schedule=sched,
            label=name, workload=wl.to_dict(), **extra)
        micro[name] = mf
        parts_out[name] = pfs
    order = list(names)
    return SystemsResult(workload=workload, gpu=gpu.name,
                          frontiers={n: frontiers[n] for n in order},
                          microbatch={n: micro[n] for n in order},
                          partitions={n: parts_out[n] for n in order})
