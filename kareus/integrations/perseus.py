"""A plan's frequencies in the schedule format of Perseus's frequency server.

Perseus (Chung et al., "Perseus: Reducing Energy Bloat in Large Model Training", SOSP 2024)
ships with Zeus as the *pipeline frequency optimizer*: a server hands every rank of a
training job a frequency schedule, and a client in the training loop
(``zeus.optimizer.pipeline_frequency.PipelineFrequencyOptimizer``) applies it: the training
framework calls ``on_instruction_begin("forward")`` / ``("backward")`` before each
microbatch computation, and the client sets the next frequency of its schedule after checking
the instruction's name.

The format, as Zeus defines it (https://github.com/ml-energy/zeus,
``zeus/optimizer/pipeline_frequency/common.py`` and ``server/scheduler.py``, zeus 0.16):

* A rank's schedule is ``FrequencySchedule(rank, frequencies)`` with ``frequencies`` a list of
  ``(instruction, MHz)`` pairs, one per forward or backward computation of one iteration, in
  the order the rank runs them (``"forward"`` / ``"backward"``). The server stores a round of
  schedules as JSON, a list of ``{"rank": r, "frequencies": [["forward", 1410], ...]}``
  ([`frequency_schedules`][kareus.integrations.perseus.frequency_schedules]).
* The server's ``PointSolution`` scheduler runs one fixed schedule read from a *solution file*
  (its ``solution_path`` argument, a ``.py`` file whose text is one Python literal: a list,
  one entry per rank, of lists of ``(instruction, MHz)`` tuples). ``PointSolution3D`` takes
  one entry per pipeline stage and copies it to every rank of that stage (the ranks report
  their ``pp_rank``). [`write_point_solution`][kareus.integrations.perseus.write_point_solution] writes
  that file: only list, tuple, string and integer literals (the server ``eval``\\ s it; kareus's own
  plans stay JSON).

Mapping a kareus plan: each computation ``(stage s, microbatch m, fwd|bwd)`` runs at the
plan's frequency for it; stage ``s``'s list follows the plan's pipeline schedule
([`get_schedule`][kareus.model.get_schedule]; 1F1B: warm-up forwards, then one forward and
one backward, then the remaining backwards), which must be the order the training framework
runs. Perseus sets only frequencies: the plan's communication SM caps and launch slots need
kareus's executor.

Context parallelism: Zeus knows pipeline, data and tensor parallelism only (its ``JobInfo``
checks ``world_size == pp_degree * dp_degree * tp_degree``). A job with CP > 1 registers
with CP folded into the data-parallel degree: ``dp_degree = cp * dp`` and, for each rank,
``dp_rank = dp_rank * cp + cp_rank``, the rank's position among the copies of its stage's
TP group. The TP degree Zeus sees stays the job's own, and every rank of a stage runs the
stage's schedule whatever its CP or DP rank, so the schedules do not change.
[`optimizer_arguments`][kareus.integrations.perseus.optimizer_arguments] gives each rank the arguments of
Zeus's client so folded.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

from kareus._io import write_text_atomic
from kareus.compose.plan import Plan
from kareus.errors import ArgumentError, ArgumentTypeError, PlanError
from kareus.model import RANK_ORDERS
from kareus.model.pipeline import get_schedule

__all__ = [
    "INSTRUCTIONS",
    "frequency_schedules",
    "optimizer_arguments",
    "rank_schedules",
    "read_point_solution",
    "stage_of_rank",
    "stage_schedules",
    "write_point_solution",
]

INSTRUCTIONS = {"fwd": "forward", "bwd": "backward"}
"""kareus phase -> the instruction name Perseus's client checks."""


def stage_schedules(plan: Plan) -> list[list[tuple[str, int]]]:
    """Per pipeline stage, ``(instruction, MHz)`` of every computation in execution order."""
    if not isinstance(plan, Plan):
        raise ArgumentTypeError(f"plan must be a kareus Plan, got {type(plan).__name__}")
    sched = get_schedule(plan.schedule, plan.num_stages, plan.num_microbatches)
    return [[(INSTRUCTIONS[c.phase], int(plan.freq_mhz(c))) for c in order]
            for order in sched.stage_orders]


