"""The stream-ordered trigger: clock requests reach the controller when the GPU gets there."""

from __future__ import annotations

import abc
import queue
import threading
import time
from typing import Any

from kareus._logging import get_logger
from kareus.errors import ArgumentTypeError, GraphCaptureError
from kareus.exec.frequency._controllers import FrequencyController
from kareus.exec.frequency._markers import EventPollingMarker, HostFunctionMarker, StreamMarker

__all__ = ["FrequencyTrigger", "StreamOrderedTrigger"]

# The package's logger: users configure "kareus.exec.frequency".
_log = get_logger("kareus.exec.frequency")


class FrequencyTrigger(abc.ABC):
    """Requests clock changes that take effect in stream order (the executor's role for
    frequency: it asks at each microbatch boundary, the trigger gets it there).

    [`StreamOrderedTrigger`][kareus.exec.StreamOrderedTrigger] is the implementation for GPUs;
    ``kareus.testing`` has a recording fake.
    """

    #: Whether a request made on a stream being captured into a CUDA graph becomes part
    #: of the graph (a host node); when not, an executor that captures issues the request
    #: on the stream right before the graph's replay.
    capturable: bool = False

    @abc.abstractmethod
    def request(self, freq_mhz: int, *, stream: Any = None) -> int:
        """Ask for ``freq_mhz`` from the current end of ``stream`` on; returns a token.

        Args:
            freq_mhz: The SM clock to run at from that point of the stream on.
            stream: The stream whose current end marks the boundary (``None``: the
                current CUDA stream).
        """


class StreamOrderedTrigger(FrequencyTrigger):
    """Hands clock requests to a controller when the GPU reaches them in stream order.

    Args:
        controller: The [`FrequencyController`][kareus.exec.FrequencyController] that changes the
            clock.
        marker: How markers are put on streams; ``None`` =
            [`HostFunctionMarker`][kareus.exec.HostFunctionMarker] if ``ext/hostfn`` builds and
            loads, else [`EventPollingMarker`][kareus.exec.EventPollingMarker].

    Use as a context manager, or call [`close`][kareus.exec.StreamOrderedTrigger.close] (it waits
    for delivered markers). ``fired`` lists ``(token, freq_mhz, time_s)`` in the order requests
    reached the controller; ``errors`` holds exceptions the controller raised on its thread.
    """

    def __init__(self, controller: FrequencyController, *,
                 marker: StreamMarker | None = None) -> None:
        if not isinstance(controller, FrequencyController):
            raise ArgumentTypeError(f"controller must be a FrequencyController, got "
                                    f"{type(controller).__name__}")
        if marker is not None and not isinstance(marker, StreamMarker):
            raise ArgumentTypeError(f"marker must be a StreamMarker, got {type(marker).__name__}")
        self.controller = controller
        self.fallback_reason: str | None = None
        if marker is None:
            try:
                marker = HostFunctionMarker()
            except Exception as exc:  # any build/load failure
                self.fallback_reason = f"{type(exc).__name__}: {exc}"[:500]
                marker = EventPollingMarker()
                _log.warning("clock changes fall back to event polling (delivered up to "
                             "%.1f ms late): the host-function extension is unavailable: %s",
                             1e3 * marker._poll_s, self.fallback_reason)
        self.marker = marker
        # Requests on a stream being captured become host nodes with the host-function
        # marker; with event polling the executor issues them before each replay.
        self.capturable = bool(marker.capturable)
        self._requests: dict[int, int] = {}
        self._standing: dict[int, int] = {}
        self._made_once = 0
        self._fired_once = 0
        self._next = 1
        self._lock = threading.Lock()
        self._queue: queue.Queue[int | None] = queue.Queue()
        self.fired: list[tuple[int, int, float]] = []
        self.errors: list[BaseException] = []
        self._worker = threading.Thread(target=self._work, name="kareus-frequency",
                                        daemon=True)
        self._worker.start()
        self.marker.start(self._queue.put)
        self._closed = False

    @property
    def mechanism(self) -> str:
        """``"hostfn"`` or ``"event"`` (or a custom marker's name)."""
        return self.marker.name


    def request(self, freq_mhz: int, *, stream: Any = None) -> int:
        """Ask for ``freq_mhz`` from the current end of ``stream`` on; returns a token.

        On a stream being captured into a CUDA graph the request is a standing one: a
        host node that asks for the clock at every replay of the graph.

        Raises:
            GraphCaptureError: the stream is being captured and the marker cannot be
                part of a graph (event polling).
        """
        if self._closed:
            raise RuntimeError("the trigger is closed")
        import torch

        if stream is None:
            stream = torch.cuda.current_stream()
        standing = bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        if standing and not self.capturable:
            raise GraphCaptureError(f"the {self.mechanism} marker cannot be captured in a "
                                    "CUDA graph: request the clock outside the capture")
        with self._lock:
            token = self._next
            self._next += 1
            if standing:
                self._standing[token] = int(freq_mhz)
            else:
                self._requests[token] = int(freq_mhz)
                self._made_once += 1
        if standing:
            self.marker.enqueue(stream, token, standing=True)
        else:
            self.marker.enqueue(stream, token)
        return token

    def _work(self) -> None:
        while True:
            token = self._queue.get()
            if token is None:
                return
            with self._lock:
                freq = self._requests.pop(token, None)
                once = freq is not None
                if freq is None:
                    freq = self._standing.get(token)
            if freq is None:
                continue
            try:
                self.controller.set_frequency(freq, token=token)
            except BaseException as exc:  # reported through errors
                self.errors.append(exc)
            self.fired.append((token, freq, time.perf_counter()))
            if once:
                with self._lock:
                    self._fired_once += 1

    def pending(self) -> int:
        """Requests not yet delivered to the controller."""
        with self._lock:
            return len(self._requests)

    def wait(self, timeout_s: float = 10.0) -> bool:
        """Wait until every one-shot request made so far has been handled by the
        controller (standing requests of captured graphs fire at each replay: synchronise
        the device to have them delivered)."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            with self._lock:
                if self._fired_once >= self._made_once:
                    return True
            time.sleep(0.0005)
        return False

    def close(self, *, timeout_s: float = 10.0) -> None:
        """Wait (up to ``timeout_s``) for outstanding markers, then stop the marker and
        the worker thread."""
        if self._closed:
            return
        self._closed = True
        drained = self.wait(timeout_s)
        self.marker.close(drained=drained)
        self._queue.put(None)
        self._worker.join(timeout=5.0)

    def __enter__(self) -> StreamOrderedTrigger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
