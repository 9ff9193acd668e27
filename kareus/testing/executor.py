"""Fakes and the conformance suite of the Executor role.

* [`RecordingExecutor`][kareus.testing.RecordingExecutor] - an [`Executor`][kareus.exec.Executor]
  without a device: it runs the ops it is given (so the caller's code runs) and records, in order,
  what a real executor would have done: digests compared, clock requests, partitions
  with their configurations, collectives with their SM count and launch point. Use it to
  test code that drives an executor (a training loop, a runner) on any CPU.
* [`RecordingCollective`][kareus.testing.RecordingCollective] - a
  [`CollectiveBackend`][kareus.exec.CollectiveBackend] that records each call (and, given a
  [`RecordingStreamBackend`][kareus.exec.RecordingStreamBackend], logs it as launched on the
  stream it was given), for executors on a fake device.
* [`RecordingTrigger`][kareus.testing.RecordingTrigger] - a
  [`FrequencyTrigger`][kareus.exec.FrequencyTrigger] that records each clock request with the stream
  it was made on.
* [`check_executor`][kareus.testing.check_executor], ``EXECUTOR_CHECKS`` and the pytest mix-in
  [`ExecutorConformance`][kareus.testing.ExecutorConformance] - conformance checks for any executor,
  made by a factory ``make(plan) -> Executor`` whose executor runs without a GPU (or on one):
  what the training loop and the partition runner rely on. Every op runs once, in order; the
  role's rules hold (an unknown slot, one nanobatch, a partition before ``start`` under a plan,
  an op out of order, a bad kind); the hooks are called in stream order (the collective right
  before its slot's op with the configuration's SM count, then joined; the plan's clock once per
  microbatch computation); a new plan needs ``start`` again; ``graphs`` tells the truth about
  ``capture``; ``empty`` gives zeroed buffers of the shape and dtype asked for.

This module imports neither pytest nor any hardware library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

from kareus.compose import MicrobatchChoice, Plan
from kareus.errors import (
    ArgumentTypeError,
    ConfigError,
    GraphCaptureError,
    PlanError,
    UnknownSlotError,
)
from kareus.exec.collectives import CollectiveBackend
from kareus.exec.executor import (
    COMM_KINDS,
    CollectiveLaunch,
    Executor,
    LaunchConfig,
    PartitionHook,
    PartitionScope,
    RecordingStreamBackend,
)
from kareus.exec.frequency import FrequencyTrigger
from kareus.model.config import ScheduleConfig
from kareus.testing._suite import _add_tests, _run_checks

__all__ = [
    "EXECUTOR_CHECKS",
    "ExecutorConformance",
    "RecordingCollective",
    "RecordingExecutor",
    "RecordingTrigger",
    "check_executor",
    "make_test_plan",
    "make_workload_plan",
]


# ------------------------------------------------------------------------ fakes


class RecordingCollective(CollectiveBackend):
    """A collective backend that records each call instead of communicating.

    Args:
        streams: When given, each call is also logged on it as launched on the stream
            the call was given (``"all_reduce(x)"``, ``"all_gather(x->y)"``, ...), so
            ordering questions can be asked of the stream log.
        world_size: Ranks the fake group has.
        sm_count: SMs of the fake GPU.
        name: Prefix of the stream-log entries (``"{name}[{sms}]:"`` when not empty).

    Attributes:
        calls: ``(op, tensor or input, sms)`` of every call, in order.
        splits: ``(output_splits, input_splits)`` of every all-to-all, in order.
    """

    name: ClassVar[str] = "recording"

    def __init__(self, *, streams: RecordingStreamBackend | None = None, world_size: int = 2,
                 sm_count: int = 132, name: str = "") -> None:
        self._streams = streams
        self._world = int(world_size)
        self._sm_count = int(sm_count)
        self._prefix = name
        self.calls: list[tuple[str, Any, int | None]] = []
        self.splits: list[tuple[list[int], list[int]]] = []

    @property
    def world_size(self) -> int:
        """Ranks in the fake group."""
        return self._world

    @property
    def rank(self) -> int:
        """Always rank 0."""
        return 0

    @property
    def sm_count(self) -> int:
        """SMs of the fake GPU."""
        return self._sm_count

    def _log(self, what: str, stream: Any, sms: int | None) -> None:
        if self._streams is not None:
            prefix = f"{self._prefix}[{sms}]:" if self._prefix else ""
            self._streams.launch(prefix + what, stream)

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        """Records an all-reduce of ``tensor``; returns ``tensor``."""
        self.calls.append(("all_reduce", tensor, sms))
        self._log(f"all_reduce({tensor})", stream, sms)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Records an all-gather of ``input`` into ``output``; returns ``output``."""
        self.calls.append(("all_gather", input, sms))
        self._log(f"all_gather({input}->{output})", stream, sms)
        return output

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        """Records a reduce-scatter of ``input`` into ``output``; returns ``output``."""
        self.calls.append(("reduce_scatter", input, sms))
        self._log(f"reduce_scatter({input}->{output})", stream, sms)
        return output

    def all_to_all(self, output: Any, input: Any, output_splits: Any, input_splits: Any,
                   stream: Any, sms: int | None) -> Any:
        """Records an all-to-all of ``input`` into ``output`` and its splits (one entry per
        rank of the fake group, else ``CollectiveArgumentError``); returns ``output``."""
        from kareus.exec.collectives import CollectiveArgumentError

        for what, sp in (("output_splits", output_splits), ("input_splits", input_splits)):
            if len(sp) != self._world:
                raise CollectiveArgumentError(f"all_to_all: {what} must list one row count "
                                              f"per rank ({self._world}), got {len(sp)}")
        self.calls.append(("all_to_all", input, sms))
        self.splits.append((list(output_splits), list(input_splits)))
        self._log(f"all_to_all({input}->{output})", stream, sms)
        return output


