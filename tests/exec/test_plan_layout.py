"""A plan is for one TP layout: one made for sequence parallelism is refused for the
all-reduce layout and the other way round, in one line, wherever a plan meets a job."""

from __future__ import annotations

import attrs
import pytest

from kareus.errors import PlanError
from kareus.exec.train import check_plan_workload
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.testing import make_workload_plan


def _wl(tp: int, sp: bool) -> Workload:
    m = ModelArch(name="tiny", layers=2, hidden=64, heads=8, kv_heads=4, head_dim=8, ffn=128,
                  vocab=101)
    return Workload(model=m, parallelism=Parallelism(tp=tp, cp=2, sp=sp), microbatch_size=4,
                    seq_len=16, num_microbatches=2)


@pytest.mark.parametrize("made_sp", [False, True])
def test_a_plan_for_one_tp_layout_is_refused_for_the_other(made_sp):
    plan = make_workload_plan(_wl(2, made_sp))
    assert plan.workload["sp"] is made_sp
    check_plan_workload(plan, _wl(2, made_sp), one_stage=False)
    with pytest.raises(PlanError, match=f"sp: plan {made_sp}, job {not made_sp}") as err:
        check_plan_workload(plan, _wl(2, not made_sp), one_stage=False)
    assert "\n" not in str(err.value)


def test_sequence_parallelism_at_tp1_is_the_plain_layout():
    plan = make_workload_plan(_wl(1, True))
    check_plan_workload(plan, _wl(1, False), one_stage=False)
    # a plan written before plans recorded the layout is for the all-reduce layout
    legacy = make_workload_plan(_wl(2, False))
    old = {k: v for k, v in legacy.workload.items() if k != "sp"}
    legacy = attrs.evolve(legacy, workload=old)
    check_plan_workload(legacy, _wl(2, False), one_stage=False)
    with pytest.raises(PlanError, match="sp: plan False, job True"):
        check_plan_workload(legacy, _wl(2, True), one_stage=False)
