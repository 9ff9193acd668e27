"""Frequency controllers and the stream-ordered trigger, on CPU with fakes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from fake_nvml import FakeNVML

from kareus.errors import HardwareError, UnsupportedFrequencyError
from kareus.exec.frequency import (
    DryRunFrequencyController,
    EventPollingMarker,
    FrequencyController,
    FrequencyPermissionError,
    HostFunctionMarker,
    NVMLFrequencyController,
    StreamMarker,
    StreamOrderedTrigger,
)

# ------------------------------------------------------------------ NVML controller


def test_locks_and_restores_every_gpu():
    nvml = FakeNVML(n=2)
    with NVMLFrequencyController(device_indices=[0, 1], gpu="h200-sxm", nvml=nvml,
                                 handle_signals=False) as ctrl:
        ctrl.set_frequency(1500)
        assert [d.locked for d in nvml.devices] == [(1500, 1500)] * 2
        assert ctrl.locked_devices == (0, 1)
    assert [d.locked for d in nvml.devices] == [None, None]
    assert ("reset", 0) in nvml.calls and ("reset", 1) in nvml.calls


def test_restores_on_exception():
    nvml = FakeNVML(n=1)
    with pytest.raises(RuntimeError, match="boom"), NVMLFrequencyController(
            device_indices=[0], nvml=nvml, handle_signals=False) as ctrl:
        ctrl.set_frequency(1200)
        raise RuntimeError("boom")
    assert nvml.devices[0].locked is None


def test_permission_denied_is_a_clear_hardware_error():
    nvml = FakeNVML(n=1, allow_clock_changes=False)
    ctrl = NVMLFrequencyController(device_indices=[0], nvml=nvml, handle_signals=False)
    with pytest.raises(FrequencyPermissionError, match="root") as info:
        ctrl.set_frequency(1500)
    assert isinstance(info.value, HardwareError) and isinstance(info.value, PermissionError)
    assert ctrl.locked_devices == ()
    ctrl.close()


def test_partial_failure_restores_gpus_already_locked():
    nvml = FakeNVML(n=2)
    orig = nvml.nvmlDeviceSetGpuLockedClocks

    def second_fails(h, lo, hi):
        if h is nvml.devices[1]:
            raise nvml.NVMLError_NoPermission()
        return orig(h, lo, hi)

    nvml.nvmlDeviceSetGpuLockedClocks = second_fails
    ctrl = NVMLFrequencyController(device_indices=[0, 1], nvml=nvml, handle_signals=False)
    with pytest.raises(FrequencyPermissionError):
        ctrl.set_frequency(1500)
    assert nvml.devices[0].locked is None  # the first GPU was put back
    ctrl.close()


def test_unsupported_clock_rejected_before_touching_hardware():
    nvml = FakeNVML(n=1)
    ctrl = NVMLFrequencyController(device_indices=[0], gpu="h200-sxm", nvml=nvml,
                                   handle_signals=False)
    with pytest.raises(UnsupportedFrequencyError, match="nearest"):
        ctrl.set_frequency(1501)
    assert not any(c[0] == "lock" for c in nvml.calls)
    ctrl.close()


def test_sigterm_restores_then_chains_previous_handler():
    nvml = FakeNVML(n=1)
    seen = []
    prev = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        ctrl = NVMLFrequencyController(device_indices=[0], nvml=nvml)
        ctrl.set_frequency(1410)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 2
        while not seen and time.time() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGTERM]
        assert nvml.devices[0].locked is None
        ctrl.close()
        assert signal.getsignal(signal.SIGTERM) is not ctrl._on_sigterm
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_atexit_hook_restores():
    nvml = FakeNVML(n=1)
    ctrl = NVMLFrequencyController(device_indices=[0], nvml=nvml, handle_signals=False)
    ctrl.set_frequency(1605)
    ctrl._atexit()
    assert nvml.devices[0].locked is None
    ctrl.close()


def test_dry_run_records_requests_with_times():
    t = iter([1.0, 2.0, 3.0])
    ctrl = DryRunFrequencyController(gpu="h200-sxm", clock=lambda: next(t))
    with ctrl:
        ctrl.set_frequency(1500, token=7)
        ctrl.set_frequency(1200)
    assert [(r.freq_mhz, r.time_s, r.token) for r in ctrl.requests] == [
        (1500, 1.0, 7), (1200, 2.0, None), (None, 3.0, None)]
    with pytest.raises(UnsupportedFrequencyError):
        ctrl.set_frequency(1)


# ------------------------------------------------------------------ trigger


class FakeStream:
    """A stream whose markers fire when the test 'runs' the device up to them."""

    def __init__(self) -> None:
        self.queue: list[int] = []


class FakeMarker(StreamMarker):
    name = "fake"

    def start(self, fire):
        self.fire = fire

    def enqueue(self, stream, token):
        stream.queue.append(token)

    def run(self, stream, count=1):
        for _ in range(count):
            self.fire(stream.queue.pop(0))

    def close(self, *, drained=True):
        self.closed = drained


class ThreadRecordingController(DryRunFrequencyController):
    def __init__(self):
        super().__init__()
        self.threads = []

    def set_frequency(self, freq_mhz, *, token=None):
        self.threads.append(threading.current_thread().name)
        super().set_frequency(freq_mhz, token=token)


def test_trigger_delivers_in_stream_order_when_reached():
    ctrl = ThreadRecordingController()
    marker = FakeMarker()
    s = FakeStream()
    with StreamOrderedTrigger(ctrl, marker=marker) as trig:
        a = trig.request(1500, stream=s)
        b = trig.request(1200, stream=s)
        time.sleep(0.02)
        assert ctrl.requests == []  # enqueued, but the device has not got there
        assert trig.pending() == 2
        marker.run(s)
        deadline = time.time() + 2
        while len(ctrl.requests) < 1 and time.time() < deadline:
            time.sleep(0.001)
        assert [r.freq_mhz for r in ctrl.requests] == [1500]
        marker.run(s)
        assert trig.wait(2.0)
    assert [(r.freq_mhz, r.token) for r in ctrl.requests[:2]] == [(1500, a), (1200, b)]
    # The controller ran on the trigger's own thread, never on the caller's.
    assert set(ctrl.threads) == {"kareus-frequency"}
    assert marker.closed is True


def test_controller_errors_are_kept_not_lost():
    class Failing(FrequencyController):
        def set_frequency(self, freq_mhz, *, token=None):
            raise HardwareError("no")

        def reset(self):
            pass

    marker = FakeMarker()
    s = FakeStream()
    trig = StreamOrderedTrigger(Failing(), marker=marker)
    trig.request(1500, stream=s)
    marker.run(s)
    assert trig.wait(2.0)
    trig.close()
    assert len(trig.errors) == 1 and isinstance(trig.errors[0], HardwareError)


class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_event_polling_fallback_fires_when_events_complete():
    events = []

    def factory(stream):
        ev = FakeEvent()
        events.append(ev)
        return ev

    ctrl = DryRunFrequencyController()
    trig = StreamOrderedTrigger(ctrl, marker=EventPollingMarker(event_factory=factory,
                                                                poll_interval_s=0.0005))
    assert trig.mechanism == "event"
    trig.request(1500, stream="s")
    trig.request(1350, stream="s")
    time.sleep(0.02)
    assert ctrl.requests == []
    events[0].done = True
    deadline = time.time() + 2
    while not ctrl.requests and time.time() < deadline:
        time.sleep(0.001)
    assert [r.freq_mhz for r in ctrl.requests] == [1500]
    events[1].done = True
    assert trig.wait(2.0)
    trig.close()
    assert [r.freq_mhz for r in ctrl.requests] == [1500, 1350]


class FakeHostFnLib:
    """Stands in for ext/hostfn: remembers (fd, token); the test plays the CUDA callback
    thread by writing the token into the pipe from another thread."""

    def __init__(self):
        self.pending = []

    def kareus_hostfn_enqueue(self, stream, fd, token):
        self.pending.append((fd, token.value))
        return 0

    def reach_all(self):
        def cb():
            for fd, tok in self.pending:
                os.write(fd, int(tok).to_bytes(8, "little"))
        t = threading.Thread(target=cb)
        t.start()
        t.join()


def test_host_function_marker_pipe_protocol():
    lib = FakeHostFnLib()
    ctrl = DryRunFrequencyController()
    trig = StreamOrderedTrigger(ctrl, marker=HostFunctionMarker(lib=lib))
    assert trig.mechanism == "hostfn"
    trig.request(1500, stream=1234)
    trig.request(1200, stream=1234)
    time.sleep(0.01)
    assert ctrl.requests == []
    lib.reach_all()
    assert trig.wait(2.0)
    trig.close()
    assert [r.freq_mhz for r in ctrl.requests] == [1500, 1200]


def test_without_the_extension_the_trigger_falls_back_to_events():
    trig = StreamOrderedTrigger(DryRunFrequencyController())
    try:
        if trig.mechanism == "hostfn":  # pragma: no cover - only where ext/hostfn builds
            pytest.skip("ext/hostfn is available here")
        assert trig.mechanism == "event" and trig.fallback_reason
    finally:
        trig.close()


def test_type_checks():
    with pytest.raises(TypeError, match="FrequencyController"):
        StreamOrderedTrigger(object())
    with pytest.raises(TypeError, match="StreamMarker"):
        StreamOrderedTrigger(DryRunFrequencyController(), marker=object())


# ------------------------------------------------------------------ one clock check


@pytest.mark.parametrize("freq", [1501, 100, 5000])
def test_controllers_check_clocks_exactly_as_the_gpu_spec_does(freq):
    from kareus.model.gpu import get_gpu

    with pytest.raises(UnsupportedFrequencyError) as want:
        get_gpu("h200-sxm").check_clock(freq)
    nvml = FakeNVML(n=1)
    with NVMLFrequencyController(device_indices=[0], gpu="h200-sxm", nvml=nvml,
                                 handle_signals=False) as nvml_ctrl:
        for ctrl in (DryRunFrequencyController(gpu="h200-sxm"), nvml_ctrl):
            with pytest.raises(UnsupportedFrequencyError) as got:
                ctrl.set_frequency(freq)
            assert str(got.value) == str(want.value)
            assert "nearest supported" in str(got.value)
    assert not any(c[0] == "lock" for c in nvml.calls)


def test_the_trigger_is_the_frequency_role_the_executor_takes():
    from kareus.exec.frequency import FrequencyTrigger

    with pytest.raises(TypeError, match="request"):
        FrequencyTrigger()  # type: ignore[abstract]
    assert issubclass(StreamOrderedTrigger, FrequencyTrigger)
