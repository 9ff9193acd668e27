"""Graph-captured execution (kareus.exec._graphs, TorchExecutor.capture) on the recording
fake device: which ops go into which graph, the event order inside a graph, where the
clock requests go, when a sequence is captured again, and replay order."""

from __future__ import annotations

import pytest

from kareus.errors import GraphCaptureError
from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
from kareus.exec.frequency import FrequencyTrigger
from kareus.model.config import ScheduleConfig
from kareus.testing import RecordingCollective, RecordingTrigger, make_test_plan

OPS = ("attn_norm", "qkv", "rope", "attn_core", "out_proj")


class HostNodeTrigger(FrequencyTrigger):
    """A trigger whose requests are part of a captured graph (as host-function markers
    are): each request is logged on the fake device as a launch on its stream."""

    capturable = True

    def __init__(self, dev: RecordingStreamBackend) -> None:
        self.dev = dev

    def request(self, freq_mhz: int, *, stream=None) -> int:
        self.dev.launch(f"clock {freq_mhz}", stream)
        return 1


def make(plan=None, **kw):
    dev = RecordingStreamBackend()
    coll = RecordingCollective(streams=dev)
    ex = TorchExecutor(collective=coll, streams=dev, plan=plan, **kw)
    return ex, dev, coll


def partition_body(ex, dev, tag, slot="qkv", sms=8):
    def body():
        ex.run_partition([dev.op(f"{tag}.{n}") for n in OPS], [f"{tag}.{n}" for n in OPS],
                         f"buf{tag}", ScheduleConfig(1980, sms, f"{tag}.{slot}"))
    return body


def launches(entries, stream):
    return [e[2] for e in entries if e[0] == "launch" and e[1] == stream]


def test_graphs_default_on_where_the_backend_captures_and_off_on_request():
    ex, dev, _ = make()
    assert ex.graphs is True  # the recording fake captures
    ex2, _, _ = make(graphs=False)
    assert ex2.graphs is False
    with pytest.raises(GraphCaptureError, match="eagerly"):
        ex2.capture("x", [lambda: None])


def test_each_body_is_one_graph_with_its_collective_and_events_inside():
    ex, dev, coll = make()
    seq = ex.capture("part", [partition_body(ex, dev, "a"), partition_body(ex, dev, "b")],
                     warmup=0)
    assert len(seq) == 2
    g0, g1 = dev.graphs["part[0]"], dev.graphs["part[1]"]
    assert launches(g0, "compute") == [f"a.{n}" for n in OPS]
    assert launches(g0, "comm") == ["all_reduce(bufa)"]
    assert launches(g1, "compute") == [f"b.{n}" for n in OPS]
    # Inside the graph: fork after attn_norm (record on compute, wait on comm), the
    # collective, then the slot's op; the join at the end of the graph.
    kinds = [(e[0], e[1]) for e in g0]
    fork = kinds.index(("record", "compute"))
    assert kinds[fork + 1] == ("wait", "comm")
    assert g0[fork + 2] == ("launch", "comm", "all_reduce(bufa)")
    assert g0[fork - 1] == ("launch", "compute", "a.attn_norm")
    assert g0[fork + 3][:2] == ("record", "comm")  # the collective's done event
    assert g0[fork + 4] == ("launch", "compute", "a.qkv")
    assert g0[-1][0] == "wait" and g0[-1][1] == "compute"
    assert coll.calls == [("all_reduce", "bufa", 8), ("all_reduce", "bufb", 8)]


def test_warmup_runs_the_bodies_eagerly_on_a_side_stream_before_capture():
    ex, dev, _ = make()
    ex.capture("w", [partition_body(ex, dev, "a")], warmup=1)
    cap = dev.log.index(("capture", "", "w[0]"))
    eager = dev.log[:cap]
    assert launches(eager, "warmup") == [f"a.{n}" for n in OPS]
    assert launches(eager, "compute") == []


def test_replay_launches_the_graphs_in_capture_order_and_refuses_another():
    ex, dev, _ = make()
    seq = ex.capture("s", [partition_body(ex, dev, t) for t in "abc"], warmup=0)
    n = len(dev.log)
    seq.replay()
    assert dev.log[n:] == [("replay", "compute", f"s[{i}]") for i in range(3)]
    seq.replay(0)
    with pytest.raises(GraphCaptureError, match="out of order"):
        seq.replay(2)
    with pytest.raises(GraphCaptureError, match="stopped at graph 1"):
        seq.replay()
    seq.replay(1)
    seq.replay(2)
    assert seq.replays == 2


def test_same_signature_reuses_the_graphs_another_recaptures():
    ex, dev, _ = make()
    bodies = [partition_body(ex, dev, "a")]
    first = ex.capture("s", bodies, signature=("shape", 1), warmup=0)
    assert ex.capture("s", bodies, signature=("shape", 1), warmup=0) is first
    captures = sum(1 for e in dev.log if e[0] == "capture")
    second = ex.capture("s", bodies, signature=("shape", 2), warmup=0)
    assert second is not first and ex.sequence("s") is second
    assert sum(1 for e in dev.log if e[0] == "capture") == captures + 1


def test_a_new_plan_drops_the_graphs_and_needs_start_again():
    plan = make_test_plan()
    ex, dev, _ = make(plan=plan)
    ex.start()
    ex.capture("s", [partition_body(ex, dev, "a")], warmup=0)
    ex.plan = make_test_plan(freqs_mhz=(1500, 1410))
    assert ex.sequence("s") is None
    with pytest.raises(Exception, match="start"):
        ex.capture("s", [partition_body(ex, dev, "a")], warmup=0)
    ex.start()
    ex.capture("s", [partition_body(ex, dev, "a")], warmup=0)
    assert ex.sequence("s").key[1] == str(ex.plan.digest)


