"""Graph-captured execution: work captured once into CUDA graphs, then replayed.

Launching a small model's ops one by one costs more host time than the GPU needs to run
them (10-150 us per eager op against partitions of 70-270 us of GPU time for Qwen3-1.7B
at TP=4, CP=2; docs/performance.md), so the GPU waits on the host. Production stacks
capture the work into CUDA graphs and replay it (Megatron-Core's ``--cuda-graph-impl``,
TransformerEngine's ``make_graphed_callables``, torchtitan's whole-step capture), one
launch per graph. The executor does the same:

* a ``GraphSequence`` is a list of callables (a training iteration's microbatch
  computations, or a partition's steps) captured in order, each into its own graph, all
  sharing one memory pool. Sharing a pool is what keeps memory flat (an activation
  allocated in the forward's graph and freed after the backward's is reused by the next
  microbatch's forward), and it is also why the graphs of a sequence must be replayed in
  the order they were captured: ``GraphSequence.replay`` enforces it;
* what a callable enqueues goes into its graph as it would run eagerly: the collective
  on the executor's side stream with its SM cap at the configured slot, forked and
  joined through events (captured as graph dependencies), the clock request of a
  microbatch as a host node (the trigger's callback writes a token to a pipe and makes
  no CUDA call);
* inputs are static: a graph reads and writes the addresses it was captured with, so a
  caller copies new data into the tensors the callables read (the training loop's
  batches are such tensors) instead of passing new ones;
* a sequence is captured again when its signature (the caller's description of shapes
  and schedule) or the executor's plan changes; otherwise the existing one is reused.

Before capture the callables run once eagerly (library set-up happens there: cuBLAS
workspaces, cuDNN plans, Triton compilation), on a side stream as CUDA requires of work
that allocates before a capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kareus.errors import GraphCaptureError

__all__ = ["GraphSequence"]


class GraphSequence:
    """Graphs captured in order into one memory pool, replayed in that order.

    Created by [TorchExecutor.capture][kareus.exec.TorchExecutor.capture].

    Attributes:
        name: The sequence's name (the executor's key).
        key: ``(signature, plan digest)`` it was captured for.
        graphs: The captured graphs, in capture order.
        deferred: Per graph, clock requests that could not be captured (a trigger without
            host nodes) and are issued on the stream right before that graph's replay.
    """

    def __init__(self, *, name: str, key: tuple[Any, ...], streams: Any, graphs: Sequence[Any],
                 deferred: Sequence[Sequence[int]], request: Callable[[int], Any] | None
                 ) -> None:
        self.name = name
        self.key = key
        self.graphs = tuple(graphs)
        self.deferred = tuple(tuple(d) for d in deferred)
        self._streams = streams
        self._request = request
        self._next = 0
        self.replays = 0

    def __len__(self) -> int:
        return len(self.graphs)

    @property
    def next_index(self) -> int:
        """The graph the next ``replay`` of one graph must launch."""
        return self._next

    def replay(self, index: int | None = None) -> None:
        """Launch every graph in order (``index=None``), or graph ``index``, which must be
        the next in capture order (graphs of one pool reuse each other's memory).

        Raises:
            GraphCaptureError: ``index`` is not the next graph of the sequence.
        """
        if index is None:
            if self._next != 0:
                raise GraphCaptureError(
                    f"graph sequence {self.name!r} stopped at graph {self._next}: replay "
                    f"graphs {self._next}..{len(self) - 1} first")
            for i in range(len(self)):
                self._launch(i)
            return
        if index != self._next:
            raise GraphCaptureError(
                f"graph {index} of sequence {self.name!r} replayed out of order (graph "
                f"{self._next} is next): graphs sharing a memory pool must replay in the "
                "order they were captured")
        self._launch(index)

    def _launch(self, i: int) -> None:
        if self._request is not None:
            for freq in self.deferred[i]:
                self._request(freq)
        self._streams.replay(self.graphs[i])
        self._next = (i + 1) % len(self)
        if self._next == 0:
            self.replays += 1
