"""The executor role: what a training loop and the NVML profiler's runner rely on.

[`Executor`][kareus.exec.Executor] runs partitions (and microbatches of them) under configurations
or a plan. It is a template: the role itself owns everything that must be the same in every
implementation, and a subclass says only how its device does three things.

What the role owns (concrete methods, the same for every executor):

* the plan and its agreement across ranks ([`start`][kareus.exec.Executor.start] compares digests;
  a partition under a plan before ``start`` is a ``PlanError``);
* the microbatch scope ([`microbatch`][kareus.exec.Executor.microbatch]: ``current`` names the
  computation, the plan's clock for it is requested at its start);
* the partition scope ([`partition`][kareus.exec.Executor.partition] yields a
  [`PartitionScope`][kareus.exec.PartitionScope]): the collective named by ``communicate``, the
  ops issued in order (checked against ``op_names`` when given: ``ConfigError``), the collective
  launched right before the op of its launch slot, or after every op when the configuration is
  sequential, and joined at the end of the scope;
* [`run_partition`][kareus.exec.Executor.run_partition] and
  [`run_nanobatched`][kareus.exec.Executor.run_nanobatched] built on that scope (an unknown slot is an
  ``UnknownSlotError``, fewer than two nanobatches a ``ValueError``), and
  [`run_collective`][kareus.exec.Executor.run_collective] (a collective by itself, as the outside
  work runs them).

What a subclass implements (the hooks, called in stream order):

* [`launch_collective`][kareus.exec.Executor.launch_collective] - start one collective
  ([`CollectiveLaunch`][kareus.exec.CollectiveLaunch]: its kind, tensors, SM count, backend and
  slot) now, beside the compute that follows; return a handle;
* [`join_collective`][kareus.exec.Executor.join_collective] - make what comes next wait for it;
* [`request_clock`][kareus.exec.Executor.request_clock] - ask for a microbatch computation's clock.

and may override [`launch_op`][kareus.exec.Executor.launch_op] (default: call the op),
[`empty`][kareus.exec.Executor.empty] (the communication buffers; default ``torch.zeros``) and the
graph capability ([`graphs`][kareus.exec.Executor.graphs], [`capture`][kareus.exec.Executor.capture],
[`sequence`][kareus.exec.Executor.sequence], [`release_graphs`][kareus.exec.Executor.release_graphs];
default: no graphs, everything runs eagerly).

[`TorchExecutor`][kareus.exec.TorchExecutor] implements the hooks on CUDA streams (events, a
high-priority side stream, SM-capped collective backends, a stream-ordered frequency trigger,
CUDA graphs); ``kareus.testing`` has a recording fake built on the same template and a
conformance suite (``check_executor``). ``LaunchConfig`` is what an executor reads of a
configuration (the launch slot and the SM count, not the clock, which is applied per
microbatch). ``COMM_KINDS`` are the collectives an executor launches.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import attrs

from kareus._logging import get_logger
from kareus.compose import Plan
from kareus.errors import ArgumentError, ConfigError, GraphCaptureError, PlanError, UnknownSlotError
from kareus.exec._graphs import GraphSequence
from kareus.exec.plan_lookup import ComputationId, _require_plan, plan_config, plan_frequency

__all__ = ["COMM_KINDS", "CollectiveLaunch", "Executor", "LaunchConfig", "PartitionHook",
           "PartitionScope"]

_log = get_logger(__name__)

#: Collective kinds the executor can launch (the names of ``CollectiveBackend`` methods).
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

#: The parallel groups a collective may name (``None``: routed by its kind); ``"ep"``: a
#: mixture of experts' expert-parallel group (its all-to-alls).
COMM_GROUPS = ("tp", "cp", "ep")

#: An all-to-all's splits: ``(output_splits, input_splits)``, host lists of row counts, one
#: per rank (``CollectiveBackend.all_to_all``'s).
Splits = tuple[tuple[int, ...], tuple[int, ...]]


def _check_splits(kind: str, splits: Any) -> Splits | None:
    """``splits`` as a pair of int tuples (an all-to-all needs them; the others take none)."""
    if kind != "all_to_all":
        if splits is not None:
            raise ArgumentError(f"{kind} takes no splits (only all_to_all does)")
        return None
    if splits is None:
        raise ArgumentError("all_to_all needs splits=(output_splits, input_splits), host "
                            "lists of row counts, one per rank")
    try:
        outs, ins = splits
        return tuple(int(v) for v in outs), tuple(int(v) for v in ins)
    except (TypeError, ValueError):
        raise ArgumentError("splits must be (output_splits, input_splits), two lists of row "
                            f"counts, got {splits!r:.60}") from None


def _check_group(group: str | None) -> None:
    if group is not None and group not in COMM_GROUPS:
        raise ArgumentError(f"group must be one of {COMM_GROUPS} or None, got {group!r:.40}")


class LaunchConfig(Protocol):
    """What an executor reads of a partition's configuration: where the collective starts
    and how many SMs it gets.

    A [`ScheduleConfig`][kareus.model.ScheduleConfig] is one (its clock is applied per
    microbatch, not here); so is a baseline's configuration whose ``comm_sms`` is ``None``
    (the collective with its own CTA count, on the executor's ``default_collective``), as
    [`kareus.exec.schedule.DefaultConfig`][kareus.exec.schedule.DefaultConfig] is.
    """

    @property
    def launch_slot(self) -> str | None:
        """The op the collective launches with; ``None`` = after every op (sequential)."""

    @property
    def comm_sms(self) -> int | None:
        """SMs the collective gets; ``None`` = the backend's own choice."""

    @property
    def sequential(self) -> bool:
        """Whether the collective runs after every op (``launch_slot is None``)."""


@attrs.frozen(eq=False)
class CollectiveLaunch:
    """One collective an executor launches now (what
    [`Executor.launch_collective`][kareus.exec.Executor.launch_collective] is given).

    Attributes:
        partition: The partition it belongs to (its type, ``"partition"`` for
            [`run_partition`][kareus.exec.Executor.run_partition], ``"nanobatch{i}"`` for
            nanobatch ``i`` of [`run_nanobatched`][kareus.exec.Executor.run_nanobatched]).
        kind: One of ``COMM_KINDS``.
        tensor: The tensor to all-reduce in place, or the input of an all-gather /
            reduce-scatter.
        output: The output of an all-gather / reduce-scatter / all-to-all (``None`` for
            all-reduce).
        config: The configuration it runs under.
        slot: The op it launches with (it starts right before that op), or ``None``: after
            every op of the partition (sequential, or exposed).
        group: The parallel group it runs over, ``"tp"`` or ``"cp"``, when the caller says
            (``None``: the backend routes by kind, as a
            [`GroupedCollective`][kareus.exec.train.GroupedCollective] does: all-reduces over
            TP, all-gathers and reduce-scatters over CP). Sequence parallelism all-gathers
            and reduce-scatters over TP, so its collectives name their group; a mixture of
            experts' all-to-alls name ``"ep"``.
        splits: An all-to-all's ``(output_splits, input_splits)`` (host tuples of row
            counts, one per rank); ``None`` for the other kinds.
    """

    partition: str
    kind: str
    tensor: Any
    output: Any
    config: LaunchConfig
    slot: str | None
    group: str | None = None
    splits: Splits | None = None

    @property
    def sms(self) -> int | None:
        """SMs it gets (the configuration's ``comm_sms``; ``None``: the backend's own choice)."""
        return self.config.comm_sms

    @property
    def backend(self) -> str | None:
        """The collective backend the configuration names (``ScheduleConfig.backend``), or
        ``None``: the executor's own choice."""
        return getattr(self.config, "backend", None)


@attrs.frozen
class _Exposed:
    """The configuration of a collective run by itself: no launch slot, ``comm_sms`` SMs."""

    comm_sms: int | None
    launch_slot: None = None

    @property
    def sequential(self) -> bool:
        """Always: it runs after everything issued before it."""
        return True


class PartitionHook(abc.ABC):
    """The scope of one partition in a user's loop (what [`Executor.partition`][kareus.exec.Executor.partition] yields).

    Call [`communicate`][kareus.exec.PartitionHook.communicate] to name the partition's collective,
    then [`op`][kareus.exec.PartitionHook.op] for each computation op in order; the executor
    launches the collective at the configured slot.

    Attributes:
        key: The partition type.
        config: The configuration it runs under.
    """

    key: str
    config: LaunchConfig

    @abc.abstractmethod
    def communicate(self, tensor: Any, *, kind: str = "all_reduce", output: Any = None,
                    group: str | None = None, splits: Any = None) -> None:
        """Register the collective of this partition (launched at the configured slot).

        Args:
            tensor: The tensor to all-reduce in place, or the input of an all-gather /
                reduce-scatter / all-to-all.
            kind: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or
                ``"all_to_all"``.
            output: Output tensor of all-gather / reduce-scatter / all-to-all.
            group: The parallel group, ``"tp"``, ``"cp"`` or ``"ep"`` (``None``: routed by
                kind; [`CollectiveLaunch.group`][kareus.exec.CollectiveLaunch]).
            splits: An all-to-all's ``(output_splits, input_splits)``, host lists of row
                counts, one per rank (required for it, refused for the other kinds).
        """

    @abc.abstractmethod
    def op(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run (enqueue) computation op ``name`` as ``fn(*args, **kwargs)``; returns its result.

        Args:
            name: The op's name (launch slots refer to it).
            fn: The callable that enqueues the op.
            *args: Positional arguments of ``fn``.
            **kwargs: Keyword arguments of ``fn``.
        """


class PartitionScope(PartitionHook):
    """The slot state machine of one partition: ops in order, the collective at its slot.

    Created by [`Executor.partition`][kareus.exec.Executor.partition] (and the executor's
    ``run_*`` methods); call [`communicate`][kareus.exec.PartitionScope.communicate] before the
    slot's op, then [`op`][kareus.exec.PartitionScope.op] for each computation op in order. The
    scope asks its executor's hooks to do the work: ``launch_collective`` right before the op
    named by the configuration's ``launch_slot``, ``launch_op`` for each op, and on
    [`close`][kareus.exec.PartitionScope.close] a collective not launched yet (sequential) after
    the ops, then ``join_collective``.

    The rules: a kind outside ``COMM_KINDS`` or an all-gather / reduce-scatter without an
    output is a ``ValueError``; a second collective, or reaching the slot before
    ``communicate``, a ``RuntimeError``; an op out of the declared ``op_names`` order a
    ``ConfigError``; a slot never reached while ``op_names`` was declared an
    ``UnknownSlotError``.

    Attributes:
        key: The partition type.
        config: The configuration it runs under.
        ops_run: The ops issued so far, in order.
    """

    def __init__(self, executor: Executor, key: str, config: LaunchConfig,
                 op_names: Sequence[str] | None = None) -> None:
        self._ex = executor
        self.key = key
        self.config = config
        self._op_names = tuple(op_names) if op_names is not None else None
        self._count = 0
        self._comm: tuple[str, Any, Any, str | None, Splits | None] | None = None
        self._launched = False
        self._handle: Any = None
        self.ops_run: list[str] = []

    def communicate(self, tensor: Any, *, kind: str = "all_reduce", output: Any = None,
                    group: str | None = None, splits: Any = None) -> None:
        """Register the collective ([`PartitionHook.communicate`][kareus.exec.PartitionHook.communicate]); a kind outside
        ``COMM_KINDS``, a group outside ``COMM_GROUPS``, or an all-to-all without splits is a
        ValueError."""
        if kind not in COMM_KINDS:
            raise ArgumentError(f"kind must be one of {COMM_KINDS}, got {kind!r}")
        _check_group(group)
        checked = _check_splits(kind, splits)
        if self._comm is not None:
            raise RuntimeError(f"partition {self.key!r} already has a collective")
        if kind != "all_reduce" and output is None:
            raise ArgumentError(f"{kind} needs an output tensor")
        self._comm = (kind, tensor, output, group, checked)

    def op(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Issue computation op ``name`` (``fn(*args, **kwargs)``) through the executor's
        ``launch_op``, launching the collective first if ``name`` is the configured slot."""
        names = self._op_names
        if names is not None and (self._count >= len(names) or names[self._count] != name):
            expected = names[self._count] if self._count < len(names) else "no more ops"
            raise ConfigError(f"partition {self.key!r}: op {name!r} out of order "
                              f"(expected {expected!r})")
        if not self._launched and self.config.launch_slot == name:
            self._launch(at=name)
        self._count += 1
        self.ops_run.append(name)
        return self._ex.launch_op(self.key, name, fn, *args, **kwargs)

    def _launch(self, *, at: str | None) -> None:
        if self._comm is None:
            raise RuntimeError(
                f"partition {self.key!r} reached its launch slot {self.config.launch_slot!r} "
                "before communicate() named the collective")
        kind, tensor, output, group, splits = self._comm
        self._handle = self._ex.launch_collective(CollectiveLaunch(
            partition=self.key, kind=kind, tensor=tensor, output=output, config=self.config,
            slot=at, group=group, splits=splits))
        self._launched = True

    def close(self) -> None:
        """Launch a pending collective (sequential) and join it into what comes next."""
        if self._comm is None:
            return
        if not self._launched:
            if self.config.launch_slot is not None and self._op_names is not None:
                raise UnknownSlotError(f"partition {self.key!r}: slot "
                                       f"{self.config.launch_slot!r} was never reached")
            self._launch(at=None)
        self._ex.join_collective(self._handle)


def _default_digest_exchange(digest: str) -> list[str]:
    """Every rank's digest over the default process group (this rank's alone without one)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return [digest]
    if not (dist.is_available() and dist.is_initialized()):
        return [digest]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, digest)
    return [str(d) for d in out]


class Executor(abc.ABC):
    """Runs partitions (and microbatches of them) under configurations or a plan.

    The role a training loop and the NVML profiler's runner rely on. Under a plan, call
    [`start`][kareus.exec.Executor.start] first (every rank compares the plan's digest), then wrap
    each microbatch computation in [`microbatch`][kareus.exec.Executor.microbatch] and each
    partition in [`partition`][kareus.exec.Executor.partition]; outside a plan,
    [`run_partition`][kareus.exec.Executor.run_partition] and
    [`run_nanobatched`][kareus.exec.Executor.run_nanobatched] take a configuration directly. Usable
    as a context manager (``with executor:`` calls [`start`][kareus.exec.Executor.start]).

    A template: every method above is concrete and enforces the role's rules; a subclass
    implements [`launch_collective`][kareus.exec.Executor.launch_collective],
    [`join_collective`][kareus.exec.Executor.join_collective] and
    [`request_clock`][kareus.exec.Executor.request_clock], and calls
    ``super().__init__(plan=..., digest_exchange=...)``::

        class MyExecutor(Executor):
            def launch_collective(self, launch):   # now, beside the ops that follow
                return my_backend.start(launch.kind, launch.tensor, launch.output,
                                        sms=launch.sms)
            def join_collective(self, handle):     # what comes next waits for it
                handle.wait()
            def request_clock(self, freq_mhz):     # at the start of a microbatch
                my_clock.request(freq_mhz)

    Args:
        plan: The plan to apply, or ``None`` (then only ``run_*`` and scopes given a
            configuration run).
        digest_exchange: ``digest -> list of every rank's digest``; ``None`` = an
            ``all_gather_object`` over torch's default process group (a single process
            without one, or without torch, compares with itself).

    Attributes:
        plan: The plan the executor applies, or ``None``; setting another one drops every
            captured graph and asks for [`start`][kareus.exec.Executor.start] again.
        current: ``(stage, microbatch, phase)`` of the microbatch computation being run,
            or ``None`` outside [`microbatch`][kareus.exec.Executor.microbatch].
        graphs: Whether this executor captures work into graphs
            ([`capture`][kareus.exec.Executor.capture]); ``False`` for the role's default.
    """

    graphs: bool = False
    """Whether [`capture`][kareus.exec.Executor.capture] captures graphs (the role's default:
    no; callers then run the bodies eagerly)."""

    current: ComputationId | None = None
    # Class-level defaults, so that a subclass that forgets super().__init__() still has
    # the state the template keeps (no plan, not started, the default digest exchange).
    _plan: Plan | None = None
    _started: bool = False
    _exchange: Callable[[str], Sequence[str]] | None = None

    def __init__(self, *, plan: Plan | None = None,
                 digest_exchange: Callable[[str], Sequence[str]] | None = None) -> None:
        if plan is not None:
            _require_plan(plan)
        self._plan = plan
        self._exchange = digest_exchange
        self._started = False
        self.current = None

    # -- the hooks a subclass implements ---------------------------------------------
    @abc.abstractmethod
    def launch_collective(self, launch: CollectiveLaunch) -> Any:
        """Start ``launch``'s collective now, with ``launch.sms`` SMs (``None``: the
        backend's own choice) on ``launch.backend`` (``None``: this executor's choice).

        Called in stream order: at the launch slot right before that op is issued, so the
        collective must depend on everything issued before and overlap what is issued
        after it until [`join_collective`][kareus.exec.Executor.join_collective]; with
        ``launch.slot`` ``None`` after every op of the partition. An executor that runs
        collectives synchronously may simply run it here.

        Returns:
            A handle [`join_collective`][kareus.exec.Executor.join_collective] is given.
        """

    @abc.abstractmethod
    def join_collective(self, handle: Any) -> None:
        """Make everything issued from now on wait for the collective ``handle`` came from
        (a [`launch_collective`][kareus.exec.Executor.launch_collective] result), so that what
        follows the partition sees its result."""

    @abc.abstractmethod
    def request_clock(self, freq_mhz: int) -> None:
        """Request the plan's clock for the microbatch computation starting now
        (``current`` names it). The request must take effect in stream order, where the
        device reaches this point, not when the host does; an executor without frequency
        control does nothing."""

    def launch_op(self, partition: str, name: str, fn: Callable[..., Any], /,
                  *args: Any, **kwargs: Any) -> Any:
        """Issue computation op ``name`` of ``partition``: ``fn(*args, **kwargs)``, whose
        result is returned (override to record or wrap ops; the default calls it)."""
        return fn(*args, **kwargs)

    # -- communication buffers -------------------------------------------------------
    def empty(self, shape: int | Sequence[int], dtype: Any, *, kind: str = "all_reduce",
              group: str | None = None) -> Any:
        """A zeroed buffer for a collective of ``kind`` (what runnable partitions built with
        ``build(collective=executor)`` and the training loop's model allocate their
        communication tensors with).

        The role's default is ``torch.zeros`` on the current CUDA device (on the CPU
        without one); an executor whose collectives want registered memory returns it here.
        Allocations may be collective: every rank asks for the same buffers in the same
        order.

        Args:
            shape: Tensor shape (an int for 1-D).
            dtype: A torch dtype.
            kind: The collective the buffer is for (one of ``COMM_KINDS``).
            group: Its group (``"tp"``, ``"cp"``; ``None``: the kind's usual one).
        """
        import torch

        device = (torch.device("cuda", torch.cuda.current_device())
                  if torch.cuda.is_available() else torch.device("cpu"))
        return torch.zeros(shape, dtype=dtype, device=device)

    # -- graphs (the role's default: none) -------------------------------------------
    def capture(self, name: str, bodies: Sequence[Callable[[], Any]], *,
                signature: Any = None, warmup: int = 1) -> GraphSequence:
        """Capture ``bodies`` into a ``GraphSequence`` replayed
        in order, or return the one captured under ``name`` for the same ``signature`` and
        plan (see [`TorchExecutor.capture`][kareus.exec.TorchExecutor.capture]).

        Raises:
            GraphCaptureError: this executor does not capture graphs (the role's default;
                callers check [`graphs`][kareus.exec.Executor.graphs] first and run the
                bodies eagerly).
        """
        raise GraphCaptureError(f"{type(self).__name__} does not capture graphs "
                                "(graphs is False): call the bodies directly")

    def sequence(self, name: str) -> GraphSequence | None:
        """The graph sequence captured under ``name``, if any (the role's default: none)."""
        return None

    def release_graphs(self, name: str | None = None) -> None:
        """Drop the graphs captured under ``name`` (``None``: all); the role's default
        holds none."""
        return None

    # -- the plan --------------------------------------------------------------------
    @property
    def plan(self) -> Plan | None:
        """The plan applied; setting another one drops every captured graph (they hold
        the old plan's slots, SM counts and clocks) and asks for
        [`start`][kareus.exec.Executor.start] again."""
        return self._plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        """Apply another plan (drops the graphs; call [`start`][kareus.exec.Executor.start] again)."""
        if plan is not None:
            _require_plan(plan)
        if plan is not self._plan:
            self.release_graphs()
            self._started = False
        self._plan = plan

    def start(self) -> None:
        """Agree with every rank on the plan (compare digests) before any collective runs.

        Raises:
            PlanError: some rank holds another plan (the message lists each rank's digest).
        """
        if self.plan is not None:
            mine = str(self.plan.digest)
            every = list((self._exchange or _default_digest_exchange)(mine))
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

    def __enter__(self) -> Executor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    # -- running partitions ----------------------------------------------------------
    def run_partition(self, ops: Sequence[Callable[[], Any]], op_names: Sequence[str],
                      comm_tensor: Any, config: LaunchConfig, *,
                      comm_kind: str = "all_reduce", comm_output: Any = None,
                      comm_group: str | None = None, comm_splits: Any = None) -> None:
        """Enqueue one partition: ``ops`` in order, the collective at ``config``'s slot
        (joined at the end). The configuration's clock is not applied here: it is set per
        microbatch ([`microbatch`][kareus.exec.Executor.microbatch]).

        Args:
            ops: Zero-argument callables that enqueue each computation op.
            op_names: Their names (the slot names refer to them).
            comm_tensor: The tensor the collective acts on.
            config: The schedule configuration.
            comm_kind: The collective (one of ``COMM_KINDS``).
            comm_output: Output tensor of all-gather / reduce-scatter / all-to-all.
            comm_group: Its group (``"tp"``, ``"cp"``, ``"ep"``; ``None``: routed by kind).
            comm_splits: An all-to-all's ``(output_splits, input_splits)``.

        Raises:
            UnknownSlotError: ``config.launch_slot`` is not one of ``op_names``.
            ValueError: ``ops`` and ``op_names`` differ in length.
        """
        if len(ops) != len(op_names):
            raise ArgumentError(f"{len(ops)} ops but {len(op_names)} names")
        if config.launch_slot is not None and config.launch_slot not in op_names:
            raise UnknownSlotError(f"launch slot {config.launch_slot!r} is not one of the ops "
                                   f"{list(op_names)} (or None for sequential)")
        scope = self._open_scope("partition", config, op_names)
        scope.communicate(comm_tensor, kind=comm_kind, output=comm_output, group=comm_group,
                          splits=comm_splits)
        for name, fn in zip(op_names, ops):
            scope.op(name, fn)
        scope.close()

    def run_nanobatched(self, ops: Sequence[Callable[[int], Any]], op_names: Sequence[str],
                        comm_tensors: Sequence[Any], config: LaunchConfig, *,
                        comm_kind: str = "all_reduce", comm_outputs: Sequence[Any] | None = None,
                        comm_group: str | None = None, comm_splits: Any = None) -> None:
        """Run one layer segment over ``n >= 2`` nanobatches, each nanobatch's collective
        overlapping the next nanobatch's computation from ``config``'s slot on.

        Nanobatch ``i``'s computation (``op(i)`` for each op) overlaps the collective of
        nanobatch ``i-1`` (the scope ``"nanobatch{i-1}"``), launched at ``config``'s slot;
        the last nanobatch's collective runs after the computation (exposed), or overlaps
        the next segment when the caller chains segments through
        [`partition`][kareus.exec.Executor.partition]. Sequential configurations run each
        nanobatch's collective right after its computation.

        Args:
            ops: Callables ``op(i)`` that enqueue an op for nanobatch ``i``.
            op_names: Their names.
            comm_tensors: Per nanobatch, the tensor its collective acts on (written by
                that nanobatch's computation).
            config: The schedule configuration.
            comm_kind: The collective.
            comm_outputs: Per nanobatch, the output tensor (all-gather / reduce-scatter).
            comm_group: The collectives' group (``"tp"``, ``"cp"``, ``"ep"``; ``None``:
                routed by kind).
            comm_splits: The all-to-alls' ``(output_splits, input_splits)``, the same for
                every nanobatch.

        Raises:
            ValueError: fewer than two nanobatches.
        """
        n = len(comm_tensors)
        if n < 2:
            raise ArgumentError(f"nanobatching needs n >= 2 nanobatches, got {n}")
        outs = list(comm_outputs) if comm_outputs is not None else [None] * n
        # Nanobatch 0 has no previous collective to overlap.
        for fn in ops:
            fn(0)
        for i in range(1, n):
            if config.sequential:
                self._run_exposed(f"nanobatch{i - 1}", comm_kind, comm_tensors[i - 1],
                                  outs[i - 1], config, group=comm_group, splits=comm_splits)
                for fn in ops:
                    fn(i)
                continue
            scope = self._open_scope(f"nanobatch{i - 1}", config, op_names)
            scope.communicate(comm_tensors[i - 1], kind=comm_kind, output=outs[i - 1],
                              group=comm_group, splits=comm_splits)
            for name, fn in zip(op_names, ops):
                scope.op(name, fn, i)
            scope.close()
        self._run_exposed(f"nanobatch{n - 1}", comm_kind, comm_tensors[n - 1], outs[n - 1],
                          config, group=comm_group, splits=comm_splits)

    def run_collective(self, kind: str, tensor: Any, output: Any = None, *,
                       sms: int | None = None, partition: str = "collective",
                       group: str | None = None, splits: Any = None) -> None:
        """Run one collective by itself, in stream order: after everything issued so far,
        and what comes next waits for it (the outside work's collectives, which run among
        its ops rather than beside them). The role's default launches and joins it through
        the hooks, with no launch slot.

        Args:
            kind: One of ``COMM_KINDS``.
            tensor: The tensor to all-reduce in place, or the input of an all-gather /
                reduce-scatter.
            output: The output of an all-gather / reduce-scatter.
            sms: SMs it gets (``None``: the backend's own choice).
            partition: What it belongs to (for the hooks' records).
            group: Its group (``"tp"``, ``"cp"``, ``"ep"``; ``None``: routed by kind).
            splits: An all-to-all's ``(output_splits, input_splits)``.

        Raises:
            ValueError: ``kind`` is not one of ``COMM_KINDS``, an all-gather /
                reduce-scatter / all-to-all has no output, or an all-to-all no splits.
        """
        if kind not in COMM_KINDS:
            raise ArgumentError(f"kind must be one of {COMM_KINDS}, got {kind!r}")
        if kind != "all_reduce" and output is None:
            raise ArgumentError(f"{kind} needs an output tensor")
        _check_group(group)
        self._run_exposed(partition, kind, tensor, output, _Exposed(comm_sms=sms), group=group,
                          splits=_check_splits(kind, splits))

    def _open_scope(self, key: str, config: LaunchConfig,
                    op_names: Sequence[str] | None) -> PartitionScope:
        """A new partition scope: the one place scopes are made (a subclass may make a
        [`PartitionScope`][kareus.exec.PartitionScope] of its own, or record the scope)."""
        return PartitionScope(self, key, config, op_names)

    def _run_exposed(self, key: str, kind: str, tensor: Any, output: Any,
                     config: LaunchConfig, *, group: str | None = None,
                     splits: Any = None) -> None:
        """A collective after everything issued so far, joined right away."""
        self.join_collective(self.launch_collective(CollectiveLaunch(
            partition=key, kind=kind, tensor=tensor, output=output, config=config, slot=None,
            group=group, splits=_check_splits(kind, splits))))

    # -- training-loop hooks ---------------------------------------------------------
    @contextlib.contextmanager
    def partition(self, key: str, *, config: LaunchConfig | None = None,
                  op_names: Sequence[str] | None = None) -> Iterator[PartitionScope]:
        """Hook for a user's loop: the scope of one partition of type ``key``, under the
        plan's configuration of the current microbatch computation unless ``config`` is
        given. The scope's collective is launched and joined as it closes (not when the
        block raises).

        Args:
            key: The partition type (e.g. ``"fwd_attn"``).
            config: Override the plan's configuration.
            op_names: Expected op order, checked as ops are issued (optional).

        Raises:
            PlanError: neither a plan nor ``config``; a plan not agreed on with
                [`start`][kareus.exec.Executor.start]; or no ``current`` computation (outside
                [`microbatch`][kareus.exec.Executor.microbatch]) or no configuration of ``key``
                in it.
        """
        if config is None:
            if self.plan is None:
                raise PlanError(f"no plan and no config for partition {key!r}")
            self._require_started()
            config = plan_config(self.plan, key, self.current)
        scope = self._open_scope(key, config, op_names)
        ok = False
        try:
            yield scope
            ok = True
        finally:
            if ok:
                scope.close()

    @contextlib.contextmanager
    def microbatch(self, stage: int, microbatch: int, phase: str) -> Iterator[None]:
        """Hook for a user's loop around one microbatch computation: ``current`` names it
        inside, and under a plan its clock is requested at its start
        ([`request_clock`][kareus.exec.Executor.request_clock]), in stream order.

        Args:
            stage: Pipeline stage.
            microbatch: Microbatch index.
            phase: ``"fwd"`` or ``"bwd"``.

        Raises:
            ValueError: ``phase`` is neither.
            PlanError: a plan not agreed on with [`start`][kareus.exec.Executor.start], or
                without this computation.
        """
        if phase not in ("fwd", "bwd"):
            raise ArgumentError(f"phase must be 'fwd' or 'bwd', got {phase!r}")
        self._require_started()
        freq = (None if self.plan is None
                else plan_frequency(self.plan, stage, microbatch, phase))
        prev = self.current
        self.current = (stage, microbatch, phase)
        try:
            if freq is not None:
                self.request_clock(freq)
            yield None
        finally:
            self.current = prev
