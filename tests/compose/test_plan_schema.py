"""plan.json's JSON Schema (kareus/compose/plan.schema.json), shipped with the package.

Every plan the pipeline produces (each system's fastest, lowest-energy and a middle plan;
1F1B and GPipe; a preset model and one of your own) validates against it, and shape-level
corruptions fail it. The schema's checks are a subset of :meth:`Plan.from_dict`'s (which
also checks the digest, the GPU's clocks and SMs, and the schedule's computations).
"""

from __future__ import annotations

import copy
import hashlib
import json
from importlib.resources import files

import attrs
import pytest

from kareus.compose.plan import PLAN_VERSION, Plan
from kareus.model.workload import Workload, get_model
from kareus.workflow import optimize

SCHEMA = json.loads((files("kareus.compose") / "plan.schema.json").read_text("utf-8"))


def _plans(result) -> list[Plan]:
    """Each system's fastest, middle and lowest-energy plans."""
    out = []
    for fr in result.frontiers.values():
        pts = fr.points
        out += [pts[i].plan for i in sorted({0, len(pts) // 2, len(pts) - 1})]
    return out


@pytest.fixture(scope="module")
def plans() -> list[dict]:
    own = attrs.evolve(get_model("qwen3-1.7b"), name="my-arch", layers=4)
    runs = [
        (Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=4), "1f1b"),
        (Workload(model=own, parallelism=Workload.preset(
            "qwen3-1.7b", tp=2, pp=2).parallelism, microbatch_size=2, seq_len=512,
            num_microbatches=3), "gpipe"),
        # a mixture of experts of one's own, expert parallel (its workload has ep and
        # routing_imbalance, its model a moe table)
        (Workload.preset(attrs.evolve(get_model("qwen3-30b-a3b"), name="my-moe", layers=4),
                         dp=2, ep=2, microbatch_size=2, seq_len=512, num_microbatches=2,
                         routing_imbalance=1.25), "1f1b"),
        # layers run one by one (chained_layers false: torchtitan's FSDP-wrapped blocks)
        (Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2, seq_len=512,
                         num_microbatches=2, chained_layers=False), "1f1b"),
    ]
    out = []
    for wl, schedule in runs:
        res = optimize(wl, "h200-sxm", budget=8, seed=3, progress=False, schedule=schedule)
        out += [p.to_dict() for p in _plans(res)]
        out.append(res.select().to_dict())
    return out


def test_schema_is_shipped_and_names_every_key_of_a_plan(plans):
    assert SCHEMA["properties"]["version"]["const"] == PLAN_VERSION
    for d in plans:
        assert set(d) == set(SCHEMA["properties"]) == set(SCHEMA["required"])
        for ch in d["choices"]:
            # kareus writes every choice's nanobatch count; older plans lack it (optional)
            assert set(ch) == set(SCHEMA["$defs"]["choice"]["properties"])
            assert set(SCHEMA["$defs"]["choice"]["required"]) == set(ch) - {"nanobatches"}
        if d["workload"] is not None:
            moe = {"ep", "routing_imbalance"} if "moe" in d["workload"]["model"] else set()
            # written only when false (plans of chained layers are unchanged)
            unchained = {"chained_layers"} if "chained_layers" in d["workload"] else set()
            assert d["workload"].get("chained_layers", False) is False
            assert set(d["workload"]) == (set(SCHEMA["$defs"]["workload"]["required"]) | moe
                                          | unchained)
    assert {d["schedule"] for d in plans} == {"1f1b", "gpipe"}
    assert any(isinstance(d["workload"]["model"], dict) for d in plans)


def test_produced_plans_validate(plans):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the dev extra) "
                                     "validates plans against the schema")
    validator = jsonschema.Draft202012Validator
    validator.check_schema(SCHEMA)
    for d in plans:
        validator(SCHEMA).validate(json.loads(json.dumps(d)))  # as read back from plan.json
        content = {k: v for k, v in d.items() if k != "digest"}
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode("utf-8")
        assert hashlib.sha256(blob).hexdigest() == d["digest"]  # the schema's description


def _set(path: str, value):
    def mutate(d):
        *head, last = path.split("/")
        obj = d
        for k in head:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        if value is _DELETE:
            del obj[last]
        else:
            obj[last] = value(obj.get(last)) if callable(value) else value
    return mutate


_DELETE = object()

