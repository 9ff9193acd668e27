"""The frontier of a whole training iteration: Pareto-optimal plans.

An [`IterationFrontier`][kareus.compose.IterationFrontier] holds the Pareto-optimal trade-offs of a
whole training iteration: each point is a [`Plan`][kareus.compose.Plan] with its iteration time
and total energy. Users pick from it with
[`IterationFrontier.select`][kareus.compose.IterationFrontier.select].

Energy scope: iteration energies cover every GPU of the job (dynamic energy plus static
power x iteration time on every GPU). Times are wall times seen by one rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kareus._check import check_number
from kareus._io import write_text_atomic
from kareus.compose._frontier_common import FRONTIER_VERSION, check_kind, loads, pareto_points
from kareus.compose.plan import Plan
from kareus.errors import ArgumentError, InfeasibleError, PlanError
from kareus.search.pareto import hypervolume

__all__ = ["IterationFrontier", "IterationPoint"]

def _points(value: Iterable[IterationPoint]) -> tuple[IterationPoint, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class IterationPoint:
    """One Pareto-optimal iteration plan.

    Attributes:
        time_s: Iteration time (per rank).
        energy_j: Iteration energy over every GPU of the job (dynamic + static).
        plan: The plan that achieves it.
    """

    time_s: float = attrs.field(converter=float)
    energy_j: float = attrs.field(converter=float)
    plan: Plan

    @property
    def dynamic_energy_j(self) -> float:
        """The plan's dynamic energy (the total less static power x time)."""
        return self.plan.dynamic_energy_j


