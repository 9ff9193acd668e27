"""Executors: run partitions on real streams under a schedule configuration or a plan.

A partition is a run of computation ops plus one collective that does not depend on
them (with nanobatching: the collective of the previous nanobatch). Its
[`ScheduleConfig`][kareus.model.ScheduleConfig] says *when* the collective starts and
*how many SMs* it gets:

* launch slot ``k`` (the op the communication starts with): record an event on the
  compute stream after op ``k-1``, make the communication stream wait on it, enqueue
  the collective on the communication stream, then enqueue op ``k``;
* ``launch_slot=None`` (sequential, as Megatron-LM does): every computation op, then
  the collective, with no overlap;
* in both cases the compute stream waits for the collective at the end of the
  partition, so what comes next sees the reduced tensor.

The streams are reached through a [`StreamBackend`][kareus.exec.StreamBackend] (CUDA streams through
torch in [`TorchStreamBackend`][kareus.exec.TorchStreamBackend];
[`RecordingStreamBackend`][kareus.exec.RecordingStreamBackend] records which stream launched what
and which stream waited on which event, so the ordering logic is tested on any CPU without torch).
The collective runs through a [`CollectiveBackend`][kareus.exec.CollectiveBackend]
(``all_reduce(tensor, stream, sms)`` and friends), with the configuration's SM count.

[`Executor`][kareus.exec.Executor] is the role (what a training loop and the NVML profiler's runner
rely on): it owns the plan, the scopes and the slot state machine, and asks its implementation
for three hooks; [`TorchExecutor`][kareus.exec.TorchExecutor] implements them on streams (the
collective on a side stream after an event of the compute stream, a join back through an event,
the clock through a stream-ordered trigger) and adds CUDA graphs and registered communication
buffers. ``kareus.testing`` has a recording fake and a conformance suite. Training-loop hooks let
a user's own loop apply a plan::

    executor = TorchExecutor(plan=plan, collective=backend, frequency=trigger)
    executor.start()                     # ranks compare the plan's digest (or use `with`)
    with executor.microbatch(stage, mb, "fwd"):   # stream-ordered frequency request
        with executor.partition("fwd_attn") as part:
            part.communicate(prev_nanobatch_out)  # the collective of this partition
            h = part.op("attn_norm", norm, x)     # ops in stream order; the comm
            qkv = part.op("qkv", proj, h)         # launches at the configured slot
            ...

The plan is a [`kareus.compose.Plan`][kareus.compose.Plan]: a frequency per microbatch computation
and a configuration per partition type inside it, keyed ``"s{stage}.m{microbatch}.{phase}"``;
the frequency reaches the GPU through a
[`FrequencyTrigger`][kareus.exec.FrequencyTrigger]
([`StreamOrderedTrigger`][kareus.exec.StreamOrderedTrigger]).

Modules: the role ([`Executor`][kareus.exec.Executor], [`PartitionHook`][kareus.exec.PartitionHook],
[`PartitionScope`][kareus.exec.PartitionScope], [`CollectiveLaunch`][kareus.exec.CollectiveLaunch],
``LaunchConfig``) is in ``_executor_role``, the plan lookups (``computation_key``,
``plan_config``, ``plan_frequency``, ``plan_nanobatches``) in the public
[`kareus.exec.plan_lookup`][kareus.exec.plan_lookup] and the stream backends in ``_streams``;
this module holds the implementation on CUDA streams
([`TorchExecutor`][kareus.exec.TorchExecutor]) and re-exports the rest (import the names from here
or from [`kareus.exec`][kareus.exec]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kareus._logging import get_logger
from kareus.compose import Plan
from kareus.errors import ArgumentError, ArgumentTypeError, ConfigError, GraphCaptureError
from kareus.exec._executor_role import (
    COMM_KINDS,
    CollectiveLaunch,
    Executor,
    LaunchConfig,
    PartitionHook,
    PartitionScope,
    _check_splits,
)
from kareus.exec._graphs import GraphSequence, prefer_workspace_free_gemms
from kareus.exec._streams import RecordingStreamBackend, StreamBackend, TorchStreamBackend
from kareus.exec.collectives import CollectiveBackend, ProcessGroupCollective
from kareus.exec.frequency import FrequencyTrigger
from kareus.exec.plan_lookup import (
    computation_key,
    plan_config,
    plan_frequency,
    plan_nanobatches,
)

__all__ = [
    "COMM_KINDS",
    "CollectiveLaunch",
    "Executor",
    "GraphSequence",
    "LaunchConfig",
    "PartitionHook",
    "PartitionScope",
    "ProcessGroupCollective",
    "RecordingStreamBackend",
    "StreamBackend",
    "TorchExecutor",
    "TorchStreamBackend",
    "computation_key",
    "plan_config",
    "plan_frequency",
    "plan_nanobatches",
]

_log = get_logger(__name__)


def _route(backend: Any, kind: str, group: str | None) -> Any:
    """The backend that runs a collective of ``kind`` over ``group``: for a backend with one
    backend per group (``for_group``, as the training loop's
    [`GroupedCollective`][kareus.exec.train.GroupedCollective]) and a named group, that group's;
    otherwise ``backend`` itself (it routes by kind, or serves one group)."""
    pick = getattr(backend, "for_group", None)
    if group is not None and callable(pick):
        return pick(group)
    return backend


def _call(backend: Any, kind: str, tensor: Any, output: Any, stream: Any, sms: int | None,
          splits: Any) -> None:
    """Enqueue one collective of ``kind`` on ``backend`` (an all-to-all with its
    ``(output_splits, input_splits)``)."""
    if kind == "all_reduce":
        backend.all_reduce(tensor, stream, sms)
    elif kind == "all_to_all":
        outs, ins = splits
        backend.all_to_all(output, tensor, list(outs), list(ins), stream, sms)
    else:
        getattr(backend, kind)(output, tensor, stream, sms)


class TorchExecutor(Executor):
    """Runs partitions on CUDA streams with an SM-capped collective backend.

    The [`Executor`][kareus.exec.Executor] role's hooks on streams: a collective is launched on a
    high-priority side stream after an event of the current stream
    ([`launch_collective`][kareus.exec.TorchExecutor.launch_collective]) and joined back through
    an event ([`join_collective`][kareus.exec.TorchExecutor.join_collective]); a microbatch's
    clock goes through the frequency trigger on the current stream
    ([`request_clock`][kareus.exec.TorchExecutor.request_clock]). On top of the role: CUDA graphs
    ([`capture`][kareus.exec.TorchExecutor.capture]) and registered communication buffers
    ([`empty`][kareus.exec.TorchExecutor.empty]).

    Args:
        collective: The collective backend (e.g.
            [`NCCLCappedCollective`][kareus.exec.NCCLCappedCollective] or
            [`OwnKernelCollective`][kareus.exec.OwnKernelCollective]).
        plan: The plan a training loop applies (optional for
            [`run_partition`][kareus.exec.TorchExecutor.run_partition]).
        streams: The stream backend; ``None`` =
            [`TorchStreamBackend`][kareus.exec.TorchStreamBackend].
        frequency: The trigger ([`StreamOrderedTrigger`][kareus.exec.StreamOrderedTrigger]) that
            changes the clock at microbatch boundaries in stream order; ``None`` = no
            frequency control.
        default_collective: Used when a configuration's SM count is ``None`` (the
            library's own choice, e.g.
            [`ProcessGroupCollective`][kareus.exec.ProcessGroupCollective]; the systems that do not
            cap SMs use it).
        backends: Backends by name, for configurations that name one
            (ScheduleConfig.backend (``kareus.model.config.ScheduleConfig.backend``),
            e.g. ``{"own": OwnKernelCollective(), "nccl_capped": NCCLCappedCollective()}``
            when the search measured both); ``collective`` runs the configurations that
            name none. Communication buffers come from [`empty`][kareus.exec.TorchExecutor.empty].
        digest_exchange: ``digest -> list of every rank's digest``; ``None`` = an
            ``all_gather_object`` over the default process group (a single process
            without one compares with itself).
        graphs: Capture work into CUDA graphs and replay it
            ([`capture`][kareus.exec.TorchExecutor.capture]); ``None`` (default) = on wherever the
            stream backend can capture (a CUDA device), ``False`` = everything eager. Graph capture
            is what keeps a GPU fed when the host is slower than the ops (docs/performance.md).
        comm_high_priority: Run collectives on a high-priority stream (default), so that
            a collective launched beside an op gets its SMs as soon as the previous op
            frees them, ahead of that op's pending thread blocks, and overlaps it as the
            plan assumes. At normal priority a GEMM that fills the GPU may be dispatched
            first, and the collective then starts only in its last wave (the measured 2x
            H200 grids point to this: docs/fidelity.md). Backends whose library runs
            collectives on streams of its own take the priority in their own options
            ([`NCCLCappedCollective`][kareus.exec.NCCLCappedCollective]).
    """

    def __init__(self, *, collective: CollectiveBackend, plan: Plan | None = None,
                 streams: StreamBackend | None = None, frequency: FrequencyTrigger | None = None,
                 default_collective: CollectiveBackend | None = None,
                 backends: Mapping[str, CollectiveBackend] | None = None,
                 digest_exchange: Callable[[str], Sequence[str]] | None = None,
                 comm_high_priority: bool = True, graphs: bool | None = None) -> None:
        named = dict(backends or {})
        for label, backend in (("collective", collective),
                               ("default_collective", default_collective),
                               *((f"backends[{k!r}]", b) for k, b in named.items())):
            if backend is not None and not isinstance(backend, CollectiveBackend):
                raise ArgumentTypeError(f"{label} must be a CollectiveBackend "
                                        f"(kareus.exec.collectives), got {type(backend).__name__}")
        if collective is None:
            raise ArgumentTypeError("collective must be a CollectiveBackend "
                                    "(kareus.exec.collectives), got None")
        if streams is not None and not isinstance(streams, StreamBackend):
            raise ArgumentTypeError(f"streams must be a StreamBackend, got "
                                    f"{type(streams).__name__}")
        if frequency is not None and not isinstance(frequency, FrequencyTrigger):
            raise ArgumentTypeError("frequency must be a FrequencyTrigger (e.g. "
                                    f"StreamOrderedTrigger), got {type(frequency).__name__}")
        super().__init__(plan=plan, digest_exchange=digest_exchange)
        self.collective: CollectiveBackend = collective
        self.default_collective: CollectiveBackend | None = default_collective
        self.backends: dict[str, CollectiveBackend] = named
        self.streams: StreamBackend = streams if streams is not None else TorchStreamBackend()
        if graphs and not self.streams.supports_graphs:
            raise GraphCaptureError(f"graphs=True, but {type(self.streams).__name__} cannot "
                                    "capture graphs (no CUDA device?): pass graphs=False")
        self.graphs: bool = (self.streams.supports_graphs if graphs is None
                             else bool(graphs))
        if self.graphs and isinstance(self.streams, TorchStreamBackend):
            prefer_workspace_free_gemms()  # no memset node per GEMM (kareus.exec._graphs)
        self._sequences: dict[str, GraphSequence] = {}
        self._deferred: list[int] | None = None
        self.frequency: FrequencyTrigger | None = frequency
        self._comm_stream: Any = None
        self.comm_high_priority = bool(comm_high_priority)

    # -- setup -----------------------------------------------------------------------
    @property
    def comm_stream(self) -> Any:
        """The side stream collectives run on (created on first use)."""
        if self._comm_stream is None:
            self._comm_stream = self.streams.new_stream(
                name="comm", high_priority=self.comm_high_priority)
        return self._comm_stream

    def empty(self, shape: int | Sequence[int], dtype: Any, *, kind: str = "all_reduce",
              group: str | None = None) -> Any:
        """A zeroed communication buffer from the backends: registered memory from the
        first of ``collective``, then ``backends``, that allocates
        ([OwnKernelCollective.empty][kareus.exec.OwnKernelCollective.empty];
        a backend per group, such as the training loop's ``GroupedCollective``, asks the
        backend of the group that runs collectives of ``kind``), which every backend can
        also run on, else ``torch.zeros`` on the current device.

        A registered allocation is collective: every rank must ask for the same buffers
        in the same order (runnable partitions built with ``build(collective=executor)``
        do). The memory lives until that backend is closed.

        Args:
            shape: Tensor shape (an int for 1-D).
            dtype: A torch dtype.
            kind: The collective the buffer is for (``"all_reduce"``, ``"all_gather"``,
                ``"reduce_scatter"``).
            group: Its group, ``"tp"`` or ``"cp"`` (``None``: the group that runs ``kind``
                by default; sequence parallelism all-gathers and reduce-scatters over TP).
        """
        for backend in (self.collective, *self.backends.values()):
            alloc = getattr(backend, "empty", None)
            route = getattr(backend, "backend_for", None)
            if not callable(alloc) and callable(route):  # one backend per group
                try:
                    sub = (_route(backend, kind, group) if group is not None
                           else route(kind))
                    alloc = getattr(sub, "empty", None)
                except ValueError:  # no group runs that kind here
                    alloc = None
            if callable(alloc):
                return alloc(shape, dtype).zero_()
        import torch

        return torch.zeros(shape, dtype=dtype,
                           device=torch.device("cuda", torch.cuda.current_device()))

    def backend_for(self, sms: int | None, backend: str | None = None) -> CollectiveBackend:
        """The backend that runs a collective of ``sms`` SMs on ``backend`` (a name of
        ``backends``; ``None`` = ``collective``, or the default collective when
        ``sms`` is ``None`` too).

        Raises:
            ConfigError: ``backend`` names no backend of this executor.
        """
        if backend is not None:
            try:
                return self.backends[backend]
            except KeyError:
                raise ConfigError(f"the configuration asks for collective backend {backend!r}, "
                                  f"but this executor has {sorted(self.backends) or 'none'}: "
                                  "pass it in TorchExecutor(backends=...)") from None
        if sms is None and self.default_collective is not None:
            return self.default_collective
        return self.collective

    # -- the role's hooks ------------------------------------------------------------
    def launch_collective(self, launch: CollectiveLaunch) -> Any:
        """Launch ``launch``'s collective on the side stream
        ([`comm_stream`][kareus.exec.TorchExecutor.comm_stream]) after everything enqueued on
        the current stream so far: record an event on the current stream, make the side
        stream wait on it, enqueue the collective there through
        [`backend_for`][kareus.exec.TorchExecutor.backend_for] with ``launch.sms`` SMs.

        Returns:
            The event recorded on the side stream after the collective.
        """
        return self._launch_comm((launch.kind, launch.tensor, launch.output), launch.sms,
                                 launch.backend, launch.group, launch.splits)

    def join_collective(self, handle: Any) -> None:
        """Make the current stream wait on the collective's event (``handle``)."""
        self._join(handle)

    def request_clock(self, freq_mhz: int) -> None:
        """Request ``freq_mhz`` through the frequency trigger on the current stream
        (nothing without one). Inside a capture with a trigger that has no host nodes, the
        request is held and issued right before that graph's replay."""
        if self.frequency is None:
            return
        if self._deferred is not None and self.streams.is_capturing():
            # A trigger without host nodes: issued right before this graph's replay.
            self._deferred.append(freq_mhz)
        else:
            self.frequency.request(freq_mhz, stream=self.streams.current_stream())

    def run_collective(self, kind: str, tensor: Any, output: Any = None, *,
                       sms: int | None = None, partition: str = "collective",
                       group: str | None = None, splits: Any = None) -> None:
        """Run one collective by itself on the current stream, through
        [`backend_for`][kareus.exec.TorchExecutor.backend_for] ``(sms)`` with ``sms`` SMs
        (the outside work's collectives; no side stream, so nothing to join).

        Raises:
            ValueError: ``kind`` is not one of ``COMM_KINDS``.
        """
        if kind not in COMM_KINDS:
            raise ArgumentError(f"kind must be one of {COMM_KINDS}, got {kind!r}")
        backend = _route(self.backend_for(sms), kind, group)
        stream = self.streams.current_stream()
        _call(backend, kind, tensor, output, stream, sms, _check_splits(kind, splits))

    # -- the mechanism ---------------------------------------------------------------
    def _launch_comm(self, comm: tuple[str, Any, Any], sms: int | None,
                     backend_name: str | None = None, group: str | None = None,
                     splits: Any = None) -> Any:
        kind, tensor, output = comm
        backend = _route(self.backend_for(sms, backend_name), kind, group)
        compute = self.streams.current_stream()
        side = self.comm_stream
        ready = self.streams.record_event(compute)
        self.streams.wait_event(side, ready)
        with self.streams.use_stream(side):
            _call(backend, kind, tensor, output, side, sms, splits)
        return self.streams.record_event(side)

    def _join(self, done_event: Any) -> None:
        self.streams.wait_event(self.streams.current_stream(), done_event)

    # -- graphs ----------------------------------------------------------------------
    def capture(self, name: str, bodies: Sequence[Callable[[], Any]], *,
                signature: Any = None, warmup: int = 1, pool: Any = None) -> GraphSequence:
        """Capture ``bodies`` in order into graphs sharing one memory pool
        (``GraphSequence``), or return the sequence captured
        under ``name`` before if its signature and the plan are unchanged.

        Each body enqueues its work as it would eagerly (partitions through
        [`partition`][kareus.exec.TorchExecutor.partition] or
        [`run_partition`][kareus.exec.TorchExecutor.run_partition], clock requests through
        [`microbatch`][kareus.exec.TorchExecutor.microbatch]); collectives, events and clock
        requests are captured with it. Every rank must capture the same bodies in the same order
        (the collectives).

        Args:
            name: The sequence's key; capturing another signature under it replaces it.
            bodies: Zero-argument callables, one graph each.
            signature: Anything comparable that describes what the bodies depend on
                (shapes, schedule); a change re-captures.
            warmup: Eager runs of every body before the capture (library set-up), on a
                side stream; 0 when the caller has just run them.
            pool: The memory pool to capture into: one this executor's streams made
                (``graph_pool()``) and other graphs were captured into, whose memory the
                new graphs may then reuse (so the caller replays them in the order they
                were captured and reads nothing a graph of the pool wrote after another
                one ran); ``None`` (default): a new pool.

        Returns:
            The sequence; replay it with ``GraphSequence.replay``.

        Raises:
            GraphCaptureError: graphs are off, or a body cannot be captured (an op that
                synchronises with the host).
        """
        if not self.graphs:
            raise GraphCaptureError("this executor runs eagerly (graphs=False): call the "
                                    "bodies directly")
        if not bodies:
            raise ArgumentError("nothing to capture: bodies is empty")
        self._require_started()
        key = (signature, None if self.plan is None else str(self.plan.digest))
        old = self._sequences.get(name)
        if old is not None and old.key == key and len(old) == len(bodies):
            return old
        self.release_graphs(name)
        if warmup:
            side = self.streams.new_stream(name="warmup")
            self.streams.wait_event(side, self.streams.record_event(
                self.streams.current_stream()))
            with self.streams.use_stream(side):
                for _ in range(int(warmup)):
                    for body in bodies:
                        body()
            self.streams.wait_event(self.streams.current_stream(),
                                    self.streams.record_event(side))
        pool = self.streams.graph_pool() if pool is None else pool
        graphs, deferred = [], []
        for i, body in enumerate(bodies):
            self._deferred = [] if not getattr(self.frequency, "capturable", False) else None
            try:
                with self.streams.capture(pool, name=f"{name}[{i}]") as graph:
                    body()
            except GraphCaptureError:
                raise
            except RuntimeError as exc:
                raise GraphCaptureError(
                    f"graph {i} of {name!r} could not be captured ({str(exc)[:300]}): an op "
                    "synchronises with the host or runs on a stream outside the capture; "
                    "run eagerly (graphs=False / --no-graphs)") from exc
            finally:
                held, self._deferred = self._deferred, None
            graphs.append(graph)
            deferred.append(held or [])
        # The request closes over the trigger and the streams, not the executor: the
        # executor holds the sequence, and a cycle would leave its graphs to the garbage
        # collector instead of freeing them when the executor goes
        trigger, streams = self.frequency, self.streams
        request = None if trigger is None else (
            lambda f: trigger.request(f, stream=streams.current_stream()))
        seq = GraphSequence(name=name, key=key, streams=self.streams, graphs=graphs,
                            deferred=deferred, request=request)
        self._sequences[name] = seq
        _log.info("captured %d graph(s) of %r", len(graphs), name)
        return seq

    def sequence(self, name: str) -> GraphSequence | None:
        """The graph sequence captured under ``name``, if any."""
        return self._sequences.get(name)

    def release_graphs(self, name: str | None = None) -> None:
        """Drop the graphs of ``name`` (``None``: all); their pools return to the
        allocator once nothing else holds them.

        The device is synchronised first: a replay still running reads and writes its
        pool, which must not be handed to new allocations (other streams') before it ends.
        """
        dropped = (list(self._sequences) if name is None
                   else [name] if name in self._sequences else [])
        if not dropped:
            return
        self.streams.synchronize()
        for n in dropped:
            del self._sequences[n]

