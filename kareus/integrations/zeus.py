"""Zeus interop: clocks through the Zeus daemon, energy through ZeusMonitor.

Zeus (https://github.com/ml-energy/zeus, ``pip install 'kareus[zeus]'``) measures and
optimises the energy of deep-learning jobs. Two of its pieces slot into kareus's roles:

* [`ZeusdFrequencyController`][kareus.integrations.zeus.ZeusdFrequencyController], a
  [`FrequencyController`][kareus.exec.FrequencyController]. Locking GPU clocks needs root
  (``CAP_SYS_ADMIN``), which [`NVMLFrequencyController`][kareus.exec.NVMLFrequencyController]
  therefore needs. Zeus's daemon ``zeusd`` runs privileged and takes clock requests over a Unix
  socket; with ``ZEUSD_SOCK_PATH`` set, Zeus's device layer (``zeus.device.get_gpus()``) sends
  ``set_gpu_locked_clocks`` and ``reset_gpu_locked_clocks`` to it, so an unprivileged training job
  can follow a plan's frequencies (zeus 0.16: ``zeus/device/gpu/nvidia.py``, ``ZeusdNVIDIAGPU``; the
  daemon's HTTP API is documented in ``zeusd/`` of the same repository).
* [`ZeusEnergyMeter`][kareus.integrations.zeus.ZeusEnergyMeter], an
  [`EnergyMeter`][kareus.profilers.EnergyMeter] (so [`NVMLProfiler`][kareus.profilers.NVMLProfiler] takes it
  as ``meter=``) that reads each GPU's energy counter through a ``ZeusMonitor``'s devices instead of
  pynvml: the GPU indices are ZeusMonitor's (after ``CUDA_VISIBLE_DEVICES``), and the same monitor
      stays available for
  Zeus's own measurement windows
  ([`ZeusEnergyMeter.begin_window`][kareus.integrations.zeus.ZeusEnergyMeter.begin_window]).
  ZeusMonitor's windows read the counter when they begin and end; kareus's profiler needs the
  moments the counter *steps*, so the meter polls the counter as the NVML meter does.

Importing this module imports no Zeus; the classes do when built. Tests inject fake
``zeus`` modules (``tests/integrations/test_zeus.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from kareus.errors import ArgumentError, HardwareError
from kareus.exec import FrequencyPermissionError
from kareus.exec.frequency import LockingFrequencyController
from kareus.model.gpu import GPUSpec
from kareus.profilers import EnergyMeter

__all__ = ["ZeusEnergyMeter", "ZeusdFrequencyController", "zeus_gpus"]

_INSTALL = "pip install 'kareus[zeus]'"


def zeus_gpus() -> Any:
    """Zeus's GPU collection (``zeus.device.get_gpus()``).

    Raises:
        HardwareError: Zeus is not installed, or it cannot reach the GPUs or the daemon.
    """
    try:
        from zeus.device import get_gpus  # optional dependency
    except ImportError as exc:
        raise HardwareError(f"Zeus is not installed: {_INSTALL}") from exc
    try:
        return get_gpus()
    except Exception as exc:  # Zeus raises its own error classes
        raise HardwareError(f"Zeus could not open the GPUs ({type(exc).__name__}: {exc})") \
            from exc


def _call(obj: Any, snake: str, camel: str, *args: Any, **kwargs: Any) -> Any:
    """Call a Zeus GPUs method by its current (snake_case) or older (camelCase) name."""
    fn = getattr(obj, snake, None) or getattr(obj, camel)
    return fn(*args, **kwargs)


class ZeusdFrequencyController(LockingFrequencyController):
    """Locks SM clocks through Zeus (the ``zeusd`` daemon) and always gives them back.

    Args:
        device_indices: Zeus's indices of the GPUs to control (after
            ``CUDA_VISIBLE_DEVICES``; a rank's own GPU).
        gpu: GPU preset or spec; requested clocks must be among its supported clocks.
        gpus: Zeus's GPU collection; ``None`` = ``zeus.device.get_gpus()`` (a fake in tests).
        require_zeusd: Refuse to start unless ``ZEUSD_SOCK_PATH`` is set (without the daemon,
            Zeus locks clocks through NVML directly, which needs root: then use
            [`NVMLFrequencyController`][kareus.exec.NVMLFrequencyController]).

    Use as a context manager (or call ``close()``): the default clocks come back on exit, on
    exceptions and at interpreter exit.

    Raises:
        HardwareError: Zeus is missing, ``ZEUSD_SOCK_PATH`` is not set, or Zeus fails.
    """

    _restore_failed = "could not restore the default clocks through Zeus: "

    def __init__(self, *, device_indices: Sequence[int], gpu: str | GPUSpec | None = None,
                 gpus: Any = None, require_zeusd: bool = True) -> None:
        if not tuple(device_indices):
            raise ArgumentError("a ZeusdFrequencyController needs at least one GPU")
        if gpus is None:
            if require_zeusd and not os.environ.get("ZEUSD_SOCK_PATH"):
                raise HardwareError(
                    "ZEUSD_SOCK_PATH is not set: start the Zeus daemon (zeusd) and set "
                    "ZEUSD_SOCK_PATH to its socket before the first Zeus call, or pass "
                    "require_zeusd=False to lock clocks through NVML as root")
            gpus = zeus_gpus()
        self.gpus = gpus
        super().__init__(device_indices=device_indices, gpu=gpu, handle_signals=False)

    def _lock_device(self, index: int, freq_mhz: int) -> None:
        # blocking until zeusd did
        self.gpus.set_gpu_locked_clocks(index, freq_mhz, freq_mhz, block=True)

    def _unlock_device(self, index: int) -> None:
        self.gpus.reset_gpu_locked_clocks(index, block=True)

    def _restore_after_failure(self) -> None:
        with contextlib.suppress(Exception):
            self.reset()

    def _error(self, exc: BaseException, what: str) -> HardwareError:
        text = f"{type(exc).__name__}: {exc}"
        if "NoPermission" in type(exc).__name__ or "403" in str(exc):
            return FrequencyPermissionError(
                f"could not {what}: permission denied ({text}); check that zeusd runs as "
                "root and that this user may write to its socket")
        return HardwareError(f"could not {what} through Zeus ({text})")


class _ZeusHandles:
    """The two NVML entry points EnergyMeter's constructor uses, answered for Zeus indices
    (every counter, temperature and clock read goes through
    [`ZeusEnergyMeter`][kareus.integrations.zeus.ZeusEnergyMeter])."""

    def nvmlInit(self) -> None:  # NVML's name
        return None

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return int(index)


class ZeusEnergyMeter(EnergyMeter):
    """Step-edge reads of the GPUs' energy counters through a ``ZeusMonitor``.

    A drop-in for [`EnergyMeter`][kareus.profilers.EnergyMeter] (``NVMLProfiler(meter=...)``): the same
    polling thread, edges and queries, with every read going through Zeus's device layer.

    Args:
        device_indices: ZeusMonitor's GPU indices to read (``None`` = the monitor's own).
        monitor: A ``zeus.monitor.ZeusMonitor``; ``None`` = a new one on ``device_indices``.
        poll_interval_s: As for [`EnergyMeter`][kareus.profilers.EnergyMeter].
        history: As for [`EnergyMeter`][kareus.profilers.EnergyMeter].

    Raises:
        HardwareError: Zeus is missing, or a GPU has no energy counter (older than Volta,
            where ZeusMonitor samples power instead).
    """

    def __init__(self, *, device_indices: Sequence[int] | None = None, monitor: Any = None,
                 poll_interval_s: float | None = None, history: int = 20000) -> None:
        if monitor is None:
            try:
                from zeus.monitor import ZeusMonitor  # optional dependency
            except ImportError as exc:
                raise HardwareError(f"Zeus is not installed: {_INSTALL}") from exc
            try:
                monitor = ZeusMonitor(gpu_indices=None if device_indices is None
                                      else list(device_indices))
            except Exception as exc:  # Zeus raises its own error classes
                raise HardwareError(f"ZeusMonitor could not start ({type(exc).__name__}: "
                                    f"{exc})") from exc
        indices = list(monitor.gpu_indices if device_indices is None else device_indices)
        self.monitor = monitor
        gpus = monitor.gpus
        for i in indices:
            if not _call(gpus, "supports_get_total_energy_consumption",
                         "supportsGetTotalEnergyConsumption", i):
                raise HardwareError(f"GPU {i} has no energy counter (ZeusMonitor samples its "
                                    "power instead); kareus's meter needs a Volta or newer GPU")
        super().__init__(device_indices=indices, nvml=_ZeusHandles(),
                         poll_interval_s=poll_interval_s, history=history)

    def read_energy_mj(self) -> list[int]:
        """Current counter values (mJ), one per GPU, through Zeus."""
        gpus = self.monitor.gpus
        return [int(_call(gpus, "get_total_energy_consumption", "getTotalEnergyConsumption", i))
                for i in self.device_indices]

    def temperatures_c(self) -> list[float]:
        """GPU temperatures (degrees C), through Zeus."""
        gpus = self.monitor.gpus
        return [float(_call(gpus, "get_gpu_temperature", "getGpuTemperature", i))
                for i in self.device_indices]

    def sm_clocks_mhz(self) -> list[float]:
        """Not available through Zeus's device layer: raises, so samples carry no clock and
        [`mean_sm_clock_mhz`][kareus.profilers.EnergyMeter.mean_sm_clock_mhz] answers ``None``."""
        raise NotImplementedError("Zeus's device layer does not report the current SM clock")

    def begin_window(self, key: str, *, sync_execution: bool = True) -> None:
        """Begin a ZeusMonitor measurement window (Zeus's own API, same monitor)."""
        self.monitor.begin_window(key, sync_execution=sync_execution)

    def end_window(self, key: str, *, sync_execution: bool = True) -> tuple[float, float]:
        """End a ZeusMonitor window; returns ``(time_s, energy_j)``, the energy summed over
        this meter's GPUs."""
        m = self.monitor.end_window(key, sync_execution=sync_execution)
        return float(m.time), float(sum(m.gpu_energy[i] for i in self.device_indices))
