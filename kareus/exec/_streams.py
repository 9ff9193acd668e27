"""Streams and events: the only device primitives the executor's ordering needs.

[`TorchStreamBackend`][kareus.exec.TorchStreamBackend] reaches CUDA streams through torch (imported
lazily); [`RecordingStreamBackend`][kareus.exec.RecordingStreamBackend] records which stream
launched what and which stream waited on which event, so the executor's ordering logic is tested on
any CPU without torch, and answers ordering questions on the device's terms
([`happens_before`][kareus.exec.RecordingStreamBackend.happens_before]).
"""

from __future__ import annotations

import abc
import contextlib
import gc
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kareus.errors import GraphCaptureError

__all__ = ["RecordingStreamBackend", "StreamBackend", "TorchStreamBackend"]


class StreamBackend(abc.ABC):
    """Streams and events: the only device primitives the executor's ordering needs."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream work is enqueued on now."""

    @abc.abstractmethod
    def new_stream(self, *, name: str, high_priority: bool = False) -> Any:
        """A new stream (``name`` is for logs and fakes). ``high_priority``: the device
        dispatches this stream's thread blocks ahead of those of normal-priority streams
        as SMs free up (it never preempts running blocks)."""

    @abc.abstractmethod
    def record_event(self, stream: Any) -> Any:
        """Record and return an event at the current end of ``stream``."""

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device) until ``event`` has happened."""

    @abc.abstractmethod
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context in which ``stream`` is the current stream."""

    # -- graphs (optional: a backend without them runs everything eagerly) -----------
    @property
    def supports_graphs(self) -> bool:
        """Whether [`capture`][kareus.exec.StreamBackend.capture] and [`replay`][kareus.exec.StreamBackend.replay] work here."""
        return False

    def graph_pool(self) -> Any:
        """A new memory pool that graphs captured into it share (allocations made during
        one capture may be reused by a later capture into the same pool, so the graphs
        of a pool must be replayed in the order they were captured)."""
        raise GraphCaptureError(f"{type(self).__name__} cannot capture graphs")

    def capture(self, pool: Any, *, name: str) -> contextlib.AbstractContextManager[Any]:
        """Context that captures what is enqueued inside into a graph (yielded), with
        its allocations in ``pool``; nothing runs on the device until
        [`replay`][kareus.exec.StreamBackend.replay]."""
        raise GraphCaptureError(f"{type(self).__name__} cannot capture graphs")

    def replay(self, graph: Any) -> None:
        """Launch a captured graph on the current stream."""
        raise GraphCaptureError(f"{type(self).__name__} cannot replay graphs")

    def is_capturing(self) -> bool:
        """Whether work enqueued now goes into a graph rather than to the device."""
        return False

    def synchronize(self) -> None:
        """Wait until the device has finished everything enqueued (before graphs are
        dropped: their pool's memory goes back to the allocator, and a replay still
        running must not see it handed out again). A backend without graphs has nothing
        to wait for."""
        return None


