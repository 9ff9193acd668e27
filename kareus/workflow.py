"""The whole pipeline in one call: search every partition type, compose, compare.

[`optimize`][kareus.optimize] is what ``kareus optimize`` runs and what notebooks call:

1. build the partition types kareus searches ([kareus.compose.kareus_types][]): the
   workload's (nanobatched) types and, when the workload splits microbatches, the unsplit
   ones too (keyed ``<type>@n1``), so that kareus can run a computation unsplit where
   nanobatching does not pay;
2. search each type's full configuration space as the search specification says
   ([`SearchSpec`][kareus.search.SearchSpec]: budget, batch size, seed, surrogate, acquisition
   passes; a [`MultiPassSearch`][kareus.search.MultiPassSearch] whose initial design starts with
   the baselines' own configurations; every measurement is appended to a JSONL log per type,
   ``search-<key>.jsonl``, so a killed run resumes where it stopped);
3. measure the baselines' restricted spaces, the work outside partitions and the
   per-iteration tail, and compose the five systems (Megatron-LM, nanobatching, Perseus,
   nanobatching + Perseus, kareus) through the same microbatch and iteration composers
   ([compose_systems][kareus.workflow.compose_systems]);
4. summarise: each system's maximum-throughput point, and kareus's iso-time energy saving
   and iso-energy time saving against a reference system (Perseus by default).

Every search-side role comes in at ``optimize``'s door, as Optuna's ``create_study(sampler=,
pruner=, storage=)`` takes its parts: ``partitions=`` (your own Partition types), ``search=``
(a [`SearchSpec`][kareus.search.SearchSpec]) or its parts (``budget=``, ``surrogate=``,
``passes=``, ...), ``profiler=``, ``microbatch_composer=`` and ``iteration_composer=``, and
``pool=`` (a ``concurrent.futures`` pool that runs the searches).

This module and ``kareus._orchestrate`` (whose public names are re-exported here:
[`compose_systems`][kareus.workflow.compose_systems],
[`measure_systems`][kareus.workflow.measure_systems], [`preflight`][kareus.workflow.preflight], ...)
are the one place that measures; the layers below only search and compose.

Energy scope: every energy here is a total over all GPUs of the job for one iteration, as
published tables report; TFLOP/s per GPU counts model FLOPs (3x forward, no
recomputation) over the iteration time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import textwrap
import time
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import attrs

from kareus._logging import get_logger
from kareus._orchestrate import (
    compose_systems,
    exhaustive_search,
    measure_outside_work,
    measure_systems,
    partition_builder,
    preflight,
    require_outside_work,
    search_types,
)
from kareus._outdir import guarded_folder, is_held, move_aside
from kareus._version import __version__
from kareus.compose.iteration_frontier import IterationFrontier, IterationPoint
from kareus.compose.plan import Plan
from kareus.compose.systems import (
    SYSTEMS,
    AnyIterationComposer,
    AnyMicrobatchComposer,
    PartitionBuilder,
    SystemsResult,
    kareus_types,
)
from kareus.errors import ArgumentError, ArgumentTypeError, InfeasibleError, OutputError
from kareus.model.gpu import get_gpu
from kareus.model.partition import PartitionSet
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.search._progress import ProgressBar, in_notebook
from kareus.search._spec import SearchSpec, execution_of, resolve_surrogate
from kareus.search.acquisition import AcquisitionPass
from kareus.search.partition_frontier import PartitionFrontier
from kareus.search.surrogate import Surrogate

__all__ = ["OptimizationResult", "SystemSummary", "compose_systems", "exhaustive_search",
           "iso_energy_time_saving", "iso_time_energy_saving", "manifest_inputs",
           "measure_outside_work", "measure_systems", "optimize", "partition_builder",
           "preflight", "require_outside_work", "resolve_surrogate", "search_types"]

RESULTS_VERSION = 1

_log = get_logger(__name__)


@attrs.frozen(kw_only=True)
class SystemSummary:
    """One system's maximum-throughput iteration (energies over every GPU of the job)."""

    name: str
    time_s: float
    static_j: float
    dynamic_j: float
    total_j: float
    tflops_per_gpu: float

    def to_dict(self) -> dict[str, float]:
        """The summary as a JSON-ready dict (the keys are the field names)."""
        return {"time_s": self.time_s, "static_j": self.static_j, "dynamic_j": self.dynamic_j,
                "total_j": self.total_j, "tflops_per_gpu": self.tflops_per_gpu}


