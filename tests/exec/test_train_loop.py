"""The library's training loop (kareus.exec.train) on the CPU with torch.

* one process, no collective: loss and every gradient equal an autograd reference of the
  same decoder (the op-by-op backward is right);
* one process standing in for TP and CP groups (loopback): the three schedules give the
  same losses, the loss falls, a reset starts over;
* four processes over gloo (TP=2 x CP=2) and two (TP=1 x CP=2), real collectives through
  the executor, each rank fed its chunks of Megatron-Core's load-balanced layout (chunks
  ``r`` and ``2 CP - 1 - r`` of 2 x CP): the loss and every rank's gradients equal the
  float64 autograd reference of the whole model assembled from the shards, on whole
  sequences (tensor and context parallelism are right).

Skipped without torch.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest

torch = pytest.importorskip("torch")

from kareus.compose import MicrobatchChoice, Plan
from kareus.errors import PlanError
from kareus.exec.collectives import CollectiveBackend
from kareus.exec.executor import RecordingStreamBackend
from kareus.exec.train import (
    GroupedCollective,
    LoopbackGroupCollective,
    LoopbackGroups,
    TrainingLoop,
    check_plan_workload,
    make_collectives,
    measure_runs,
    named_collectives,
    shuffled_order,
)
from kareus.model.config import ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.pipeline import get_schedule
from kareus.model.workload import ModelArch, Parallelism, Workload

F = torch.nn.functional
REPO = Path(__file__).resolve().parents[2]


#: torch's intra-op threads: one (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def workload(tp: int, cp: int, recompute: bool | str = True, n: int = 2) -> Workload:
    m = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64,
                  vocab=50)
    return Workload(model=m, parallelism=Parallelism(tp=tp, cp=cp), microbatch_size=4,
                    seq_len=8, num_microbatches=2, nanobatches=n, recompute=recompute)


def plan_for(wl: Workload, *, pick: int = 1, sms: int = 8, backend: str | None = None) -> Plan:
    cfgs = {}
    for name, p in build_partitions(wl).types.items():
        slots = [s.name for s in p.slots]
        cfgs[name] = ScheduleConfig(1980, sms,
                                    slots[min(pick, len(slots) - 1)] if slots else None,
                                    backend=backend)
    comps = get_schedule("1f1b", 1, wl.num_microbatches).stage_orders[0]
    return Plan(gpu="h200-sxm", num_stages=1, num_microbatches=wl.num_microbatches,
                choices=[MicrobatchChoice(freq_mhz=1980, configs=cfgs)],
                assignment={c.key(): 0 for c in comps}, time_s=1.0, energy_j=1.0,
                dynamic_energy_j=0.5, static_power_w=100.0, workload=wl.to_dict())


def loopback_loop(tp: int, cp: int, recompute: bool = True, *, lr: float = 1e-2,
                  plan: bool = True) -> TrainingLoop:
    wl = workload(tp, cp, recompute)
    groups = LoopbackGroups(tp=tp, cp=cp)
    capped, default, _ = make_collectives(groups, backend="loopback")
    return TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan_for(wl) if plan else None,
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float32", lr=lr)


# ------------------------------------------------------------------ the reference


def _rms(x, w, eps=1e-5):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


def _rope(x, cos, sin):  # x [b, s, heads, hd]; HF layout, halves equal
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


def reference(shards: list[dict[str, Any]], arch: ModelArch, layers: int,
              batches: list[tuple[Any, Any]], n_tokens: int) -> tuple[float, list[dict]]:
    """Loss and gradients of the whole model from its TP shards (``shards[r]``: rank r's
    parameters by name), on whole sequences; autograd, float64."""
    tp = len(shards)
    P = [{k: v.detach().double().clone().requires_grad_() for k, v in s.items()}
         for s in shards]
    heads, kvh, hd = arch.heads // tp, arch.kv_heads // tp, arch.head_dim
    eps = arch.norm_eps
    emb = torch.cat([p["emb"] for p in P])[:arch.vocab]
    wlm = (emb.t() if arch.tied_embeddings  # one matrix: both gradients reach it
           else torch.cat([p["Wlm"] for p in P], dim=1)[:, :arch.vocab])
    total = 0.0
    for tokens, labels in batches:
        b, s = tokens.shape
        pos = torch.arange(s, dtype=torch.float64)
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(pos, inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos(), ang.sin()
        x = emb[tokens.reshape(-1)]
        for layer in range(layers):
            y = 0
            xn = _rms(x, P[0][f"l{layer}.w_attn_norm"], eps)
            for p in P:
                qkv = (xn @ p[f"l{layer}.Wqkv"]).view(b, s, heads + 2 * kvh, hd)
                q, k = qkv[:, :, :heads], qkv[:, :, heads:heads + kvh]
                if arch.qk_norm:  # per head over head_dim, before RoPE (one weight each)
                    q = _rms(q, P[0][f"l{layer}.w_q_norm"], eps)
                    k = _rms(k, P[0][f"l{layer}.w_k_norm"], eps)
                q = _rope(q, cos, sin).transpose(1, 2)
                k = _rope(k, cos, sin).transpose(1, 2)
                v = qkv[:, :, heads + kvh:].transpose(1, 2)
                rep = heads // kvh
                o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                   v.repeat_interleave(rep, 1), is_causal=True)
                y = y + o.transpose(1, 2).reshape(b * s, heads * hd) @ p[f"l{layer}.Wo"]
            x = x + y
            xn2 = _rms(x, P[0][f"l{layer}.w_mlp_norm"], eps)
            x = x + sum((F.silu(xn2 @ p[f"l{layer}.Wg"]) * (xn2 @ p[f"l{layer}.Wu"]))
                        @ p[f"l{layer}.Wd"] for p in P)
        logits = _rms(x, P[0]["w_final"], eps) @ wlm
        total = total + F.cross_entropy(logits, labels.reshape(-1), reduction="sum")
    loss = total / n_tokens
    loss.backward()
    grads = []
    for p in P:
        grads.append({k: (v.grad if v.grad is not None else torch.zeros_like(v)).float()
                      for k, v in p.items()})
    # Replicated weights (norms) get their gradient once per TP rank in the reference;
    # each rank holds the whole of it.
    for k in grads[0]:
        if k.endswith(("norm", "w_final")):
            tot = sum(g[k] for g in grads)
            for g in grads:
                g[k] = tot
    return float(loss.detach()), grads


def step_reference(loop: TrainingLoop, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The float64 autograd ``reference`` of one step of a one-rank ``loop`` (TP = 1) from
    ``params`` (its parameters before the step, on the CPU) on the loop's batches: the loss
    and every gradient."""
    wl = loop.workload
    batches = [(t.cpu(), lab.cpu()) for t, lab in loop.batches]
    ref_loss, (ref,) = reference([params], wl.model, loop.layers, batches,
                                 wl.num_microbatches * wl.microbatch_size * wl.seq_len)
    return ref_loss, ref


