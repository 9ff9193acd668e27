"""kareus.integrations.torchtitan against torchtitan 0.3's own Llama 3 blocks.

* one process: the workload read from a config (and from a built model), the refusals
  (typed, one line), and a planned model (TP = 1) equal to torchtitan's own, fused and
  separate QKV, with Llama 3.1's scaled RoPE frequencies;
* two processes over gloo (TP = 2, torchtitan's own TP plan, both SPMD backends):
  a clone with kareus applied runs two microbatches forward and backward under the
  schedules sequential, nanobatching and kareus, the blocks chained into one stack (the
  default) and per block; the losses, the logits and every parameter's gradient equal
  torchtitan's own model, both ranks record the same partitions, the chained model runs
  one exposed forward collective per forward where per block runs one per layer, and
  remove_plan gives back the identical forwards;
* the same for torchtitan's ``qwen3`` with sequence parallelism on
  (``enable_sequence_parallel=True``: each block takes and returns this rank's sequence
  shard, ``Shard(1)``; the workload reads ``sp`` from the model's TP plan);
* blocks with a hook around their call run per block (chain=True refuses them);
* torchtitan's stock FlexAttention (block_causal document masks) on packed batches, at
  TP = 1 and at TP = 2 with sequence parallelism: the planned blocks' logits equal
  torchtitan's (its forward only: FlexAttention has no CPU backward), under the baseline
  and under a plan made for the documents (``document_tokens``, whose gradients equal the
  baseline's); a plan whose workload does not say so is refused, and the reverse.
"""

from __future__ import annotations

import copy
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from kareus import Parallelism
from kareus.errors import ArgumentError, ArgumentTypeError, WorkloadError
from kareus.integrations import torchtitan as kt
from kareus.testing import make_workload_plan

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

DIM, LAYERS, HEADS, KV, VOCAB, SEQ, MBS = 64, 2, 4, 2, 128, 16, 4


def config(*, fuse: bool, scaling: str = "llama") -> object:
    """A tiny Llama 3 config: SDPA inner attention (flex has no CPU backward)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    layers = _build_llama3_layers(
        fuse_qkv=fuse, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=32, theta=500000.0,
                                scaling=scaling, original_max_position_embeddings=64),
        attn_backend="flex")
    for lc in layers:  # "sdpa" is refused by name in 0.3.0; its module is not
        lc.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers)


def qwen3_config(*, fuse: bool) -> object:
    """A tiny Qwen3 config (torchtitan's own layer builder): per-head query/key RMSNorm,
    eps 1e-6, rotate-half RoPE (CosSinRoPE), the LM head tied to the embedding."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _build_qwen3_layers
    from torchtitan.models.qwen3.model import Qwen3Model

    hd = DIM // HEADS
    layers = _build_qwen3_layers(
        fuse_qkv=fuse, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV, head_dim=hd,
        hidden_dim=192, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=hd, max_seq_len=32, theta=1000000.0))
    for lc in layers:  # as config(): SDPA (flex has no CPU backward)
        lc.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=1e-6),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers)


#: The models checked, by name.
MODELS = {"llama3": config, "qwen3": qwen3_config}


def build(cfg):
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    # a little noise on the norms, so that their gradients are not all alike
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):  # the q/k norms too (q_norm, k_norm)
                p.add_(0.1 * torch.randn_like(p))
    return model


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("fuse", [False, True])
def test_the_workload_is_the_model_s(fuse):
    cfg = config(fuse=fuse)
    wl = kt.workload_from_torchtitan(cfg, tp=2, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=2, name="tiny")
    arch = wl.model
    assert (arch.hidden, arch.layers, arch.heads, arch.kv_heads, arch.head_dim, arch.ffn,
            arch.vocab) == (64, 2, 4, 2, 16, 192, 128)
    assert (wl.parallelism.tp, wl.microbatch_size, wl.seq_len, wl.num_microbatches,
            wl.nanobatches, wl.recompute) == (2, MBS, SEQ, 2, 2, "full")
    model = build(cfg)
    assert kt.workload_from_torchtitan(model, tp=2, microbatch_size=MBS, seq_len=SEQ,
                                       num_microbatches=2, name="tiny") == wl


def _replace_layers(cfg, **changes):
    for i, lc in enumerate(cfg.layers):
        for path, value in changes.items():
            obj = lc
            *parents, last = path.split(".")
            for name in parents:
                obj = getattr(obj, name)
            setattr(obj, last, value)
        cfg.layers[i] = lc
    return cfg


