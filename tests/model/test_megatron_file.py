"""A Megatron-Core / Megatron-LM configuration as a model file (``--model-file``): its three
forms, Megatron's defaults and vocabulary padding, and the one-line refusals."""

from __future__ import annotations

import json

import pytest

from kareus.model.files import SpecFileError, load_model_file, model_from_megatron_config

#: Megatron-LM's --yaml-cfg form (the layout of its examples/gpt3/gpt_config.yaml).
YAML = """\
language_model:
  num_layers: 28
  hidden_size: 2048
  num_attention_heads: 16
  num_query_groups: 8
  ffn_hidden_size: 6144
  kv_channels: 128
  hidden_dropout: 0.0
  attention_dropout: 0.0
  layernorm_epsilon: 1.e-6
  add_bias_linear: False
  gated_linear_unit: False
  activation_func: swiglu
  normalization: "RMSNorm"
  qk_layernorm: True
model_parallel:
  tensor_model_parallel_size: 2
  sequence_parallel: True
micro_batch_size: 2
global_batch_size: 128
untie_embeddings_and_output_weights: False
position_embedding_type: rope
make_vocab_size_divisible_by: 128
vocab_size: 151936
tokenizer_type: HuggingFaceTokenizer
lr: 2.5e-4
"""

#: Megatron-LM's parsed arguments as flat JSON (attribute names of its argparse namespace).
ARGS = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
        "group_query_attention": True, "num_query_groups": 8, "ffn_hidden_size": None,
        "kv_channels": None, "swiglu": True, "add_bias_linear": False,
        "normalization": "RMSNorm", "norm_epsilon": 1e-5, "hidden_dropout": 0.0,
        "attention_dropout": 0.0, "position_embedding_type": "rope", "vocab_size": 32000,
        "tokenizer_type": "NullTokenizer", "make_vocab_size_divisible_by": 128,
        "tensor_model_parallel_size": 1, "untie_embeddings_and_output_weights": False,
        "lr": 3e-4, "train_iters": 20}


def test_megatron_lm_s_yaml(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "qwen3.yaml"
    f.write_text(YAML, encoding="utf-8")
    m = load_model_file(f)
    assert m.name == "qwen3"
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn) == (
        28, 2048, 16, 8, 128, 6144)
    assert (m.qk_norm, m.norm_eps, m.tied_embeddings) == (True, 1e-6, True)
    # Megatron-LM pads the tokenizer's vocabulary to a multiple of 128 x TP=2
    assert m.vocab == 152064


def test_megatron_lm_s_arguments_as_json(tmp_path):
    f = tmp_path / "job.json"
    f.write_text(json.dumps(ARGS), encoding="utf-8")
    m = load_model_file(f)
    # NullTokenizer: 32000 + 1 padded to 128; --swiglu without ffn: 8/3 x 1024 down to 64s
    assert (m.vocab, m.ffn, m.kv_heads, m.head_dim, m.tied_embeddings) == (
        32128, 2688, 8, 64, True)
    assert model_from_megatron_config({**ARGS, "group_query_attention": False}).kv_heads == 16
    assert model_from_megatron_config(
        {**ARGS, "untie_embeddings_and_output_weights": True}).tied_embeddings is False
    assert model_from_megatron_config({**ARGS, "padded_vocab_size": 32768}).vocab == 32768


@pytest.mark.megatron_line
def test_a_saved_transformer_config(tmp_path):
    """``dataclasses.asdict`` of a real TransformerConfig (functions by name), with the
    model's vocab_size beside it."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    import dataclasses

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                            num_query_groups=4, ffn_hidden_size=512, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            qk_layernorm=True, layernorm_epsilon=1e-6)

    def plain(v):
        if isinstance(v, (bool, int, float, str)) or v is None:
            return v
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return getattr(v, "__name__", str(v))

    saved = {f.name: plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    f = tmp_path / "transformer_config.json"
    f.write_text(json.dumps({**saved, "vocab_size": 1024}), encoding="utf-8")
    m = load_model_file(f)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab) == (
        2, 256, 8, 4, 32, 512, 1024)
    assert (m.qk_norm, m.norm_eps, m.tied_embeddings) == (True, 1e-6, True)
    with pytest.raises(SpecFileError, match="vocab_size is missing"):
        model_from_megatron_config(saved)
    # Megatron-Core's defaults are a GPT-2 layer: each difference named by its field
    bare = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8)
    with pytest.raises(SpecFileError, match="gated_linear_unit"):
        model_from_megatron_config({**{f.name: plain(getattr(bare, f.name))
                                       for f in dataclasses.fields(bare)}, "vocab_size": 8})


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_dropout": 0.1}, "hidden_dropout"),
    ({"add_bias_linear": True}, "add_bias_linear"),
    ({"normalization": "LayerNorm"}, "normalization"),
    ({"swiglu": False}, "swiglu"),
    ({"num_experts": 8}, "num_moe_experts"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
    ({"apply_layernorm_1p": True}, "layernorm_zero_centered_gamma"),
    ({"window_size": [128, 0]}, "window_size"),
    ({"multi_latent_attention": True}, "multi_latent_attention"),
    ({"rotary_percent": 0.5}, "rotary_percent"),
])
def test_what_the_layer_does_not_compute_is_refused_naming_the_field(change, field):
    with pytest.raises(SpecFileError, match=field) as err:
        model_from_megatron_config({**ARGS, **change})
    assert "\n" not in str(err.value)


def test_megatron_s_defaults_are_refused_not_assumed():
    """A minimal file gets Megatron's defaults: dropout 0.1, biases, LayerNorm."""
    minimal = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8,
               "swiglu": True}
    with pytest.raises(SpecFileError, match="add_bias_linear"):
        model_from_megatron_config(minimal)
    with pytest.raises(SpecFileError, match="hidden_dropout"):
        model_from_megatron_config({**minimal, "add_bias_linear": False,
                                    "normalization": "RMSNorm"})
    with pytest.raises(SpecFileError, match="num_layers is missing"):
        model_from_megatron_config({"language_model": {"hidden_size": 64}})
