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

* **the forward's input** is copied into the forward graph's static buffer (one copy
  kernel); the forward graph writes the inputs of layers ``1 ..`` it keeps for the
  backward into its own static outputs;
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
  ran: static inputs and the kept inputs live outside the pool, and outputs are cloned
  right after their replay. An executor given by the caller keeps a pool per graph, and
  layers of one shape share a graph (their weights copied in);
* **weights** are read where they lie when the graph is captured (a parameter, or a view of
  one such as ``linear``'s transpose: the framework's optimizer updates it in place between
  replays). A weight that lies elsewhere on a later call (one made anew on every call, as
  ``qkv_from_separate``'s concatenation, when the allocator does not hand it the same
  memory; a framework that reallocates its parameters; another layer's weights in a
  shared graph) makes the runner capture that computation again with the weight copied
  into a static buffer from then on. The test is the address alone, which is exact: a
  tensor at the captured address is what the graph reads, whatever made it;
* **outputs** handed to autograd are cloned after each replay: the layer's output (autograd
  keeps it across microbatches, saved by the next op), the input gradient (it may become a
  leaf's ``.grad``) and the weight gradients (accumulated by autograd into ``.grad``, or by
  the framework's hooks into ``main_grad``: writing them into the framework's gradient
  buffers inside the graph would bypass those hooks, so that is not done).

