"""The stream-ordered trigger (kareus.exec.frequency._trigger), on CPU with fake markers."""

from __future__ import annotations

import threading
import time

import pytest

from kareus.errors import HardwareError
from kareus.exec.frequency import (
    DryRunFrequencyController,
    FrequencyController,
    StreamMarker,
    StreamOrderedTrigger,
)

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


def test_the_trigger_is_the_frequency_role_the_executor_takes():
    from kareus.exec.frequency import FrequencyTrigger

    with pytest.raises(TypeError, match="request"):
        FrequencyTrigger()  # type: ignore[abstract]
    assert issubclass(StreamOrderedTrigger, FrequencyTrigger)
