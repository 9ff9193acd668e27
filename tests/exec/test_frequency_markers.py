"""Stream markers (kareus.exec.frequency._markers): event polling and the host-function
pipe protocol, on CPU with fakes."""

from __future__ import annotations

import os
import threading
import time

from kareus.exec.frequency import (
    DryRunFrequencyController,
    EventPollingMarker,
    HostFunctionMarker,
    StreamOrderedTrigger,
)


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
