"""The training loop's mixture-of-experts layer (kareus.exec.train with ModelArch.moe) on
the CPU with torch.

* one process (TP = CP = EP = 1): the loss and every gradient equal a float64 autograd
  reference of the same model, for each recomputation policy, with and without shared
  experts;
* two processes over gloo, EP=2 folded over CP=2 (each rank holds two of the four experts,
  sorts its received tokens by expert) and EP=2 over TP=2 with sequence parallelism (each
  TP rank routes its sequence shard), real dispatch and combine all-to-alls through the
  executor at the slots each schedule gives them: the losses of two iterations, every
  gradient (router, experts, shared experts, attention) and the weights after two AdamW
  steps equal the float64 reference (``kareus.testing.moe_block_reference`` in the whole
  model) under every schedule (sequential, nanobatching, kareus with a plan of
  ``make_workload_plan``), with random (uneven) routing and with every token biased to
  the first rank's experts (the other rank receives no rows);
* what is not run is refused in one line (CUDA graphs, nanobatches along the sequence,
  a loopback stand-in for EP).

Skipped without torch.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

torch = pytest.importorskip("torch")

from kareus.errors import ArgumentError, PlanError, WorkloadError
from kareus.exec.executor import RecordingStreamBackend
from kareus.exec.train import (
    FixedRateCollectiveTimes,
    GroupedCollective,
    LoopbackGroups,
    TrainingLoop,
    check_plan_workload,
    make_collectives,
)
from kareus.model.moe import MoEArch
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.testing import make_workload_plan, moe_block_reference

F = torch.nn.functional
REPO = Path(__file__).resolve().parents[2]
LR = 1e-3


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def moe_workload(*, tp: int = 1, cp: int = 1, ep: int = 1, dp: int = 1, recompute: str = "none",
                 shared: bool = False, n: int = 2, layers: int = 2) -> Workload:
    moe = MoEArch(experts=4, experts_per_token=2, expert_ffn=16,
                  shared_experts=1 if shared else 0, shared_expert_ffn=24 if shared else 0)
    m = ModelArch(name="tiny-moe", layers=layers, hidden=32, heads=4, kv_heads=2, head_dim=8,
                  ffn=64, vocab=50, moe=moe)
    return Workload(model=m, parallelism=Parallelism(tp=tp, cp=cp, ep=ep, dp=dp, sp=tp > 1),
                    microbatch_size=4, seq_len=16, num_microbatches=2, nanobatches=n,
                    recompute=recompute)


def batches(wl: Workload, seed: int = 0) -> list[tuple[Any, Any]]:
    """The loop's microbatches as whole sequences (``TrainingLoop._data``'s draws), every
    data-parallel replica's (one iteration of the whole job)."""
    out = []
    for mb in range(wl.num_microbatches * wl.parallelism.dp):
        g = torch.Generator(device="cpu").manual_seed(seed * 7919 + 104729 + mb)
        tok = torch.randint(0, wl.model.vocab, (wl.microbatch_size, wl.seq_len + 1),
                            generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


# ------------------------------------------------------------------ the reference

_REPLICATED = ("norm", "w_final", "Wr", "Wsg", "Wsu", "Wsd")
_EXPERTS = ("W1e", "W2e")


def _rms(x, w, eps):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


def whole_model(tp_shards: list[dict[str, Any]], ep_shards: list[dict[str, Any]],
                wl: Workload, bias: Any = None) -> dict[str, Any]:
    """The whole model's float64 leaves: TP-sharded weights per TP rank (``tp_shards[t]``),
    replicated ones once, every expert (``ep_shards[e]``'s experts in EP-rank order)."""
    out: dict[str, Any] = {}
    for t, shard in enumerate(tp_shards):
        for k, v in shard.items():
            if k.endswith(_EXPERTS) or (t > 0 and k.endswith(_REPLICATED)):
                continue
            out[k if k.endswith(_REPLICATED) else f"{k}@{t}"] = v.detach().double().clone()
    for k in ep_shards[0]:
        if k.endswith(_EXPERTS):
            out[k] = torch.cat([s[k].detach().double() for s in ep_shards])
    return {k: v.requires_grad_() for k, v in out.items()}


def forward_loss(P: dict[str, Any], wl: Workload, data: list[tuple[Any, Any]], tp: int,
                 bias: Any = None) -> Any:
    """The mean cross-entropy of the whole model on whole sequences (float64)."""
    arch, moe = wl.model, wl.model.moe
    heads, kvh, hd, eps = arch.heads // tp, arch.kv_heads // tp, arch.head_dim, arch.norm_eps
    emb = torch.cat([P[f"emb@{t}"] for t in range(tp)])[:arch.vocab]
    wlm = torch.cat([P[f"Wlm@{t}"] for t in range(tp)], dim=1)[:, :arch.vocab]
    total = 0.0
    n_tokens = 0
    for tokens, labels in data:
        b, s = tokens.shape
        n_tokens += b * s
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos(), ang.sin()
        x = emb[tokens.reshape(-1)]
        for layer in range(arch.layers):
            pre = f"l{layer}."
            xn = _rms(x, P[pre + "w_attn_norm"], eps)
            y = 0
            for t in range(tp):
                qkv = (xn @ P[f"{pre}Wqkv@{t}"]).view(b, s, heads + 2 * kvh, hd)
                q = _rope(qkv[:, :, :heads], cos, sin).transpose(1, 2)
                k = _rope(qkv[:, :, heads:heads + kvh], cos, sin).transpose(1, 2)
                v = qkv[:, :, heads + kvh:].transpose(1, 2)
                rep = heads // kvh
                o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                   v.repeat_interleave(rep, 1), is_causal=True)
                y = y + o.transpose(1, 2).reshape(b * s, heads * hd) @ P[f"{pre}Wo@{t}"]
            x = x + y
            xn2 = _rms(x, P[pre + "w_mlp_norm"], eps)
            shared = ((P[pre + "Wsg"], P[pre + "Wsu"], P[pre + "Wsd"])
                      if moe.shared_experts else None)
            if bias is None:
                x = x + moe_block_reference(xn2, P[pre + "Wr"], P[pre + "W1e"], P[pre + "W2e"],
                                            top_k=moe.experts_per_token, shared=shared)
            else:
                x = x + _biased_block(xn2, P[pre + "Wr"], P[pre + "W1e"], P[pre + "W2e"],
                                      moe.experts_per_token, bias, shared)
        logits = _rms(x, P["w_final"], eps) @ wlm
        total = total + F.cross_entropy(logits, labels.reshape(-1), reduction="sum")
    return total / n_tokens


