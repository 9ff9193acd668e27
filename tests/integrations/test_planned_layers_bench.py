"""bench/planned_layers.py runs its code path on the CPU (a tiny model): every mode and
schedule, a JSON of every row."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench_scripts import load_bench


def test_the_bench_runs_every_row_on_the_cpu(tmp_path, capsys):
    bench = load_bench("planned_layers")
    out = tmp_path / "pl.json"
    assert bench.main(["--device", "cpu", "--tiny", "--rounds", "1", "--layers", "2",
                       "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["schedule"]) for r in rows] == [
        (m, s) for m in bench.MODES for s in bench.SCHEDULES]
    assert all(r["iteration_s"] > 0 for r in rows)
    assert "synthetic plan" in capsys.readouterr().out