def losses_by_schedule(loop: TrainingLoop, steps: int) -> dict[str, list[float]]:
    """``steps`` losses of each of ``loop``'s schedules, each from the loop's initial state
    (``reset``)."""
    losses = {}
    for s in loop.schedules:
        loop.reset()
        losses[s] = [float(loop.step(s)) for _ in range(steps)]
    return losses


def assert_bf16_step(loss: float, grads: dict[str, Any], ref_loss: float, ref: dict[str, Any],
                     *what: object) -> None:
    """A bf16 step (on a GPU) against its float64 ``step_reference``: the loss within 5e-3
    and every gradient within 3e-2, relative (bf16 rounding); ``what`` names the case."""
    from _helpers import rel_error  # tests/, on sys.path under pytest (not in the workers)

    assert loss == pytest.approx(ref_loss, rel=5e-3), what
    for k, g in grads.items():
        err = rel_error(g, ref[k])
        assert err < 3e-2, (*what, k, err)


def _close(a, b, tol=1e-4):
    return float((a.double() - b.double()).norm() / max(b.double().norm(), 1e-12)) < tol


@pytest.mark.parametrize(("schedule", "recompute"), [("sequential", "full"),
                                                     ("nanobatching", "none"),
                                                     ("sequential", "selective"),
                                                     ("nanobatching", "selective")])
@pytest.mark.parametrize("features", [
    {},  # a Llama layer
    {"tied_embeddings": True},
    {"qk_norm": True, "norm_eps": 1e-6},  # Qwen3's layer
    {"qk_norm": True, "norm_eps": 1e-6, "tied_embeddings": True}])
def test_one_process_matches_autograd(schedule, recompute, features):
    wl = workload(1, 1, recompute)
    wl = wl.with_(model=attrs.evolve(wl.model, **features))
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1), streams=RecordingStreamBackend(),
                        kernels="torch", device="cpu", dtype="float32", lr=1e-3)
    m = loop.model
    # tied: the output layer is the embedding, transposed; qk-norm: one weight per layer each
    assert ("Wlm" in m.params) is not wl.model.tied_embeddings
    assert ("l0.w_q_norm" in m.params) is wl.model.qk_norm
    if wl.model.qk_norm:  # not ones, so that a wrong weight shows in the gradients
        for layer in range(loop.layers):
            for name in ("w_q_norm", "w_k_norm"):
                m.params[f"l{layer}.{name}"].uniform_(0.5, 1.5)
    params = {k: v.clone() for k, v in m.params.items()}
    loss = float(loop.step(schedule))
    ref_loss, (ref,) = reference([params], wl.model, loop.layers, loop.batches,
                                 wl.num_microbatches * wl.microbatch_size * wl.seq_len)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for k, g in m.grads.items():
        assert _close(g, ref[k]), k
    # the optimizer moved the weights
    assert not torch.equal(m.params["l0.Wqkv"], params["l0.Wqkv"])


