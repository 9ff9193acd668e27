"""What an executor reads of a plan: the nanobatches of each microbatch computation."""

from __future__ import annotations

import attrs
import pytest

from kareus.compose import MicrobatchChoice, Plan
from kareus.errors import PlanError
from kareus.exec.plan_lookup import plan_config, plan_frequency, plan_nanobatches
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.pipeline import one_f_one_b
from kareus.model.workload import Workload
from kareus.workflow import compose_systems, exhaustive_search

WL = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                     num_microbatches=2)


def _plan(*, fwd_nanobatches: int | None, workload: Workload | None = WL) -> Plan:
    """Forward computations as ``fwd_nanobatches`` says (None: not recorded, as plan
    files written before the field), backward ones unsplit."""
    fwd_split = WL if fwd_nanobatches in (None, WL.nanobatches) else \
        WL.with_(nanobatches=fwd_nanobatches)
    fwd = build_partitions(fwd_split)
    bwd = build_partitions(WL.with_(nanobatches=1))
    choices = [
        MicrobatchChoice(freq_mhz=1410, nanobatches=fwd_nanobatches, configs={
            n: ScheduleConfig(1410, 4, None) for n in fwd.counts["fwd"]}),
        MicrobatchChoice(freq_mhz=1200, nanobatches=1, configs={
            n: ScheduleConfig(1200, 8, None) for n in bwd.counts["bwd"]}),
    ]
    sched = one_f_one_b(2, 2)
    return Plan(gpu="a100-40gb", num_stages=2, num_microbatches=2, choices=choices,
                assignment={c.key(): int(c.phase == "bwd") for c in sched.nodes},
                time_s=1.0, energy_j=300.0, dynamic_energy_j=100.0, static_power_w=200.0,
                label="kareus", workload=None if workload is None else workload.to_dict())


def test_plan_nanobatches_per_computation():
    plan = Plan.from_json(_plan(fwd_nanobatches=2).to_json())  # as a plan file reads back
    assert plan_nanobatches(plan, 0, 1, "fwd") == 2
    assert plan_nanobatches(plan, 1, 0, "bwd") == 1
    assert plan_frequency(plan, 1, 0, "bwd") == 1200
    # the unsplit computation's partition types are those of the unsplit workload
    assert plan_config(plan, "bwd_mlp", (1, 0, "bwd")) == ScheduleConfig(1200, 8, None)
    assert plan_config(plan, "fwd_mlp", (1, 0, "bwd")).freq_mhz == 1200


def test_a_choice_without_a_count_runs_the_workloads():
    plan = Plan.from_json(_plan(fwd_nanobatches=None).to_json())
    assert plan_nanobatches(plan, 0, 0, "fwd") == WL.nanobatches == 2
    assert plan_nanobatches(plan, 0, 0, "bwd") == 1
    orphan = _plan(fwd_nanobatches=None, workload=None)
    with pytest.raises(PlanError, match="no nanobatch count"):
        plan_nanobatches(orphan, 0, 0, "fwd")
    assert plan_nanobatches(orphan, 0, 0, "bwd") == 1  # recorded: no workload needed


def test_bad_arguments():
    plan = _plan(fwd_nanobatches=2)
    with pytest.raises(PlanError, match="no computation s0.m7.fwd"):
        plan_nanobatches(plan, 0, 7, "fwd")
    with pytest.raises(TypeError, match="kareus.compose.Plan"):
        plan_nanobatches(attrs.asdict(plan), 0, 0, "fwd")  # type: ignore[arg-type]


def test_a_composed_kareus_plan_gives_every_computation_a_count():
    from tests.compose.conftest import FakeProfiler

    def search(p, part):
        return exhaustive_search(p, ConfigSpace(part, p.gpu, freqs_mhz=p.gpu.search_clocks_mhz[::4],
                                                comm_sms=[4, 32]))

    res = compose_systems(WL, FakeProfiler(), search=search, systems=["kareus"])
    for pt in res["kareus"].points:
        counts = {plan_nanobatches(pt.plan, c.stage, c.microbatch, c.phase)
                  for c in one_f_one_b(2, 2).nodes}
        assert counts <= {1, 2} and counts == set(pt.plan.nanobatch_counts)
