"""Planned layers run one by one under a workload of unchained layers
(``Workload.chained_layers=False``): what runs is what the plan costs.

One process stands in for the TP (x CP, x EP) group on the recording executor, for dense
layers and for mixture-of-experts layers (test_layer_moe's tiny model: the expert-parallel
all-to-alls, the forward's un-permutation after the combine, a shared expert). Per computation of
one planned layer, the partitions run (their keys, their ops) are the partition types and
counts of ``build_partitions`` (per layer), the collectives that run exposed are the
unchained partition set's exposed collectives (in its outside work), at their own CTA count
as it costs them, and the ops run outside any partition are its bare computation. A stack
of such layers is refused.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kareus.errors import WorkloadError
from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier
from kareus.model import build_partitions
from kareus.model.workload import Parallelism
from kareus.testing import RecordingExecutor, make_workload_plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _reference import full_weights, planned_weights, shard, workload
from test_layer_moe import _kareus as moe_planned
from test_layer_moe import local_moe, moe_weights
from test_layer_moe import workload as moe_workload

CASES = {  # name: (tp, cp, sp, recompute[, microbatch size: 1 splits along the sequence])
    "tp2-none": (2, 1, False, "none"),
    "tp2-seqsplit-selective": (2, 1, False, "selective", 1),
    "tp2-selective": (2, 1, False, "selective"),
    "tp2-full": (2, 1, False, "full"),
    "tp2-sp-none": (2, 1, True, "none"),
    "tp2-sp-full": (2, 1, True, "full"),
    "tp2-cp2-full": (2, 2, False, "full"),
}


def _unchained(tp, cp, sp, recompute, mbs=4, n=2):
    wl = workload(tp, cp, recompute=recompute, n=n, mbs=mbs)
    return wl.with_(parallelism=Parallelism(tp=tp, cp=cp, sp=sp), chained_layers=False)


def _one_layer(wl, plan):
    """One planned layer's forward and backward of microbatch 0: the recording executor's
    log per computation."""
    arch = wl.model
    p = wl.parallelism
    dense = shard(full_weights(arch, 1), arch, p.tp, 0)
    if arch.moe is None:
        ws = planned_weights({k: torch.nn.Parameter(v) for k, v in dense.items()}, arch)
    else:  # the attention's weights and this EP rank's experts (test_layer_moe's layout)
        ps = {k: torch.nn.Parameter(v) for k, v in dense.items() if k not in ("w1", "w2", "w3")}
        ps |= {k: torch.nn.Parameter(v) for k, v in local_moe(
            moe_weights(arch, 1), p.ep, 0).items()}
        ws = moe_planned(ps, arch)
    seq = wl.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
    x = torch.randn(wl.microbatch_size, seq, arch.hidden, requires_grad=True)
    ex = RecordingExecutor(plan=plan)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=p.tp, cp=p.cp, ep=p.ep,
                                                             dp=p.dp),
                          executor=ex, baseline=RecordingExecutor(), kernels="torch",
                          eps=arch.norm_eps)
    with applier.microbatch(0, "fwd"):
        y = applier.layer()(x, ws)
    start = len(ex.log)
    with applier.microbatch(0, "bwd"):
        y.sum().backward()
    return {"fwd": ex.log[:start], "bwd": ex.log[start:]}, applier


def _partitions(log):
    """``[(key, config, ops run in it, collectives launched)]`` of one computation."""
    out = []
    for e in log:
        if e[0] == "partition":
            out.append([e[1], e[2], [], []])
        elif e[0] == "op" and out:
            out[-1][2].append(e[2])
        elif e[0] == "collective" and out:
            out[-1][3].append(e[1:])
    return out


#: Mixture-of-experts cases: name: (test_layer_moe's layout, recompute, shared expert).
MOE_CASES = {
    "moe-tp2-sp-ep2-full": ("tp2-sp", "full", False),
    "moe-tp2-sp-ep2-selective": ("tp2-sp", "selective", False),
    "moe-tp2-sp-ep2-none": ("tp2-sp", "none", False),
    "moe-cp2-ep2-shared-full": ("cp2", "full", True),
    "moe-dp2-ep2-shared-none": ("dp2", "none", True),
}


def _case(case):
    if case in MOE_CASES:
        layout, recompute, shared = MOE_CASES[case]
        return moe_workload(recompute, shared, layout).with_(chained_layers=False)
    return _unchained(*CASES[case])


@pytest.mark.parametrize("case", sorted(CASES) + sorted(MOE_CASES))
def test_one_planned_layer_runs_the_unchained_partitions(case):
    wl = _case(case)
    pset = build_partitions(wl)
    chained = build_partitions(wl.with_(chained_layers=True))
    L = wl.layers_per_stage
    plan = make_workload_plan(wl, pick=1, sms=12)
    logs, _ = _one_layer(wl, plan)
    for phase, log in logs.items():
        parts = _partitions(log)
        with_ops = [p for p in parts if p[2]]
        # every unit with ops runs as a type of the plan, holding exactly the type's ops
        for key, _, ops, _ in with_ops:
            assert tuple(ops) == tuple(op.name for op in pset.types[key].compute_ops), key
        got = collections.Counter(p[0] for p in with_ops)
        want = {t: c // L for t, c in pset.counts[phase].items() if c}
        assert dict(got) == want, (phase, dict(got), want)
        # the collectives with nothing beside them: the set's exposed ones (outside work
        # beyond the chained set's), at their own CTA count
        exposed = [p for p in parts if not p[2]]
        extra = pset.outside[(0, phase)].comms[len(chained.outside[(0, phase)].comms):]
        assert len(exposed) == len(extra) // L
        assert [c[0][1] for p in exposed for c in [p[3]]] == [c.kind.value for c in extra[
            :len(exposed)]]
        assert all(c[2] is None and c[3] is None for p in exposed for c in p[3])
        # every op of the computation ran in a partition or bare, as the set counts it
        bare = pset.outside[(0, phase)].ops[len(chained.outside[(0, phase)].ops):]
        ran_in = sum(len(p[2]) for p in parts)
        total = sum(len(pset.types[t].compute_ops) * c // L
                    for t, c in pset.counts[phase].items())
        assert ran_in == total
        assert len(bare) % L == 0 and len(bare) // L > 0


def test_unsplit_computations_are_the_chained_ones():
    wl = _unchained(2, 1, True, "full", mbs=4, n=1)
    a, b = build_partitions(wl), build_partitions(wl.with_(chained_layers=True))
    assert a.counts == b.counts and a.outside == b.outside
    assert {k: v.compute_ops for k, v in a.types.items()} == {
        k: v.compute_ops for k, v in b.types.items()}


def test_a_stack_of_unchained_layers_is_refused():
    wl = _unchained(2, 1, False, "full")
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2), kernels="torch",
                          plan=make_workload_plan(wl))
    assert applier.stack(1).layers == 1
    with pytest.raises(WorkloadError, match="chained_layers=False"):
        applier.stack(2)


def test_a_plan_for_chained_layers_is_refused_by_unchained_layers_and_back():
    wl = _unchained(2, 1, False, "full")
    for plan_wl, job in ((wl.with_(chained_layers=True), wl),
                         (wl, wl.with_(chained_layers=True))):
        with pytest.raises(Exception, match="chained_layers: plan") as err:
            PlanApplier(workload=job, groups=LoopbackGroups(tp=2), kernels="torch",
                        plan=make_workload_plan(plan_wl))
        assert "--unchained-layers" in str(err.value)
        assert "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_unchained_plan_on_cuda_streams_computes_the_sequential_layers(graphs):
    """On one GPU (TP=4 x CP=2 stood in for by loopback collectives, bf16, a TorchExecutor
    on CUDA streams, eager or from the applier's own graphs): two planned layers under a
    plan for unchained layers compute what the sequential schedule computes, the plan's
    collectives at its SM count and the exposed ones at their own CTA count."""
    from kareus.exec.schedule import DefaultConfig
    from kareus.exec.train import make_collectives
    from kareus.model.workload import ModelArch, Workload

    arch = ModelArch(name="small", layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                     ffn=1024, vocab=1000)
    wl = Workload(model=arch, parallelism=Parallelism(tp=4, cp=2), microbatch_size=4,
                  seq_len=512, num_microbatches=2, nanobatches=2, chained_layers=False)
    groups = LoopbackGroups(tp=4, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    plan = make_workload_plan(wl, sms=16, freqs_mhz=(1980, 1410))
    p = {k: v.to("cuda", torch.bfloat16).requires_grad_(True)
         for k, v in shard(full_weights(arch, 1), arch, 4, 0).items()}
    x = torch.randn(4, 256, arch.hidden, generator=torch.Generator().manual_seed(0)).to(
        "cuda", torch.bfloat16)
    results = {}
    for schedule in ("sequential", "kareus"):
        applier = PlanApplier(workload=wl, groups=groups, plan=plan, schedule=schedule,
                              collective=capped, default_collective=default, record=True,
                              graphs=graphs and schedule == "kareus")
        layer = applier.layer()
        outs = []
        for mb in range(2):
            xm = x.clone().requires_grad_(True)
            with applier.microbatch(mb, "fwd"):
                y = layer(layer(xm, planned_weights(p, arch)), planned_weights(p, arch))
            with applier.microbatch(mb, "bwd"):
                y.float().square().mean().backward()
            outs.append((y.detach(), xm.grad))
        grads = {k: v.grad.clone() for k, v in p.items()}
        for v in p.values():
            v.grad = None
        results[schedule] = (outs, grads)
        if schedule == "kareus":
            ran = applier.partitions_run
            assert {cfg.comm_sms for _, k, cfg in ran if ":" not in k} == {16}
            assert all(isinstance(cfg, DefaultConfig) for _, k, cfg in ran if ":" in k)
            assert any(":" in k for _, k, _ in ran)  # exposed collectives ran
    torch.cuda.synchronize()

    def rel(a, b):
        return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-12))

    (outs, grads), (bouts, bgrads) = results["kareus"], results["sequential"]
    for (y, dx), (by, bdx) in zip(outs, bouts, strict=True):
        assert rel(y, by) < 2e-2 and rel(dx, bdx) < 2e-2
    for k, g in grads.items():
        assert rel(g, bgrads[k]) < 2e-2, k