def test_what_kareus_does_not_compute_is_refused():
    from torchtitan.models.common import RMSNorm
    from torchtitan.models.common.attention import VarlenAttention
    from torchtitan.models.common.feed_forward import SigmoidGatedFeedForward
    from torchtitan.models.common.linear import Linear

    kw = dict(tp=2, microbatch_size=MBS, seq_len=SEQ, num_microbatches=2)
    cases = [
        ({"attention.qk_norm": RMSNorm.Config(normalized_shape=8)}, "qk_norm normalizes 8"),
        ({"attention.qk_norm": RMSNorm.Config(normalized_shape=16, elementwise_affine=False)},
         "without a weight"),
        ({"attention_norm.eps": 1e-6}, "different eps"),
        ({"moe": object()}, "mixture of experts"),
        ({"attention.inner_attention": VarlenAttention.Config(window_size=(8, 0))}, "window"),
        ({"feed_forward.w1.bias": True}, "biases"),
    ]
    for change, match in cases:
        with pytest.raises(WorkloadError, match=match):
            kt.workload_from_torchtitan(_replace_layers(config(fuse=True), **change), **kw)
    cfg = config(fuse=False)
    ff = cfg.layers[0].feed_forward
    cfg.layers[0].feed_forward = SigmoidGatedFeedForward.Config(
        w1=ff.w1, w2=ff.w2, w3=ff.w3, gate=Linear.Config(in_features=DIM, out_features=1))
    with pytest.raises(WorkloadError, match="SigmoidGated"):
        kt.workload_from_torchtitan(cfg, **kw)
    with pytest.raises(WorkloadError, match="TP=4"):
        kt.workload_from_torchtitan(config(fuse=True), **dict(kw, tp=4))
    with pytest.raises(ArgumentTypeError, match="Llama3Model"):
        kt.workload_from_torchtitan(torch.nn.Linear(2, 2), **kw)