def test_clock_requests_are_host_nodes_with_a_capturable_trigger():
    plan = make_test_plan()
    dev = RecordingStreamBackend()
    trig = HostNodeTrigger(dev)
    ex = TorchExecutor(collective=RecordingCollective(streams=dev), streams=dev, plan=plan,
                       frequency=trig)
    ex.start()
    keys = sorted(plan.assignment)
    stage, mb, phase = keys[0].split(".")
    s, m = int(stage[1:]), int(mb[1:])

    def body():
        with ex.microbatch(s, m, phase):
            dev.launch("work")
    seq = ex.capture("mb", [body], warmup=0)
    g = dev.graphs["mb[0]"]
    assert g[0][2].startswith("clock ") and g[1][2] == "work"  # first node of the graph
    assert seq.deferred == ((),)


def test_a_trigger_without_host_nodes_is_issued_before_each_replay():
    plan = make_test_plan()
    dev = RecordingStreamBackend()
    trig = RecordingTrigger()
    ex = TorchExecutor(collective=RecordingCollective(streams=dev), streams=dev, plan=plan,
                       frequency=trig)
    ex.start()
    comps = sorted(plan.assignment)
    bodies = []
    for key in comps:
        stage, mb, phase = key.split(".")

        def body(s=int(stage[1:]), m=int(mb[1:]), p=phase):
            with ex.microbatch(s, m, p):
                dev.launch("work")
        bodies.append(body)
    seq = ex.capture("it", bodies, warmup=0)
    assert trig.requests == []  # nothing issued while capturing
    assert all(len(d) == 1 for d in seq.deferred)
    seq.replay()
    assert trig.freqs_mhz == [d[0] for d in seq.deferred]
    # each request is made right before its graph's replay, on the current stream
    seq.replay()
    assert len(trig.requests) == 2 * len(comps)


def test_a_body_that_cannot_be_captured_is_a_typed_error():
    ex, dev, _ = make()

    def sync():
        raise RuntimeError("operation not permitted when stream is capturing")
    with pytest.raises(GraphCaptureError, match="graphs=False"):
        ex.capture("bad", [sync], warmup=0)
    assert ex.sequence("bad") is None


def test_a_backend_without_graphs_refuses_graphs_true():
    class NoGraphs(RecordingStreamBackend):
        @property
        def supports_graphs(self) -> bool:
            return False

    dev = NoGraphs()
    ex = TorchExecutor(collective=RecordingCollective(streams=dev), streams=dev)
    assert ex.graphs is False
    with pytest.raises(GraphCaptureError, match="graphs=False"):
        TorchExecutor(collective=RecordingCollective(streams=dev), streams=dev, graphs=True)


def test_dropping_graphs_synchronises_the_device_first():
    ex, dev, _ = make()
    ex.capture("s", [partition_body(ex, dev, "a")], signature=1, warmup=0)
    ex.capture("s", [partition_body(ex, dev, "a")], signature=1, warmup=0)  # reused
    assert ("synchronize", "", None) not in dev.log
    ex.capture("s", [partition_body(ex, dev, "a")], signature=2, warmup=0)
    sync = dev.log.index(("synchronize", "", None))
    assert dev.log[sync + 1:].count(("capture", "", "s[0]")) == 1
    n = dev.log.count(("synchronize", "", None))
    ex.release_graphs("nothing")
    assert dev.log.count(("synchronize", "", None)) == n
    ex.release_graphs()
    assert dev.log.count(("synchronize", "", None)) == n + 1 and ex.sequence("s") is None


# ---------------------------------------------------------------- cuBLAS's workspace


@pytest.fixture
def clean_cublas_env(monkeypatch):
    import kareus.exec._graphs as g

    for k in g.WORKSPACE_FREE:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(g, "_warned_late", False)
    return g


def test_workspace_free_gemms_are_asked_for_where_the_user_has_not_chosen(clean_cublas_env):
    import os

    from kareus.exec import prefer_workspace_free_gemms

    assert prefer_workspace_free_gemms() == "set"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"
    assert prefer_workspace_free_gemms() == "user"  # now set: kept as it is


def test_a_users_workspace_and_deterministic_mode_are_left_alone(clean_cublas_env, monkeypatch):
    import os
    import sys
    import types

    g = clean_cublas_env
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert g.prefer_workspace_free_gemms() == "user"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    fake = types.SimpleNamespace(are_deterministic_algorithms_enabled=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert g.prefer_workspace_free_gemms() == "deterministic"
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_setting_it_after_cuda_started_is_said_once(clean_cublas_env, monkeypatch, caplog):
    import logging
    import sys
    import types

    g = clean_cublas_env
    fake = types.SimpleNamespace(are_deterministic_algorithms_enabled=lambda: False,
                                 cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)
    with caplog.at_level(logging.INFO, logger="kareus"):
        assert g.prefer_workspace_free_gemms() == "set"
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
        assert g.prefer_workspace_free_gemms() == "set"
    said = [r for r in caplog.records if "after CUDA started" in r.getMessage()]
    assert len(said) == 1


def test_a_graphed_executor_asks_for_workspace_free_gemms(clean_cublas_env, monkeypatch):
    import os

    from kareus.exec._streams import TorchStreamBackend

    make(graphs=False)  # the recording device: nothing asked
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setattr(TorchStreamBackend, "supports_graphs", True, raising=False)
    TorchExecutor(collective=RecordingCollective(),
                  streams=TorchStreamBackend(device="cpu"), graphs=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"
