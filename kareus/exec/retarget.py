"""Moving a running job along its iteration frontier: a new deadline, energy budget or straggler.

A plan is one point of kareus's iteration frontier
([`IterationFrontier`][kareus.compose.IterationFrontier], written beside ``plan.json`` as
``frontier.json`` by ``kareus optimize``). Every point is a whole plan, composed and
checked when the frontier was made, so a job that must speed up or slow down (a new
deadline, a site power cap read as an energy budget per iteration, a straggling stage)
moves to another point without searching again:
[`FrontierSwitch`][kareus.exec.retarget.FrontierSwitch] picks the point, every rank the same
(decided on rank 0, broadcast over the default process group), and hands out one
[`Executor`][kareus.exec.Executor] per point, built once and kept: an executor keeps the
CUDA graphs it captured under its plan, so switching back to a point used before replays
its graphs instead of capturing them again. The owner (the library's
[`TrainingLoop.retarget`][kareus.exec.train.TrainingLoop.retarget], the integrations'
``PlanApplier.retarget``) applies the switch at the next iteration boundary.

**Which point.** ``deadline_s``: the lowest-energy point whose iteration time is at most
the deadline. ``energy_budget_j``: the fastest point whose iteration energy (every GPU of
the job) is at most the budget. ``stage_slowdown``: the straggler case, handled as Perseus
does (Chung et al., "Perseus: Removing Energy Bloat from Large Model Training", SOSP 2024):
when one pipeline stage runs ``s`` times slower than planned, the iteration cannot finish
before ``s`` x the fastest point's time, so the other stages gain nothing by running fast
and slow their clocks to the straggler's pace: the lowest-energy point that finishes within
``max(s)`` x the fastest time. With one pipeline stage (PP = 1: the library's loop) the
straggler is outside the stage (a slow data-parallel replica, a throttled GPU elsewhere in
the job), and the stage's whole iteration takes the straggler's pace. With PP > 1 the
frontier's points are whole-job plans, not per-stage ones, so slowing only the stages off
the critical path needs per-stage frontiers that the plan does not carry: a slowdown that
is not the same on every stage is refused (give ``deadline_s`` instead).

Frequency: each point's plan requests its clocks through the executor's
[`FrequencyTrigger`][kareus.exec.FrequencyTrigger]; with a
[`DryRunFrequencyController`][kareus.exec.DryRunFrequencyController] (the only one allowed on
shared or lent GPUs) everything but the clock change itself runs and the requests are
recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kareus._check import check_number
from kareus.compose import IterationFrontier, Plan
from kareus.errors import ArgumentError, ArgumentTypeError, PlanError
from kareus.exec.executor import Executor

__all__ = ["FrontierSwitch", "Target", "broadcast_from_rank0"]


def _slowdowns(value: Mapping[int, float] | Sequence[float] | None
               ) -> tuple[tuple[int, float], ...] | None:
    if value is None:
        return None
    items = value.items() if isinstance(value, Mapping) else enumerate(value)
    out = []
    for stage, s in items:
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise ArgumentError(f"stage_slowdown: stage must be a whole number >= 0, got "
                                f"{stage!r:.40}")
        s = check_number(f"stage_slowdown[{stage}]", s, positive=True)
        if s < 1.0:
            raise ArgumentError(f"stage_slowdown[{stage}] must be >= 1 (how many times slower "
                                f"the stage runs than planned), got {s:g}")
        out.append((stage, float(s)))
    if not out:
        raise ArgumentError("stage_slowdown is empty: give {stage: factor} for the straggler")
    return tuple(sorted(out))


@attrs.frozen(kw_only=True)
class Target:
    """What a running job must meet: exactly one of a deadline, an energy budget or the
    stages' slowdowns.

    Attributes:
        deadline_s: Iteration time limit (s).
        energy_budget_j: Iteration energy limit (J, every GPU of the job).
        stage_slowdown: ``(stage, factor)`` pairs, each factor >= 1: the stage runs that
            many times slower than planned (a straggler). Build from a dict or a sequence
            (one factor per stage).
    """

    deadline_s: float | None = None
    energy_budget_j: float | None = None
    stage_slowdown: tuple[tuple[int, float], ...] | None = attrs.field(
        default=None, converter=_slowdowns)

    def __attrs_post_init__(self) -> None:
        given = [n for n in ("deadline_s", "energy_budget_j", "stage_slowdown")
                 if getattr(self, n) is not None]
        if len(given) != 1:
            raise ArgumentError("retarget takes exactly one of deadline_s=, energy_budget_j= "
                                f"or stage_slowdown= (got {', '.join(given) or 'none'})")
        if self.deadline_s is not None:
            object.__setattr__(self, "deadline_s", check_number(
                "deadline_s", self.deadline_s, positive=True, allow_inf=True))
        if self.energy_budget_j is not None:
            object.__setattr__(self, "energy_budget_j", check_number(
                "energy_budget_j", self.energy_budget_j, positive=True, allow_inf=True))

    def index(self, frontier: IterationFrontier, *, stages: int = 1) -> int:
        """The index of the frontier point that meets this target.

        Args:
            frontier: The iteration frontier (fastest first).
            stages: The job's pipeline stages (a slowdown that differs between stages of a
                PP > 1 job is refused).

        Raises:
            InfeasibleError: no point meets the target (the message says the closest).
            ArgumentError: a stage out of range, or a per-stage slowdown with PP > 1.
        """
        if self.stage_slowdown is not None:
            factors = dict(self.stage_slowdown)
            bad = [s for s in factors if s >= stages]
            if bad:
                raise ArgumentError(f"stage_slowdown names stage(s) {bad}; the job has "
                                    f"{stages} pipeline stage(s) (0 .. {stages - 1})")
            if stages > 1 and (len(factors) < stages or len(set(factors.values())) > 1):
                raise ArgumentError(
                    "stage_slowdown that differs between pipeline stages needs per-stage "
                    "frontiers, which the plan does not carry (its points are whole-job "
                    "plans): give deadline_s= (the straggler's iteration time) instead")
            if not len(frontier):
                frontier.max_throughput()  # the frontier's own InfeasibleError
            deadline = max(factors.values()) * frontier.points[0].time_s * (1 + 1e-12)
            plan = frontier.select(deadline_s=deadline)
        else:
            plan = frontier.select(deadline_s=self.deadline_s,
                                   energy_budget_j=self.energy_budget_j)
        return next(i for i, p in enumerate(frontier.points) if p.plan is plan)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the slowdowns as ``{stage: factor}``)."""
        return {"deadline_s": self.deadline_s, "energy_budget_j": self.energy_budget_j,
                "stage_slowdown": (None if self.stage_slowdown is None
                                   else {str(k): v for k, v in self.stage_slowdown})}


