"""Executors: run partitions on real streams under a schedule configuration or a plan.

A partition is a run of computation ops plus one collective that does not depend on
them (with nanobatching: the collective of the previous nanobatch). Its
:class:`~kareus.model.config.ScheduleConfig` says *when* the collective starts and
*how many SMs* it gets:

* launch slot ``k`` (the op the communication starts with): record an event on the
  compute stream after op ``k-1``, make the communication stream wait on it, enqueue
  the collective on the communication stream, then enqueue op ``k``;
* ``launch_slot=None`` (sequential, as Megatron-LM does): every computation op, then
  the collective, with no overlap;
* in both cases the compute stream waits for the collective at the end of the
  partition, so what comes next sees the reduced tensor.

The streams are reached through a :class:`StreamBackend` (CUDA streams through
torch in :class:`TorchStreamBackend`; :class:`RecordingStreamBackend` records which
stream launched what and which stream waited on which event, so the ordering logic
is tested on any CPU without torch). The collective runs through a collective
backend (``kareus.exec.collectives.CollectiveBackend``: ``all_reduce(tensor, stream,
sms)`` and friends), with the configuration's SM count.

Training-loop hooks let a user's own loop apply a plan::

    executor = TorchExecutor(plan=plan, collective=backend, frequency=trigger)
    executor.start()                     # ranks compare the plan's digest (or use `with`)
    with executor.microbatch(stage, mb, "fwd"):   # stream-ordered frequency request
        with executor.partition("fwd_attn") as part:
            part.communicate(prev_nanobatch_out)  # the collective of this partition
            h = part.op("attn_norm", norm, x)     # ops in stream order; the comm
            qkv = part.op("qkv", proj, h)         # launches at the configured slot
            ...

A plan is a :class:`kareus.compose.plan.Plan` (configurations and frequencies per
microbatch computation, keyed ``"s{stage}.m{microbatch}.{phase}"``) or any object with a
``digest`` attribute, a per-partition-type configuration (``config_for(type)`` or a
``configs`` mapping) and per-computation frequencies (``frequency_for(stage,
microbatch, phase)`` or a ``freqs_mhz`` mapping keyed by ``(stage, microbatch, phase)``).
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from kareus._logging import get_logger
from kareus.errors import ConfigError, PlanError, UnknownSlotError
from kareus.exec.collectives._base import _DIST_TENSOR_COLLECTIVE
from kareus.model.config import ScheduleConfig

__all__ = [
    "COMM_KINDS",
    "Executor",
    "PartitionScope",
    "ProcessGroupCollective",
    "RecordingStreamBackend",
    "StreamBackend",
    "TorchExecutor",
    "TorchStreamBackend",
    "plan_config",
    "plan_frequency",
]

#: Collective kinds the executor can launch (the names of ``CollectiveBackend`` methods).
_log = get_logger(__name__)

COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


# ------------------------------------------------------------------------ streams


class StreamBackend(abc.ABC):
    """Streams and events: the only device primitives the executor's ordering needs."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream work is enqueued on now."""

    @abc.abstractmethod
    def new_stream(self, *, name: str) -> Any:
        """A new stream (``name`` is for logs and fakes)."""

    @abc.abstractmethod
    def record_event(self, stream: Any) -> Any:
        """Record and return an event at the current end of ``stream``."""

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device) until ``event`` has happened."""

    @abc.abstractmethod
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context in which ``stream`` is the current stream."""


class TorchStreamBackend(StreamBackend):
    """CUDA streams and events through ``torch.cuda`` (imported lazily)."""

    def __init__(self, *, device: Any = None) -> None:
        import torch  # noqa: PLC0415 - heavy, optional

        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)

    def current_stream(self) -> Any:
        return self._torch.cuda.current_stream(self.device)

    def new_stream(self, *, name: str) -> Any:
        return self._torch.cuda.Stream(device=self.device)

    def record_event(self, stream: Any) -> Any:
        ev = self._torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._torch.cuda.stream(stream)


@attrs.frozen
class _FakeStream:
    name: str


@attrs.frozen
class _FakeEvent:
    id: int
    stream: str
    after: int  # number of log entries on that stream before the record


