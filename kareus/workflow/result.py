"""What an ``optimize`` run found, and how it is summarised, compared and saved.

[`OptimizationResult`][kareus.workflow.OptimizationResult] holds every system's iteration frontier,
kareus's partition frontiers, the profiles made and the wall time; it selects a plan, prints the
comparison table, plots the frontiers and writes ``results.json``, ``plan.json`` and
``frontier.png``. Each system is summarised by its maximum-throughput point
([`SystemSummary`][kareus.workflow.SystemSummary]), and kareus is compared with a reference system
at equal time ([`iso_time_energy_saving`][kareus.workflow.iso_time_energy_saving]) and equal energy
([`iso_energy_time_saving`][kareus.workflow.iso_energy_time_saving]).

Energy scope: every energy here is a total over all GPUs of the job for one iteration, as
published tables report; TFLOP/s per GPU counts model FLOPs (3x forward, no recomputation)
over the iteration time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import attrs

from kareus._io import check_output_folder
from kareus._logging import get_logger
from kareus.compose.iteration_frontier import IterationFrontier, IterationPoint
from kareus.compose.plan import Plan
from kareus.compose.systems import (
    SystemsResult,
)
from kareus.errors import OutputError
from kareus.model.gpu import get_gpu
from kareus.model.partition import PartitionSet
from kareus.model.workload import Workload
from kareus.search.partition_frontier import PartitionFrontier
from kareus.search.progress import in_notebook

__all__ = ["FRONTIER_NAME", "RESULTS_VERSION", "OptimizationResult", "SystemSummary", "iso_energy_time_saving",
           "iso_time_energy_saving", "joules"]


RESULTS_VERSION = 1

#: kareus's iteration frontier beside ``plan.json`` in an output folder (every point's plan).
FRONTIER_NAME = "frontier.json"

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
            ``<type>@n1``); the baselines' measurements each search started from
            (its priors) are not counted.
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
        # IterationFrontier.select raises InfeasibleError when no plan meets the limit, and
        # an argument error (a kareus error that is a ValueError/TypeError) for a mistake
        return self.kareus.select(deadline_s=deadline_s, energy_budget_j=energy_budget_j)

    def table(self) -> str:
        """The comparison table and kareus's savings against Perseus, as text."""
        rows = []
        for s in self.systems().values():
            rows.append([s.name, f"{s.time_s:.4f}", joules(s.static_j), joules(s.dynamic_j),
                         joules(s.total_j), f"{s.tflops_per_gpu:.1f}"])
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
        if path is not None and not Path(path).parent.is_dir():  # before any drawing
            raise OutputError(f"cannot save the plot to {path}: the folder {Path(path).parent} "
                              "does not exist; create it or pass a path in an existing folder")
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
        """Write ``results.json``, ``plan.json`` (``plan`` or the fastest kareus plan),
        ``frontier.json`` (kareus's iteration frontier, every point's plan:
        [`IterationFrontier.save`][kareus.compose.IterationFrontier.save], what a running job
        moves along without searching again: ``TrainingLoop.retarget``) and, if matplotlib
        is installed, ``frontier.png`` to ``out_dir``; return their paths.
        ``write_plan=False`` leaves ``plan.json`` out (no plan met a constraint).

        Every file is written atomically (a temporary file renamed over the target), so a
        run killed while saving leaves the old file or the new one, never a torn one.

        Raises:
            OutputError: ``out_dir`` is empty, an existing file, or not writable.
        """
        from kareus._io import write_json_atomic

        out = check_output_folder(out_dir, what="out_dir")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"out_dir {out}: cannot create it ({exc.strerror or exc})"
                              ) from None
        paths = {"results": out / "results.json"}
        write_json_atomic(paths["results"], self.to_dict())
        if len(self.kareus):
            paths["frontier"] = out / FRONTIER_NAME
            # without the composer's wall time: the same inputs give the same bytes
            attrs.evolve(self.kareus, stats={k: v for k, v in self.kareus.stats.items()
                                             if k != "wall_s"}).save(paths["frontier"])
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

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from font",
                                category=UserWarning)
        yield


def _shows_figures() -> bool:
    """Whether a new matplotlib figure is shown without a call to ``savefig``: in a
    notebook, or in an interactive session (IPython's ``%matplotlib``, ``plt.ion()``)."""
    import matplotlib.pyplot as plt

    return in_notebook() or plt.isinteractive()


def joules(energy_j: float) -> str:
    """An energy for a table: whole joules with thousands separators from 1,000 J up, four
    significant digits below (a small workload's 0.0123 J is not printed as 0)."""
    return f"{energy_j:,.0f}" if abs(energy_j) >= 1000 else f"{energy_j:.4g}"


def _pct(x: float | None, what: str) -> str:
    return f"{100 * x:.1f}% {what}" if x is not None else f"n/a ({what}: not reachable)"