def iso_time_energy_saving(system: IterationFrontier, reference: IterationFrontier
                           ) -> float | None:
    """Energy saved by ``system`` at the reference's fastest iteration time, as a fraction.

    ``1 - E_system(t_ref) / E_ref(t_ref)`` where ``t_ref`` is the reference's fastest time and
    ``E_system(t)`` the lowest energy of a ``system`` plan that takes at most ``t``. ``None``
    when ``system`` cannot run that fast.
    """
    if not len(system) or not len(reference):
        return None
    ref = reference.points[0]
    ok = [p.energy_j for p in system.points if p.time_s <= ref.time_s * (1 + 1e-9)]
    return 1.0 - min(ok) / ref.energy_j if ok else None


def iso_energy_time_saving(system: IterationFrontier, reference: IterationFrontier
                           ) -> float | None:
    """Time saved by ``system`` at the reference's lowest iteration energy, as a fraction.

    ``1 - T_system(e_ref) / T_ref(e_ref)`` where ``e_ref`` is the reference's lowest energy
    and ``T_system(e)`` the shortest time of a ``system`` plan that uses at most ``e``.
    ``None`` when ``system`` cannot use that little energy.
    """
    if not len(system) or not len(reference):
        return None
    ref = reference.points[-1]
    ok = [p.time_s for p in system.points if p.energy_j <= ref.energy_j * (1 + 1e-9)]
    return 1.0 - min(ok) / ref.time_s if ok else None