class RecordingStreamBackend(StreamBackend):
    """A fake device that records what each stream was asked to do, in host order.

    ``log`` holds tuples: ``("launch", stream, what)``, ``("record", stream, event_id)``
    and ``("wait", stream, event_id)``. Ops and collectives passed to an executor that
    uses this backend call :meth:`launch` to log themselves (:meth:`op` makes such an
    op); :meth:`happens_before` answers ordering questions on the device's terms.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, str, Any]] = []
        self._stack: list[_FakeStream] = [_FakeStream("compute")]
        self._ids = itertools.count()
        self.events: dict[int, _FakeEvent] = {}

    def current_stream(self) -> _FakeStream:
        return self._stack[-1]

    def new_stream(self, *, name: str) -> _FakeStream:
        return _FakeStream(name)

    def record_event(self, stream: Any) -> _FakeEvent:
        n = sum(1 for e in self.log if e[1] == stream.name and e[0] == "launch")
        ev = _FakeEvent(next(self._ids), stream.name, n)
        self.events[ev.id] = ev
        self.log.append(("record", stream.name, ev.id))
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream.name, event.id))

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[Any]:
        self._stack.append(stream)
        try:
            yield stream
        finally:
            self._stack.pop()

    def launch(self, what: str, stream: Any = None) -> None:
        """Log that ``what`` was enqueued on ``stream`` (default: the current stream)."""
        s = self.current_stream() if stream is None else stream
        self.log.append(("launch", s.name, what))

    def op(self, what: str) -> Callable[..., None]:
        """A callable that logs ``what`` as launched on the current stream."""
        def run(*_: Any, **__: Any) -> None:
            self.launch(what)
        return run

    # -- queries used by tests -----------------------------------------------------
    def launches(self, stream: str) -> list[str]:
        """What was launched on ``stream``, in order."""
        return [e[2] for e in self.log if e[0] == "launch" and e[1] == stream]

    def happens_before(self, first: tuple[str, str], second: tuple[str, str]) -> bool:
        """Whether launch ``first`` = (stream, what) is ordered before launch ``second`` on
        the device: same stream in order, or through a record/wait chain."""
        return _happens_before(self.log, first, second)


def _happens_before(log: list[tuple[str, str, Any]], first: tuple[str, str],
                    second: tuple[str, str]) -> bool:
    # Device order: each stream runs its entries in order; a wait makes everything after
    # it on the waiting stream follow everything before the record on the recording stream.
    pos = {(e[1], e[2]): i for i, e in enumerate(log) if e[0] == "launch"}
    if first not in pos or second not in pos:
        raise KeyError(f"{first if first not in pos else second} was never launched")
    records = {e[2]: i for i, e in enumerate(log) if e[0] == "record"}
    # reach[stream] = latest log index on `stream` whose predecessors include `first`.
    start = pos[first]
    reached: dict[str, int] = {log[start][1]: start}
    changed = True
    while changed:
        changed = False
        for i, e in enumerate(log):
            if e[0] != "wait":
                continue
            rec = records.get(e[2])
            if rec is None:
                continue
            src = log[rec][1]
            if src in reached and reached[src] < rec and (
                    e[1] not in reached or reached[e[1]] > i):
                reached[e[1]] = i
                changed = True
    s2, idx2 = second[0], pos[second]
    return s2 in reached and reached[s2] < idx2


# ------------------------------------------------------------------------ collectives


class ProcessGroupCollective:
    """Collectives through a ``torch.distributed`` group with the library's own CTA count.

    This is what Megatron-LM and plain nanobatching use (NCCL picks its CTAs); the
    ``sms`` argument is ignored. Use it as ``default_collective`` for baselines.
    """

    def __init__(self, *, group: Any = None) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        self._dist = dist
        self.group = group

    def all_reduce(self, tensor: Any, stream: Any, sms: int | None) -> Any:
        import torch  # noqa: PLC0415

        with torch.cuda.stream(stream):
            self._dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        return self._shard_collective("all_gather", output, input, stream)

    def reduce_scatter(self, output: Any, input: Any, stream: Any, sms: int | None) -> Any:
        return self._shard_collective("reduce_scatter", output, input, stream)

    def _shard_collective(self, op: str, output: Any, input: Any, stream: Any) -> Any:
        """All-gather or reduce-scatter through ``torch.distributed``'s flat-tensor call."""
        import torch  # noqa: PLC0415

        run = getattr(self._dist, _DIST_TENSOR_COLLECTIVE[op])
        with torch.cuda.stream(stream):
            run(output.view(-1), input.view(-1), group=self.group)
        return output


