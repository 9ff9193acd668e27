"""Mixture-of-experts models from files: a Qwen3 MoE ``config.json`` (the values of
Qwen/Qwen3-30B-A3B's published config on Hugging Face, written into ``tmp_path``: nothing
is downloaded), kareus's own model files with a ``[moe]`` table, and the one-line refusals
of what kareus does not compute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from kareus.model.files import SpecFileError, load_model_file, model_from_hf_config
from kareus.model.workload import Workload, get_model

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def _write(tmp_path: Path, d: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return path


def test_qwen3_moe_config_is_the_preset():
    arch = model_from_hf_config(QWEN3_30B_A3B, name="qwen3-30b-a3b")
    assert arch == get_model("qwen3-30b-a3b")


def test_qwen3_moe_config_file_makes_a_workload(tmp_path: Path):
    path = _write(tmp_path, QWEN3_30B_A3B)
    arch = load_model_file(path)
    assert arch.moe is not None and arch.moe.experts == 128
    wl = Workload.from_hf_config(path, dp=8, ep=8, microbatch_size=4)
    assert wl.parallelism.ep == 8 and wl.model.moe == arch.moe


@pytest.mark.parametrize("change, needle", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not computed"),
    ({"mlp_only_layers": [0, 47]}, "mlp_only_layers [0, 47] is not computed"),
    ({"output_router_logits": True}, "output_router_logits True is not computed"),
    ({"num_experts": None}, "missing num_experts (a qwen3_moe config needs it)"),
    ({"num_experts_per_tok": 200}, "at most moe.experts"),
    ({"attention_bias": True}, "in qwen3_moe it biases the output projection"),
    ({"shared_expert_intermediate_size": 5632}, "a qwen3_moe layer has no shared expert"),
    # the top-k of a softmax over every expert, not renormalised: another weighting
    ({"norm_topk_prob": False}, "norm_topk_prob False is not computed"),
    ({"norm_topk_prob": None}, "norm_topk_prob None is not computed"),  # transformers: False
])
def test_what_a_qwen3_moe_config_asks_beyond_kareus_is_refused(tmp_path, change, needle):
    path = _write(tmp_path, {**QWEN3_30B_A3B, **change})
    with pytest.raises(SpecFileError) as err:
        load_model_file(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_other_families_experts_are_still_refused():
    dense = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("architectures",)}
    dense["model_type"] = "qwen3"
    with pytest.raises(SpecFileError, match="num_experts 128 is not computed: kareus costs "
                                            "experts of qwen3_moe and mixtral configs only"):
        model_from_hf_config(dense)


# mistralai/Mixtral-8x7B-v0.1's config.json on Hugging Face
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}


def test_mixtral_config_is_the_preset():
    assert model_from_hf_config(MIXTRAL_8X7B, name="mixtral-8x7b") == get_model("mixtral-8x7b")


@pytest.mark.parametrize("change, needle", [
    ({"sliding_window": 4096}, "sliding_window 4096 is not computed"),
    ({"router_jitter_noise": 0.01}, "router_jitter_noise 0.01 is not computed"),
    ({"output_router_logits": True}, "output_router_logits True is not computed"),
    ({"num_local_experts": None}, "missing num_local_experts (a mixtral config needs it)"),
])
def test_what_a_mixtral_config_asks_beyond_kareus_is_refused(tmp_path, change, needle):
    path = _write(tmp_path, {**MIXTRAL_8X7B, **change})
    with pytest.raises(SpecFileError) as err:
        load_model_file(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_kareus_model_file_with_a_moe_table(tmp_path: Path):
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\nlayers = 4\nhidden = 256\nheads = 4\nkv_heads = 2\n'
                    'head_dim = 64\nffn = 512\nvocab = 1024\n\n[moe]\nexperts = 16\n'
                    'experts_per_token = 4\nexpert_ffn = 128\nshared_experts = 1\n'
                    'shared_expert_ffn = 256\nrouter_dtype = "bfloat16"\n')
    arch = load_model_file(path)
    assert arch.moe is not None and arch.moe.router_dtype_bytes == 2
    assert arch.moe.shared_experts == 1
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace("experts_per_token = 4", "topk = 4"))
    with pytest.raises(SpecFileError, match=r"model file .*bad.toml: moe: unknown field"):
        load_model_file(bad)
    # the architecture written and read back is the same
    assert attrs.evolve(arch) == type(arch).from_dict(arch.to_dict())