def _biased_block(x, wr, w1, w2, k, bias, shared):
    """The MoE block with the experts chosen on ``logits + bias`` (the probabilities of the
    unbiased logits): the routing the skewed test forces on the loop."""
    logits = x @ wr
    idx = torch.topk(logits + bias, k, dim=-1).indices
    probs = torch.softmax(logits.gather(1, idx), dim=-1)
    out = torch.zeros_like(x)
    for e in range(wr.shape[1]):
        hit = idx == e
        tok = hit.any(-1).nonzero().squeeze(1)
        if tok.numel():
            gate, up = (x[tok] @ w1[e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[e]
            out = out.index_add(0, tok, (probs * hit).sum(-1)[tok].unsqueeze(1) * y)
    if shared is not None:
        wg, wu, wd = shared
        out = out + (F.silu(x @ wg) * (x @ wu)) @ wd
    return out


def reference_steps(P: dict[str, Any], wl: Workload, data, tp: int, steps: int = 2,
                    bias: Any = None) -> list[tuple[float, dict[str, Any]]]:
    """``steps`` AdamW steps of the whole model as the loop takes them (lr ``LR``, betas
    (0.9, 0.95), eps 1e-8, weight decay 0.01): each step's loss and gradients, then the
    weights after the last."""
    opt = torch.optim.AdamW(list(P.values()), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = forward_loss(P, wl, data, tp, bias)
        loss.backward()
        out.append((float(loss.detach()), {k: v.grad.clone() for k, v in P.items()}))
        opt.step()
    return out


def for_rank(whole: dict[str, Any], key: str, tp_rank: int, ep_rank: int, local: int) -> Any:
    """Rank ``(tp_rank, ep_rank)``'s part of a whole-model tensor ``key``."""
    if key.endswith(_EXPERTS):
        return whole[key][ep_rank * local:(ep_rank + 1) * local]
    if key.endswith(_REPLICATED):
        return whole[key]
    return whole[f"{key}@{tp_rank}"]


def _close(a, b, tol=1e-4):
    return float((a.double() - b.double()).norm() / max(b.double().norm(), 1e-12)) < tol


def _check_against_reference(res: list[dict], wl: Workload, schedules: tuple[str, ...],
                             bias: Any = None) -> None:
    p = wl.parallelism
    by_tp = {r["tp_rank"]: r for r in res}
    by_ep = {r["ep_rank"]: r for r in res}
    P = whole_model([by_tp[t]["params"] for t in range(p.tp)],
                    [by_ep[e]["params"] for e in range(p.ep)], wl)
    ref = reference_steps(P, wl, batches(wl), p.tp, bias=bias)
    final = {k: v.detach() for k, v in P.items()}
    local = wl.model.moe.experts // p.ep
    for s in schedules:
        for r in res:
            for step, (ref_loss, ref_grads) in enumerate(ref):
                assert r[s]["losses"][step] == pytest.approx(ref_loss, rel=1e-5), (s, step)
                for k, g in r[s]["grads"][step].items():
                    want = for_rank(ref_grads, k, r["tp_rank"], r["ep_rank"], local)
                    assert _close(g, want), (s, step, r["rank"], k)
            for k, w in r[s]["weights"].items():
                want = for_rank(final, k, r["tp_rank"], r["ep_rank"], local)
                assert _close(w, want, 1e-5), (s, "weights", r["rank"], k)


# ------------------------------------------------------------------ one process


def _one_process(wl: Workload, *, device: str = "cpu", kernels: str | None = "torch"
                 ) -> dict[str, Any]:
    """Two steps of each schedule in one process (``device="cuda"``: on the current GPU, its
    streams, float32, ``kernels``: ``None`` the default set), the results on the CPU."""
    kw: dict[str, Any] = ({"streams": RecordingStreamBackend(), "kernels": "torch",
                           "device": "cpu"} if device == "cpu" else {"kernels": kernels})
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1, cp=1), dtype="float32",
                        lr=LR, **kw)
    res = {"rank": 0, "tp_rank": 0, "ep_rank": 0,
           "params": {k: v.cpu().clone() for k, v in loop.model.params.items()}}
    for s in loop.schedules:  # no plan at TP = CP = EP = 1 (nothing to overlap)
        res[s] = _two_steps(loop, s)
    return res


def _two_steps(loop: TrainingLoop, schedule: str) -> dict[str, Any]:
    loop.reset()
    out: dict[str, Any] = {"losses": [], "grads": []}
    for _ in range(2):
        out["losses"].append(float(loop.step(schedule)))
        out["grads"].append({k: v.cpu().clone() for k, v in loop.model.grads.items()})
    out["weights"] = {k: v.cpu().clone() for k, v in loop.model.params.items()}
    return out


@pytest.mark.parametrize(("recompute", "shared"), [("none", False), ("full", True),
                                                   ("selective", True), ("none", True)])
def test_one_process_moe_matches_autograd(recompute, shared):
    wl = moe_workload(recompute=recompute, shared=shared)
    _check_against_reference([_one_process(wl)], wl, ("sequential", "nanobatching"))


def test_moe_reference_block_is_the_dense_mlp_with_one_expert():
    # top-1 of one expert: probability 1, the block is that expert's SwiGLU MLP
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    w1 = torch.randn(1, 8, 12, generator=g, dtype=torch.float64)
    w2 = torch.randn(1, 6, 8, generator=g, dtype=torch.float64)
    wr = torch.randn(8, 1, generator=g, dtype=torch.float64)
    y = moe_block_reference(x, wr, w1, w2, top_k=1)
    assert torch.allclose(y, (F.silu(x @ w1[0, :, :6]) * (x @ w1[0, :, 6:])) @ w2[0])
    with pytest.raises(ValueError, match="top_k"):
        moe_block_reference(x, wr, w1, w2, top_k=2)


# ------------------------------------------------------------------ refusals


def test_moe_refusals_are_one_line():
    wl = moe_workload(n=1)
    kw = {"streams": RecordingStreamBackend(), "kernels": "torch", "device": "cpu",
          "dtype": "float32"}
    with pytest.raises(WorkloadError, match="graphs=False"):
        TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1, cp=1), graphs=True, **kw)
    seq = attrs.evolve(wl, microbatch_size=1, nanobatches=2)
    with pytest.raises(WorkloadError, match="along the sequence"):
        TrainingLoop(workload=seq, groups=LoopbackGroups(tp=1, cp=1), **kw)
    with pytest.raises(WorkloadError, match="EP=2"):  # groups of another EP degree
        TrainingLoop(workload=moe_workload(cp=2, ep=2), groups=LoopbackGroups(tp=1, cp=2),
                     **kw)
    with pytest.raises(ArgumentError, match="divide"):
        LoopbackGroups(tp=1, cp=2, ep=4)


