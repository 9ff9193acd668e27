"""A plan made for packed documents (``Workload.document_tokens``): the plan file records
the setting (and validates against plan.json's schema), reads back with it, and costs the
shorter attention; a plan of one setting is refused for a job of another."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

from kareus.compose.plan import Plan
from kareus.errors import PlanError
from kareus.model.workload import Workload
from kareus.workflow import optimize


def test_a_plan_for_packed_documents_records_and_costs_them():
    wl = Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2, seq_len=8192,
                         num_microbatches=2)
    plans = {}
    for docs in (None, 1024):
        res = optimize(wl.with_(document_tokens=docs), "h200-sxm", budget=8, seed=3,
                       progress=False)
        plans[docs] = res.select()
    d = json.loads(plans[1024].to_json())
    assert d["workload"]["document_tokens"] == 1024
    assert "document_tokens" not in plans[None].workload
    back = Plan.from_json(plans[1024].to_json())
    assert back.workload == plans[1024].workload
    assert Workload.from_dict(back.workload).document_tokens == 1024
    # the attention within 1k-token documents is a quarter of 8k causal attention's
    assert plans[1024].time_s < plans[None].time_s
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((files("kareus.compose") / "plan.schema.json").read_text("utf-8"))
    jsonschema.Draft202012Validator(schema).validate(d)
    bad = json.loads(plans[1024].to_json())
    bad["workload"]["document_tokens"] = 0
    with pytest.raises(PlanError, match="document_tokens"):
        Plan.from_dict(bad)


def test_a_plan_of_one_document_setting_is_refused_for_another():
    from kareus.exec.train import check_plan_workload
    from kareus.testing import make_workload_plan

    wl = Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2, seq_len=4096,
                         num_microbatches=2, document_tokens=512)
    plan = make_workload_plan(wl)
    check_plan_workload(plan, wl)
    for job, words in ((wl.with_(document_tokens=None), "document_tokens: plan 512, job None"),
                       (wl.with_(document_tokens=1024), "document_tokens: plan 512, job 1024")):
        with pytest.raises(PlanError, match=words) as err:
            check_plan_workload(plan, job)
        assert "\n" not in str(err.value)
    with pytest.raises(PlanError, match="document_tokens: plan None, job 512"):
        check_plan_workload(make_workload_plan(wl.with_(document_tokens=None)), wl)
