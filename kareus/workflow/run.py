"""The whole pipeline in one call: search every partition type, compose, compare.

[`optimize`][kareus.workflow.optimize] is what ``kareus optimize`` runs and what notebooks call:

1. check every input before anything is measured ([`prepare`][kareus.workflow.prepare], which
   returns the checked [`OptimizationRun`][kareus.workflow.OptimizationRun]);
2. build the partition types kareus searches ([kareus.compose.kareus_types][]): the
   workload's (nanobatched) types and, when the workload splits microbatches, the unsplit
   ones too (keyed ``<type>@n1``), so that kareus can run a computation unsplit where
   nanobatching does not pay;
3. search each type's full configuration space as the search specification says
   ([`SearchSpec`][kareus.search.SearchSpec]: budget, batch size, seed, surrogate, acquisition
   passes; every measurement is appended to a JSONL log per type, ``search-<key>.jsonl``, so a
   killed run resumes where it stopped);
4. measure the baselines' restricted spaces, the work outside partitions and the
   per-iteration tail, and compose the five systems (Megatron-LM, nanobatching, Perseus,
   nanobatching + Perseus, kareus) through the same microbatch and iteration composers
   ([compose_systems][kareus.workflow.compose_systems]);
5. return an [`OptimizationResult`][kareus.workflow.OptimizationResult].

Every search-side role comes in at ``optimize``'s door, as Optuna's ``create_study(sampler=,
pruner=, storage=)`` takes its parts: ``partitions=`` (your own Partition types), ``search=``
(a [`SearchSpec`][kareus.search.SearchSpec]) or its parts as shorthand (``budget=``,
``surrogate=``, ``passes=``, ...), ``profiler=`` (or ``gpu=`` / ``execution=`` for the default
emulated one), ``microbatch_composer=`` and ``iteration_composer=``, and ``pool=`` (a
``concurrent.futures`` pool that runs the searches).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import attrs

from kareus._logging import get_logger
from kareus.compose.systems import (
    AnyIterationComposer,
    AnyMicrobatchComposer,
    PartitionBuilder,
    compose_measured,
    kareus_types,
)
from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model.partition import Partition, PartitionSet
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search import (
    Observation,
    SearchSpec,
    prior_count,
    resolve_surrogate,
    search_log_path,
)
from kareus.search.acquisition import AcquisitionPass
from kareus.search.progress import ProgressBar
from kareus.search.surrogate import Surrogate
from kareus.workflow.checks import (
    check_arguments,
    check_log_dir,
    estimate_run_s,
    preflight,
    search_spec_of,
    system_names,
)
from kareus.workflow.compose import compose_systems
from kareus.workflow.measure import (
    baseline_priors,
    measure_systems,
    partition_builder,
    search_types,
)
from kareus.workflow.outdir import (
    guarded_folder,
    is_held,
    manifest_inputs,
    recover_torn_logs,
)
from kareus.workflow.result import OptimizationResult
from kareus.workflow.smoothing import smooth_kareus

__all__ = ["OptimizationRun", "optimize", "prepare"]

_log = get_logger(__name__)


def optimize(
    workload: Workload,
    gpu: str | None = None,
    *,
    profiler: Profiler | None = None,
    search: SearchSpec | None = None,
    partitions: PartitionSet | PartitionBuilder | None = None,
    passes: Sequence[AcquisitionPass | tuple[AcquisitionPass, float]] | None = None,
    budget: int | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    systems: Sequence[str] | None = None,
    schedule: str = "1f1b",
    progress: bool | None = None,
    surrogate: Surrogate | str | None = None,
    microbatch_composer: AnyMicrobatchComposer | None = None,
    iteration_composer: AnyIterationComposer | None = None,
    pool: Executor | None = None,
    fresh: bool = False,
    execution: str | None = None,
    prior_model: Profiler | None = None,
    smooth: bool = False,
) -> OptimizationResult:

    """Search, compose and compare: the whole kareus pipeline for one workload.

    Args:
        workload: The training workload (TP >= 2 or CP >= 2). ``kareus optimize --workload
            NAME`` runs ``Workload.preset(NAME, tp=4, pp=2)`` (the command's defaults;
            ``Workload.preset`` alone gives TP = PP = 1, one GPU, which kareus refuses)
            with the workload's own batch defaults (8 microbatches of 8 x 4096 tokens, 2
            nanobatches, recomputation) on ``a100-40gb``, as here with ``gpu=None``. Its
            TP layout (``Parallelism(sp=True)``: sequence parallelism, ``--sp``) and
            recomputation policy (``recompute="full" | "selective" | "none"``,
            ``--recompute``) decide the partition types, their work and the memory check,
            and the plan records both.
        gpu: GPU preset name of the default profiler (the embedded emulated GPU); ``None`` =
            ``a100-40gb``. Beside a ``profiler`` of your own it is refused (that profiler has
            its GPU).
        profiler: Where measurements come from; ``None`` = the embedded
            [`EmulatedProfiler`][kareus.profilers.EmulatedProfiler] (1% noise, ``seed``). Any
            [`Profiler`][kareus.model.Profiler] that implements ``measure`` and
            ``measure_outside`` (checked before the first measurement,
            [`preflight`][kareus.workflow.preflight]).
        search: How every partition type is searched
            ([`SearchSpec`][kareus.search.SearchSpec]: budget, batch size, seed, surrogate,
            acquisition passes); ``None`` = one made of ``budget``, ``batch_size``, ``seed``,
            ``surrogate`` and ``passes`` (each ``None``: the specification's default). With
            ``search``, leave those out (``seed`` may repeat the specification's).
        partitions: Your own partition types: a ``PartitionSet`` of ``workload`` (used for the
            workload itself; the unsplit types kareus searches too and the baselines' other
            nanobatch counts are built by ``build_partitions``), or a function ``workload ->
            PartitionSet`` used for every variant the systems run; ``None`` =
            [`build_partitions`][kareus.model.build_partitions].
        passes: The acquisition passes of every search, ``(pass, weight)`` pairs or bare
            [`AcquisitionPass`][kareus.search.AcquisitionPass]es (weight 1); ``None`` =
            [`default_passes`][kareus.search.default_passes].
        budget: Profiles per partition type for kareus's search (it may stop earlier once
            the measured front stops improving), the unsplit types included; ``None`` = 96.
        batch_size: Profiles per search batch; ``None`` = the search's default.
        seed: Seed of the searches (and of the emulator's noise); ``None`` = the search
            specification's (0 by default).
        log_dir: Where each type's search log (``search-<type>.jsonl``) goes; an existing log
            is resumed, so a killed run continues without re-measuring. ``None`` = no logs.
        systems: Which systems to compose; ``None`` = all five.
        schedule: Pipeline schedule (``"1f1b"`` or ``"gpipe"``).
        progress: Progress on stderr, of each search and of the composition: ``None`` = on
            a terminal or in a notebook (``tqdm.auto`` when installed, kareus's own bar
            otherwise); ``True`` = also elsewhere, as a plain line every few seconds (a
            pipe, a log file); ``False`` = none.
        surrogate: The searches' surrogate: ``None`` or ``"gp"`` = the default Gaussian
            process ([`default_surrogate`][kareus.search.default_surrogate]), ``"trees"`` = the
            XGBoost ensemble of the reference artifact
            ([`tree_surrogate`][kareus.search.tree_surrogate]), or a
            [`Surrogate`][kareus.search.Surrogate] template of your own.
        microbatch_composer: Any [`FrontierComposer`][kareus.compose.FrontierComposer] of the
            microbatch level, used for every system; ``None`` =
            [`MicrobatchComposer`][kareus.compose.MicrobatchComposer].
        iteration_composer: The same for the iteration level; ``None`` =
            [`IterationComposer`][kareus.compose.IterationComposer].
        pool: Run each partition type's search as a task of this
            ``concurrent.futures.Executor`` (a thread or process pool,
            [`RayExecutor`][kareus.workflow.ray.RayExecutor], submitit's executor on Slurm);
            ``None`` = one after another here. Logs come back into ``log_dir``; the
            result is the serial run's ([`kareus.workflow.pools`][kareus.workflow.pools]).
        fresh: Discard the search logs (and results) already in ``log_dir`` instead of
            resuming them.
        execution: How the emulated GPUs are fed: ``"graphed"`` (CUDA-graph replay, what
            the executor runs on a GPU) or ``"eager"`` (every op launched from the host at
            its host cost, ``TorchExecutor(graphs=False)``); ``None`` = the profiler's
            (``"graphed"`` for the embedded emulator). Like ``gpu``, it chooses the default
            profiler and is refused beside your own (give it to that profiler). Stated in the
            table, ``results.json``, the manifest and each search log's header.
        prior_model: A noise-free model of the GPU (an
            [`EmulatedProfiler`][kareus.profilers.EmulatedProfiler] with ``noise=0``, e.g.
            calibrated to the GPU's profile) whose prediction of every configuration is
            each search's prior mean: the surrogates model how the measurements differ
            from it ([`PriorMean`][kareus.search.PriorMean]). ``None`` = none. It must
            model the profiler's GPU. Recorded in the manifest and each search log.
        smooth: Compose kareus's plans on *smoothed* values: each configuration measured
            for a kareus partition type valued by surrogates fitted on all of that type's
            measurements ([`smooth_kareus`][kareus.workflow.smooth_kareus]), which pools
            the noise of single measurements out, instead of on its one measurement,
            whose luck the composition would otherwise select. kareus's figures are then
            estimates from measurements; the baselines' stay measured, and so do kareus's
            anchors (its frontier still holds every baseline point). ``False`` = as
            measured (the default). Recorded in the manifest when on.

    What it writes: nothing, unless ``log_dir`` is given; then only the search logs and
    the folder's manifest and lock there. ``results.json`` and ``plan.json`` are written
    by the result, ``result.save(out)``
    ([kareus.workflow.OptimizationResult.save][]), and a plan alone by
    ``result.select(...).save(path)``.

    ``log_dir`` is guarded ([`kareus.workflow.outdir`][kareus.workflow.outdir]): a manifest of every input that changes
    a number is kept there and a folder of another job is refused; an exclusive lock
    refuses a second run on the same folder at once.

    Returns:
        What the run found ([kareus.OptimizationResult][]): every system's iteration
        frontier (``result.frontiers``; kareus's own is ``result.kareus``), kareus's
        partition frontiers, the profiles made, the wall time; ``result.select(...)``
        picks a [kareus.Plan][], ``result.table()`` compares the systems, and
        ``result.save(out)`` writes the files.

    Raises:
        InfeasibleError: the budget is below 1.
        ConfigError: ``seed`` is negative.
        WorkloadError, UnknownPresetError: for an invalid workload or GPU, a workload
            with TP = CP = 1 (nothing to schedule), or a workload that does not fit in the
            GPU's memory (``kareus.model.memory.check_memory``).
        OutputError: ``log_dir`` is unusable or holds another job's logs.
        FolderInUseError: another run holds ``log_dir``.
        ArgumentTypeError: a profiler that does not implement ``measure_outside`` (before
            the first measurement, naming what to implement), or ``search`` that is not a
            SearchSpec.
        ArgumentError: ``search`` together with a keyword that names one of its parts, or
            ``gpu`` / ``execution`` together with a ``profiler`` of your own.
        TypeError: an argument of the wrong type.

    Examples:
        A small run on the embedded emulator (under a second on a laptop), its fastest
        plan, and the files saved:

        >>> import tempfile
        >>> import kareus
        >>> workload = kareus.Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2,
        ...                                   seq_len=1024, num_microbatches=4)
        >>> result = kareus.optimize(workload, "h200-sxm", budget=4, progress=False)
        >>> sorted(result.frontiers)
        ['kareus', 'megatron', 'nanobatching', 'nanobatching+perseus', 'perseus']
        >>> plan = result.select()  # the fastest kareus plan
        >>> plan.time_s <= result.frontiers["megatron"].points[0].time_s
        True
        >>> out = tempfile.mkdtemp()
        >>> paths = result.save(out, figure=False)  # results.json, plan.json, frontier.json
        >>> sorted(path.name for path in paths.values())
        ['frontier.json', 'plan.json', 'results.json']
    """
    check_log_dir(log_dir)
    run = prepare(workload, gpu, profiler=profiler, search=search, partitions=partitions,
                  passes=passes, budget=budget, batch_size=batch_size, seed=seed,
                  systems=systems, schedule=schedule, surrogate=surrogate,
                  microbatch_composer=microbatch_composer,
                  iteration_composer=iteration_composer, execution=execution,
                  prior_model=prior_model, smooth=smooth)
    log_path = Path(log_dir) if log_dir is not None else None
    guard = contextlib.ExitStack()
    if log_path is not None and not is_held(log_path):
        guard.enter_context(guarded_folder(log_path, run.manifest, what="log_dir", fresh=fresh))
    with guard:
        return run.run(log_dir=log_path, pool=pool, progress=progress)


@attrs.frozen(kw_only=True)
class OptimizationRun:
    """One ``optimize`` run with every input checked, before anything is measured.

    [`prepare`][kareus.workflow.prepare] makes it (all of ``optimize``'s checks, once: the
    arguments, the search specification, the systems, the profiler, the memory and what the
    profiler can measure); [`run`][kareus.workflow.OptimizationRun.run] searches and composes.
    ``kareus optimize`` prepares the run, says how long it will take and guards its output
    folder with the run's ``manifest``, then runs it:
    nothing is checked twice.

    Attributes:
        workload: The workload.
        profiler: What measures (the default emulated profiler when none was given).
        search: How every partition type is searched.
        systems: The systems composed, in order.
        schedule: The pipeline schedule's name.
        partitions: Builds the partition set of a workload (the user's or kareus's own).
        microbatch_composer: The microbatch-level composer, or ``None`` (the default).
        iteration_composer: The iteration-level composer, or ``None`` (the default).
        manifest: Every input that changes a number, as an output folder's manifest records
            it ([`manifest_inputs`][kareus.workflow.manifest_inputs]).
        estimate_s: Roughly how long the run takes on a 2-core CPU with the emulated
            profiler ([`estimate_run_s`][kareus.workflow.estimate_run_s]).
        left_out: Systems of the default five that this workload cannot run (the
            nanobatching ones when a microbatch holds one sequence), each composed by none.
        prior_model: The model whose prediction is each search's prior mean, or ``None``.
        smooth: Whether kareus composes on smoothed values (``optimize``'s ``smooth``).
    """

    workload: Workload
    profiler: Profiler
    search: SearchSpec
    systems: tuple[str, ...]
    schedule: str
    partitions: PartitionBuilder
    microbatch_composer: AnyMicrobatchComposer | None
    iteration_composer: AnyIterationComposer | None
    manifest: dict[str, Any]
    estimate_s: float
    left_out: tuple[str, ...] = ()
    prior_model: Profiler | None = None
    smooth: bool = False

    def run(self, *, log_dir: Path | None = None, pool: Executor | None = None,
            progress: bool | None = None) -> OptimizationResult:
        """Search every partition type, compose the systems and return the result.

        Args:
            log_dir: The search logs' folder (resumed; created), already guarded by the
                caller, or ``None`` for no logs.
            pool: Runs each type's search as a task (``optimize``'s ``pool``).
            progress: As ``optimize``'s.
        """
        from functools import partial

        from kareus.model.pipeline import get_schedule

        if pool is not None and not isinstance(pool, Executor):
            raise ArgumentTypeError(f"pool must be a concurrent.futures.Executor (a thread or "
                                    f"process pool, kareus.workflow.ray.RayExecutor, "
                                    f"submitit's AutoExecutor), got {type(pool).__name__}")
        workload, profiler, build = self.workload, self.profiler, self.partitions
        start = time.monotonic()
        pset = build(workload)
        types = kareus_types(workload, build)
        _log.info("optimising %s on %s with %s: %d partition types (%d unsplit), budget %d "
                  "each", workload.describe(), profiler.gpu.name, type(profiler).__name__,
                  len(types), len(types) - len(pset.types), self.search.budget)
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            recover_torn_logs(log_dir)
        clocks = profiler.clocks_mhz()

        def priors_of(some: Mapping[str, Partition]) -> dict[str, list[Observation]]:
            return baseline_priors(profiler, workload, some, systems=self.systems,
                                   freqs_mhz=None if clocks is None else list(clocks),
                                   partitions=build, log_dir=log_dir)

        if pool is not None:  # every type's priors first, then the searches as tasks
            priors = priors_of(types)
            frontiers = search_types(profiler, types, self.search, log_dir=log_dir,
                                     progress=progress, pool=pool, pset=pset, priors=priors,
                                     prior_model=self.prior_model)
        else:  # one type after another, its priors right before its search: the order a
            # resumed run reads the logs back in (each log holds its priors, then its search)
            priors, frontiers = {}, {}
            for key, part in types.items():
                one = priors_of({key: part})
                priors.update(one)
                frontiers.update(search_types(profiler, {key: part}, self.search,
                                              log_dir=log_dir, progress=progress,
                                              priors=one, prior_model=self.prior_model))
        # kareus's own profiles: its frontiers also hold the baselines' measurements its
        # searches started from (a resumed search's, recorded in its log, counted too)
        profiles = {name: len(fr.measured()) - (
            len(priors[name]) if name in priors
            else 0 if log_dir is None else prior_count(search_log_path(log_dir, name)))
            for name, fr in frontiers.items()}
        names = list(self.systems)
        _log.info("composing %s over a %s schedule", ", ".join(names), self.schedule)
        bar = ProgressBar(None, desc=f"composing {len(names)} systems", enabled=progress)
        bar.refresh()
        with bar, bar.heartbeat():
            if not self.smooth:
                result = compose_systems(workload, profiler, systems=names,
                                         kareus_frontiers=frontiers,
                                         freqs_mhz=None if clocks is None else list(clocks),
                                         schedule=partial(get_schedule, self.schedule),
                                         microbatch_composer=self.microbatch_composer,
                                         iteration_composer=self.iteration_composer,
                                         partitions=build)
            else:  # what compose_systems does, kareus's frontiers smoothed in between
                measured = smooth_kareus(
                    measure_systems(workload, profiler, systems=names,
                                    kareus_frontiers=frontiers,
                                    freqs_mhz=None if clocks is None else list(clocks),
                                    partitions=build),
                    profiler, prior_model=self.prior_model,
                    surrogate=self.search.surrogate_template(), seed=self.search.seed)
                result = compose_measured(
                    measured, schedule=get_schedule(self.schedule, workload.parallelism.pp,
                                                    workload.num_microbatches),
                    microbatch_composer=self.microbatch_composer,
                    iteration_composer=self.iteration_composer)
            bar.set_status("done")
        return OptimizationResult(workload=workload, gpu=profiler.gpu.name, partitions=pset,
                                  composition=result, wall_s=time.monotonic() - start,
                                  profiles=profiles, execution=profiler.execution)


def prepare(
    workload: Workload,
    gpu: str | None = None,
    *,
    profiler: Profiler | None = None,
    search: SearchSpec | None = None,
    partitions: PartitionSet | PartitionBuilder | None = None,
    passes: Sequence[AcquisitionPass | tuple[AcquisitionPass, float]] | None = None,
    budget: int | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
    systems: Sequence[str] | None = None,
    schedule: str = "1f1b",
    surrogate: Surrogate | str | None = None,
    microbatch_composer: AnyMicrobatchComposer | None = None,
    iteration_composer: AnyIterationComposer | None = None,
    execution: str | None = None,
    prior_model: Profiler | None = None,
    smooth: bool = False,
) -> OptimizationRun:
    """Check every input of an ``optimize`` run and return it, ready to run; nothing is
    measured or written. The arguments are [`optimize`][kareus.workflow.optimize]'s.

    ``gpu`` and ``execution`` choose the default profiler (the embedded emulated GPU) and
    are refused beside a ``profiler`` of your own, which has its GPU and its execution mode
    already: give them to it.
    """
    check_arguments(workload, gpu)
    spec = search_spec_of(search, budget=budget, batch_size=batch_size, seed=seed,
                          surrogate=surrogate, passes=passes)
    names = system_names(systems)
    names, left_out = _splittable_systems(workload, names, given=systems is not None)
    resolve_surrogate(spec.surrogate, spec.seed)  # a missing extra (trees: xgboost) now
    if profiler is None:
        from kareus.profilers.emulator import EmulatedProfiler

        profiler = EmulatedProfiler(gpu or "a100-40gb", seed=spec.seed, execution=execution)
    elif not isinstance(profiler, Profiler):
        raise ArgumentTypeError(f"profiler must be a kareus Profiler, got "
                                f"{type(profiler).__name__}")
    elif gpu is not None or execution is not None:
        given = "gpu" if gpu is not None else "execution"
        raise ArgumentError(f"{given}= chooses the default (emulated) profiler; yours measures "
                            f"{profiler.gpu.name}"
                            + (f", {profiler.execution}" if profiler.execution else "")
                            + f": leave {given}= out (or give it to your profiler)")
    preflight(workload, profiler, schedule=schedule)  # before any long work
    if prior_model is not None:
        if not isinstance(prior_model, Profiler):
            raise ArgumentTypeError(f"prior_model must be a kareus Profiler, got "
                                    f"{type(prior_model).__name__}")
        if prior_model.gpu.name != profiler.gpu.name:
            raise ArgumentError(f"prior_model models {prior_model.gpu.name}, the profiler "
                                f"measures {profiler.gpu.name}: give prior_model a model of "
                                f"{profiler.gpu.name}")
    build = partition_builder(partitions, workload)
    manifest = manifest_inputs(
        workload, profiler, budget=spec.budget, batch_size=spec.batch_size, seed=spec.seed,
        schedule=schedule, surrogate=spec.surrogate, systems=systems,
        microbatch_composer=microbatch_composer, iteration_composer=iteration_composer,
        passes=spec.passes, partitions=partitions, prior_model=prior_model, smooth=smooth)
    if not isinstance(smooth, bool):
        raise ArgumentTypeError(f"smooth must be True or False, got {smooth!r:.40}")
    return OptimizationRun(workload=workload, profiler=profiler, search=spec,
                           systems=tuple(names), left_out=left_out, schedule=schedule,
                           partitions=build,
                           microbatch_composer=microbatch_composer,
                           iteration_composer=iteration_composer, manifest=manifest,
                           prior_model=prior_model, smooth=smooth,
                           estimate_s=estimate_run_s(workload, profiler, spec.budget))


#: The systems that split every microbatch into nanobatches.
_SPLITTING = ("nanobatching", "nanobatching+perseus")


def _splittable_systems(workload: Workload, names: list[str], *, given: bool
                        ) -> tuple[list[str], tuple[str, ...]]:
    """The systems to compose, without the nanobatching ones when a microbatch of one
    sequence cannot be split: along its batch it cannot, and along the sequence
    (``Workload.sequence_split``) only at CP = 1; left out of the default five, refused
    when asked for by name."""
    if workload.microbatch_size >= 2 or workload.parallelism.cp == 1:
        return names, ()
    asked = [n for n in names if n in _SPLITTING]
    if asked and given:
        raise ArgumentError(f"systems: {', '.join(asked)} split each microbatch into "
                            f"nanobatches, and microbatch_size=1 at CP={workload.parallelism.cp} "
                            "does not split (nanobatches along the sequence are modelled at "
                            "CP=1 only); leave them out (the default leaves them out)")
    return [n for n in names if n not in _SPLITTING], tuple(asked)
