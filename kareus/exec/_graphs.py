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

**GEMMs without a workspace.** With its default workspace, cuBLAS on an H200 (torch
2.11, CUDA 13) picks GEMM kernels that need a zeroed 4-byte counter and zeroes it with a
``cudaMemsetAsync`` right before the kernel; in a graph that is a memset node, and the
GPU idles around each one (about 4 us before it, against about 0.5 us between two
kernels). Measured on one H200 (``bench/probes/results/graph_memset_probe_h200_gemms.json``,
``bench/probes/results/cublas_workspace_loop_h200/``): of a graphed nanobatched Qwen3-1.7B
TP=4 CP=2 iteration's 18,884 GPU operations, 3,372 were memsets (2,700 of them cuBLAS's),
and the GPU was busy 94.3% of the span;
with ``CUBLAS_WORKSPACE_CONFIG=:0:0`` (no workspace) cuBLAS picks kernels without the
counter, the memsets are gone (16,184 operations), the GPU is busy 97.7% and the
iteration is 1-3% shorter; the GEMMs alone ran 0.96-1.02x their time with the workspace
at the three presets' shapes. ``prefer_workspace_free_gemms`` sets that default (and
``CUBLASLT_WORKSPACE_SIZE=0`` for PyTorch builds whose cuBLASLt workspace is separate)
where the user has not chosen: PyTorch reads the variables once, at the process's first
GEMM, so the ``kareus`` command sets them at start, and the training loop, the
executors and the integrations when they are built. The cuDNN attention kernels keep
their own memsets (two per forward and backward; the flash backend has none but ran
1.9x slower at Qwen3-1.7B's shapes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kareus._logging import get_logger
from kareus.errors import GraphCaptureError

__all__ = ["GraphSequence", "prefer_workspace_free_gemms"]

_log = get_logger(__name__)

#: The environment ``prefer_workspace_free_gemms`` sets: cuBLAS's handle workspace (as
#: ``CUBLAS_WORKSPACE_CONFIG`` spells sizes: none) and PyTorch's cuBLASLt workspace (KiB).
WORKSPACE_FREE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
_warned_late = False


def prefer_workspace_free_gemms() -> str:
    """Ask cuBLAS for GEMMs without a workspace (module docstring: no memset node per
    GEMM in a graph), unless the user chose.

    Returns:
        ``"set"`` (the variables were unset and are now set), ``"user"`` (the user set
        ``CUBLAS_WORKSPACE_CONFIG``: kept, e.g. ``:4096:8``, which PyTorch's
        deterministic mode asks for), or ``"deterministic"`` (PyTorch's deterministic
        algorithms are on: left alone). When set after CUDA has started in this process,
        it takes effect only if no GEMM has run yet; that is logged once.
    """
    global _warned_late
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        return "user"
    torch = sys.modules.get("torch")  # not imported here: only asked when already loaded
    if torch is not None and torch.are_deterministic_algorithms_enabled():
        return "deterministic"
    for k, v in WORKSPACE_FREE.items():
        os.environ.setdefault(k, v)
    if torch is not None and torch.cuda.is_initialized() and not _warned_late:
        _warned_late = True
        _log.info("CUBLAS_WORKSPACE_CONFIG=:0:0 set after CUDA started in this process: it "
                  "takes effect only if no GEMM has run yet; set it before starting for "
                  "graphs without a memset per GEMM")
    return "set"


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
