"""GPU frequency control, applied at microbatch boundaries in stream order.

A plan gives every microbatch computation one SM clock. The clock must change when
the *GPU* reaches the boundary between two microbatch computations, not when the
host thread happens to enqueue it (the host runs far ahead of the device), so a
request travels in stream order:

* :class:`StreamOrderedTrigger` (a :class:`FrequencyTrigger`, the role the executor
  asks) puts a marker on the stream at the boundary. With the small CUDA extension in
  ``_ext/hostfn`` the marker is a host function
  (``cudaLaunchHostFunc``) that only writes the request's token into a pipe; without
  it, the marker is a CUDA event that a polling thread watches. Either way, the
  trigger's own thread receives the request when the GPU gets there and calls the
  controller; no NVML or CUDA call runs inside the CUDA callback.
* A :class:`FrequencyController` changes the clock. :class:`NVMLFrequencyController`
  locks the SM clock with ``nvmlDeviceSetGpuLockedClocks`` and always restores it:
  on exit from its context, on exceptions, at interpreter exit and on SIGTERM. A
  permission problem raises :class:`FrequencyPermissionError`.
  :class:`DryRunFrequencyController` only records each request with its time; it is
  the only controller that may run on shared machines whose clocks must not change.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import ctypes
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kareus._logging import get_logger
from kareus.errors import HardwareError
from kareus.model.gpu import GPUSpec, get_gpu

_log = get_logger(__name__)

__all__ = [
    "DryRunFrequencyController",
    "EventPollingMarker",
    "FrequencyController",
    "FrequencyPermissionError",
    "FrequencyRequest",
    "FrequencyTrigger",
    "HostFunctionMarker",
    "NVMLFrequencyController",
    "StreamMarker",
    "StreamOrderedTrigger",
    "load_hostfn_library",
]


class FrequencyPermissionError(HardwareError, PermissionError):
    """The process may not change GPU clocks (NVML: insufficient permissions)."""


@attrs.frozen(kw_only=True)
class FrequencyRequest:
    """One clock request as a controller saw it.

    Attributes:
        freq_mhz: The requested SM clock (``None``: restore the default).
        time_s: ``time.perf_counter()`` when the controller received it.
        token: The trigger's token (``None`` for direct calls).
    """

    freq_mhz: int | None
    time_s: float
    token: int | None = None


# ------------------------------------------------------------------ controllers


class FrequencyController(abc.ABC):
    """Sets the SM clock of the GPUs it controls; restores the default on exit.

    Use it as a context manager so the default clock comes back whatever happens.
    """

    @abc.abstractmethod
    def set_frequency(self, freq_mhz: int, *, token: int | None = None) -> None:
        """Lock the SM clock at ``freq_mhz``."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Restore the default clock behaviour."""

    def __enter__(self) -> FrequencyController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()


