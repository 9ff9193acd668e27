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


def test_a_graph_dropped_during_a_capture_is_destroyed_after_it(monkeypatch):
    # destroying a CUDA graph inside a capture invalidates that capture: a graph whose
    # holder goes then (a reference cycle the garbage collector frees mid-capture) is
    # kept until the next point outside captures

    from kareus.exec import _streams

    destroyed: list[int] = []

    class Graph:  # stands in for torch.cuda.CUDAGraph (its destructor is the CUDA call)
        def __init__(self, n):
            self.n, self.replays = n, 0

        def replay(self):
            self.replays += 1

        def __del__(self):
            destroyed.append(self.n)

    capturing = [True]
    monkeypatch.setattr(_streams, "_capture_underway", lambda: capturing[0])
    monkeypatch.setattr(_streams, "_GRAVEYARD", [])
    graph = Graph(1)
    held = _streams.CapturedGraph(graph)
    held.replay()
    assert graph.replays == 1
    del graph, held  # "inside a capture" (a cycle freed by the collector goes alike)
    assert destroyed == [] and len(_streams._GRAVEYARD) == 1
    assert _streams.bury_graphs() == 0  # still capturing: kept
    assert destroyed == []
    capturing[0] = False
    assert _streams.bury_graphs() == 1
    assert destroyed == [1]
    held = _streams.CapturedGraph(Graph(2))  # outside any capture: destroyed at once
    del held
    assert destroyed == [1, 2] and _streams._GRAVEYARD == []