def test_another_torchtitan_release_is_refused(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(kt, "_checked_version", None)
    monkeypatch.setattr(metadata, "version", lambda name: "0.4.1")
    with pytest.raises(ArgumentError, match=r"0\.3\.x; found 0\.4\.1"):
        kt.check_torchtitan_version()


@pytest.mark.parametrize("fuse", [False, True])
def test_qwen3_s_workload(fuse):
    wl = kt.workload_from_torchtitan(qwen3_config(fuse=fuse), tp=2, microbatch_size=MBS,
                                     seq_len=SEQ, num_microbatches=2, name="tiny-qwen3")
    m = wl.model
    assert (m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn) == (64, 4, 2, 16, 192)
    assert (m.qk_norm, m.norm_eps, m.tied_embeddings, m.qkv_bias) == (True, 1e-6, True, False)


def _one_rank(cfg):
    """torchtitan's model of ``cfg`` (``build``), a copy of it to plan, and the workload of
    one rank (TP = 1) running it on one microbatch."""
    ref = build(cfg)
    model = copy.deepcopy(ref)
    return ref, model, kt.workload_from_torchtitan(cfg, tp=1, microbatch_size=MBS, seq_len=SEQ,
                                                   num_microbatches=1)


#: the schedules of the one-rank tests: the blocks chained (the default) or, nanobatching,
#: per block
_SCHEDULES_AND_CHAINS = pytest.mark.parametrize(
    "schedule,chain", [("sequential", None), ("nanobatching", None), ("nanobatching", False)])


def _same_step(ref, model):
    """One forward and backward of ``ref`` and of the planned ``model`` on the same tokens:
    the same logits and every parameter's gradient; returns the tokens."""
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (ref, model):
        logits = m(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()
                                          ).backward()
        outs.append(logits.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    got = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    return tokens


@pytest.mark.parametrize("fuse", [False, True])
@_SCHEDULES_AND_CHAINS
def test_a_planned_qwen3_is_torchtitan_s_qwen3(fuse, schedule, chain):
    # TP = 1: rotate-half RoPE (no row reordering), the q/k norm weights and eps 1e-6
    cfg = qwen3_config(fuse=fuse)
    ref, model, wl = _one_rank(cfg)
    applier = kt.apply_plan(model, workload=wl, schedule=schedule, kernels="torch",
                            chain=chain)
    plain = 1.0 / (1000000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(applier.rope_inv_freq, plain)
    _same_step(ref, model)
    assert any("q_norm" in n for n, _ in model.named_parameters())
    # The model checks the workload's model field by field, whatever made it
    other = copy.deepcopy(ref)
    for change, match in (({"qk_norm": False}, "qk_norm=True"),
                          ({"norm_eps": 1e-5}, "norm_eps=1e-06")):
        wrong = wl.with_(model=attrs.evolve(wl.model, **change))
        with pytest.raises(WorkloadError, match=match) as err:
            kt.apply_plan(other, workload=wrong, kernels="torch")
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("fuse", [False, True])
@_SCHEDULES_AND_CHAINS
def test_a_planned_model_is_torchtitan_s_model(fuse, schedule, chain):
    # TP = 1: the layout (fused groups, interleaved RoPE rows), the scaled frequencies and
    # the gradients through the views, without processes; the blocks chained (the
    # default) or per block.
    cfg = config(fuse=fuse)
    ref, model, wl = _one_rank(cfg)
    applier = kt.apply_plan(model, workload=wl, schedule=schedule, kernels="torch",
                            chain=chain)
    assert len(kt.chained_blocks(model)) == (0 if chain is False else LAYERS)
    inv = applier.rope_inv_freq
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(inv, plain)  # the scaled frequencies: the check has teeth
    tokens = _same_step(ref, model)
    depths = {key[-1] for key in applier._programs}
    assert depths == ({1} if chain is False else {LAYERS})  # one stack of every layer
    assert kt.remove_plan(model) == LAYERS
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "values" not in model.layers.__dict__ and kt.chained_blocks(model) == []
    torch.testing.assert_close(model(tokens[:, :-1]), ref(tokens[:, :-1]))


def test_blocks_with_anything_around_their_call_run_per_block():
    # A stack skips the blocks' __call__: a block with a hook (fully_shard's FSDP hooks,
    # say) runs per block, checked at every forward; chain=True refuses it, typed.
    cfg = config(fuse=True)
    ref, model, wl = _one_rank(cfg)
    applier = kt.apply_plan(model, workload=wl, schedule="nanobatching", kernels="torch")
    tokens = torch.randint(0, VOCAB, (MBS, SEQ))
    want = ref(tokens)
    calls = []
    handle = model.layers["1"].register_forward_hook(lambda *a: calls.append(1))
    assert kt.chained_blocks(model) == []
    torch.testing.assert_close(model(tokens), want, rtol=1e-5, atol=1e-5)
    assert calls == [1] and {k[-1] for k in applier._programs} == {1}
    handle.remove()
    assert len(kt.chained_blocks(model)) == LAYERS
    torch.testing.assert_close(model(tokens), want, rtol=1e-5, atol=1e-5)
    assert calls == [1] and {k[-1] for k in applier._programs} == {1, LAYERS}
    # outside the decoder's forward, layers.values() is the blocks (optimizer hooks, ...)
    assert list(model.layers.values()) == [model.layers["0"], model.layers["1"]]
    with pytest.raises(ArgumentError, match="remove_plan"):
        kt.apply_plan(model, workload=wl, kernels="torch")
    kt.remove_plan(model)
    kt.apply_plan(model, workload=wl, schedule="nanobatching", kernels="torch", chain=True)
    handle = model.layers["0"].register_forward_pre_hook(lambda *a: None)
    with pytest.raises(WorkloadError, match="chain=True: a block of Llama3Model has module "
                                            "hooks"):
        model(tokens)
    kt.remove_plan(model)
    with pytest.raises(WorkloadError, match="module hooks"):
        kt.apply_plan(model, workload=wl, kernels="torch", chain=True)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing replaced
    with pytest.raises(ArgumentTypeError, match="chain"):
        kt.apply_plan(model, workload=wl, kernels="torch", chain="yes")


def test_a_workload_of_unchained_layers_runs_per_block_even_where_blocks_chain():
    # Workload.chained_layers=False: the plan costs each block run on its own, so the
    # blocks run so (the same values), and chain=True is refused before anything changes.
    cfg = config(fuse=True)
    ref, model, wl = _one_rank(cfg)
    wl = wl.with_(chained_layers=False)
    with pytest.raises(WorkloadError, match="chained_layers=False"):
        kt.apply_plan(model, workload=wl, schedule="nanobatching", kernels="torch",
                      chain=True)
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing replaced
    applier = kt.apply_plan(model, workload=wl, schedule="nanobatching", kernels="torch")
    tokens = torch.randint(0, VOCAB, (MBS, SEQ))
    assert kt.chained_blocks(model) == []
    torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
    assert {k[-1] for k in applier._programs} == {1}


@pytest.mark.parametrize("around", ["hook", "chain=False", "fully_shard"])
def test_a_plan_for_chained_layers_is_refused_where_blocks_run_one_by_one(around):
    # The plan's partitions must be those that run: a plan made for chained layers
    # (chained_layers=True, the default) where a block cannot chain (FSDP's fully_shard,
    # a hook, chain=False) is refused in one line, before anything is replaced.
    cfg = config(fuse=True)
    model = build(cfg)
    wl = kt.workload_from_torchtitan(cfg, tp=2, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=1)
    plan = make_workload_plan(wl)
    chain = None
    if around == "hook":
        model.layers["1"].register_forward_pre_hook(lambda *a: None)
    elif around == "chain=False":
        chain = False
    else:
        from torch.distributed.fsdp import FSDPModule

        blk = model.layers["0"]  # what fully_shard makes of a block: an FSDPModule
        blk.__class__ = type("FSDPBlock", (FSDPModule, type(blk)), {})
    with pytest.raises(WorkloadError) as err:
        kt.apply_plan(model, workload=wl, plan=plan, kernels="torch", chain=chain)
    msg = str(err.value)
    assert "made for chained layers" in msg and "--unchained-layers" in msg
    assert "\n" not in msg
    if around == "fully_shard":
        assert "fully_shard" in msg
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing replaced


def test_a_compiled_block_can_chain_as_apply_plan_runs_it_uncompiled():
    # torch.compile of a block (torchtitan's compile.enable) is set aside by apply_plan,
    # so it does not keep the blocks from chaining: a plan for chained layers passes the
    # chaining check (and stops at the TP group, which this test does not give)
    cfg = config(fuse=True)
    model = build(cfg)
    model.layers["0"]._compiled_call_impl = torch.compile(model.layers["0"].forward)
    assert kt._blocks_chain(model) is None
    wl = kt.workload_from_torchtitan(cfg, tp=2, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=1)
    with pytest.raises(ArgumentError, match="mesh="):
        kt.apply_plan(model, workload=wl, plan=make_workload_plan(wl), kernels="torch")


def test_apply_plan_refusals():
    cfg = config(fuse=True)
    model = build(cfg)
    kw = dict(microbatch_size=MBS, seq_len=SEQ, num_microbatches=1)
    wl = kt.workload_from_torchtitan(cfg, tp=1, **kw)
    with pytest.raises(WorkloadError, match="CP=1"):
        kt.apply_plan(model, workload=wl.with_(parallelism=Parallelism(cp=2)))
    with pytest.raises(ArgumentError, match="mesh="):
        kt.apply_plan(model, workload=kt.workload_from_torchtitan(cfg, tp=2, **kw))
    with pytest.raises(ArgumentError, match="rope_inv_freq"):
        kt.apply_plan(model, workload=wl, rope_inv_freq=torch.ones(8))
    with pytest.raises(WorkloadError, match="workload_from_torchtitan"):
        kt.apply_plan(model, workload=wl.with_(model=attrs.evolve(wl.model, ffn=256)))
    kt.apply_plan(model, workload=wl, kernels="torch")
    tokens = torch.randint(0, VOCAB, (MBS, SEQ))
    with pytest.raises(WorkloadError, match="seq_len"):
        model(tokens[:, :8])
    with pytest.raises(WorkloadError, match="masks"):
        model(tokens, None, object())
    # positions 0..seq-1 in every row: plain causal, accepted
    model(tokens, torch.arange(SEQ).expand(MBS, SEQ))


def test_wrap_trainer_enters_the_scopes_per_microbatch():
    # A stand-in with the Trainer's attributes the wrapper touches (a real Trainer needs a
    # dataset, a tokenizer and CUDA).
    cfg = config(fuse=True)
    model = build(cfg)
    wl = kt.workload_from_torchtitan(cfg, tp=1, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=2)
    applier = kt.apply_plan(model, workload=wl, schedule="sequential", kernels="torch")
    scopes = []
    real = applier.microbatch

    def spy(mb, phase):
        scopes.append((mb, phase))
        return real(mb, phase)

    applier.microbatch = spy

    def loss_fn(pred, labels, n):
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten(),
                                                 reduction="sum") / n
        return loss, None


    class Trainer:
        parallel_dims = SimpleNamespace(pp_enabled=False)
        model_parts = [model]
        train_context = staticmethod(nullcontext)

        def __init__(self):
            self.loss_fn = loss_fn
            self.fwd_bwd_fn = self._forward_backward_body

        def _forward_backward_body(self, *a):
            raise AssertionError("replaced")

        def train_step(self, batches):
            for tokens in batches:
                self.fwd_bwd_fn(tokens[:, :-1], tokens[:, 1:], tokens.numel(), {})

    trainer = Trainer()
    kt.wrap_trainer(trainer, applier)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1))
    trainer.train_step([tokens, tokens])
    trainer.train_step([tokens, tokens])
    assert scopes == [(m, ph) for m in (0, 1) for ph in ("fwd", "bwd")] * 2
    with pytest.raises(Exception, match="microbatch 2"):
        trainer.train_step([tokens] * 3)
    assert all(p.grad is not None for p in model.parameters())
    pp = Trainer()
    pp.parallel_dims = SimpleNamespace(pp_enabled=True)
    with pytest.raises(WorkloadError, match="pipeline_parallel_degree 1"):
        kt.wrap_trainer(pp, applier)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("fuse", [False, True])
