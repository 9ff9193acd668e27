"""The training loop with nanobatches along the sequence on one GPU (production kernels,
CUDA streams, graphed by default): chunk ``j``'s attention over chunks ``0..j`` through the
flash op's lower-right causal attention, the backward's chunks last first.

* TP = CP = 1: loss and gradients of the bf16 loop against the float64 autograd reference
  on the CPU (selective and no recomputation; full needs a collective: refused there);
* TP = 2 stood in for by the loopback collective: the three schedules (kareus under a plan
  with per-chunk types) give the same losses within bf16 rounding, at every policy.

Skipped without torch or without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _helpers import cuda_marks, small_workload
from test_train_loop import assert_bf16_step, losses_by_schedule, plan_for, step_reference

from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives
from kareus.model.workload import Workload

pytestmark = cuda_marks()


def workload(tp: int, recompute: str, n: int = 2) -> Workload:
    return small_workload(tp, mbs=1, seq=512, n=n, recompute=recompute)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("recompute", ["selective", "none"])
def test_bf16_loop_along_the_sequence_matches_autograd(recompute, n):
    wl = workload(1, recompute, n)
    assert wl.sequence_split
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1), lr=1e-3)
    m = loop.model
    params = {k: v.detach().float().cpu() for k, v in m.params.items()}
    ref_loss, ref = step_reference(loop, params)  # (one sequence a microbatch)
    for schedule in ("sequential", "nanobatching"):
        loop.reset()
        loss = float(loop.step(schedule))
        assert_bf16_step(loss, m.grads, ref_loss, ref, schedule)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_loopback_tp2_schedules_along_the_sequence_agree(recompute):
    wl = workload(2, recompute)
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan_for(wl, sms=8), lr=1e-3)
    losses = losses_by_schedule(loop, 3)
    for s in ("nanobatching", "kareus"):
        assert losses[s] == pytest.approx(losses["sequential"], rel=1e-2), (s, losses)
    assert losses["sequential"][-1] < losses["sequential"][0]