class RecordingTrigger(FrequencyTrigger):
    """A frequency trigger that records each request instead of changing a clock.

    Attributes:
        requests: ``(freq_mhz, stream)`` of every request, in order.
    """

    def __init__(self) -> None:
        self.requests: list[tuple[int, Any]] = []

    def request(self, freq_mhz: int, *, stream: Any = None) -> int:
        """Records the request; returns its token (1, 2, ...)."""
        self.requests.append((int(freq_mhz), stream))
        return len(self.requests)

    @property
    def freqs_mhz(self) -> list[int]:
        """The requested clocks, in order."""
        return [f for f, _ in self.requests]


class _RecordingScope(PartitionScope):
    """The scope [`RecordingExecutor.partition`][kareus.testing.RecordingExecutor.partition] yields: the role's
    scope, recording each ``communicate``."""

    _ex: RecordingExecutor

    def communicate(self, tensor: Any, *, kind: str = "all_reduce", output: Any = None,
                    group: str | None = None, splits: Any = None) -> None:
        """Registers the partition's collective (launched at the configured slot); records it."""
        super().communicate(tensor, kind=kind, output=output, group=group, splits=splits)
        self._ex.log.append(("communicate", self.key, kind))


class RecordingExecutor(Executor):
    """An executor without a device: runs the ops, records what would have been launched.

    Built on the role's template, as [`TorchExecutor`][kareus.exec.TorchExecutor] is (the same
    plan lookups, slot state machine, op-order checks and errors), so that code tested against
    it runs the same against the real one; its hooks record instead of launching.

    Args:
        plan: The plan to apply, or ``None``.
        digest_exchange: ``digest -> every rank's digest`` (default: this rank alone).

    Attributes:
        log: What happened, in order: ``("start", digest)``, ``("microbatch", stage,
            microbatch, phase, freq_mhz)`` (``freq_mhz`` ``None`` without a plan),
            ``("partition", key, config)``, ``("communicate", key, kind)``, ``("op", key,
            name)``, ``("collective", key, kind, comm_sms, launch_slot)`` at the point
            the collective is launched (``launch_slot`` ``None``: after the ops) and
            ``("join", key)`` where what follows waits for it.
    """

    def __init__(self, *, plan: Plan | None = None,
                 digest_exchange: Callable[[str], Sequence[str]] | None = None) -> None:
        if plan is not None and not isinstance(plan, Plan):
            raise ArgumentTypeError(f"plan must be a kareus.compose.Plan, got "
                                    f"{type(plan).__name__}")
        super().__init__(plan=plan, digest_exchange=digest_exchange or (lambda d: [d]))
        self.log: list[tuple[Any, ...]] = []

    # -- the role's hooks: record ----------------------------------------------------
    def launch_collective(self, launch: CollectiveLaunch) -> str:
        """Records ``("collective", partition, kind, comm_sms, slot)``; the handle is the
        partition's key."""
        self.log.append(("collective", launch.partition, launch.kind, launch.sms, launch.slot))
        return launch.partition

    def join_collective(self, handle: Any) -> None:
        """Records ``("join", partition)``."""
        self.log.append(("join", handle))

    def request_clock(self, freq_mhz: int) -> None:
        """Records ``("microbatch", stage, microbatch, phase, freq_mhz)``."""
        assert self.current is not None
        self.log.append(("microbatch", *self.current, freq_mhz))

    def launch_op(self, partition: str, name: str, fn: Callable[..., Any], /,
                  *args: Any, **kwargs: Any) -> Any:
        """Records ``("op", partition, name)`` and runs the op."""
        self.log.append(("op", partition, name))
        return fn(*args, **kwargs)

    # -- what the role runs, recorded ------------------------------------------------
    def start(self) -> None:
        """Compares the plan's digest over the (fake) ranks; records it."""
        super().start()
        if self.plan is not None:
            self.log.append(("start", str(self.plan.digest)))

    def _open_scope(self, key: str, config: LaunchConfig,
                    op_names: Sequence[str] | None) -> PartitionScope:
        """The role's scope of one partition (recording each ``communicate``); records
        ``("partition", key, config)``."""
        self.log.append(("partition", key, config))
        return _RecordingScope(self, key, config, op_names)

    @contextlib.contextmanager
    def microbatch(self, stage: int, microbatch: int, phase: str) -> Iterator[None]:
        """The role's scope of one microbatch computation; without a plan (no clock to
        request) records it with ``freq_mhz`` ``None``."""
        with super().microbatch(stage, microbatch, phase):
            if self.plan is None:
                self.log.append(("microbatch", stage, microbatch, phase, None))
            yield None

    def entries(self, kind: str) -> list[tuple[Any, ...]]:
        """The log entries of one kind (``"op"``, ``"collective"``, ...), without the kind."""
        return [e[1:] for e in self.log if e[0] == kind]