def test_a_plan_for_another_expert_parallel_degree_is_refused():
    plan = make_workload_plan(moe_workload(tp=2, cp=2, ep=2))
    check_plan_workload(plan, moe_workload(tp=2, cp=2, ep=2))
    with pytest.raises(PlanError, match="ep: plan 2, job 4"):
        check_plan_workload(plan, moe_workload(tp=2, cp=2, ep=4))


def test_loopback_stands_in_for_the_expert_parallel_group():
    # one process standing in for EP=2 over CP=2 (and TP=2 x EP=2 with SP): the dispatch
    # and combine run through the stand-in's all-to-all at the plan's slots; the loss stays
    # finite and falls, a reset starts over. (The rows "other ranks" return are stand-ins
    # cycled within each nanobatch's exchange, so the schedules' functions differ slightly
    # after the first step: a timing stand-in, not the model.)
    for tp, cp, shared in ((1, 2, True), (2, 1, False)):
        wl = moe_workload(tp=tp, cp=cp, ep=2, shared=shared)
        groups = LoopbackGroups(tp=tp, cp=cp, ep=2)
        capped, default, _ = make_collectives(groups, backend="loopback")
        loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                            default_collective=default, plan=make_workload_plan(wl),
                            streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                            dtype="float32", lr=1e-2)
        first = {}
        for s in loop.schedules:
            loop.reset()
            losses = [float(loop.step(s)) for _ in range(4)]
            first[s] = losses
            assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (s, losses)
        loop.reset()
        assert float(loop.step("kareus")) == pytest.approx(first["kareus"][0], rel=1e-6)
        calls = [c for c in capped.ep.calls if c[0] == "all_to_all"]
        assert calls and any(sms == 8 for _, _, sms in calls)  # the plan's SM count


