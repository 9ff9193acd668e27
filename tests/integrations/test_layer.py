"""The framework-neutral planned layer (kareus.integrations) against a plain-PyTorch layer.

* one process (TP = CP = 1, CPU, fp32): the planned layer's output and every gradient
  (input, each weight, through the layout helpers into ``[out, in]`` parameters) equal the
  autograd reference, two layers deep, under both baselines, for rotate-half and for
  interleaved RoPE (reordered rows);
* the schedule a plan asks for (one process standing in for TP=2 x CP=2 on the recording
  executor): clock requests, partitions, slots and SM counts, split and unsplit computations;
* refusals (typed, one line);
* several processes over gloo (TP=2, and TP=2 x CP=2 on Megatron-Core's load-balanced
  chunks): every schedule's outputs and gradients equal the reference of the whole layer,
  and every rank records the plan's schedule.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kareus.errors import ArgumentError, PlanError, WorkloadError
from kareus.exec.train import LoopbackGroups
from kareus.integrations import (
    LAYER_WEIGHTS,
    PlanApplier,
    gate_up_from_fused,
    linear,
    qkv_from_grouped,
    qkv_from_separate,
)
from kareus.integrations._kept import KeptActivations
from kareus.model import cp_positions
from kareus.testing import RecordingExecutor, make_workload_plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _ranks import run_ranks
from _reference import full_weights, layer, planned_weights, shard, workload

REPO = HERE.parents[1]


def _params(arch, seed):
    return {k: torch.nn.Parameter(v) for k, v in full_weights(arch, seed).items()}


def _grads(params):
    out = {k: p.grad.clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    return out


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
@pytest.mark.parametrize("qk", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("how", ["layers", "stack"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("schedule", ["sequential", "nanobatching"])
def test_a_planned_layer_is_the_reference_layer(schedule, interleaved, how, qk, recompute):
    wl = workload(qk=qk, recompute=recompute)
    arch = wl.model
    layers = [_params(arch, seed) for seed in (1, 2)]
    x = torch.randn(4, 16, arch.hidden, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    c = torch.randn(4, 16, arch.hidden, generator=torch.Generator().manual_seed(9))

    y = x
    for p in layers:
        y = layer(y, p, arch, interleaved=interleaved)
    (y * c).sum().backward()
    ref_y, ref_dx, ref = y.detach(), x.grad.clone(), [_grads(p) for p in layers]
    x.grad = None

    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule=schedule,
                          kernels="torch", eps=arch.norm_eps)
    ws = [planned_weights(p, arch, interleaved=interleaved) for p in layers]
    assert len(ws[0]) == (9 if qk else 7)
    if how == "stack":  # one autograd node over both layers
        y = applier.stack(len(layers))(x, ws)
    else:
        planned = applier.layer()
        y = x
        for w in ws:
            y = planned(y, w)
    (y * c).sum().backward()
    torch.testing.assert_close(y.detach(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, ref_dx, rtol=1e-4, atol=1e-5)
    for p, want in zip(layers, ref, strict=True):
        for k, g in _grads(p).items():
            torch.testing.assert_close(g, want[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_planned_stack_keeps_what_its_policy_says_and_reruns_the_rest(recompute):
    """What the autograd node holds between forward and backward, and which forward ops its
    backward runs: none of them (none), the attention core once per layer and nanobatch
    right before out_dgrad (selective), every one (full)."""
    from kareus.model.decoder import decoder_layer

    wl = workload(recompute=recompute)
    arch = wl.model
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                          kernels="torch", eps=arch.norm_eps)
    x = torch.randn(4, 16, arch.hidden, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    ws = [planned_weights(_params(arch, seed), arch) for seed in (1, 2)]
    prog = applier.program(x.detach(), 2)
    ran, run_op = [], prog.run_op

    def recording(op, nb):
        ran.append((prog.phase, op.name))
        run_op(op, nb)

    prog.run_op = recording
    y = applier.stack(2)(x, ws)
    # eager, what the backward reads is saved for it through autograd (after the input
    # and the weights), so autograd frees it once the backward has run
    node = y.grad_fn
    assert node.inputs is None
    kept = list(node.saved_tensors[1 + node.weights:])
    if recompute == "full":  # the second layer's input (the first's is the node's input)
        assert node.kept_layout == "inputs"
        assert len(kept) == 1 and kept[0].shape == (64, arch.hidden)
    else:
        kept = KeptActivations.unpack(node.kept_layout, kept)
        assert sorted(kept.act) == [(layer, i) for layer in range(2) for i in range(2)]
        for a in kept.act.values():
            assert ("graph" in a) is ("attn" in a) is (recompute == "none")
            assert {"x_in", "xn", "x_mid", "xn2", "g", "u", "a"} <= set(a)
    y.sum().backward()
    forward_ops = set(decoder_layer("fwd").op_names)
    bwd = [name for phase, name in ran if phase == "bwd"]
    again = [name for name in bwd if name in forward_ops]
    assert again == {"none": [], "selective": ["attn_core"] * 4}.get(recompute, again)
    if recompute == "full":  # every forward op but the down projection (TP = CP = 1:
        assert set(again) == forward_ops - {"down"}  # no backward op reads its output)
        assert len(again) == 2 * 2 * (len(decoder_layer("fwd").op_names) - 1)
    if recompute == "selective":
        assert all(bwd[i + 1] == "out_dgrad" for i, n in enumerate(bwd) if n == "attn_core")


def test_the_wrong_rope_layout_is_another_model():
    # The interleaved reference differs from the rotate-half planned layer unless the rows
    # are reordered: the check above has teeth.
    wl = workload()
    arch = wl.model
    p = _params(arch, 1)
    x = torch.randn(4, 16, arch.hidden, generator=torch.Generator().manual_seed(0))
    planned = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), kernels="torch").layer()
    with torch.no_grad():
        want = layer(x, p, arch, interleaved=True)
        assert not torch.allclose(planned(x, planned_weights(p, arch)), want, atol=1e-3)
        torch.testing.assert_close(planned(x, planned_weights(p, arch, interleaved=True)), want,
                                   rtol=1e-5, atol=1e-5)


def test_a_model_s_own_rope_frequencies():
    # A model that scales its RoPE frequencies (Llama 3.1) passes them; the base is then
    # ignored. A base of 10,000 differs from the default 500,000: the check has teeth.
    wl = workload()
    arch = wl.model
    p = _params(arch, 1)
    x = torch.randn(4, 16, arch.hidden, generator=torch.Generator().manual_seed(0))
    inv = 1.0 / (10000.0 ** (torch.arange(0, arch.head_dim, 2).float() / arch.head_dim))
    inv[2:] /= 8.0
    with torch.no_grad():
        want = layer(x, p, arch, inv=inv)
        got = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), kernels="torch",
                          rope_inv_freq=inv).layer()(x, planned_weights(p, arch))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        plain = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), kernels="torch",
                            ).layer()(x, planned_weights(p, arch))
        assert not torch.allclose(plain, want, atol=1e-3)
    with pytest.raises(ArgumentError, match="head_dim / 2"):
        PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), kernels="torch",
                    rope_inv_freq=inv[:2]).layer()(x, planned_weights(p, arch))


def test_grouped_and_fused_layouts_are_the_separate_ones():
    g = torch.Generator().manual_seed(3)
    heads, kvh, hd, h, f = 4, 2, 8, 32, 64
    wq, wk, wv = (torch.randn(n * hd, h, generator=g) for n in (heads, kvh, kvh))
    grouped = torch.cat([torch.cat((wq.view(kvh, -1, h)[i], wk.view(kvh, hd, h)[i],
                                    wv.view(kvh, hd, h)[i])) for i in range(kvh)])
    assert torch.equal(qkv_from_grouped(grouped, heads=heads, kv_heads=kvh, head_dim=hd),
                       qkv_from_separate(wq, wk, wv, head_dim=hd))
    w1, w3 = torch.randn(f, h, generator=g), torch.randn(f, h, generator=g)
    wg, wu = gate_up_from_fused(torch.cat((w1, w3)))
    assert torch.equal(wg, linear(w1)) and torch.equal(wu, linear(w3))
    with pytest.raises(ArgumentError, match="rows"):
        qkv_from_grouped(grouped[1:], heads=heads, kv_heads=kvh, head_dim=hd)
    with pytest.raises(ArgumentError, match="2-D"):
        linear(torch.zeros(3))


# ------------------------------------------------------------------ the plan's schedule


def _recorded(wl, plan, microbatches, *, phases=("fwd", "bwd")):
    arch = wl.model
    ex = RecordingExecutor(plan=plan)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2), executor=ex,
                          baseline=RecordingExecutor(), kernels="torch", record=True)
    p = {k: torch.nn.Parameter(v) for k, v in shard(full_weights(arch, 1), arch, 2, 0).items()}
    x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden, requires_grad=True)
    planned = applier.layer()
    for mb in microbatches:
        with applier.microbatch(mb, "fwd"):
            y = planned(x, planned_weights(p, arch))
        if "bwd" in phases:
            with applier.microbatch(mb, "bwd"):
                y.sum().backward()
    return ex.log, applier


def test_a_plan_sets_clocks_partitions_slots_and_sms():
    from kareus.exec.executor import plan_config, plan_frequency

    wl = workload(2, 2)
    plan = make_workload_plan(wl, pick=1, sms=12, freqs_mhz=(1980, 1410),
                              unsplit_microbatches=(1,))
    log, applier = _recorded(wl, plan, [0, 1])
    clocks = [e[1:] for e in log if e[0] == "microbatch"]
    assert clocks == [(0, m, ph, plan_frequency(plan, 0, m, ph))
                      for m in (0, 1) for ph in ("fwd", "bwd")]
    assert {c[3] for c in clocks} == {1980, 1410}
    # Every collective of a computation runs under the configuration the plan gives its
    # partition type there: the SM count always, the slot unless clipped to the unit.
    comp, n_coll = None, {}
    for e in log:
        if e[0] == "microbatch":
            comp = e[1:4]
        elif e[0] == "collective":
            _, key, kind, sms, slot = e
            assert sms == plan_config(plan, key, comp).comm_sms == 12, (comp, key)
            n_coll[comp] = n_coll.get(comp, 0) + 1
    # One layer at TP=2 x CP=2: a forward has 3 collectives (K/V all-gather, two all-reduces)
    # per nanobatch; a backward re-runs the forward, then 3 more (all-reduce, dK/dV
    # reduce-scatter, all-reduce). Microbatch 1 runs unsplit.
    assert n_coll == {(0, 0, "fwd"): 6, (0, 0, "bwd"): 12, (0, 1, "fwd"): 3, (0, 1, "bwd"): 6}
    split_keys = {k for ph, k, _ in applier.partitions_run}
    assert split_keys <= set(plan.partition_configs(nanobatches=2)) | set(
        plan.partition_configs(nanobatches=1))
    # A slot the unit holds is the plan's; the first partition of the forward (fwd_attn_in
    # ops beside the K/V all-gather of the nanobatch before) launches at its op 'qkv'.
    first = next(e for e in log if e[0] == "collective")
    assert first[1:3] == ("fwd_attn_in_ag", "all_gather")
    assert first[4] == plan_config(plan, "fwd_attn_in_ag", (0, 0, "fwd")).launch_slot


def test_a_stack_chains_collectives_across_its_layers():
    # Two planned layers run the last collective of each layer's forward exposed (a
    # partition with no ops beside it); a stack of the two only its own last one: the
    # boundary all-reduce runs beside the next layer's first partition, as planned. (A
    # backward ends with its input norm's backward, which overlaps the last all-reduce
    # of the layer either way.)
    wl = workload(2, 2)
    arch = wl.model
    plan = make_workload_plan(wl, sms=12)
    ws = [planned_weights({k: torch.nn.Parameter(v) for k, v in
                           shard(full_weights(arch, seed), arch, 2, 0).items()}, arch)
          for seed in (1, 2)]
    x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden, requires_grad=True)
    exposed = {}
    for how in ("layers", "stack"):
        ex = RecordingExecutor(plan=plan)
        applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2), executor=ex,
                              baseline=RecordingExecutor(), kernels="torch")
        with applier.microbatch(0, "fwd"):
            if how == "stack":
                y = applier.stack(2)(x, ws)
            else:
                y = applier.layer()(applier.layer()(x, ws[0]), ws[1])
        with applier.microbatch(0, "bwd"):
            y.sum().backward()
        parts = [e for e in ex.log if e[0] == "partition"]
        ops_in = {}
        key = None
        for e in ex.log:
            if e[0] == "partition":
                key = len(ops_in)
                ops_in[key] = 0
            elif e[0] == "op" and key is not None:
                ops_in[key] += 1
        exposed[how] = sum(1 for n in ops_in.values() if n == 0)
        assert len(parts) == len(ops_in)
        collectives = [e for e in ex.log if e[0] == "collective"]
        # 2 layers x (3 forward + 3 recomputed + 3 backward) collectives x 2 nanobatches
        assert len(collectives) == 2 * 9 * 2
    assert exposed == {"layers": 2, "stack": 1}


def test_each_pipeline_stage_applies_its_own_computations():
    from kareus.model.workload import Parallelism

    wl = workload(2, 2).with_(parallelism=Parallelism(tp=2, cp=2, pp=2))
    arch = wl.model
    plan = make_workload_plan(wl, freqs_mhz=(1980, 1410))
    assert plan.num_stages == 2
    w = planned_weights(shard(full_weights(arch, 1), arch, 2, 0), arch)
    x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden)
    for stage in (0, 1):
        ex = RecordingExecutor(plan=plan)
        applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2), executor=ex,
                              baseline=RecordingExecutor(), kernels="torch", stage=stage)
        with applier.microbatch(1, "fwd"):
            applier.layer()(x, w)
        assert [e for e in ex.log if e[0] == "microbatch"] == [
            ("microbatch", stage, 1, "fwd", 1410)]
    with pytest.raises(ArgumentError, match="stage"):
        PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2), executor=ex,
                    baseline=RecordingExecutor(), stage=2)
    with pytest.raises(PlanError, match="stage"):
        PlanApplier(workload=workload(2, 2), groups=LoopbackGroups(tp=2, cp=2),
                    executor=RecordingExecutor(plan=plan), baseline=RecordingExecutor())


def test_a_plan_needs_the_microbatch_scope_and_the_baselines_do_not():
    wl = workload(2, 2)
    arch = wl.model
    plan = make_workload_plan(wl)
    groups = LoopbackGroups(tp=2, cp=2)
    applier = PlanApplier(workload=wl, groups=groups, executor=RecordingExecutor(plan=plan),
                          baseline=RecordingExecutor(), kernels="torch")
    w = planned_weights(shard(full_weights(arch, 1), arch, 2, 0), arch)
    x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden)
    with pytest.raises(PlanError, match="microbatch") as err:
        applier.layer()(x, w)
    assert "wrap_schedule(applier)" in str(err.value) and "--" not in str(err.value)
    odd = torch.randn(wl.microbatch_size + 1, wl.seq_len // 2, arch.hidden)
    with applier.microbatch(0, "fwd"), pytest.raises(WorkloadError, match="microbatch_size=") \
            as err:
        applier.layer()(odd, w)
    assert "--" not in str(err.value)
    with applier.microbatch(0, "bwd"), pytest.raises(PlanError, match="'fwd'"):
        applier.layer()(x, w)
    base = PlanApplier(workload=wl, groups=groups, schedule="nanobatching",
                       baseline=RecordingExecutor(), kernels="torch")
    assert base.layer()(x, w).shape == x.shape


def test_the_plan_s_clocks_go_to_the_trigger_given():
    # The default TorchExecutor requests each computation's clock through frequency=,
    # once per microbatch computation, at its start.
    from kareus.exec.executor import plan_frequency
    from kareus.testing import RecordingTrigger

    wl = workload(2, 2)
    arch = wl.model
    plan = make_workload_plan(wl, freqs_mhz=(1980, 1410))
    trigger = RecordingTrigger()
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2), plan=plan,
                          frequency=trigger, kernels="torch")
    w = planned_weights(shard(full_weights(arch, 1), arch, 2, 0), arch)
    for mb in (0, 1):
        x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden, requires_grad=True)
        with applier.microbatch(mb, "fwd"):
            y = applier.stack(2)(x, [w, w])
        with applier.microbatch(mb, "bwd"):
            y.sum().backward()
    assert trigger.freqs_mhz == [plan_frequency(plan, 0, mb, ph) for mb in (0, 1)
                                 for ph in ("fwd", "bwd")] == [1980, 1980, 1410, 1410]


def test_loopback_groups_get_the_loopback_collective_by_default():
    # One process standing in for TP=2 x CP=2 without executors given: the applier builds
    # the loopback collectives (each collective a real op of its bytes) and runs a plan.
    from kareus.exec.train import LoopbackGroupCollective

    wl = workload(2, 2)
    arch = wl.model
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2),
                          plan=make_workload_plan(wl), kernels="torch")
    w = planned_weights(shard(full_weights(arch, 1), arch, 2, 0), arch)
    x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden, requires_grad=True)
    with applier.microbatch(0, "fwd"):
        y = applier.layer()(x, w)
    with applier.microbatch(0, "bwd"):
        y.sum().backward()
    tp = applier.executor.collective.backend_for("all_reduce")
    assert isinstance(tp, LoopbackGroupCollective) and tp.calls_total > 0
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("how", ["layer", "stack"])
def test_under_sequence_parallelism_a_layer_takes_and_returns_the_sequence_shard(how):
    # One process standing in for TP=2 x CP=2 with sequence parallelism, under a plan of the
    # SP partition types: the layer's input and output are [batch, seq / (CP x TP),
    # hidden]; its TP collectives are all-gathers and reduce-scatters on the TP group's
    # backend (the CP group's runs the K/V ones); the input gradient is a shard too.
    import attrs

    from kareus.exec.train import LoopbackGroupCollective

    wl = workload(2, 2)
    wl = wl.with_(parallelism=attrs.evolve(wl.parallelism, sp=True))
    arch = wl.model
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, cp=2),
                          plan=make_workload_plan(wl), kernels="torch", record=True)
    w = planned_weights(shard(full_weights(arch, 1), arch, 2, 0), arch)
    x = torch.randn(wl.microbatch_size, wl.seq_len // 4, arch.hidden, requires_grad=True)
    run = (applier.layer() if how == "layer" else
           (lambda x, w: applier.stack(2)(x, [w, w])))
    with applier.microbatch(0, "fwd"):
        y = run(x, w)
    assert y.shape == x.shape
    with applier.microbatch(0, "bwd"):
        y.sum().backward()
    assert x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    tp = applier.executor.collective.for_group("tp")
    cp = applier.executor.collective.for_group("cp")
    assert isinstance(tp, LoopbackGroupCollective)
    assert {k for k, _, _ in tp.calls} == {"all_gather", "reduce_scatter"}
    assert {k for k, _, _ in cp.calls} == {"all_gather", "reduce_scatter"}
    # every TP collective moves the nanobatch's tokens x hidden; the K/V ones less
    t = wl.microbatch_size // wl.nanobatches * wl.seq_len // 2 * arch.hidden
    assert {n for _, n, _ in tp.calls} == {t}
    with pytest.raises(WorkloadError, match=r"seq / \(CP x TP\)"), \
            applier.microbatch(0, "fwd"):
        applier.layer()(torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden), w)


def test_refusals_are_typed_and_say_what_to_do():
    wl = workload(2, 2)
    arch = wl.model
    groups = LoopbackGroups(tp=2, cp=2)
    with pytest.raises(WorkloadError, match="TP=2 x CP=2"):
        PlanApplier(workload=workload(2, 1), groups=groups, baseline=RecordingExecutor())
    with pytest.raises(ArgumentError, match="eps"):
        PlanApplier(workload=wl, groups=groups, baseline=RecordingExecutor(), eps=1e-6)
    with pytest.raises(PlanError, match="plan="):
        PlanApplier(workload=wl, groups=groups, schedule="kareus", baseline=RecordingExecutor())
    plan = make_workload_plan(wl)
    applier = PlanApplier(workload=wl, groups=groups, executor=RecordingExecutor(plan=plan),
                          baseline=RecordingExecutor(), kernels="torch")
    p = shard(full_weights(arch, 1), arch, 2, 0)
    w = planned_weights(p, arch)
    wrong = torch.randn(wl.microbatch_size * 2, wl.seq_len // 2, arch.hidden)
    with applier.microbatch(0, "fwd"), pytest.raises(WorkloadError, match="made for"):
        applier.layer()(wrong, w)
    x = torch.randn(wl.microbatch_size, wl.seq_len // 2, arch.hidden)
    with pytest.raises(ArgumentError, match="missing"):
        applier.layer()(x, {k: w[k] for k in LAYER_WEIGHTS[:-1]})
    ones = torch.ones(arch.head_dim)
    with pytest.raises(ArgumentError, match="model has no qk_norm"):
        applier.layer()(x, {**w, "w_q_norm": ones, "w_k_norm": ones})
    with pytest.raises(ArgumentError, match="dtype|float"):
        applier.layer()(x.double(), w)


# ------------------------------------------------------------------ several processes, gloo


def _worker(out_dir: str, tp: int, qk: bool, recompute: str) -> None:
    import torch.distributed as dist

    from kareus.exec.train import TorchParallelGroups

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    base = TorchParallelGroups(tp=tp)  # the "framework's" groups
    groups = TorchParallelGroups.from_groups(tp=base.tp_group if base.tp_size > 1 else None,
                                             cp=base.cp_group if base.cp_size > 1 else None)
    wl = workload(groups.tp_size, groups.cp_size, microbatches=2, qk=qk, recompute=recompute)
    arch = wl.model
    # this rank's tokens: Megatron-Core's load-balanced chunks (r and 2 CP - 1 - r)
    pos = torch.tensor(cp_positions(wl.seq_len, groups.cp_size, groups.cp_rank))
    plan = make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410),
                              unsplit_microbatches=(1,))
    result = {"tp_rank": groups.tp_rank, "cp_rank": groups.cp_rank}
    for schedule in ("sequential", "nanobatching", "kareus", "kareus-stack"):
        stacked = schedule.endswith("-stack")
        applier = PlanApplier(workload=wl, groups=groups, schedule=schedule.split("-")[0],
                              plan=plan if schedule.startswith("kareus") else None, kernels="torch",
                              eps=arch.norm_eps, record=True)
        planned = applier.layer()
        layers = [{k: torch.nn.Parameter(v.clone()) for k, v in
                   shard(full_weights(arch, seed), arch, groups.tp_size, groups.tp_rank).items()}
                  for seed in (1, 2)]
        outs = []
        for mb in range(wl.num_microbatches):
            g = torch.Generator().manual_seed(100 + mb)
            x = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g)
            c = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g)
            xl = x[:, pos].clone().requires_grad_(True)
            with applier.microbatch(mb, "fwd"):
                if stacked:
                    y = applier.stack(2)(xl, [planned_weights(p, arch) for p in layers])
                else:
                    y = xl
                    for p in layers:
                        y = planned(y, planned_weights(p, arch))
            with applier.microbatch(mb, "bwd"):
                (y * c[:, pos]).sum().backward()
            outs.append((y.detach(), xl.grad.clone()))
        result[schedule] = {"outs": outs,
                            "grads": [{k: p.grad.clone() for k, p in ps.items()} for ps in layers],
                            "partitions": [(ph, k) for ph, k, _ in applier.partitions_run]}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _reference_run(arch, microbatches, mbs, seq):
    layers = [_params(arch, seed) for seed in (1, 2)]
    outs = []
    for mb in range(microbatches):
        g = torch.Generator().manual_seed(100 + mb)
        x = torch.randn(mbs, seq, arch.hidden, generator=g).requires_grad_(True)
        c = torch.randn(mbs, seq, arch.hidden, generator=g)
        y = x
        for p in layers:
            y = layer(y, p, arch)
        (y * c).sum().backward()
        outs.append((y.detach(), x.grad.clone()))
    return outs, [{k: p.grad.clone() for k, p in ps.items()} for ps in layers]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "tp", "qk", "recompute"),
                         [(2, 2, False, "full"), (4, 2, False, "full"), (2, 2, True, "full"),
                          (4, 2, False, "none"), (4, 2, True, "selective")],
                         ids=["tp2", "tp2-cp2", "tp2-qwen3", "tp2-cp2-none",
                              "tp2-cp2-qwen3-selective"])
def test_gloo_ranks_match_the_whole_layer(tmp_path, world, tp, qk, recompute):
    res = run_ranks(__file__, tmp_path, world, str(tp), str(int(qk)), recompute)
    cp = world // tp
    wl = workload(tp, cp, microbatches=2, qk=qk, recompute=recompute)
    arch = wl.model
    outs, grads = _reference_run(arch, wl.num_microbatches, wl.microbatch_size, wl.seq_len)
    for schedule in ("sequential", "nanobatching", "kareus", "kareus-stack"):
        for r in res:
            pos = torch.tensor(cp_positions(wl.seq_len, cp, r["cp_rank"]))
            for (y, dx), (ry, rdx) in zip(r[schedule]["outs"], outs, strict=True):
                torch.testing.assert_close(y, ry[:, pos], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(dx, rdx[:, pos], rtol=1e-4, atol=1e-5)
        # Weight gradients: each CP rank holds its chunk's part (the framework sums them
        # over its data- and context-parallel ranks); each TP rank its shard. The query/key
        # norm weights are whole on every TP rank, which holds its heads' part of their
        # gradient (the framework sums them over TP, as Megatron-Core does): the sum over
        # every rank is the whole gradient, and no rank has it alone.
        for i, want in enumerate(grads):
            for k in ("qn", "kn") if qk else ():
                got = sum(r[schedule]["grads"][i][k] for r in res)
                torch.testing.assert_close(got, want[k], rtol=1e-4, atol=1e-5,
                                           msg=f"{schedule} layer {i} {k}")
                assert not torch.allclose(res[0][schedule]["grads"][i][k], want[k], atol=1e-3)
        for t in range(tp):
            mine = [r for r in res if r["tp_rank"] == t]
            for i, want in enumerate(grads):
                want_shard = shard(want, arch, tp, t)
                for k in set(want_shard) - {"qn", "kn"}:
                    got = sum(r[schedule]["grads"][i][k] for r in mine)
                    torch.testing.assert_close(got, want_shard[k], rtol=1e-4, atol=1e-5,
                                               msg=f"{schedule} layer {i} {k} tp {t}")
        parts = [r[schedule]["partitions"] for r in res]
        assert all(p == parts[0] for p in parts), "ranks ran different partitions"
    assert any(k.startswith("fwd_mlp") for _, k in res[0]["kareus"]["partitions"])


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])), sys.argv[4])
