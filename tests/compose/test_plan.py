"""Plans: JSON round trip, digest, and typed errors for corrupt or invalid files."""

from __future__ import annotations

import json

import pytest

from kareus.compose.plan import PLAN_VERSION, MicrobatchChoice, Plan
from kareus.errors import PlanError
from kareus.model.config import ScheduleConfig
from kareus.model.pipeline import one_f_one_b


def _plan(freq=1410, sms=4):
    sched = one_f_one_b(2, 2)
    choices = [MicrobatchChoice(freq_mhz=freq, configs={"fwd_attn": ScheduleConfig(freq, sms, "qkv"),
                                                        "bwd_mlp": ScheduleConfig(freq, sms, None)}),
               MicrobatchChoice(freq_mhz=1200, configs={"fwd_attn": ScheduleConfig(1200, 8, None),
                                                        "bwd_mlp": ScheduleConfig(1200, 8, None)},
                                predicted=True)]
    assignment = {c.key(): (i % 2) for i, c in enumerate(sched.nodes)}
    return Plan(gpu="a100-40gb", num_stages=2, num_microbatches=2, choices=choices,
                assignment=assignment, time_s=1.5, energy_j=900.0, dynamic_energy_j=600.0,
                static_power_w=200.0, label="kareus", workload={"model": "x"})


def test_round_trip_json_and_file(tmp_path):
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.digest == plan.digest
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.freq_mhz("s0.m0.fwd") in (1410, 1200)
    assert loaded.config("s0.m0.fwd", "fwd_attn").freq_mhz == loaded.freq_mhz("s0.m0.fwd")
    assert loaded.predicted
    assert set(loaded.partition_configs()) == {"fwd_attn", "bwd_mlp"}
    assert "digest" in loaded.summary() and "stage 1 bwd" in loaded.summary()
    assert "Plan(kareus" in repr(loaded)


def test_digest_changes_with_content():
    assert _plan(sms=4).digest != _plan(sms=8).digest


def _mutated(fn):
    d = _plan().to_dict()
    fn(d)
    return json.dumps(d)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(version=PLAN_VERSION + 1), "version"),
    (lambda d: d.pop("version"), "version"),
    (lambda d: d.pop("choices"), "choices"),
    (lambda d: d.pop("assignment"), "assignment"),
    (lambda d: d.update(gpu="tpu-v9"), "unknown GPU"),
    (lambda d: d["choices"][0].update(freq_mhz=1411), "not a supported SM clock"),
    (lambda d: d["choices"][0]["configs"]["fwd_attn"].update(comm_sms=500), "comm_sms=500"),
    (lambda d: d["choices"][0]["configs"]["fwd_attn"].update(comm_sms=0), "comm_sms=0"),
    (lambda d: d["assignment"].pop("s0.m0.fwd"), "do not match"),
    (lambda d: d["assignment"].update({"s0.m0.fwd": 7}), "choice 7"),
    (lambda d: d["assignment"].update({"bogus": 0}), "malformed"),
    (lambda d: d.update(time_s=2.0), "digest"),
    (lambda d: d["choices"][0].pop("configs"), "malformed"),
])
def test_corrupt_plans_raise_plan_error(mutate, match):
    with pytest.raises(PlanError, match=match):
        Plan.from_json(_mutated(mutate))


def test_not_json_and_not_object(tmp_path):
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{broken")
    with pytest.raises(PlanError, match="JSON object"):
        Plan.from_json("[1, 2]")
    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(PlanError, match="bad.json"):
        Plan.load(path)


def test_choice_rejects_mismatched_frequency():
    with pytest.raises(ValueError, match="runs at"):
        MicrobatchChoice(freq_mhz=1410, configs={"a": ScheduleConfig(1200, 4, None)})