def test_packed_documents_rotate_at_their_positions(fuse, name):
    # torchtitan's text loader packs documents: positions restart at each one. Under
    # torchtitan's SDPA attention (causal over the whole sequence) its blocks rotate RoPE at
    # those positions; the planned blocks do the same: same output, same gradients.
    cfg = MODELS[name](fuse=fuse)
    base = build(cfg)
    planned = copy.deepcopy(base)
    wl = kt.workload_from_torchtitan(cfg, tp=1, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=1)
    kt.apply_plan(planned, workload=wl, schedule="sequential", kernels="torch")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    packed = torch.stack([torch.cat((torch.arange(k), torch.arange(SEQ - k)))
                          for k in (3, 8, 11, 16)])
    outs = []
    for model in (base, planned):
        out = model(tokens, positions=packed)
        out.square().mean().backward()
        outs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    for n, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][n], grad, rtol=1e-4, atol=1e-6, msg=n)
    # the positions matter: plain positions give another output
    assert not torch.allclose(planned(tokens).detach(), outs[1][0], atol=1e-4)


def _flex(cfg):
    """``cfg`` with torchtitan's stock FlexAttention (block_causal document masks)."""
    from torchtitan.models.common.attention import FlexAttention

    for lc in cfg.layers:
        lc.attention.inner_attention = FlexAttention.Config()
    return cfg


def test_document_masks_need_a_workload_that_says_so():
    # FlexAttention masks packed documents: a plan needs a workload with document_tokens
    # (the attention within documents costed), and a workload with it needs such a model
    flex = _flex(config(fuse=True))
    assert kt.masks_documents(flex) and not kt.masks_documents(config(fuse=True))
    kw = dict(microbatch_size=MBS, seq_len=SEQ, num_microbatches=1)
    causal = kt.workload_from_torchtitan(flex, tp=2, **kw)
    docs = kt.workload_from_torchtitan(flex, tp=2, document_tokens=8, **kw)
    assert docs.document_tokens == 8
    with pytest.raises(WorkloadError, match="document_tokens=") as err:
        kt.apply_plan(build(flex), workload=causal, plan=make_workload_plan(causal))
    assert "\n" not in str(err.value)
    # accepted up to the TP group this process does not have
    with pytest.raises(ArgumentError, match="mesh="):
        kt.apply_plan(build(flex), workload=docs, plan=make_workload_plan(docs))
    sdpa = config(fuse=True)
    with pytest.raises(WorkloadError, match="without document_tokens"):
        kt.apply_plan(build(sdpa), workload=kt.workload_from_torchtitan(
            sdpa, tp=1, document_tokens=8, **kw), schedule="sequential")


