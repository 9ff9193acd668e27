"""What a planned layer's forward keeps for its backward when its recomputation policy keeps
activations (``"none"``, ``"selective"``): one object the autograd node holds between
them, shared by eager execution (``kareus.integrations._layer``) and graphs
(``kareus.integrations._graphed``). No torch import.
"""

from __future__ import annotations

from typing import Any

import attrs

from kareus.errors import ArgumentError
from kareus.exec.kernels import SavedAttention

__all__ = ["KeptActivations"]


class KeptActivations:
    """What a planned layer's (or stack's) forward kept for its backward under a policy that
    keeps activations (``"none"``, ``"selective"``): per layer and nanobatch, the tensors
    its backward reads ([`KEPT_FOR_BACKWARD`][kareus.exec.train.KEPT_FOR_BACKWARD]), as the
    forward left them. Opaque to the caller: the autograd node hands it to its backward.

    Under graphs the tensors are the forward graph's static buffers, lent to this object
    until its backward has run (``release``) or it is dropped; the graph is not replayed
    while they are lent (``kareus.integrations._graphed``).

    Args:
        act: ``(layer, nanobatch) -> {name: tensor, saved attention, list, host value or
            attrs record of them}`` (a mixture of experts keeps its routing: a record of
            tensors and host split sizes).
        depth: Layers of the computation.
        nanobatches: Nanobatches the forward ran in.
        release: Called once when the backward has read them (graphs: frees the slot).
    """

    def __init__(self, act: dict[tuple[int, int], dict[str, Any]], *, depth: int,
                 nanobatches: int, release: Any = None) -> None:
        self.act, self.depth, self.nanobatches = act, int(depth), int(nanobatches)
        self._release = release
        self.consumed = False
        #: Under graphs: the forward slot the tensors lie in (its key, its capture's number
        #: and which lending of it this is).
        self.slot: Any = None

    def for_backward(self, depth: int, nanobatches: int) -> dict[tuple[int, int],
                                                                  dict[str, Any]]:
        """The backward's state (a copy of the mappings; the tensors are shared).

        Raises:
            ArgumentError: another depth, or another nanobatch split than the forward's
                (the kept activations are per nanobatch), or the backward ran already
                with graphs (the buffers may be another forward's now).
        """
        if self.consumed:
            raise ArgumentError("a planned layer's backward ran twice on graphs with "
                                "recompute 'none'/'selective' (retain_graph): its forward's "
                                "buffers are lent once; use graphs=False")
        if depth != self.depth or nanobatches != self.nanobatches:
            raise ArgumentError(f"the forward ran {self.depth} layer(s) in {self.nanobatches} "
                                f"nanobatch(es) and its backward {depth} in {nanobatches}: "
                                "with recompute 'none' or 'selective' a microbatch's backward "
                                "runs in its forward's nanobatches (make the plan so, or "
                                "recompute 'full')")
        return {key: dict(a) for key, a in self.act.items()}

    def pack(self) -> tuple[list[Any], Any]:
        """``(tensors, layout)``: every tensor held (each once, attention states' included),
        and what rebuilds the mappings around them (``unpack``). Eager execution hands the
        tensors to autograd (``ctx.save_for_backward``), so they are freed when the backward
        has run (not when the autograd node goes, which may be much later: a framework that
        keeps the output) and pass through ``torch.autograd.graph.saved_tensors_hooks``
        (activation offloading, memory accounting) as every other saved tensor does."""
        tensors: list[Any] = []
        index: dict[int, int] = {}

        def slot(t: Any) -> int:
            i = index.get(id(t))
            if i is None:
                i = index[id(t)] = len(tensors)
                tensors.append(t)
            return i

        def shape(v: Any) -> Any:
            if isinstance(v, SavedAttention):
                # the state without its tensors (the layout must not hold them)
                bare = attrs.evolve(v, output=None, tensors=())
                return ("attention", bare, slot(v.output),
                        tuple(None if t is None else slot(t) for t in v.tensors))
            if isinstance(v, list):
                return ("list", [shape(x) for x in v])
            if v is None:
                return ("none",)
            if isinstance(v, int | float | bool | str | tuple):  # host values (split sizes)
                return ("value", v)
            if attrs.has(type(v)):  # a record of tensors and host values (an MoE routing)
                return ("attrs", type(v), {f.alias: shape(getattr(v, f.name))
                                           for f in attrs.fields(type(v))})
            return ("tensor", slot(v))

        layout = {key: {name: shape(v) for name, v in a.items()}
                  for key, a in self.act.items()}
        return tensors, (layout, self.depth, self.nanobatches)

    @staticmethod
    def unpack(layout: Any, tensors: list[Any]) -> KeptActivations:
        """The activations ``pack`` gave ``(tensors, layout)`` of, around ``tensors`` (what
        autograd hands back: the same tensors, or what a saved-tensors hook made of them)."""
        act_layout, depth, nanobatches = layout

        def value(s: Any) -> Any:
            if s[0] == "attention":
                _, saved, out, ts = s
                return attrs.evolve(saved, output=tensors[out],
                                    tensors=tuple(None if i is None else tensors[i]
                                                  for i in ts))
            if s[0] == "list":
                return [value(x) for x in s[1]]
            if s[0] == "none":
                return None
            if s[0] == "value":
                return s[1]
            if s[0] == "attrs":
                return s[1](**{name: value(x) for name, x in s[2].items()})
            return tensors[s[1]]

        act = {key: {name: value(s) for name, s in a.items()} for key, a in act_layout.items()}
        return KeptActivations(act, depth=depth, nanobatches=nanobatches)

    def release(self) -> None:
        """The backward has read the activations (graphs: the forward's buffers are free)."""
        if self._release is not None:
            self.consumed = True
            self._release()
            self._release = None
