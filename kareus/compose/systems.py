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
exhaustively; kareus's full space is searched ([`kareus.search.SearchSpec`][kareus.search.SearchSpec]).

This module only composes. The measuring (kareus's searches, the baselines' exhaustive spaces,
the outside work and the per-iteration tail) happens in one place above it,
[`kareus.workflow.measure_systems`][kareus.workflow.measure_systems], which hands over a
[`SystemsMeasurements`][kareus.compose.SystemsMeasurements];
[`compose_measured`][kareus.compose.compose_measured] composes it.
[`kareus.workflow.compose_systems`][kareus.workflow.compose_systems] does both.

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

import attrs

from kareus.compose.composer import FrontierComposer
from kareus.compose.context import IterationContext, MicrobatchContext, OutsideTable
from kareus.compose.iteration import IterationComposer
from kareus.compose.iteration_frontier import IterationFrontier
from kareus.compose.microbatch import MicrobatchComposer
from kareus.compose.microbatch_frontier import MicrobatchFrontier
from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.gpu import GPUSpec
from kareus.model.measurement import Measurement
from kareus.model.partition import Partition, PartitionSet, build_partitions
from kareus.model.pipeline import PipelineSchedule
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search import PartitionFrontier, system_config_indices

__all__ = ["SYSTEMS", "AnyIterationComposer", "AnyMicrobatchComposer", "MeasuredSet",
           "MeasuredSystem", "PartitionBuilder", "SearchFn", "SystemsMeasurements",
           "SystemsResult", "baseline_space", "compose_measured", "kareus_partition_sets",
           "kareus_type_key", "kareus_types", "system_configs", "system_workload"]

#: Names of the five systems, in the order they are reported (the four baselines, then kareus).
SYSTEMS = ("megatron", "nanobatching", "perseus", "nanobatching+perseus", "kareus")

#: Any composer of partition frontiers into the microbatch frontiers of every
#: ``(stage, phase)``; called as ``compose(frontiers, MicrobatchContext(...))``.
AnyMicrobatchComposer = FrontierComposer[Mapping[str, PartitionFrontier], MicrobatchContext,
                                         dict[tuple[int, str], MicrobatchFrontier]]

#: Any composer of microbatch frontiers into an iteration frontier; called as
#: ``compose(frontiers, IterationContext(...))``.
AnyIterationComposer = FrontierComposer[Mapping[tuple[int, str], MicrobatchFrontier],
                                        IterationContext, IterationFrontier]

#: ``search(profiler, partition) -> PartitionFrontier``: how kareus's full space is searched
#: (a [`SearchSpec`][kareus.search.SearchSpec] is one).
SearchFn = Callable[[Profiler, Partition], PartitionFrontier]

#: ``build(workload) -> PartitionSet``: how a workload is cut into partitions
#: ([`build_partitions`][kareus.model.build_partitions] by default; a builder of your own
#: gives every system your Partition types).
PartitionBuilder = Callable[[Workload], PartitionSet]

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
        raise ArgumentError(f"no restricted space for {name!r}; baselines: {SYSTEMS[:-1]}")
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


def kareus_partition_sets(workload: Workload, build: PartitionBuilder | None = None
                          ) -> tuple[PartitionSet, ...]:
    """The partition sets kareus searches and composes for a workload.

    Args:
        workload: The training workload.
        build: Cuts a workload into partitions; ``None`` =
            [`build_partitions`][kareus.model.build_partitions].

    Returns:
        The workload's own set and, when it splits microbatches (``nanobatches >= 2``), the
        unsplit set of ``workload.with_(nanobatches=1)`` after it.

    Raises:
        WorkloadError: the workload has no collective to schedule (TP = CP = 1).
    """
    build = build_partitions if build is None else build
    sets = [build(workload)]
    if workload.nanobatches > 1:
        sets.append(build(workload.with_(nanobatches=1)))
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