@pytest.mark.slow
def test_planned_blocks_mask_documents_as_torchtitan_s_flex_attention():
    # torchtitan's stock attention (FlexAttention, block_causal masks built by its decoder
    # from the positions) against the planned blocks masking the same documents (the
    # dense-mask path on the CPU; FlexAttention has no CPU backward, so torchtitan's side
    # runs forward only), then the planned model's backward runs
    cfg = _flex(config(fuse=True))
    base = build(cfg)
    planned = copy.deepcopy(base)
    wl = kt.workload_from_torchtitan(cfg, tp=1, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=1, document_tokens=6)
    kt.apply_plan(planned, workload=wl, schedule="nanobatching", kernels="torch")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    packed = torch.stack([torch.cat((torch.arange(k), torch.arange(SEQ - k)))
                          for k in (3, 8, 11, 16)])
    with torch.no_grad():
        want = base(tokens, positions=packed, attention_masks=base.get_attention_masks(packed))
    got = planned(tokens, positions=packed, attention_masks=planned.get_attention_masks(packed))
    torch.testing.assert_close(got.detach(), want, rtol=1e-4, atol=1e-5)
    got.square().mean().backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all())
               for p in planned.parameters())
    # the masks matter: the same positions, causal over the whole sequence, differ
    sdpa = build(config(fuse=True))
    with torch.no_grad():
        assert not torch.allclose(sdpa(tokens, positions=packed), want, atol=1e-4)


# ------------------------------------------------------------------ two processes, gloo


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


#: (schedule, chain) of the runs: torchtitan's own blocks, then kareus's, chained (the
#: default) and, under the overlapping schedules, per block.
RUNS = [("torchtitan", None), ("sequential", None), ("nanobatching", None),
        ("nanobatching", False), ("kareus", None), ("kareus", False)]


def _own_forwards(model):
    """What every module's forward and the layers' ``values`` are (an instance attribute,
    such as torchtitan's redistribution wrapper of the model's forward, or the class's)."""
    out = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    out["layers.values"] = model.layers.__dict__.get("values")
    return out


def _worker(out_dir: str, backend: str, name: str) -> None:
    flex = name.endswith("-flex")  # "qwen3-sp-flex": torchtitan's stock FlexAttention
    name = name.removesuffix("-flex")
    sp = name.endswith("-sp")  # "qwen3-sp": torchtitan's TP plan with sequence parallelism
    name = name.removesuffix("-sp")
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.tools.utils as tt_utils
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    # (importing the model package also registers the "fake" process-group backend that
    # torchtitan's build_mesh asks for on mesh dimensions of degree 1)
    config(fuse=False)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    # torchtitan 0.3 picks "cuda" when no accelerator is found: the mesh is on the CPU here
    tt_parallel_dims.device_type = tt_utils.device_type = "cpu"
    dist_utils.set_spmd_backend(backend)
    parallelism = ParallelismConfig(tensor_parallel_degree=2, enable_sequence_parallel=sp,
                                    spmd_backend=backend)
    dims = ParallelDims.from_config(parallelism, world_size=2)
    dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    if flex:
        result = _flex_runs(MODELS[name], parallelism, dims, context)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
        return
    result: dict = {}
    make = MODELS[name]
    for fuse in (False, True):
        cfg = make(fuse=fuse)
        cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
        base = build(cfg)
        wl = kt.workload_from_torchtitan(cfg, tp=2, microbatch_size=MBS, seq_len=SEQ,
                                         num_microbatches=2)
        assert wl.parallelism.sequence_parallel == sp == kt.sequence_parallel_of(cfg)
        plan = make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410),
                                  unsplit_microbatches=(1,))
        # per block (chain=False) a plan runs only if made for blocks run one by one
        per_block = wl.with_(chained_layers=False)
        per_block_plan = make_workload_plan(per_block, pick=1, sms=8, freqs_mhz=(1980, 1410),
                                            unsplit_microbatches=(1,))
        for schedule, chain in RUNS:
            model = copy.deepcopy(base)
            with context():
                model.parallelize(dims)
            own = _own_forwards(model)
            applier = None
            if schedule != "torchtitan":
                mine = per_block if (schedule, chain) == ("kareus", False) else wl
                applier = kt.apply_plan(model, workload=mine, mesh=dims, schedule=schedule,
                                        plan=(None if schedule != "kareus" else
                                              per_block_plan if mine is per_block else plan),
                                        kernels="torch", record=True, chain=chain)
            losses, logits, forwards = [], [], []
            for mb in range(wl.num_microbatches):
                g = torch.Generator().manual_seed(10 + mb)
                tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
                with context():
                    ran = len(applier.partitions_run) if applier else 0
                    with applier.microbatch(mb, "fwd") if applier else nullcontext():
                        out = model(tokens[:, :-1])
                    if applier:  # this forward's partitions: (key, launch slot)
                        forwards.append([(k, cfg.launch_slot) for _, k, cfg
                                         in applier.partitions_run[ran:]])
                    loss = cross_entropy_loss(out, tokens[:, 1:], global_vocab_size=VOCAB)
                    loss = loss / tokens[:, 1:].numel()
                    with applier.microbatch(mb, "bwd") if applier else nullcontext():
                        loss.backward()
                losses.append(float(_full(loss).detach()))
                logits.append(_full(out).detach().clone())
            result[(fuse, schedule, chain)] = {
                "losses": losses, "logits": logits, "forwards": forwards,
                "chained": len(kt.chained_blocks(model)),
                "restored": kt.remove_plan(model) if applier else 0,
                "own_forwards": _own_forwards(model) == own,
                "grads": {n: _full(p.grad).detach().clone()
                          for n, p in model.named_parameters()},
                "placements": {n: str(getattr(p.grad, "placements", None))
                               for n, p in model.named_parameters()},
                "partitions": ([(ph, k) for ph, k, _ in applier.partitions_run]
                               if applier else []),
            }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()



