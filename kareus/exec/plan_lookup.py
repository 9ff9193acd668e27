"""How an executor reads a plan: the key of a microbatch computation, and what the plan
gives it.

A [`kareus.compose.Plan`][kareus.compose.Plan] sets a frequency per microbatch computation and a
configuration per partition type inside it, keyed ``"s{stage}.m{microbatch}.{phase}"``
(``computation_key``), and the nanobatches each computation splits its microbatch into
(1: unsplit, running the partition types of ``workload.with_(nanobatches=1)``).
``plan_config``, ``plan_frequency`` and ``plan_nanobatches`` look them up and
turn a missing entry into a [`PlanError`][kareus.errors.PlanError] that says what to do; every
executor ([`TorchExecutor`][kareus.exec.TorchExecutor], the recording fake of
``kareus.testing``) and the training loop read plans through them.
"""

from __future__ import annotations

from kareus.compose import Plan
from kareus.errors import ArgumentTypeError, PlanError
from kareus.model.config import ScheduleConfig

__all__ = ["ComputationId", "computation_key", "plan_config", "plan_frequency",
           "plan_nanobatches"]

#: A microbatch computation: ``(stage, microbatch, phase)`` with phase ``"fwd"``/``"bwd"``.
ComputationId = tuple[int, int, str]


def computation_key(stage: int, microbatch: int, phase: str) -> str:
    """The key a [`Plan`][kareus.compose.Plan] gives a microbatch computation.

    Args:
        stage: Pipeline stage.
        microbatch: Microbatch index.
        phase: ``"fwd"`` or ``"bwd"``.

    Returns:
        ``"s{stage}.m{microbatch}.{phase}"``.
    """
    return f"s{stage}.m{microbatch}.{phase}"


def _require_plan(plan: object) -> Plan:
    if not isinstance(plan, Plan):
        raise ArgumentTypeError(f"plan must be a kareus.compose.Plan (load one with "
                                f"Plan.load(path)), got {type(plan).__name__}")
    return plan


def plan_config(plan: Plan, partition_type: str,
                computation: ComputationId | None) -> ScheduleConfig:
    """The configuration ``plan`` gives partition type ``partition_type`` in a computation.

    Args:
        plan: The plan.
        partition_type: The partition type (e.g. ``"fwd_attn"``).
        computation: ``(stage, microbatch, phase)`` of the microbatch computation the
            partition runs in (a plan sets configurations per computation).

    Raises:
        TypeError: ``plan`` is not a [`Plan`][kareus.compose.Plan].
        PlanError: no computation is given, or the plan has no configuration for the
            partition type there.
    """
    _require_plan(plan)
    if computation is None:
        raise PlanError("this plan sets configurations per microbatch computation: run "
                        "partitions inside executor.microbatch(stage, microbatch, phase)")
    key = computation_key(*computation)
    try:
        return plan.config(key, partition_type)
    except KeyError:
        raise PlanError(f"the plan has no configuration for partition type "
                        f"{partition_type!r} in computation {key}") from None


def plan_frequency(plan: Plan, stage: int, microbatch: int, phase: str) -> int:
    """The SM clock ``plan`` gives one microbatch computation.

    Args:
        plan: The plan.
        stage: Pipeline stage.
        microbatch: Microbatch index.
        phase: ``"fwd"`` or ``"bwd"``.

    Raises:
        TypeError: ``plan`` is not a [`Plan`][kareus.compose.Plan].
        PlanError: the plan has no such computation.
    """
    return int(_require_plan(plan).freq_mhz(computation_key(stage, microbatch, phase)))


def plan_nanobatches(plan: Plan, stage: int, microbatch: int, phase: str) -> int:
    """The nanobatches ``plan`` splits one microbatch computation into (1: unsplit).

    A computation's partition types (what ``plan_config`` is asked for) are those of
    the workload split in this many nanobatches. A plan file written before choices
    recorded the count runs the workload's count.

    Args:
        plan: The plan.
        stage: Pipeline stage.
        microbatch: Microbatch index.
        phase: ``"fwd"`` or ``"bwd"``.

    Raises:
        TypeError: ``plan`` is not a [`Plan`][kareus.compose.Plan].
        PlanError: the plan has no such computation, or gives no count for it (a choice
            without one in a plan without a workload).
    """
    return int(_require_plan(plan).nanobatches(computation_key(stage, microbatch, phase)))
