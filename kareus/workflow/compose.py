"""Measure and compose the five systems of one workload side by side.

[`compose_systems`][kareus.workflow.compose_systems] is [`measure_systems`][kareus.workflow.measure_systems]
(every measurement, through one cache) followed by the compose layer's
[`compose_measured`][kareus.compose.compose_measured] (microbatch and iteration frontiers of each
system through the same composers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kareus.compose.systems import (
    AnyIterationComposer,
    AnyMicrobatchComposer,
    PartitionBuilder,
    SearchFn,
    SystemsResult,
    compose_measured,
)
from kareus.errors import ArgumentTypeError
from kareus.model.partition import PartitionSet
from kareus.model.pipeline import PipelineSchedule, one_f_one_b
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search import PartitionFrontier, SearchSpec
from kareus.workflow.measure import measure_systems

__all__ = ["compose_systems"]



def compose_systems(workload: Workload, profiler: Profiler, *,
                    search: SearchSpec | SearchFn | None = None,
                    systems: Sequence[str] | None = None,
                    freqs_mhz: Sequence[int] | None = None,
                    schedule: Callable[[int, int], PipelineSchedule] | None = None,
                    microbatch_composer: AnyMicrobatchComposer | None = None,
                    iteration_composer: AnyIterationComposer | None = None,
                    kareus_frontiers: Mapping[str, PartitionFrontier] | None = None,
                    partitions: PartitionSet | PartitionBuilder | None = None,
                    ) -> SystemsResult:
    """Iteration frontiers of the five systems for one workload and one profiler.

    Measures ([`measure_systems`][kareus.workflow.measure_systems]), then composes
    ([`compose_measured`][kareus.compose.compose_measured]).

    Args:
        workload: The training workload (needs TP >= 2 or CP >= 2).
        profiler: Measures partitions and the work outside them (it must implement
            ``measure_outside``: checked before the first measurement).
        search: How kareus's full space is searched per partition type: a
            [`SearchSpec`][kareus.search.SearchSpec] or any ``search(profiler, partition) ->
            PartitionFrontier``; ``None`` = ``SearchSpec()`` (what ``kareus.optimize`` runs
            by default: 96 profiles per type).
        systems: Which of ``SYSTEMS`` to compose; ``None`` = all five.
        freqs_mhz: Frequencies of the frequency-planning systems; ``None`` = the GPU's
            search grid.
        schedule: ``(stages, microbatches) -> PipelineSchedule``; ``None`` = 1F1B.
        microbatch_composer: Any [`FrontierComposer`][kareus.compose.FrontierComposer] of partition
            frontiers into microbatch frontiers; ``None`` =
            [`MicrobatchComposer`][kareus.compose.MicrobatchComposer].
        iteration_composer: Any [`FrontierComposer`][kareus.compose.FrontierComposer] of microbatch
            frontiers into an iteration frontier; ``None`` =
            [`IterationComposer`][kareus.compose.IterationComposer].
        kareus_frontiers: Partition frontiers already searched for kareus, by
            [`kareus_type_key`][kareus.compose.kareus_type_key] (skips their search).
        partitions: How the workload is cut into partitions (a ``PartitionSet`` of the
            workload, or a function ``workload -> PartitionSet`` for every variant the systems
            run; [`partition_builder`][kareus.workflow.partition_builder]); ``None`` =
            [`build_partitions`][kareus.model.build_partitions].

    Writes nothing: [kareus.optimize][] wraps it with search logs, and its result's
    ``save(out)`` writes ``results.json`` and ``plan.json``.

    Returns:
        Every system's iteration frontier, microbatch frontiers and partition frontiers.

    Raises:
        ArgumentTypeError: an argument of the wrong type (a profiler that is not a Profiler
            or cannot measure outside work, a composer that is not a FrontierComposer, a
            search that returns something else than a PartitionFrontier).
        ArgumentError: an unknown system name.

    Examples:
        Megatron-LM and Perseus on the emulator (neither searches kareus's space):

        >>> import kareus
        >>> from kareus.profilers import EmulatedProfiler
        >>> from kareus.workflow import compose_systems
        >>> workload = kareus.Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2,
        ...                                   seq_len=1024, num_microbatches=4)
        >>> result = compose_systems(workload, EmulatedProfiler("h200-sxm"),
        ...                          systems=["megatron", "perseus"])
        >>> sorted(result.frontiers)
        ['megatron', 'perseus']
        >>> megatron, perseus = result.frontiers["megatron"], result.frontiers["perseus"]
        >>> perseus.points[-1].energy_j < megatron.points[0].energy_j
        True
    """
    from kareus.compose.composer import FrontierComposer

    for what, comp in (("microbatch_composer", microbatch_composer),
                       ("iteration_composer", iteration_composer)):
        if comp is not None and not isinstance(comp, FrontierComposer):  # before measuring
            raise ArgumentTypeError(f"{what} must be a kareus FrontierComposer, "
                                    f"got {type(comp).__name__}")
    measured = measure_systems(workload, profiler, search=search, systems=systems,
                               freqs_mhz=freqs_mhz, kareus_frontiers=kareus_frontiers,
                               partitions=partitions)
    make_schedule = one_f_one_b if schedule is None else schedule
    sched = make_schedule(workload.parallelism.pp, workload.num_microbatches)
    return compose_measured(measured, schedule=sched, microbatch_composer=microbatch_composer,
                            iteration_composer=iteration_composer)
