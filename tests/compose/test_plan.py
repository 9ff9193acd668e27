"""Plans: JSON round trip, digest, and validation of plan files as data.

A plan file is checked before it is trusted: the corpus below holds more than fifty kinds
of corruption (bytes, types, ranges, the GPU, the workload, the schedule, partition types,
slots; each with the digest left stale or recomputed), and every one must raise a one-line
:class:`PlanError` naming the file, never be accepted and never escape as another
exception.
"""

from __future__ import annotations

import contextlib
import hashlib
import json

import attrs
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kareus.compose.plan import PLAN_MAX_BYTES, PLAN_VERSION, MicrobatchChoice, Plan
from kareus.errors import PlanError
from kareus.model.config import ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.pipeline import one_f_one_b
from kareus.model.workload import Workload

WORKLOAD = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                           num_microbatches=2)


def _choice(freq: int, sms: int, phase: str, *, sequential: bool = False,
            predicted: bool = False) -> MicrobatchChoice:
    pset = build_partitions(WORKLOAD)
    configs = {}
    for name in pset.counts[phase]:
        slots = pset.types[name].slots
        slot = None if sequential or not slots else slots[0].name
        configs[name] = ScheduleConfig(freq, sms, slot)
    return MicrobatchChoice(freq_mhz=freq, configs=configs, predicted=predicted)


def _plan(freq=1410, sms=4):
    sched = one_f_one_b(2, 2)
    choices = [_choice(freq, sms, "fwd"), _choice(1200, 8, "bwd", sequential=True,
                                                   predicted=True)]
    assignment = {c.key(): (0 if c.phase == "fwd" else 1) for c in sched.nodes}
    return Plan(gpu="a100-40gb", num_stages=2, num_microbatches=2, choices=choices,
                assignment=assignment, time_s=1.5, energy_j=900.0, dynamic_energy_j=600.0,
                static_power_w=200.0, label="kareus", workload=WORKLOAD.to_dict())


def test_round_trip_json_and_file(tmp_path):
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.digest == plan.digest
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.freq_mhz("s0.m0.fwd") == 1410 and loaded.freq_mhz("s0.m0.bwd") == 1200
    assert loaded.config("s0.m0.fwd", "fwd_mlp").freq_mhz == loaded.freq_mhz("s0.m0.fwd")
    assert loaded.predicted
    assert set(loaded.partition_configs()) == set(build_partitions(WORKLOAD).types)
    assert "digest" in loaded.summary() and "stage 1 bwd" in loaded.summary()
    assert "Plan(kareus" in repr(loaded)
    assert not list(tmp_path.glob(".plan.json.*")), "the atomic write left a temporary file"


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
    (lambda d: d.pop("digest"), "digest"),
    (lambda d: d.update(gpu="tpu-v9"), "unknown GPU"),
    (lambda d: d["choices"][0].update(freq_mhz=1411), "not a supported SM clock"),
    (lambda d: d["choices"][0]["configs"]["fwd_mlp"].update(comm_sms=500),
     r"choices\[0\].configs.fwd_mlp.comm_sms: 500 is out of range"),
    (lambda d: d["choices"][0]["configs"]["fwd_mlp"].update(comm_sms=0), "comm_sms: 0"),
    (lambda d: d["choices"][0]["configs"]["fwd_mlp"].update(comm_sms=4.7),
     "comm_sms: 4.7 is not a whole number"),
    (lambda d: d["choices"][0]["configs"]["fwd_mlp"].update(comm_sms="4"),
     "not a whole number"),
    (lambda d: d["assignment"].pop("s0.m0.fwd"), "lacks computation"),
    (lambda d: d["assignment"].update({"s0.m0.fwd": 7}), "out of range"),
    (lambda d: d["assignment"].update({"bogus": 0}), "not a computation"),
    (lambda d: d.update(time_s=2.0), "energy_j"),
    (lambda d: d.update(workload=5), "workload: must be a JSON object"),
    (lambda d: d["choices"][0].pop("configs"), "lacks the key"),
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
    with pytest.raises(PlanError, match="is a folder"):
        Plan.load(tmp_path)


UNSPLIT = WORKLOAD.with_(nanobatches=1)