# ------------------------------------------------------------------ conformance


#: The op names of the conformance checks' partition.
OPS = ("attn_norm", "qkv", "rope", "attn_core", "out_proj")


def make_test_plan(*, freqs_mhz: Sequence[int] = (1980, 1410),
                   slots: Sequence[str | None] = ("qkv", None),
                   sms: Sequence[int] = (16, 4)) -> Plan:
    """A small valid plan for one stage and two forward microbatches of ``fwd_attn``.

    Microbatch ``i`` runs at ``freqs_mhz[i]`` with ``sms[i]`` SMs launched at ``slots[i]``
    (ops ``OPS``); the plan is for an ``h200-sxm``.
    """
    choices = [MicrobatchChoice(freq_mhz=f, configs={"fwd_attn": ScheduleConfig(f, s, slot)})
               for f, slot, s in zip(freqs_mhz, slots, sms)]
    return Plan(gpu="h200-sxm", num_stages=1, num_microbatches=len(choices), choices=choices,
                assignment={f"s0.m{i}.fwd": i for i in range(len(choices))}, time_s=1.0,
                energy_j=1.0, dynamic_energy_j=0.5, static_power_w=100.0)


def make_workload_plan(workload: Any, *, pick: int = 1, sms: int = 8,
                       freqs_mhz: Sequence[int] = (1980,),
                       unsplit_microbatches: Sequence[int] = (),
                       backend: str | None = None) -> Plan:
    """A valid plan for every microbatch computation of ``workload`` (1F1B over its PP
    stages), without searching: for a test of code that applies plans (a training loop, a
    framework adapter) on any CPU.

    Every partition type launches its collective at its slot number ``pick`` (clipped to
    its last) with ``sms`` SMs; microbatch ``m`` runs at ``freqs_mhz[m % len(freqs_mhz)]``;
    the microbatches in ``unsplit_microbatches`` run unsplit (the partition types of
    ``workload.with_(nanobatches=1)``), the others in the workload's nanobatches. Its
    time and energy figures are placeholders (1 s; 0.5 J dynamic, 100 W static, so 100.5 J
    in all: consistent, so the plan saves and loads), not a prediction.

    Raises:
        WorkloadError: the workload has no collective (TP = CP = 1).
    """
    from kareus.model.partition import build_partitions
    from kareus.model.pipeline import get_schedule

    def configs(wl: Any, freq: int, phase: str) -> dict[str, ScheduleConfig]:
        """Every partition type a ``phase`` computation of ``wl`` runs (a plan's choice
        names exactly those)."""
        pset = build_partitions(wl)
        out = {}
        for name in sorted(pset.counts[phase]):
            slots = [s.name for s in pset.types[name].slots]
            slot = slots[min(pick, len(slots) - 1)] if slots else None  # unsplit: after
            out[name] = ScheduleConfig(freq, sms, slot, backend=backend)
        return out

    freqs = [int(f) for f in freqs_mhz]
    unsplit = {int(m) for m in unsplit_microbatches}
    whole = workload.with_(nanobatches=1) if unsplit else workload
    stages = workload.parallelism.pp
    comps = [c for order in get_schedule("1f1b", stages, workload.num_microbatches).stage_orders
             for c in order]
    # one choice per (clock, split, phase) that some computation runs, in first-use order
    index: dict[tuple[int, bool, str], int] = {}
    choices: list[MicrobatchChoice] = []
    assignment = {}
    for c in comps:
        key = (freqs[c.microbatch % len(freqs)], c.microbatch in unsplit, c.phase)
        if key not in index:
            f, whole_mb, phase = key
            wl = whole if whole_mb else workload
            index[key] = len(choices)
            choices.append(MicrobatchChoice(freq_mhz=f, configs=configs(wl, f, phase),
                                            nanobatches=wl.nanobatches))
        assignment[c.key()] = index[key]
    return Plan(gpu="h200-sxm", num_stages=stages, num_microbatches=workload.num_microbatches,
                choices=choices, assignment=assignment, time_s=1.0, energy_j=100.5,
                dynamic_energy_j=0.5, static_power_w=100.0, workload=workload.to_dict())