def test_the_time_faithful_stand_in_times_the_all_to_alls():
    # the faithful stand-in holds each all-to-all's SMs for its time (on the CPU: the time
    # recorded, the plain stand-in's data) and says where its times come from
    wl = moe_workload(cp=2, ep=2)
    groups = LoopbackGroups(tp=1, cp=2, ep=2)
    capped, default, note = make_collectives(groups, backend="loopback", loopback="faithful",
                                             times=FixedRateCollectiveTimes())
    assert note.count("group of 2") == 2 and "STAND-IN" in note  # the CP and EP groups
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=make_workload_plan(wl),
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float32")
    loss = float(loop.step("kareus"))
    assert math.isfinite(loss)
    timed = [t for t in capped.ep.timed if t[0] == "all_to_all"]
    assert timed and all(secs > 0 and sms == 8 for _, _, sms, secs in timed)
    # a stand-in of the plain one's data
    plain = LoopbackGroups(tp=1, cp=2, ep=2)
    pc, pd, _ = make_collectives(plain, backend="loopback")
    other = TrainingLoop(workload=wl, groups=plain, collective=pc, default_collective=pd,
                         plan=make_workload_plan(wl), streams=RecordingStreamBackend(),
                         kernels="torch", device="cpu", dtype="float32")
    assert float(other.step("kareus")) == pytest.approx(loss, rel=1e-6)


# ------------------------------------------------------------------ two ranks over gloo