**Memory per graph** (activation = ``batch x seq / CP x hidden`` elements of the compute
dtype; ``L`` = the stack's layers): a forward graph holds its static input and output (2
activations) and the kept inputs (``L - 1`` activations); a backward graph reading its
forward's slot holds the output gradient and the input gradient (2 activations) and the
weight gradients (the ``L`` layers' weights' size); a backward graph fed copies (its
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
buffers where they lie, in the forward's pool, and their outputs are cloned right after
their replay, so the pool holds the largest backward's temporaries once, not once per
layer and slot.

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

from kareus.errors import ArgumentError, GraphCaptureError
from kareus.integrations._kept import KeptActivations

__all__ = ["GraphedRunner", "KeptInputs", "capture_in_progress", "computation_signature"]


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
    from kareus.exec.plan_lookup import computation_key

    n, unsplit = applier._computation(phase)
    choice: Any = None
    if applier.schedule == "kareus":
        current = applier._executor().current
        key = computation_key(*current)
        index = applier.plan.assignment.get(key, key)
        # the choice itself (frequency, nanobatches, every configuration and SM count),
        # not its index: another plan (a retarget) may hold another choice at that index
        choice = (applier.plan.choices[index] if isinstance(index, int)
                  and 0 <= index < len(applier.plan.choices) else index)
    wsig = tuple((tuple(w.shape), tuple(w.stride()), w.dtype) for ws in weights for w in ws)
    kept = (-1 if isinstance(inputs, KeptActivations)  # every activation a policy keeps
            else len(inputs or ()))
    return (phase, len(weights), n, unsplit, choice, tuple(x.shape), x.dtype,
            str(x.device), wsig, kept)


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
        self._kept = list(forward.kept)
        self.owner: Any = None
        self.retired = False
        _Slot.serials += 1
        self.serial = _Slot.serials

    @property
    def x(self) -> Any:
        """The forward graph's static input."""
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
        import weakref

        self.slot = slot
        self.clones: list[Any] | None = None
        slot.owner = weakref.ref(self)

    def __len__(self) -> int:
        return len(self.slot.kept)

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
        self._copy_always: set[tuple[tuple[Any, ...], int, int]] = set()
        self._names: dict[tuple[Any, ...], str] = {}
        self._seen: dict[tuple[Any, ...], set[int]] = {}
        self._own: dict[tuple[Any, ...], set[int]] = {}
        self._slots: dict[tuple[Any, ...], list[_Captured]] = {}
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
            key: tuple[Any, ...] | None = None) -> tuple[Any, Any]:
        """``PlanApplier.run`` from a graph: copy in, replay, clone out (see the module
        docstring). A forward returns its kept inputs as a ``KeptInputs``. ``key``: the
        computation's ``computation_signature``, when the caller has it."""
        if key is None:
            key = computation_signature(self.applier, phase, x, weights, inputs)
        if self.applier.workload.recompute != "full":  # activations kept: lent slots
            if phase == "fwd":
                return self._forward_kept(key, x, weights)
            if not isinstance(inputs, KeptActivations):
                raise ArgumentError("a planned layer's graphed backward takes what its "
                                    "forward kept (KeptActivations)")
            return self._backward_kept(key, x, weights, dy, inputs)
        key = (*key, self._identity(key, weights))
        slot = None
        if isinstance(inputs, KeptInputs):
            if inputs.slot.retired:  # its forward graph was captured again: copies
                inputs = inputs.tensors()
            else:
                slot = inputs.slot
                if not inputs.in_place():  # another forward's now, or evicted: load it
                    kept = inputs.tensors()
                    self.loads += 1
                    slot.evict()
                    slot.x.copy_(x)  # the forward's input, as autograd saved it
                    for dst, src in zip(slot.kept, kept, strict=True):
                        dst.copy_(src)
                slot.owner = None  # consumed by this backward
                key = (*key, "slot", slot.serial)
        cap = self._graphs.get(key)
        if cap is None or self._moved(key, cap, weights):
            if cap is not None and cap.slot is not None and phase == "fwd":
                self._retire(cap.slot)
            cap = self._capture(key, phase, x, weights, dy, inputs, slot)
        else:
            if phase == "fwd":
                assert cap.slot is not None
                cap.slot.evict()
            self._copy_in(cap, x, weights, dy, inputs)
            cap.seq.replay()
        self.applier._record(phase, cap.ran)
        first, rest = cap.result
        if phase == "fwd":
            assert cap.slot is not None
            return first.clone(), KeptInputs(cap.slot)
        return first.clone(), [t.clone() for t in rest]

    def _forward_kept(self, key: tuple[Any, ...], x: Any,
                      weights: Sequence[Sequence[Any]]) -> tuple[Any, Any]:
        """The forward from a free slot; its kept activations lent, not copied."""
        slots = self._slots.setdefault(key, [])
        idx = next((i for i, c in enumerate(slots) if not c.lent), len(slots))
        skey = (*key, "slot", idx)
        cap = slots[idx] if idx < len(slots) else None
        if cap is None or self._moved(skey, cap, weights):
            cap = self._capture(skey, "fwd", x, weights, None, None, None)
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
        return out.clone(), lent

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
        bkey = (*key, skey)
        cap = self._graphs.get(bkey)
        if cap is None or cap.generation != generation or self._moved(bkey, cap, weights):
            # the backward graph reads the forward slot's buffers where they lie (a slot
            # captured again has new buffers: its backward is captured again too)
            static = KeptActivations(fwd.result[1].act, depth=kept.depth,
                                     nanobatches=kept.nanobatches)
            cap = self._capture(bkey, "bwd", x, weights, dy, static, None)
            cap.generation = generation
        else:
            self._copy_in(cap, x, weights, dy, None)
            cap.seq.replay()
        kept.release()
        self.applier._record("bwd", cap.ran)
        first, rest = cap.result
        return first.clone(), [t.clone() for t in rest]

    def _identity(self, key: tuple[Any, ...], weights: Sequence[Sequence[Any]]) -> int | None:
        """Which graph of ``key`` this call replays: with a shared memory pool, each layer
        (or stack) its own, known by its first weight's address once that address has come
        back on a later call (a parameter; a tensor made anew on every call rarely does),
        at most the model's layer count per key; ``None``: the graph every other call
        shares, whose weights are copied in when they lie elsewhere."""
        if not _shares_pool(self.applier._executor()):
            return None
        ptr = int(weights[0][0].data_ptr())
        own = self._own.setdefault(key, set())
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
        outputs (input and weight gradients) are cloned right after its replay, before
        another graph runs; so each backward graph needs the memory of its temporaries
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
        for key in [k for k in self._graphs if k[-2:] == ("slot", slot.serial)]:
            del self._graphs[key]
            name = self._names.get(key)
            if name is not None:
                ex.release_graphs(name)

    def _moved(self, key: tuple[Any, ...], cap: _Captured,
               weights: Sequence[Sequence[Any]]) -> bool:
        """Whether a weight read in place lies elsewhere now (then it is copied from now on
        and the computation captured again)."""
        moved = False
        for i, ws in enumerate(weights):
            for j, w in enumerate(ws):
                if not cap.copied[i][j] and w.data_ptr() != cap.ptrs[i][j]:
                    self._copy_always.add((key, i, j))
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
        for i, ws in enumerate(weights):
            for j, w in enumerate(ws):
                if cap.copied[i][j]:
                    cap.weights[i][j].copy_(w)

    def _capture(self, key: tuple[Any, ...], phase: str, x: Any,
                 weights: Sequence[Sequence[Any]], dy: Any, inputs: Any,
                 slot: _Slot | None) -> _Captured:
        import torch

        ap = self.applier
        cap = _Captured()
        static_kept = inputs if isinstance(inputs, KeptActivations) else None
        if static_kept is not None:  # a backward reading its forward slot's activations
            inputs = None
        if slot is None:
            cap.x = torch.empty_like(x, memory_format=torch.contiguous_format)
            cap.inputs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                          for t in inputs or ()]
        cap.dy = None if dy is None else torch.empty_like(dy,
                                                          memory_format=torch.contiguous_format)
        for i, ws in enumerate(weights):
            row, copied, ptrs = [], [], []
            for j, w in enumerate(ws):
                copy = (key, i, j) in self._copy_always
                row.append(torch.empty_strided(w.shape, w.stride(), dtype=w.dtype,
                                               device=w.device) if copy else w)
                copied.append(copy)
                ptrs.append(w.data_ptr())
            cap.weights.append(row)
            cap.copied.append(copied)
            cap.ptrs.append(ptrs)
        self._copy_in(cap, x, weights, dy, inputs)
        if phase == "fwd" and ap.workload.recompute == "full":
            # outside the pool: the backward reads them after other replays
            b, s, h = x.shape
            cap.kept = [torch.empty((b * s, h), dtype=x.dtype, device=x.device)
                        for _ in range(len(weights) - 1)]

        def body() -> None:
            # what the graph reads: its own static buffers, or its forward's slot
            gx, gin = (cap.x, cap.inputs) if slot is None else (slot.x, slot.kept)
            cap.result, cap.ran = ap._run_eager(phase, gx, cap.weights, cap.dy,
                                                static_kept or gin or None,
                                                kept_out=cap.kept or None)

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
        cap.seq = ex.capture(name, [body], signature=(key, self.captures), warmup=2,
                             **({} if pool is None else {"pool": pool}))
        cap.seq.replay()
        if phase == "fwd":
            cap.slot = _Slot(cap)
        else:
            cap.slot = slot
        self.captures += 1
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
