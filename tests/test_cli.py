from kareus.cli import main


def test_gpus_and_workloads_list_presets(capsys):
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-40gb", "h100-sxm", "h200-sxm"):
        assert name in out
    assert main(["workloads"]) == 0
    out = capsys.readouterr().out
    for name in ("llama3.2-3b", "qwen3-1.7b", "llama3.3-70b"):
        assert name in out
    assert "28672" in out


def test_help_without_command(capsys):
    assert main([]) == 0
    assert "usage: kareus" in capsys.readouterr().out


def _small(tmp_path, *extra):
    return ["optimize", "--workload", "qwen3-1.7b", "--gpu", "h200-sxm", "--tp", "2",
            "--pp", "2", "--microbatches", "4", "--microbatch-size", "2", "--seq-len", "1024",
            "--budget", "12", "--quiet", "--out", str(tmp_path / "out"), *extra]


def test_optimize_small_workload_writes_results(tmp_path, capsys):
    import json

    from kareus.compose.plan import Plan

    assert main(_small(tmp_path)) == 0
    out = capsys.readouterr().out
    for name in ("megatron", "nanobatching", "perseus", "nanobatching+perseus", "kareus"):
        assert name in out
    assert "iso-time" in out
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(res["systems"]) == {"megatron", "nanobatching", "perseus",
                                   "nanobatching+perseus", "kareus"}
    k = res["systems"]["kareus"]
    assert k["total_j"] == k["static_j"] + k["dynamic_j"]
    assert k["static_j"] > 0 and k["tflops_per_gpu"] > 0
    # kareus's space contains the baselines' configurations, so its fastest iteration is at
    # least about as fast as the fastest baseline (measurement noise aside).
    fastest_baseline = min(v["time_s"] for n, v in res["systems"].items() if n != "kareus")
    assert k["time_s"] <= fastest_baseline * 1.02
    assert res["workload"]["model"] == "qwen3-1.7b" and res["gpu"] == "h200-sxm"
    assert "iso_time_energy_saving_vs_perseus" in res
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.time_s == k["time_s"]
    logs = sorted((tmp_path / "out" / "logs").glob("search-*.jsonl"))
    assert len(logs) == 4
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 1000
    # show prints the plan in words.
    assert main(["show", str(tmp_path / "out" / "plan.json")]) == 0
    assert "partition configurations" in capsys.readouterr().out
    # Running again resumes from the logs: kareus's searches re-measure nothing.
    sizes = [len(p.read_text().splitlines()) for p in logs]
    assert main(_small(tmp_path)) == 0
    assert [len(p.read_text().splitlines()) for p in logs] == sizes


def test_optimize_deadline_selects_and_rejects(tmp_path, capsys):
    import json

    assert main(_small(tmp_path)) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    capsys.readouterr()
    fastest = res["systems"]["kareus"]["time_s"]
    assert main(_small(tmp_path, "--deadline-s", str(fastest * 0.5))) == 2
    err = capsys.readouterr().err
    assert "no plan meets the deadline" in err


def test_helpful_errors(tmp_path, capsys):
    cases = [
        (["optimize", "--workload", "gpt-9"], "known workloads"),
        (["optimize", "--workload", "qwen3-1.7b", "--gpu", "tpu"], "known GPUs"),
        (["optimize", "--workload", "qwen3-1.7b", "--pp", "5"], "does not divide the 28 layers"),
        (["optimize", "--workload", "qwen3-1.7b", "--tp", "3"], "TP=3"),
        (["optimize", "--workload", "qwen3-1.7b", "--gpus", "12"], "not a multiple"),
        (["optimize", "--workload", "qwen3-1.7b", "--profiler", "replay:/nonexistent.json"],
         "no such file"),
        (["optimize", "--workload", "qwen3-1.7b", "--profiler", "magic"], "emulated"),
        (["show", str(tmp_path / "missing.json")], "error"),
    ]
    for argv, pattern in cases:
        assert main(argv) == 2, argv
        assert pattern in capsys.readouterr().err, argv


def test_unknown_surrogate_is_rejected_by_argparse(capsys):
    import pytest

    with pytest.raises(SystemExit) as info:
        main(["optimize", "--workload", "qwen3-1.7b", "--surrogate", "forest"])
    assert info.value.code == 2
    assert "invalid choice: 'forest'" in capsys.readouterr().err


def test_bad_budget_is_rejected_by_argparse(capsys):
    import pytest

    with pytest.raises(SystemExit) as info:
        main(["optimize", "--workload", "qwen3-1.7b", "--budget", "0"])
    assert info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_record_then_replay_reproduces_results(tmp_path, capsys):
    import json

    record = tmp_path / "run.json"
    assert main(_small(tmp_path, "--record", str(record))) == 0
    first = json.loads((tmp_path / "out" / "results.json").read_text())
    replay = tmp_path / "replayed"
    argv = _small(tmp_path, "--profiler", f"replay:{record}")
    argv[argv.index("--out") + 1] = str(replay)
    assert main(argv) == 0
    second = json.loads((replay / "results.json").read_text())
    assert second["systems"] == first["systems"]
    assert second["frontiers"] == first["frontiers"]
