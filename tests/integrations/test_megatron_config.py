"""workload_from_megatron on duck-typed configs (no Megatron-Core needed): the fields it
reads, the defaults of those it lacks, and the typed one-line refusals of what kareus's
layer does not compute."""

from __future__ import annotations

import math
import types

import pytest

from kareus.errors import ArgumentError, ArgumentTypeError, WorkloadError
from kareus.integrations._megatron_config import check_layer_config, workload_from_megatron


def silu(x):  # named like torch.nn.functional.silu
    return x


def gelu(x):
    return x


def _config(**changes):
    fields = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                  kv_channels=None, ffn_hidden_size=512, tensor_model_parallel_size=2,
                  context_parallel_size=1, pipeline_model_parallel_size=1,
                  recompute_granularity=None, gated_linear_unit=True, activation_func=silu,
                  add_bias_linear=False, normalization="RMSNorm", qk_layernorm=False,
                  sequence_parallel=False, num_moe_experts=None, layernorm_epsilon=1e-5,
                  multi_latent_attention=False, hidden_dropout=0.0, attention_dropout=0.0,
                  bf16=True)
    fields.update(changes)
    return types.SimpleNamespace(**fields)


def _wl(config, **kw):
    args = dict(microbatch_size=4, seq_len=128, num_microbatches=4, vocab_size=1000)
    args.update(kw)
    return workload_from_megatron(config, **args)


def test_the_fields_it_reads():
    wl = _wl(_config())
    m, p = wl.model, wl.parallelism
    assert (m.name, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab) == (
        "megatron-gpt", 4, 256, 8, 4, 32, 512, 1000)
    assert (p.tp, p.cp, p.pp, p.dp) == (2, 1, 1, 1)
    assert (wl.microbatch_size, wl.seq_len, wl.num_microbatches, wl.nanobatches) == (4, 128, 4, 2)
    assert wl.recompute == "none" and wl.dtype_bytes == 2


def test_defaults_and_overrides():
    # num_query_groups None: as many as heads; kv_channels given: the head dim
    wl = _wl(_config(num_query_groups=None, kv_channels=64, bf16=False), name="mine",
             nanobatches=4, tp=4, pp=2, dp=3)
    m, p = wl.model, wl.parallelism
    assert (m.name, m.heads, m.kv_heads, m.head_dim) == ("mine", 8, 8, 64)
    assert (p.tp, p.pp, p.dp, wl.nanobatches, wl.dtype_bytes) == (4, 2, 3, 4, 4)
    # A field the config lacks reads as Megatron-Core's default (here: dropout 0.1).
    cfg = _config()
    del cfg.hidden_dropout
    with pytest.raises(WorkloadError, match="hidden_dropout=0.0"):
        _wl(cfg)

