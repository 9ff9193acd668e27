"""Zeus interop on the CPU: ZeusdFrequencyController and ZeusEnergyMeter against fake zeus
modules (no Zeus, no GPU, no daemon needed)."""

from __future__ import annotations

import sys
import time
import types

import pytest
from fake_zeus import FakeGPUs, FakeZeusMonitor, install

from kareus.errors import HardwareError, UnsupportedFrequencyError
from kareus.exec import (
    DryRunFrequencyController,
    FrequencyController,
    FrequencyPermissionError,
    StreamMarker,
    StreamOrderedTrigger,
)
from kareus.integrations.zeus import ZeusdFrequencyController, ZeusEnergyMeter
from kareus.model.config import ScheduleConfig
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.partition import OpPartition
from kareus.profilers import EnergyMeter, NVMLProfiler, PartitionRunner


@pytest.fixture()
def gpus(monkeypatch: pytest.MonkeyPatch) -> FakeGPUs:
    monkeypatch.setenv("ZEUSD_SOCK_PATH", "/var/run/zeusd.sock")
    return install(monkeypatch, FakeGPUs(2))


# ----------------------------------------------------------------- frequency control


def test_controller_locks_and_restores_through_zeus(gpus: FakeGPUs) -> None:
    with ZeusdFrequencyController(device_indices=[0, 1], gpu="h200-sxm") as ctl:
        assert isinstance(ctl, FrequencyController)
        ctl.set_frequency(1500, token=7)
        assert ctl.current_mhz == 1500 and ctl.locked_devices == (0, 1)
        with pytest.raises(UnsupportedFrequencyError, match="nearest"):
            ctl.set_frequency(1501)
    assert gpus.calls == [("lock", 0, 1500, 1500, True), ("lock", 1, 1500, 1500, True),
                          ("reset", 0, True), ("reset", 1, True)]
    assert [r.freq_mhz for r in ctl.requests] == [1500, None]
    assert ctl.requests[0].token == 7 and ctl.locked_devices == ()


def test_controller_needs_the_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeGPUs(1))
    monkeypatch.delenv("ZEUSD_SOCK_PATH", raising=False)
    with pytest.raises(HardwareError, match="ZEUSD_SOCK_PATH is not set"):
        ZeusdFrequencyController(device_indices=[0])
    ZeusdFrequencyController(device_indices=[0], require_zeusd=False).close()


def test_permission_denied_is_typed_and_restores(gpus: FakeGPUs) -> None:
    ctl = ZeusdFrequencyController(device_indices=[0, 1])
    ctl.set_frequency(1200)
    gpus.allow = False
    with pytest.raises(FrequencyPermissionError, match="zeusd runs as root"):
        ctl.set_frequency(1300)
    assert ("reset", 0, True) in gpus.calls and ctl.locked_devices == ()
    ctl.close()


