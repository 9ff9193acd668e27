"""Planned layers and CUDA graphs: launched into someone else's capture, or replayed from
graphs of their own.

**Inside an enclosing capture.** When the current CUDA stream is being captured
(``torch.cuda.is_current_stream_capturing()``: torchtitan's step capture, Megatron-Core's
``cuda_graph_impl="local"``, a user's own ``torch.cuda.graph``), a planned layer or stack
enqueues its kernels as it would eagerly, and they go into that capture: the collectives on
the executor's side stream (forked and joined through events, which the capture turns into
graph edges), the microbatch scope's clock request as a host node (the stream-ordered
trigger's host-function marker; the event-polling marker cannot be captured and says so).
No graph of its own is captured or replayed there. What a capture cannot hold is refused in
one line: set-up on a computation's first run (programs, registered buffers, communicators,
the kernels' first launches: the framework's warm-up step runs it first), the ranks'
digest exchange of the plan (``applier.start()`` before the capture), and a plan whose
microbatch computations differ when the capture may be replayed for every microbatch
(``PlanApplier(whole_step_capture=True)`` says it holds the whole step).

**Graphs of its own** (``PlanApplier(graphs=True)``, the default on a CUDA device): each
distinct computation is captured once by the executor
([`TorchExecutor.capture`][kareus.exec.TorchExecutor.capture]: its collectives at the plan's
slots and SM counts, the cross-stream events, in one graph) and replayed after that. For a
chained stack ([`PlannedStack`][kareus.integrations.PlannedStack]) a graph is the whole
microbatch computation of the stack, as the training loop's graphs are. What a graph reads
and writes must stay at the addresses it was captured with:

* **the forward's input** is read in place when it is a static output this runner lent
  (the previous layer's output: a graph captured for that address reads it there),
  copied into the forward graph's static buffer otherwise (one copy kernel; the
  backward's output gradient likewise: read in place when it is the next layer's lent
  input gradient); the forward graph writes the inputs of layers ``1 ..`` it keeps for
  the backward into its own static outputs;
* **the backward reads what its forward kept in place**: the forward graph's static input
  and kept inputs are its *slot*, which the backward graph of that forward reads where they
  lie (no clone out of the forward, no copy into the backward). A later replay of the same
  forward graph before that backward (several microbatches' forwards before their
  backwards, a forward under ``torch.no_grad`` in between) first clones the slot for the
  pending backward, which copies it back before its replay; a forward whose backward can no
  longer run (its autograd node freed) is not cloned for;
* **a graph per layer**: the default executors' graphs share one memory pool
  (``shared_pool_streams``), so each layer (or stack) gets its own graphs once its first
  weight has come back at the same address on a later call (at most the model's layer
  count per computation; calls before that, and beyond it, share one graph). Sharing the
  pool is safe because nothing a later replay could overwrite is read after another graph
  ran: static inputs, outputs and the kept inputs live outside the pool. An executor
  given by the caller keeps a pool per graph, and layers of one shape share a graph
  (their weights copied in);
* **weights** are read where they lie when the graph is captured (a parameter, or a view of
  one such as ``linear``'s transpose: the framework's optimizer updates it in place between
  replays). A weight that lies elsewhere on a later call (one made anew on every call, as
  ``qkv_from_separate``'s concatenation, when the allocator does not hand it the same
  memory; a framework that reallocates its parameters; another layer's weights in a
  shared graph) makes the runner capture that computation again with the weight copied
  into a static buffer from then on. The test is the address alone, which is exact: a
  tensor at the captured address is what the graph reads, whatever made it;
* **outputs are lent**: the layer's output, the input gradient and the weight gradients
  are static buffers the graph writes (allocated outside its pool, the weight gradients
  in the layout eager execution gives them), handed to autograd as aliases, not clones.
  Whoever takes them (the next op that saves the output, a ``.grad`` that steals a
  weight gradient, the framework's hooks that add it into ``main_grad``) holds a
  reference to the buffer's storage; a graph is replayed only when the references to
  each of its outputs' storages are the runner's own again
  (``torch._C._storage_Use_Count``, the liveness test of PyTorch's CUDA graph trees).
  Otherwise the call replays (or captures, once) another copy of the graph; beyond
  ``LEND_SLOTS`` held copies per computation a new copy clones its outputs (a caller that
  keeps every output costs a copy each, not a graph each). The gradients still reach the
  framework through autograd, per microbatch, so its hooks run as for an eager layer:
  writing them into its gradient buffers inside the graph would bypass those hooks. A
  lent tensor read on another stream must be released only once the current stream is
  ordered after that read (as PyTorch's allocator asks without ``record_stream``).

**Memory per graph** (activation = ``batch x seq / CP x hidden`` elements of the compute
dtype; ``L`` = the stack's layers): a forward graph holds its static input (none when it
reads its input in place) and output (2 activations) and the kept inputs (``L - 1``
activations); a backward graph reading its forward's slot holds the output gradient (none
in place) and the input gradient (2 activations) and the weight gradients (the ``L``
layers' weights' size); the lent outputs are what autograd holds anyway (eager
execution allocates them afresh), and each further copy of a graph (outputs held at once)
holds its own; a backward graph fed copies (its
forward's graph was captured again since) holds the input and kept inputs as well (``L + 2``
activations); a copied weight adds its size. The pool (shared by the executor's graphs, or one per graph
with an executor given) holds the peak of the temporaries a computation allocates (one
layer's recomputed forward and backward at a time). One forward and one backward graph per
plan choice, shape and layer (two microbatches with one choice share them); the backward
graphs are per forward graph whose slot they read. Per layer of a model run one node per
layer, so: about 4 activations (static input, output; output gradient, input gradient,
the backward reading its forward's input) plus its weights' size, per plan choice.

**Kept activations** (recomputation ``"none"`` or ``"selective"``): what the forward keeps
for the backward stays where the forward graph wrote it, in the graph's static buffers
(its memory pool), and is lent to the layer's autograd node
(``KeptActivations``) instead of being copied out; the backward graph of that
forward reads them in place. While they are lent the forward graph is not replayed: the
next forward of the same shape replays another copy of the graph (a *slot*), captured the
first time every slot is lent, so there are as many slots as forwards of that shape whose
backward is pending at once (a framework's layers, each one node, use one slot per layer
and microbatch in flight): the activations take the memory eager execution would give
them, and no copy. A slot is free again when its backward has run, or when the autograd
graph holding it is dropped without one. The forward's attention must then run on the
fused kernels (flash or cuDNN), whose saved state is plain tensors: attention through
autograd (a CP piece whose mask is not causal's) is refused with ``"none"``.
Such forward graphs keep a memory pool each (the applier's default executors share one
pool among all graphs only under full recomputation): kept activations allocated in a
shared pool could lie where another graph's temporaries do, which that graph's replay
would overwrite while they are lent. Their backward graphs share one pool (on a
``TorchExecutor``: ``GraphedRunner._backward_pool``): they read their forward slot's
buffers where they lie, in the forward's pool, and their outputs (the input and weight
gradients, lent or cloned) are static buffers allocated outside any pool, so the pool
holds the largest backward's temporaries once, not once per layer and slot.

So, what graphs keep resident, per policy (what ``bench/recompute_policy.py`` reports as
``footprint``): a forward slot keeps its kept activations allocated for as long as the
graph lives (whether lent or not: its static outputs), and its pool the forward's
temporaries; under ``"full"`` the slot keeps only the layers' inputs and every graph
shares one pool. A peak of allocated memory measured around replays does not see any of
it (a replay allocates nothing): measure reserved memory, graphs included.

A graph is keyed by what changes the captured work: phase, depth, nanobatch count,
whether the plan runs the computation unsplit, the plan's choice for the computation (its
configurations and SM counts), shapes and dtypes (``computation_signature``). The
microbatch scope's clock request is made when the scope is entered, outside the graphs, as
in eager execution.

Why not ``torch.cuda.make_graphed_callables``: it captures through autograd, while a
planned layer's forward and backward are already one autograd node each whose inside is
kareus's executor (two streams, events, capped communicators); capturing that inside is
the executor's job, and this module only keeps its buffers still.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import attrs

from kareus.errors import ArgumentError, GraphCaptureError
from kareus.integrations._kept import KeptActivations

__all__ = ["GraphMemory", "GraphedRunner", "KeptInputs", "capture_in_progress",
           "computation_signature"]

#: Addresses per computation and input at which graphs read that input in place.
IN_PLACE_ADDRESSES = 16

#: Copies of one computation's graph whose static outputs may be held by callers at once
#: (lent, not cloned) before further copies clone their outputs instead: outputs kept by
#: the caller beyond this cost a copy each, not a graph each.
LEND_SLOTS = 4


@attrs.frozen
class GraphMemory:
    """What a planned-layer applier's own graphs hold (``PlanApplier.graph_memory()``).

    Attributes:
        graphs: Graphs captured and kept (every copy and input-address variant).
        lending: Of those, graphs that lend their static outputs (the rest clone them).
        static_bytes: Their static buffers: inputs copied in, outputs, kept inputs,
            copied weights (the memory pools' temporaries are not counted: the caching
            allocator's figures hold them).
    """

    graphs: int
    lending: int
    static_bytes: int

    @property
    def static_bytes_per_graph(self) -> float:
        """The static buffers' mean size per graph (0 without graphs)."""
        return self.static_bytes / self.graphs if self.graphs else 0.0


def _can_count() -> bool:
    """Whether this PyTorch tells how many tensors share a storage (the test of whether a
    lent output is still held); without it outputs are cloned."""
    import torch

    return callable(getattr(torch._C, "_storage_Use_Count", None))


def shared_pool_streams() -> Any:
    """CUDA streams whose graphs all share one memory pool (a
    [`TorchStreamBackend`][kareus.exec.TorchStreamBackend] whose ``graph_pool`` is always the
    same): the default executors of a graphed applier, so that a graph per layer costs its
    static buffers, not a pool of temporaries each. Sharing is safe here because what
    outlives a replay is allocated outside the pool (static inputs, the kept inputs a
    backward reads) or read right after the replay, before any other graph runs (the
    outputs cloned out)."""
    from kareus.exec import TorchStreamBackend

    class SharedPoolStreams(TorchStreamBackend):
        shares_graph_pool = True

        def graph_pool(self) -> Any:
            pool = getattr(self, "_shared_pool", None)
            if pool is None:
                pool = self._shared_pool = super().graph_pool()
            return pool

    return SharedPoolStreams()


def _shares_pool(executor: Any) -> bool:
    """Whether ``executor``'s graphs share one memory pool (its streams say so)."""
    return bool(getattr(getattr(executor, "streams", None), "shares_graph_pool", False))


def capture_in_progress() -> bool:
    """Whether work enqueued now on the current CUDA stream goes into a graph that someone
    is capturing (the framework's step capture, a user's ``torch.cuda.graph``).

    ``torch.cuda.is_current_stream_capturing()``, asked only once CUDA has started in this
    process (before that nothing can be capturing, and asking would start it): a planned
    layer then launches its kernels into that capture instead of capturing or replaying
    graphs of its own.
    """
    import torch

    if not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def computation_signature(applier: Any, phase: str, x: Any,
                          weights: Sequence[Sequence[Any]],
                          inputs: Sequence[Any] | KeptInputs | KeptActivations | None
                          ) -> tuple[Any, ...]:
    """What changes the work a planned computation enqueues: phase, depth, nanobatch count,
    whether the plan runs it unsplit, the plan's choice for it (its configurations and SM
    counts), shapes, strides and dtypes. Two calls with one signature enqueue the same
    kernels on tensors of the same layout (a graph of one replays the other)."""
    # the plan's choice (frequency, nanobatches, every configuration and SM count) as a
    # number per distinct choice: the applier looks it up once per computation and plan
    n, unsplit, choice = applier._computation_choice(phase)
    # shapes as torch.Size (a tuple: equal and hashed as one)
    wsig = tuple([(w.shape, w.stride(), w.dtype) for ws in weights for w in ws])
    kept = (-1 if isinstance(inputs, KeptActivations)  # every activation a policy keeps
            else len(inputs or ()))
    return (phase, len(weights), n, unsplit, choice, x.shape, x.dtype, x.device, wsig, kept)


class _Slot:
    """A forward graph's static buffers that its backward graphs read in place: the
    stack's input (the copy the forward read) and the inputs of layers ``1 ..`` the
    forward kept (static buffers the graph writes, outside its memory pool); and the
    forward whose backward they hold now (a weak reference to its [`KeptInputs`][kareus.integrations._graphed.KeptInputs]).
    """

    serials = 0

    def __init__(self, forward: _Captured) -> None:
        # the forward's buffers, not the forward itself: the forward holds its slot, and
        # a cycle would leave the forward's graph to the garbage collector, which may run
        # (and destroy it) inside a later capture
        self._x = forward.x
        self.x_ptr = forward.x_ptr  # the input's address, read in place when ``x`` is None
        self._kept = list(forward.kept)
        self.owner: Any = None
        self.retired = False
        _Slot.serials += 1
        self.serial = _Slot.serials

    @property
    def x(self) -> Any:
        """The forward graph's static input (``None``: it reads its input in place, at
        ``x_ptr``, where autograd keeps it for the backward)."""
        return self._x

    @property
    def kept(self) -> list[Any]:
        """The inputs of layers ``1 ..`` the forward graph writes (static buffers allocated
        outside its memory pool)."""
        return list(self._kept)

    def holder(self) -> KeptInputs | None:
        """The pending forward whose backward these buffers hold (``None``: free)."""
        return None if self.owner is None else self.owner()

    def evict(self) -> None:
        """Before the buffers are overwritten: give the pending forward's backward clones
        of them (enqueued before the overwrite, so they hold what it kept)."""
        held = self.holder()
        if held is not None and held.clones is None:
            held.clones = [t.clone() for t in self.kept]
        self.owner = None


class KeptInputs:
    """What a graphed forward hands its backward instead of copies of what it kept: its
    forward graph's slot, read in place by the backward graph while no later replay of
    that forward has overwritten it, or clones of it made right before such a replay.

    ``len()`` is the number of kept inputs (layers ``1 ..``); ``tensors()`` gives them.
    """

    def __init__(self, slot: _Slot) -> None:
        self.slot = slot
        self.clones: list[Any] | None = None
        slot.owner = weakref.ref(self)

    def __len__(self) -> int:
        return len(self.slot._kept)

    def in_place(self) -> bool:
        """Whether the slot still holds this forward's buffers."""
        return self.clones is None and self.slot.holder() is self

    def tensors(self) -> list[Any]:
        """The kept inputs of layers ``1 ..`` (the slot's own while they are this
        forward's; clones otherwise)."""
        return list(self.slot.kept if self.clones is None else self.clones)


class _Captured:
    """One captured computation: its graph sequence, static buffers and static outputs."""

    def __init__(self) -> None:
        self.seq: Any = None
        self.x: Any = None
        self.dy: Any = None
        self.inputs: list[Any] = []
        self.slot: _Slot | None = None  # a forward's; the slot a backward reads
        self.kept: list[Any] = []  # a forward's static kept inputs
        # per layer, per weight: the tensor the graph reads, and whether it is a copy
        self.weights: list[list[Any]] = []
        self.copied: list[list[bool]] = []
        self.ptrs: list[list[int]] = []
        self.result: Any = None
        self.ran: list[tuple[str, Any]] = []
        self.lent = False  # a forward slot's kept activations are lent to a pending backward
        self.lendings = 0  # how many times they were lent (which lending a release frees)
        # a forward slot: its capture's number; a backward: that of the slot it reads
        self.generation = 0
        self.phase = "fwd"
        # the static outputs the graph writes (output, or input and weight gradients),
        # lent to autograd (``lends``) or cloned after each replay; the references to
        # their storages the runner itself holds (``settle``)
        self.outs: list[Any] = []
        self.lends = False
        self.own_refs: list[int] = []
        # the outputs' storages (``_cdata``: held by ``outs``) and the count function,
        # set by ``settle``: ``busy`` asks only these on every call
        self._storages: list[int] = []
        self._use_count: Any = None
        # every weight's address at the capture when none is copied (``_moved``'s fast
        # test), else None; the (layer, weight) of the copied ones (``_copy_in``)
        self.read_ptrs: list[int] | None = None
        self.copy_idx: list[tuple[int, int]] = []
        # inputs read in place: the caller's tensors during a capture or replay only
        self.current: tuple[Any, Any] = (None, None)
        self.x_ptr = 0  # where the forward's input was when it was captured
        self.key: tuple[Any, ...] = ()
        self.family: tuple[Any, ...] = ()  # the computation, whatever copy or variant
        self.rule: tuple[Any, ...] = ()  # the weights it reads (``_copy_always``)

    def settle(self) -> None:
        """Count the references the runner itself holds to each static output's storage
        (the buffers, the graph's result): more later means a caller still holds one.
        The count is ``torch._C._storage_Use_Count`` (how many references hold a storage:
        tensors and views on it, saved tensors of autograd, ``.grad`` fields; the count
        PyTorch's own CUDA graph trees test their outputs' liveness with), asked of the
        storages found here once (``outs`` holds them for the graph's life)."""
        if self.lends:
            import torch

            self._use_count = torch._C._storage_Use_Count
            self._storages = [t.untyped_storage()._cdata for t in self.outs]
            self.own_refs = [self._use_count(c) for c in self._storages]
        else:
            self.own_refs = []

    def busy(self) -> bool:
        """Whether a caller still holds a static output this graph lent (an output that
        autograd saved for a backward, a gradient that became a ``.grad``, a view of
        either): its next replay would overwrite it. When none is held, the counts are
        the runner's own and become the reference (a reference of the runner's that was
        there when it settled and has gone since cannot hide a caller's later)."""
        if not self.lends:
            return False
        counts = list(map(self._use_count, self._storages))
        if counts == self.own_refs:  # the usual case: nothing held
            return False
        if any(c > n for c, n in zip(counts, self.own_refs, strict=True)):
            return True
        self.own_refs = counts
        return False

    def hand_out(self, t: Any) -> Any:
        """A static output for the caller: lent (an alias of the static buffer, which
        ``busy`` then reports held until every alias of it is gone), or cloned."""
        return t.detach() if self.lends else t.clone()


class GraphedRunner:
    """Runs a [`PlanApplier`][kareus.integrations.PlanApplier]'s computations from CUDA
    graphs (see the module docstring).

    Args:
        applier: The applier whose programs and executors run the captured work.

    Attributes:
        captures: Graphs captured so far (a re-capture counts again).
        loads: Backwards whose kept inputs were copied back into their forward's slot
            (another forward of that graph ran in between).
    """

    def __init__(self, applier: Any) -> None:
        import weakref

        # weakly: the applier holds its runner, and a cycle would leave the runner's
        # graphs to the garbage collector (``kareus.exec._streams.CapturedGraph``)
        self._applier = weakref.ref(applier)
        self._graphs: dict[tuple[Any, ...], _Captured] = {}
        # (weights a graph reads, layer, weight) that moved once: copied in from then on
        self._copy_always: set[tuple[tuple[Any, ...], int, int]] = set()
        self._names: dict[tuple[Any, ...], str] = {}
        self._seen: dict[tuple[Any, ...], set[int]] = {}
        self._own: dict[tuple[Any, ...], set[int]] = {}
        self._slots: dict[tuple[Any, ...], list[_Captured]] = {}
        self._in_place: dict[tuple[Any, ...], set[int]] = {}
        self._lent_ptrs: set[int] = set()  # where the static outputs this runner lends lie
        self._families: dict[tuple[Any, ...], list[_Captured]] = {}
        self._backward_pools: dict[int, tuple[Any, Any]] = {}
        self.captures = 0
        self.loads = 0

    @property
    def applier(self) -> Any:
        """The applier whose programs and executors run the captured work."""
        applier = self._applier()
        if applier is None:
            raise GraphCaptureError("this graphed runner's PlanApplier is gone: run "
                                    "through the applier")
        return applier

    def run(self, phase: str, x: Any, weights: Sequence[Sequence[Any]], dy: Any = None,
            inputs: Sequence[Any] | KeptInputs | None = None, *,
            number: int | None = None) -> tuple[Any, Any]:
        """``PlanApplier.run`` from a graph: inputs read in place or copied in, replay,
        outputs lent or cloned (see the module
        docstring). A forward returns its kept inputs as a ``KeptInputs``. ``number``: the
        applier's number for the computation's ``computation_signature``
        (``PlanApplier._signature_number``), when the caller has it. The runner's keys
        start with that number, not the signature itself: a signature holds every
        weight's layout, and a dictionary hashes its key again on every look-up."""
        ap = self.applier
        if number is None:
            number = ap._signature_number(phase, x, weights, inputs)
        key: tuple[Any, ...] = (number,)
        if ap.workload.recompute != "full":  # activations kept: lent slots
            if phase == "fwd":
                return self._forward_kept(key, x, weights)
            if not isinstance(inputs, KeptActivations):
                raise ArgumentError("a planned layer's graphed backward takes what its "
                                    "forward kept (KeptActivations)")
            return self._backward_kept(key, x, weights, dy, inputs)
        # inputs read where they lie: the forward's input, the backward's output gradient
        read = (self._stable(key, "x", x) if phase == "fwd" else None,
                self._stable(key, "dy", dy) if phase == "bwd" else None)
        identity = self._identity(key, weights)
        family = (*key, identity)
        key = (*key, ("in", *read), identity)
        slot = None
        if isinstance(inputs, KeptInputs):
            if inputs.slot.retired or (inputs.slot.x is None
                                       and x.data_ptr() != inputs.slot.x_ptr):
                # its forward graph was captured again (or, read in place, its input is
                # not where the forward read it): copies
                inputs = inputs.tensors()
            else:
                slot = inputs.slot
                if not inputs.in_place():  # another forward's now, or evicted: load it
                    kept = inputs.tensors()
                    self.loads += 1
                    slot.evict()
                    if slot.x is not None:  # (read in place: it is still there)
                        slot.x.copy_(x)  # the forward's input, as autograd saved it
                    for dst, src in zip(slot.kept, kept, strict=True):
                        dst.copy_(src)
                slot.owner = None  # consumed by this backward
                key = (*key, "slot", slot.serial)
        key, cap, lends = self._pick(key, family)
        if cap is None or self._moved(key, cap, weights):
            if cap is not None and cap.slot is not None and phase == "fwd":
                self._retire(cap.slot)
            cap = self._capture(key, phase, x, weights, dy, inputs, slot, lends=lends,
                                read=read, family=family, identity=identity)
        else:
            if phase == "fwd":
                assert cap.slot is not None
                cap.slot.evict()
            self._copy_in(cap, x, weights, dy, inputs)
            cap.current = (x, dy)
            try:
                cap.seq.replay()
            finally:
                cap.current = (None, None)
        if ap.record:
            ap._record(phase, cap.ran)
        first, rest = cap.result
        if phase == "fwd":
            assert cap.slot is not None
            return cap.hand_out(first), KeptInputs(cap.slot)
        return cap.hand_out(first), [cap.hand_out(t) for t in rest]

    def memory(self) -> GraphMemory:
        """The graphs kept and their static buffers (see ``GraphMemory``)."""
        seen: set[int] = set()
        total = 0
        for cap in self._graphs.values():
            bufs = [cap.x, cap.dy, *cap.inputs, *cap.kept, *cap.outs,
                    *(w for row, cp in zip(cap.weights, cap.copied, strict=True)
                      for w, c in zip(row, cp, strict=True) if c)]
            for t in bufs:
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return GraphMemory(graphs=len(self._graphs),
                           lending=sum(1 for c in self._graphs.values() if c.lends),
                           static_bytes=total)

    def _stable(self, key: tuple[Any, ...], what: str, t: Any) -> int | None:
        """The address to read input ``what`` of computation ``key`` at in place (the
        graph captured for that address reads it there, no copy), or ``None`` (copied
        into a static buffer): a contiguous tensor at the start of a static output this
        runner lent (the previous layer's output, or the next layer's input gradient:
        addresses that stay this runner's as long as its graphs do), at most
        ``IN_PLACE_ADDRESSES`` addresses per computation and input. Other tensors are
        copied in: an address the allocator gives back on some calls and not on others
        would capture a graph per address seen."""
        if t is None or not t.is_contiguous():
            return None
        ptr = int(t.data_ptr())
        if ptr not in self._lent_ptrs:
            return None
        known = self._in_place.setdefault((key, what), set())
        if ptr in known or len(known) < IN_PLACE_ADDRESSES:
            known.add(ptr)
            return ptr
        return None

    def _pick(self, key: tuple[Any, ...], family: tuple[Any, ...]
              ) -> tuple[tuple[Any, ...], _Captured | None, bool]:
        """Which copy of computation ``key``'s graph this call replays: the first whose
        static outputs nobody holds any more; else a new copy (``None``), which lends its
        outputs while fewer than ``LEND_SLOTS`` lending graphs of the computation
        (``family``: whatever inputs they read in place) are held, and clones them
        otherwise (bounded memory when a caller keeps every output). Returns ``(key of
        the copy, its graph or None, whether a new copy lends)``."""
        j = 0
        while True:
            k = (*key, "copy", j)
            cap = self._graphs.get(k)
            if cap is None:
                return k, None, self._lending_held(family) < LEND_SLOTS and _can_count()
            if not cap.busy():
                return k, cap, cap.lends
            j += 1

    def _lending_held(self, family: tuple[Any, ...]) -> int:
        """How many graphs of computation ``family`` lent outputs that are still held."""
        caps = self._families.get(family, [])
        caps[:] = [c for c in caps if self._graphs.get(c.key) is c]  # current ones
        return sum(1 for c in caps if c.lends and c.busy())

    def _forward_kept(self, key: tuple[Any, ...], x: Any,
                      weights: Sequence[Sequence[Any]]) -> tuple[Any, Any]:
        """The forward from a free slot; its kept activations lent, not copied."""
        slots = self._slots.setdefault(key, [])
        idx = next((i for i, c in enumerate(slots) if not c.lent and not c.busy()),
                   len(slots))
        skey = (*key, "slot", idx)
        cap = slots[idx] if idx < len(slots) else None
        if cap is None or self._moved(skey, cap, weights):
            held = sum(1 for c in slots if c.lends and not c.lent and c.busy())
            lends = (cap.lends if cap is not None
                     else held < LEND_SLOTS and _can_count())
            cap = self._capture(skey, "fwd", x, weights, None, None, None, lends=lends,
                                family=key)
            cap.generation = self.captures
            _refuse_autograd_attention(cap.result[1])  # before the slot is used
            if idx < len(slots):
                slots[idx] = cap
            else:
                slots.append(cap)
        else:
            self._copy_in(cap, x, weights, None, None)
            cap.seq.replay()
        self.applier._record("fwd", cap.ran)
        out, kept = cap.result
        cap.lent = True
        cap.lendings += 1
        free = _Release(cap)
        lent = KeptActivations(kept.act, depth=kept.depth, nanobatches=kept.nanobatches,
                               release=free)
        # dropped without its backward (no grad needed, an exception): the slot is free
        weakref.finalize(lent, free)
        lent.slot = (skey, cap.generation, cap.lendings)
        return cap.hand_out(out), lent

    def _backward_kept(self, key: tuple[Any, ...], x: Any, weights: Sequence[Sequence[Any]],
                       dy: Any, kept: KeptActivations) -> tuple[Any, list[Any]]:
        """The backward of a forward slot, reading its static buffers in place."""
        slot = kept.slot
        if slot is None:
            raise ArgumentError("a planned layer's graphed backward needs its graphed "
                                "forward's kept activations")
        skey, generation, lending = slot
        fwd = self._graphs.get(skey)
        if (fwd is None or fwd.generation != generation or not fwd.lent
                or fwd.lendings != lending):
            raise ArgumentError("a planned layer's forward buffers were released before its "
                                "backward ran (a backward run twice: retain_graph is not "
                                "supported on graphs with recompute 'none'/'selective')")
        bkey, cap, lends = self._pick((*key, skey), key)
        if cap is None or cap.generation != generation or self._moved(bkey, cap, weights):
            # the backward graph reads the forward slot's buffers where they lie (a slot
            # captured again has new buffers: its backward is captured again too)
            static = KeptActivations(fwd.result[1].act, depth=kept.depth,
                                     nanobatches=kept.nanobatches)
            cap = self._capture(bkey, "bwd", x, weights, dy, static, None,
                                lends=lends if cap is None else cap.lends, family=key)
            cap.generation = generation
        else:
            self._copy_in(cap, x, weights, dy, None)
            cap.seq.replay()
        kept.release()
        self.applier._record("bwd", cap.ran)
        first, rest = cap.result
        return cap.hand_out(first), [cap.hand_out(t) for t in rest]

    def _identity(self, key: tuple[Any, ...], weights: Sequence[Sequence[Any]]) -> int | None:
        """Which graph of ``key`` this call replays: with a shared memory pool, each layer
        (or stack) its own, known by its first weight's address once that address has come
        back on a later call (a parameter; a tensor made anew on every call rarely does),
        at most the model's layer count per key; ``None``: the graph every other call
        shares, whose weights are copied in when they lie elsewhere."""
        if not _shares_pool(self.applier._executor()):
            return None
        ptr = int(weights[0][0].data_ptr())
        own = self._own.get(key)
        if own is None:
            own = self._own[key] = set()
        if ptr in own:
            return ptr
        seen = self._seen.setdefault(key, set())
        if ptr in seen and len(own) < self.applier.workload.model.layers:
            own.add(ptr)
            return ptr
        seen.add(ptr)
        return None

    def _backward_pool(self, ex: Any) -> Any:
        """The memory pool every backward graph of kept activations shares (per stream
        backend), or ``None`` where the executor takes no pool (an executor of another
        kind: a pool per graph, as before). Sharing is safe: a backward graph reads its
        forward slot's buffers, which lie in that forward graph's own pool, and its
        outputs (input and weight gradients) are static buffers allocated outside any
        pool (lent or cloned); so each backward graph needs the memory of its temporaries
        only while it runs, and one pool holds the largest of them instead of one each
        (a framework's layers, one node each: a backward graph per layer and forward
        slot)."""
        from kareus.exec import TorchExecutor

        if not isinstance(ex, TorchExecutor) or not ex.graphs:
            return None
        held = self._backward_pools.get(id(ex.streams))
        if held is None:  # the streams held too: their id stays theirs
            held = self._backward_pools[id(ex.streams)] = (ex.streams,
                                                           ex.streams.graph_pool())
        return held[1]

    def _retire(self, slot: _Slot) -> None:
        """A forward graph is captured again: its slot stays with the forwards that hold it
        (their backwards read copies), and the backward graphs that read it go."""
        slot.retired = True
        ex = self.applier._executor()
        for key in [k for k, c in self._graphs.items()
                    if c.phase == "bwd" and c.slot is slot]:
            self._drop(self._graphs.pop(key))
            name = self._names.get(key)
            if name is not None:
                ex.release_graphs(name)

    def _drop(self, cap: _Captured) -> None:
        """A graph goes (captured again, or its forward slot's was): its static outputs
        are no longer addresses this runner lends."""
        if cap.lends and cap.outs:
            self._lent_ptrs.discard(int(cap.outs[0].data_ptr()))

    def _moved(self, key: tuple[Any, ...], cap: _Captured,
               weights: Sequence[Sequence[Any]]) -> bool:
        """Whether a weight read in place lies elsewhere now (then it is copied from now on
        and the computation captured again)."""
        if (cap.read_ptrs is not None  # none copied: one comparison of every address
                and [w.data_ptr() for ws in weights for w in ws] == cap.read_ptrs):
            return False
        moved = False
        for i, ws in enumerate(weights):
            for j, w in enumerate(ws):
                if not cap.copied[i][j] and w.data_ptr() != cap.ptrs[i][j]:
                    # every graph of these weights copies it from now on (each copy and
                    # input variant, forward and backward)
                    self._copy_always.add((cap.rule, i, j))
                    moved = True
        return moved

    def _copy_in(self, cap: _Captured, x: Any, weights: Sequence[Sequence[Any]], dy: Any,
                 inputs: Any) -> None:
        if cap.x is not None:  # not a backward reading its forward's slot
            cap.x.copy_(x)
            for dst, src in zip(cap.inputs, inputs or (), strict=True):
                dst.copy_(src)
        if cap.dy is not None:
            cap.dy.copy_(dy)
        for i, j in cap.copy_idx:
            cap.weights[i][j].copy_(weights[i][j])

    def _capture(self, key: tuple[Any, ...], phase: str, x: Any,
                 weights: Sequence[Sequence[Any]], dy: Any, inputs: Any,
                 slot: _Slot | None, *, lends: bool = False,
                 read: tuple[int | None, int | None] = (None, None),
                 family: tuple[Any, ...] | None = None,
                 identity: int | None = None) -> _Captured:
        import torch

        ap = self.applier
        cap = _Captured()
        cap.phase, cap.lends, cap.key = phase, bool(lends), key
        cap.family = key if family is None else family
        # whose weights it reads: their layout, and the layer's own graphs' identity
        cap.rule = (tuple((tuple(w.shape), tuple(w.stride()), w.dtype)
                          for ws in weights for w in ws), identity)
        self._families.setdefault(cap.family, []).append(cap)
        static_kept = inputs if isinstance(inputs, KeptActivations) else None
        if static_kept is not None:  # a backward reading its forward slot's activations
            inputs = None
        if slot is None and read[0] is None:
            cap.x = torch.empty_like(x, memory_format=torch.contiguous_format)
            cap.inputs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                          for t in inputs or ()]
        cap.x_ptr = int(x.data_ptr())
        cap.dy = (None if dy is None or read[1] is not None
                  else torch.empty_like(dy, memory_format=torch.contiguous_format))
        for i, ws in enumerate(weights):
            row, copied, ptrs = [], [], []
            for j, w in enumerate(ws):
                copy = (cap.rule, i, j) in self._copy_always
                row.append(torch.empty_strided(w.shape, w.stride(), dtype=w.dtype,
                                               device=w.device) if copy else w)
                copied.append(copy)
                ptrs.append(w.data_ptr())
            cap.weights.append(row)
            cap.copied.append(copied)
            cap.ptrs.append(ptrs)
        cap.copy_idx = [(i, j) for i, cs in enumerate(cap.copied)
                        for j, c in enumerate(cs) if c]
        cap.read_ptrs = (None if cap.copy_idx
                         else [p for ptrs in cap.ptrs for p in ptrs])
        self._copy_in(cap, x, weights, dy, inputs)
        # the static outputs (outside the pool, before the capture): the forward's
        # output; the backward's input gradient and weight gradients, in the layout
        # eager execution gives them (``zeros_like`` of each weight)
        b, s, h = x.shape
        cap.outs = [torch.empty((b * s, h), dtype=x.dtype, device=x.device)]
        if phase == "bwd":
            cap.outs += [torch.zeros_like(w) for ws in cap.weights for w in ws]
        if phase == "fwd" and ap.workload.recompute == "full":
            # outside the pool: the backward reads them after other replays
            cap.kept = [torch.empty((b * s, h), dtype=x.dtype, device=x.device)
                        for _ in range(len(weights) - 1)]

        def body() -> None:
            # what the graph reads: its own static buffers, or its forward's slot; an
            # input read in place where the caller's tensor lies (``current``: the
            # tensor at that address during this capture or replay)
            gx, gin = (cap.x, cap.inputs) if slot is None else (slot.x, slot.kept)
            if gx is None:
                gx = cap.current[0]
            gdy = cap.dy if cap.dy is not None else cap.current[1]
            cap.result, cap.ran = ap._run_eager(phase, gx, cap.weights, gdy,
                                                static_kept or gin or None,
                                                kept_out=cap.kept or None,
                                                out_bufs=cap.outs)

        name = self._names.setdefault(key, f"integrations:{phase}:{len(self._names)}")
        # The capture runs the body twice eagerly first (warm-up: the first call of a
        # Triton op at a new signature compiles or fetches its kernel, the second builds
        # its lean launch; neither may happen inside a capture), then captures it, then
        # the caller's result comes from a replay, as every later call's does. A
        # re-capture (a weight moved) is another signature under the same name: the
        # executor drops the old graphs.
        ex = ap._executor()
        pool = (self._backward_pool(ex) if phase == "bwd"
                and ap.workload.recompute != "full" else None)
        cap.current = (x, dy)  # dropped after: a graph holds no caller's tensor
        try:
            cap.seq = ex.capture(name, [body], signature=(key, self.captures), warmup=2,
                                 **({} if pool is None else {"pool": pool}))
            cap.seq.replay()
        finally:
            cap.current = (None, None)
        cap.settle()
        if cap.lends:
            self._lent_ptrs.add(int(cap.outs[0].data_ptr()))
        if phase == "fwd":
            cap.slot = _Slot(cap)
        else:
            cap.slot = slot
        self.captures += 1
        old = self._graphs.get(key)
        if old is not None:
            self._drop(old)
        self._graphs[key] = cap
        return cap


class _Release:
    """Frees a forward slot from one lending of its kept activations (a later lending of
    the same slot is not freed by it)."""

    def __init__(self, cap: _Captured) -> None:
        self.cap, self.lending = cap, cap.lendings

    def __call__(self) -> None:
        if self.cap.lendings == self.lending:
            self.cap.lent = False


def _refuse_autograd_attention(kept: Any) -> None:
    """Refuse kept attention state that is an autograd graph on a GPU (its backward through
    the autograd engine is not capturable in another graph than its forward's)."""
    for a in kept.act.values():
        saved = a.get("graph")  # one attention's state, or under CP one per causal piece
        for st in saved if isinstance(saved, list) else [saved]:
            if (st is not None and getattr(st, "backend", None) == "autograd"
                    and st.output.device.type == "cuda"):
                raise ArgumentError("graphs=True with recompute='none' needs the attention on "
                                    "the fused kernels (flash or cuDNN); this attention runs "
                                    "through autograd (a CP piece whose mask is not causal's, "
                                    "or a backend without a direct op): use "
                                    "recompute='selective', or graphs=False")
