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
    assert [r[:2] for r in data["table"]] == [["tiny-tp2", s] for s in rep["systems"]]
    assert "NOT A MEASUREMENT" in capsys.readouterr().out
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