def broadcast_from_rank0(value: int) -> int:
    """``value`` as rank 0 has it, on every rank of torch's default process group (the
    value itself without one, or in a world of one)."""
    try:
        import torch.distributed as dist
    except ImportError:  # no torch: one process
        return int(value)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(value)
    box = [int(value)]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


class FrontierSwitch:
    """The points of an iteration frontier a job may run, and the executor of each.

    Args:
        frontier: The iteration frontier (``kareus optimize``'s ``frontier.json``:
            [`IterationFrontier.load`][kareus.compose.IterationFrontier.load]).
        current: The executor applying the plan the job runs now (its plan need not be a
            point of ``frontier``; it is kept, under its digest, for a switch back).
        make_executor: ``plan -> Executor`` for a point not used before (built once per
            point, then kept).
        check: Called with each new point's plan before its executor is built (the owner
            refuses a plan its job cannot run, in one line).
        decide: ``index -> the index every rank uses``; ``None``:
            [`broadcast_from_rank0`][kareus.exec.retarget.broadcast_from_rank0] (rank 0
            decides, every rank of the default process group follows).

    Attributes:
        built: Executors built for new points so far.
        history: ``(target, index, digest)`` of every switch decided, in order.
    """

    def __init__(self, frontier: IterationFrontier, *, current: Executor,
                 make_executor: Callable[[Plan], Executor],
                 check: Callable[[Plan], None] | None = None,
                 decide: Callable[[int], int] | None = None) -> None:
        if not isinstance(current, Executor) or current.plan is None:
            raise ArgumentTypeError("current must be the Executor applying the job's plan")
        self.frontier = self._checked(frontier)
        self._make = make_executor
        self._check = check
        self._decide = decide or broadcast_from_rank0
        self._executors: dict[str, Executor] = {str(current.plan.digest): current}
        self.built = 0
        self.history: list[tuple[Target, int, str]] = []

    @staticmethod
    def _checked(frontier: IterationFrontier) -> IterationFrontier:
        if not isinstance(frontier, IterationFrontier):
            raise ArgumentTypeError(f"frontier must be a kareus.compose.IterationFrontier "
                                    f"(IterationFrontier.load of frontier.json), got "
                                    f"{type(frontier).__name__}")
        digests = {p.plan.digest for p in frontier.points}
        if len(digests) != len(frontier.points):
            raise PlanError("the frontier holds the same plan twice: load it from "
                            "kareus optimize's frontier.json")
        return frontier

    def use(self, frontier: IterationFrontier) -> None:
        """Choose from ``frontier`` from now on (a frontier loaded again, or a new one);
        the executors built so far are kept, so a point used before keeps its graphs."""
        self.frontier = self._checked(frontier)

    def choose(self, target: Target, *, stages: int = 1) -> Plan:
        """The point meeting ``target``, the same on every rank (decided on rank 0).

        Rank 0's index is broadcast: every rank must call this at the same place. A
        rank other than 0 still checks the target (a bad argument fails on every rank
        alike) but takes rank 0's point.

        Raises:
            InfeasibleError: no point meets the target (on rank 0; the other ranks then
                fail at the broadcast too, or hang: call it where every rank gets the same
                target).
        """
        index = self._decide(target.index(self.frontier, stages=stages))
        if not 0 <= index < len(self.frontier):
            raise PlanError(f"rank 0 chose frontier point {index}, this rank's frontier has "
                            f"{len(self.frontier)}: every rank must load the same frontier")
        plan = self.frontier.points[index].plan
        self.history.append((target, index, str(plan.digest)))
        return plan

    def executor(self, plan: Plan) -> Executor:
        """The executor of ``plan``: the one kept for it, else one built (once)."""
        key = str(plan.digest)
        ex = self._executors.get(key)
        if ex is None:
            if self._check is not None:
                self._check(plan)
            ex = self._make(plan)
            if not isinstance(ex, Executor) or ex.plan is None or \
                    str(ex.plan.digest) != key:
                raise ArgumentTypeError("make_executor must return an Executor applying the "
                                        "plan it was given")
            self._executors[key] = ex
            self.built += 1
        return ex

    @property
    def executors(self) -> dict[str, Executor]:
        """Digest -> executor, for every point used so far (and the starting plan)."""
        return dict(self._executors)