@attrs.frozen(kw_only=True)
class IterationFrontier:
    """The iteration-level time-energy frontier: Pareto-optimal plans, fastest first.

    Attributes:
        points: The Pareto points, by increasing time (and so decreasing energy).
        label: What produced it (e.g. ``"kareus"``, ``"perseus"``).
        stats: Facts about how it was composed (time unit, steps, wall time, ...).
    """

    points: tuple[IterationPoint, ...] = attrs.field(converter=_points)
    label: str = ""
    stats: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        for a, b in zip(self.points, self.points[1:]):
            if not (a.time_s < b.time_s and a.energy_j > b.energy_j):
                raise ArgumentError("IterationFrontier points must be strictly faster-and-costlier "
                                    "in order (a Pareto front sorted by time)")

    @classmethod
    def from_points(cls, points: Iterable[IterationPoint], *, label: str = "",
                    stats: dict[str, Any] | None = None) -> IterationFrontier:
        """Keep the Pareto-optimal points in (time, energy) and sort them by time."""
        pts = pareto_points(points, lambda p: (p.time_s, p.energy_j))
        # Drop exact ties in time or energy that pareto_mask keeps (equal x, equal y only).
        out: list[IterationPoint] = []
        for p in pts:
            if out and (p.time_s <= out[-1].time_s or p.energy_j >= out[-1].energy_j):
                continue
            out.append(p)
        return cls(points=tuple(out), label=label, stats=dict(stats or {}))

    def __len__(self) -> int:
        return len(self.points)

    def __iter__(self) -> Iterator[IterationPoint]:
        return iter(self.points)

    def __getitem__(self, i: int) -> IterationPoint:
        return self.points[i]

    def to_dict(self) -> dict[str, Any]:
        """The frontier as a JSON-ready dict (kind, version, label, stats, every plan)."""
        return {"kind": "iteration_frontier", "version": FRONTIER_VERSION, "label": self.label,
                "stats": self.stats, "plans": [p.plan.to_dict() for p in self.points]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IterationFrontier:
        """Rebuild from [`to_dict`][kareus.compose.IterationFrontier.to_dict] output; every plan is validated (PlanError)."""
        check_kind(d, "iteration_frontier")
        try:
            plans = [Plan.from_dict(p) for p in d["plans"]]
            return cls(points=[IterationPoint(time_s=p.time_s, energy_j=p.energy_j, plan=p)
                               for p in plans], label=str(d.get("label", "")),
                       stats=dict(d.get("stats", {})))
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed iteration frontier: {type(exc).__name__}: {exc}"
                            ) from None

    def to_json(self, *, indent: int | None = None) -> str:
        """[`to_dict`][kareus.compose.IterationFrontier.to_dict] as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> IterationFrontier:
        """Rebuild from [`to_json`][kareus.compose.IterationFrontier.to_json] output (raises PlanError if invalid)."""
        return cls.from_dict(loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the frontier (every plan) as JSON."""
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> IterationFrontier:
        """Read a frontier written by [`save`][kareus.compose.IterationFrontier.save] (raises PlanError if invalid)."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def array(self) -> np.ndarray:
        """``(n, 2)`` array of (time_s, energy_j)."""
        return np.array([(p.time_s, p.energy_j) for p in self.points],
                        dtype=np.float64).reshape(-1, 2)

    def hypervolume(self, ref: Sequence[float]) -> float:
        """Hypervolume of the frontier against a reference point (time_s, energy_j)."""
        return hypervolume(self.array(), ref)

    # -- selection -------------------------------------------------------------------
    def _need_points(self) -> None:
        if not self.points:
            raise InfeasibleError(f"the {self.label or 'iteration'} frontier is empty")

    def max_throughput(self) -> Plan:
        """The fastest plan."""
        self._need_points()
        return self.points[0].plan

    def min_energy(self) -> Plan:
        """The lowest-energy plan."""
        self._need_points()
        return self.points[-1].plan

    def select(self, *, deadline_s: float | None = None,
               energy_budget_j: float | None = None) -> Plan:
        """The best plan under one constraint.

        Args:
            deadline_s: Iteration time limit: returns the lowest-energy plan that meets it.
            energy_budget_j: Iteration energy limit: returns the fastest plan within it.

        Raises:
            ArgumentError: neither or both constraints given, or a limit that is NaN, zero
                or negative (``+inf`` is no limit).
            ArgumentTypeError: a limit that is not a number.
            InfeasibleError: the frontier is empty, or no plan meets the constraint (the
                message gives the closest the frontier can do).
        """
        if (deadline_s is None) == (energy_budget_j is None):
            raise ArgumentError("give exactly one of deadline_s= or energy_budget_j= to "
                                "IterationFrontier.select (max_throughput() and min_energy() "
                                "take none)")
        if deadline_s is not None:
            deadline_s = check_number("deadline_s", deadline_s, positive=True, allow_inf=True)
        if energy_budget_j is not None:
            energy_budget_j = check_number("energy_budget_j", energy_budget_j, positive=True,
                                           allow_inf=True)
        self._need_points()
        if deadline_s is not None:
            ok = [p for p in self.points if p.time_s <= deadline_s]
            if not ok:
                raise InfeasibleError(f"no plan meets the deadline {deadline_s:.6g} s; the fastest "
                                      f"takes {self.points[0].time_s:.6g} s")
            return min(ok, key=lambda p: p.energy_j).plan
        assert energy_budget_j is not None
        ok = [p for p in self.points if p.energy_j <= energy_budget_j]
        if not ok:
            raise InfeasibleError(f"no plan fits the energy budget {energy_budget_j:.6g} J; the "
                                  f"lowest-energy plan uses {self.points[-1].energy_j:.6g} J")
        return min(ok, key=lambda p: p.time_s).plan

    # -- display ---------------------------------------------------------------------
    def __repr__(self) -> str:
        if not self.points:
            return f"IterationFrontier({self.label or ''}: empty)"
        f, e = self.points[0], self.points[-1]
        return (f"IterationFrontier({self.label + ': ' if self.label else ''}{len(self.points)} "
                f"plans; fastest {f.time_s:.4f} s / {f.energy_j:.1f} J; lowest energy "
                f"{e.time_s:.4f} s / {e.energy_j:.1f} J)")

    def summary(self, max_rows: int = 10) -> str:
        """A text table of (a sample of) the frontier's points."""
        lines = [repr(self), f"  {'time (s)':>10} {'energy (J)':>12} {'dynamic (J)':>12}  MHz"]
        n = len(self.points)
        idx = sorted(set(np.linspace(0, n - 1, min(n, max_rows)).round().astype(int).tolist()))
        for i in idx:
            p = self.points[i]
            freqs = sorted({p.plan.choices[j].freq_mhz for j in set(p.plan.assignment.values())})
            lines.append(f"  {p.time_s:10.4f} {p.energy_j:12.1f} {p.dynamic_energy_j:12.1f}  "
                         f"{freqs[0]}-{freqs[-1]}")
        return "\n".join(lines)

    def plot(self, ax: Any = None, **kwargs: Any) -> Any:
        """Draw the frontier as a staircase of points (needs matplotlib)."""
        import matplotlib.pyplot as plt  # optional dependency

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 4))
        a = self.array()
        kwargs.setdefault("label", self.label or None)
        ax.plot(a[:, 0], a[:, 1], "o-", ms=3, **kwargs)
        ax.set_xlabel("iteration time (s)")
        ax.set_ylabel("iteration energy (J, all GPUs)")
        return ax
