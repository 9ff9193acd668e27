"""kareus verify (kareus.workflow.verification) end to end on the CPU: an emulated optimize
run's folder verified in the training loop (one process standing in for TP=2 with loopback
collectives), energy from a fake NVML counter scaled to the job, the command's exit status
and verify.json; the dry run says it is not a measurement.

Skipped without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fake_nvml import FakeNVML

from kareus.cli import main
from kareus.compose import IterationFrontier, Plan
from kareus.errors import ArgumentError, HardwareError, PlanError
from kareus.model.measurement import Measurement
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.workflow import optimize
from kareus.workflow.verification import Figures, job_measurement, verify

#: torch's intra-op threads: one (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(tp: int = 2, seq: int = 8) -> Workload:
    m = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64,
                  vocab=50)
    return Workload(model=m, parallelism=Parallelism(tp=tp, cp=1), microbatch_size=2,
                    seq_len=seq, num_microbatches=2, nanobatches=2, recompute=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("opt")
    optimize(tiny(), "h200-sxm", budget=4, seed=1, progress=False).save(out, figure=False)
    return out


def test_the_folder_keeps_the_frontier_the_plan_came_from(folder):
    fr = IterationFrontier.load(folder / "frontier.json")
    plan = Plan.load(folder / "plan.json")
    assert len(fr) >= 1 and plan.digest in {p.plan.digest for p in fr.points}
    assert "wall_s" not in fr.stats  # the same inputs give the same bytes


def test_a_measurement_is_scaled_to_the_job_as_the_tune_scales():
    m = job_measurement(time_s=0.5, energy_j=300.0, measured_gpus=1, job_gpus=8,
                        job_static_power_w=800.0)
    assert m == Measurement(time_s=0.5, energy_j=300.0, static_power_w=100.0).scaled_to_scope(
        measured_gpus=1, scope_gpus=8)
    assert (m.time_s, m.energy_j, m.static_power_w) == (0.5, 2400.0, 800.0)
    f = Figures.of_measurement(m)
    assert (f.static_j, f.dynamic_j, f.total_j) == (400.0, 2000.0, 2400.0)
    same = Measurement(time_s=1.0, energy_j=2.0, static_power_w=1.0)
    assert same.scaled_to_scope(measured_gpus=4, scope_gpus=4) is same
    with pytest.raises(ArgumentError, match="scope_gpus"):
        same.scaled_to_scope(measured_gpus=1, scope_gpus=0)


def test_verify_runs_every_system_and_scales_the_counter_to_the_job(folder, tmp_path):
    nvml = FakeNVML(1, period_s=0.002, idle_w=100.0)
    rep = verify(folder, device="cpu", steps=3, warmup=1, repeats=2, nvml=nvml,
                 busy_steps=0, out=tmp_path)
    assert rep is not None and not rep.measured and "NOT A MEASUREMENT" in rep.note
    assert [s.system for s in rep.systems] == ["megatron", "nanobatching", "kareus"]
    assert [s.schedule for s in rep.systems] == ["sequential", "nanobatching", "kareus"]
    results = json.loads((folder / "results.json").read_text())
    plan = Plan.load(folder / "plan.json")
    for s in rep.systems:
        pred = results["systems"][s.system] if s.system != "kareus" else None
        if pred is not None:
            assert s.predicted.total_j == pytest.approx(pred["total_j"])
        else:
            assert s.predicted.total_j == pytest.approx(plan.energy_j)
        assert s.repeats == 2 and s.measured is not None
        # the fake GPU draws 100 W: one GPU read, the job's two GPUs counted
        assert s.measured.total_j == pytest.approx(2 * 100.0 * s.measured_time_s, rel=0.25)
        assert s.measured.static_j == pytest.approx(
            s.predicted.static_j / s.predicted.time_s * s.measured_time_s)
    data = json.loads((tmp_path / "verify.json").read_text())
    assert data["measured"] is False and data["job_gpus"] == 2 and data["measured_gpus"] == 1
    assert "scaled to 2" in data["energy_scope"]
    assert len(data["runs"]) == 6 and data["plan"]["digest"] == plan.digest
    # each run's window in parts (a trend would say it was not steady), per rank
    for run in data["runs"]:
        (parts,) = run["sub_powers_w_by_rank"]
        assert 1 <= len(parts) <= 3
        assert all(w == pytest.approx(100.0, rel=0.25) for w in parts)
    assert "dry-run" in data["clocks"]
    assert set(data["systems"]["kareus"]["ratios"]) == {"time_s", "static_j", "dynamic_j",
                                                        "total_j"}
    assert "CPU DRY RUN" in rep.table().splitlines()[0]


def test_the_command_prints_writes_and_exits_past_the_tolerance(folder, tmp_path, capsys):
    out = tmp_path / "v.json"
    code = main(["verify", str(folder), "--device", "cpu", "--steps", "2", "--repeats", "1",
                 "--quiet", "--out", str(out), "--systems", "kareus"])
    text = capsys.readouterr()
    assert code == 1  # a CPU's host time is nowhere near an H200's composed time
    assert "CPU DRY RUN" in text.out and "predicted" in text.out and "measured" in text.out
    assert "outside the tolerance" in text.err and "not a measurement" in text.err
    assert json.loads(out.read_text())["passed"] is False
    code = main(["verify", str(folder / "plan.json"), "--device", "cpu", "--steps", "1",
                 "--repeats", "1", "--quiet", "--out", str(out), "--tolerance", "1e6",
                 "--systems", "kareus"])
    assert code == 0 and json.loads(out.read_text())["passed"] is True


def test_refusals(folder, tmp_path):
    with pytest.raises(ArgumentError, match="--systems"):
        verify(folder, device="cpu", systems=["perseus"])
    other = tmp_path / "results.json"
    data = json.loads((folder / "results.json").read_text())
    data["workload"] = tiny(seq=16).to_dict()
    other.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="another job"):
        verify(folder, results=other, device="cpu")
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "plan.json").write_bytes((folder / "plan.json").read_bytes())
    with pytest.raises(PlanError, match="results"):
        verify(lone, device="cpu", systems=["megatron"])
    if not torch.cuda.is_available():
        with pytest.raises(HardwareError, match="--device cpu"):
            verify(folder)


def test_a_counter_slower_than_the_runs_still_measures_every_system(folder, tmp_path):
    # the counter steps every 150 ms; a run of a few CPU iterations lasts far less. The
    # windows are lengthened (by default to 7.5 of the counter's periods) until it steps
    # several times in each, so every system gets a measured energy.
    nvml = FakeNVML(1, period_s=0.15, idle_w=100.0)
    rep = verify(folder, device="cpu", steps=1, warmup=1, repeats=1, nvml=nvml,
                 busy_steps=0, out=tmp_path)
    assert rep is not None
    data = json.loads((tmp_path / "verify.json").read_text())
    # (the period is the median of the steps the meter's poller saw, which a loaded CPU
    # delays: seen 0.99 s instead of 1.125 s on a busy 2-core machine)
    assert data["min_window_s"] == pytest.approx(7.5 * 0.15, rel=0.25)
    for s in rep.systems:
        assert s.measured is not None and s.energy_method == "nvml_counter"
        assert s.energy_runs == 1 and s.iterations > 1
        assert s.measured.total_j == pytest.approx(2 * 100.0 * s.measured_time_s, rel=0.25)
        assert data["systems"][s.system]["energy_method"] == "nvml_counter"
    for run in data["runs"]:
        assert run["window_s"] >= data["min_window_s"] and run["energy_method"] == "nvml_counter"
    assert "energy from nvml_counter, 1 of 1 runs" in rep.table()


def test_power_readings_stand_in_for_a_counter_that_did_not_step_and_are_labelled(
        folder, tmp_path):
    nvml = FakeNVML(1, period_s=30.0, idle_w=100.0)  # no step inside any window
    rep = verify(folder, device="cpu", steps=1, warmup=0, repeats=1, nvml=nvml,
                 busy_steps=0, systems=["kareus"], min_window_s=0.2, out=tmp_path)
    assert rep is not None
    (s,) = rep.systems
    assert s.energy_method == "nvml_power_samples" and s.measured is not None
    assert s.measured.total_j == pytest.approx(2 * 100.0 * s.measured_time_s, rel=0.25)
    nothing = FakeNVML(1, period_s=30.0, idle_w=100.0, power_readings=False)
    rep = verify(folder, device="cpu", steps=1, warmup=0, repeats=1, nvml=nothing,
                 busy_steps=0, systems=["kareus"], min_window_s=0.2, out=tmp_path)
    assert rep is not None
    (s,) = rep.systems
    # nothing measured the energy: no figure, said so, and the check fails
    assert s.measured is None and s.energy_method is None and not s.within(1e9)
    assert "NOTHING (not measured)" in rep.table()


def test_the_time_faithful_loopback_is_labelled_a_stand_in_everywhere(folder, tmp_path):
    rep = verify(folder, device="cpu", steps=1, warmup=0, repeats=1, busy_steps=0,
                 systems=["kareus"], loopback="faithful", out=tmp_path)
    assert rep is not None
    data = json.loads((tmp_path / "verify.json").read_text())
    assert data["loopback"] == "faithful" and data["stand_in"].startswith("STAND-IN")
    # where the collective times come from: the H200 profile's curve measured on 2 GPUs
    assert "STAND-IN" in data["collectives"] and "MEASURED curve" in data["collectives"]
    assert rep.note.startswith("STAND-IN") and "STAND-IN" in rep.table()
    plain = verify(folder, device="cpu", steps=1, warmup=0, repeats=1, busy_steps=0,
                   systems=["kareus"], out=tmp_path)
    assert plain is not None and plain.facts["stand_in"] is None
    assert "STAND-IN" not in plain.table()
    with pytest.raises(ArgumentError, match="--loopback"):
        verify(folder, device="cpu", loopback="fast")


def test_the_command_takes_loopback_faithful(folder, tmp_path, capsys):
    out = tmp_path / "v.json"
    main(["verify", str(folder), "--device", "cpu", "--steps", "1", "--repeats", "1",
          "--quiet", "--out", str(out), "--systems", "kareus", "--loopback", "faithful"])
    assert "STAND-IN" in capsys.readouterr().out
    assert json.loads(out.read_text())["loopback"] == "faithful"
    code = main(["optimize", "--workload", "qwen3-1.7b", "--tp", "2", "--loopback", "faithful",
                 "--out", str(tmp_path / "o")])
    assert code == 2 and "--loopback" in capsys.readouterr().err


def test_a_plan_for_unchained_layers_is_refused_in_one_line(tmp_path):
    # kareus's loop chains its layers; a plan made for layers run one by one
    # (chained_layers=False, torchtitan's Trainer) is not verified in it
    optimize(tiny().with_(chained_layers=False), "h200-sxm", budget=4, seed=1,
             progress=False).save(tmp_path, figure=False)
    with pytest.raises(PlanError, match="chained_layers") as err:
        verify(tmp_path, device="cpu")
    assert "\n" not in str(err.value)
