"""The training loop's mixture-of-experts layer on one GPU (kareus.exec.train, CUDA streams,
the default kernel set).

* TP = CP = EP = 1, float32 on the GPU's kernels (the grouped GEMMs' loop path in float32):
  the losses, every gradient and the weights after two AdamW steps equal the float64
  reference of tests/exec/test_train_moe.py (float32: in bf16 a token whose two logits lie
  within its rounding could be routed to other experts than the reference's);
* EP=2 over CP=2 stood in for by the loopback (one GPU), bf16 (the grouped GEMMs on
  ``torch._grouped_mm`` where the GPU has it): every schedule runs eagerly (a mixture of
  experts is not graph-captured), the plan's all-to-alls run on the side stream with its
  SM count, the loss is finite and falls; the step time of each schedule is printed;
* ``graphs=True`` is refused in one line.

Skipped without torch or without CUDA.
"""

from __future__ import annotations

import math
import time

import pytest

torch = pytest.importorskip("torch")

from test_train_moe import (
    _check_against_reference,
    _one_process,
    moe_workload,
)

from kareus.errors import WorkloadError
from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives
from kareus.model.moe import MoEArch
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.testing import make_workload_plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kernels", [None, "torch"])  # the default set, and plain torch
@pytest.mark.parametrize(("recompute", "shared"), [("none", True), ("full", False)])
def test_float32_moe_loop_on_the_gpu_matches_autograd(recompute, shared, kernels):
    wl = moe_workload(recompute=recompute, shared=shared)
    _check_against_reference([_one_process(wl, device="cuda", kernels=kernels)], wl,
                             ("sequential", "nanobatching"))


def _bench_workload() -> Workload:
    moe = MoEArch(experts=8, experts_per_token=2, expert_ffn=512)
    m = ModelArch(name="small-moe", layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                  ffn=1024, vocab=1000, moe=moe)
    return Workload(model=m, parallelism=Parallelism(tp=1, cp=2, ep=2), microbatch_size=4,
                    seq_len=256, num_microbatches=2, nanobatches=2, recompute="none")


def test_bf16_loopback_ep_loop_runs_every_schedule_eagerly():
    wl = _bench_workload()
    groups = LoopbackGroups(tp=1, cp=2, ep=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=make_workload_plan(wl), lr=1e-2)
    assert not loop.graphs  # a mixture of experts runs eagerly
    for s in loop.schedules:
        loop.reset()
        losses = [float(loop.step(s)) for _ in range(4)]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (s, losses)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            loop.step(s)
        torch.cuda.synchronize()
        print(f"{s}: {1e3 * (time.perf_counter() - t0) / 5:.2f} ms/iteration "
              "(loopback EP=2 stand-in, eager)")
    calls = [c for c in capped.ep.calls if c[0] == "all_to_all"]
    assert calls and any(sms == 8 for _, _, sms in calls)


def test_graphs_are_refused_for_moe():
    with pytest.raises(WorkloadError, match="graphs=False"):
        TrainingLoop(workload=moe_workload(), groups=LoopbackGroups(tp=1), graphs=True)
