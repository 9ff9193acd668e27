"""The frontier of one microbatch computation (the forward or the backward of one stage).

A [`MicrobatchFrontier`][kareus.compose.MicrobatchFrontier] holds the time-energy trade-offs of one
microbatch computation: each point is a [`MicrobatchChoice`][kareus.compose.MicrobatchChoice] (a
frequency, a nanobatch count and one configuration per partition type) with its time and *dynamic*
energy. Static
energy is charged once, at iteration level, for the whole iteration (bubbles included),
so microbatch points compare on dynamic energy.

Energy scope: microbatch energies cover every GPU that runs the stage in the job
(TP x CP GPUs of one replica, times DP). Times are wall times seen by one rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import attrs

from kareus._io import write_text_atomic
from kareus.compose._frontier_common import FRONTIER_VERSION, check_kind, loads, pareto_points
from kareus.compose.plan import MicrobatchChoice
from kareus.errors import ArgumentError, PlanError

__all__ = ["MicrobatchFrontier", "MicrobatchPoint"]

def _points(value: Iterable[MicrobatchPoint]) -> tuple[MicrobatchPoint, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class MicrobatchPoint:
    """One way to run a microbatch computation and what it costs.

    Attributes:
        time_s: Wall time of the computation on one rank.
        dynamic_energy_j: Dynamic energy over every GPU of the stage (TP x CP x DP).
        choice: The frequency and per-type configurations that achieve it.
    """

    time_s: float = attrs.field(converter=float)
    dynamic_energy_j: float = attrs.field(converter=float)
    choice: MicrobatchChoice

    @property
    def freq_mhz(self) -> int:
        """The frequency of the choice."""
        return self.choice.freq_mhz

    @property
    def predicted(self) -> bool:
        """Whether the point is built on surrogate predictions (not only measurements)."""
        return self.choice.predicted

    @property
    def nanobatches(self) -> int | None:
        """The nanobatches the choice splits the microbatch into (1: unsplit); ``None``
        when the choice does not record it (the workload's count)."""
        return self.choice.nanobatches


@attrs.frozen(kw_only=True)
class MicrobatchFrontier:
    """The time-energy frontier of one microbatch computation (one stage, one phase).

    Attributes:
        stage: Pipeline stage.
        phase: ``"fwd"`` or ``"bwd"``.
        by_freq: Frequency -> the Pareto points at that frequency, fastest first.
        points: Pareto points over every frequency in (time, dynamic energy), fastest first.
    """

    stage: int
    phase: str
    by_freq: dict[int, tuple[MicrobatchPoint, ...]]
    points: tuple[MicrobatchPoint, ...] = attrs.field(converter=_points)

    @classmethod
    def from_fronts(cls, stage: int, phase: str,
                    by_freq: Mapping[int, Sequence[MicrobatchPoint]]) -> MicrobatchFrontier:
        """Build from per-frequency fronts; ``points`` is their joint Pareto front."""
        fronts = {int(f): tuple(sorted(p, key=attrgetter("time_s"))) for f, p in by_freq.items()
                  if p}
        allp = [p for ps in fronts.values() for p in ps]
        pts = pareto_points(allp, attrgetter("time_s", "dynamic_energy_j"))
        return cls(stage=stage, phase=phase, by_freq=dict(sorted(fronts.items(), reverse=True)),
                   points=pts)

    @classmethod
    def union(cls, frontiers: Sequence[MicrobatchFrontier]) -> MicrobatchFrontier:
        """The Pareto union of frontiers of one computation: at every frequency the Pareto
        points of all their points there, and the joint front over those.

        Kareus composes each computation twice, from the nanobatched partition types and
        from the unsplit ones; the union lets each point be either, its choice recording
        its nanobatch count. Of points with exactly equal time and energy, the one of the
        earlier frontier is kept.

        Args:
            frontiers: At least one frontier, all of the same stage and phase.

        Returns:
            The union frontier.

        Raises:
            ValueError: no frontier, or frontiers of different computations.
        """
        frs = list(frontiers)
        if not frs:
            raise ArgumentError("union needs at least one microbatch frontier")
        stage, phase = frs[0].stage, frs[0].phase
        other = [(f.stage, f.phase) for f in frs if (f.stage, f.phase) != (stage, phase)]
        if other:
            raise ArgumentError(f"union of frontiers of different computations: stage {stage} "
                                f"{phase} and {other}")
        merged: dict[int, list[MicrobatchPoint]] = {}
        for fr in frs:
            for f, pts in fr.by_freq.items():
                merged.setdefault(f, []).extend(pts)
        key = attrgetter("time_s", "dynamic_energy_j")
        return cls.from_fronts(stage, phase, {f: pareto_points(pts, key)
                                              for f, pts in merged.items()})

    @property
    def freqs_mhz(self) -> list[int]:
        """Frequencies with at least one point, descending."""
        return list(self.by_freq)

    def at(self, freq_mhz: int) -> tuple[MicrobatchPoint, ...]:
        """The Pareto points at one frequency (empty if none)."""
        return self.by_freq.get(int(freq_mhz), ())

    def __len__(self) -> int:
        return len(self.points)

    def __iter__(self) -> Iterator[MicrobatchPoint]:
        return iter(self.points)

    def to_dict(self) -> dict[str, Any]:
        """The frontier as a JSON-ready dict (kind, version, stage, phase, points by
        frequency)."""
        return {"kind": "microbatch_frontier", "version": FRONTIER_VERSION, "stage": self.stage,
                "phase": self.phase,
                "by_freq": {str(f): [{"time_s": p.time_s, "dynamic_energy_j": p.dynamic_energy_j,
                                      "choice": p.choice.to_dict()} for p in pts]
                            for f, pts in self.by_freq.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MicrobatchFrontier:
        """Rebuild from [`to_dict`][kareus.compose.MicrobatchFrontier.to_dict] output (raises PlanError if invalid)."""
        check_kind(d, "microbatch_frontier")
        try:
            by_freq = {int(f): [MicrobatchPoint(time_s=p["time_s"],
                                                dynamic_energy_j=p["dynamic_energy_j"],
                                                choice=MicrobatchChoice.from_dict(p["choice"]))
                                for p in pts] for f, pts in d["by_freq"].items()}
            return cls.from_fronts(int(d["stage"]), str(d["phase"]), by_freq)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed microbatch frontier: {type(exc).__name__}: {exc}"
                            ) from None

    def to_json(self, *, indent: int | None = None) -> str:
        """[`to_dict`][kareus.compose.MicrobatchFrontier.to_dict] as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> MicrobatchFrontier:
        """Rebuild from [`to_json`][kareus.compose.MicrobatchFrontier.to_json] output (raises PlanError if invalid)."""
        return cls.from_dict(loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the frontier as JSON."""
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MicrobatchFrontier:
        """Read a frontier written by [`save`][kareus.compose.MicrobatchFrontier.save] (raises PlanError if invalid)."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def __repr__(self) -> str:
        if not self.points:
            return f"MicrobatchFrontier(stage {self.stage} {self.phase}: empty)"
        fast, slow = self.points[0], self.points[-1]
        npred = sum(p.predicted for p in self.points)
        pred = f", {npred} predicted" if npred else ""
        return (f"MicrobatchFrontier(stage {self.stage} {self.phase}: {len(self.points)} points "
                f"over {len(self.by_freq)} frequencies{pred}; fastest {fast.time_s * 1e3:.3f} ms "
                f"/ {fast.dynamic_energy_j:.2f} J dyn @ {fast.freq_mhz} MHz; lowest energy "
                f"{slow.time_s * 1e3:.3f} ms / {slow.dynamic_energy_j:.2f} J dyn "
                f"@ {slow.freq_mhz} MHz)")

    def plot(self, ax: Any = None, **kwargs: Any) -> Any:
        """Per-frequency fronts in grey and the joint front in colour (needs matplotlib)."""
        import matplotlib.pyplot as plt  # optional dependency

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 4))
        for pts in self.by_freq.values():
            ax.plot([p.time_s * 1e3 for p in pts], [p.dynamic_energy_j for p in pts], ".",
                    color="0.7", ms=3)
        ax.plot([p.time_s * 1e3 for p in self.points],
                [p.dynamic_energy_j for p in self.points], "o-", color="C3", **kwargs)
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("dynamic energy (J, all GPUs of the stage)")
        ax.set_title(f"stage {self.stage} {self.phase}")
        return ax
