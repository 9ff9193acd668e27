"""bench/cp_attention_layout.py runs its code path on the CPU (tiny shapes): both layouts,
every CP rank, a JSON of every row (not a measurement: the GPU run is)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench_scripts import load_bench


def test_the_bench_runs_every_row_on_the_cpu(tmp_path, capsys):
    bench = load_bench("cp_attention_layout")
    out = tmp_path / "cp.json"
    assert bench.main(["--device", "cpu", "--tiny", "--rounds", "1", "--cps", "2",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert not data["meta"]["measured"]
    rows = data["rows"]
    assert [(r["layout"], r["cp"], len(r["fwd_s"])) for r in rows] == [
        ("load_balanced", 2, 2), ("contiguous", 2, 2)]
    assert "contiguous / load-balanced" in capsys.readouterr().out