def _mixed_plan() -> Plan:
    """Forward computations split in the workload's 2 nanobatches, backward ones unsplit
    (the partition types of the workload with one nanobatch)."""
    sched = one_f_one_b(2, 2)
    fwd = build_partitions(WORKLOAD)
    bwd = build_partitions(UNSPLIT)
    choices = [
        MicrobatchChoice(freq_mhz=1410, nanobatches=2, configs={
            n: ScheduleConfig(1410, 4, fwd.types[n].slots[0].name) for n in fwd.counts["fwd"]}),
        MicrobatchChoice(freq_mhz=1200, nanobatches=1, configs={
            n: ScheduleConfig(1200, 16, None) for n in bwd.counts["bwd"]}),
    ]
    assignment = {c.key(): (0 if c.phase == "fwd" else 1) for c in sched.nodes}
    return Plan(gpu="a100-40gb", num_stages=2, num_microbatches=2, choices=choices,
                assignment=assignment, time_s=1.5, energy_j=900.0, dynamic_energy_j=600.0,
                static_power_w=200.0, label="kareus", workload=WORKLOAD.to_dict())


def test_a_mixed_plan_round_trips_with_each_choices_nanobatches(tmp_path):
    plan = _mixed_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    d = json.loads(path.read_text())
    assert [c["nanobatches"] for c in d["choices"]] == [2, 1]
    loaded = Plan.load(path)
    assert loaded == plan and loaded.digest == plan.digest
    assert loaded.nanobatches("s1.m0.fwd") == 2 and loaded.nanobatches("s0.m1.bwd") == 1
    assert loaded.nanobatch_counts == (2, 1)
    # each split's partition types: unsplit names without the nanobatched suffixes
    assert set(loaded.partition_configs(nanobatches=1)) == set(build_partitions(UNSPLIT).types)
    assert set(loaded.partition_configs(nanobatches=2)) == set(
        build_partitions(WORKLOAD).counts["fwd"])
    text = loaded.summary()
    assert "nanobatches per stage" in text and "stage 0 bwd  1: 2" in text
    assert "partition configurations, unsplit" in text
    assert "partition configurations, 2 nanobatches" in text
    assert "1200 MHz, unsplit [" in str(loaded.choices[1])


def test_an_old_plan_without_nanobatches_loads_with_its_digest_as_the_workloads_count():
    plan = _plan()  # choices that record no count, as plan files written before it
    d = plan.to_dict()
    assert all("nanobatches" not in c for c in d["choices"])
    loaded = Plan.from_dict(json.loads(json.dumps(d)))
    assert loaded.digest == d["digest"]
    assert all(c.nanobatches is None for c in loaded.choices)
    assert loaded.nanobatches("s0.m0.fwd") == WORKLOAD.nanobatches == 2
    assert loaded.nanobatch_counts == (2,)
    assert "nanobatches per stage" in loaded.summary()
    # without a workload the count is unknown: said, not guessed
    orphan = attrs.evolve(plan, workload=None)
    assert orphan.nanobatch_counts == ()
    with pytest.raises(PlanError, match="no nanobatch count for computation s0.m0.fwd"):
        orphan.nanobatches("s0.m0.fwd")


def test_a_plan_written_before_choices_had_nanobatches_loads_as_the_workloads():
    from pathlib import Path

    # the example's plan as it was before it was regenerated, kept for the measured runs
    path = Path(__file__).parents[2] / "bench" / "plans" / "llama3b_tp2_h200_measured.json"
    d = json.loads(path.read_text())
    assert all("nanobatches" not in c for c in d["choices"])  # written before the field
    plan = Plan.load(path)
    assert plan.digest == d["digest"]
    assert {plan.nanobatches(k) for k in plan.assignment} == {d["workload"]["nanobatches"]}


@pytest.mark.parametrize("n", [0, -1, True, 1.0, "1"])
def test_choice_nanobatches_must_be_a_positive_whole_number(n):
    with pytest.raises(ValueError, match="nanobatches"):
        MicrobatchChoice(freq_mhz=1410, configs={"a": ScheduleConfig(1410, 4, None)},
                         nanobatches=n)


def test_choice_rejects_mismatched_frequency():
    with pytest.raises(ValueError, match="runs at"):
        MicrobatchChoice(freq_mhz=1410, configs={"a": ScheduleConfig(1200, 4, None)})


# -- the corruption corpus ------------------------------------------------------------------
def _redigest(d):
    content = {k: v for k, v in d.items() if k != "digest"}
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
    d["digest"] = hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _set(*path, value):
    def fn(d, k):
        node = d
        for p in path[:-1]:
            node = node[p(k) if callable(p) else p]
        last = path[-1]
        node[last(k) if callable(last) else last] = value
    return fn