def _recorder(calls: list[str], name: str) -> Callable[..., str]:
    def op(*args: Any) -> str:
        calls.append(name if not args else f"{name}[{args[0]}]")
        return name
    return op


def _check_type(make: Callable[[Plan | None], Executor]) -> None:
    ex = make(None)
    assert isinstance(ex, Executor), f"factory returned {type(ex).__name__}, not an Executor"
    assert ex.plan is None, "an executor made without a plan must have plan None"
    assert ex.current is None, "current must be None outside microbatch()"


def _check_run_partition(make: Callable[[Plan | None], Executor]) -> None:
    for slot in (*OPS, None):
        ex = make(None)
        calls: list[str] = []
        ex.run_partition([_recorder(calls, o) for o in OPS], OPS, "buf",
                         ScheduleConfig(1980, 8, slot))
        assert calls == list(OPS), f"slot {slot}: ops must run once each, in order; got {calls}"
    ex = make(None)
    try:
        ex.run_partition([_recorder([], o) for o in OPS], OPS, "b", ScheduleConfig(1980, 8, "x"))
    except UnknownSlotError:
        pass
    else:
        raise AssertionError("an unknown launch slot must raise UnknownSlotError")


def _check_run_nanobatched(make: Callable[[Plan | None], Executor]) -> None:
    for slot in ("rope", None):
        ex = make(None)
        calls: list[str] = []
        ex.run_nanobatched([_recorder(calls, o) for o in OPS], OPS, ["y0", "y1", "y2"],
                           ScheduleConfig(1980, 16, slot))
        want = [f"{o}[{i}]" for i in range(3) for o in OPS]
        assert calls == want, f"slot {slot}: every op of every nanobatch, in order; got {calls}"
    try:
        make(None).run_nanobatched([_recorder([], o) for o in OPS], OPS, ["y0"],
                                   ScheduleConfig(1980, 16, "rope"))
    except ValueError:
        pass
    else:
        raise AssertionError("run_nanobatched with one nanobatch must raise ValueError")


