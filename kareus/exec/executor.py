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
rely on); [`TorchExecutor`][kareus.exec.TorchExecutor] is the implementation, and ``kareus.testing``
has a recording fake and a conformance suite. Training-loop hooks let a user's own loop apply
a plan::

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
``LaunchConfig``) is in ``_executor_role``, the plan lookups (``computation_key``, ``plan_config``,
``plan_frequency``) in ``_plan_lookup`` and the stream backends in ``_streams``; this
module holds the implementation on CUDA streams ([`TorchExecutor`][kareus.exec.TorchExecutor],
[`PartitionScope`][kareus.exec.PartitionScope]) and re-exports the rest (import the names from here
or from [`kareus.exec`][kareus.exec]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kareus._logging import get_logger
from kareus.compose import Plan
from kareus.errors import ConfigError, GraphCaptureError, PlanError, UnknownSlotError
from kareus.exec._executor_role import COMM_KINDS, Executor, LaunchConfig, PartitionHook
from kareus.exec._graphs import GraphSequence
from kareus.exec._plan_lookup import (
    _require_plan,
    computation_key,
    plan_config,
    plan_frequency,
    plan_nanobatches,
)
from kareus.exec._streams import RecordingStreamBackend, StreamBackend, TorchStreamBackend
from kareus.exec.collectives import CollectiveBackend, ProcessGroupCollective
from kareus.exec.frequency import FrequencyTrigger

__all__ = [
    "COMM_KINDS",
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


def _default_digest_exchange(digest: str) -> list[str]:
    try:
        import torch.distributed as dist
    except ImportError:
        return [digest]
    if not (dist.is_available() and dist.is_initialized()):
        return [digest]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest)
    return [str(d) for d in out]


class PartitionScope(PartitionHook):
    """Ops of one partition, launched in stream order with the collective at its slot.

    Created by [`TorchExecutor.partition`][kareus.exec.TorchExecutor.partition]; call
    [`communicate`][kareus.exec.PartitionScope.communicate] before the slot's op, then
    [`op`][kareus.exec.PartitionScope.op] for each computation op in order. On exit, a collective
    not yet launched (sequential, or a slot never reached) is launched after the ops, and the
    compute stream waits for it.
    """

    def __init__(self, executor: TorchExecutor, key: str, config: LaunchConfig,
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
        """Register the collective ([`PartitionHook.communicate`][kareus.exec.PartitionHook.communicate]); a kind outside
        ``COMM_KINDS`` is a ValueError."""
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
        self._done_event = self._ex._launch_comm(self._comm, self.config.comm_sms,
                                                 getattr(self.config, "backend", None))
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
                raise TypeError(f"{label} must be a CollectiveBackend (kareus.exec.collectives), "
                                f"got {type(backend).__name__}")
        if collective is None:
            raise TypeError("collective must be a CollectiveBackend (kareus.exec.collectives), "
                            "got None")
        if streams is not None and not isinstance(streams, StreamBackend):
            raise TypeError(f"streams must be a StreamBackend, got {type(streams).__name__}")
        if frequency is not None and not isinstance(frequency, FrequencyTrigger):
            raise TypeError("frequency must be a FrequencyTrigger (e.g. StreamOrderedTrigger), "
                            f"got {type(frequency).__name__}")
        if plan is not None:
            _require_plan(plan)
        self.collective: CollectiveBackend = collective
        self.default_collective: CollectiveBackend | None = default_collective
        self.backends: dict[str, CollectiveBackend] = named
        self._plan = plan
        self.streams: StreamBackend = streams if streams is not None else TorchStreamBackend()
        if graphs and not self.streams.supports_graphs:
            raise GraphCaptureError(f"graphs=True, but {type(self.streams).__name__} cannot "
                                    "capture graphs (no CUDA device?): pass graphs=False")
        self.graphs: bool = (self.streams.supports_graphs if graphs is None
                             else bool(graphs))
        self._sequences: dict[str, GraphSequence] = {}
        self._deferred: list[int] | None = None
        self.frequency: FrequencyTrigger | None = frequency
        self._exchange = digest_exchange or _default_digest_exchange
        self._comm_stream: Any = None
        self.comm_high_priority = bool(comm_high_priority)
        self._started = False
        self.current = None

    # -- setup -----------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:  # type: ignore[override]
        """The plan applied; setting another one drops every captured graph (they hold
        the old plan's slots, SM counts and clocks) and asks for
        [`start`][kareus.exec.TorchExecutor.start] again."""
        return self._plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        """Apply another plan (drops the graphs; call [`start`][kareus.exec.TorchExecutor.start] again)."""
        if plan is not None:
            _require_plan(plan)
        if plan is not self._plan:
            self.release_graphs()
            self._started = False
        self._plan = plan

    @property
    def comm_stream(self) -> Any:
        """The side stream collectives run on (created on first use)."""
        if self._comm_stream is None:
            self._comm_stream = self.streams.new_stream(
                name="comm", high_priority=self.comm_high_priority)
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

    def _require_started(self) -> None:
        if self.plan is not None and not self._started:
            raise PlanError("call executor.start() first: ranks must compare the plan's digest "
                            "before any collective runs under it")

    def empty(self, shape: int | Sequence[int], dtype: Any, *, kind: str = "all_reduce") -> Any:
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
        """
        for backend in (self.collective, *self.backends.values()):
            alloc = getattr(backend, "empty", None)
            route = getattr(backend, "backend_for", None)
            if not callable(alloc) and callable(route):  # one backend per group
                try:
                    alloc = getattr(route(kind), "empty", None)
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

    # -- the mechanism ---------------------------------------------------------------
    def _launch_comm(self, comm: tuple[str, Any, Any], sms: int | None,
                     backend_name: str | None = None) -> Any:
        kind, tensor, output = comm
        backend = self.backend_for(sms, backend_name)
        compute = self.streams.current_stream()
        side = self.comm_stream
        ready = self.streams.record_event(compute)
        self.streams.wait_event(side, ready)
        with self.streams.use_stream(side):
            if kind == "all_reduce":
                backend.all_reduce(tensor, side, sms)
            else:
                getattr(backend, kind)(output, tensor, side, sms)
        return self.streams.record_event(side)

    def _join(self, done_event: Any) -> None:
        self.streams.wait_event(self.streams.current_stream(), done_event)

    def run_partition(self, ops: Sequence[Callable[[], Any]], op_names: Sequence[str],
                      comm_tensor: Any, config: LaunchConfig, *,
                      comm_kind: str = "all_reduce", comm_output: Any = None) -> None:
        """Enqueue one partition ([`Executor.run_partition`][kareus.exec.Executor.run_partition]): ``ops`` in order on the
        current stream, the collective on the side stream from ``config``'s slot. The
        configuration's ``freq_mhz`` is ignored here: the clock is set per microbatch
        ([`microbatch`][kareus.exec.TorchExecutor.microbatch]).

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
                        comm_tensors: Sequence[Any], config: LaunchConfig, *,
                        comm_kind: str = "all_reduce", comm_outputs: Sequence[Any] | None = None,
                        ) -> None:
        """Run one layer segment over ``n >= 2`` nanobatches with overlap.

        Nanobatch ``i``'s computation (``op(i)`` for each op) overlaps the collective of
        nanobatch ``i-1``, launched at ``config``'s slot; the last nanobatch's collective
        runs after the computation (exposed), or overlaps the next segment when the
        caller chains segments through [`partition`][kareus.exec.TorchExecutor.partition].
        Sequential configurations run each nanobatch's collective right after its computation.

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
        backend = getattr(config, "backend", None)
        # Nanobatch 0 has no previous collective to overlap.
        for fn in ops:
            fn(0)
        for i in range(1, n):
            if seq:
                self._run_exposed(comm_tensors[i - 1], comm_kind, outs[i - 1], config.comm_sms,
                                  backend)
                for fn in ops:
                    fn(i)
                continue
            scope = PartitionScope(self, f"nanobatch{i}", config, op_names)
            scope.communicate(comm_tensors[i - 1], kind=comm_kind, output=outs[i - 1])
            for name, fn in zip(op_names, ops):
                scope.op(name, fn, i)
            scope.close()
        self._run_exposed(comm_tensors[n - 1], comm_kind, outs[n - 1], config.comm_sms,
                          backend)

    def _run_exposed(self, tensor: Any, kind: str, output: Any, sms: int | None,
                     backend: str | None = None) -> None:
        done = self._launch_comm((kind, tensor, output), sms, backend)
        self._join(done)

    # -- graphs ----------------------------------------------------------------------
    def capture(self, name: str, bodies: Sequence[Callable[[], Any]], *,
                signature: Any = None, warmup: int = 1) -> GraphSequence:
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
            raise ValueError("nothing to capture: bodies is empty")
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
        pool = self.streams.graph_pool()
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
        trigger = self.frequency
        request = None if trigger is None else (
            lambda f: trigger.request(f, stream=self.streams.current_stream()))
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

    # -- training-loop hooks ---------------------------------------------------------
    @contextlib.contextmanager
    def partition(self, key: str, *, config: LaunchConfig | None = None,
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
            if self._deferred is not None and self.streams.is_capturing():
                # A trigger without host nodes: issued right before this graph's replay.
                self._deferred.append(f)
            else:
                self.frequency.request(f, stream=self.streams.current_stream())
        prev = self.current
        self.current = (stage, microbatch, phase)
        try:
            yield None
        finally:
            self.current = prev