def _pop(*path):
    def fn(d, k):
        node = d
        for p in path[:-1]:
            node = node[p(k) if callable(p) else p]
        node.pop(path[-1](k) if callable(path[-1]) else path[-1])
    return fn


def _cfg_name(d, k):
    names = sorted(d["choices"][k % 2]["configs"])
    return names[k % len(names)]


def _on_config(field, value):
    def fn(d, k):
        d["choices"][k % 2]["configs"][_cfg_name(d, k)][field] = value
    return fn


def _drop_config(d, k):
    d["choices"][k % 2]["configs"].pop(_cfg_name(d, k))


def _extra_config(d, k):
    d["choices"][k % 2]["configs"]["fwd_zzz"] = {"comm_sms": 4, "launch_slot": None}


def _extra_choice(d, k):
    d["choices"].append(dict(d["choices"][0]))


def _swap_phase(d, k):
    key = sorted(d["assignment"])[k % len(d["assignment"])]
    d["assignment"][key] = 1 - d["assignment"][key]


def _wrong_slot(d, k):
    fwd = d["choices"][0]["configs"]
    names = sorted(fwd)
    fwd[names[k % len(names)]]["launch_slot"] = "no_such_slot"


def _slot_of_other_type(d, k):
    # the first slot of one partition type is generally not a slot of the next one
    pset = build_partitions(WORKLOAD)
    names = sorted(d["choices"][0]["configs"])
    a, b = names[k % len(names)], names[(k + 1) % len(names)]
    theirs = {s.name for s in pset.types[b].slots}
    mine = [s.name for s in pset.types[a].slots if s.name not in theirs]
    d["choices"][0]["configs"][b]["launch_slot"] = mine[0] if mine else "attn_nope"


