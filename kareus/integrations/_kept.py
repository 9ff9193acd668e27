"""What a planned layer's forward keeps for its backward when its recomputation policy keeps
activations (``"none"``, ``"selective"``): one object the autograd node holds between
them, shared by eager execution (``kareus.integrations._layer``) and graphs
(``kareus.integrations._graphed``). No torch import.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import ArgumentError

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
        act: ``(layer, nanobatch) -> {name: tensor or saved attention}``.
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

    def release(self) -> None:
        """The backward has read the activations (graphs: the forward's buffers are free)."""
        if self._release is not None:
            self.consumed = True
            self._release()
            self._release = None
