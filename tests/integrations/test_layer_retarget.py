"""The planned layer's plan moved along its frontier (PlanApplier.retarget) and measured
against its prediction in a user's own loop (PlanApplier.measure), on the CPU with the
recording executor.

Skipped without torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch")

from kareus.compose import IterationFrontier, IterationPoint
from kareus.errors import ArgumentError, PlanError
from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier
from kareus.testing import RecordingExecutor, make_workload_plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _reference import full_weights, planned_weights, shard, workload


def _frontier(wl):
    pts = []
    for freq, t, e in ((1980, 1.0, 10.0), (1410, 1.6, 8.0)):
        plan = attrs.evolve(make_workload_plan(wl, sms=12 if freq == 1980 else 6,
                                               freqs_mhz=(freq,)),
                            time_s=t, energy_j=e, dynamic_energy_j=e - 2.0 * t,
                            static_power_w=2.0)
        pts.append(IterationPoint(time_s=t, energy_j=e, plan=plan))
    return IterationFrontier(points=pts, label="kareus")


def _iteration(applier, planned, ws, x, microbatches=2):
    for mb in range(microbatches):
        with applier.microbatch(mb, "fwd"):
            y = planned(x, ws)
        with applier.microbatch(mb, "bwd"):
            y.sum().backward()


def test_retarget_moves_the_applier_to_the_point_and_keeps_its_executors():
    torch.set_num_threads(1)
    wl = workload(2, 2)
    arch = wl.model
    fr = _frontier(wl)
    logs = {}

    def recording(plan):
        ex = RecordingExecutor(plan=plan)
        logs[plan.digest] = ex.log
        return ex

    first = recording(fr.points[0].plan)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2), executor=first,
                          baseline=RecordingExecutor(), kernels="torch")
    p = {k: torch.nn.Parameter(v) for k, v in shard(full_weights(arch, 1), arch, 2, 0).items()}
    ws = planned_weights(p, arch)
    x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden, requires_grad=True)
    planned = applier.layer()
    _iteration(applier, planned, ws, x)
    with pytest.raises(ArgumentError, match="executor_for"):
        applier.retarget(deadline_s=2.0, frontier=fr)  # given its executor: how to build?
    plan = applier.retarget(deadline_s=2.0, frontier=fr, executor_for=recording)
    assert plan is fr.points[1].plan and applier.plan is plan
    _iteration(applier, planned, ws, x)
    slow = logs[plan.digest]
    assert {e[4] for e in slow if e[0] == "microbatch"} == {1410}
    assert {e[3] for e in slow if e[0] == "collective"} == {6}
    applier.retarget(stage_slowdown={0: 1.0})  # back: the first executor, kept
    assert applier.executor is first and applier.frontier_switch.built == 1
    with applier.microbatch(0, "fwd"), pytest.raises(PlanError, match="between iterations"):
        applier.retarget(deadline_s=2.0)


def test_measure_compares_a_users_loop_with_the_plan():
    wl = workload(2, 2)
    plan = attrs.evolve(make_workload_plan(wl, sms=12), time_s=0.5, energy_j=400.0,
                        dynamic_energy_j=200.0, static_power_w=400.0)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2),
                          executor=RecordingExecutor(plan=plan), baseline=RecordingExecutor(),
                          kernels="torch")

    class Meter:  # 250 W on the one GPU read
        def energy_between(self, t0, t1):
            return 250.0 * (t1 - t0), t1 - t0, 3

    now = [0.0]
    with applier.measure(meter=Meter(), warmup=1, clock=lambda: now[0],
                         synchronize=lambda: None) as check:
        for _ in range(5):
            now[0] += 0.55
            check.step()
    rep = check.report
    (row,) = rep.systems
    assert row.measured_time_s == pytest.approx(0.55)
    # one GPU read, the job's 4 GPUs: 250 W x 0.55 s x 4; static: the plan's 400 W (the
    # job's) x the measured time
    assert row.measured.total_j == pytest.approx(550.0)
    assert row.measured.static_j == pytest.approx(400.0 * 0.55)
    assert row.measured.dynamic_j == pytest.approx(550.0 - 220.0)
    assert row.ratios()["time_s"] == pytest.approx(1.1)
    assert row.energy_method == "Meter.energy_between" and row.iterations == 4
    assert row.ratios()["total_j"] == pytest.approx(550.0 / 400.0)
    assert not rep.passed and row.within(0.4) and not row.within(0.3)
    assert "kareus" in rep.table() and rep.to_dict()["systems"]["kareus"]["ratios"]
    bare = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2),
                       baseline=RecordingExecutor(), kernels="torch")
    with pytest.raises(PlanError, match="plan="):
        bare.measure()


def test_graphed_layers_capture_each_point_once_and_replay_it_on_return():
    """With graphs (the CPU stand-in executor of test_layer_graphs, whose graphs re-run
    their bodies): a point's computations are captured by its own executor once; back on a
    point used before, its graphs replay (no capture), with its SM counts."""
    from test_layer_graphs import RerunExecutor, _run

    from kareus.exec.train import make_collectives

    torch.set_num_threads(1)
    wl = workload(tp=1, cp=2)
    fr = _frontier(wl)
    groups = LoopbackGroups(tp=1, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")

    def rerun(plan):
        return RerunExecutor(collective=capped, default_collective=default, plan=plan)

    first = rerun(fr.points[0].plan)
    applier = PlanApplier(workload=wl, groups=groups, executor=first, kernels="torch",
                          baseline=RerunExecutor(collective=default,
                                                 default_collective=default),
                          graphs=True, record=True)
    params = [{k: torch.nn.Parameter(v) for k, v in full_weights(wl.model, 1).items()}]
    xs = [torch.randn(4, 8, wl.model.hidden, generator=torch.Generator().manual_seed(s))
          for s in (0, 1)]

    def sms_run() -> set[int]:
        applier.partitions_run.clear()
        _run(applier, params, xs, plan=True)
        return {cfg.comm_sms for _, _, cfg in applier.partitions_run}

    # twice per point: a layer's own graphs are captured once its weights come back at
    # the same address (the runner's rule), so the second run reaches the steady state
    assert sms_run() == {12} and sms_run() == {12}
    captured = len(first.captured)
    assert captured > 0
    applier.retarget(deadline_s=2.0, frontier=fr, executor_for=rerun)
    # the slow point's graphs, captured by its own executor
    assert sms_run() == {6} and sms_run() == {6}
    second = applier.executor
    assert second is not first and len(second.captured) > 0
    n2 = len(second.captured)
    applier.retarget(deadline_s=1.0)
    assert applier.executor is first and sms_run() == {12} and sms_run() == {12}
    assert len(first.captured) == captured and len(second.captured) == n2  # replayed
    applier.retarget(deadline_s=2.0)
    assert sms_run() == {6} and sms_run() == {6}
    assert len(first.captured) == captured and len(second.captured) == n2