#: Kinds of dict-level corruption: name -> fn(plan dict, integer parameter).
DICT_KINDS = {
    **{f"drop {key}": _pop(key) for key in (
        "version", "gpu", "schedule", "num_stages", "num_microbatches", "choices",
        "assignment", "time_s", "energy_j", "dynamic_energy_j", "static_power_w",
        "workload", "digest")},
    "unknown top-level key": _set("extra", value=1),
    "version 2": _set("version", value=2),
    "version as string": _set("version", value="1"),
    "version true": _set("version", value=True),
    "version float": _set("version", value=1.0),
    "digest garbage": _set("digest", value="xyz"),
    "digest number": _set("digest", value=5),
    "digest uppercase": lambda d, k: d.update(digest=d["digest"].upper()),
    "gpu unknown": _set("gpu", value="tpu-v9"),
    "gpu number": _set("gpu", value=5),
    "gpu null": _set("gpu", value=None),
    "schedule unknown": _set("schedule", value="zigzag"),
    "schedule number": _set("schedule", value=1),
    "num_stages 0": _set("num_stages", value=0),
    "num_stages 3": _set("num_stages", value=3),
    "num_stages string": _set("num_stages", value="2"),
    "num_stages float": _set("num_stages", value=2.0),
    "num_stages huge": _set("num_stages", value=10**12),
    "num_microbatches 1": _set("num_microbatches", value=1),
    "num_microbatches negative": _set("num_microbatches", value=-2),
    "num_microbatches true": _set("num_microbatches", value=True),
    "label number": _set("label", value=5),
    "label huge": _set("label", value="x" * 10_000),
    "workload number": _set("workload", value=5),
    "workload null": _set("workload", value=None),
    "workload list": _set("workload", value=[]),
    "workload tp 999": _set("workload", "tp", value=999),
    "workload tp 3": _set("workload", "tp", value=3),
    "workload cp 2 (other partition types)": _set("workload", "cp", value=2),
    "workload model unknown": _set("workload", "model", value="gpt-9"),
    "workload pp 4": _set("workload", "pp", value=4),
    "workload microbatches 3": _set("workload", "num_microbatches", value=3),
    "workload recompute string": _set("workload", "recompute", value="yes"),
    "workload recompute off": _set("workload", "recompute", value=False),
    "workload seq_len 0": _set("workload", "seq_len", value=0),
    "workload nanobatches 3": _set("workload", "nanobatches", value=3),
    "workload missing key": _pop("workload", "cp"),
    "workload extra key": _set("workload", "zz", value=1),
    "time_s negative": _set("time_s", value=-1.5),
    "time_s zero": _set("time_s", value=0),
    "time_s string": _set("time_s", value="1.5"),
    "time_s null": _set("time_s", value=None),
    "time_s huge": _set("time_s", value=1e300),
    "time_s beyond float range": _set("time_s", value=10**400),
    "energy_j beyond float range": _set("energy_j", value=-(10**400)),
    "time_s edited": _set("time_s", value=1.4),
    "energy_j negative": _set("energy_j", value=-900.0),
    "energy_j inconsistent": _set("energy_j", value=901.0),
    "energy_j list": _set("energy_j", value=[900.0]),
    "dynamic_energy_j negative": _set("dynamic_energy_j", value=-1.0),
    "static_power_w huge": _set("static_power_w", value=1e200),
    "static_power_w zero": _set("static_power_w", value=0.0),
    "choices empty": _set("choices", value=[]),
    "choices object": _set("choices", value={}),
    "choices string": _set("choices", value="x"),
    "choice unused": _extra_choice,
    "choice not an object": _set("choices", lambda k: k % 2, value=7),
    "choice freq unsupported": _set("choices", lambda k: k % 2, "freq_mhz", value=1411),
    "choice freq string": _set("choices", lambda k: k % 2, "freq_mhz", value="1410"),
    "choice freq float": _set("choices", lambda k: k % 2, "freq_mhz", value=1410.5),
    "choice freq negative": _set("choices", lambda k: k % 2, "freq_mhz", value=-1),
    "choice predicted string": _set("choices", lambda k: k % 2, "predicted", value="no"),
    "choice lacks predicted": _pop("choices", lambda k: k % 2, "predicted"),
    "choice extra key": _set("choices", lambda k: k % 2, "zz", value=0),
    "choice nanobatches 0": _set("choices", lambda k: k % 2, "nanobatches", value=0),
    "choice nanobatches string": _set("choices", lambda k: k % 2, "nanobatches", value="2"),
    "choice nanobatches float": _set("choices", lambda k: k % 2, "nanobatches", value=2.0),
    "choice nanobatches true": _set("choices", lambda k: k % 2, "nanobatches", value=True),
    # 2 sequences do not split in 3; unsplit, the nanobatched types are unknown
    "choice nanobatches 3 (no split)": _set("choices", lambda k: k % 2, "nanobatches",
                                             value=3),
    "choice nanobatches 1 with the nanobatched types": _set("choices", 0, "nanobatches",
                                                             value=1),
    "configs empty": _set("choices", lambda k: k % 2, "configs", value={}),
    "configs list": _set("choices", lambda k: k % 2, "configs", value=[]),
    "partition type missing": _drop_config,
    "partition type unknown": _extra_config,
    "computation of the wrong phase": _swap_phase,
    "comm_sms 0": _on_config("comm_sms", 0),
    "comm_sms 4.7": _on_config("comm_sms", 4.7),
    "comm_sms string": _on_config("comm_sms", "4"),
    "comm_sms 5000": _on_config("comm_sms", 5000),
    "comm_sms all SMs": _on_config("comm_sms", 108),
    "comm_sms null": _on_config("comm_sms", None),
    "launch_slot number": _on_config("launch_slot", 5),
    "launch_slot unknown": _wrong_slot,
    "launch_slot of another type": _slot_of_other_type,
    "config extra key": _on_config("zz", 1),
    "config not an object": lambda d, k: d["choices"][0]["configs"].update(
        {_cfg_name(d, 0): 4}),
    "assignment list": _set("assignment", value=[]),
    "assignment missing computation":
        lambda d, k: d["assignment"].pop(sorted(d["assignment"])[k % len(d["assignment"])]),
    "assignment unknown computation": _set("assignment", "s9.m0.fwd", value=0),
    "assignment bogus key": _set("assignment", "bogus", value=0),
    "assignment index out of range":
        lambda d, k: d["assignment"].update({sorted(d["assignment"])[0]: 2 + k}),
    "assignment index negative": lambda d, k: d["assignment"].update(
        {sorted(d["assignment"])[0]: -1}),
    "assignment index string": lambda d, k: d["assignment"].update(
        {sorted(d["assignment"])[0]: "0"}),
    "assignment index float": lambda d, k: d["assignment"].update(
        {sorted(d["assignment"])[0]: 0.5}),
    "assignment index true": lambda d, k: d["assignment"].update(
        {sorted(d["assignment"])[0]: True}),
}