def _check_hooks_follow_the_plan(make: Callable[[Plan | None], Executor]) -> None:
    plan = make_test_plan()
    ex = make(plan)
    assert ex.plan is plan, "the executor must keep the plan it was given"
    try:
        with ex.partition("fwd_attn"):
            pass
    except PlanError:
        pass
    else:
        raise AssertionError("a partition under a plan before start() must raise PlanError")
    ex.start()
    for mb in (0, 1):
        calls: list[str] = []
        with ex.microbatch(0, mb, "fwd"):
            assert ex.current == (0, mb, "fwd"), "current must name the computation"
            with ex.partition("fwd_attn", op_names=OPS) as part:
                assert isinstance(part, PartitionHook), "partition() must yield a PartitionHook"
                assert part.config == plan.config(f"s0.m{mb}.fwd", "fwd_attn"), \
                    "the scope must carry the plan's configuration of this computation"
                part.communicate(f"x{mb}")
                got = [part.op(o, _recorder(calls, o)) for o in OPS]
        assert got == list(OPS), "op() must return what the op returns"
        assert calls == list(OPS), f"ops must run once each, in order; got {calls}"
        assert ex.current is None, "current must be restored after microbatch()"
    try:
        with ex.microbatch(0, 0, "sideways"):
            pass
    except ValueError:
        pass
    else:
        raise AssertionError("a phase other than 'fwd'/'bwd' must raise ValueError")


def _check_scope_rules(make: Callable[[Plan | None], Executor]) -> None:
    ex = make(None)
    try:
        with ex.partition("fwd_attn"):
            pass
    except PlanError:
        pass
    else:
        raise AssertionError("a partition with neither plan nor config must raise PlanError")
    try:
        with ex.partition("fwd_attn", config=ScheduleConfig(1980, 8, "qkv"),
                          op_names=OPS) as part:
            part.communicate("x")
            part.op("qkv", _recorder([], "qkv"))
    except ConfigError:
        pass
    else:
        raise AssertionError("an op out of the declared order must raise ConfigError")
    try:
        ex.run_partition([_recorder([], "qkv")], OPS, "b", ScheduleConfig(1980, 8, None))
    except ValueError:
        pass
    else:
        raise AssertionError("run_partition with fewer ops than names must raise ValueError")
    try:
        with ex.partition("fwd_attn", config=ScheduleConfig(1980, 8, None)) as part:
            part.communicate("x", kind="broadcast")
    except ValueError:
        pass
    else:
        raise AssertionError("a collective kind outside COMM_KINDS must raise ValueError")
    try:
        ex.run_collective("broadcast", "x")
    except ValueError:
        pass
    else:
        raise AssertionError("run_collective of a kind outside COMM_KINDS must raise ValueError")


