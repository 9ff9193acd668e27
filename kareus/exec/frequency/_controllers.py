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

from kareus.errors import HardwareError
from kareus.model.gpu import GPUSpec, get_gpu

__all__ = [
    "DryRunFrequencyController",
    "FrequencyController",
    "FrequencyPermissionError",
    "FrequencyRequest",
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
            ([`kareus.exec.nvml.nvml_device_index`][kareus.exec.nvml_device_index]: right under
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
        from kareus.exec.nvml import load_nvml, nvml_device_index

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
                except Exception as exc:  # NVMLError subclasses
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
                except Exception as exc:
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