def kareus_types(workload: Workload, build: PartitionBuilder | None = None
                 ) -> dict[str, Partition]:
    """Every partition type kareus searches, by its key ([`kareus_type_key`][kareus.compose.kareus_type_key]): the
    workload's own types first, then the unsplit ones.

    Args:
        workload: The training workload.
        build: Cuts a workload into partitions; ``None`` =
            [`build_partitions`][kareus.model.build_partitions].

    Returns:
        Key -> partition.
    """
    return {kareus_type_key(name, pset.workload.nanobatches, workload): part
            for pset in kareus_partition_sets(workload, build)
            for name, part in pset.types.items()}


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
            raise ArgumentError(f"the microbatch composer gave stage {key[0]} {key[1]} choices "
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


def _union(frontiers: Sequence[Mapping[tuple[int, str], MicrobatchFrontier]]
           ) -> dict[tuple[int, str], MicrobatchFrontier]:
    """Per computation, the Pareto union of several sets' microbatch frontiers."""
    if len(frontiers) == 1:
        return dict(frontiers[0])
    return {key: MicrobatchFrontier.union([f[key] for f in frontiers if key in f])
            for key in frontiers[0]}


def _compose_iteration(itc: AnyIterationComposer,
                       candidates: Sequence[Mapping[tuple[int, str], MicrobatchFrontier]],
                       context: IterationContext) -> IterationFrontier:
    """The iteration frontier of a system: of its microbatch frontiers, or, for kareus, the
    Pareto union of the iteration frontiers composed from several candidates.

    Kareus's candidates: the union of its partition sets' microbatch frontiers (each
    computation split or unsplit), each set's alone, and the baselines' own measurements
    alone (``MeasuredSet.anchors``, their union and each set's: the latter compose exactly as
    the baselines do). The union's microbatch frontiers hold every other
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
    frs = [itc.compose(c, context) for c in candidates]
    if len(frs) == 1:
        return frs[0]
    stats = {**frs[0].stats, "compositions": len(frs)}
    if all(isinstance(f.stats.get("wall_s"), float) for f in frs):
        stats["wall_s"] = sum(f.stats["wall_s"] for f in frs)
    return IterationFrontier.from_points([pt for f in frs for pt in f.points],
                                         label=frs[0].label, stats=stats)


def system_workload(name: str, workload: Workload) -> Workload:
    """The workload a system runs: the sequential systems unsplit (``nanobatches=1``), the
    nanobatching systems with the workload's nanobatches (2 if it has 1), kareus as given.

    Raises:
        ValueError: ``name`` is not one of ``SYSTEMS``.
    """
    if name not in SYSTEMS:
        raise ArgumentError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    if name in _SEQUENTIAL:
        return workload.with_(nanobatches=1)
    if name == "kareus" or workload.nanobatches >= 2:
        return workload
    return workload.with_(nanobatches=2)


@attrs.frozen(kw_only=True)
class MeasuredSet:
    """One partition set of a system, measured: what its microbatch composition needs.

    Attributes:
        partitions: The partition set.
        frontiers: Partition type name (in the set) -> its frontier.
        outside: The work outside partitions measured per ``(stage, phase)`` at every
            frequency the frontiers use (over one stage's TP x CP group).
        anchors: kareus only: the baselines' own measurements of this set (every
            configuration they measured of its partition types), or, where no baseline
            measured it, kareus's own of the systems' configurations
            ([`system_configs`][kareus.compose.system_configs]), which its searches measure
            first; composed on their own as a candidate, so kareus's frontier holds the
            baselines' points; ``None`` = not composed on their own (a baseline, or a search of
            its own that skipped them).
    """

    partitions: PartitionSet
    frontiers: dict[str, PartitionFrontier]
    outside: OutsideTable
    anchors: dict[str, PartitionFrontier] | None = None


@attrs.frozen(kw_only=True)
class MeasuredSystem:
    """One system, measured: its partition sets and the per-iteration tail.

    Attributes:
        name: One of ``SYSTEMS``.
        workload: The workload the system runs ([`system_workload`][kareus.compose.system_workload]).
        sets: Its partition sets (kareus: the nanobatched set, then the unsplit one).
        frontiers: Its partition frontiers by key (for kareus,
            [`kareus_type_key`][kareus.compose.kareus_type_key]; for a baseline, the type name).
        tail: The work once per iteration after the flush (optimizer step, data-parallel
            gradient reduction) at the default clock over every GPU of the job; ``None``: none.
    """

    name: str
    workload: Workload
    sets: tuple[MeasuredSet, ...]
    frontiers: dict[str, PartitionFrontier]
    tail: Measurement | None = None


@attrs.frozen(kw_only=True)
class SystemsMeasurements:
    """Everything the five systems' composition needs, measured
    ([`kareus.workflow.measure_systems`][kareus.workflow.measure_systems] makes it).

    Attributes:
        workload: The workload.
        gpu: GPU preset name.
        static_power_w: Static power of every GPU of the job together.
        systems: System name -> what it measured, in the order the systems are reported.
    """

    workload: Workload
    gpu: str
    static_power_w: float
    systems: dict[str, MeasuredSystem]


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


def compose_measured(measured: SystemsMeasurements, *, schedule: PipelineSchedule,
                     microbatch_composer: AnyMicrobatchComposer | None = None,
                     iteration_composer: AnyIterationComposer | None = None) -> SystemsResult:
    """Compose the systems measured: each one's microbatch frontiers, then its iteration frontier.

    Measures nothing:
    [`kareus.workflow.compose_systems`][kareus.workflow.compose_systems] measures and calls it.

    Args:
        measured: What every system measured.
        schedule: The pipeline DAG of the job.
        microbatch_composer: Any [`FrontierComposer`][kareus.compose.FrontierComposer] of partition
            frontiers into microbatch frontiers, called as ``compose(frontiers,
            MicrobatchContext(...))``; ``None`` =
            [`MicrobatchComposer`][kareus.compose.MicrobatchComposer].
        iteration_composer: Any [`FrontierComposer`][kareus.compose.FrontierComposer] of microbatch
            frontiers into an iteration frontier, called as ``compose(frontiers,
            IterationContext(...))`` (the context holds the per-iteration tail); ``None`` =
            [`IterationComposer`][kareus.compose.IterationComposer].

    Returns:
        Every system's iteration frontier, microbatch frontiers and partition frontiers.

    Raises:
        TypeError: a composer that is not a FrontierComposer.
        ValueError: a microbatch composer whose choices record another nanobatch count than
            their partition set's.
    """
    mbc: AnyMicrobatchComposer = (MicrobatchComposer() if microbatch_composer is None
                                  else microbatch_composer)
    itc: AnyIterationComposer = (IterationComposer() if iteration_composer is None
                                 else iteration_composer)
    for what, comp in (("microbatch_composer", mbc), ("iteration_composer", itc)):
        if not isinstance(comp, FrontierComposer):
            raise ArgumentTypeError(f"{what} must be a kareus FrontierComposer, "
                                    f"got {type(comp).__name__}")
    frontiers: dict[str, IterationFrontier] = {}
    micro: dict[str, dict[tuple[int, str], MicrobatchFrontier]] = {}
    for name, system in measured.systems.items():
        composed: list[dict[tuple[int, str], MicrobatchFrontier]] = []
        anchored: list[dict[tuple[int, str], MicrobatchFrontier]] = []
        for mset in system.sets:
            n = mset.partitions.workload.nanobatches
            ctx = MicrobatchContext(partitions=mset.partitions, outside=mset.outside)
            made = mbc.compose(mset.frontiers, ctx)
            composed.append(_with_nanobatches(made, n) if name == "kareus" else made)
            if mset.anchors is not None:
                anchored.append(_with_nanobatches(mbc.compose(mset.anchors, ctx), n))
        # kareus: each computation split or unsplit, whichever is on the front
        mf = _union(composed)
        candidates = [mf, *composed] if len(composed) > 1 else [mf]
        if anchored:
            candidates.append(_union(anchored))
            if len(anchored) > 1:  # each set's own: a baseline's microbatch frontiers alone
                candidates += anchored
        frontiers[name] = _compose_iteration(itc, candidates, IterationContext(
            static_power_w=measured.static_power_w, gpu=measured.gpu, schedule=schedule,
            tail=system.tail, label=name, workload=system.workload.to_dict()))
        micro[name] = mf
    return SystemsResult(workload=measured.workload, gpu=measured.gpu, frontiers=frontiers,
                         microbatch=micro,
                         partitions={n: dict(s.frontiers) for n, s in measured.systems.items()})