class TorchStreamBackend(StreamBackend):
    """CUDA streams and events through ``torch.cuda`` (imported lazily)."""

    def __init__(self, *, device: Any = None) -> None:
        import torch  # heavy, optional

        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)

    def current_stream(self) -> Any:
        """The current CUDA stream of the device."""
        return self._torch.cuda.current_stream(self.device)

    def new_stream(self, *, name: str, high_priority: bool = False) -> Any:
        """A new CUDA stream on the device (``name`` is unused); priority -1 (high, as
        PyTorch's FSDP gives its communication streams) when ``high_priority``."""
        return self._torch.cuda.Stream(device=self.device, priority=-1 if high_priority else 0)

    def record_event(self, stream: Any) -> Any:
        """Record and return a CUDA event at the current end of ``stream``."""
        ev = self._torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait on the device until ``event`` has happened."""
        stream.wait_event(event)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """``torch.cuda.stream(stream)``: ``stream`` is current inside."""
        return self._torch.cuda.stream(stream)

    @property
    def supports_graphs(self) -> bool:
        """CUDA graphs are available on any CUDA device."""
        return bool(self._torch.cuda.is_available()) and self.device.type == "cuda"

    def graph_pool(self) -> Any:
        """``torch.cuda.graph_pool_handle()``: a private pool of the caching allocator."""
        return self._torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, pool: Any, *, name: str) -> Iterator[Any]:
        """``torch.cuda.graph`` into a new ``CUDAGraph`` sharing ``pool``; yields it held
        by a ``CapturedGraph`` (see there: a graph dropped during a capture is destroyed
        after it).

        Capture errors are thread-local: other threads of the process (the energy
        meter's NVML polling, the frequency controller) keep running, as long as they
        make no CUDA call on the capturing stream. Python's cyclic garbage collector is
        off during the capture (it could destroy an unreachable graph, anyone's, whose
        destruction would invalidate this capture; PyTorch stopped collecting before
        each capture in 2.9). A capture that fails (its body raises, or CUDA invalidated
        it) is ended and undone before the error propagates: the stream current before
        it is current again, the allocator stops routing to ``pool`` and the graph's
        random-generator state is dropped, so CUDA stays usable (``torch.cuda.graph``
        leaves its capture stream current and the generator in capture when ending an
        invalidated capture raises).
        """
        torch = self._torch
        bury_graphs()  # outside any capture of ours (the caller's own is checked)
        graph = torch.cuda.CUDAGraph()
        before = torch.cuda.current_stream(self.device)
        collecting = gc.isenabled()
        gc.disable()
        _capturing.depth = getattr(_capturing, "depth", 0) + 1
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                yield CapturedGraph(graph)
        except BaseException:
            _undo_capture(torch, graph, pool, before, self.device)
            raise
        finally:
            _capturing.depth -= 1
            if collecting:
                gc.enable()

    def replay(self, graph: Any) -> None:
        """``graph.replay()`` on the current stream (graphs dropped during a capture are
        destroyed first: ``CapturedGraph``)."""
        if _GRAVEYARD:
            bury_graphs()
        graph.replay()

    def is_capturing(self) -> bool:
        """``torch.cuda.is_current_stream_capturing()``."""
        return bool(self._torch.cuda.is_current_stream_capturing())

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()`` of the device; then graphs dropped during a
        capture are destroyed (``CapturedGraph``)."""
        self._torch.cuda.synchronize(self.device)
        bury_graphs()


#: Per thread: how many captures of a ``TorchStreamBackend`` are open in it.
_capturing = threading.local()
#: CUDA graphs whose ``CapturedGraph`` was dropped while a capture was underway.
_GRAVEYARD: list[Any] = []


def _capture_underway() -> bool:
    """Whether destroying a CUDA graph now could invalidate a capture: one of ours is open
    in this thread, or the current stream is being captured (anyone's capture)."""
    if getattr(_capturing, "depth", 0):
        return True
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def bury_graphs() -> int:
    """Destroy the graphs dropped during a capture (``CapturedGraph``), unless a capture is
    underway now; returns how many were destroyed."""
    if not _GRAVEYARD or _capture_underway():
        return 0
    n = len(_GRAVEYARD)
    del _GRAVEYARD[:]
    return n


class CapturedGraph:
    """A captured CUDA graph, as [`TorchStreamBackend.capture`][kareus.exec.TorchStreamBackend.capture]
    yields it: ``replay()`` launches it.

    Destroying a CUDA graph while a stream is being captured is an operation CUDA does
    not permit there: it invalidates that capture (PyTorch prints "CUDA warning:
    operation not permitted when stream is capturing" and the capture fails). Graphs
    dropped in a reference cycle are destroyed whenever Python's cyclic garbage
    collector runs, which may be inside a capture (a planned layer's own, or the
    framework's step capture around planned layers). So when this holder goes away
    while a capture is underway, its graph is kept in a list and destroyed at the next
    point outside captures (the next capture of a ``TorchStreamBackend``, its
    ``synchronize``).
    """

    __slots__ = ("graph",)

    def __init__(self, graph: Any) -> None:
        self.graph = graph

    def replay(self) -> None:
        """Launch the graph on the current stream."""
        self.graph.replay()

    def __del__(self) -> None:
        graph, self.graph = self.graph, None
        try:
            if graph is not None and _capture_underway():
                _GRAVEYARD.append(graph)
        except Exception:  # at interpreter exit torch may be half gone
            pass


def _undo_capture(torch: Any, graph: Any, pool: Any, before: Any, device: Any) -> None:
    """After a failed capture: end it if it is still open, make ``before`` the current
    stream again, stop routing allocations to ``pool`` and drop the graph's state (its
    random-generator capture state), each step best effort."""
    with contextlib.suppress(RuntimeError):
        if torch.cuda.is_current_stream_capturing():  # the body raised before the end
            with contextlib.suppress(RuntimeError):
                graph.capture_end()
    if torch.cuda.current_stream(device) != before:
        torch.cuda.set_stream(before)
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is not None:  # already done when the capture ended cleanly: then it raises
        with contextlib.suppress(RuntimeError, TypeError):
            end(torch.cuda.current_device() if device.index is None else device.index, pool)
    with contextlib.suppress(RuntimeError):
        graph.reset()


@attrs.frozen
class _FakeStream:
    name: str
    high_priority: bool = False


@attrs.frozen
class _FakeEvent:
    id: int
    stream: str
    after: int  # number of log entries on that stream before the record


class RecordingStreamBackend(StreamBackend):
    """A fake device that records what each stream was asked to do, in host order.

    ``log`` holds tuples: ``("launch", stream, what)``, ``("record", stream, event_id)``
    and ``("wait", stream, event_id)``. Ops and collectives passed to an executor that
    uses this backend call [`launch`][kareus.exec.RecordingStreamBackend.launch] to log themselves
    ([`op`][kareus.exec.RecordingStreamBackend.op] makes such an op);
    [`happens_before`][kareus.exec.RecordingStreamBackend.happens_before] answers ordering questions
    on the device's terms.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, str, Any]] = []
        self._stack: list[_FakeStream] = [_FakeStream("compute")]
        self._ids = itertools.count()
        self.events: dict[int, _FakeEvent] = {}
        self._pools = itertools.count()
        self._capturing: str | None = None
        #: Graph name -> the log entries captured into it (launches, records, waits).
        self.graphs: dict[str, list[tuple[str, str, Any]]] = {}

    def current_stream(self) -> _FakeStream:
        """The fake stream work is logged on now (``compute`` outside [`use_stream`][kareus.exec.RecordingStreamBackend.use_stream])."""
        return self._stack[-1]

    def new_stream(self, *, name: str, high_priority: bool = False) -> _FakeStream:
        """A new fake stream called ``name`` (its priority is kept, for tests)."""
        return _FakeStream(name, high_priority)

    def record_event(self, stream: Any) -> _FakeEvent:
        """Log a record on ``stream``; return the event (it counts the launches before it)."""
        n = sum(1 for e in self.log if e[1] == stream.name and e[0] == "launch")
        ev = _FakeEvent(next(self._ids), stream.name, n)
        self.events[ev.id] = ev
        self.log.append(("record", stream.name, ev.id))
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        """Log that ``stream`` waits for ``event``."""
        self.log.append(("wait", stream.name, event.id))

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[Any]:
        """Context in which ``stream`` is the current fake stream."""
        self._stack.append(stream)
        try:
            yield stream
        finally:
            self._stack.pop()

    @property
    def supports_graphs(self) -> bool:
        """The fake captures: the log shows ``("capture", "", name)`` ...
        ``("end_capture", "", name)`` around what went into a graph, and
        ``("replay", stream, name)`` for each replay."""
        return True

    def graph_pool(self) -> int:
        """A new pool id."""
        return next(self._pools)

    @contextlib.contextmanager
    def capture(self, pool: Any, *, name: str) -> Iterator[Any]:
        """Log a capture of graph ``name``; entries logged inside belong to it."""
        if self._capturing is not None:
            raise GraphCaptureError(f"capture of {name!r} inside the capture of "
                                    f"{self._capturing!r}")
        self.log.append(("capture", "", name))
        start = len(self.log)
        self._capturing = name
        try:
            yield name
        finally:
            self._capturing = None
            self.graphs[name] = list(self.log[start:])
            self.log.append(("end_capture", "", name))

    def replay(self, graph: Any) -> None:
        """Log a replay of ``graph`` on the current stream."""
        if graph not in self.graphs:
            raise GraphCaptureError(f"graph {graph!r} was never captured")
        self.log.append(("replay", self.current_stream().name, graph))

    def is_capturing(self) -> bool:
        """Whether a capture is open."""
        return self._capturing is not None

    def synchronize(self) -> None:
        """Log a device synchronisation."""
        self.log.append(("synchronize", "", None))

    def launch(self, what: str, stream: Any = None) -> None:
        """Log that ``what`` was enqueued on ``stream`` (default: the current stream)."""
        s = self.current_stream() if stream is None else stream
        self.log.append(("launch", s.name, what))

    def op(self, what: str) -> Callable[..., None]:
        """A callable that logs ``what`` as launched on the current stream."""
        def run(*_: Any, **__: Any) -> None:
            self.launch(what)
        return run

    # -- queries used by tests -----------------------------------------------------
    def launches(self, stream: str) -> list[str]:
        """What was launched on ``stream``, in order."""
        return [e[2] for e in self.log if e[0] == "launch" and e[1] == stream]

    def happens_before(self, first: tuple[str, str], second: tuple[str, str]) -> bool:
        """Whether launch ``first`` = (stream, what) is ordered before launch ``second`` on
        the device: same stream in order, or through a record/wait chain."""
        return _happens_before(self.log, first, second)


def _happens_before(log: list[tuple[str, str, Any]], first: tuple[str, str],
                    second: tuple[str, str]) -> bool:
    # Device order: each stream runs its entries in order; a wait makes everything after
    # it on the waiting stream follow everything before the record on the recording stream.
    pos = {(e[1], e[2]): i for i, e in enumerate(log) if e[0] == "launch"}
    if first not in pos or second not in pos:
        raise KeyError(f"{first if first not in pos else second} was never launched")
    records = {e[2]: i for i, e in enumerate(log) if e[0] == "record"}
    # reach[stream] = latest log index on `stream` whose predecessors include `first`.
    start = pos[first]
    reached: dict[str, int] = {log[start][1]: start}
    changed = True
    while changed:
        changed = False
        for i, e in enumerate(log):
            if e[0] != "wait":
                continue
            rec = records.get(e[2])
            if rec is None:
                continue
            src = log[rec][1]
            if src in reached and reached[src] < rec and (
                    e[1] not in reached or reached[e[1]] > i):
                reached[e[1]] = i
                changed = True
    s2, idx2 = second[0], pos[second]
    return s2 in reached and reached[s2] < idx2