class DryRunFrequencyController(FrequencyController):
    """Records every request with its time instead of touching the GPU.

    Args:
        gpu: When given, requested clocks are checked against its supported clocks.
        clock: Time source (default ``time.perf_counter``).
    """

    def __init__(self, *, gpu: str | GPUSpec | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.gpu = None if gpu is None else get_gpu(gpu)
        self._clock = clock or time.perf_counter
        self.requests: list[FrequencyRequest] = []
        self._lock = threading.Lock()
        self.current_mhz: int | None = None

    def set_frequency(self, freq_mhz: int, *, token: int | None = None) -> None:
        """Record a request for ``freq_mhz`` (checked against the GPU's clocks when it is known).

        Raises:
            UnsupportedFrequencyError: not a supported clock of the GPU.
        """
        f = int(freq_mhz)
        if self.gpu is not None:
            self.gpu.check_clock(f)  # UnsupportedFrequencyError naming the nearest clock
        with self._lock:
            self.requests.append(FrequencyRequest(freq_mhz=f, time_s=self._clock(), token=token))
            self.current_mhz = f

    def reset(self) -> None:
        """Record a request to restore the default clock."""
        with self._lock:
            self.requests.append(FrequencyRequest(freq_mhz=None, time_s=self._clock()))
            self.current_mhz = None


def _nvml_error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return int(value) if isinstance(value, int) else None


_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_NOT_SUPPORTED = 3


class NVMLFrequencyController(FrequencyController):
    """Locks SM clocks through NVML and always gives them back.

    Args:
        device_indices: NVML indices of the GPUs to control; ``None`` = this process's
            current CUDA device, found in NVML by its UUID
            (:func:`kareus.exec.nvml.nvml_device_index`: right under ``CUDA_VISIBLE_DEVICES``).
        gpu: GPU preset; requested clocks must be among its supported clocks.
        nvml: The NVML module (``None``: ``pynvml``); a fake for tests.
        handle_signals: Restore the clocks on SIGTERM (then run the previous handler,
            or exit with status 143). Only possible from the main thread.

    Raises:
        HardwareError: NVML is missing or fails.
    """

    def __init__(self, *, device_indices: Sequence[int] | None = None,
                 gpu: str | GPUSpec | None = None, nvml: Any = None,
                 handle_signals: bool = True) -> None:
        from kareus.exec.nvml import load_nvml, nvml_device_index  # noqa: PLC0415

        self.nvml = load_nvml(nvml)
        if device_indices is None:
            device_indices = [nvml_device_index(nvml=self.nvml)]
        self.device_indices = tuple(int(i) for i in device_indices)
        if not self.device_indices:
            raise ValueError("an NVMLFrequencyController needs at least one GPU")
        self.gpu = None if gpu is None else get_gpu(gpu)
        self._handles = {i: self.nvml.nvmlDeviceGetHandleByIndex(i)
                         for i in self.device_indices}
        self._locked: set[int] = set()
        self._lock = threading.RLock()
        self.current_mhz: int | None = None
        self.requests: list[FrequencyRequest] = []
        self._prev_sigterm: Any = None
        self._closed = False
        atexit.register(self._atexit)
        if handle_signals and threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._handles_signal = True
        else:
            self._handles_signal = False

    def set_frequency(self, freq_mhz: int, *, token: int | None = None) -> None:
        """Lock every controlled GPU's SM clock at ``freq_mhz``.

        Raises:
            UnsupportedFrequencyError: not a supported clock of the GPU.
            FrequencyPermissionError: NVML refuses (needs root); the clocks are restored.
            HardwareError: any other NVML failure; the clocks are restored.
        """
        f = int(freq_mhz)
        if self.gpu is not None:
            self.gpu.check_clock(f)  # UnsupportedFrequencyError naming the nearest clock
        with self._lock:
            for i, h in self._handles.items():
                try:
                    self.nvml.nvmlDeviceSetGpuLockedClocks(h, f, f)
                except Exception as exc:  # noqa: BLE001 - NVMLError subclasses
                    self._raise(exc, f"lock GPU {i} at {f} MHz")
                self._locked.add(i)
            self.current_mhz = f
            self.requests.append(FrequencyRequest(freq_mhz=f, time_s=time.perf_counter(),
                                                  token=token))

    def _raise(self, exc: BaseException, what: str) -> None:
        code = _nvml_error_code(exc)
        name = type(exc).__name__
        if code == _NVML_ERROR_NO_PERMISSION or "NoPermission" in name:
            # Put back whatever was already changed before reporting.
            self.reset()
            raise FrequencyPermissionError(
                f"could not {what}: NVML says insufficient permissions. Locking clocks "
                "needs root (or CAP_SYS_ADMIN); run as root, or use "
                "DryRunFrequencyController to plan without changing clocks") from exc
        if code == _NVML_ERROR_NOT_SUPPORTED or "NotSupported" in name:
            self.reset()
            raise HardwareError(f"could not {what}: this GPU does not support locked "
                                "clocks (nvmlDeviceSetGpuLockedClocks)") from exc
        self.reset()
        raise HardwareError(f"could not {what}: {exc}") from exc

    def reset(self) -> None:
        """Restore the default clocks of every GPU this controller locked."""
        with self._lock:
            errors = []
            for i in sorted(self._locked):
                try:
                    self.nvml.nvmlDeviceResetGpuLockedClocks(self._handles[i])
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"GPU {i}: {exc}")
                    continue
                self._locked.discard(i)
            self.current_mhz = None
            self.requests.append(FrequencyRequest(freq_mhz=None, time_s=time.perf_counter()))
            if errors:
                raise HardwareError("could not restore the default clocks of "
                                    + "; ".join(errors))

    @property
    def locked_devices(self) -> tuple[int, ...]:
        """GPUs whose clocks are locked now."""
        return tuple(sorted(self._locked))

    def close(self) -> None:
        """Restore the clocks and remove the signal handler."""
        if self._closed:
            return
        try:
            self.reset()
        finally:
            self._closed = True
            if self._handles_signal and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._prev_sigterm or signal.SIG_DFL)
                self._handles_signal = False
            with contextlib.suppress(Exception):
                atexit.unregister(self._atexit)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _atexit(self) -> None:
        with contextlib.suppress(Exception):
            self.reset()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        with contextlib.suppress(Exception):
            self.reset()
        prev = self._prev_sigterm
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_IGN:
            return
        else:
            raise SystemExit(128 + signum)


