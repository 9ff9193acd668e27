"""bench/host_overhead.py: the host time per planned-layer node on graphs=True, on the CPU
with a stand-in replay: every mode and schedule and the bare autograd node, a JSON of
every row; the timed iterations replay graphs captured during the warm-up (none captured
while timed), and the stand-in launches nothing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench_scripts import load_bench


def test_the_bench_times_every_row_on_replays_only(tmp_path, capsys):
    bench = load_bench("host_overhead")
    out = tmp_path / "ho.json"
    assert bench.main(["--layers", "2", "--rounds", "3", "--warmup", "2",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["mode"], r["schedule"]) for r in rows] == [
        (m, s) for m in bench.MODES for s in (*bench.SCHEDULES, "bare node")]
    for r in rows:
        assert r["fwd_us_per_node"] > 0 and r["bwd_us_per_node"] > 0 and r["lead_us"] > 0
        assert r["captures_while_timed"] == 0
        assert (r["graphs"] > 0) == (r["schedule"] != "bare node")
    assert "emulated" in result["measured"]
    assert "stand-in replay" in capsys.readouterr().out


def test_the_stand_in_streams_launch_nothing_and_share_a_pool():
    bench = load_bench("host_overhead")
    ex = bench._stand_in_executor_class()
    from kareus.exec.train import LoopbackGroupCollective

    coll = LoopbackGroupCollective(group_size=1)
    executor = ex(shared=True, collective=coll, default_collective=coll)
    assert executor.graphs and executor.streams.shares_graph_pool
    executor.streams.replay(object())  # a no-op
    assert not ex(shared=False, collective=coll,
                  default_collective=coll).streams.shares_graph_pool


def test_the_profile_names_the_graphed_runner():
    bench = load_bench("host_overhead")
    text = bench.profile(bench.parse_args(["--layers", "1", "--rounds", "2", "--warmup", "1",
                                           "--top", "60"]), "layers:kareus")
    assert "function calls" in text and "_graphed.py" in text


def test_the_real_path_needs_a_gpu(monkeypatch):
    import torch

    bench = load_bench("host_overhead")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--device", "cuda"])


@pytest.mark.gpu
def test_on_a_gpu_the_timed_iterations_replay_real_graphs(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bench = load_bench("host_overhead")
    out = tmp_path / "ho.json"
    assert bench.main(["--device", "cuda", "--layers", "2", "--rounds", "5",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cuda" and "gpu" in result["machine"]
    for r in result["rows"]:
        assert r["captures_while_timed"] == 0
        assert (r["graphs"] > 0) == (r["schedule"] != "bare node")