@attrs.frozen(kw_only=True)
class OptimizationResult:
    """What [`optimize`][kareus.optimize] found.

    Attributes:
        workload: The workload optimised.
        gpu: GPU preset name.
        partitions: The workload's partition types (with its nanobatching; kareus also
            searches the unsplit ones, [`kareus_types`][kareus.compose.kareus_types]).
        composition: The five systems' composition (kareus and the four it is compared
            with): their iteration frontiers and what they were built from.
        wall_s: Wall time of the whole run.
        execution: How the measured GPUs were fed: ``"graphed"`` (CUDA-graph replay) or
            ``"eager"`` (every op launched from the host), as the profiler says
            (``EmulatedProfiler.execution``); ``None``: the
            profiler does not say.
        profiles: Profiles (measurements) made by kareus's searches, per partition type
            key ([`kareus_type_key`][kareus.compose.kareus_type_key]: the unsplit types as
            ``<type>@n1``).
    """

    workload: Workload
    gpu: str
    partitions: PartitionSet
    composition: SystemsResult
    wall_s: float
    profiles: dict[str, int]
    execution: str | None = None

    @property
    def frontiers(self) -> dict[str, IterationFrontier]:
        """System name -> iteration frontier."""
        return self.composition.frontiers

    @property
    def kareus(self) -> IterationFrontier:
        """The iteration frontier of kareus itself (the ``"kareus"`` system)."""
        return self.composition.frontiers["kareus"]

    def partition_frontiers(self) -> dict[str, PartitionFrontier]:
        """kareus's partition frontiers, per type key (the unsplit types as ``<type>@n1``;
        a frontier's ``partition`` is the type's own name)."""
        return self.composition.partitions["kareus"]

    def _summary(self, name: str, point: IterationPoint) -> SystemSummary:
        flops = self.partitions.model_flops_per_gpu_iteration()
        return SystemSummary(name=name, time_s=point.time_s,
                             static_j=point.energy_j - point.dynamic_energy_j,
                             dynamic_j=point.dynamic_energy_j, total_j=point.energy_j,
                             tflops_per_gpu=flops / point.time_s / 1e12)

    def systems(self) -> dict[str, SystemSummary]:
        """Each system's maximum-throughput point."""
        return {name: self._summary(name, fr.points[0])
                for name, fr in self.frontiers.items() if len(fr)}

    def savings(self, reference: str = "perseus") -> dict[str, float | None]:
        """kareus's iso-time energy saving and iso-energy time saving against ``reference``."""
        ref = self.frontiers[reference]
        return {"iso_time_energy_saving": iso_time_energy_saving(self.kareus, ref),
                "iso_energy_time_saving": iso_energy_time_saving(self.kareus, ref)}

    def select(self, *, deadline_s: float | None = None,
               energy_budget_j: float | None = None) -> Plan:
        """A kareus plan: the fastest (no constraint), or the best under one constraint.

        Raises:
            InfeasibleError: no kareus plan meets the constraint.
        """
        if deadline_s is None and energy_budget_j is None:
            return self.kareus.max_throughput()
        try:
            return self.kareus.select(deadline_s=deadline_s, energy_budget_j=energy_budget_j)
        except ValueError as exc:
            raise InfeasibleError(str(exc)) from None

    def table(self) -> str:
        """The comparison table and kareus's savings against Perseus, as text."""
        rows = []
        for s in self.systems().values():
            rows.append([s.name, f"{s.time_s:.4f}", f"{s.static_j:,.0f}", f"{s.dynamic_j:,.0f}",
                         f"{s.total_j:,.0f}", f"{s.tflops_per_gpu:.1f}"])
        headers = ["system", "iteration time (s)", "static energy (J)", "dynamic energy (J)",
                   "total energy (J)", "TFLOP/s per GPU"]
        widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
        lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(headers, widths)))]
        lines.append("  ".join("-" * w for w in widths))
        for r in rows:
            lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(r, widths))))
        lines.append("")
        lines.append(f"Maximum-throughput point of each system; energies are totals over all "
                     f"{self.workload.parallelism.world_size} GPUs per iteration"
                     + {"graphed": "; graph-captured execution (CUDA-graph replay; "
                                   "--no-graphs: eager launches).",
                        "eager": "; eager execution (every op launched from the host, "
                                 "--no-graphs).",
                        None: "."}.get(self.execution, f"; execution {self.execution}."))
        if "perseus" in self.frontiers:
            sv = self.savings("perseus")
            lines.append("kareus vs perseus: " + _pct(sv["iso_time_energy_saving"], "less energy")
                         + " at perseus's fastest iteration time (iso-time); "
                         + _pct(sv["iso_energy_time_saving"], "less time")
                         + " at perseus's lowest energy (iso-energy).")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The content of ``results.json``."""
        sv = self.savings("perseus") if "perseus" in self.frontiers else {}
        return {
            "version": RESULTS_VERSION,
            "workload": self.workload.to_dict(),
            "gpu": self.gpu,
            **({} if get_gpu(self.gpu).is_preset else {"gpu_spec": get_gpu(self.gpu).to_dict()}),
            "energy_scope": "total over all GPUs of the job, per iteration",
            "execution": self.execution,
            "systems": {n: s.to_dict() for n, s in self.systems().items()},
            "iso_time_energy_saving_vs_perseus": sv.get("iso_time_energy_saving"),
            "iso_energy_time_saving_vs_perseus": sv.get("iso_energy_time_saving"),
            "frontiers": {n: [[p.time_s, p.energy_j] for p in fr.points]
                          for n, fr in self.frontiers.items()},
            "profiles_per_partition_type": self.profiles,
        }  # no wall time: the same inputs give the same bytes (it is in OptimizationResult)

    def plot(self, path: str | os.PathLike[str] | None = None, *, ax: Any = None) -> Any:
        """The systems' iteration frontiers, time vs energy (needs matplotlib).

        Args:
            path: Save the figure to this file (the format follows the suffix: ``.png``,
                ``.pdf``, ``.svg``).
            ax: Draw into these matplotlib axes; ``None`` = a new figure.

        Returns:
            The matplotlib axes. Without ``path`` and ``ax``, a notebook or an interactive
            matplotlib session shows the figure as usual; in a script, where nothing would
            ever show it, it is saved to ``kareus-frontier.png`` in the working directory
            and stderr says so.
        """
        import matplotlib.pyplot as plt  # optional dependency

        fresh = ax is None
        if fresh:
            _, ax = plt.subplots(figsize=(7, 5))
        markers = {"megatron": "s", "nanobatching": "D", "perseus": "^",
                   "nanobatching+perseus": "v", "kareus": "o"}
        for name, fr in self.frontiers.items():
            if not len(fr):
                continue
            a = fr.array()
            style = "-" if len(fr) > 1 else ""
            ax.plot(a[:, 0], a[:, 1] / 1e3, style, marker=markers.get(name, "."),
                    ms=6 if len(fr) == 1 else 3, label=name, lw=2 if name == "kareus" else 1)
        ax.set_xlabel("iteration time (s)")
        ax.set_ylabel("iteration energy (kJ, all GPUs)")
        # wrapped, so that a long workload description is not cut at the figure's edge
        ax.set_title("\n".join(textwrap.wrap(f"{self.workload.describe()} on {self.gpu}",
                                              width=64)), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        if path is None and fresh and not _shows_figures():
            path = Path("kareus-frontier.png")
            print(f"kareus: saved the frontier plot to {path.resolve()} (pass a path to "
                  "choose where)", file=sys.stderr)
        if path is not None:
            fig = ax.figure
            with _missing_glyphs_quiet():
                fig.tight_layout()
                fig.savefig(path, dpi=120)
            _log.info("wrote the frontier plot to %s", path)
        return ax

    def save(self, out_dir: str | os.PathLike[str], *, plan: Plan | None = None,
             figure: bool = True, write_plan: bool = True) -> dict[str, Path]:
        """Write ``results.json``, ``plan.json`` (``plan`` or the fastest kareus plan) and,
        if matplotlib is installed, ``frontier.png`` to ``out_dir``; return their paths.
        ``write_plan=False`` leaves ``plan.json`` out (no plan met a constraint).

        Every file is written atomically (a temporary file renamed over the target), so a
        run killed while saving leaves the old file or the new one, never a torn one.

        Raises:
            OutputError: ``out_dir`` is empty, an existing file, or not writable.
        """
        from kareus._io import write_json_atomic
        from kareus._outdir import check_output_folder

        out = check_output_folder(out_dir, what="out_dir")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"out_dir {out}: cannot create it ({exc.strerror or exc})"
                              ) from None
        paths = {"results": out / "results.json"}
        write_json_atomic(paths["results"], self.to_dict())
        if write_plan:
            paths["plan"] = out / "plan.json"
            (plan if plan is not None else self.select()).save(paths["plan"])
        if figure:
            try:
                import matplotlib

                matplotlib.use("Agg")
                import matplotlib.pyplot as plt
            except ImportError:
                print("kareus: matplotlib is not installed; skipping frontier.png "
                      "(pip install 'kareus[plot]')", file=sys.stderr)
            else:
                fig, ax = plt.subplots(figsize=(7, 5))
                self.plot(ax=ax)
                paths["figure"] = out / "frontier.png"
                tmp = out / ".frontier.png.tmp"
                with _missing_glyphs_quiet():
                    fig.tight_layout()
                    fig.savefig(tmp, dpi=120, format="png")
                os.replace(tmp, paths["figure"])
                plt.close(fig)
        return paths

    def __repr__(self) -> str:
        sv = self.savings() if "perseus" in self.frontiers else {}
        return (f"OptimizationResult({self.workload.describe()} on {self.gpu}; "
                f"{sum(self.profiles.values())} profiles in {self.wall_s:.1f} s; kareus vs "
                f"perseus: {_pct(sv.get('iso_time_energy_saving'), 'energy')} iso-time, "
                f"{_pct(sv.get('iso_energy_time_saving'), 'time')} iso-energy)")


@contextlib.contextmanager
def _missing_glyphs_quiet() -> Any:
    """Silence matplotlib's warning per character that its font lacks (a model named in
    CJK script, say): the title shows boxes there, and stderr keeps to kareus's own lines."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font",
                                category=UserWarning)
        yield


