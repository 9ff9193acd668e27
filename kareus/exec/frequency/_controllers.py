"""Frequency controllers: set the SM clock of the GPUs, and always give it back."""

from __future__ import annotations

import abc
import atexit
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kareus.errors import ArgumentError, HardwareError
from kareus.exec.nvml_device import load_nvml, nvml_device_index
from kareus.model.gpu import GPUSpec, get_gpu

__all__ = [
    "DryRunFrequencyController",
    "FrequencyController",
    "FrequencyPermissionError",
    "FrequencyRequest",
    "LockingFrequencyController",
    "NVMLFrequencyController",
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


class LockingFrequencyController(FrequencyController):
    """The shared half of the controllers that really lock clocks: which GPUs are locked,
    restoring them whatever happens, and the record of requests.

    A subclass says how to lock and restore one GPU (``_lock_device``, ``_unlock_device``)
    and what a failure means (``_error``); this class restores the default clocks on exit
    from a ``with`` block, on ``close()``, at interpreter exit, on
    SIGTERM when asked to, and before any error of a lock request is raised.

    Args:
        device_indices: The GPUs to control, in the subclass's numbering.
        gpu: GPU preset or spec; requested clocks must be among its supported clocks.
        handle_signals: Restore the clocks on SIGTERM (then run the previous handler, or exit
            with status 143). Only possible from the main thread.

    Raises:
        ValueError: no GPU to control.
    """

    #: The start of the error raised when restoring the clocks fails.
    _restore_failed = "could not restore the default clocks of "

    def __init__(self, *, device_indices: Sequence[int], gpu: str | GPUSpec | None = None,
                 handle_signals: bool = False) -> None:
        self.device_indices = tuple(int(i) for i in device_indices)
        if not self.device_indices:
            raise ArgumentError(f"{type(self).__name__} needs at least one GPU")
        self.gpu = None if gpu is None else get_gpu(gpu)
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

    @abc.abstractmethod
    def _lock_device(self, index: int, freq_mhz: int) -> None:
        """Lock GPU ``index``'s SM clock at ``freq_mhz`` (any exception: it failed)."""

    @abc.abstractmethod
    def _unlock_device(self, index: int) -> None:
        """Restore GPU ``index``'s default clocks (any exception: it failed)."""

    @abc.abstractmethod
    def _error(self, exc: BaseException, what: str) -> HardwareError:
        """The error to raise when ``what`` (e.g. "lock GPU 0 at 1500 MHz") failed with ``exc``."""

    def set_frequency(self, freq_mhz: int, *, token: int | None = None) -> None:
        """Lock every controlled GPU's SM clock at ``freq_mhz``.

        Raises:
            UnsupportedFrequencyError: not a supported clock of the GPU (nothing touched).
            FrequencyPermissionError: the GPU refuses for lack of permission; the clocks are
                restored.
            HardwareError: any other failure; the clocks are restored.
        """
        f = int(freq_mhz)
        if self.gpu is not None:
            self.gpu.check_clock(f)  # UnsupportedFrequencyError naming the nearest clock
        with self._lock:
            for i in self.device_indices:
                try:
                    self._lock_device(i, f)
                except Exception as exc:
                    self._raise(exc, f"lock GPU {i} at {f} MHz")
                self._locked.add(i)
            self.current_mhz = f
            self.requests.append(FrequencyRequest(freq_mhz=f, time_s=time.perf_counter(),
                                                  token=token))

    def _raise(self, exc: BaseException, what: str) -> None:
        """Put back whatever was already changed, then raise the subclass's error."""
        self._restore_after_failure()
        raise self._error(exc, what) from exc

    def _restore_after_failure(self) -> None:
        # A failure to restore is raised in place of the lock error (which stays its
        # context): clocks left locked matter more.
        self.reset()

    def reset(self) -> None:
        """Restore the default clocks of every GPU this controller locked."""
        with self._lock:
            errors = []
            for i in sorted(self._locked):
                try:
                    self._unlock_device(i)
                except Exception as exc:
                    errors.append(f"GPU {i}: {exc}")
                    continue
                self._locked.discard(i)
            self.current_mhz = None
            self.requests.append(FrequencyRequest(freq_mhz=None, time_s=time.perf_counter()))
            if errors:
                raise HardwareError(self._restore_failed + "; ".join(errors))

    @property
    def locked_devices(self) -> tuple[int, ...]:
        """GPUs whose clocks are locked now."""
        return tuple(sorted(self._locked))

    def close(self) -> None:
        """Restore the clocks (once) and remove the signal handler."""
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


def _nvml_error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return int(value) if isinstance(value, int) else None


_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_NOT_SUPPORTED = 3


class NVMLFrequencyController(LockingFrequencyController):
    """Locks SM clocks through NVML and always gives them back.

    Args:
        device_indices: NVML indices of the GPUs to control; ``None`` = this process's
            current CUDA device, found in NVML by its UUID
            ([`kareus.profilers.nvml.nvml_device_index`][kareus.exec.nvml_device_index]: right under
            ``CUDA_VISIBLE_DEVICES``).
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
        self.nvml = load_nvml(nvml)
        if device_indices is None:
            device_indices = [nvml_device_index(nvml=self.nvml)]
        self._handles = {int(i): self.nvml.nvmlDeviceGetHandleByIndex(int(i))
                         for i in device_indices}
        super().__init__(device_indices=device_indices, gpu=gpu, handle_signals=handle_signals)

    def _lock_device(self, index: int, freq_mhz: int) -> None:
        self.nvml.nvmlDeviceSetGpuLockedClocks(self._handles[index], freq_mhz, freq_mhz)

    def _unlock_device(self, index: int) -> None:
        self.nvml.nvmlDeviceResetGpuLockedClocks(self._handles[index])

    def _error(self, exc: BaseException, what: str) -> HardwareError:
        code = _nvml_error_code(exc)
        name = type(exc).__name__
        if code == _NVML_ERROR_NO_PERMISSION or "NoPermission" in name:
            return FrequencyPermissionError(
                f"could not {what}: NVML says insufficient permissions. Locking clocks "
                "needs root (or CAP_SYS_ADMIN); run as root, or use "
                "DryRunFrequencyController to plan without changing clocks")
        if code == _NVML_ERROR_NOT_SUPPORTED or "NotSupported" in name:
            return HardwareError(f"could not {what}: this GPU does not support locked "
                                 "clocks (nvmlDeviceSetGpuLockedClocks)")
        return HardwareError(f"could not {what}: {exc}")
