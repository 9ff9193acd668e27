"""Planned layers replayed from CUDA graphs: static buffers around a captured layer program.

A planned layer (or stack) launched eagerly pays the host path of every op, and on a small
model the GPU waits for it (``bench/planned_layers.py``). With ``PlanApplier(graphs=True)``
each distinct computation is captured once by the executor
([`TorchExecutor.capture`][kareus.exec.TorchExecutor.capture]: its collectives at the plan's
slots and SM counts, the cross-stream events, in one graph) and replayed after that. What a
graph reads and writes must stay at the addresses it was captured with, so each graph owns:

* **static inputs**: the layer's input, the backward's output gradient and the inputs of
  layers ``1 ..`` the forward kept; each call copies the caller's tensors into them (one
  copy kernel each);
* **weights**: read where they lie when the graph is captured (a parameter, or a view of
  one such as ``linear``'s transpose: the framework's optimizer updates it in place between
  replays). A weight that lies elsewhere on a later call (one made anew on every call, as
  ``qkv_from_separate``'s concatenation, when the allocator does not hand it the same
  memory; a framework that reallocates its parameters) makes the runner capture that
  computation again with the weight copied into a static buffer from then on. The test is
  the address alone, which is exact: a tensor at the captured address is what the graph
  reads, whatever made it;
* **outputs**: what the captured run returned (the layer's output, the kept inputs, the
  input gradient, the weight gradients) is cloned after each replay. The next replay
  overwrites the static outputs, and autograd keeps a layer's output (saved by the next
  op) and its gradients (accumulated into ``.grad`` / ``main_grad``) across microbatches.

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
autograd (CP ranks above 0, whose mask is not causal's) is refused with ``"none"``.

A graph is keyed by what changes the captured work: phase, depth, nanobatch count,
whether the plan runs the computation unsplit, the plan's choice for the computation (its
configurations and SM counts), shapes and dtypes. Microbatch computations that share a plan
choice share a graph. The microbatch scope's clock request is made when the scope is
entered, outside the graphs, as in eager execution.

Why not ``torch.cuda.make_graphed_callables``: it captures through autograd, while a
planned layer's forward and backward are already one autograd node each whose inside is
kareus's executor (two streams, events, capped communicators); capturing that inside is
the executor's job, and this module only keeps its buffers still.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from kareus.errors import ArgumentError
from kareus.integrations._kept import KeptActivations

__all__ = ["GraphedRunner"]


class _Captured:
    """One captured computation: its graph sequence, static buffers and static outputs."""

    def __init__(self) -> None:
        self.seq: Any = None
        self.x: Any = None
        self.dy: Any = None
        self.inputs: list[Any] = []
        # per layer, per weight: the tensor the graph reads, and whether it is a copy
        self.weights: list[list[Any]] = []
        self.copied: list[list[bool]] = []
        self.ptrs: list[list[int]] = []
        self.result: Any = None
        self.ran: list[tuple[str, Any]] = []
        self.lent = False  # its kept activations are lent to a pending backward
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
    """

    def __init__(self, applier: Any) -> None:
        self.applier = applier
        self._graphs: dict[tuple[Any, ...], _Captured] = {}
        self._copy_always: set[tuple[tuple[Any, ...], int, int]] = set()
        self._names: dict[tuple[Any, ...], str] = {}
        self._slots: dict[tuple[Any, ...], list[_Captured]] = {}
        self.captures = 0

    def _key(self, phase: str, x: Any, weights: Sequence[Sequence[Any]],
             inputs: Sequence[Any] | None) -> tuple[Any, ...]:
        from kareus.exec.plan_lookup import computation_key

        ap = self.applier
        n, unsplit = ap._computation(phase)
        choice: Any = None
        if ap.schedule == "kareus":
            current = ap._executor().current
            key = computation_key(*current)
            choice = ap.plan.assignment.get(key, key)
        wsig = tuple((tuple(w.shape), tuple(w.stride()), w.dtype) for ws in weights for w in ws)
        kept = len(inputs or ()) if not isinstance(inputs, KeptActivations) else -1
        return (phase, len(weights), n, unsplit, choice, tuple(x.shape), x.dtype,
                str(x.device), wsig, kept)

    def run(self, phase: str, x: Any, weights: Sequence[Sequence[Any]], dy: Any = None,
            inputs: Sequence[Any] | None = None) -> tuple[Any, list[Any]]:
        """``PlanApplier.run`` from a graph: copy in, replay, clone out (kept activations
        lent, not cloned: see the module docstring)."""
        key = self._key(phase, x, weights, inputs)
        if self.applier.workload.recompute != "full":
            if phase == "fwd":
                return self._forward_kept(key, x, weights)
            if not isinstance(inputs, KeptActivations):
                raise ArgumentError("a planned layer's graphed backward takes what its "
                                    "forward kept (KeptActivations)")
            return self._backward_kept(key, x, weights, dy, inputs)
        cap = self._graphs.get(key)
        if cap is None or self._moved(key, cap, weights):
            cap = self._capture(key, phase, x, weights, dy, inputs)
        else:
            self._copy_in(cap, x, weights, dy, inputs)
            cap.seq.replay()
        self.applier._record(phase, cap.ran)
        first, rest = cap.result
        return first.clone(), [t.clone() for t in rest]

    def _forward_kept(self, key: tuple[Any, ...], x: Any,
                      weights: Sequence[Sequence[Any]]) -> tuple[Any, Any]:
        """The forward from a free slot; its kept activations lent, not copied."""
        slots = self._slots.setdefault(key, [])
        idx = next((i for i, c in enumerate(slots) if not c.lent), len(slots))
        skey = (*key, "slot", idx)
        cap = slots[idx] if idx < len(slots) else None
        if cap is None or self._moved(skey, cap, weights):
            cap = self._capture(skey, "fwd", x, weights, None, None)
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
            cap = self._capture(bkey, "bwd", x, weights, dy, static)
            cap.generation = generation
        else:
            self._copy_in(cap, x, weights, dy, None)
            cap.seq.replay()
        kept.release()
        self.applier._record("bwd", cap.ran)
        first, rest = cap.result
        return first.clone(), [t.clone() for t in rest]

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
                 inputs: Sequence[Any] | None) -> None:
        cap.x.copy_(x)
        if cap.dy is not None:
            cap.dy.copy_(dy)
        for dst, src in zip(cap.inputs, inputs or (), strict=True):
            dst.copy_(src)
        for i, ws in enumerate(weights):
            for j, w in enumerate(ws):
                if cap.copied[i][j]:
                    cap.weights[i][j].copy_(w)

    def _capture(self, key: tuple[Any, ...], phase: str, x: Any,
                 weights: Sequence[Sequence[Any]], dy: Any, inputs: Any) -> _Captured:
        import torch

        ap = self.applier
        cap = _Captured()
        cap.x = torch.empty_like(x, memory_format=torch.contiguous_format)
        cap.dy = None if dy is None else torch.empty_like(dy,
                                                          memory_format=torch.contiguous_format)
        static_kept = inputs if isinstance(inputs, KeptActivations) else None
        cap.inputs = ([] if static_kept is not None else
                      [torch.empty_like(t, memory_format=torch.contiguous_format)
                       for t in inputs or ()])
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
        self._copy_in(cap, x, weights, dy, None if static_kept is not None else inputs)

        def body() -> None:
            cap.result, cap.ran = ap._run_eager(phase, cap.x, cap.weights, cap.dy,
                                                static_kept or cap.inputs or None)

        name = self._names.setdefault(key, f"integrations:{phase}:{len(self._names)}")
        # The capture runs the body twice eagerly first (warm-up: the first call of a
        # Triton op at a new signature compiles or fetches its kernel, the second builds
        # its lean launch; neither may happen inside a capture), then captures it, then
        # the caller's result comes from a replay, as every later call's does. A
        # re-capture (a weight moved) is another signature under the same name: the
        # executor drops the old graphs.
        cap.seq = ap._executor().capture(name, [body], signature=(key, self.captures),
                                         warmup=2)
        cap.seq.replay()
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
        saved = a.get("graph")
        if (saved is not None and getattr(saved, "backend", None) == "autograd"
                and saved.output.device.type == "cuda"):
            raise ArgumentError("graphs=True with recompute='none' needs the attention on the "
                                "fused kernels (flash or cuDNN); this attention runs through "
                                "autograd (a CP rank above 0, or a backend without a direct "
                                "op): use recompute='selective', or graphs=False")
