"""bench/planned_layers.py runs its code path on the CPU (a tiny model): every mode and
schedule the CPU runs, several shapes, a JSON of every row; the graphed modes (own and
step capture) are refused without a GPU."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from bench_scripts import load_bench


def test_the_bench_runs_every_row_on_the_cpu(tmp_path, capsys):
    bench = load_bench("planned_layers")
    out = tmp_path / "pl.json"
    assert bench.main(["--device", "cpu", "--tiny", "--rounds", "1", "--rows", "2:4x32,1:4x32",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layers"], r["mode"], r["schedule"]) for r in rows] == [
        (n, m, s) for n in (2, 1) for m in bench.MODES for s in bench.SCHEDULES]
    assert all(r["iteration_s"] > 0 and r["vs_step"] is None for r in rows)
    assert "synthetic plan" in capsys.readouterr().out


def test_the_bench_parses_its_shapes_and_refuses_graphed_modes_on_the_cpu():
    bench = load_bench("planned_layers")
    args = bench.parse_args(["--rows", "4:4x4096,8:8x4096,14:8x4096"])
    assert bench._shapes(args) == [(4, 4, 4096), (8, 8, 4096), (14, 8, 4096)]
    args = bench.parse_args(["--modes", "stack@step"])
    assert bench._modes(args, cuda=True) == ["stack@step"]
    with pytest.raises(SystemExit, match="need a CUDA GPU"):
        bench._modes(args, cuda=False)
    with pytest.raises(SystemExit, match="LAYERS:MBSxSEQ"):
        bench._shapes(bench.parse_args(["--rows", "4x4096"]))


def test_the_issue_table_is_one_option():
    # --issue-table: the three shapes of the own-graphs-against-step table, the graphed
    # and step modes, 3 rounds, busy fractions without the GPU-only figure
    bench = load_bench("planned_layers")
    args = bench.parse_args(["--issue-table"])
    assert bench._shapes(args) == [(4, 4, 4096), (8, 8, 4096), (14, 8, 4096)]
    assert bench._modes(args, cuda=True) == ["layers+graphs", "stack+graphs", "layers@step",
                                             "stack@step"]
    assert args.rounds == 3 and args.no_gpu_only
    assert bench.parse_args([]).rounds == 5
    assert bench.parse_args(["--issue-table", "--rounds", "2"]).rounds == 2


def test_the_issue_table_keeps_the_gpu_only_time_when_asked():
    bench = load_bench("planned_layers")
    assert not bench.parse_args(["--issue-table", "--gpu-only"]).no_gpu_only


def test_the_lead_probe_records_before_the_first_launch_of_an_armed_iteration():
    # lead ms: an event recorded right before the first graph launch after arm(), once,
    # whichever of the mode's appliers launches it; later launches are left alone
    bench = load_bench("planned_layers")
    launched, recorded = [], []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            recorded.append(len(launched))

    torch_stand_in = SimpleNamespace(cuda=SimpleNamespace(Event=Event))

    class Streams:
        def replay(self, graph):
            launched.append(graph)

    class Ex:
        def __init__(self, streams):
            self.streams = streams

    shared = Streams()
    appliers = {"a": type("A", (), {"baseline": Ex(shared), "executor": None})(),
                "b": type("A", (), {"baseline": Ex(shared), "executor": Ex(Streams())})()}
    probe = bench._LeadProbe(torch_stand_in, type("It", (), {"appliers": appliers})())
    shared.replay("g0")  # not armed: no event
    assert probe.event is None and recorded == []
    probe.arm()
    appliers["b"].executor.streams.replay("g1")
    shared.replay("g2")
    assert recorded == [1] and probe.event is not None  # before g1's launch, once
    assert probe.launch_s is not None and probe.launch_s >= 0  # g1's launch call, timed
    assert launched == ["g0", "g1", "g2"]  # each launched exactly once (wrapped once)
