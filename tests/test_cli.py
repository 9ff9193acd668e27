import pytest

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


def test_no_command_prints_the_usage_and_fails(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert "usage: kareus" in captured.err and "optimize" in captured.err and not captured.out


@pytest.mark.parametrize(("argv", "needle"), [
    (["optimize", "--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["optimize", "--surrogate", "forest"], "invalid choice: 'forest'"),
    (["optimize", "--seed", "x"], "argument --seed: expected a whole number"),
    (["bogus"], "invalid choice: 'bogus'"),
])
def test_argument_parser_errors_are_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and not captured.out
    assert captured.err.startswith("kareus: error: ") and needle in captured.err
    assert "--help lists the options" in captured.err


def test_replay_of_a_folder_says_it_wants_a_recording_file(tmp_path, capsys):
    assert main(["optimize", "--workload", "qwen3-1.7b", "--profiler", f"replay:{tmp_path}",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a folder" in err and "recording file" in err
    assert "no such file" not in err and not (tmp_path / "out").exists()


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
    assert res["workload"]["model"]["name"] == "qwen3-1.7b" and res["gpu"] == "h200-sxm"
    assert "iso_time_energy_saving_vs_perseus" in res
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.time_s == k["time_s"]
    logs = sorted((tmp_path / "out" / "logs").glob("search-*.jsonl"))
    # the workload's 4 nanobatched types and its 4 unsplit ones (<type>@n1)
    assert len(logs) == 8 and sum(p.name.endswith("@n1.jsonl") for p in logs) == 4
    assert set(res["profiles_per_partition_type"]) == {p.name[7:-6] for p in logs}
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 1000
    # show prints the plan in words, with each computation's nanobatches.
    assert main(["show", str(tmp_path / "out" / "plan.json")]) == 0
    shown = capsys.readouterr().out
    assert "partition configurations" in shown and "nanobatches per stage" in shown
    assert shown.splitlines()[0] == "kareus plan v1"  # not "kareus plan v1 kareus"
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
    plan = (tmp_path / "out" / "plan.json").read_bytes()
    (tmp_path / "out" / "results.json").unlink()
    assert main(_small(tmp_path, "--deadline-s", str(fastest * 0.5))) == 2
    captured = capsys.readouterr()
    # One line, with the fastest plan's time; the searches' results are written all the same
    # (the table too), and the earlier plan.json is left as it was.
    (line,) = [x for x in captured.err.splitlines() if not x.startswith("kareus: optimising")]
    assert line.startswith("kareus: error: no plan meets the deadline")
    assert f"the fastest takes {fastest:.6g} s" in captured.err
    assert "but no plan.json" in captured.err
    assert "kareus vs perseus" in captured.out
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == res
    assert (tmp_path / "out" / "plan.json").read_bytes() == plan


def test_negative_seed_is_refused_before_the_start_line_leaving_nothing(tmp_path, capsys):
    out = tmp_path / "x"
    with pytest.raises(SystemExit) as info:
        main(["optimize", "--workload", "qwen3-1.7b", "--seed", "-1", "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "must be >= 0" in err and "optimising" not in err
    assert not out.exists()


def test_helpful_errors(tmp_path, capsys):
    cases = [
        (["optimize", "--workload", "gpt-9"], "known workloads"),
        (["optimize", "--workload", "qwen3-1.7b", "--gpu", "tpu"], "known GPUs"),
        (["optimize", "--workload", "qwen3-1.7b", "--pp", "5"], "does not divide the 28 layers"),
        (["optimize", "--workload", "qwen3-1.7b", "--tp", "3"], "TP=3"),
        (["optimize", "--workload", "qwen3-1.7b", "--gpus", "12"], "not a multiple"),
        (["optimize", "--workload", "qwen3-1.7b", "--profiler", "replay:/nonexistent.json"],
         "no such file"),
        (["optimize", "--workload", "qwen3-1.7b", "--profiler", "magic"], "'nvml' (real GPUs"),
        (["show", str(tmp_path / "missing.json")], "error"),
    ]
    for argv, pattern in cases:
        assert main(argv) == 2, argv
        assert pattern in capsys.readouterr().err, argv


def test_gpus_and_dp_that_disagree_are_refused_in_one_line(tmp_path, capsys):
    """--gpus 16 at TP x PP = 8 means DP = 2: a --dp 4 beside it is refused, naming both
    options, before any folder is made; a --dp that agrees is accepted."""
    from kareus.cli import _workload_from_args, build_parser

    out = tmp_path / "x"
    assert main(["optimize", "--workload", "qwen3-1.7b", "--gpus", "16", "--dp", "4",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpus 16 and --dp 4 disagree" in err
    assert "DP = 2" in err and not out.exists()
    args = build_parser().parse_args(["optimize", "--workload", "qwen3-1.7b", "--gpus", "16",
                                      "--dp", "2"])
    assert _workload_from_args(args).parallelism.dp == 2
    args = build_parser().parse_args(["optimize", "--workload", "qwen3-1.7b"])
    assert _workload_from_args(args).parallelism.dp == 1


def test_gpu_profile_does_not_switch_the_gpu_silently(tmp_path, capsys):
    """--gpu-profile h200-sxm without --gpu would change the GPU from the default
    a100-40gb: refused in one line that says to add --gpu h200-sxm."""
    out = tmp_path / "x"
    assert main(["optimize", "--workload", "qwen3-1.7b", "--gpu-profile", "h200-sxm",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --gpu h200-sxm" in err and "a100-40gb" in err
    assert not out.exists()


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


def test_record_after_a_resume_holds_the_measurements_read_back_from_the_logs(tmp_path):
    import json

    # The first run searches, writes its logs and records; the second, in the same folder,
    # reads every search measurement back from the logs. Its recording must hold the same
    # samples of every configuration, in the same order, and replay the whole run.
    fresh = tmp_path / "fresh.json"
    assert main(_small(tmp_path, "--record", str(fresh))) == 0
    first = json.loads((tmp_path / "out" / "results.json").read_text())
    resumed = tmp_path / "resumed.json"
    assert main(_small(tmp_path, "--record", str(resumed))) == 0

    def samples(path):
        by: dict[str, list] = {}
        for r in json.loads(path.read_text())["measurements"]:
            key = json.dumps({k: v for k, v in r.items() if k != "measurement"}, sort_keys=True)
            by.setdefault(key, []).append(r["measurement"])
        return by

    assert samples(resumed) == samples(fresh)
    replay = _small(tmp_path, "--profiler", f"replay:{resumed}")
    replay[replay.index("--out") + 1] = str(tmp_path / "replayed")
    assert main(replay) == 0
    second = json.loads((tmp_path / "replayed" / "results.json").read_text())
    assert second["systems"] == first["systems"]


def test_jobs_search_partition_types_in_processes_with_the_serial_result(tmp_path):
    serial = _small(tmp_path)
    pooled = _small(tmp_path, "--jobs", "2")
    pooled[pooled.index("--out") + 1] = str(tmp_path / "pooled")
    assert main(serial) == 0 and main(pooled) == 0
    for name in ("results.json", "plan.json"):
        assert (tmp_path / "pooled" / name).read_bytes() == \
            (tmp_path / "out" / name).read_bytes()


def test_jobs_with_the_nvml_profiler_is_refused_in_one_line(tmp_path, capsys):
    _one_line_failure(capsys, ["optimize", "--profiler", "nvml", "--jobs", "2", "--out",
                               str(tmp_path / "o")], 2, "--jobs is for emulated")


# -- one-line errors, checked before long work ----------------------------------------------
def _one_line_failure(capsys, argv, code, pattern):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == code, (argv, rc, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kareus: error:"), (argv, err)
    assert "Traceback" not in err
    assert pattern in lines[0], (argv, lines[0])


def test_bad_paths_and_absurd_sizes_fail_in_one_line_before_the_search(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    out = str(tmp_path / "o")
    cases = [
        (["--out", str(a_file)], "existing file"),
        (["--out", ""], "--out is empty"),
        (["--out", str(a_file / "sub")], "cannot be created"),
        (["--out", out, "--record", str(tmp_path)], "is a folder"),
        (["--out", out, "--record", ""], "--record is empty"),
        (["--out", out, "--seq-len", "1"], "--seq-len >= 128"),
        (["--out", out, "--seq-len", "10000000"], "does not fit on h200-sxm"),
        (["--out", out, "--microbatch-size", "60000"], "GiB per GPU"),
        (["--out", out, "--microbatches", "100000"], "days"),
        (["--out", out, "--budget", "1000000"], "lower --budget"),
    ]
    for extra, pattern in cases:
        argv = _small(tmp_path, *extra)
        _one_line_failure(capsys, argv, 2, pattern)
        # nothing was searched: no log was written anywhere
        assert not list(tmp_path.rglob("search-*.jsonl")), extra


def test_show_a_folder_a_corrupt_plan_and_a_non_plan(tmp_path, capsys):
    _one_line_failure(capsys, ["show", str(tmp_path)], 2, "is a folder")
    bad = tmp_path / "plan.json"
    bad.write_text('{"version": 1, "workload": 5}')
    _one_line_failure(capsys, ["show", str(bad)], 2, str(bad))
    bad.write_bytes(b"\xff\xfe{}")
    _one_line_failure(capsys, ["show", str(bad)], 2, "not UTF-8")
    # `kareus show OUT` reads OUT/plan.json
    assert main(_small(tmp_path)) == 0
    capsys.readouterr()
    assert main(["show", str(tmp_path / "out")]) == 0
    assert "partition configurations" in capsys.readouterr().out


def test_a_folder_of_another_job_is_refused_naming_the_field(tmp_path, capsys):
    assert main(_small(tmp_path)) == 0
    capsys.readouterr()
    before = (tmp_path / "out" / "results.json").read_bytes()
    for extra, field in ((["--seq-len", "512"], "workload.seq_len"),
                         (["--workload", "llama3.2-3b"], "workload.model.name"),
                         (["--seed", "3"], "seed"), (["--noise", "0.02"], "profiler.noise"),
                         (["--budget", "13"], "budget"),
                         (["--surrogate", "trees"], "surrogate")):
        _one_line_failure(capsys, _small(tmp_path, *extra), 2, f"its {field} is")
    assert (tmp_path / "out" / "results.json").read_bytes() == before
    capsys.readouterr()
    # --fresh discards the old results and runs the new job
    assert main(_small(tmp_path, "--seq-len", "512", "--fresh")) == 0
    import json

    assert json.loads((tmp_path / "out" / "results.json").read_text())["workload"][
        "seq_len"] == 512


def test_a_folder_without_manifest_holding_results_is_refused(tmp_path, capsys):
    (tmp_path / "out" / "logs").mkdir(parents=True)
    (tmp_path / "out" / "logs" / "search-fwd_mlp.jsonl").write_text("{}\n")
    _one_line_failure(capsys, _small(tmp_path), 2, "without a manifest")


def test_a_folder_in_use_is_refused_at_once(tmp_path, capsys, monkeypatch):
    import fcntl

    from kareus.workflow.outdir import guarded_folder

    with guarded_folder(tmp_path / "out", {"x": 1}, what="--out"):
        # the lock is per open file: a second open in this process is refused like another
        # run. "At once" without a clock: every exclusive lock the run asks for is
        # non-blocking (LOCK_NB), so a held folder is refused, never waited for.
        ops: list[int] = []
        flock = fcntl.flock

        def recording_flock(fd, op):
            ops.append(op)
            assert not op & fcntl.LOCK_EX or op & fcntl.LOCK_NB, "a blocking lock would wait"
            return flock(fd, op)

        monkeypatch.setattr(fcntl, "flock", recording_flock)
        _one_line_failure(capsys, _small(tmp_path), 1, "in use by another kareus run")
        assert any(op & fcntl.LOCK_EX for op in ops)


def test_two_concurrent_runs_one_refused_no_duplicated_measurements(tmp_path):
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-m", "kareus", *_small(tmp_path)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert codes in ([0, 0], [0, 1]), results
    if codes == [0, 1]:
        err = next(e for rc, e in results if rc == 1)
        assert "in use by another kareus run" in err and "Traceback" not in err
    for log in (tmp_path / "out" / "logs").glob("search-*.jsonl"):
        told = [json.dumps(r["config"], sort_keys=True)
                for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "tell"]
        assert len(told) == len(set(told)), f"{log.name} measures a configuration twice"
    # and the folder is usable afterwards
    assert subprocess.run(argv, capture_output=True, timeout=300).returncode == 0


@pytest.mark.parametrize(("signame", "code", "says"), [
    ("SIGINT", 130, "interrupted"),          # Ctrl-C
    ("SIGTERM", 143, "stopped by SIGTERM"),  # kill, or a batch scheduler's stop
])
def test_a_stop_says_the_same_command_resumes(tmp_path, signame, code, says):
    import signal
    import subprocess
    import sys
    import time

    # Either signal runs the same clean-up: one line, the logs kept, the folder unlocked,
    # and the same command finishes the job.
    sig = getattr(signal, signame)
    argv = [sys.executable, "-m", "kareus", *_small(tmp_path)]
    argv[argv.index("--budget") + 1] = "40"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    logs = tmp_path / "out" / "logs"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
            p.stat().st_size > 2000 for p in logs.glob("search-*.jsonl")):
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == code, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert says in last and "same command" in last
    assert subprocess.run(argv, capture_output=True, timeout=300).returncode == 0


def test_sigterm_handler_is_put_back_after_the_command(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert main(["gpus"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.usefixtures("ctrl_c_delivered")
@pytest.mark.parametrize(("signame", "status", "word"), [
    ("SIGTERM", 143, "stopped by SIGTERM"), ("SIGINT", 130, "interrupted")])
def test_a_stop_while_the_command_sets_up_is_one_line_not_lost(signame, status, word,
                                                                monkeypatch, capsys):
    """The handlers are in place before the arguments are parsed and logging is set up: a
    signal there ends the command with its one line and status, never a traceback or a
    run that goes on."""
    import os
    import signal

    import kareus.cli as cli

    def configure(verbosity):
        os.kill(os.getpid(), getattr(signal, signame))
        for _ in range(1000):  # the handler runs between bytecodes
            pass

    monkeypatch.setattr(cli, "configure_logging", configure)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["gpus"]) == status
    captured = capsys.readouterr()
    assert captured.err == f"kareus: {word}\n" and not captured.out
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_torn_log_header_is_recovered_not_truncated(tmp_path, capsys):
    logs = tmp_path / "out" / "logs"
    assert main(_small(tmp_path)) == 0
    log = sorted(logs.glob("search-*.jsonl"))[0]
    torn = log.read_bytes().split(b"\n")[0][:40]
    log.write_bytes(torn)  # a kill while the header line was being written
    capsys.readouterr()
    assert main(_small(tmp_path)) == 0
    kept = log.with_name(log.name + ".torn")
    assert kept.read_bytes() == torn, "the torn file is kept, not truncated to nothing"
    assert log.read_bytes().split(b"\n")[0].startswith(b'{"kind":"header"')


def test_replay_as_another_gpu_and_impossible_rows_are_refused(tmp_path, capsys):
    import json

    record = tmp_path / "run.json"
    assert main(_small(tmp_path, "--record", str(record))) == 0
    capsys.readouterr()
    replay = _small(tmp_path, "--profiler", f"replay:{record}")
    replay[replay.index("--out") + 1] = str(tmp_path / "replayed")
    other = list(replay)
    other[other.index("--gpu") + 1] = "a100-40gb"
    _one_line_failure(capsys, other, 2, "was measured on h200-sxm")
    data = json.loads(record.read_text())
    row = next(r for r in data["measurements"] if r.get("config", {}).get("comm_sms"))
    row["config"]["comm_sms"] = 5000
    record.write_text(json.dumps(data))
    _one_line_failure(capsys, replay, 2, "comm_sms=5000")


def test_python_api_type_and_path_errors(tmp_path, capsys):
    from kareus.errors import KareusError, OutputError, WorkloadError
    from kareus.model import Workload

    with pytest.raises(WorkloadError, match="microbatch_size must be a whole number"):
        Workload.preset("qwen3-1.7b", tp=2, microbatch_size="8")
    with pytest.raises(WorkloadError, match="tp must be a whole number"):
        Workload.preset("qwen3-1.7b", tp=2.0)
    assert main(_small(tmp_path)) == 0
    from kareus.workflow import optimize

    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=4)
    result = optimize(wl, "h200-sxm", budget=4, progress=False)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(OutputError, match="existing file"):
        result.save(a_file)
    with pytest.raises(KareusError):
        result.save("")


def test_workloads_lists_the_layer_features(capsys):
    assert main(["workloads"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "qk-norm, tied embeddings, eps 1e-06" in rows["qwen3-1.7b"]
    assert rows["llama3.3-70b"].rstrip().endswith("eps 1e-05")


def test_the_start_says_the_spaces_against_the_budget(tmp_path, capsys):
    argv = [a for a in _small(tmp_path) if a != "--quiet"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "configurations each (clocks x communication SMs x launch slots); --budget 12" in err
    assert "a median 0.55 (per job 0.29-0.68) of the energy saving" in err  # what less gives up


def test_sp_and_recompute_options_make_the_workload(capsys):
    from kareus.cli import _workload_from_args, build_parser

    def wl(*extra):
        return _workload_from_args(build_parser().parse_args(
            ["optimize", "--workload", "qwen3-1.7b", *extra]))

    base = wl()
    assert (base.parallelism.sp, base.recompute) == (False, "full")
    assert wl("--sp").parallelism.sequence_parallel
    for policy in ("none", "selective", "full"):
        assert wl("--recompute", policy).recompute == policy
    # --no-recompute stays: --recompute none by another name
    assert wl("--no-recompute").recompute == "none"
    assert wl("--no-recompute", "--recompute", "none").recompute == "none"
    assert main(["optimize", "--workload", "qwen3-1.7b", "--no-recompute", "--recompute",
                 "selective"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "contradicts --recompute selective" in err
    with pytest.raises(SystemExit) as info:
        main(["optimize", "--workload", "qwen3-1.7b", "--recompute", "attention"])
    assert info.value.code == 2 and "--recompute" in capsys.readouterr().err


def test_document_tokens_make_the_workload_and_the_plan(tmp_path, capsys):
    from kareus.cli import _workload_from_args, build_parser
    from kareus.compose.plan import Plan

    def wl(*extra):
        return _workload_from_args(build_parser().parse_args(
            ["optimize", "--workload", "qwen3-1.7b", *extra]))

    assert wl().document_tokens is None
    assert wl("--document-tokens", "512").document_tokens == 512
    # packed documents' attention is modelled at CP = 1 only: refused in one line
    assert main(["optimize", "--workload", "qwen3-1.7b", "--cp", "2",
                 "--document-tokens", "512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CP=1 only" in err
    assert main(_small(tmp_path, "--document-tokens", "256")) == 0
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.workload["document_tokens"] == 256


def test_optimize_with_sp_and_selective_recomputation_writes_a_plan_for_that_layout(tmp_path,
                                                                                    capsys):
    import json

    from kareus.compose.plan import Plan

    assert main(_small(tmp_path, "--sp", "--recompute", "selective")) == 0
    out = capsys.readouterr().out
    for name in ("megatron", "nanobatching", "perseus", "nanobatching+perseus", "kareus"):
        assert name in out
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.workload["sp"] is True and plan.workload["recompute"] == "selective"
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["workload"]["sp"] is True
    assert any("_norm" in t for t in res["profiles_per_partition_type"])
    # the folder is the SP job's: the all-reduce layout is another job
    assert main(_small(tmp_path, "--recompute", "selective")) == 2
    assert "sp" in capsys.readouterr().err


def test_unchained_layers_make_a_plan_for_layers_run_one_by_one(tmp_path, capsys):
    """--unchained-layers: the workload's layers run one by one (each its own planned layer,
    as torchtitan's FSDP-wrapped blocks or Megatron-Core's unchained layers), the plan file
    says so, and its partition types are those of that workload; without the flag the plan
    file has no such key (the format of every plan before)."""
    from kareus.cli import _workload_from_args, build_parser
    from kareus.compose.plan import Plan
    from kareus.model import Workload, build_partitions

    args = build_parser().parse_args(["optimize", "--workload", "qwen3-1.7b",
                                      "--unchained-layers"])
    assert _workload_from_args(args).chained_layers is False
    args = build_parser().parse_args(["optimize", "--workload", "qwen3-1.7b"])
    assert _workload_from_args(args).chained_layers is True
    assert main([*_small(tmp_path), "--unchained-layers"]) == 0
    capsys.readouterr()
    plan = Plan.load(tmp_path / "out" / "plan.json")
    assert plan.workload["chained_layers"] is False
    wl = Workload.from_dict(plan.workload)
    assert set(plan.partition_configs(nanobatches=wl.nanobatches)) == set(
        build_partitions(wl).types)


def test_rank_orders_spelt_as_the_model_spells_them() -> None:
    from kareus import cli
    from kareus.model import RANK_ORDERS

    assert cli._RANK_ORDERS == RANK_ORDERS


def test_rank_order_option_reaches_the_workload() -> None:
    from kareus.cli import _workload_from_args, build_parser
    from kareus.errors import ArgumentError

    def wl(*flags: str):  # type: ignore[no-untyped-def]
        return _workload_from_args(build_parser().parse_args(
            ["optimize", "--workload", "llama3.2-3b", "--tp", "2", "--pp", "4", "--dp", "2",
             *flags]))

    default, mapped = wl(), wl("--rank-order", "tp-cp-ep-pp-dp")
    assert default.parallelism.rank_order == "tp-cp-ep-dp-pp"
    assert mapped.parallelism.rank_order == "tp-cp-ep-pp-dp"
    # the stages of one replica in one node under the mapping, four ranks apart otherwise
    from kareus.model import build_partitions

    assert build_partitions(default).outside[(0, "fwd")].p2p_cross_node
    assert not build_partitions(mapped).outside[(0, "fwd")].p2p_cross_node
    with pytest.raises(ArgumentError, match="drop --rank-order"):
        _workload_from_args(build_parser().parse_args(
            ["optimize", "--megatron-args", "--num-layers 4", "--rank-order",
             "tp-cp-ep-pp-dp"]))
