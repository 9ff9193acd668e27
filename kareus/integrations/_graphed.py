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

from collections.abc import Sequence
from typing import Any

__all__ = ["GraphedRunner", "capture_in_progress", "computation_signature"]


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
                          inputs: Sequence[Any] | None) -> tuple[Any, ...]:
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
        choice = applier.plan.assignment.get(key, key)
    wsig = tuple((tuple(w.shape), tuple(w.stride()), w.dtype) for ws in weights for w in ws)
    return (phase, len(weights), n, unsplit, choice, tuple(x.shape), x.dtype,
            str(x.device), wsig, len(inputs or ()))


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
        self.captures = 0

    def run(self, phase: str, x: Any, weights: Sequence[Sequence[Any]], dy: Any = None,
            inputs: Sequence[Any] | None = None) -> tuple[Any, list[Any]]:
        """``PlanApplier.run`` from a graph: copy in, replay, clone out."""
        key = computation_signature(self.applier, phase, x, weights, inputs)
        cap = self._graphs.get(key)
        if cap is None or self._moved(key, cap, weights):
            cap = self._capture(key, phase, x, weights, dy, inputs)
        else:
            self._copy_in(cap, x, weights, dy, inputs)
            cap.seq.replay()
        self.applier._record(phase, cap.ran)
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
                 weights: Sequence[Sequence[Any]], dy: Any,
                 inputs: Sequence[Any] | None) -> _Captured:
        import torch

        ap = self.applier
        cap = _Captured()
        cap.x = torch.empty_like(x, memory_format=torch.contiguous_format)
        cap.dy = None if dy is None else torch.empty_like(dy,
                                                          memory_format=torch.contiguous_format)
        cap.inputs = [torch.empty_like(t, memory_format=torch.contiguous_format)
                      for t in inputs or ()]
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

        def body() -> None:
            cap.result, cap.ran = ap._run_eager(phase, cap.x, cap.weights, cap.dy,
                                                cap.inputs or None)

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