# ------------------------------------------------------------------------ plans


def _computation_key(computation: tuple[int, int, str] | None) -> str | None:
    if computation is None:
        return None
    stage, mb, phase = computation
    return f"s{stage}.m{mb}.{phase}"


def plan_config(plan: Any, partition_type: str,
                computation: tuple[int, int, str] | None = None) -> ScheduleConfig:
    """The configuration ``plan`` gives partition type ``partition_type``.

    Accepts :class:`kareus.compose.plan.Plan` (per computation: ``plan.config(key, type)``
    with ``key = "s{stage}.m{microbatch}.{phase}"``, so ``computation`` is needed),
    ``plan.config_for(type)``, or a mapping ``plan.configs`` / ``plan.partition_configs``
    (values: :class:`ScheduleConfig` or its dict form).

    Raises:
        PlanError: the plan has no configuration for it, or needs the computation.
    """
    if callable(getattr(plan, "config_for", None)):
        cfg = plan.config_for(partition_type)
    elif hasattr(plan, "assignment") and callable(getattr(plan, "config", None)):
        key = _computation_key(computation)
        if key is None:
            raise PlanError("this plan sets configurations per microbatch computation: run "
                            "partitions inside executor.microbatch(stage, microbatch, phase)")
        try:
            cfg = plan.config(key, partition_type)
        except KeyError:
            raise PlanError(f"the plan has no configuration for partition type "
                            f"{partition_type!r} in computation {key}") from None
    else:
        table = getattr(plan, "configs", None)
        if not isinstance(table, Mapping):
            table = getattr(plan, "partition_configs", None)
        if not isinstance(table, Mapping):
            raise TypeError(f"{type(plan).__name__} has no config_for(), config(computation, "
                            "type) or configs mapping")
        if partition_type not in table:
            raise PlanError(f"the plan has no configuration for partition type "
                            f"{partition_type!r}; it has: {', '.join(map(str, table))}")
        cfg = table[partition_type]
    if isinstance(cfg, Mapping):
        cfg = ScheduleConfig.from_dict(dict(cfg))
    if not isinstance(cfg, ScheduleConfig):
        raise TypeError(f"plan configuration of {partition_type!r} must be a ScheduleConfig, "
                        f"got {type(cfg).__name__}")
    return cfg


def plan_frequency(plan: Any, stage: int, microbatch: int, phase: str) -> int | None:
    """The SM clock ``plan`` gives one microbatch computation (``None``: leave it).

    Accepts :class:`kareus.compose.plan.Plan` (``plan.freq_mhz("s0.m1.fwd")``),
    ``plan.frequency_for(stage, microbatch, phase)``, or a mapping ``plan.freqs_mhz``
    keyed by ``(stage, microbatch, phase)``.
    """
    if callable(getattr(plan, "frequency_for", None)):
        f = plan.frequency_for(stage, microbatch, phase)
    elif hasattr(plan, "assignment") and callable(getattr(plan, "freq_mhz", None)):
        f = plan.freq_mhz(_computation_key((stage, microbatch, phase)))
    else:
        table = getattr(plan, "freqs_mhz", None)
        if not isinstance(table, Mapping):
            return None
        f = table.get((stage, microbatch, phase))
    return None if f is None else int(f)


def _default_digest_exchange(digest: str) -> list[str]:
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError:
        return [digest]
    if not (dist.is_available() and dist.is_initialized()):
        return [digest]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest)
    return [str(d) for d in out]


# ------------------------------------------------------------------------ executors


