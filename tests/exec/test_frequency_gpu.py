"""The stream-ordered trigger on a GPU, with the dry-run controller only (clocks of shared
machines must never change). Skipped without torch or CUDA."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from _helpers import cuda_marks

from kareus.exec.frequency import (
    DryRunFrequencyController,
    EventPollingMarker,
    HostFunctionMarker,
    StreamOrderedTrigger,
)

pytestmark = cuda_marks()


def _marker(kind):
    if kind == "event":
        return EventPollingMarker()
    try:
        return HostFunctionMarker()
    except Exception as exc:
        pytest.skip(f"ext/hostfn not built here: {exc}")


@pytest.mark.parametrize("kind", ["hostfn", "event"])
def test_trigger_fires_in_stream_order_not_host_order(kind):
    ctrl = DryRunFrequencyController(gpu="h200-sxm")
    trig = StreamOrderedTrigger(ctrl, marker=_marker(kind))
    s = torch.cuda.current_stream()
    cycles = 100_000_000  # ~50-70 ms at H200 clocks
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    evs[0].record(s)
    torch.cuda._sleep(cycles)  # microbatch 0
    evs[1].record(s)
    trig.request(1500, stream=s)  # boundary 0 -> 1
    torch.cuda._sleep(cycles)  # microbatch 1
    evs[2].record(s)
    trig.request(1200, stream=s)  # boundary 1 -> 2
    t_host = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert trig.wait(5.0)
    trig.close()
    d1 = evs[0].elapsed_time(evs[1]) / 1000
    d2 = evs[1].elapsed_time(evs[2]) / 1000
    got = [(r.freq_mhz, r.time_s - t0) for r in ctrl.requests if r.freq_mhz is not None]
    assert [f for f, _ in got] == [1500, 1200]
    # The host enqueued both requests long before the GPU got there; each request reached
    # the controller only after the GPU finished the work before it.
    assert t_host < 0.5 * d1
    assert got[0][1] >= 0.9 * d1
    assert got[1][1] - got[0][1] >= 0.9 * d2
    assert got[1][1] <= d1 + d2 + 0.05
    assert trig.errors == []
