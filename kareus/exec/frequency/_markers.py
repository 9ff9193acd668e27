"""Stream markers: tell the host when the device reaches a point of a stream.

A host function (``cudaLaunchHostFunc``, from the small ``ext/hostfn`` extension) that
writes a token into a pipe, or, without the extension, a CUDA event that a thread polls.
"""

from __future__ import annotations

import abc
import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any

from kareus.errors import GraphCaptureError, HardwareError
from kareus.exec._ext_build import load_shared_library

__all__ = ["EventPollingMarker", "HostFunctionMarker", "StreamMarker", "load_hostfn_library"]


class StreamMarker(abc.ABC):
    """Puts a marker on a stream; calls ``fire(token)`` (from any thread) when the
    device reaches it."""

    name: str = ""
    #: Whether a marker put on a stream that is being captured becomes part of the graph
    #: (``enqueue(..., standing=True)``: delivered at every replay).
    capturable: bool = False

    @abc.abstractmethod
    def start(self, fire: Callable[[int], None]) -> None:
        """Begin delivering tokens to ``fire``."""

    @abc.abstractmethod
    def enqueue(self, stream: Any, token: int, *, standing: bool = False) -> None:
        """Put the marker for ``token`` at the current end of ``stream``; ``standing``:
        the stream is being captured, deliver the token at every replay of the graph
        (only markers that are ``capturable``)."""

    @abc.abstractmethod
    def close(self, *, drained: bool = True) -> None:
        """Stop delivering (after markers already reached have been delivered);
        ``drained`` says whether every marker enqueued has been reached."""


_HOSTFN_LIB: Any = None


def load_hostfn_library(*, arch: str | None = None) -> Any:
    """Build (first use) and load ``ext/hostfn``; returns the ``ctypes`` library.

    Raises:
        kareus.exec._ext_build.ExtensionBuildError: nvcc missing or the build failed.
    """
    global _HOSTFN_LIB
    if _HOSTFN_LIB is None:
        if arch is None:
            import torch

            major, minor = torch.cuda.get_device_capability()
            arch = f"sm_{major}{minor}"
        lib = load_shared_library("hostfn", arch=arch)
        lib.kareus_hostfn_enqueue.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                              ctypes.c_ulonglong]
        lib.kareus_hostfn_enqueue.restype = ctypes.c_int
        lib.kareus_hostfn_enqueue_standing.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                                       ctypes.c_ulonglong]
        lib.kareus_hostfn_enqueue_standing.restype = ctypes.c_int
        lib.kareus_hostfn_version.restype = ctypes.c_int
        if lib.kareus_hostfn_version() != 2:
            raise HardwareError("ext/hostfn library has an unexpected ABI version")
        _HOSTFN_LIB = lib
    return _HOSTFN_LIB


def _stream_handle(stream: Any) -> int:
    handle = getattr(stream, "cuda_stream", stream)
    return int(handle)


class HostFunctionMarker(StreamMarker):
    """Markers as CUDA host functions (``ext/hostfn``) that write tokens into a pipe.

    Args:
        lib: The loaded library (``None``: ``load_hostfn_library``).
    """

    name = "hostfn"
    capturable = True

    def __init__(self, *, lib: Any = None) -> None:
        self._lib = lib if lib is not None else load_hostfn_library()
        self._standing = 0
        self._r, self._w = os.pipe()
        # Never block the CUDA callback thread (it would stall every stream of the
        # process): with the reader gone (after close) and a graph still replayed, a full
        # pipe drops the token instead.
        os.set_blocking(self._w, False)
        self._thread: threading.Thread | None = None
        self._fire: Callable[[int], None] | None = None

    def start(self, fire: Callable[[int], None]) -> None:
        """Start the thread that reads tokens from the pipe and hands them to ``fire``."""
        self._fire = fire
        self._thread = threading.Thread(target=self._read, name="kareus-hostfn-reader",
                                        daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._r, 4096)
            if not chunk:
                return
            buf += chunk
            while len(buf) >= 8:
                token = int.from_bytes(buf[:8], "little", signed=False)
                buf = buf[8:]
                if token == 0xFFFFFFFFFFFFFFFF:
                    return
                assert self._fire is not None
                self._fire(token)

    def enqueue(self, stream: Any, token: int, *, standing: bool = False) -> None:
        """Enqueue a host function on ``stream`` that writes ``token`` into the pipe;
        ``standing`` (a stream being captured into a graph): a host node that writes it
        at every replay."""
        fn = (self._lib.kareus_hostfn_enqueue_standing if standing
              else self._lib.kareus_hostfn_enqueue)
        rc = fn(ctypes.c_void_p(_stream_handle(stream)), self._w, ctypes.c_ulonglong(token))
        if rc != 0:
            raise HardwareError(f"cudaLaunchHostFunc failed (error {rc})")
        self._standing += bool(standing)

    def close(self, *, drained: bool = True) -> None:
        # The stop token goes through the pipe after every token already written.
        """Stop the reader after every token already written; close the pipe if ``drained``."""
        os.write(self._w, (0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"))
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if drained and not self._standing:
            os.close(self._w)
            os.close(self._r)
        # A captured graph's host nodes may still write to self._w at a later replay:
        # with standing markers both ends stay open, so the descriptor is never reused.
        # Otherwise host functions still queued on a stream will write to self._w later:
        # keep both ends open so that descriptor number is never reused for another file.


class EventPollingMarker(StreamMarker):
    """Markers as events that a thread polls (the fallback without ``ext/hostfn``).

    Args:
        event_factory: ``stream -> event`` recording an event on ``stream`` (an object
            with ``query() -> bool``); ``None`` = ``torch.cuda.Event`` recorded there.
        poll_interval_s: Polling period (the delivery delay is up to about this).
    """

    name = "event"

    def __init__(self, *, event_factory: Callable[[Any], Any] | None = None,
                 poll_interval_s: float = 0.0002) -> None:
        self._factory = event_factory or self._torch_event
        self._poll_s = float(poll_interval_s)
        self._pending: list[tuple[int, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fire: Callable[[int], None] | None = None

    @staticmethod
    def _torch_event(stream: Any) -> Any:
        import torch

        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def start(self, fire: Callable[[int], None]) -> None:
        """Start the thread that polls the events and hands reached tokens to ``fire``."""
        self._fire = fire
        self._thread = threading.Thread(target=self._poll, name="kareus-event-poller",
                                        daemon=True)
        self._thread.start()

    def enqueue(self, stream: Any, token: int, *, standing: bool = False) -> None:
        """Record an event for ``token`` at the current end of ``stream``.

        Raises:
            GraphCaptureError: ``standing``: a polled event cannot be part of a graph.
        """
        if standing:
            raise GraphCaptureError("event polling cannot mark a stream being captured; "
                                    "the executor issues such clock requests before each "
                                    "graph's replay instead")
        ev = self._factory(stream)
        with self._lock:
            self._pending.append((token, ev))

    def _deliver_ready(self) -> bool:
        with self._lock:
            pending = list(self._pending)
        done = [(tok, ev) for tok, ev in pending if ev.query()]
        if done:
            with self._lock:
                ids = {id(ev) for _, ev in done}
                self._pending = [p for p in self._pending if id(p[1]) not in ids]
            assert self._fire is not None
            for tok, _ in done:
                self._fire(tok)
        return bool(done)

    def _poll(self) -> None:
        while not self._stop.is_set():
            if not self._deliver_ready():
                self._stop.wait(self._poll_s)
        self._deliver_ready()

    def close(self, *, drained: bool = True) -> None:
        """Stop the polling thread (after delivering the events already reached)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
