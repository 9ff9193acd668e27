"""A plan made for a qk-norm model before its query/key norms ran fused with RoPE names
launch slots its layer no longer has (``q_norm``, ``rope_bwd``): it is refused on load in
one line that names the slot and says to make the plan again."""

from __future__ import annotations

import copy

import pytest

from kareus.compose.plan import Plan
from kareus.errors import PlanError
from kareus.model.workload import Workload
from kareus.workflow import optimize


@pytest.fixture(scope="module")
def plan_dict() -> dict:
    wl = Workload.preset("qwen3-1.7b", tp=2, cp=2, pp=1, microbatch_size=2, seq_len=1024,
                         num_microbatches=2)
    assert wl.model.qk_norm
    return optimize(wl, "h200-sxm", budget=8, seed=3, progress=False).select().to_dict()


def _set_slot(d: dict, type_prefix: str, slot: str) -> str:
    for ch in d["choices"]:
        for name, cfg in ch["configs"].items():
            if name.startswith(type_prefix):
                cfg["launch_slot"] = slot
                return name
    raise AssertionError(type_prefix)


@pytest.mark.parametrize(("prefix", "old"), [("fwd_attn_in", "q_norm"),
                                             ("bwd_attn_in", "rope_bwd")])
def test_a_plan_with_the_unfused_slots_is_refused_in_one_line(plan_dict, prefix, old):
    d = copy.deepcopy(plan_dict)
    assert Plan.from_dict(d).digest == d["digest"]  # as made: loads
    name = _set_slot(d, prefix, old)
    with pytest.raises(PlanError) as err:
        Plan.from_dict(d)
    msg = str(err.value)
    assert "\n" not in msg and f"{name}.launch_slot: {old!r} is not a launch slot" in msg
    assert "qk_norm_rope" in msg and "make it again" in msg


def test_another_unknown_slot_gets_no_such_hint(plan_dict):
    d = copy.deepcopy(plan_dict)
    _set_slot(d, "fwd_attn_in", "swiglu")
    with pytest.raises(PlanError, match="is not a launch slot") as err:
        Plan.from_dict(d)
    assert "make it again" not in str(err.value)