def _degrees(plan: Plan, tp: int | None, cp: int | None, dp: int | None) -> tuple[int, int, int]:
    w: dict[str, Any] = plan.workload or {}
    out = []
    for name, given in (("tp", tp), ("cp", cp), ("dp", dp)):
        value = given if given is not None else w.get(name)
        if value is None:
            raise PlanError(f"the plan does not say its {name.upper()} degree (no workload): "
                            f"pass {name}=")
        if int(value) < 1:
            raise ArgumentError(f"{name} must be >= 1, got {value}")
        out.append(int(value))
    return out[0], out[1], out[2]


def stage_of_rank(rank: int, *, tp: int, cp: int = 1, dp: int = 1, pp: int | None = None,
                  rank_order: str = RANK_ORDERS[0]) -> int:
    """The pipeline stage of a global rank under ``rank_order``
    (``kareus.model.RANK_ORDERS``): Megatron-LM's default ``tp-cp-ep-dp-pp``
    (TP varies fastest, PP slowest), or ``tp-cp-ep-pp-dp`` (``--use-tp-pp-dp-mapping``,
    which needs ``pp``)."""
    if rank_order not in RANK_ORDERS:
        raise ArgumentError(f"rank_order must be one of {', '.join(RANK_ORDERS)}, got "
                            f"{rank_order!r:.40}")
    if rank_order == "tp-cp-ep-pp-dp":
        if pp is None:
            raise ArgumentError("stage_of_rank: rank_order 'tp-cp-ep-pp-dp' needs pp=")
        return (rank // (tp * cp)) % pp
    return rank // (tp * cp * dp)


def optimizer_arguments(plan: Plan, rank: int, *, tp: int | None = None,
                        cp: int | None = None, dp: int | None = None) -> dict[str, int]:
    """The arguments of Zeus's ``PipelineFrequencyOptimizer`` for one global rank, CP
    folded into DP.

    Zeus has no context-parallel degree: the job registers with ``dp_degree = cp * dp``,
    and the rank's ``dp_rank`` counts the CP ranks inside each DP rank
    (``dp_rank * cp + cp_rank``), with the ranks laid out in the plan's workload's rank
    order (``Workload.parallelism.rank_order``; Megatron-LM's default ``tp-cp-ep-dp-pp``
    where the plan does not say).
    Pass the result with the rank's ``device_id`` and the server's URL::

        from zeus.optimizer.pipeline_frequency import PipelineFrequencyOptimizer

        pfo = PipelineFrequencyOptimizer(
            **optimizer_arguments(plan, torch.distributed.get_rank()),
            device_id=local_rank, server_url="http://perseus-host:7787")

    Args:
        plan: The plan the server's schedules come from.
        rank: The global rank.
        tp: Tensor-parallel degree; ``None`` = the plan's workload's.
        cp: Context-parallel degree; ``None`` = the plan's workload's.
        dp: Data-parallel degree; ``None`` = the plan's workload's.

    Returns:
        ``rank``, ``dp_rank``, ``pp_rank``, ``tp_rank`` of the rank and the job's
        ``dp_degree``, ``pp_degree``, ``tp_degree`` and ``world_size``, as Zeus names them.

    Raises:
        PlanError: a degree is not given and the plan has no workload.
        ValueError: ``rank`` is outside the job (``0 <= rank < world_size``), or a degree
            is below 1.
    """
    tp_, cp_, dp_ = _degrees(plan, tp, cp, dp)
    world = tp_ * cp_ * dp_ * plan.num_stages
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ArgumentError(f"rank must be an integer in [0, {world}) (TP {tp_} x CP {cp_} x "
                         f"DP {dp_} x PP {plan.num_stages}), got {rank!r}")
    order = str((plan.workload or {}).get("rank_order", RANK_ORDERS[0]))
    pp_rank = stage_of_rank(rank, tp=tp_, cp=cp_, dp=dp_, pp=plan.num_stages, rank_order=order)
    cp_rank = (rank // tp_) % cp_
    dp_rank = (rank // (tp_ * cp_ * (plan.num_stages if order == "tp-cp-ep-pp-dp" else 1))
               ) % dp_
    return {"rank": rank, "dp_rank": dp_rank * cp_ + cp_rank,
            "pp_rank": pp_rank, "tp_rank": rank % tp_,
            "dp_degree": cp_ * dp_, "pp_degree": plan.num_stages, "tp_degree": tp_,
            "world_size": world}


def rank_schedules(plan: Plan, *, tp: int | None = None, cp: int | None = None,
                   dp: int | None = None) -> list[list[tuple[str, int]]]:
    """Per global rank, its stage's schedule (the ranks laid out in the plan's workload's
    rank order, Megatron-LM's default ``tp-cp-ep-dp-pp`` where it does not say).

    Args:
        plan: The plan.
        tp: Tensor-parallel degree; ``None`` = the plan's workload's.
        cp: Context-parallel degree; ``None`` = the plan's workload's.
        dp: Data-parallel degree; ``None`` = the plan's workload's.

    Raises:
        PlanError: a degree is not given and the plan has no workload.
    """
    tp_, cp_, dp_ = _degrees(plan, tp, cp, dp)
    stages = stage_schedules(plan)
    world = tp_ * cp_ * dp_ * plan.num_stages
    order = str((plan.workload or {}).get("rank_order", RANK_ORDERS[0]))
    return [list(stages[stage_of_rank(r, tp=tp_, cp=cp_, dp=dp_, pp=plan.num_stages,
                                      rank_order=order)]) for r in range(world)]


def frequency_schedules(plan: Plan, *, tp: int | None = None, cp: int | None = None,
                        dp: int | None = None) -> list[dict[str, Any]]:
    """The server's JSON form of one round of schedules: ``[{"rank": r, "frequencies":
    [["forward", MHz], ...]}, ...]`` for every global rank."""
    return [{"rank": r, "frequencies": [[name, f] for name, f in sched]}
            for r, sched in enumerate(rank_schedules(plan, tp=tp, cp=cp, dp=dp))]


def _literal(schedules: list[list[tuple[str, int]]]) -> str:
    rows = []
    for sched in schedules:
        rows.append("    [" + ", ".join(f"({name!r}, {int(f)})" for name, f in sched) + "],")
    return "[\n" + "\n".join(rows) + "\n]\n"


def write_point_solution(plan: Plan, path: str | os.PathLike[str], *, per: str = "stage",
                         tp: int | None = None, cp: int | None = None,
                         dp: int | None = None) -> Path:
    """Write the solution file of Perseus's ``PointSolution3D`` (``per="stage"``) or
    ``PointSolution`` (``per="rank"``) scheduler.

    Start the server with the scheduler and ``scheduler_args={"solution_path": path}``.

    Args:
        plan: The plan.
        path: A ``.py`` file (the server refuses other suffixes).
        per: ``"stage"``: one schedule per pipeline stage; ``"rank"``: one per global rank.
        tp: For ``per="rank"``: the tensor-parallel degree; ``None`` = the plan's workload's.
        cp: For ``per="rank"``: the context-parallel degree; ``None`` = the plan's workload's.
        dp: For ``per="rank"``: the data-parallel degree; ``None`` = the plan's workload's.

    Returns:
        The path written (atomically).

    Raises:
        ValueError: ``path`` does not end in ``.py``, or ``per`` is neither value.
    """
    p = Path(path)
    if p.suffix != ".py":
        raise ArgumentError(f"Perseus reads solution files ending in .py, got {str(p)!r}")
    if per == "stage":
        schedules, what = stage_schedules(plan), "pipeline stage (PointSolution3D)"
    elif per == "rank":
        schedules = rank_schedules(plan, tp=tp, cp=cp, dp=dp)
        what = "global rank, Megatron-LM rank order (PointSolution)"
    else:
        raise ArgumentError(f"per must be 'stage' or 'rank', got {per!r}")
    header = (f"# Perseus frequency schedule exported by kareus from plan {plan.digest[:12]} "
              f"({plan.gpu}, {plan.schedule}, {plan.num_stages} stages x "
              f"{plan.num_microbatches} microbatches)\n"
              f"# One list per {what}: (instruction, SM clock MHz) in execution order.\n")
    return write_text_atomic(p, header + _literal(schedules))


def read_point_solution(path: str | os.PathLike[str]) -> list[list[tuple[str, int]]]:
    """Read a solution file back as data (``ast.literal_eval``: nothing is executed).

    Raises:
        ValueError: the file is not one literal list of lists of ``(str, int)`` pairs.
    """
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError) as exc:
        raise ArgumentError(f"{path} is not a Perseus solution literal: {exc}") from None
    ok = isinstance(data, list) and all(
        isinstance(s, list) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                                    and isinstance(x[1], int) for x in s) for s in data)
    if not ok:
        raise ArgumentError(f"{path} is not a list of lists of (instruction, MHz) pairs")
    return data