def _text(d):
    return json.dumps(d, indent=1)


#: Kinds of byte-level corruption: name -> fn(valid file bytes, integer parameter) -> bytes.
BYTE_KINDS = {
    "empty file": lambda b, k: b"",
    "truncated": lambda b, k: b[: max(1, (k * 7919) % len(b))],
    "non-UTF-8 byte": lambda b, k: b[:10] + b"\xff\xfe" + b[10:],
    "latin-1 label": lambda b, k: b.replace(b'"kareus"', '"kar\xe9us"'.encode("latin-1")),
    "UTF-8 BOM": lambda b, k: b"\xef\xbb\xbf" + b,
    "NaN time": lambda b, k: b.replace(b'"time_s": 1.5', b'"time_s": NaN'),
    "Infinity static power": lambda b, k: b.replace(b'"static_power_w": 200.0',
                                                    b'"static_power_w": Infinity'),
    "JSON array": lambda b, k: b"[" + b + b"]",
    "JSON string": lambda b, k: b'"plan"',
    "JSON null": lambda b, k: b"null",
    "deeply nested": lambda b, k: b"[" * 100_000 + b"]" * 100_000,
    "over the size cap": lambda b, k: b[:-2] + b', "pad": "' + b"x" * PLAN_MAX_BYTES + b'"}\n',
    "binary noise": lambda b, k: bytes((i * 131 + k) % 256 for i in range(512)),
}


def test_the_corpus_has_at_least_fifty_kinds():
    assert len(DICT_KINDS) + len(BYTE_KINDS) >= 50


@pytest.mark.parametrize("kind", sorted(DICT_KINDS))
def test_each_dict_corruption_is_refused_with_digest_recomputed(kind, tmp_path):
    d = _plan().to_dict()
    DICT_KINDS[kind](d, 0)
    if "digest" in d and kind.split()[0] != "digest":
        _redigest(d)
    path = tmp_path / "plan.json"
    path.write_text(_text(d))
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg


@pytest.mark.parametrize("kind", sorted(BYTE_KINDS))
def test_each_byte_corruption_is_refused(kind, tmp_path):
    path = tmp_path / "plan.json"
    _plan().save(path)
    path.write_bytes(BYTE_KINDS[kind](path.read_bytes(), 3))
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(kinds=st.lists(st.sampled_from(sorted(DICT_KINDS)), min_size=1, max_size=3),
       k=st.integers(0, 50), redigest=st.booleans(), byte_kind=st.none() | st.sampled_from(
           sorted(set(BYTE_KINDS) - {"over the size cap", "deeply nested"})))
def test_random_corruptions_are_refused_without_traceback(kinds, k, redigest, byte_kind):
    d = _plan().to_dict()
    for kind in kinds:
        # an earlier corruption may have removed what this one edits: the plan stays corrupt
        with contextlib.suppress(KeyError, IndexError, TypeError, AttributeError):
            DICT_KINDS[kind](d, k)
    # a recomputed digest would undo a corruption of the digest itself (as in
    # test_each_dict_corruption_is_refused_with_digest_recomputed)
    digest_only = all(kind.split()[0] == "digest" for kind in kinds)
    if redigest and not digest_only and isinstance(d.get("digest"), str):
        _redigest(d)
    raw = _text(d).encode("utf-8")
    if byte_kind is not None:
        raw = BYTE_KINDS[byte_kind](raw, k)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None:
        return  # covered through files in test_each_byte_corruption_is_refused
    with pytest.raises(PlanError) as info:
        Plan.from_json(text, source="corrupt.json")
    assert "corrupt.json" in str(info.value) and "\n" not in str(info.value)


def test_a_real_plan_from_the_composer_validates(tmp_path):
    """A plan composed by the pipeline (not hand-built) passes every check."""
    from kareus.workflow import compose_systems
    from tests.compose.conftest import FakeProfiler

    wl = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=512,
                         num_microbatches=2)
    res = compose_systems(wl, FakeProfiler("a100-40gb"), systems=["megatron", "kareus"])
    for name, fr in res.frontiers.items():
        for point in (fr.points[0], fr.points[-1]):
            path = tmp_path / f"{name}.json"
            point.plan.save(path)
            assert Plan.load(path) == point.plan