def _shows_figures() -> bool:
    """Whether a new matplotlib figure is shown without a call to ``savefig``: in a
    notebook, or in an interactive session (IPython's ``%matplotlib``, ``plt.ion()``)."""
    import matplotlib.pyplot as plt

    return in_notebook() or plt.isinteractive()


def _pct(x: float | None, what: str) -> str:
    return f"{100 * x:.1f}% {what}" if x is not None else f"n/a ({what}: not reachable)"


def _check_arguments(workload: Any, gpu: Any, *, log_dir: Any) -> None:
    """``optimize``'s plain arguments, checked before anything runs (the search's are checked
    by [`SearchSpec`][kareus.search.SearchSpec])."""
    if not isinstance(workload, Workload):
        raise ArgumentTypeError(f"workload must be a kareus Workload, got "
                                f"{type(workload).__name__}")
    if gpu is not None and (not isinstance(gpu, str) or not gpu):
        raise ArgumentTypeError(f"gpu must be a GPU preset name such as 'h200-sxm' (or None: the "
                                f"profiler's), got {gpu!r:.40}")
    if log_dir is not None:
        if not isinstance(log_dir, (str, os.PathLike)):
            raise ArgumentTypeError(f"log_dir must be a folder path or None, got "
                                    f"{type(log_dir).__name__}")
        if not os.fspath(log_dir):
            raise OutputError("log_dir is empty: name a folder for the logs (or pass None "
                              "for none); an empty path would write into the working folder")