def _flex_runs(make, parallelism, dims, context) -> dict:
    """TP = 2 with torchtitan's stock FlexAttention (block_causal document masks) on packed
    batches: torchtitan's own forward (no backward: FlexAttention has none on a CPU), then
    kareus's layers under the sequential baseline and under a plan made for the documents
    (``document_tokens``), forward and backward."""
    from torchtitan.components.loss import cross_entropy_loss

    cfg = _flex(make(fuse=True))
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    base = build(cfg)
    wl = kt.workload_from_torchtitan(cfg, tp=2, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=2, document_tokens=6)
    plan = make_workload_plan(wl, pick=1, sms=8)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    packed = torch.stack([torch.cat((torch.arange(k), torch.arange(SEQ - k)))
                          for k in (3, 8, 11, 16)])
    result: dict = {}
    for schedule in ("torchtitan", "sequential", "kareus"):
        model = copy.deepcopy(base)
        with context():
            model.parallelize(dims)
        applier = None
        if schedule != "torchtitan":
            applier = kt.apply_plan(model, workload=wl, mesh=dims, schedule=schedule,
                                    plan=plan if schedule == "kareus" else None,
                                    kernels="torch", record=True)
        with context():
            masks = model.get_attention_masks(packed)
            if applier is None:
                with torch.no_grad():
                    out = model(tokens[:, :-1], packed, masks)
                result[schedule] = {"logits": _full(out).detach().clone()}
                continue
            with applier.microbatch(0, "fwd"):
                out = model(tokens[:, :-1], packed, masks)
            loss = cross_entropy_loss(out, tokens[:, 1:], global_vocab_size=VOCAB)
            with applier.microbatch(0, "bwd"):
                loss.backward()
        result[schedule] = {
            "logits": _full(out).detach().clone(),
            "grads": {n: _full(p.grad).detach().clone() for n, p in model.named_parameters()},
            "partitions": [(ph, k) for ph, k, _ in applier.partitions_run]}
    return result


@pytest.mark.slow
def test_gloo_tp2_flex_documents_equal_torchtitan_s(tmp_path):
    # TP = 2 with sequence parallelism and torchtitan's stock FlexAttention on packed
    # documents: the planned layers (sequential baseline, and a plan costed for the
    # documents) give torchtitan's logits; the plan's gradients are the baseline's
    from _ranks import run_ranks  # tests/integrations, on sys.path under pytest

    res = run_ranks(__file__, tmp_path, 2, "spmd_types", "qwen3-sp-flex")
    for r in res:
        want = r["torchtitan"]["logits"]
        for schedule in ("sequential", "kareus"):
            torch.testing.assert_close(r[schedule]["logits"], want, rtol=1e-4, atol=1e-5,
                                       msg=schedule)
        assert any(ph == "bwd" for ph, _ in r["kareus"]["partitions"])
        for n, grad in r["sequential"]["grads"].items():
            torch.testing.assert_close(r["kareus"]["grads"][n], grad, rtol=1e-4, atol=1e-6,
                                       msg=n)
    assert res[0]["kareus"]["partitions"] == res[1]["kareus"]["partitions"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*sorted(MODELS), "qwen3-sp"])
@pytest.mark.parametrize("backend", ["spmd_types", "partial_dtensor"])
def test_gloo_tp2_equals_torchtitan(tmp_path, backend, name):
    from _ranks import run_ranks  # tests/integrations, on sys.path under pytest

    res = run_ranks(__file__, tmp_path, 2, backend, name)
    for r in res:
        for fuse in (False, True):
            want = r[(fuse, "torchtitan", None)]
            for schedule, chain in RUNS[1:]:
                got = r[(fuse, schedule, chain)]
                what = f"{backend} fuse={fuse} {schedule} chain={chain}"
                assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), what
                for a, b in zip(got["logits"], want["logits"], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=what)
                assert set(got["grads"]) == set(want["grads"])
                for n, g in want["grads"].items():
                    torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-6,
                                               msg=f"{what} {n}")
                assert got["chained"] == (0 if chain is False else LAYERS), what
                assert got["restored"] == LAYERS and got["own_forwards"], what
    for fuse in (False, True):
        for schedule, chain in RUNS[1:]:
            parts = [r[(fuse, schedule, chain)]["partitions"] for r in res]
            assert parts[0] and parts[0] == parts[1], "ranks ran different partitions"
        assert any(k.startswith("fwd_mlp") for _, k in res[0][(fuse, "kareus", None)]
                   ["partitions"])
        # The exposed forward collectives: in a forward cut into nanobatches, a collective
        # with nothing left to overlap runs in a partition of no ops, launched after them
        # (launch slot None; named "<kind>:tail" under the baselines, and under a plan for
        # blocks run one by one, which costs them at their own CTA count). Per block, each
        # layer's last all-reduce is one; chained, only the decoder's last.
        for schedule in ("nanobatching", "kareus"):
            split = [0, 1] if schedule == "nanobatching" else [0]  # the plan: mb 1 unsplit
            for chain, per_forward in ((False, LAYERS), (None, 1)):
                forwards = res[0][(fuse, schedule, chain)]["forwards"]
                for mb in split:
                    tails = [k for k, slot in forwards[mb] if slot is None]
                    assert len(tails) == per_forward, (schedule, chain, mb, forwards[mb])
                    if schedule == "nanobatching" or chain is False:
                        kind = "reduce_scatter" if name.endswith("-sp") else "all_reduce"
                        assert tails == [f"{kind}:tail"] * per_forward
            # the unsplit microbatch runs the same partitions either way
            if schedule == "kareus":
                assert (res[0][(fuse, schedule, None)]["forwards"][1]
                        == res[0][(fuse, schedule, False)]["forwards"][1])


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])