def _gloo_collective():
    from tests.exec.test_train_loop import GlooCollective

    class GlooAllToAll(GlooCollective):
        """GlooCollective with the EP group's all-to-all (test only)."""

        def all_to_all(self, output, input, output_splits, input_splits, stream, sms):
            self.dist.all_to_all_single(output, input.contiguous(),
                                        output_split_sizes=list(output_splits),
                                        input_split_sizes=list(input_splits),
                                        group=self.group)
            return output

    return GlooAllToAll


def _case(case: str) -> tuple[Workload, bool]:
    """``"ep2cp2[-skew]"``: EP=2 over CP=2, TP=1, shared experts; ``"ep2tp2"``: EP=2 over
    TP=2 with sequence parallelism, full recomputation; ``"ep2tp2cp2"``, ``"ep4tp2cp2"``:
    four ranks (TP=2 with sequence parallelism x CP=2). ``-skew``: every token's experts
    are chosen among the first EP rank's (the second receives no rows)."""
    if case.startswith("ep2cp2"):
        return moe_workload(cp=2, ep=2, shared=True, recompute="none"), case.endswith("skew")
    if case == "ep2tp2":
        return moe_workload(tp=2, ep=2, recompute="full"), False
    if case == "ep2tp2cp2":  # two ranks hold each expert: its gradients summed over them
        return moe_workload(tp=2, cp=2, ep=2, recompute="selective"), False
    if case == "ep4tp2cp2":  # one expert per rank (no sort), the EP group over TP and CP
        return moe_workload(tp=2, cp=2, ep=4, recompute="none"), False
    if case == "ep2dp2":  # EP alone: over two data-parallel replicas, shared experts
        return moe_workload(dp=2, ep=2, shared=True, recompute="full"), False
    if case == "ep2tp2dp2":  # the EP group is the TP group; experts summed over DP
        return moe_workload(tp=2, dp=2, ep=2, recompute="selective"), False
    raise ValueError(case)


_SKEW = torch.tensor([100.0, 100.0, 0.0, 0.0], dtype=torch.float64)


def _skew(model: Any) -> None:
    """Choose every token's experts on ``logits + _SKEW`` (probabilities of the logits)."""

    def router_topk(layer, a, nb):
        logits = a.pop("logits")
        idx = torch.topk(logits + _SKEW.to(logits.dtype), model.topk, dim=-1).indices
        a["topi"] = idx
        a["probs"] = torch.softmax(logits.gather(1, idx), dim=-1)

    model._op_router_topk = router_topk


def _dense_dp_workload() -> Workload:
    from tests.exec.test_train_loop import workload

    wl = workload(2, 1, recompute="none")
    return wl.with_(parallelism=Parallelism(tp=2, dp=2))