CORRUPTIONS = {
    "digest missing": _set("digest", _DELETE),
    "digest not hex": _set("digest", "x" * 64),
    "unknown key": _set("notes", "hello"),
    "version 2": _set("version", 2),
    "schedule unknown": _set("schedule", "zigzag"),
    "stages 0": _set("num_stages", 0),
    "microbatches a string": _set("num_microbatches", "4"),
    "time negative": _set("time_s", -1.0),
    "time zero": _set("time_s", 0.0),
    "energy a string": _set("energy_j", "12"),
    "static power negative": _set("static_power_w", -5.0),
    "label a number": _set("label", 5),
    "workload a number": _set("workload", 5),
    "workload tp 0": _set("workload/tp", 0),
    "workload extra key": _set("workload/colour", "red"),
    "workload ep 0": _set("workload/ep", 0),
    "workload routing imbalance below 1": _set("workload/routing_imbalance", 0.5),
    "workload model empty": _set("workload/model", ""),
    "choices empty": _set("choices", []),
    "frequency a float": _set("choices/0/freq_mhz", 1410.5),
    "frequency a string": _set("choices/0/freq_mhz", "1410"),
    "predicted a string": _set("choices/0/predicted", "no"),
    "nanobatches 0": _set("choices/0/nanobatches", 0),
    "nanobatches a string": _set("choices/0/nanobatches", "2"),
    "nanobatches a float": _set("choices/0/nanobatches", 1.5),
    "choice extra key": _set("choices/0/note", 1),
    "configs empty": _set("choices/0/configs", {}),
    "assignment empty": _set("assignment", {}),
    "assignment bad key": lambda d: d["assignment"].update({"stage0.mb1.fwd": 0}),
    "assignment negative": lambda d: d["assignment"].update({"s0.m0.fwd": -1}),
    "assignment a float": lambda d: d["assignment"].update({"s0.m0.fwd": 0.5}),
}


def _config_corruptions() -> dict:
    def on_config(fn):
        def mutate(d):
            cfg = next(iter(d["choices"][0]["configs"].values()))
            fn(cfg)
        return mutate
    return {
        "comm_sms 4.7": on_config(lambda c: c.update(comm_sms=4.7)),
        "comm_sms a string": on_config(lambda c: c.update(comm_sms="4")),
        "comm_sms 0": on_config(lambda c: c.update(comm_sms=0)),
        "comm_sms missing": on_config(lambda c: c.pop("comm_sms")),
        "launch slot a number": on_config(lambda c: c.update(launch_slot=3)),
        "launch slot empty": on_config(lambda c: c.update(launch_slot="")),
        "config extra key": on_config(lambda c: c.update(freq_mhz=1410)),
    }


@pytest.mark.parametrize("name", sorted({**CORRUPTIONS, **_config_corruptions()}))
def test_corrupt_plans_fail_the_schema_and_the_loader(plans, name):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the dev extra) "
                                     "validates plans against the schema")
    from kareus.errors import PlanError

    d = copy.deepcopy(plans[0])
    {**CORRUPTIONS, **_config_corruptions()}[name](d)
    if not name.startswith("digest") and isinstance(d, dict):
        # a digest made for the corrupt content, so that the loader must find the fault itself
        content = {k: v for k, v in d.items() if k != "digest"}
        blob = json.dumps(content, sort_keys=True, separators=(",", ":")).encode("utf-8")
        d["digest"] = hashlib.sha256(blob).hexdigest()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, SCHEMA, cls=jsonschema.Draft202012Validator)
    with pytest.raises(PlanError):  # the loader refuses it too
        Plan.from_dict(d)


def test_an_moe_plan_loads_with_its_expert_parallelism(plans):
    moe = [d for d in plans if isinstance(d["workload"]["model"], dict)
           and "moe" in d["workload"]["model"]]
    assert moe
    plan = Plan.from_dict(json.loads(json.dumps(moe[0])))
    wl = Workload.from_dict(plan.workload)
    assert wl.parallelism.ep == 2 and wl.routing_imbalance == 1.25
    assert wl.model.moe is not None and wl.model.moe.experts == 128


def test_an_unchained_plan_validates_and_loads_unchained(plans):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the dev extra) "
                                     "validates plans against the schema")
    unchained = [d for d in plans if d["workload"].get("chained_layers") is False]
    assert unchained
    jsonschema.validate(unchained[0], SCHEMA, cls=jsonschema.Draft202012Validator)
    plan = Plan.from_dict(json.loads(json.dumps(unchained[0])))
    assert Workload.from_dict(plan.workload).chained_layers is False