def test_positions_are_read_once_per_tensor(monkeypatch):
    # Reading a GPU tensor's values waits for the GPU: the blocks of one forward share one
    # positions tensor, and only the first block reads it.
    from kareus.errors import WorkloadError
    from kareus.integrations import torchtitan as tt

    reads = []
    real = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: reads.append(1) or real(a, b))
    pos = torch.arange(8).expand(2, 8).clone()
    for _ in range(4):
        assert tt._rope_positions(None, pos) is None  # 0 .. seq - 1: the shared tables
    assert len(reads) == 1
    pos.add_(0)  # written since: read again
    tt._rope_positions(None, pos)
    assert len(reads) == 2
    # packed documents: RoPE at their positions, attention causal over the sequence ...
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)
    assert torch.equal(tt._rope_positions(None, packed), packed)
    # ... or masking them where the block's attention is flex / varlen (block_causal) ...
    assert torch.equal(tt._rope_positions(object(), packed, True), packed)
    # ... and masks given to an SDPA block (a custom mask) are refused
    with pytest.raises(WorkloadError, match="not FlexAttention or VarlenAttention"):
        tt._rope_positions(object(), packed)
    with pytest.raises(WorkloadError, match="without positions"):
        tt._rope_positions(object(), None)


def test_wrap_trainer_takes_a_trainer_and_a_plan():
    with pytest.raises(ArgumentTypeError, match="Trainer"):
        kt.wrap_trainer(object(), None)
    with pytest.raises(ArgumentTypeError, match="plan must be"):
        kt.wrap_trainer(object(), 3)
    with pytest.raises(ArgumentTypeError, match="Trainer"):
        kt.workload_from_trainer(SimpleNamespace(config=None))


def test_the_trainer_s_activation_checkpoint_is_a_recomputation_policy_or_refused():
    from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

    assert kt.recompute_from_torchtitan(None) == "none"
    assert kt.recompute_from_torchtitan(FullAC.Config()) == "full"
    assert kt.recompute_from_torchtitan("none") == "none"
    assert kt.recompute_from_torchtitan("full") == "full"
    # torchtitan's per-op selective is none of kareus's policies: the one run in its
    # place is named, or the setting is refused (saying what differs)
    for setting in (SelectiveAC.Config(), "selective"):
        with pytest.raises(WorkloadError, match="per-op.*selective_as") as err:
            kt.recompute_from_torchtitan(setting)
        assert "\n" not in str(err.value)
        for policy in ("none", "selective", "full"):
            assert kt.recompute_from_torchtitan(setting, selective_as=policy) == policy
    with pytest.raises(ArgumentError, match="selective_as"):
        kt.recompute_from_torchtitan(SelectiveAC.Config(), selective_as="op")
    # selective_as concerns selective only
    assert kt.recompute_from_torchtitan(FullAC.Config(), selective_as="none") == "full"
    for setting in (MemoryBudgetAC.Config(), "memory-budget"):
        with pytest.raises(WorkloadError, match="memory-budget") as err:
            kt.recompute_from_torchtitan(setting, selective_as="full")
        assert "\n" not in str(err.value)
    with pytest.raises(ArgumentTypeError, match="activation_checkpoint"):
        kt.recompute_from_torchtitan(object())
    with pytest.raises(ArgumentTypeError, match="activation_checkpoint"):
        kt.recompute_from_torchtitan("op")


# ------------------------------------------------------------------ kareus optimize


#: torchtitan's own flags for the debug Llama 3 at TP = 2 with SDPA attention (the stock
#: FlexAttention masks documents: their length is given with --document-tokens), its
#: defaults otherwise.
TT_FLAGS = ("--module llama3 --config llama3_debugmodel --parallelism.tensor_parallel_degree 2 "
            "--override.imports kareus.testing.torchtitan_sdpa.causal_sdpa "
            "--training.seq_len 256 --training.local_batch_size 4 "
            "--training.global_batch_size 8")