@pytest.mark.parametrize(("change", "policy"), [
    ({}, "none"),
    ({"recompute_granularity": "selective"}, "selective"),  # recompute_modules None: 0.16's
    ({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}, "selective"),
    ({"recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 1}, "full"),
    ({"recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 2}, "full"),  # every layer, in units of two
    ({"recompute_granularity": "full", "recompute_method": "block",
      "recompute_num_layers": 2, "pipeline_model_parallel_size": 2}, "full"),  # 2 per stage
])
def test_megatron_s_recomputation_is_the_workload_s_policy(change, policy):
    assert _wl(_config(**change)).recompute == policy


@pytest.mark.parametrize(("change", "match"), [
    ({"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
     "recompute_modules=\\['core_attn'\\]"),
    ({"recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
     "recompute_modules"),
    ({"recompute_granularity": "full", "recompute_method": "block",
      "recompute_num_layers": 3}, "recompute_num_layers=1"),  # 3 of 4 layers
    ({"recompute_granularity": "full", "recompute_method": None,
      "recompute_num_layers": None}, "recompute_method='uniform'"),
    ({"recompute_granularity": "full", "recompute_method": "uniform",
      "recompute_num_layers": 1, "distribute_saved_activations": True},
     "distribute_saved_activations=False"),
])
def test_recomputation_kareus_does_not_run_is_refused(change, match):
    with pytest.raises(WorkloadError, match=match) as err:
        _wl(_config(**change))
    assert "\n" not in str(err.value)


def test_the_layer_s_recomputation_must_be_the_workload_s():

    cfg = _config(recompute_granularity="selective")
    wl = _wl(cfg)
    check_layer_config(cfg, wl.model, 2, recompute="selective")
    with pytest.raises(WorkloadError, match="recompute_granularity='selective'.*"
                                            "recompute='full'"):
        check_layer_config(cfg, wl.model, 2, recompute="full")


@pytest.mark.parametrize(("change", "match"), [
    ({"gated_linear_unit": False}, "SwiGLU"),
    ({"activation_func": gelu}, "activation gelu"),
    ({"add_bias_linear": True}, "add_bias_linear=False"),
    ({"add_qkv_bias": True}, "add_qkv_bias=False"),
    ({"normalization": "LayerNorm"}, "RMSNorm"),
    ({"layernorm_zero_centered_gamma": True}, "zero_centered"),
    ({"qk_l2_norm": True}, "qk_l2_norm=False"),
    ({"qk_clip": True}, "qk_clip=False"),
    ({"num_moe_experts": 8}, "moe_token_dispatcher_type='alltoall'"),  # Megatron's default
    ({"layernorm_epsilon": 0.0}, "layernorm_epsilon must be in"),
    ({"multi_latent_attention": True}, "multi-latent"),
    ({"window_size": (128, 0)}, "window_size=None"),
    ({"context_parallel_size": 2, "cp_comm_type": "a2a"}, "cp_comm_type='a2a'"),
    ({"context_parallel_size": 2, "cp_comm_type": ["p2p"] * 3 + ["a2a+p2p"]},
     "set cp_comm_type='all_gather' or 'p2p'"),
    ({"hidden_dropout": 0.1}, "dropout"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.0"),
    ({"rotary_interleaved": True}, "rotary_interleaved=False"),
    ({"fp32_residual_connection": True}, "fp32_residual_connection=False"),
    ({"apply_residual_connection_post_layernorm": True}, "pre-norm"),
    ({"softmax_scale": 1.0}, "softmax_scale=None"),
])
def test_what_kareus_does_not_compute_is_refused(change, match):
    with pytest.raises(WorkloadError, match=match) as err:
        _wl(_config(**change))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("comm", [None, "p2p", "all_gather", ["all_gather", "p2p"] * 2])
def test_context_parallelism_is_read(comm):
    # Megatron's load-balanced CP layout is kareus's: CP > 1 is read (Megatron's default
    # ring and the all-gather compute the same attention; kareus's layer all-gathers)
    cfg = _config(context_parallel_size=2, cp_comm_type=comm)
    wl = _wl(cfg)
    assert wl.parallelism.cp == 2
    check_layer_config(cfg, wl.model, tp=2, cp=2)
    with pytest.raises(WorkloadError, match="context_parallel_size=2, the workload's model CP=1"):
        check_layer_config(cfg, wl.model, tp=2)
    with pytest.raises(WorkloadError, match=r"2\*CP=4"):  # 2 x CP chunks of 126 tokens
        _wl(cfg, seq_len=126)
    # the all-to-all types are not checked without CP (Megatron ignores them there)
    _wl(_config(cp_comm_type="a2a"))


def test_qwen3_s_layer_is_read():
    # Per-head query/key RMSNorm, eps 1e-6, the output layer tied to the embedding (a
    # GPTModel argument): the model's layer features, computed by kareus's layer.
    wl = _wl(_config(qk_layernorm=True, layernorm_epsilon=1e-6),
             share_embeddings_and_output_weights=True)
    m = wl.model
    assert (m.qk_norm, m.norm_eps, m.tied_embeddings, m.qkv_bias) == (True, 1e-6, True, False)
    assert not _wl(_config()).model.qk_norm
    with pytest.raises(ArgumentTypeError, match="share_embeddings_and_output_weights"):
        _wl(_config(), share_embeddings_and_output_weights=1)


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden": 128}, "hidden_size=256"), ({"heads": 16, "head_dim": 16}, "num_attention_heads"),
    ({"kv_heads": 8}, "num_query_groups"), ({"ffn": 1024}, "ffn_hidden_size"),
    ({"qk_norm": True}, "qk_layernorm=False"), ({"norm_eps": 1e-6}, "layernorm_epsilon=1e-05"),
    ({"qkv_bias": True}, "add_qkv_bias=False"),
])
def test_a_layer_checks_its_config_against_the_workload(change, field):
    # Whatever made the workload (a preset, a hand-made ModelArch), a layer whose own config
    # differs from its model is refused in one line naming Megatron's field.
    cfg = _config()
    arch = _wl(cfg).model
    check_layer_config(cfg, arch, tp=2)
    # another attention scale (Megatron-Core main's µP sets one in the config) is refused by
    # the layer's own check too, whatever made the workload
    with pytest.raises(WorkloadError, match="softmax_scale=None"):
        check_layer_config(_config(softmax_scale=0.5), arch, tp=2)
    with pytest.raises(WorkloadError, match=field) as err:
        check_layer_config(cfg, arch.__class__(**{**arch.to_dict(), **change}), tp=2)
    assert "\n" not in str(err.value)
    with pytest.raises(WorkloadError, match="tensor_model_parallel_size=2"):
        check_layer_config(cfg, arch, tp=4)
    # The layout: sequence-sharded hidden states (sequence_parallel) or whole ones, as the
    # workload says (a no-op at TP=1, as Megatron's scatter and gather are)
    check_layer_config(_config(sequence_parallel=True), arch, tp=2, sp=True)
    check_layer_config(_config(sequence_parallel=True, tensor_model_parallel_size=1), arch,
                       tp=1, sp=False)
    for sp in (True, False):
        with pytest.raises(WorkloadError, match=f"sequence_parallel={not sp}") as err:
            check_layer_config(_config(sequence_parallel=not sp), arch, tp=2, sp=sp)
        assert "\n" not in str(err.value)


def test_sequence_parallelism_is_read():
    wl = _wl(_config(sequence_parallel=True))
    assert wl.parallelism.sp and wl.parallelism.sequence_parallel
    assert not _wl(_config()).parallelism.sp


def test_refusals_and_dimension_errors_are_typed():
    with pytest.raises(WorkloadError, match=r"and 1 more"):
        _wl(_config(hidden_dropout=0.1, rotary_interleaved=True))
    assert _wl(_config(), cp=2).parallelism.cp == 2
    with pytest.raises(ArgumentError, match="ffn_hidden_size"):
        _wl(_config(ffn_hidden_size=None))
    with pytest.raises(WorkloadError, match="kv_channels"):
        _wl(_config(hidden_size=250))
    with pytest.raises(WorkloadError, match="KV heads"):
        _wl(_config(num_query_groups=1))  # TP=2 cannot split one query group
    with pytest.raises(WorkloadError, match="nanobatches"):
        _wl(_config(), microbatch_size=3)
    assert _wl(_config(softmax_scale=1 / math.sqrt(32))).model.head_dim == 32