def _search_spec(search: Any, *, budget: Any, batch_size: Any, seed: Any, surrogate: Any,
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


def _system_names(systems: Sequence[str] | None) -> list[str]:
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
    executor: Executor | None = None,
) -> OptimizationResult:
    """Search, compose and compare: the whole kareus pipeline for one workload.

    Args:
        workload: The training workload (TP >= 2 or CP >= 2). ``kareus optimize --workload
            NAME`` runs ``Workload.preset(NAME, tp=4, pp=2)`` (the command's defaults;
            ``Workload.preset`` alone gives TP = PP = 1, one GPU, which kareus refuses)
            with the workload's own batch defaults (8 microbatches of 8 x 4096 tokens, 2
            nanobatches, recomputation) on ``a100-40gb``, as here with ``gpu=None``.
        gpu: GPU preset name; ``None`` = the profiler's GPU (``a100-40gb`` without a profiler).
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
            [`RayExecutor`][kareus.interop.ray.RayExecutor], submitit's executor on Slurm);
            ``None`` = one after another here. Logs come back into ``log_dir``; the
            result is the serial run's ([`kareus.interop.tasks`][kareus.interop.tasks]).
        fresh: Discard the search logs (and results) already in ``log_dir`` instead of
            resuming them.
        execution: How the emulated GPUs are fed: ``"graphed"`` (CUDA-graph replay, what
            the executor runs on a GPU) or ``"eager"`` (every op launched from the host at
            its host cost, ``TorchExecutor(graphs=False)``); ``None`` = the profiler's
            (``"graphed"`` for the embedded emulator). With a ``profiler`` of its own it
            must agree with it. Stated in the table, ``results.json``, the manifest and
            each search log's header.
        executor: Deprecated name of ``pool`` (a ``DeprecationWarning``): ``kareus.Executor``
            is the role that runs plans on GPUs, not a pool of tasks.

    What it writes: nothing, unless ``log_dir`` is given; then only the search logs and
    the folder's manifest and lock there. ``results.json`` and ``plan.json`` are written
    by the result, ``result.save(out)``
    ([kareus.workflow.OptimizationResult.save][]), and a plan alone by
    ``result.select(...).save(path)``.

    ``log_dir`` is guarded (``kareus._outdir``): a manifest of every input that changes
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
            ``pool`` together with ``executor``.
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
        >>> paths = result.save(out, figure=False)  # results.json and plan.json
        >>> sorted(path.name for path in paths.values())
        ['plan.json', 'results.json']
    """
    from functools import partial

    from kareus.model.pipeline import get_schedule

    if executor is not None:
        warnings.warn("optimize(executor=...) is deprecated: pass the concurrent.futures pool "
                      "as pool=... (kareus.Executor is the role that runs plans)",
                      DeprecationWarning, stacklevel=2)
        if pool is not None:
            raise ArgumentError("give pool= (executor= is its deprecated name), not both")
        pool = executor
    if pool is not None and not isinstance(pool, Executor):
        raise ArgumentTypeError(f"pool must be a concurrent.futures.Executor (a thread or "
                                f"process pool, kareus.interop.ray.RayExecutor, submitit's "
                                f"AutoExecutor), got {type(pool).__name__}")
    _check_arguments(workload, gpu, log_dir=log_dir)
    spec = _search_spec(search, budget=budget, batch_size=batch_size, seed=seed,
                        surrogate=surrogate, passes=passes)
    names = _system_names(systems)
    if profiler is None:
        from kareus.profilers.emulator import EmulatedProfiler

        profiler = EmulatedProfiler(gpu or "a100-40gb", seed=spec.seed, execution=execution)
    elif not isinstance(profiler, Profiler):
        raise ArgumentTypeError(f"profiler must be a kareus Profiler, got "
                                f"{type(profiler).__name__}")
    elif execution is not None and execution_of(profiler) != execution:
        raise ArgumentError(f"execution={execution!r} but the profiler measures "
                            f"{execution_of(profiler) or 'without saying how the GPU is fed'}: "
                            "give the emulated profiler its execution, or leave it out")
    if gpu is not None and profiler.gpu.name != gpu:
        raise ArgumentError(f"the profiler measures {profiler.gpu.name}, not {gpu}")
    preflight(workload, profiler, schedule=schedule)  # before any long work
    build = partition_builder(partitions, workload)
    start = time.monotonic()
    pset = build(workload)
    types = kareus_types(workload, build)
    _log.info("optimising %s on %s with %s: %d partition types (%d unsplit), budget %d each",
              workload.describe(), profiler.gpu.name, type(profiler).__name__,
              len(types), len(types) - len(pset.types), spec.budget)
    log_path = Path(log_dir) if log_dir is not None else None
    guard = contextlib.ExitStack()
    if log_path is not None and not is_held(log_path):
        guard.enter_context(guarded_folder(
            log_path, what="log_dir", fresh=fresh, inputs=manifest_inputs(
                workload, profiler, budget=spec.budget, batch_size=spec.batch_size,
                seed=spec.seed, schedule=schedule, surrogate=spec.surrogate, systems=systems,
                microbatch_composer=microbatch_composer,
                iteration_composer=iteration_composer, passes=spec.passes,
                partitions=partitions)))
    with guard:
        if log_path is not None:
            log_path.mkdir(parents=True, exist_ok=True)
            _recover_torn_logs(log_path)
        frontiers = search_types(profiler, types, spec, log_dir=log_path, progress=progress,
                                 pool=pool, pset=pset)
        profiles = {name: len(fr.measured()) for name, fr in frontiers.items()}
        _log.info("composing %s over a %s schedule", ", ".join(names), schedule)
        bar = ProgressBar(None, desc=f"composing {len(names)} systems", enabled=progress)
        bar.refresh()
        with bar, bar.heartbeat():
            clocks = profiler.clocks_mhz()
            result = compose_systems(workload, profiler, systems=names,
                                     kareus_frontiers=frontiers,
                                     freqs_mhz=None if clocks is None else list(clocks),
                                     schedule=partial(get_schedule, schedule),
                                     microbatch_composer=microbatch_composer,
                                     iteration_composer=iteration_composer,
                                     partitions=build)
            bar.set_status("done")
        return OptimizationResult(workload=workload, gpu=profiler.gpu.name, partitions=pset,
                                  composition=result, wall_s=time.monotonic() - start,
                                  profiles=profiles, execution=execution_of(profiler))