@pytest.mark.parametrize(("change", "field"), [({"qkv_bias": True}, "qkv_bias")])
def test_a_layer_feature_the_decoder_does_not_compute_is_refused(change, field):
    from kareus.errors import WorkloadError

    wl = workload(1, 1)
    wl = wl.with_(model=attrs.evolve(wl.model, **change))
    with pytest.raises(WorkloadError, match=rf"training loop does not compute {field}"):
        TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1), streams=RecordingStreamBackend(),
                     kernels="torch", device="cpu", dtype="float32")


@pytest.mark.parametrize("tp,cp,recompute", [(2, 1, True), (1, 2, True), (2, 2, False)])
def test_loopback_schedules_agree_and_the_loss_falls(tp, cp, recompute):
    loop = loopback_loop(tp, cp, recompute)
    losses = losses_by_schedule(loop, 4)
    ref = losses["sequential"]
    for s, got in losses.items():
        assert got == pytest.approx(ref, rel=1e-5), s
    assert ref[-1] < ref[0]
    loop.reset()
    assert float(loop.step("kareus")) == losses["kareus"][0]


def _kept_storage_bytes(act: Any) -> int:
    """Bytes of the storages reachable from the loop's activations (each once)."""
    from kareus.exec.kernels import SavedAttention

    seen: dict[int, int] = {}

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(v, SavedAttention):
            for t in (v.output, *v.tensors):
                walk(t)
        elif isinstance(v, (list, tuple)):
            for t in v:
                walk(t)
        elif isinstance(v, dict):
            for t in v.values():
                walk(t)

    walk(act)
    return sum(seen.values())


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2)])
def test_the_bytes_the_forward_keeps_are_the_memory_model_s(tp, cp):
    """After a microbatch's forward the loop holds, per policy, the bytes the memory model
    counts for its layers (``kept_activation_bytes``; fp32 here): none > selective (the
    attention core's output and statistics) > full (the layers' inputs)."""
    from kareus.model.memory import kept_activation_bytes

    got = {}
    for policy in ("none", "selective", "full"):
        loop = loopback_loop(tp, cp, policy, plan=False)
        m = loop.model
        fwd, bwd = (c for c in loop.computations if c.microbatch == 0)
        loop._run_computation("nanobatching", fwd)
        got[policy] = _kept_storage_bytes(m.act)
        wl = loop.workload.with_(dtype_bytes=4)
        want = kept_activation_bytes(wl, layers=loop.layers)
        if policy == "none":  # on the CPU the attention's log-sum-exp lives in its autograd
            tokens = wl.microbatch_size * wl.seq_len // cp  # graph, not in m.act
            want -= 4 * wl.model.heads // tp * tokens * loop.layers
        assert got[policy] == want, policy
        loop._run_computation("nanobatching", bwd)
    assert got["none"] > got["selective"] > got["full"]


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_what_the_forward_keeps_and_the_backward_runs_again(policy):
    """CP=2 standing in (one process): after a forward, each layer keeps every activation
    (none), all but the attention core's output and its saved state (selective; the
    gathered K/V instead), or its input only (full); the backward runs no forward op
    (none), the attention core once per layer and nanobatch right before out_dgrad
    (selective), or every forward op (full)."""
    from kareus.model.decoder import decoder_layer

    loop = loopback_loop(1, 2, policy, plan=False)
    m = loop.model
    fwd, bwd = (c for c in loop.computations if c.microbatch == 0)
    assert (fwd.phase, bwd.phase) == ("fwd", "bwd")
    loop._run_computation("nanobatching", fwd)
    kept = {key: set(a) for key, a in m.act.items()}
    assert len(kept) == loop.layers * 2  # layers x nanobatches
    common = {"x_in", "xn", "x_mid", "xn2", "g", "u", "a"}
    want = {"full": {"x_in"}, "none": common | {"graph", "attn"},
            "selective": common | {"q", "kvs"}}[policy]
    for names in kept.values():
        assert names == want
    ran = []
    run_op = m.run_op

    def recording(op, nb):
        ran.append(op.name)
        run_op(op, nb)

    m.run_op = recording
    loop._run_computation("nanobatching", bwd)
    forward_ops = set(decoder_layer("fwd").op_names)
    again = [n for n in ran if n in forward_ops]
    if policy == "none":
        assert again == []
    elif policy == "selective":
        assert again == ["attn_core"] * (loop.layers * 2)
        for i, n in enumerate(ran):
            if n == "attn_core":
                assert ran[i + 1] == "out_dgrad"
    else:
        assert set(again) == forward_ops


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_plan_splitting_a_backward_otherwise_than_its_forward(policy):
    """Kept activations are per nanobatch: with recompute 'none' (or 'selective') a plan
    that runs a microbatch's forward split and its backward unsplit is refused, for the
    loop and for planned layers; full recomputation re-splits the input and runs it."""
    from kareus.integrations import PlanApplier
    from kareus.testing import make_workload_plan

    wl = workload(2, 1, policy)
    plan = make_workload_plan(wl, unsplit_microbatches=(0,))
    key = "s0.m0.fwd"
    split = plan.assignment["s0.m1.fwd"]  # m1's forward choice: split
    plan = attrs.evolve(plan, assignment={**plan.assignment, key: split})  # m0's too
    assert plan.nanobatches(key) == 2 and plan.nanobatches("s0.m0.bwd") == 1
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")

    builds = (lambda: TrainingLoop(workload=wl, groups=groups, collective=capped,
                                   default_collective=default, plan=plan,
                                   streams=RecordingStreamBackend(), kernels="torch",
                                   device="cpu", dtype="float32"),
              lambda: PlanApplier(workload=wl, groups=groups, plan=plan, collective=capped,
                                  default_collective=default, kernels="torch"))
    for build in builds:
        if policy == "full":
            build()
        else:
            with pytest.raises(PlanError, match="s0.m0.fwd into 2 nanobatch.*recompute='none'"):
                build()