def _spy(ex: Executor, events: list[tuple[Any, ...]]) -> None:
    """Record, in ``events``, each call of ``ex``'s hooks (the executor still runs them)."""
    launch, join, clock, run_op = (ex.launch_collective, ex.join_collective, ex.request_clock,
                                   ex.launch_op)

    def spied_launch(c: CollectiveLaunch) -> Any:
        events.append(("collective", c.partition, c.kind, c.sms, c.slot))
        return launch(c)

    def spied_join(handle: Any) -> None:
        events.append(("join",))
        join(handle)

    def spied_clock(freq_mhz: int) -> None:
        events.append(("clock", freq_mhz, ex.current))
        clock(freq_mhz)

    def spied_op(partition: str, name: str, fn: Callable[..., Any], /, *args: Any,
                 **kwargs: Any) -> Any:
        events.append(("op", name))
        return run_op(partition, name, fn, *args, **kwargs)

    for attr, fn in (("launch_collective", spied_launch), ("join_collective", spied_join),
                     ("request_clock", spied_clock), ("launch_op", spied_op)):
        setattr(ex, attr, fn)


def _check_hooks_in_stream_order(make: Callable[[Plan | None], Executor]) -> None:
    for slot in (*OPS, None):
        ex = make(None)
        events: list[tuple[Any, ...]] = []
        _spy(ex, events)
        ex.run_partition([_recorder([], o) for o in OPS], OPS, "buf",
                         ScheduleConfig(1980, 8, slot))
        at = len(OPS) if slot is None else OPS.index(slot)
        want: list[tuple[Any, ...]] = [("op", o) for o in OPS]
        want.insert(at, ("collective", "partition", "all_reduce", 8, slot))
        want.append(("join",))
        assert events == want, (
            f"slot {slot}: launch_collective once right before the slot's op (after every op "
            f"when sequential) with the configuration's SM count, launch_op for each op, "
            f"join_collective at the end; got {events}")
    ex = make(None)
    events = []
    _spy(ex, events)
    ex.run_nanobatched([_recorder([], o) for o in OPS], OPS, ["y0", "y1"],
                       ScheduleConfig(1980, 16, "rope"))
    comms = [e for e in events if e[0] == "collective"]
    assert comms == [("collective", "nanobatch0", "all_reduce", 16, "rope"),
                     ("collective", "nanobatch1", "all_reduce", 16, None)], \
        f"run_nanobatched: each nanobatch's collective, the last one exposed; got {comms}"
    assert events.count(("join",)) == 2, "run_nanobatched: every collective is joined"
    plan = make_test_plan()
    ex = make(plan)
    ex.start()
    events = []
    _spy(ex, events)
    for mb in (0, 1):
        with ex.microbatch(0, mb, "fwd"):
            pass
    assert events == [("clock", 1980, (0, 0, "fwd")), ("clock", 1410, (0, 1, "fwd"))], \
        f"microbatch() requests the plan's clock once, with current set; got {events}"
    ex = make(None)
    events = []
    _spy(ex, events)
    with ex.microbatch(0, 0, "fwd"):
        pass
    assert events == [], "without a plan there is no clock to request"


def _check_plan_change(make: Callable[[Plan | None], Executor]) -> None:
    ex = make(make_test_plan())
    ex.start()
    other = make_test_plan(freqs_mhz=(1500, 1410))
    ex.plan = other
    assert ex.plan is other, "setting plan must apply the new plan"
    try:
        with ex.microbatch(0, 0, "fwd"):
            pass
    except PlanError:
        pass
    else:
        raise AssertionError("after another plan is set, start() must run again (PlanError)")
    ex.start()
    with ex.microbatch(0, 0, "fwd"), ex.partition("fwd_attn") as part:
        assert part.config == other.config("s0.m0.fwd", "fwd_attn"), \
            "the scope must carry the new plan's configuration"


