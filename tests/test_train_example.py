"""examples/train_torchrun.py on the CPU: arguments and the committed plan.

The script is a thin wrapper over the library's loop (kareus.exec.train); the loop's
schedule logic is tested in tests/exec/test_train_chain.py and the loop itself in
tests/exec/test_train_loop.py (CPU) and tests/exec/test_train_gpu.py (GPU).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kareus.errors import PlanError
from kareus.model.partition import build_partitions

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_torchrun.py"
PLAN = ROOT / "examples" / "plans" / "llama3b_tp2_h200.json"


@pytest.fixture(scope="module")
def ex_mod():
    spec = importlib.util.spec_from_file_location("train_torchrun", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_runs_without_torch():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--plan", "--steps", "--dry-run-clocks", "--make-plan",
                 "--allow-clock-changes", "--backend"):
        assert flag in out.stdout


def test_defaults(ex_mod):
    a = ex_mod.parse_args([])
    assert a.clocks == "dry-run" and not a.allow_clock_changes
    assert a.steps == 10 and a.plan == PLAN and a.backend == "nccl_capped"
    assert a.schedules == ["kareus", "sequential", "nanobatching"]
    assert ex_mod.parse_args(["--dry-run-clocks", "--steps", "3"]).steps == 3


def test_real_clocks_refused_without_permission(ex_mod, capsys):
    with pytest.raises(SystemExit) as exc:
        ex_mod.parse_args(["--nvml-clocks"])
    assert exc.value.code == 2
    assert "--allow-clock-changes" in capsys.readouterr().err
    a = ex_mod.parse_args(["--nvml-clocks", "--allow-clock-changes"])
    assert a.clocks == "nvml"
    with pytest.raises(SystemExit):
        ex_mod.parse_args(["--nvml-clocks", "--dry-run-clocks"])


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--layers", "0"], ["--slack", "-1"],
                                 ["--schedules", "kareus,nope"],
                                 ["--schedules", "kareus,kareus"], ["--backend", "mpi"]])
def test_bad_arguments_exit(ex_mod, bad):
    with pytest.raises(SystemExit):
        ex_mod.parse_args(bad)


def test_committed_plan_loads_with_its_workload(ex_mod):
    plan, wl = ex_mod.load_plan(PLAN)
    assert plan.digest == json.loads(PLAN.read_text())["digest"]
    assert (wl.parallelism.tp, wl.parallelism.pp, wl.nanobatches) == (2, 1, 2)
    assert (wl.microbatch_size, wl.seq_len, wl.model.name) == (8, 4096, "llama3.2-3b")
    assert set(plan.partition_configs()) == set(build_partitions(wl).types)


def test_plan_without_workload_or_tampered_is_refused(ex_mod, tmp_path):
    d = json.loads(PLAN.read_text())
    d["workload"] = None
    d.pop("digest")
    p = tmp_path / "noworkload.json"
    p.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="workload"):
        ex_mod.load_plan(p)
    d = json.loads(PLAN.read_text())
    d["choices"][0]["configs"]["fwd_attn"]["comm_sms"] += 1
    p.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="digest"):
        ex_mod.load_plan(p)


def test_pipeline_plan_is_refused_with_what_to_do(ex_mod, tmp_path):
    d = json.loads(PLAN.read_text())
    d["num_stages"] = 2
    d.pop("digest")
    p = tmp_path / "pp2.json"
    p.write_text(json.dumps(d))
    with pytest.raises(PlanError):
        ex_mod.load_plan(p)


def test_committed_plan_is_what_the_documented_make_plan_command_writes(ex_mod, tmp_path):
    """`python examples/train_torchrun.py --make-plan --plan
    examples/plans/llama3b_tp2_h200.json` (the script's docstring; about a second on a CPU)
    must write the committed plan byte for byte: run it again when this fails."""
    out = tmp_path / "plan.json"
    ex_mod.make_plan(ex_mod.parse_args(["--make-plan", "--plan", str(out)]))
    assert out.read_bytes() == PLAN.read_bytes(), (
        "examples/plans/llama3b_tp2_h200.json drifted from what --make-plan writes: run "
        "python examples/train_torchrun.py --make-plan --plan "
        "examples/plans/llama3b_tp2_h200.json")


def test_make_plan_writes_a_loadable_plan(ex_mod, tmp_path, capsys):
    pytest.importorskip("xgboost")
    out = tmp_path / "plan.json"
    args = ex_mod.parse_args(["--make-plan", "--plan", str(out), "--budget", "6",
                              "--microbatches", "2"])
    made = ex_mod.make_plan(args)
    plan, wl = ex_mod.load_plan(out)
    assert plan.digest == made.digest and wl.num_microbatches == 2
    assert "saved" in capsys.readouterr().out