# ------------------------------------------------------------------ stream markers


class StreamMarker(abc.ABC):
    """Puts a marker on a stream; calls ``fire(token)`` (from any thread) when the
    device reaches it."""

    name: str = ""

    @abc.abstractmethod
    def start(self, fire: Callable[[int], None]) -> None:
        """Begin delivering tokens to ``fire``."""

    @abc.abstractmethod
    def enqueue(self, stream: Any, token: int) -> None:
        """Put the marker for ``token`` at the current end of ``stream``."""

    @abc.abstractmethod
    def close(self, *, drained: bool = True) -> None:
        """Stop delivering (after markers already reached have been delivered);
        ``drained`` says whether every marker enqueued has been reached."""


_HOSTFN_LIB: Any = None


def load_hostfn_library(*, arch: str | None = None) -> Any:
    """Build (first use) and load ``_ext/hostfn``; returns the ``ctypes`` library.

    Raises:
        kareus.exec._ext_build.ExtensionBuildError: nvcc missing or the build failed.
    """
    global _HOSTFN_LIB
    if _HOSTFN_LIB is None:
        from kareus.exec._ext_build import load_shared_library  # noqa: PLC0415

        if arch is None:
            import torch  # noqa: PLC0415

            major, minor = torch.cuda.get_device_capability()
            arch = f"sm_{major}{minor}"
        lib = load_shared_library("hostfn", arch=arch)
        lib.kareus_hostfn_enqueue.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                              ctypes.c_ulonglong]
        lib.kareus_hostfn_enqueue.restype = ctypes.c_int
        lib.kareus_hostfn_version.restype = ctypes.c_int
        if lib.kareus_hostfn_version() != 1:
            raise HardwareError("ext/hostfn library has an unexpected ABI version")
        _HOSTFN_LIB = lib
    return _HOSTFN_LIB


def _stream_handle(stream: Any) -> int:
    handle = getattr(stream, "cuda_stream", stream)
    return int(handle)


