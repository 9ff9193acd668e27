"""Planned layers with nanobatches along the sequence on one GPU (production kernels, the
applier's own CUDA graphs by default): chunk ``j``'s attention over chunks ``0..j`` through
the flash op's lower-right causal attention, the backward's chunks last first.

* TP = CP = 1, bf16: output and every gradient against the float32 reference of the
  whole layer, about as close as PyTorch's own bf16 autograd (selective and no
  recomputation; full needs a collective there: refused);
* TP = 2 stood in for by the loopback collective under a plan (one microbatch unsplit):
  every schedule computes the same function at every recomputation policy.

Skipped without torch or without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers import assert_as_close_as_torch, cuda_marks, rel_error, small_workload
from _reference import full_weights, layer, planned_weights, shard

from kareus.exec.train import LoopbackGroups, make_collectives
from kareus.integrations import PlanApplier
from kareus.model.workload import Workload
from kareus.testing import make_workload_plan

pytestmark = cuda_marks()


def workload(tp: int, recompute: str, n: int = 2) -> Workload:
    return small_workload(tp, mbs=1, seq=1024, n=n, recompute=recompute)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("recompute", ["selective", "none"])
@pytest.mark.parametrize("how", ["layers", "stack"])
def test_bf16_planned_layers_along_the_sequence_match_the_reference(how, recompute, n):
    wl = workload(1, recompute, n)
    assert wl.sequence_split
    arch = wl.model
    dev = torch.device("cuda")
    fulls = [{k: v.to(dev, torch.bfloat16).float() for k, v in full_weights(arch, s).items()}
             for s in (1, 2)]
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, wl.seq_len, arch.hidden, generator=g).to(dev, torch.bfloat16).float()
    c = torch.randn(1, wl.seq_len, arch.hidden, generator=g).to(dev)

    def torch_layers(xin, dtype):
        ps = [{k: v.detach().to(dtype).requires_grad_(True) for k, v in f.items()}
              for f in fulls]
        xi = xin.detach().to(dtype).requires_grad_(True)
        y = xi
        for p in ps:
            y = layer(y, p, arch)
        (y.float() * c).sum().backward()
        return y, xi, ps

    yr, xr, pr = torch_layers(x, torch.float32)
    yt, xt, pt = torch_layers(x, torch.bfloat16)
    ps = [{k: v.detach().to(torch.bfloat16).requires_grad_(True) for k, v in f.items()}
          for f in fulls]
    xb = x.detach().to(torch.bfloat16).requires_grad_(True)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                          eps=arch.norm_eps)
    ws = [planned_weights(p, arch) for p in ps]
    for _ in range(2):  # the first call eager, the second from the applier's graphs
        for p in ps:
            for v in p.values():
                v.grad = None
        xb.grad = None
        if how == "stack":
            y = applier.stack(2)(xb, ws)
        else:
            y = xb
            for w in ws:
                y = applier.layer()(y, w)
        (y.float() * c).sum().backward()
        assert_as_close_as_torch(y, yt, yr, "output")
        assert_as_close_as_torch(xb.grad, xt.grad, xr.grad, "input gradient")
        for p, p_t, p_r in zip(ps, pt, pr, strict=True):
            for k in p:
                assert_as_close_as_torch(p[k].grad, p_t[k].grad, p_r[k].grad, k)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_loopback_tp2_plan_along_the_sequence_runs_every_schedule_alike(recompute):
    wl = workload(2, recompute)
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    plan = make_workload_plan(wl, sms=16, freqs_mhz=(1980, 1410), unsplit_microbatches=(1,))
    p = {k: v.to("cuda", torch.bfloat16).requires_grad_(True)
         for k, v in shard(full_weights(wl.model, 1), wl.model, 2, 0).items()}
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, wl.seq_len, wl.model.hidden, generator=g).to("cuda", torch.bfloat16)
    got = {}
    for schedule in ("sequential", "nanobatching", "kareus"):
        applier = PlanApplier(workload=wl, groups=groups, collective=capped,
                              default_collective=default, schedule=schedule,
                              plan=plan if schedule == "kareus" else None,
                              eps=wl.model.norm_eps)
        outs = []
        for mb in range(wl.num_microbatches):
            xb = x.clone().requires_grad_(True)
            for v in p.values():
                v.grad = None
            with applier.microbatch(mb, "fwd"):
                y = applier.layer()(xb, planned_weights(p, wl.model))
            with applier.microbatch(mb, "bwd"):
                y.float().sum().backward()
            outs.append((y.detach(), xb.grad.clone(), p["wq"].grad.clone()))
        got[schedule] = outs
    for s in ("nanobatching", "kareus"):
        for a, b in zip(got[s], got["sequential"], strict=True):
            for u, v in zip(a, b, strict=True):
                assert rel_error(u, v) < 2e-2, s
