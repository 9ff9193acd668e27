"""`kareus optimize --profiler nvml` hands the job to kareus.tune.tune on every rank, and
rank 0 prints the table, the frontiers and the GPU time (tune itself is faked here)."""

from __future__ import annotations

from pathlib import Path

import kareus.tune
from kareus.cli import main
from kareus.tune import TuneReport


def test_optimize_with_the_nvml_profiler_runs_the_tuning_driver(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_tune(workload, **kw):
        seen.update(kw, workload=workload)
        return TuneReport(result=None, frontiers={}, paths={"tune": Path(kw["out_dir"]) /
                                                            "tune.json"},
                          wall_s=12.0, world_size=4, gpu_time_s=48.0, measured=7,
                          info={"clock_note": "clocks not controlled (test)"})

    monkeypatch.setattr(kareus.tune, "tune", fake_tune)
    rc = main(["optimize", "--profiler", "nvml", "--workload", "llama3.2-3b", "--tp", "4",
               "--pp", "2", "--budget", "16", "--types", "fwd_attn,fwd_mlp",
               "--backends", "own", "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 0
    assert seen["workload"].parallelism.tp == 4 and seen["budget"] == 16
    assert seen["types"] == ["fwd_attn", "fwd_mlp"] and seen["backends"] == ["own"]
    assert seen["allow_clock_changes"] is False and seen["progress"] is False
    out = capsys.readouterr().out
    assert "GPU time: 48.0 GPU-s (12.0 s on 4 GPU(s)); clocks not controlled (test)" in out


def test_ranks_other_than_0_print_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(kareus.tune, "tune", lambda workload, **kw: None)
    assert main(["optimize", "--profiler", "nvml", "--workload", "llama3.2-3b", "--tp", "2",
                 "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert capsys.readouterr().out == ""


def test_record_is_refused_with_the_nvml_profiler(tmp_path, capsys):
    rc = main(["optimize", "--profiler", "nvml", "--workload", "llama3.2-3b", "--tp", "2",
               "--record", str(tmp_path / "r.json"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "--record" in capsys.readouterr().err
