"""Building a job's collectives: the backends of its TP and CP groups, or their one-GPU
stand-ins.

[`make_collectives`][kareus.exec.train.make_collectives] builds, per group of more than one
rank, the backend the plan's collectives run on (with exact SM caps) and the one the
baselines' run on (their own CTA count): NCCL communicators capped per SM count, kareus's
own SM-capped kernels, or on one GPU a loopback stand-in, plain
([`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective]) or time-faithful
([`TimedLoopbackGroupCollective`][kareus.exec.train.TimedLoopbackGroupCollective]).
[`named_collectives`][kareus.exec.train.named_collectives] does the same for a plan whose
configurations name their backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kareus.errors import ArgumentError, PlanError
from kareus.exec.train._groups import (
    GroupedCollective,
    LoopbackGroupCollective,
    LoopbackGroups,
    ParallelGroups,
    TorchParallelGroups,
)
from kareus.exec.train._timed import (
    STAND_IN_LABEL,
    CollectiveTimes,
    TimedLoopbackGroupCollective,
)

__all__ = ["BACKENDS", "LOOPBACK_MODES", "faithful_note", "make_collectives",
           "named_collectives"]

#: The one-GPU stand-ins: ``"plain"`` (a kernel of the bytes) and ``"faithful"`` (as long as
#: the real collective, on its SM count).
LOOPBACK_MODES = ("plain", "faithful")


def faithful_note(backends: Iterable[TimedLoopbackGroupCollective | None]) -> str:
    """The line that says what a time-faithful stand-in runs and where its times come
    from (per group and kind)."""
    parts = []
    for b in backends:
        if b is None:
            continue
        srcs = sorted({b.source(k) for k in b.kinds})
        parts.append(f"group of {b.world_size} ({b.backend} kernels): " + "; ".join(srcs))
    return (f"{STAND_IN_LABEL}: one GPU stands in for the group; each collective computes "
            "the loopback's data in a kernel of exactly its SM count that holds those SMs "
            "for the real collective's time at that count and size, alone (no link "
            "traffic; its slow-down beside computation only what its own copy suffers); "
            "the work outside partitions' collectives too, at their uncapped SM count. "
            "Times: " + " | ".join(parts))


#: Backends ``make_collectives`` builds for the plan's collectives.
BACKENDS = ("nccl_capped", "own", "loopback")


def make_collectives(groups: ParallelGroups, *, backend: str = "nccl_capped",
                     caps: tuple[int, ...] = (), high_priority: bool = True,
                     loopback: str = "plain", times: CollectiveTimes | None = None,
                     curves: str = "nccl"
                     ) -> tuple[GroupedCollective | None, GroupedCollective | None, str]:
    """The collectives of a job: ``(capped, default, note)``.

    Args:
        groups: The job's groups ([`TorchParallelGroups`][kareus.exec.train.TorchParallelGroups], or
            [`LoopbackGroups`][kareus.exec.train.LoopbackGroups] with ``backend="loopback"``).
        backend: ``"nccl_capped"`` (NCCL communicators capped at each SM count),
            ``"own"`` (kareus's SM-capped kernels on registered buffers) or
            ``"loopback"`` (one GPU:
            [`LoopbackGroupCollective`][kareus.exec.train.LoopbackGroupCollective]).
        caps: SM counts to create NCCL communicators for up front (every rank, same order).
        high_priority: Capped NCCL communicators on high-priority streams
            ([`NCCLCappedCollective`][kareus.exec.NCCLCappedCollective]); pair it with the
            executor's ``comm_high_priority``.
        loopback: With ``backend="loopback"``: ``"plain"`` (a kernel of the collective's
            bytes, far shorter than the real collective) or ``"faithful"``
            ([`TimedLoopbackGroupCollective`][kareus.exec.train.TimedLoopbackGroupCollective]:
            the same data, holding the collective's SM count for as long as the real
            collective takes, from ``times``; a STAND-IN, said in the note). The groups'
            own collectives (the work outside partitions) then run through the same
            stand-ins ([`LoopbackGroups.run_through`][kareus.exec.train.LoopbackGroups.run_through]).
        times: The collectives' times for ``loopback="faithful"`` (required there).
        curves: Whose collective kernels' times the faithful stand-in takes (``"nccl"``
            or ``"own"``).

    Returns:
        The backend with exact SM caps, the one with the collectives' own CTA count
        ([`ProcessGroupCollective`][kareus.exec.ProcessGroupCollective]; the loopback again on
        one GPU), both ``None`` when TP = CP = 1, and a line saying what runs.
    """
    if backend not in BACKENDS:
        raise ArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
    sizes = {"tp": groups.tp_size, "cp": groups.cp_size}
    if groups.ep_size > 1:  # a mixture of experts' dispatch and combine
        sizes["ep"] = groups.ep_size
    if sizes["tp"] * sizes["cp"] * sizes.get("ep", 1) == 1:
        return None, None, "no collectives (TP = CP = EP = 1)"
    if loopback not in LOOPBACK_MODES:
        raise ArgumentError(f"loopback must be one of {LOOPBACK_MODES}, got {loopback!r}")
    if backend == "loopback":
        if not isinstance(groups, LoopbackGroups):
            raise ArgumentError("the loopback backend goes with LoopbackGroups (one GPU)")
        if loopback == "faithful":
            if times is None:
                raise ArgumentError("loopback='faithful' needs times= (a CollectiveTimes: "
                                    "kareus.profilers.EmulatedCollectiveTimes)")
            timed = {g: (TimedLoopbackGroupCollective(
                group_size=n, times=times, backend=curves,
                kinds=("all_to_all",) if g == "ep" else None) if n > 1 else None)
                for g, n in sizes.items()}
            groups.run_through(dict(timed))  # the outside work's collectives too
            return (GroupedCollective(**timed), GroupedCollective(**timed),
                    faithful_note(timed.values()))
        mk = {g: (LoopbackGroupCollective(group_size=n) if n > 1 else None) for g, n in sizes.items()}
        return (GroupedCollective(**mk), GroupedCollective(**mk),
                "loopback: one GPU stands in for the group (a real kernel of each "
                "collective's bytes on the side stream; no link traffic, SM caps not applied)")
    if not isinstance(groups, TorchParallelGroups):
        raise ArgumentError(f"backend {backend!r} needs TorchParallelGroups")
    from kareus.exec.collectives import (
        NCCLCappedCollective,
        OwnKernelCollective,
        ProcessGroupCollective,
    )

    capped: dict[str, Any] = {}
    default: dict[str, Any] = {}
    for g, n in sizes.items():
        if n == 1:
            capped[g] = default[g] = None
            continue
        pg = groups.group(g)
        default[g] = ProcessGroupCollective(group=pg)
        if backend == "own":
            capped[g] = OwnKernelCollective(group=pg)
        else:
            capped[g] = NCCLCappedCollective(group=pg, high_priority=high_priority)
            for sms in caps:
                capped[g].group_for(sms)
    note = ("OwnKernelCollective (kareus's SM-capped kernels, registered buffers)"
            if backend == "own" else
            "NCCLCappedCollective (min_ctas = max_ctas = the plan's SM count)")
    return GroupedCollective(**capped), GroupedCollective(**default), note


def named_collectives(groups: ParallelGroups, names: Any, *, caps: tuple[int, ...] = (),
                      high_priority: bool = True, loopback: str = "plain",
                      times: CollectiveTimes | None = None) -> dict[str, GroupedCollective]:
    """Collectives for a plan whose configurations name their backend
    (ScheduleConfig.backend (``kareus.model.config.ScheduleConfig.backend``)), for
    [`TorchExecutor`][kareus.exec.TorchExecutor]'s ``backends=``.

    Args:
        groups: The job's groups; with [`LoopbackGroups`][kareus.exec.train.LoopbackGroups] every
            name gets the loopback (one GPU stands in for the group, whatever backend the plan
            chose).
        names: Backend names (of ``BACKENDS`` other than ``"loopback"``).
        caps: SM counts to create NCCL communicators for up front.
        high_priority: As [`make_collectives`][kareus.exec.train.make_collectives]'s.
        loopback: As [`make_collectives`][kareus.exec.train.make_collectives]'s (with
            ``LoopbackGroups``; the faithful stand-in of a name takes that backend's
            collective times: ``"own"`` kareus's kernels', ``"nccl_capped"`` NCCL's).
        times: As [`make_collectives`][kareus.exec.train.make_collectives]'s.

    Raises:
        ValueError: a name this loop cannot build.
    """
    out: dict[str, GroupedCollective] = {}
    for name in sorted(set(names)):
        if name not in BACKENDS or name == "loopback":
            raise PlanError(f"the plan names collective backend {name!r}; the training loop "
                            f"builds {[b for b in BACKENDS if b != 'loopback']}: make the "
                            "plan with those")
        kind = "loopback" if isinstance(groups, LoopbackGroups) else name
        capped, _, _ = make_collectives(groups, backend=kind, caps=caps,
                                        high_priority=high_priority, loopback=loopback,
                                        times=times,
                                        curves="own" if name == "own" else "nccl")
        if capped is not None:
            out[name] = capped
    return out