def _recover_torn_logs(log_dir: Path) -> None:
    """Move aside a search log whose header line was cut short by a kill (it holds no
    measurement yet), so that the search starts it again instead of failing on it; the
    torn file is kept beside it as ``<name>.torn``."""
    for log in sorted(log_dir.glob("search-*.jsonl")):
        try:
            with open(log, "rb") as fh:
                head = fh.readline()
        except OSError:
            continue
        if not head or head.endswith(b"\n"):
            continue
        try:
            complete = isinstance(json.loads(head), dict)
        except ValueError:
            complete = False
        if not complete:
            kept = move_aside(log)
            print(f"kareus: {log} had a torn header line (a run was killed as it started); "
                  f"kept it as {kept.name} and starting that search again", file=sys.stderr)


def _digest_json(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _profiler_identity(profiler: Profiler) -> dict[str, Any]:
    inner: Any = profiler
    while isinstance(getattr(inner, "inner", None), Profiler):  # recorders are transparent
        inner = inner.inner
    ident: dict[str, Any] = {"class": f"{type(inner).__module__}.{type(inner).__qualname__}"}
    for attr in ("noise", "time_noise", "seed", "power_limit", "samples"):
        value = getattr(inner, attr, None)
        if isinstance(value, (bool, int, float, str)):
            ident[attr] = value
    calibration = getattr(inner, "calibration", None)
    if isinstance(calibration, str) and calibration:  # an emulator from a measured profile
        ident["calibration"] = calibration
    priority = getattr(inner, "comm_priority", None)
    if isinstance(priority, str) and priority != "high":  # an emulator at normal priority
        ident["comm_priority"] = priority
    execution = execution_of(inner)
    if execution is not None:  # how the emulated GPU is fed: graphed or eager
        ident["execution"] = execution
    data = getattr(inner, "data", None)
    if isinstance(data, dict):
        ident["data_digest"] = _digest_json(data)
    return ident


def _name_of(obj: Any) -> Any:
    if obj is None or isinstance(obj, str):
        return obj
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def manifest_inputs(workload: Workload, profiler: Profiler, *, budget: int,
                    batch_size: int | None, seed: int, schedule: str,
                    surrogate: Surrogate | str | None, systems: Sequence[str] | None,
                    microbatch_composer: Any = None, iteration_composer: Any = None,
                    passes: Sequence[tuple[AcquisitionPass, float]] | None = None,
                    partitions: Any = None) -> dict[str, Any]:
    """Every input of ``optimize`` that changes a number, as the manifest of its output
    folder records it (``kareus._outdir``): a folder whose manifest differs is refused.

    ``passes`` and ``partitions`` are recorded only when given (not the defaults), so a
    folder made before they could be given keeps its manifest."""
    gpu = profiler.gpu
    spec: dict[str, Any] | str
    try:
        spec = attrs.asdict(gpu)
    except attrs.exceptions.NotAnAttrsClassError:
        spec = repr(gpu)
    return {
        "kareus_version": __version__,
        "workload": {**workload.to_dict(), "dtype_bytes": workload.dtype_bytes,
                     "architecture": attrs.asdict(workload.model)},
        "gpu": {"name": gpu.name, "spec_digest": _digest_json(spec)},
        "budget": budget,
        "batch_size": batch_size,
        "seed": seed,
        "schedule": schedule,
        "surrogate": _name_of(surrogate) or "gp",
        "profiler": _profiler_identity(profiler),
        "systems": list(systems) if systems is not None else None,
        "composers": [_name_of(microbatch_composer), _name_of(iteration_composer)],
        **({} if passes is None else {"passes": [[_name_of(p), _stable_repr(p), float(w)]
                                                 for p, w in passes]}),
        **({} if partitions is None else {"partitions": _partitions_identity(partitions)}),
    }


def _partitions_identity(partitions: Any) -> Any:
    """What the manifest records of ``optimize(partitions=...)``: a set's digest (its
    types, counts and outside work), or a builder's name."""
    if isinstance(partitions, PartitionSet):
        types = {n: {"class": _name_of(p), "overlappable": p.overlappable,
                     "ops": [[op.name, op.flops, op.bytes_moved] for op in p.compute_ops],
                     "comm": [p.comm_op.kind.value, p.comm_op.bytes, p.comm_op.group_size]}
                 for n, p in partitions.types.items()}
        return {"types": {n: _name_of(p) for n, p in partitions.types.items()},
                "digest": _digest_json([types, partitions.counts, repr(partitions.outside),
                                        repr(partitions.iteration)])}
    return getattr(partitions, "__qualname__", None) or _name_of(partitions)


def _stable_repr(obj: Any) -> str | None:
    """``repr(obj)`` where it says what the object is; ``None`` where it holds a memory
    address (the same configuration would give another manifest in the next run)."""
    text = repr(obj)
    return None if " at 0x" in text else text
