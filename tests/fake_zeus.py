"""Fake ``zeus`` modules for CPU tests: a GPU collection whose energy counters step every
few milliseconds (like NVML's, faster), temperatures, locked-clock calls with a permission
switch, and a ZeusMonitor with measurement windows."""

from __future__ import annotations

import sys
import threading
import time
import types
from dataclasses import dataclass

import pytest


class ZeusdError(RuntimeError):
    """What Zeus raises when the daemon refuses a request."""


class FakeGPUs:
    """``zeus.device.get_gpus()``: counters step every ``period_s`` at ``idle_w`` plus any
    busy spans' extra power."""

    def __init__(self, n: int = 2, *, period_s: float = 0.02, idle_w: float = 80.0,
                 counters: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.period_s = period_s
        self.idle_w = idle_w
        self.counters = counters
        self.n = n
        self.busy: list[tuple[int, float, float, float]] = []
        self.calls: list[tuple] = []
        self.allow = True
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def _energy_j(self, i: int, t: float) -> float:
        e = self.idle_w * (t - self.t0)
        with self.lock:
            spans = [s for s in self.busy if s[0] == i]
        for _, a, b, w in spans:
            lo, hi = max(a, self.t0), min(b, t)
            if hi > lo:
                e += w * (hi - lo)
        return e

    def supports_get_total_energy_consumption(self, i: int) -> bool:
        return self.counters

    def get_total_energy_consumption(self, i: int) -> int:
        k = int((time.perf_counter() - self.t0) / self.period_s)
        return int(self._energy_j(i, self.t0 + k * self.period_s) * 1000)

    def get_gpu_temperature(self, i: int) -> int:
        return 41

    def set_gpu_locked_clocks(self, i: int, lo: int, hi: int, block: bool = True) -> None:
        self.calls.append(("lock", i, lo, hi, block))
        if not self.allow:
            raise ZeusdError("Failed to set GPU locked clocks: 403 Forbidden")

    def reset_gpu_locked_clocks(self, i: int, block: bool = True) -> None:
        self.calls.append(("reset", i, block))

    def add_busy(self, i: int, start: float, end: float, extra_w: float) -> None:
        with self.lock:
            self.busy.append((i, start, end, extra_w))


@dataclass
class Measurement:
    time: float
    gpu_energy: dict[int, float]


class FakeZeusMonitor:
    """``zeus.monitor.ZeusMonitor`` over the module's FakeGPUs."""

    gpus_factory: FakeGPUs | None = None

    def __init__(self, gpu_indices: list[int] | None = None, **_: object) -> None:
        assert FakeZeusMonitor.gpus_factory is not None
        self.gpus = FakeZeusMonitor.gpus_factory
        self.gpu_indices = list(range(len(self.gpus))) if gpu_indices is None else gpu_indices
        self.windows: dict[str, tuple[float, dict[int, float]]] = {}

    def begin_window(self, key: str, sync_execution: bool = True) -> None:
        self.windows[key] = (time.time(), {i: self.gpus.get_total_energy_consumption(i) / 1e3
                                           for i in self.gpu_indices})

    def end_window(self, key: str, sync_execution: bool = True) -> Measurement:
        t0, e0 = self.windows.pop(key)
        return Measurement(time=time.time() - t0,
                           gpu_energy={i: self.gpus.get_total_energy_consumption(i) / 1e3 - e0[i]
                                       for i in self.gpu_indices})


def install(monkeypatch: pytest.MonkeyPatch, gpus: FakeGPUs) -> FakeGPUs:
    """Put fake ``zeus``, ``zeus.device`` and ``zeus.monitor`` modules in ``sys.modules``."""
    zeus = types.ModuleType("zeus")
    device = types.ModuleType("zeus.device")
    device.get_gpus = lambda: gpus  # type: ignore[attr-defined]
    monitor = types.ModuleType("zeus.monitor")
    FakeZeusMonitor.gpus_factory = gpus
    monitor.ZeusMonitor = FakeZeusMonitor  # type: ignore[attr-defined]
    zeus.device, zeus.monitor = device, monitor  # type: ignore[attr-defined]
    for name, mod in (("zeus", zeus), ("zeus.device", device), ("zeus.monitor", monitor)):
        monkeypatch.setitem(sys.modules, name, mod)
    return gpus
