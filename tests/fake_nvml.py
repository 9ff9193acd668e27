"""A fake NVML module for CPU tests: an energy counter that steps every ``period_s``, a
power reading, temperatures, clocks and locked-clock calls with a permission switch."""

from __future__ import annotations

import threading
import time


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_NoPermission(NVMLError):  # pynvml's naming
    def __init__(self) -> None:
        super().__init__(4)


NVML_ERROR_NO_PERMISSION = 4
NVML_CLOCK_SM = 1


class FakeDevice:
    def __init__(self, idle_w: float, uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
                 ) -> None:
        self.idle_w = idle_w
        self.uuid = uuid
        self.busy: list[tuple[float, float, float]] = []  # (start, end, extra watts)
        self.temp_c = 40.0
        self.locked: tuple[int, int] | None = None
        self.sm_clock_mhz = 1980

    def power_w(self, t: float) -> float:
        return self.idle_w + sum(w for a, b, w in self.busy if a <= t < b)

    def energy_j(self, t: float, t0: float) -> float:
        e = self.idle_w * (t - t0)
        for a, b, w in self.busy:
            lo, hi = max(a, t0), min(b, t)
            if hi > lo:
                e += w * (hi - lo)
        return e


class FakeNVML:
    """Counter steps every ``period_s``; reads return the value at the last step."""

    NVMLError = NVMLError
    NVMLError_NoPermission = NVMLError_NoPermission
    NVML_CLOCK_SM = NVML_CLOCK_SM

    def __init__(self, n: int = 1, *, period_s: float = 0.02, idle_w: float = 80.0,
                 allow_clock_changes: bool = True, counter_moves: bool = True,
                 power_readings: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.period_s = period_s
        # NVML reports UUIDs as "GPU-<hex>"; device i's ends in its index.
        self.devices = [FakeDevice(idle_w, f"GPU-5eed{i:04x}-1111-2222-3333-{i:012x}")
                        for i in range(n)]
        self.allow = allow_clock_changes
        self.counter_moves = counter_moves
        self.power_readings = power_readings
        self.calls: list[tuple] = []
        self.lock = threading.Lock()
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeDevice:
        return self.devices[i]

    def nvmlDeviceGetUUID(self, h: FakeDevice) -> bytes:
        return h.uuid.encode()  # older pynvml releases return bytes

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeDevice) -> int:
        if not self.counter_moves:
            return 123456
        now = time.perf_counter()
        k = int((now - self.t0) / self.period_s)
        t_step = self.t0 + k * self.period_s
        with self.lock:
            return int(h.energy_j(t_step, self.t0) * 1000)

    def nvmlDeviceGetPowerUsage(self, h: FakeDevice) -> int:
        """The power now (mW); raises like a GPU without the reading when
        ``power_readings`` is off."""
        if not self.power_readings:
            raise NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED
        with self.lock:
            return int(h.power_w(time.perf_counter()) * 1000)

    def nvmlDeviceGetTemperature(self, h: FakeDevice, sensor: int) -> float:
        return h.temp_c

    def nvmlDeviceGetClockInfo(self, h: FakeDevice, kind: int) -> int:
        return h.locked[0] if h.locked else h.sm_clock_mhz

    def nvmlDeviceSetGpuLockedClocks(self, h, lo, hi):
        self.calls.append(("lock", self.devices.index(h), lo, hi))
        if not self.allow:
            raise NVMLError_NoPermission()
        h.locked = (lo, hi)

    def nvmlDeviceResetGpuLockedClocks(self, h):
        self.calls.append(("reset", self.devices.index(h)))
        h.locked = None

    def add_busy(self, dev: int, start: float, end: float, extra_w: float) -> None:
        with self.lock:
            self.devices[dev].busy.append((start, end, extra_w))