def test_measure_runs_on_the_cpu():
    loop = loopback_loop(2, 1)
    order = shuffled_order(loop.schedules, 1, 3)
    recs = measure_runs(loop, order, steps=2, warmup=1)
    assert [(r.schedule, r.repeat) for r in recs] == order
    for r in recs:
        assert len(r.step_time_s) == 2 and len(r.losses) == 3 and r.energy_j is None
        assert r.losses == recs[0].losses or r.losses == pytest.approx(recs[0].losses,
                                                                        rel=1e-5)
        assert r.to_dict()["time_s"] == pytest.approx(r.time_s)


def test_plan_for_another_job_is_refused():
    wl = workload(2, 1)
    plan = plan_for(wl)
    check_plan_workload(plan, wl)
    with pytest.raises(PlanError, match="nanobatches"):
        check_plan_workload(plan, wl.with_(nanobatches=1))
    with pytest.raises(PlanError, match="cp: plan 1, job 2"):
        TrainingLoop(workload=workload(2, 2), groups=LoopbackGroups(tp=2, cp=2),
                     collective=make_collectives(LoopbackGroups(tp=2, cp=2),
                                                 backend="loopback")[0],
                     plan=plan, streams=RecordingStreamBackend(), kernels="torch",
                     device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="groups"):
        TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1), streams=RecordingStreamBackend(),
                     device="cpu")


