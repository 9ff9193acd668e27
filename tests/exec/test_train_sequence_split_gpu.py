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

from test_train_loop import plan_for, reference

from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives
from kareus.model.workload import ModelArch, Parallelism, Workload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def workload(tp: int, recompute: str, n: int = 2) -> Workload:
    m = ModelArch(name="small", layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                  ffn=1024, vocab=1000)
    return Workload(model=m, parallelism=Parallelism(tp=tp), microbatch_size=1,
                    seq_len=512, num_microbatches=2, nanobatches=n, recompute=recompute)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("recompute", ["selective", "none"])
def test_bf16_loop_along_the_sequence_matches_autograd(recompute, n):
    wl = workload(1, recompute, n)
    assert wl.sequence_split
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1), lr=1e-3)
    m = loop.model
    params = {k: v.detach().float().cpu() for k, v in m.params.items()}
    batches = [(t.cpu(), lab.cpu()) for t, lab in loop.batches]
    ref_loss, (ref,) = reference([params], wl.model, loop.layers, batches,
                                 wl.num_microbatches * wl.seq_len)
    for schedule in ("sequential", "nanobatching"):
        loop.reset()
        loss = float(loop.step(schedule))
        assert loss == pytest.approx(ref_loss, rel=5e-3), schedule
        for k, g in m.grads.items():
            r = ref[k].double()
            err = float((g.double().cpu() - r).norm() / max(float(r.norm()), 1e-12))
            assert err < 3e-2, (schedule, k, err)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_loopback_tp2_schedules_along_the_sequence_agree(recompute):
    wl = workload(2, recompute)
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan_for(wl, sms=8), lr=1e-3)
    losses = {}
    for s in loop.schedules:
        loop.reset()
        losses[s] = [float(loop.step(s)) for _ in range(3)]
    for s in ("nanobatching", "kareus"):
        assert losses[s] == pytest.approx(losses["sequential"], rel=1e-2), (s, losses)
    assert losses["sequential"][-1] < losses["sequential"][0]