def _worker(out_dir: str, case: str) -> None:
    import torch.distributed as dist

    from kareus.exec.train import TorchParallelGroups

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if case == "dense-tp2dp2":
        _dense_worker(out_dir, rank)
        return
    wl, skew = _case(case)
    p = wl.parallelism
    groups = TorchParallelGroups(tp=p.tp, ep=p.ep, dp=p.dp)
    gloo = _gloo_collective()
    coll = GroupedCollective(tp=gloo(groups.tp_group) if p.tp > 1 else None,
                             cp=gloo(groups.cp_group) if p.cp > 1 else None,
                             ep=gloo(groups.ep_group))
    loop = TrainingLoop(workload=wl, groups=groups, collective=coll,
                        plan=make_workload_plan(wl), streams=RecordingStreamBackend(),
                        kernels="torch", device="cpu", dtype="float32", lr=LR)
    if skew:
        _skew(loop.model)
    received: list[tuple[int, ...]] = []
    permute = loop.model._op_permute

    def recording_permute(layer, a, nb):  # the rows each rank receives, per dispatch
        permute(layer, a, nb)
        received.append(a["route"].output_splits)

    loop.model._op_permute = recording_permute
    res: dict[str, Any] = {"rank": rank, "tp_rank": groups.tp_rank, "ep_rank": groups.ep_rank,
                           "params": {k: v.clone() for k, v in loop.model.params.items()}}
    for s in loop.schedules:
        res[s] = _two_steps(loop, s)
        res[s]["ran"] = [(k, c.launch_slot) for k, c in loop.partitions_run]
    res["received"] = received
    if case == "ep2tp2":  # a plan that runs microbatch 1 unsplit (its own partition types)
        plan = make_workload_plan(wl, unsplit_microbatches=(1,))
        other = TrainingLoop(workload=wl, groups=groups, collective=coll, plan=plan,
                             streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                             dtype="float32", lr=LR)
        res["kareus-unsplit"] = _two_steps(other, "kareus")
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _dense_worker(out_dir: str, rank: int) -> None:
    """A dense model's TP=2 x DP=2 ranks (data parallelism is the loop's, MoE or not)."""
    import torch.distributed as dist

    from kareus.exec.train import TorchParallelGroups
    from tests.exec.test_train_loop import GlooCollective

    wl = _dense_dp_workload()
    groups = TorchParallelGroups(tp=2, dp=2)
    loop = TrainingLoop(workload=wl, groups=groups,
                        collective=GroupedCollective(tp=GlooCollective(groups.tp_group),
                                                     cp=None),
                        plan=make_workload_plan(wl), streams=RecordingStreamBackend(),
                        kernels="torch", device="cpu", dtype="float32", lr=LR)
    res: dict[str, Any] = {"rank": rank, "tp_rank": groups.tp_rank, "dp_rank": groups.dp_rank,
                           "params": {k: v.clone() for k, v in loop.model.params.items()}}
    for s in loop.schedules:
        loop.reset()
        res[s] = {"loss": float(loop.step(s)),
                  "grads": {k: v.clone() for k, v in loop.model.grads.items()}}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_gloo_dense_data_parallel_ranks_match_the_whole_model(tmp_path):
    # TP=2 x DP=2: each replica its own microbatches; the loss is the mean over both
    # replicas' tokens and every gradient their sum (the float64 reference of
    # tests/exec/test_train_loop.py on all four microbatches)
    from tests.exec.test_train_loop import reference

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(Path(__file__).resolve()), str(tmp_path), "dense-tp2dp2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    wl = _dense_dp_workload()
    by = {(r["tp_rank"], r["dp_rank"]): r for r in res}
    shards = [by[(t, 0)]["params"] for t in range(2)]
    data = batches(wl)
    assert len(data) == 2 * wl.num_microbatches
    ref_loss, ref = reference(shards, wl.model, wl.model.layers, data,
                              len(data) * wl.microbatch_size * wl.seq_len)
    for s in ("sequential", "nanobatching", "kareus"):
        for r in res:
            assert r[s]["loss"] == pytest.approx(ref_loss, rel=1e-5), s
            for k, g in r[s]["grads"].items():
                assert _close(g, ref[r["tp_rank"]][k]), (s, r["rank"], k)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "world"), [("ep2cp2", 2), ("ep2cp2-skew", 2), ("ep2tp2", 2),
                                             ("ep2tp2cp2", 4), ("ep4tp2cp2", 4),
                                             ("ep2dp2", 2), ("ep2tp2dp2", 4)])
def test_gloo_moe_ranks_match_the_whole_model(tmp_path, case, world):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", str(Path(__file__).resolve()), str(tmp_path), case]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    wl, skew = _case(case)
    # the plan's all-to-all partitions ran at their launch slots (its last computation's)
    ran = res[0]["kareus"]["ran"]
    assert any(slot is not None for k, slot in ran if k.endswith("_a2a") or "moe" in k), ran
    assert "bwd_moe_experts" in dict(res[0]["kareus"]["ran"])
    # uneven routing: the ranks receive different row counts; skewed, the second none
    rows = [sum(sum(r) for r in x["received"]) for x in res]
    assert len(set(rows)) > 1, rows
    if skew:
        assert rows[1] == 0 and all(min(r) > 0 for r in res[0]["received"]), rows
    _check_against_reference(res, wl, ("sequential", "nanobatching", "kareus")
                             + (("kareus-unsplit",) if case == "ep2tp2" else ()),
                             bias=_SKEW if skew else None)


if __name__ == "__main__":
    _worker(*sys.argv[1:])