def test_a_plan_that_names_its_backend_runs_on_that_backend():
    wl = workload(2, 2)
    plan = plan_for(wl, backend="nccl_capped")
    groups = LoopbackGroups(tp=2, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    kw = dict(workload=wl, groups=groups, collective=capped, default_collective=default,
              plan=plan, streams=RecordingStreamBackend(), kernels="torch", device="cpu",
              dtype="float32")
    with pytest.raises(PlanError, match="nccl_capped"):
        TrainingLoop(**kw)
    named = named_collectives(groups, {"nccl_capped"})
    loop = TrainingLoop(backends=named, **kw)
    loop.step("kareus")
    mine = named["nccl_capped"]
    assert mine.tp.calls and mine.cp.calls  # every collective of the chain ran there
    assert capped.tp.calls == [] and capped.cp.calls == []  # the outside work is not here
    with pytest.raises(ValueError, match="mscclpp"):
        named_collectives(groups, {"mscclpp"})


def test_a_plan_is_for_an_architecture_whatever_its_name():
    from kareus.exec.train import check_plan_workload

    wl = workload(2, 1)
    plan = plan_for(wl)
    renamed = wl.with_(model=attrs.evolve(wl.model, name="someone-elses-tiny"))
    check_plan_workload(plan, renamed)  # the same architecture under another name
    with_qk = wl.with_(model=attrs.evolve(wl.model, qk_norm=True, norm_eps=1e-6))
    with pytest.raises(PlanError, match=r"model.qk_norm: plan False, job True; "
                                        r"model.norm_eps: plan 1e-05, job 1e-06"):
        check_plan_workload(plan, with_qk)
    # a plan written before plans carried the architecture names a preset: its current one
    legacy = attrs.evolve(plan, workload={**plan.workload, "model": "qwen3-1.7b"})
    with pytest.raises(PlanError, match="model.layers: plan 28, job 2"):
        check_plan_workload(legacy, wl)


def test_kareus_needs_a_plan():
    loop = loopback_loop(2, 1, plan=False)
    assert loop.schedules == ("sequential", "nanobatching")
    with pytest.raises(ValueError, match="schedule"):
        loop.step("kareus")


def test_loopback_collective_and_grouping():
    lb = LoopbackGroupCollective(group_size=4)
    t = torch.ones(6)
    lb.all_reduce(t, None, 8)
    assert torch.equal(t, torch.full((6,), 4.0))
    out = torch.zeros(4, 3)
    lb.all_gather(out, torch.arange(3.0), None, 8)
    assert torch.equal(out, torch.arange(3.0).expand(4, 3))
    rs = torch.zeros(2)
    lb.reduce_scatter(rs, torch.arange(8.0), None, 8)
    assert torch.equal(rs, torch.tensor([12.0, 16.0]))  # the sum of the 4 blocks
    assert lb.calls == [("all_reduce", 6, 8), ("all_gather", 12, 8), ("reduce_scatter", 8, 8)]
    assert lb.calls_total == 3
    tp, cp = LoopbackGroupCollective(group_size=2), LoopbackGroupCollective(group_size=3)
    g = GroupedCollective(tp=tp, cp=cp)
    g.all_reduce(torch.ones(2), None, 4)
    g.reduce_scatter(torch.zeros(1), torch.ones(3), None, 4)
    assert [c[0] for c in tp.calls] == ["all_reduce"]
    assert [c[0] for c in cp.calls] == ["reduce_scatter"]
    assert g.world_size == 2 and g.backend_for("all_gather") is cp
    with pytest.raises(ValueError):
        GroupedCollective(tp=tp, cp=None).backend_for("all_gather")
    with pytest.raises(TypeError):
        GroupedCollective(tp="nccl", cp=None)
    groups = LoopbackGroups(tp=2, cp=3)
    x = torch.ones(2)
    groups.all_reduce(x, group="cp")
    groups.all_reduce(x, group="tp", op="max")
    assert torch.equal(x, torch.full((2,), 3.0))
    with pytest.raises(ValueError):
        make_collectives(groups, backend="own")


def test_loopback_reduce_scatter_is_the_adjoint_of_its_all_gather():
    """<all_gather(x), y> == <x, reduce_scatter(y)>: a backward through the stand-in is the
    exact gradient of its forward."""
    g = torch.Generator().manual_seed(0)
    lb = LoopbackGroupCollective(group_size=3)
    x, y = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(15, generator=g,
                                                                          dtype=torch.float64)
    ag, rs = torch.zeros(3, 5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    lb.all_gather(ag, x, None, None)
    lb.reduce_scatter(rs, y, None, None)
    assert float((ag.reshape(-1) * y).sum()) == pytest.approx(float((x * rs).sum()), rel=1e-12)


def test_a_deep_loopback_loop_keeps_its_gradients_bounded():
    """28 layers at TP=4 x CP=2 on the stand-in groups. Before the reduce-scatter was the
    all-gather's adjoint and the tokens came from this rank's vocabulary shard, the first
    layer's gradient was 100x the last's here (Qwen3-1.7B's went non-finite in the first
    step on one H200); now 1.9x: a 28-layer decoder's gradients at init stay within a few
    times of each other."""
    m = ModelArch(name="deep", layers=28, hidden=128, heads=8, kv_heads=4, head_dim=16,
                  ffn=256, vocab=512)
    wl = Workload(model=m, parallelism=Parallelism(tp=4, cp=2), microbatch_size=2,
                  seq_len=64, num_microbatches=1, nanobatches=2, recompute=True)
    groups = LoopbackGroups(tp=4, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, streams=RecordingStreamBackend(),
                        kernels="torch", device="cpu", dtype="float32")
    model = loop.model
    assert all(int(t.max()) < model.v_local for pair in loop.batches for t in pair)
    losses = [float(loop.step("nanobatching")) for _ in range(3)]
    assert all(math.isfinite(x) for x in losses) and losses[0] > losses[-1]
    loop.reset()
    loop.step("sequential")
    norms = [float(model.G(layer, "Wqkv").norm()) for layer in range(28)]
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert max(norms) / min(norms) < 10, norms


# ------------------------------------------------------------------ four ranks over gloo


class GlooCollective(CollectiveBackend):
    """torch.distributed collectives on CPU tensors (test only; ``sms`` ignored)."""

    name: ClassVar[str] = "gloo"

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group

    @property
    def world_size(self) -> int:
        return self.dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return self.dist.get_rank(self.group)

    @property
    def sm_count(self) -> int:
        return 132

    def all_reduce(self, tensor, stream, sms):
        self.dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, output, input, stream, sms):
        parts = list(output.view(self.world_size, -1).unbind(0))
        self.dist.all_gather(parts, input.reshape(-1).contiguous(), group=self.group)
        return output

    def reduce_scatter(self, output, input, stream, sms):
        tmp = input.clone()
        self.dist.all_reduce(tmp, group=self.group)
        m = output.numel()
        output.view(-1).copy_(tmp.view(-1)[self.rank * m:(self.rank + 1) * m])
        return output


#: Qwen3's layer features, for the four-rank test.
QWEN3_FEATURES = {"qk_norm": True, "norm_eps": 1e-6, "tied_embeddings": True}


def _four_rank_workload(case: str, tp: int = 2) -> Workload:
    """``case``: ``"features/policy"`` (llama or qwen3 layer, recomputation policy), or a
    sequence-parallel layout, ``"sp-tp2"`` or ``"sp-tp2cp2"`` (Qwen3's layer)."""
    if case.startswith("sp-"):
        cp = 2 if case.endswith("cp2") else 1
        # without recomputation at TP=2 (the gathered inputs kept), full at TP=2 x CP=2
        wl = workload(2, cp, recompute="full" if cp == 2 else "none")
        p = wl.parallelism
        return wl.with_(model=attrs.evolve(wl.model, **QWEN3_FEATURES),
                        parallelism=Parallelism(tp=p.tp, cp=p.cp, sp=True))
    features, policy = case.split("/")
    wl = workload(tp, 2, recompute=policy).with_(seq_len=16)  # 4 chunks of 4 tokens
    if features == "qwen3":
        wl = wl.with_(model=attrs.evolve(wl.model, **QWEN3_FEATURES))
    return wl


def _worker(out_dir: str, features: str, tp: str = "2") -> None:
    import torch.distributed as dist

    from kareus.exec.train import TorchParallelGroups
    from kareus.model import cp_positions

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    wl = _four_rank_workload(features, int(tp))
    groups = TorchParallelGroups(tp=int(tp))
    coll = GroupedCollective(tp=GlooCollective(groups.tp_group) if groups.tp_size > 1 else None,
                             cp=(GlooCollective(groups.cp_group) if groups.cp_size > 1
                                 else None))
    loop = TrainingLoop(workload=wl, groups=groups, collective=coll, plan=plan_for(wl),
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float32", lr=1e-3)
    params = {k: v.clone() for k, v in loop.model.params.items()}
    result = {"tp_rank": groups.tp_rank, "cp_rank": groups.cp_rank, "params": params}
    # the rank's tokens are its two chunks of Megatron-Core's layout, and so are its RoPE
    # positions
    if groups.cp_size == 2:
        c = wl.seq_len // 4
        chunks = (groups.cp_rank, 3 - groups.cp_rank)
        want = [p for j in chunks for p in range(j * c, (j + 1) * c)]
        assert loop.model.positions() == want == cp_positions(wl.seq_len, 2, groups.cp_rank)
    for s in loop.schedules:
        loop.reset()
        loss = float(loop.step(s))
        result[s] = {"loss": loss, "grads": {k: v.clone() for k, v in loop.model.grads.items()}}
    if rank == 0:  # the whole sequences, for the reference
        tokens = []
        for mb in range(wl.num_microbatches):
            g = torch.Generator(device="cpu").manual_seed(0 * 7919 + 104729 + mb)
            tok = torch.randint(0, wl.model.vocab, (wl.microbatch_size, wl.seq_len + 1),
                                generator=g)
            tokens.append((tok[:, :-1], tok[:, 1:]))
        result["batches"] = tokens
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _gloo_ranks(out_dir: Path, world: int, *args: str) -> list[dict[str, Any]]:
    """This file's ``_worker(out_dir, *args)`` in ``world`` processes over gloo (torchrun,
    a free port of its own); asserts they all exit 0 and returns what each rank saved, in
    rank order."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world}", str(Path(__file__).resolve()), str(out_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _ranks_match_the_whole_model(res: list[dict[str, Any]], wl: Workload,
                                 shards: list[dict[str, Any]]) -> None:
    """Every rank's loss (1e-5) and gradients (1e-4), under each schedule, are the float64
    reference's of the whole model assembled from the TP ``shards``, on whole sequences."""
    ref_loss, ref = reference(shards, wl.model, wl.model.layers, res[0]["batches"],
                              wl.num_microbatches * wl.microbatch_size * wl.seq_len)
    for s in ("sequential", "nanobatching", "kareus"):
        for r in res:
            assert r[s]["loss"] == pytest.approx(ref_loss, rel=1e-5), s
            for k, g in r[s]["grads"].items():
                assert _close(g, ref[r["tp_rank"]][k]), (s, r["tp_rank"], r["cp_rank"], k)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "features"), [
    (2, "llama/full"), (2, "qwen3/full"), (1, "qwen3/full"), (2, "llama/none"),
    (2, "qwen3/selective"), (2, "llama/selective")])