def test_zeus_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEUSD_SOCK_PATH", "/x")
    for name in ("zeus", "zeus.device", "zeus.monitor"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(HardwareError, match=r"kareus\[zeus\]"):
        ZeusdFrequencyController(device_indices=[0])
    with pytest.raises(HardwareError, match=r"kareus\[zeus\]"):
        ZeusEnergyMeter(device_indices=[0])


class _ImmediateMarker(StreamMarker):
    """Reached as soon as it is enqueued (no device)."""

    name = "immediate"

    def start(self, fire):  # type: ignore[no-untyped-def]
        self._fire = fire

    def enqueue(self, stream, token):  # type: ignore[no-untyped-def]
        self._fire(token)

    def close(self, *, drained: bool = True) -> None:
        return None


def test_stream_ordered_trigger_drives_the_zeus_controller(gpus: FakeGPUs) -> None:
    ctl = ZeusdFrequencyController(device_indices=[0])
    dry = DryRunFrequencyController()
    for controller in (ctl, dry):
        with StreamOrderedTrigger(controller, marker=_ImmediateMarker()) as trig:
            for f in (1410, 1200, 1410):
                trig.request(f, stream=object())
            assert trig.wait(2.0) and not trig.errors
    ctl.close()
    assert [c[2] for c in gpus.calls if c[0] == "lock"] == [1410, 1200, 1410]
    assert [r.freq_mhz for r in dry.requests] == [1410, 1200, 1410]  # the same requests


# ----------------------------------------------------------------- energy meter


def test_meter_reads_counter_steps_through_zeus(gpus: FakeGPUs) -> None:
    # GPU 1 draws 500 W in all (GPU 0 idles at 80 W). The window is counted in observed
    # counter steps (15 of 20 ms), not a fixed sleep that a starved polling thread may see
    # few steps in; the timeouts only end a broken meter.
    gpus.add_busy(1, gpus.t0, float("inf"), 420.0)
    meter = ZeusEnergyMeter(device_indices=[1], poll_interval_s=0.0005)
    assert isinstance(meter, EnergyMeter) and meter.monitor.gpu_indices == [1]
    with meter:
        meter.wait_edges(2, timeout_s=60.0)
        t0 = time.perf_counter()
        meter.wait_edges(16, timeout_s=60.0)
        t1 = time.perf_counter()
        energy, dt, steps = meter.energy_between(t0, t1)
    assert steps >= 7 and energy / dt == pytest.approx(500.0, rel=0.05)
    assert meter.temperatures_c() == [41.0]
    assert meter.mean_sm_clock_mhz(t0, t1) is None  # Zeus does not report the clock


def test_meter_windows_are_zeus_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a fake clock the window's figures are exact: 105 ms hold five whole 20-ms counter
    # steps, at 80 W on GPU 0 and 500 W on GPU 1, summed over both.
    import fake_zeus

    now = [0.0]
    monkeypatch.setattr(fake_zeus, "time", types.SimpleNamespace(
        time=lambda: now[0], perf_counter=lambda: now[0]))
    gpus = install(monkeypatch, FakeGPUs(2))
    gpus.add_busy(1, 0.0, 1.0, 420.0)
    meter = ZeusEnergyMeter(monitor=FakeZeusMonitor(gpu_indices=[0, 1]))
    assert meter.device_indices == (0, 1)
    meter.begin_window("iteration")
    now[0] = 0.105
    time_s, energy_j = meter.end_window("iteration")
    assert time_s == pytest.approx(0.105)
    assert energy_j == pytest.approx((80.0 + 500.0) * 0.1)


def test_meter_refuses_gpus_without_a_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeGPUs(1, counters=False))
    with pytest.raises(HardwareError, match="no energy counter"):
        ZeusEnergyMeter(device_indices=[0])


class _BusyRunner(PartitionRunner):
    """A 'device' that is busy for step_s per step at busy_w on the fake GPU 0."""

    def __init__(self, gpus: FakeGPUs, step_s: float = 0.004, busy_w: float = 500.0) -> None:
        self.gpus, self.step_s, self.extra_w = gpus, step_s, busy_w - gpus.idle_w
        self.until = time.perf_counter()

    def prepare(self, partition, config):  # type: ignore[no-untyped-def]
        def step() -> None:
            start = max(time.perf_counter(), self.until)
            self.until = start + self.step_s
            self.gpus.add_busy(0, start, self.until, self.extra_w)
        return step

    def synchronize(self) -> None:
        delay = self.until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def mark(self) -> float:
        return max(self.until, time.perf_counter())

    def elapsed_s(self, a: float, b: float) -> float:
        return b - a


def test_nvml_profiler_measures_with_the_zeus_meter(gpus: FakeGPUs) -> None:
    part = OpPartition(name="p", compute_ops=[ComputeOp(name="mm", kind=OpKind.GEMM,
                                                        flops=1e9, bytes_moved=1e6)],
                       comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=1e6,
                                      group_size=2))
    meter = ZeusEnergyMeter(device_indices=[0], poll_interval_s=0.0002)
    prof = NVMLProfiler(gpu="h200-sxm", runner=_BusyRunner(gpus), meter=meter, warmup_s=0.03,
                        window_steps=5, max_cooldown_s=0.2)
    try:
        rec = prof.measure_record(part, ScheduleConfig(1980, 4, "mm"))
    finally:
        prof.close()
    assert rec.measurement.time_s == pytest.approx(0.004, rel=0.03)
    assert rec.power_w == pytest.approx(500.0, rel=0.06)
    # measured idle of the one GPU, scaled to the partition's group of two
    assert rec.measurement.static_power_w == pytest.approx(2 * 80.0, rel=0.1)
