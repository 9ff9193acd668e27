"""bench/recompute_policy.py: its --quick mode runs the code path on the CPU (a tiny model,
every system at every policy, the values checked against the compiled block, what each
keeps for the backward against the memory model), and without CUDA and without --quick it
says so and exits cleanly."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bench_scripts import load_bench


def test_quick_runs_every_system_at_every_policy_and_they_agree(tmp_path, capsys):
    bench = load_bench("recompute_policy")
    out = tmp_path / "rp.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["system"], r["policy"]) for r in rows} == {
        (s, p) for s in bench.SYSTEMS for p in bench.POLICIES}
    for r in rows:  # fp32 on the CPU: kareus's layers compute the compiled block's values
        assert r["iteration_s"] > 0
        assert r["output_rel_diff"] < 1e-5 and r["grad_rel_diff"] < 1e-5, r
    assert set(result["kareus_over_compiled"]) == set(bench.POLICIES)
    kept = {(r["system"], r["policy"]): r["kept_gib"] for r in rows}
    for r in rows:  # what kareus's layers keep is what the memory model counts
        if r["system"] != "compiled":
            assert r["kept_gib"] == pytest.approx(r["model_kept_gib"], rel=1e-9), r
    for system in ("kareus-stack", "kareus-layers"):
        assert kept[(system, "none")] > kept[(system, "selective")] > kept[(system, "full")]
    assert "not a measurement" in result["machine_kind"]
    assert "CPU smoke run" in capsys.readouterr().out


def test_without_cuda_it_says_so_and_exits_cleanly(capsys, monkeypatch):
    bench = load_bench("recompute_policy")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
