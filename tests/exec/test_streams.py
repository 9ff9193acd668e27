"""The recording fake device (kareus.exec._streams): its log and its device-order answers."""

from __future__ import annotations

import pytest

from kareus.exec.executor import RecordingStreamBackend, StreamBackend


def test_log_and_order_through_an_event():
    dev = RecordingStreamBackend()
    assert isinstance(dev, StreamBackend)
    compute = dev.current_stream()
    side = dev.new_stream(name="comm")
    dev.launch("a")
    ev = dev.record_event(compute)
    dev.launch("b")
    dev.wait_event(side, ev)
    with dev.use_stream(side):
        assert dev.current_stream() is side
        dev.launch("c")
    assert dev.current_stream() is compute
    assert dev.launches("compute") == ["a", "b"] and dev.launches("comm") == ["c"]
    assert dev.events[ev.id].after == 1  # one launch on compute before the record
    assert dev.happens_before(("compute", "a"), ("comm", "c"))  # a -> record -> wait -> c
    assert not dev.happens_before(("compute", "b"), ("comm", "c"))  # b is after the record
    assert dev.happens_before(("compute", "a"), ("compute", "b"))  # same stream, in order
    assert not dev.happens_before(("comm", "c"), ("compute", "b"))  # nothing waits on c


def test_unknown_launches_are_an_error():
    dev = RecordingStreamBackend()
    dev.op("x")()
    assert dev.launches("compute") == ["x"]
    with pytest.raises(KeyError, match="never launched"):
        dev.happens_before(("compute", "x"), ("comm", "y"))