class HostFunctionMarker(StreamMarker):
    """Markers as CUDA host functions (``_ext/hostfn``) that write tokens into a pipe.

    Args:
        lib: The loaded library (``None``: :func:`load_hostfn_library`).
    """

    name = "hostfn"

    def __init__(self, *, lib: Any = None) -> None:
        self._lib = lib if lib is not None else load_hostfn_library()
        self._r, self._w = os.pipe()
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

    def enqueue(self, stream: Any, token: int) -> None:
        """Enqueue a host function on ``stream`` that writes ``token`` into the pipe."""
        rc = self._lib.kareus_hostfn_enqueue(ctypes.c_void_p(_stream_handle(stream)),
                                             self._w, ctypes.c_ulonglong(token))
        if rc != 0:
            raise HardwareError(f"cudaLaunchHostFunc failed (error {rc})")

    def close(self, *, drained: bool = True) -> None:
        # The stop token goes through the pipe after every token already written.
        """Stop the reader after every token already written; close the pipe if ``drained``."""
        os.write(self._w, (0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"))
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if drained:
            os.close(self._w)
            os.close(self._r)
        # Otherwise host functions still queued on a stream will write to self._w later:
        # keep both ends open so that descriptor number is never reused for another file.


class EventPollingMarker(StreamMarker):
    """Markers as events that a thread polls (the fallback without ``_ext/hostfn``).

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
        import torch  # noqa: PLC0415

        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def start(self, fire: Callable[[int], None]) -> None:
        """Start the thread that polls the events and hands reached tokens to ``fire``."""
        self._fire = fire
        self._thread = threading.Thread(target=self._poll, name="kareus-event-poller",
                                        daemon=True)
        self._thread.start()

    def enqueue(self, stream: Any, token: int) -> None:
        """Record an event for ``token`` at the current end of ``stream``."""
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


class FrequencyTrigger(abc.ABC):
    """Requests clock changes that take effect in stream order (the executor's role for
    frequency: it asks at each microbatch boundary, the trigger gets it there).

    :class:`StreamOrderedTrigger` is the implementation for GPUs; ``kareus.testing``
    has a recording fake.
    """

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
        controller: The :class:`FrequencyController` that changes the clock.
        marker: How markers are put on streams; ``None`` = :class:`HostFunctionMarker`
            if ``_ext/hostfn`` builds and loads, else :class:`EventPollingMarker`.

    Use as a context manager, or call :meth:`close` (it waits for delivered markers).
    ``fired`` lists ``(token, freq_mhz, time_s)`` in the order requests reached the
    controller; ``errors`` holds exceptions the controller raised on its thread.
    """

    def __init__(self, controller: FrequencyController, *,
                 marker: StreamMarker | None = None) -> None:
        if not isinstance(controller, FrequencyController):
            raise TypeError(f"controller must be a FrequencyController, got "
                            f"{type(controller).__name__}")
        if marker is not None and not isinstance(marker, StreamMarker):
            raise TypeError(f"marker must be a StreamMarker, got {type(marker).__name__}")
        self.controller = controller
        self.fallback_reason: str | None = None
        if marker is None:
            try:
                marker = HostFunctionMarker()
            except Exception as exc:  # noqa: BLE001 - any build/load failure
                self.fallback_reason = f"{type(exc).__name__}: {exc}"[:500]
                marker = EventPollingMarker()
                _log.warning("clock changes fall back to event polling (delivered up to "
                             "%.1f ms late): the host-function extension is unavailable: %s",
                             1e3 * marker._poll_s, self.fallback_reason)
        self.marker = marker
        self._requests: dict[int, int] = {}
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
        """Ask for ``freq_mhz`` from the current end of ``stream`` on; returns a token."""
        if self._closed:
            raise RuntimeError("the trigger is closed")
        if stream is None:
            import torch  # noqa: PLC0415

            stream = torch.cuda.current_stream()
        with self._lock:
            token = self._next
            self._next += 1
            self._requests[token] = int(freq_mhz)
        self.marker.enqueue(stream, token)
        return token

    def _work(self) -> None:
        while True:
            token = self._queue.get()
            if token is None:
                return
            with self._lock:
                freq = self._requests.pop(token, None)
            if freq is None:
                continue
            try:
                self.controller.set_frequency(freq, token=token)
            except BaseException as exc:  # noqa: BLE001 - reported through errors
                self.errors.append(exc)
            self.fired.append((token, freq, time.perf_counter()))

    def pending(self) -> int:
        """Requests not yet delivered to the controller."""
        with self._lock:
            return len(self._requests)

    def wait(self, timeout_s: float = 10.0) -> bool:
        """Wait until every request made so far has been handled by the controller."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            with self._lock:
                made = self._next - 1
            if len(self.fired) >= made:
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
