"""bench/verify.py's CPU smoke run (--quick) end to end, and its table of ratios."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench_scripts import load_bench


def test_the_quick_run_writes_every_system_and_says_it_is_not_a_measurement(tmp_path, capsys):
    bench = load_bench("verify")
    out = tmp_path / "v.json"
    assert bench.main(["--quick", "--steps", "1", "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["measured"] is False and "NOT A MEASUREMENT" in data["what"]
    rep = data["jobs"]["tiny-tp2"]
    assert set(rep["systems"]) == {"megatron", "nanobatching", "kareus"}
    assert [r[:2] for r in data["table"]] == (
        [["tiny-tp2", s] for s in rep["systems"]]
        + [["tiny-tp2/faithful", s] for s in rep["systems"]])
    # the time-faithful loopback's rows are labelled a stand-in
    faithful = data["jobs"]["tiny-tp2/faithful"]
    assert faithful["loopback"] == "faithful" and "STAND-IN" in faithful["stand_in"]
    assert data["stand_in"] == ["tiny-tp2/faithful"]
    text = capsys.readouterr().out
    assert "NOT A MEASUREMENT" in text and "STAND-IN" in text
    st = rep["straggler"]
    assert st["measured"] is False and st["slowdown"] == 1.2
    # a new point's executor is built once; staying on the plan's point builds none
    assert st["executors_built"] == (0 if st["switched_to"]["same_point"] else 1)
    paced = st["paced_before"]["time_s"]
    assert paced >= 1.2 * st["alone"]["time_s"] * 0.9  # the straggler sets the pace


def test_the_options_are_checked():
    bench = load_bench("verify")
    with pytest.raises(SystemExit):
        bench.parse_args(["--jobs", "gpt5"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "0"])
    assert bench.parse_args([]).jobs.split(",") == list(bench.JOBS)
    assert bench.parse_args([]).loopbacks == "plain,faithful"
    with pytest.raises(SystemExit):
        bench.parse_args(["--loopbacks", "fast"])


def test_the_time_limit_skips_the_units_it_would_not_finish(tmp_path, monkeypatch, capsys):
    # no GPU needed: the limit is checked before a unit's tune starts
    bench = load_bench("verify")
    args = bench.parse_args(["--time-limit-s", "0", "--jobs", "qwen3-cp2"])
    reports = bench._measured(args, tmp_path, print, 0.0)
    assert set(reports) == {"qwen3-cp2/plain", "qwen3-cp2/faithful"}
    assert all("time limit" in r["skipped"] for r in reports.values())
    assert bench.ratio_rows(reports) == []
    assert "SKIPPED" in capsys.readouterr().out


def test_fewer_layers_are_said():
    bench = load_bench("verify")
    wl = bench._workload("qwen3-cp2", bench.parse_args(["--layers", "4"]))
    assert wl.model.layers == 4 and wl.parallelism.tp == 4 and wl.parallelism.cp == 2