def _check_graph_capability(make: Callable[[Plan | None], Executor]) -> None:
    ex = make(None)
    assert isinstance(ex.graphs, bool), "graphs must be a bool (whether capture() works)"
    assert ex.sequence("conformance") is None, "nothing is captured before capture()"
    bodies = [lambda: ex.run_partition([_recorder([], o) for o in OPS], OPS, "b",
                                       ScheduleConfig(1980, 8, "qkv"))] * 2
    if not ex.graphs:
        try:
            ex.capture("conformance", bodies)
        except GraphCaptureError:
            pass
        else:
            raise AssertionError("capture() on an executor without graphs must raise "
                                 "GraphCaptureError")
        ex.release_graphs()  # a no-op, but callable
        return
    seq = ex.capture("conformance", bodies, warmup=0)
    assert len(seq) == 2, "capture() returns one graph per body"
    assert ex.sequence("conformance") is seq, "sequence(name) returns the captured sequence"
    assert ex.capture("conformance", bodies, warmup=0) is seq, \
        "capturing the same bodies under the same name and signature reuses the sequence"
    ex.release_graphs("conformance")
    assert ex.sequence("conformance") is None, "release_graphs(name) drops the sequence"


def _check_buffers(make: Callable[[Plan | None], Executor]) -> None:
    try:
        import torch
    except ImportError:  # the buffers are torch tensors: nothing to check without torch
        return
    ex = make(None)
    for kind in COMM_KINDS:
        t = ex.empty((2, 3), torch.float32, kind=kind)
        assert tuple(t.shape) == (2, 3) and t.dtype == torch.float32, \
            f"empty((2, 3), float32, kind={kind!r}) gave {tuple(t.shape)}, {t.dtype}"
        assert not bool(t.ne(0).any()), "empty() returns a zeroed buffer"


EXECUTOR_CHECKS: dict[str, Callable[[Callable[[Plan | None], Executor]], None]] = {
    "type": _check_type,
    "run_partition": _check_run_partition,
    "run_nanobatched": _check_run_nanobatched,
    "hooks_follow_the_plan": _check_hooks_follow_the_plan,
    "scope_rules": _check_scope_rules,
    "hooks_in_stream_order": _check_hooks_in_stream_order,
    "plan_change": _check_plan_change,
    "graph_capability": _check_graph_capability,
    "buffers": _check_buffers,
}


def check_executor(make: Callable[[Plan | None], Executor], *,
                   skip: tuple[str, ...] = ()) -> None:
    """Run every executor conformance check on executors made by ``make``.

    Args:
        make: ``make(plan)`` returns a new executor applying ``plan`` (or none), on a
            device or fake device where every rank holds the same plan (the checks call
            [`start`][kareus.exec.Executor.start]). The checks' plans are for an
            ``h200-sxm`` and one stage ([`make_test_plan`][kareus.testing.make_test_plan]).
        skip: Names (keys of ``EXECUTOR_CHECKS``) to skip.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("executor", EXECUTOR_CHECKS, skip, make)


class ExecutorConformance:
    """Mix-in: subclass in a ``Test*`` class and implement [`make_executor`][kareus.testing.ExecutorConformance.make_executor]; pytest
    then runs one test per check. Set ``skip_checks`` to a tuple of names to skip."""

    skip_checks: tuple[str, ...] = ()

    def make_executor(self, plan: Plan | None) -> Executor:
        """A new executor applying ``plan`` (implement it in the subclass)."""
        raise NotImplementedError("implement make_executor(plan) to return a new executor")


_add_tests(ExecutorConformance, EXECUTOR_CHECKS, lambda self: (self.make_executor,))