def test_gloo_ranks_match_the_whole_model(tmp_path, tp, features):
    # TP x CP=2 ranks on Megatron-Core's load-balanced chunks against the whole sequences;
    # qwen3: query/key norms (their weights' gradients summed over the TP ranks' heads),
    # eps 1e-6 and tied embeddings (a vocabulary-parallel output layer on the embedding);
    # none / selective: the activations kept (selective: the gathered K/V too, the
    # attention core re-run in the backward without its all-gather)
    res = _gloo_ranks(tmp_path, 2 * tp, features, str(tp))
    wl = _four_rank_workload(features, tp)
    by = {(r["tp_rank"], r["cp_rank"]): r for r in res}
    shards = [by[(t, 0)]["params"] for t in range(tp)]
    for c in range(2):  # CP ranks hold the same weights
        for t in range(tp):
            for k, v in by[(t, c)]["params"].items():
                assert torch.equal(v, shards[t][k]), k
    _ranks_match_the_whole_model(res, wl, shards)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "nproc"), [("sp-tp2", 2), ("sp-tp2cp2", 4)])
def test_sequence_parallel_gloo_ranks_match_the_whole_model(tmp_path, layout, nproc):
    # Sequence parallelism (Qwen3's layer: query/key norms, eps 1e-6, tied embeddings): the
    # norms on each rank's sequence shard, TP all-gathers before the QKV and gate/up GEMMs
    # and reduce-scatters after the output and down projections (and mirrored in the
    # backward), through the executor over gloo; the embedding reduce-scattered, the final
    # norm's output gathered. TP=2 keeps every activation (the gathered inputs copied for
    # the weight gradients); TP=2 x CP=2 recomputes. Two sequences per nanobatch, so the
    # reordering around RoPE and attention runs.
    res = _gloo_ranks(tmp_path, nproc, layout)
    wl = _four_rank_workload(layout)
    assert wl.parallelism.sequence_parallel
    by = {(r["tp_rank"], r["cp_rank"]): r for r in res}
    _ranks_match_the_whole_model(res, wl, [by[(t, 0)]["params"] for t in range(2)])