class Executor(abc.ABC):
    """Runs partitions (and microbatches of them) under configurations or a plan."""

    @abc.abstractmethod
    def run_partition(self, ops: Sequence[Callable[[], Any]], op_names: Sequence[str],
                      comm_tensor: Any, config: ScheduleConfig, *,
                      comm_kind: str = "all_reduce", comm_output: Any = None) -> None:
        """Enqueue one partition: ``ops`` in order, the collective at ``config``'s slot."""

    @abc.abstractmethod
    def partition(self, key: str, *, config: ScheduleConfig | None = None
                  ) -> contextlib.AbstractContextManager[PartitionScope]:
        """Hook for a user's loop: a scope whose ops and collective follow the plan."""

    @abc.abstractmethod
    def microbatch(self, stage: int, microbatch: int, phase: str
                   ) -> contextlib.AbstractContextManager[None]:
        """Hook for a user's loop around one microbatch computation."""


class PartitionScope:
    """Ops of one partition, launched in stream order with the collective at its slot.

    Created by :meth:`TorchExecutor.partition`; call :meth:`communicate` before the
    slot's op, then :meth:`op` for each computation op in order. On exit, a collective
    not yet launched (sequential, or a slot never reached) is launched after the ops,
    and the compute stream waits for it.
    """

    def __init__(self, executor: TorchExecutor, key: str, config: ScheduleConfig,
                 op_names: Sequence[str] | None = None) -> None:
        self._ex = executor
        self.key = key
        self.config = config
        self._op_names = tuple(op_names) if op_names is not None else None
        self._count = 0
        self._comm: tuple[str, Any, Any] | None = None
        self._launched = False
        self._done_event: Any = None
        self.ops_run: list[str] = []

    def communicate(self, tensor: Any, *, kind: str = "all_reduce", output: Any = None) -> None:
        """Register the collective of this partition (launched at the configured slot).

        Args:
            tensor: The tensor to all-reduce in place, or the input of an all-gather /
                reduce-scatter.
            kind: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``.
            output: Output tensor of all-gather / reduce-scatter.
        """
        if kind not in COMM_KINDS:
            raise ValueError(f"kind must be one of {COMM_KINDS}, got {kind!r}")
        if self._comm is not None:
            raise RuntimeError(f"partition {self.key!r} already has a collective")
        if kind != "all_reduce" and output is None:
            raise ValueError(f"{kind} needs an output tensor")
        self._comm = (kind, tensor, output)

    def op(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Enqueue computation op ``name`` (``fn(*args, **kwargs)``) on the compute stream,
        launching the collective first if ``name`` is the configured slot."""
        names = self._op_names
        if names is not None and (self._count >= len(names) or names[self._count] != name):
            expected = names[self._count] if self._count < len(names) else "no more ops"
            raise ConfigError(f"partition {self.key!r}: op {name!r} out of order "
                              f"(expected {expected!r})")
        if not self._launched and self.config.launch_slot == name:
            self._launch()
        self._count += 1
        self.ops_run.append(name)
        return fn(*args, **kwargs)

    def _launch(self) -> None:
        if self._comm is None:
            raise RuntimeError(
                f"partition {self.key!r} reached its launch slot {self.config.launch_slot!r} "
                "before communicate() named the collective")
        self._done_event = self._ex._launch_comm(self._comm, self.config.comm_sms)
        self._launched = True

    def close(self) -> None:
        """Launch a pending collective (sequential) and join it into the compute stream."""
        if self._comm is None:
            return
        if not self._launched:
            if self.config.launch_slot is not None and self._op_names is not None:
                raise UnknownSlotError(f"partition {self.key!r}: slot "
                                       f"{self.config.launch_slot!r} was never reached")
            self._launch()
        self._ex._join(self._done_event)


class TorchExecutor(Executor):
    """Runs partitions on CUDA streams with an SM-capped collective backend.

    Args:
        collective: The collective backend (``kareus.exec.collectives.CollectiveBackend``
            or anything with ``all_reduce(tensor, stream, sms)``; also ``all_gather`` /
            ``reduce_scatter(output, input, stream, sms)`` for those kinds).
        plan: The plan a training loop applies (optional for :meth:`run_partition`).
        streams: The stream backend; ``None`` = :class:`TorchStreamBackend`.
        frequency: A ``StreamOrderedTrigger`` (or any object with ``request(freq_mhz,
            stream=...)``) that changes the clock at microbatch boundaries in stream
            order; ``None`` = no frequency control.
        default_collective: Used when a configuration's SM count is ``None`` (the
            library's own choice, e.g. an uncapped NCCL group; baselines use it).
        digest_exchange: ``digest -> list of every rank's digest``; ``None`` = an
            ``all_gather_object`` over the default process group (a single process
            without one compares with itself).
    """

    def __init__(self, *, collective: Any, plan: Any = None,
                 streams: StreamBackend | None = None, frequency: Any = None,
                 default_collective: Any = None,
                 digest_exchange: Callable[[str], Sequence[str]] | None = None) -> None:
        if not callable(getattr(collective, "all_reduce", None)):
            raise TypeError("collective must be a CollectiveBackend (with all_reduce(tensor, "
                            f"stream, sms)), got {type(collective).__name__}")
        if streams is not None and not isinstance(streams, StreamBackend):
            raise TypeError(f"streams must be a StreamBackend, got {type(streams).__name__}")
        if frequency is not None and not callable(getattr(frequency, "request", None)):
            raise TypeError("frequency must have request(freq_mhz, stream=...), got "
                            f"{type(frequency).__name__}")
        if plan is not None and not hasattr(plan, "digest"):
            raise TypeError(f"plan must have a digest, got {type(plan).__name__}")
        self.collective = collective
        self.default_collective = default_collective
        self.plan = plan
        self.streams = streams if streams is not None else TorchStreamBackend()
        self.frequency = frequency
        self._exchange = digest_exchange or _default_digest_exchange
        self._comm_stream: Any = None
        self._started = False
        self.current: tuple[int, int, str] | None = None

    # -- setup -----------------------------------------------------------------------
    @property
    def comm_stream(self) -> Any:
        """The side stream collectives run on (created on first use)."""
        if self._comm_stream is None:
            self._comm_stream = self.streams.new_stream(name="comm")
        return self._comm_stream

    def start(self) -> None:
        """Compare the plan's digest across ranks; refuse to run on a mismatch.

        Raises:
            PlanError: some rank holds another plan (the message lists each rank's digest).
        """
        if self.plan is not None:
            mine = str(self.plan.digest)
            every = list(self._exchange(mine))
            if any(d != mine for d in every):
                listing = ", ".join(f"rank {i}: {d}" for i, d in enumerate(every))
                _log.error("refusing to train: ranks hold different plans (%s)", listing)
                raise PlanError("ranks hold different plans; every rank must load the same "
                                f"plan before training ({listing})")
        self._started = True

    def __enter__(self) -> TorchExecutor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _require_started(self) -> None:
        if self.plan is not None and not self._started:
            raise PlanError("call executor.start() first: ranks must compare the plan's digest "
                            "before any collective runs under it")

    # -- the mechanism ---------------------------------------------------------------
    def _launch_comm(self, comm: tuple[str, Any, Any], sms: int | None) -> Any:
        kind, tensor, output = comm
        compute = self.streams.current_stream()
        side = self.comm_stream
        ready = self.streams.record_event(compute)
        self.streams.wait_event(side, ready)
        backend = (self.default_collective if sms is None and self.default_collective is not None
                   else self.collective)
        with self.streams.use_stream(side):
            if kind == "all_reduce":
                backend.all_reduce(tensor, side, sms)
            else:
                getattr(backend, kind)(output, tensor, side, sms)
        return self.streams.record_event(side)

    def _join(self, done_event: Any) -> None:
        self.streams.wait_event(self.streams.current_stream(), done_event)

    def run_partition(self, ops: Sequence[Callable[[], Any]], op_names: Sequence[str],
                      comm_tensor: Any, config: ScheduleConfig, *,
                      comm_kind: str = "all_reduce", comm_output: Any = None) -> None:
        """Enqueue one partition: ``ops`` in order, the collective at ``config``'s slot.

        Args:
            ops: Zero-argument callables that enqueue each computation op.
            op_names: Their names (the slot names refer to them).
            comm_tensor: The tensor the collective acts on.
            config: The schedule configuration (its ``freq_mhz`` is ignored here: the
                clock is set per microbatch, see :meth:`microbatch`).
            comm_kind: The collective.
            comm_output: Output tensor of all-gather / reduce-scatter.

        Raises:
            UnknownSlotError: ``config.launch_slot`` is not one of ``op_names``.
        """
        if len(ops) != len(op_names):
            raise ValueError(f"{len(ops)} ops but {len(op_names)} names")
        if config.launch_slot is not None and config.launch_slot not in op_names:
            raise UnknownSlotError(f"launch slot {config.launch_slot!r} is not one of the ops "
                                   f"{list(op_names)} (or None for sequential)")
        scope = PartitionScope(self, "partition", config, op_names)
        scope.communicate(comm_tensor, kind=comm_kind, output=comm_output)
        for name, fn in zip(op_names, ops):
            scope.op(name, fn)
        scope.close()

    def run_nanobatched(self, ops: Sequence[Callable[[int], Any]], op_names: Sequence[str],
                        comm_tensors: Sequence[Any], config: ScheduleConfig, *,
                        comm_kind: str = "all_reduce", comm_outputs: Sequence[Any] | None = None,
                        ) -> None:
        """Run one layer segment over ``n >= 2`` nanobatches with overlap.

        Nanobatch ``i``'s computation (``op(i)`` for each op) overlaps the collective of
        nanobatch ``i-1``, launched at ``config``'s slot; the last nanobatch's collective
        runs after the computation (exposed), or overlaps the next segment when the
        caller chains segments through :meth:`partition`. Sequential configurations
        run each nanobatch's collective right after its computation.

        Args:
            ops: Callables ``op(i)`` that enqueue an op for nanobatch ``i``.
            op_names: Their names.
            comm_tensors: Per nanobatch, the tensor its collective acts on (written by
                that nanobatch's computation).
            config: The schedule configuration.
            comm_kind: The collective.
            comm_outputs: Per nanobatch, the output tensor (all-gather / reduce-scatter).
        """
        n = len(comm_tensors)
        if n < 2:
            raise ValueError(f"nanobatching needs n >= 2 nanobatches, got {n}")
        outs = list(comm_outputs) if comm_outputs is not None else [None] * n
        seq = config.sequential
        # Nanobatch 0 has no previous collective to overlap.
        for fn in ops:
            fn(0)
        for i in range(1, n):
            if seq:
                self._run_exposed(comm_tensors[i - 1], comm_kind, outs[i - 1], config.comm_sms)
                for fn in ops:
                    fn(i)
                continue
            scope = PartitionScope(self, f"nanobatch{i}", config, op_names)
            scope.communicate(comm_tensors[i - 1], kind=comm_kind, output=outs[i - 1])
            for name, fn in zip(op_names, ops):
                scope.op(name, fn, i)
            scope.close()
        self._run_exposed(comm_tensors[n - 1], comm_kind, outs[n - 1], config.comm_sms)

    def _run_exposed(self, tensor: Any, kind: str, output: Any, sms: int | None) -> None:
        done = self._launch_comm((kind, tensor, output), sms)
        self._join(done)

    # -- training-loop hooks ---------------------------------------------------------
    @contextlib.contextmanager
    def partition(self, key: str, *, config: ScheduleConfig | None = None,
                  op_names: Sequence[str] | None = None) -> Iterator[PartitionScope]:
        """Scope of one partition of type ``key`` under the plan's configuration.

        Args:
            key: The partition type (e.g. ``"fwd_attn"``).
            config: Override the plan's configuration.
            op_names: Expected op order, checked as ops are issued (optional).
        """
        if config is None:
            if self.plan is None:
                raise PlanError(f"no plan and no config for partition {key!r}")
            self._require_started()
            config = plan_config(self.plan, key, self.current)
        scope = PartitionScope(self, key, config, op_names)
        ok = False
        try:
            yield scope
            ok = True
        finally:
            if ok:
                scope.close()

    @contextlib.contextmanager
    def microbatch(self, stage: int, microbatch: int, phase: str) -> Iterator[None]:
        """Scope of one microbatch computation: requests the plan's clock for it in stream
        order (it takes effect when the GPU reaches this point, not when the host does)."""
        if phase not in ("fwd", "bwd"):
            raise ValueError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        self._require_started()
        if self.plan is not None and self.frequency is not None:
            f = plan_frequency(self.plan, stage, microbatch, phase)
            if f is not None:
                self.frequency.request(f, stream=self.streams.current_stream())
        prev = self.current
        self.current = (stage, microbatch, phase)
        try:
            yield None
        finally:
            self.current = prev