def test_under_the_trainer_s_fsdp_blocks_a_plan_for_chained_layers_is_refused():
    # A stand-in Trainer with torchtitan's config of TT_FLAGS and its model, each block
    # an FSDPModule as fully_shard leaves it (torchtitan 0.3 wraps every block, at any
    # data-parallel degree): the workload is one of unchained layers, equal to the config's
    # (what kareus optimize --torchtitan-args plans for), and wrap_trainer refuses a plan
    # made for chained layers in one line, before anything is applied.
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import ConfigManager

    flags = TT_FLAGS.split() + ["activation-checkpoint:none"]
    config = ConfigManager().parse_args(flags)
    _, model_config = kt._trainer_config_copy(config)
    model = model_config.build()
    for blk in kt.planned_blocks(model):
        blk.__class__ = type("FSDP" + type(blk).__name__, (FSDPModule, type(blk)), {})
    trainer = SimpleNamespace(
        config=config, model_config=model_config, model_parts=[model],
        parallel_dims=SimpleNamespace(tp=2, cp=1, pp=1, dp_replicate=1, dp_shard=1,
                                      pp_enabled=False),
        gradient_accumulation_steps=2)
    wl = kt.workload_from_trainer(trainer)
    assert wl.chained_layers is False
    assert wl == kt.workload_from_torchtitan_config(config, world_size=2)
    with pytest.raises(WorkloadError) as err:
        kt.wrap_trainer(trainer, make_workload_plan(wl.with_(chained_layers=True)))
    msg = str(err.value)
    assert "fully_shard" in msg and "--torchtitan-args" in msg and "\n" not in msg
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing applied
    # unwrapped blocks could chain: a workload read from them says so
    for blk in kt.planned_blocks(model):
        blk.__class__ = blk.__class__.__mro__[2]
    assert kt.workload_from_trainer(trainer).chained_layers is True


def test_optimize_makes_the_plan_from_torchtitan_s_flags(tmp_path, capsys):
    from torchtitan.config import ConfigManager

    from kareus.cli import main
    from kareus.compose.plan import Plan

    common = ["--gpu", "h200-sxm", "--budget", "12", "--quiet"]
    out = tmp_path / "out"
    assert main(["optimize", "--torchtitan-args", TT_FLAGS, "--gpus", "2",
                 "--recompute", "selective", *common, "--out", str(out)]) == 0
    plan = Plan.load(out / "plan.json")
    config = ConfigManager().parse_args(TT_FLAGS.split())
    wl = kt.workload_from_torchtitan_config(config, world_size=2, selective_as="selective")
    assert plan.workload == wl.to_dict()  # what wrap_trainer checks the plan against
    # the Trainer wraps every block in FSDP: the plan is for layers run one by one
    assert plan.workload["chained_layers"] is False
    assert (wl.parallelism.tp, wl.parallelism.sp, wl.microbatch_size, wl.num_microbatches,
            wl.seq_len, wl.recompute) == (2, True, 4, 2, 256, "selective")
    # the config given is not changed (its override applied to a copy): still flex
    from torchtitan.models.common.attention import FlexAttention

    inner = config.model_spec.model.layers[0].attention.inner_attention
    assert isinstance(inner, FlexAttention.Config)
    assert kt.masks_documents(config) is False  # as the Trainer builds it: SDPA
    capsys.readouterr()
    # what the flags describe is not given twice; the rank count is needed; the stock
    # attention (document masks) is not costed; selective is named, not guessed
    stock = TT_FLAGS.replace("--override.imports kareus.testing.torchtitan_sdpa.causal_sdpa",
                             "")
    # the stock attention (FlexAttention, block_causal) with the documents' length given:
    # the plan costs the attention within documents of that length
    docs = tmp_path / "docs"
    assert main(["optimize", "--torchtitan-args", stock, "--gpus", "2", "--recompute",
                 "selective", "--document-tokens", "64", *common, "--out", str(docs)]) == 0
    stock_config = ConfigManager().parse_args(stock.split())
    assert kt.masks_documents(stock_config)
    want = kt.workload_from_torchtitan_config(stock_config, world_size=2,
                                              selective_as="selective", document_tokens=64)
    assert Plan.load(docs / "plan.json").workload == want.to_dict()
    assert want.document_tokens == 64 and want.with_(document_tokens=None) == wl
    with pytest.raises(WorkloadError, match="document_tokens="):
        kt.workload_from_torchtitan_config(stock_config, world_size=2,
                                           selective_as="selective")
    with pytest.raises(WorkloadError, match="drop document_tokens"):
        kt.workload_from_torchtitan_config(config, world_size=2, selective_as="selective",
                                           document_tokens=64)
    capsys.readouterr()
    for extra, flags, words in (
            (["--gpus", "2", "--tp", "2"], TT_FLAGS, "drop --tp"),
            ([], TT_FLAGS, "--gpus"),
            (["--gpus", "3"], TT_FLAGS, "do not make 3 ranks"),
            (["--gpus", "2", "--recompute", "selective"], stock, "give --document-tokens"),
            (["--gpus", "2", "--recompute", "selective", "--document-tokens", "64"],
             TT_FLAGS, "masks no documents"),
            (["--gpus", "2"], TT_FLAGS, "selective_as"),
            (["--gpus", "2", "--recompute", "none"], TT_FLAGS + " activation-checkpoint:full",
             "contradicts"),
            (["--gpus", "2"], TT_FLAGS + " --no-such-flag", "torchtitan's parser")):
        assert main(["optimize", "--torchtitan-args", flags, *extra, *common,
                     "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_wrap_trainer_refuses_a_mixture_of_experts_model_before_anything_else():
    # the workload models unchained MoE layers now, but the Trainer's FSDP-wrapped MoE blocks
    # run under a plan are checked nowhere: wrap_trainer's up-front check refuses them
    from kareus.errors import WorkloadError
    from kareus.model import Workload

    wl = Workload.preset("qwen3-30b-a3b", tp=1, dp=8, ep=8, microbatch_size=4, seq_len=4096,
                         chained_layers=False)
    with pytest.raises(WorkloadError, match="mixture-of-experts .* Trainer") as err:
        kt._refuse_unsupported(None, None, wl)
    assert "\n" not in str(err.value)