if __name__ == "__main__":
    _worker(*sys.argv[1:])


def test_graphed_loop_captures_one_graph_per_computation_with_its_clock():
    """The capture plan of the training loop, on the recording fake (which captures but
    does not compute on replay): one graph per microbatch computation, in the pipeline
    schedule's order, each schedule its own sequence; a plan's clock requests (a trigger
    without host nodes here) go right before their computation's graph; a second call
    reuses the graphs; eager steps leave no graphs."""
    from kareus.exec.executor import plan_frequency
    from kareus.testing import RecordingTrigger

    wl = workload(2, 2)
    groups = LoopbackGroups(tp=2, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    trig = RecordingTrigger()
    plan = plan_for(wl)
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan, frequency=trig,
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float32", graphs=True)
    assert loop.graphs
    for schedule in loop.schedules:
        seq = loop.graph_sequence(schedule)
        assert len(seq) == len(loop.computations) == 2 * wl.num_microbatches
        assert loop.graph_sequence(schedule) is seq
    dev = loop.baseline.streams
    names = [e[2] for e in dev.log if e[0] == "capture"]
    assert names == [f"train:{s}[{i}]" for s in loop.schedules
                     for i in range(len(loop.computations))]
    seq = loop.graph_sequence("kareus")
    assert [d for d in seq.deferred] == [(plan_frequency(plan, c.stage, c.microbatch, c.phase),)
                                         for c in loop.computations]
    # Every graph of the nanobatched schedules forks to the side stream and joins it.
    for s in ("nanobatching", "kareus"):
        for i in range(len(loop.computations)):
            g = dev.graphs[f"train:{s}[{i}]"]
            assert ("wait", "comm") in [e[:2] for e in g]
            assert [e[:2] for e in g if e[0] == "wait"][-1] == ("wait", "compute")
    requests = len(trig.requests)
    loop.step("kareus")
    assert len(trig.requests) == requests + len(loop.computations)
    eager = TrainingLoop(workload=wl, groups=groups, collective=capped,
                         default_collective=default, streams=RecordingStreamBackend(),
                         kernels="torch", device="cpu", dtype="float32")
    assert not eager.graphs and eager.baseline.sequence("train:sequential") is None


def test_a_plan_that_runs_computations_unsplit():
    """A kareus plan whose choice for some computations is one nanobatch (kareus's space
    holds unsplit execution): those run each collective after its piece's ops with the SM
    count of their unsplit type, the others nanobatched; the loss equals the
    sequential schedule's, and every collective of an unsplit computation is capped."""
    wl = workload(2, 2)
    split = plan_for(wl, sms=8)
    unsplit_types = build_partitions(wl.with_(nanobatches=1)).types
    n1 = {name: ScheduleConfig(1980, 12, None) for name in unsplit_types}
    choices = [MicrobatchChoice(freq_mhz=1980, configs=split.choices[0].configs),
               MicrobatchChoice(freq_mhz=1980, configs=n1, nanobatches=1)]
    comps = get_schedule("1f1b", 1, wl.num_microbatches).stage_orders[0]
    plan = Plan(gpu="h200-sxm", num_stages=1, num_microbatches=wl.num_microbatches,
                choices=choices,
                assignment={c.key(): (1 if c.microbatch == 0 else 0) for c in comps},
                time_s=1.0, energy_j=1.0, dynamic_energy_j=0.5, static_power_w=100.0,
                workload=wl.to_dict())
    groups = LoopbackGroups(tp=2, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan,
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float32", lr=1e-2)
    loop.reset()
    ref = [float(loop.step("sequential")) for _ in range(2)]
    loop.reset()
    seen: list[tuple[str, Any]] = []
    runs = []
    for _ in range(2):
        loss = loop.step("kareus")
        runs.append(float(loss))
    assert runs == pytest.approx(ref, rel=1e-5)
    # microbatch 0 ran unsplit: the last computation's partitions (microbatch 1) are split;
    # run microbatch 0's forward alone to see its partitions
    loop.model.zero_grad()
    comp = loop.computations[0]
    assert (comp.microbatch, comp.phase) == (0, "fwd")
    loop._run_computation("kareus", comp)
    seen = loop.partitions_run
    assert seen and all(cfg.launch_slot is None and cfg.comm_sms == 12 for _, cfg in seen)
    assert {k for k, _ in seen} <= set(unsplit_types)
    # A plan that runs every computation unsplit names no nanobatched type: accepted.
    every = Plan(gpu="h200-sxm", num_stages=1, num_microbatches=wl.num_microbatches,
                 choices=choices, assignment={c.key(): 1 for c in comps}, time_s=1.0,
                 energy_j=1.0, dynamic_energy_j=0.5, static_power_w=100.0,
                 workload=wl.to_dict())
    TrainingLoop(workload=wl, groups=groups, collective=capped, default_collective=default,
                 plan=every, streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                 dtype="float32")


def test_loopback_keeps_the_latest_calls_only():
    lb = LoopbackGroupCollective(group_size=2)
    t = torch.ones(3)
    for _ in range(LoopbackGroupCollective.CALLS_KEPT + 5):
        lb.all_reduce(t, None, 4)
    kept = LoopbackGroupCollective.CALLS_KEPT
    for _ in range(kept - 5):  # 2 x kept calls in all: trimmed to the latest kept
        lb.all_reduce(t, None, 4)
    assert len(lb.calls) == kept  # trimmed when it reached 2 x kept
    assert lb.calls_total == 2 * kept
    assert lb.calls[-1] == ("all_reduce", 3, 4)


# ---- energy windows against a counter that steps only every so often -----------------


def _fake_nvml(**kw):
    # imported here: this file also runs as a torchrun script, where tests/ is not on the path
    from fake_nvml import FakeNVML

    return FakeNVML(1, **kw)


def _meter(nvml):
    from kareus.profilers.nvml import EnergyMeter

    return EnergyMeter(nvml=nvml, device_indices=[0], poll_interval_s=0.001).start()


def test_a_run_lasts_long_enough_for_the_counter_to_step():
    # An H200's counter steps every ~100 ms; iterations of ~1 ms would leave a window of a
    # few of them without a step. The window is lengthened until the counter steps inside.
    nvml = _fake_nvml(period_s=0.05, idle_w=300.0)
    meter = _meter(nvml)
    loop = loopback_loop(2, 1)
    try:
        meter.wait_edges(2, timeout_s=1.0)  # the meter knows the step period
        recs = measure_runs(loop, [("sequential", 0)], steps=2, warmup=1, meter=meter,
                            min_window_s=0.4)
    finally:
        meter.stop()
    (r,) = recs
    assert r.window_s >= 0.4 and len(r.step_time_s) > 2
    assert len(r.losses) == 1 + len(r.step_time_s)
    assert r.energy_method == "nvml_counter" and r.counter_steps >= 5
    # 300 W over the window, per iteration
    assert r.energy_j == pytest.approx(300.0 * r.window_s / len(r.step_time_s), rel=0.15)
    d = r.to_dict()
    assert d["iterations"] == len(r.step_time_s) and d["energy_method"] == "nvml_counter"
    # the span's parts, each at the fake GPU's steady 300 W
    assert len(r.sub_powers_w) == 3 and d["sub_powers_w"] == list(r.sub_powers_w)
    assert all(w == pytest.approx(300.0, rel=0.15) for w in r.sub_powers_w)


def test_the_default_window_follows_the_counters_step_period():
    from kareus.exec.nvml_device import MIN_ENERGY_WINDOW_S, min_energy_window_s

    class Stepping:
        def __init__(self, period):
            self.period = period

        def step_period_s(self):
            return self.period

    assert min_energy_window_s(None) == pytest.approx(7.5 * 0.1)  # an H200's 100 ms
    assert min_energy_window_s(Stepping(0.2)) == pytest.approx(1.5)
    assert min_energy_window_s(Stepping(0.001)) == MIN_ENERGY_WINDOW_S
    assert min_energy_window_s(Stepping(None)) == pytest.approx(0.75)


def test_without_a_counter_step_the_energy_comes_from_power_readings_and_says_so():
    # the counter steps every 10 s: never inside a 0.3 s window
    nvml = _fake_nvml(period_s=10.0, idle_w=250.0)
    meter = _meter(nvml)
    loop = loopback_loop(2, 1)
    try:
        (r,) = measure_runs(loop, [("nanobatching", 0)], steps=1, warmup=1, meter=meter,
                            min_window_s=0.3)
    finally:
        meter.stop()
    assert r.counter_steps == 0 and r.energy_method == "nvml_power_samples"
    assert r.power_samples >= 2
    assert r.energy_j == pytest.approx(250.0 * r.window_s / len(r.step_time_s), rel=0.05)


def test_a_window_nothing_measured_has_no_energy():
    nvml = _fake_nvml(period_s=10.0, idle_w=250.0, power_readings=False)
    meter = _meter(nvml)
    loop = loopback_loop(2, 1)
    try:
        (r,) = measure_runs(loop, [("sequential", 0)], steps=1, warmup=0, meter=meter,
                            min_window_s=0.2)
    finally:
        meter.stop()
    assert r.energy_j is None and r.energy_method is None and r.power_samples == 0


def test_every_rank_runs_the_iterations_agreed():
    loop = loopback_loop(2, 1)
    asked = []

    def agree(n):  # another rank wants 3 more iterations than this one
        asked.append(n)
        return n + 3 if len(asked) == 1 else 0

    (r,) = measure_runs(loop, [("sequential", 0)], steps=2, warmup=0, min_window_s=0.0,
                        agree=agree)
    assert asked[0] == 0 and len(r.step_time_s) == 5
