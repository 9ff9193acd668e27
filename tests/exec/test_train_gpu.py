"""The library's training loop on one GPU (kareus.exec.train), production kernels, CUDA streams.

* TP = CP = 1: loss and gradients of the bf16 loop on the GPU's fused kernels (graphed),
  at every recomputation policy, against a float64 autograd reference of the same model
  on the CPU;
* TP=2 x CP=2 stood in for by the loopback collective: the three schedules give the same
  losses (within bf16 rounding), the loss falls, every collective of the kareus schedule
  ran on the side stream with the plan's SM count, and the energy meter and
  ``measure_runs`` work end to end.

Skipped without torch or without CUDA.
"""

from __future__ import annotations

import attrs
import pytest

torch = pytest.importorskip("torch")

from _helpers import cuda_marks, small_workload
from test_train_loop import assert_bf16_step, losses_by_schedule, plan_for, step_reference

from kareus.exec.train import (
    LoopbackGroups,
    TrainingLoop,
    make_collectives,
    measure_runs,
    shuffled_order,
)
from kareus.model.workload import Workload

pytestmark = cuda_marks()


def workload(tp: int, cp: int, recompute: bool | str = True, sp: bool = False) -> Workload:
    return small_workload(tp, cp, sp=sp, seq=256, recompute=recompute)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
@pytest.mark.parametrize("schedule", ["sequential", "nanobatching"])
def test_bf16_loop_on_fused_kernels_matches_autograd(schedule, recompute):
    wl = workload(1, 1, recompute)  # graphed (the default on a GPU)
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1), lr=1e-3)
    m = loop.model
    params = {k: v.detach().float().cpu() for k, v in m.params.items()}
    loss = float(loop.step(schedule))
    assert_bf16_step(loss, m.grads, *step_reference(loop, params))


@pytest.mark.parametrize("tp,cp,sp", [(2, 1, False), (2, 2, False), (2, 1, True),
                                      (2, 2, True)])
def test_loopback_schedules_on_cuda_streams(tp, cp, sp):
    # sp: sequence parallelism (TP all-gathers and reduce-scatters on the TP loopback,
    # eager and from CUDA graphs, the default on a GPU)
    wl = workload(tp, cp, sp=sp)
    groups = LoopbackGroups(tp=tp, cp=cp)
    capped, default, _ = make_collectives(groups, backend="loopback")
    plan = plan_for(wl, sms=8)
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan, lr=1e-2)
    losses = {}
    for s in loop.schedules:
        loop.reset()
        for b in (capped.tp, capped.cp):
            if b is not None:
                b.calls.clear()
        losses[s] = [float(loop.step(s)) for _ in range(4)]
        if s == "kareus":  # the plan's SM count on every collective of the chain
            sms = [c[2] for b in (capped.tp, capped.cp) if b is not None for c in b.calls]
            assert sms and set(sms) == {8}
    ref = losses["sequential"]
    for s, got in losses.items():
        assert all(torch.isfinite(torch.tensor(got))), s
        assert got == pytest.approx(ref, rel=2e-2), s
    assert ref[-1] < ref[0]
    if sp:  # the TP collectives of the layout ran on the TP group's backend
        assert {c[0] for c in capped.tp.calls} == {"all_gather", "reduce_scatter"}
    if loop.graphs:  # graphed and eager run the same computation
        loop.graphs = False
        loop.reset()
        eager = [float(loop.step("sequential")) for _ in range(4)]
        assert eager == pytest.approx(ref, rel=2e-2)


@pytest.mark.parametrize("mbs", [1, 2])
def test_loopback_one_nanobatch_runs_every_schedule_as_sequential(mbs):
    # At one nanobatch the ops after a collective read it: the nanobatching and kareus
    # schedules once paired them with it, so on CUDA streams they read it while it ran
    # (1x H200: losses 6.9907 / 5.2171 / 3.2119 / 1.4400 against the sequential
    # schedule's 6.9838 / 5.3827 / 3.5988 / 2.1318 at TP=2 loopback, lr 1e-3). Now every
    # schedule runs as the sequential one: the same kernels in the same order.
    wl = attrs.evolve(workload(2, 1, "selective"), microbatch_size=mbs, seq_len=512,
                      nanobatches=1)
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan_for(wl, sms=8), lr=1e-3)
    losses = losses_by_schedule(loop, 4)
    ref = losses["sequential"]
    assert ref[-1] < ref[0]
    assert losses["nanobatching"] == pytest.approx(ref, rel=1e-3)
    assert losses["kareus"] == pytest.approx(ref, rel=2e-3)


def test_measure_runs_with_the_energy_meter():
    pytest.importorskip("pynvml")
    from kareus.profilers.nvml import EnergyMeter

    wl = workload(2, 1)
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan_for(wl))
    with EnergyMeter() as meter:
        recs = measure_runs(loop, shuffled_order(loop.schedules, 1, 0), steps=40, warmup=2,
                            meter=meter)
    for r in recs:
        # 40 iterations or more: the window lasts >= 0.5 s for the counter to step in it
        assert len(r.step_time_s) >= 40 and all(t > 0 for t in r.step_time_s)
        assert r.window_s >= 0.5 and r.window_s >= sum(r.step_time_s) * 0.9
        assert r.counter_steps >= 2 and r.energy_method == "nvml_counter"
        assert r.energy_j is not None and r.energy_j > 0
