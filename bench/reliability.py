"""Can the results be trusted? Kills and resumes, corrupt plans, bad invocations, two runs.

Runs four corpora against the ``kareus`` command and the plan loader and prints the counts:

1. **Kill and resume**: a small job (emulated) run once uninterrupted; then, at each kill
   point (a number of logged measurements; SIGKILL, SIGINT and SIGTERM in turn), the same
   job started in a fresh folder, killed there, and run again with the same command to the
   end. Kill points are spread over the searches' measurements (a count logged) and, for a
   quarter of them, over the end of the run (after the last measurement, within the time
   the reference run went on after its own: composition and writing). A point counts as identical when ``results.json`` and
   ``plan.json`` are both byte-identical to the uninterrupted run's. A re-run in the
   finished folder of the uninterrupted run is counted the same way.
2. **Corrupt plans**: every kind of corruption of the plan corpus in
   ``tests/compose/test_plan.py`` (dict-level with the digest recomputed, and byte-level),
   loaded with ``Plan.load``: refused with a one-line ``PlanError``, accepted, or another
   exception (a traceback for a user).
3. **Bad invocations**: command lines a user may type by mistake (paths, sizes, files):
   each must fail in one line on stderr with exit 2 or 1; a traceback or a success counts
   against.
4. **Two runs on one folder**: started together; one must be refused at once, and no
   measurement may be logged twice.
5. **Mutated input files**: a model file, a GPU file, the shipped GPU profile, a plan, a
   recording and a finished run's search logs, each with one to three fields replaced
   by a bad value (wrong type, empty, negative, not finite, beyond float range, huge),
   deleted or joined by an unknown key, one in ten also cut short or with bytes that
   are not UTF-8 (``--mutations`` of each kind, ``--seed``); each read as kareus reads
   it (a search log by running the same command again in its folder): refused in one
   typed line, accepted (a mutation may leave a valid file), or another exception.

Usage::

    python bench/reliability.py --json bench/results/reliability.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = ["optimize", "--workload", "qwen3-1.7b", "--gpu", "h200-sxm", "--tp", "2", "--pp", "2",
         "--microbatches", "4", "--microbatch-size", "2", "--seq-len", "1024", "--budget", "24",
         "--quiet"]


def _kareus(argv: list[str], **kw) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run([sys.executable, "-m", "kareus", *argv], capture_output=True,
                          text=True, timeout=600, **kw)


def _outputs(out: Path) -> tuple[bytes, bytes]:
    return (out / "results.json").read_bytes(), (out / "plan.json").read_bytes()


def _default_signals() -> None:
    """In the child: SIGINT and SIGTERM as a terminal sends them (a bench started in the
    background, e.g. under nohup, would otherwise pass SIGINT on ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _measurements(out: Path) -> int:
    n = 0
    for log in (out / "logs").glob("search-*.jsonl"):
        with contextlib.suppress(OSError):
            n += sum(1 for ln in log.read_text().splitlines() if '"kind":"tell"' in ln)
    return n


def kill_and_resume(tmp: Path, points: int) -> dict:
    ref_out = tmp / "ref"
    # The reference run, watched: how long it goes on after its last measurement is logged
    # (composition and writing), where the late kill points fall.
    first = subprocess.Popen([sys.executable, "-m", "kareus", *SMALL, "--out", str(ref_out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    last_n, t_last = 0, time.monotonic()
    while first.poll() is None:
        n = _measurements(ref_out)
        if n != last_n:
            last_n, t_last = n, time.monotonic()
        time.sleep(0.002)
    tail_s = time.monotonic() - t_last
    if first.wait() != 0:
        raise SystemExit(f"the reference run failed: {first.communicate()[1][-400:]}")
    reference = _outputs(ref_out)
    total = _measurements(ref_out)
    rerun = _kareus([*SMALL, "--out", str(ref_out)])
    rerun_same = rerun.returncode == 0 and _outputs(ref_out) == reference
    sigs = [signal.SIGKILL, signal.SIGINT, signal.SIGTERM]
    rows = []
    late = points // 4  # kill points in the composition and the writing
    early = points - late
    for k in range(points):
        target = max(1, round((k + 0.5) * total / early)) if k < early else total
        # late points: after the last measurement, spread over the reference's tail
        at_s = 0.0 if k < early else tail_s * (k - early + 0.25) / late
        sig = sigs[k % len(sigs)]
        out = tmp / f"kill-{k}"
        proc = subprocess.Popen([sys.executable, "-m", "kareus", *SMALL, "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=_default_signals)
        while proc.poll() is None and _measurements(out) < target:
            time.sleep(0.002)
        time.sleep(at_s)
        killed_at = _measurements(out)
        finished_first = proc.poll() is not None
        if not finished_first:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        resumed = _kareus([*SMALL, "--out", str(out)])
        ok = resumed.returncode == 0
        res_same = plan_same = False
        if ok:
            res, plan = _outputs(out)
            res_same, plan_same = res == reference[0], plan == reference[1]
        rows.append({"signal": sig.name, "target_measurements": target,
                     "after_target_s": round(at_s, 3),
                     "killed_at_measurements": killed_at, "finished_before_kill": finished_first,
                     "kill_exit": proc.returncode, "traceback_on_kill": "Traceback" in err,
                     "resume_ok": ok, "results_identical": res_same,
                     "plan_identical": plan_same,
                     "resume_error": None if ok else resumed.stderr.strip()[-300:]})
    return {"measurements_per_run": total, "reference_tail_s": round(tail_s, 3),
            "kill_points": len(rows),
            "stopped_by_the_signal": sum(not r["finished_before_kill"] and r["kill_exit"] != 0
                                         for r in rows),
            "resumed_ok": sum(r["resume_ok"] for r in rows),
            "identical_results_and_plan": sum(r["results_identical"] and r["plan_identical"]
                                              for r in rows),
            "identical_plan": sum(r["plan_identical"] for r in rows),
            "tracebacks_on_kill": sum(r["traceback_on_kill"] for r in rows),
            "rerun_in_finished_folder_identical": rerun_same, "points": rows}


def corrupt_plans(tmp: Path) -> dict:
    from kareus.compose.plan import Plan
    from kareus.errors import PlanError
    from tests.compose import test_plan as corpus

    counts = {"kinds": 0, "refused_one_line": 0, "accepted": [], "other_exception": []}
    base = corpus._plan()
    for name, fn in sorted(corpus.DICT_KINDS.items()):
        d = base.to_dict()
        fn(d, 0)
        if "digest" in d and name.split()[0] != "digest":
            corpus._redigest(d)
        path = tmp / "plan.json"
        path.write_text(json.dumps(d, indent=1))
        _judge(Plan, PlanError, path, f"dict: {name}", counts)
    for name, fn in sorted(corpus.BYTE_KINDS.items()):
        path = tmp / "plan.json"
        base.save(path)
        path.write_bytes(fn(path.read_bytes(), 3))
        _judge(Plan, PlanError, path, f"bytes: {name}", counts)
    return counts


def _judge(plan_cls, error, path: Path, name: str, counts: dict) -> None:  # type: ignore[no-untyped-def]
    counts["kinds"] += 1
    try:
        plan_cls.load(path)
    except error as exc:
        if "\n" not in str(exc) and str(path) in str(exc):
            counts["refused_one_line"] += 1
        else:
            counts["other_exception"].append(f"{name}: multi-line or unnamed: {exc}")
    except Exception as exc:  # what the corpus looks for
        counts["other_exception"].append(f"{name}: {type(exc).__name__}: {exc}"[:200])
    else:
        counts["accepted"].append(name)


def bad_invocations(tmp: Path) -> dict:
    a_file = tmp / "a-file"
    a_file.write_text("x")
    ro = tmp / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    out = str(tmp / "inv-out")
    plan5 = tmp / "plan5.json"
    plan5.write_text('{"version": 1, "workload": 5}')
    latin = tmp / "latin.json"
    latin.write_bytes(b'{"version": 1, "label": "caf\xe9"}')
    rec = tmp / "rec.json"
    rec.write_text('{"gpu": "h200-sxm", "static_power_w": 80, "measurements": []}')
    cases = [
        [*SMALL, "--out", str(a_file)],
        [*SMALL, "--out", ""],
        [*SMALL, "--out", str(ro / "x")],
        [*SMALL, "--out", str(a_file / "sub")],
        [*SMALL, "--out", out, "--record", str(tmp)],
        [*SMALL, "--out", out, "--record", ""],
        [*SMALL, "--out", out, "--seq-len", "1"],
        [*SMALL, "--out", out, "--seq-len", "100000000"],
        [*SMALL, "--out", out, "--microbatch-size", "1000000"],
        [*SMALL, "--out", out, "--microbatches", "100000"],
        [*SMALL, "--out", out, "--budget", "1000000000"],
        [*SMALL, "--out", out, "--budget", "0"],
        [*SMALL, "--out", out, "--budget", "x"],
        [*SMALL, "--out", out, "--tp", "3"],
        [*SMALL, "--out", out, "--pp", "5"],
        [*SMALL, "--out", out, "--gpus", "7"],
        [*SMALL, "--out", out, "--noise", "nan"],
        [*SMALL, "--out", out, "--noise", "-1"],
        [*SMALL, "--out", out, "--gpu", "tpu-v9"],
        [*SMALL, "--out", out, "--workload", "gpt-9"],
        [*SMALL, "--out", out, "--schedule", "zigzag"],
        [*SMALL, "--out", out, "--profiler", "magic"],
        [*SMALL, "--out", out, "--profiler", "replay:/nonexistent.json"],
        [*SMALL, "--out", out, "--profiler", f"replay:{a_file}"],
        [*SMALL, "--out", out, "--profiler", f"replay:{rec}"],
        [*SMALL, "--out", out, "--profiler", f"replay:{tmp}"],
        [*SMALL, "--out", out, "--deadline-s", "1", "--energy-budget-j", "1"],
        [*SMALL, "--out", out, "--deadline-s", "1e-9"],
        [*SMALL, "--out", out, "--nanobatches", "3"],
        ["show", str(tmp)],
        ["show", str(tmp / "missing.json")],
        ["show", str(a_file)],
        ["show", str(plan5)],
        ["show", str(latin)],
        ["optimize"],
        ["frobnicate"],
    ]
    rows = []
    for argv in cases:
        proc = _kareus(argv)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        traceback = "Traceback" in proc.stderr
        usage = proc.returncode == 2 and any(ln.startswith("usage:") for ln in lines)
        one_line = (not traceback and proc.returncode in (1, 2)
                    and (usage or (len([ln for ln in lines if "error" in ln]) == 1
                                   and lines[-1].startswith("kareus: error"))))
        rows.append({"argv": argv[len(SMALL):] if argv[:len(SMALL)] == SMALL else argv,
                     "exit": proc.returncode, "one_line_error": one_line,
                     "traceback": traceback, "last_line": lines[-1][:200] if lines else ""})
    ro.chmod(0o755)
    return {"invocations": len(rows), "one_line_errors": sum(r["one_line_error"] for r in rows),
            "tracebacks": sum(r["traceback"] for r in rows),
            "succeeded_wrongly": sum(r["exit"] == 0 for r in rows), "rows": rows,
            "note": "running as root, a read-only folder is writable: that case may succeed"
                    if os.geteuid() == 0 else ""}


def two_runs(tmp: Path) -> dict:
    out = tmp / "two"
    argv = [sys.executable, "-m", "kareus", *SMALL, "--out", str(out)]
    t0 = time.monotonic()
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    ended: dict[int, float] = {}
    while len(ended) < len(procs):  # the time each one ends, not when it is read
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        time.sleep(0.01)
    ends = [(p.returncode, ended[i], p.communicate()[1]) for i, p in enumerate(procs)]
    dup = 0
    for log in (out / "logs").glob("search-*.jsonl"):
        told = [json.dumps(r["config"], sort_keys=True) for r in
                map(json.loads, log.read_text().splitlines()) if r["kind"] == "tell"]
        dup += len(told) - len(set(told))
    refused = [e for e in ends if e[0] == 1 and "in use" in e[2]]
    return {"exit_codes": sorted(e[0] for e in ends), "refused": len(refused),
            "refused_after_s": round(refused[0][1], 2) if refused else None,
            "other_finished_after_s": round(max(e[1] for e in ends), 2),
            "duplicated_measurements": dup,
            "next_run_ok": _kareus([*SMALL, "--out", str(out)]).returncode == 0}


# ----------------------------------------------------------------- mutated input files

#: Values a mutation puts in place of a field: wrong types, empty, negative, zero, beyond
#: float range, not finite, huge strings.
_BAD_VALUES = [None, "x", "", -1, 0, 1, -1e9, 1e308, 10**30, 2**63, 10**400, True, [], {},
               [1, 2], {"a": 1}, 0.5, -0.0, 1e-300, "NaN", "Infinity", [None], "9" * 5000]


def _paths(obj, prefix=()):  # type: ignore[no-untyped-def]
    """Every path to a value inside nested dicts and lists (the first 6 items of a list)."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from _paths(v, (*prefix, i))


def _mutate(rng, doc):  # type: ignore[no-untyped-def]
    """``doc`` with one to three fields replaced by a bad value, deleted, or joined by an
    unknown key or list item."""
    import copy

    doc = copy.deepcopy(doc)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        r = rng.random()
        if r < 0.6:
            parent[path[-1]] = copy.deepcopy(rng.choice(_BAD_VALUES))
        elif r < 0.8:
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[f"unknown_{rng.randrange(10)}"] = 1
        else:
            parent.append(copy.deepcopy(parent[0]))
    return doc


def _mutated_bytes(rng, doc) -> bytes:  # type: ignore[no-untyped-def]
    """``doc`` mutated and written as JSON (NaN and Infinity as JSON extensions), one in
    ten then cut short, with a byte changed, or with bytes that are not UTF-8."""
    text = json.dumps(_mutate(rng, doc)).replace('"NaN"', "NaN").replace('"Infinity"',
                                                                         "Infinity")
    data = bytearray(text.encode())
    if rng.random() < 0.1:
        k = rng.random()
        if k < 0.3:
            data = data[:rng.randrange(len(data))]
        elif k < 0.6:
            data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            data += b"\xff\xfe"
    return bytes(data)


def mutated_files(tmp: Path, per_kind: int, seed: int) -> dict:
    """Model and GPU files, a GPU profile, a plan, a recording and search logs, each
    mutated ``per_kind`` times and read as kareus reads them (accepted model and GPU
    files are also used: partitions built, the emulator measuring one configuration). A
    refusal counts when it is a KareusError of one line; any other exception counts
    against, as does a search log that the command line reports as an internal error."""
    import contextlib
    import io
    import random
    import shutil

    import attrs

    from kareus.cli import main as kareus_main
    from kareus.compose.plan import Plan
    from kareus.errors import KareusError
    from kareus.model import ScheduleConfig
    from kareus.model.files import load_gpu_file, load_model_file
    from kareus.model.gpu import GPU_PRESETS
    from kareus.model.gpu_profile import GPUProfile
    from kareus.model.partition import build_partitions
    from kareus.model.workload import Parallelism, Workload
    from kareus.profilers.emulator import EmulatedProfiler
    from kareus.profilers.replay import ReplayProfiler
    from tests.compose import test_plan as plan_corpus

    rng = random.Random(seed)
    run = tmp / "mut-run"
    rec = tmp / "mut-rec.json"
    job = [*SMALL[:SMALL.index("--budget")], "--budget", "8", "--quiet"]
    done = _kareus([*job, "--out", str(run), "--record", str(rec)])
    assert done.returncode == 0, done.stderr[-500:]

    def use_model(arch):  # type: ignore[no-untyped-def]
        wl = Workload(model=arch, parallelism=Parallelism(tp=1), microbatch_size=2,
                      seq_len=256, nanobatches=2)
        build_partitions(wl)

    def use_gpu(spec):  # type: ignore[no-untyped-def]
        wl = Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2, seq_len=512)
        part = build_partitions(wl)["fwd_mlp"]
        EmulatedProfiler(spec).measure(part, ScheduleConfig(spec.max_clock_mhz, 1, None))

    gpu = {k: list(v) if isinstance(v, tuple) else v
           for k, v in attrs.asdict(GPU_PRESETS["h200-sxm"]).items()}
    loaders = {
        "model file": (lambda p: use_model(load_model_file(p)),
                       {"name": "mine", "layers": 4, "hidden": 1024, "heads": 8,
                        "kv_heads": 4, "head_dim": 128, "ffn": 4096, "vocab": 32000}),
        "GPU file": (lambda p: use_gpu(load_gpu_file(p)), {**gpu, "name": "mine"}),
        "GPU profile": (GPUProfile.load, json.loads(
            (ROOT / "kareus" / "model" / "profiles" / "h200_sxm.json").read_text())),
        "plan": (Plan.load, plan_corpus._plan().to_dict()),
        "recording": (ReplayProfiler, json.loads(rec.read_text())),
    }
    out: dict[str, dict] = {}
    for kind, (load, doc) in loaders.items():
        c: dict = {"mutations": per_kind, "refused_one_line": 0, "accepted": 0,
                   "other_exception": []}
        path = tmp / "mutated.json"
        for _ in range(per_kind):
            path.write_bytes(_mutated_bytes(rng, doc))
            try:
                load(path)
            except KareusError as exc:
                if "\n" in str(exc) or len(str(exc)) > 1000:
                    c["other_exception"].append(f"long or multi-line: {str(exc)[:150]}")
                else:
                    c["refused_one_line"] += 1
            except Exception as exc:  # what the corpus looks for
                c["other_exception"].append(f"{type(exc).__name__}: {exc}"[:200])
            else:
                c["accepted"] += 1
        out[kind] = c
    # Search logs: one record of one log (or the folder's manifest) mutated, the same
    # command run again in the folder.
    c = {"mutations": per_kind, "refused_one_line": 0, "accepted": 0, "other_exception": []}
    for _ in range(per_kind):
        work = tmp / "mut-logs"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(run, work)
        logs = sorted((work / "logs").glob("search-*.jsonl"))
        target = rng.choice(logs)
        lines = target.read_text().splitlines()
        k = rng.randrange(len(lines))
        lines[k] = _mutated_bytes(rng, json.loads(lines[k])).decode("utf-8", "replace")
        target.write_text("\n".join(lines) + "\n")
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = kareus_main([*job, "--out", str(work)])
        last = (err.getvalue().strip().splitlines() or [""])[-1]
        if code == 0:
            c["accepted"] += 1
        elif last.startswith("kareus: error:") and "Traceback" not in err.getvalue():
            c["refused_one_line"] += 1
        else:
            c["other_exception"].append(f"line {k + 1} of {target.name}: {last[:200]}")
    out["search log"] = c
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill-points", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--mutations", type=int, default=200,
                    help="mutations of each kind of input file (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mutations")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kareus-reliability-") as tmp_s:
        tmp = Path(tmp_s)
        kills = kill_and_resume(tmp, args.kill_points)
        plans = corrupt_plans(tmp)
        calls = bad_invocations(tmp)
        pair = two_runs(tmp)
        mutated = mutated_files(tmp, args.mutations, args.seed)
    print(f"kill and resume: {kills['kill_points']} kill points ({kills['stopped_by_the_signal']} "
          f"stopped by the signal), {kills['resumed_ok']} resumed, "
          f"{kills['identical_results_and_plan']} identical results.json and plan.json "
          f"({kills['identical_plan']} identical plan.json); re-run in the finished folder "
          f"identical: {kills['rerun_in_finished_folder_identical']}")
    print(f"corrupt plans: {plans['kinds']} kinds, {plans['refused_one_line']} refused in one "
          f"line, {len(plans['accepted'])} accepted, {len(plans['other_exception'])} other "
          f"exceptions")
    print(f"bad invocations: {calls['invocations']}, {calls['one_line_errors']} one-line errors, "
          f"{calls['tracebacks']} tracebacks, {calls['succeeded_wrongly']} succeeded")
    print(f"two runs on one folder: exits {pair['exit_codes']}, refused {pair['refused']} "
          f"(after {pair['refused_after_s']} s), duplicated measurements "
          f"{pair['duplicated_measurements']}, next run ok: {pair['next_run_ok']}")
    for kind, c in mutated.items():
        print(f"mutated {kind}: {c['mutations']}, {c['refused_one_line']} refused in one line, "
              f"{c['accepted']} accepted, {len(c['other_exception'])} other exceptions")
    result = {"kill_and_resume": kills, "corrupt_plans": plans, "bad_invocations": calls,
              "two_runs_one_folder": pair, "mutated_files": mutated,
              "seed": args.seed, "wall_s": time.monotonic() - t0,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()}}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
