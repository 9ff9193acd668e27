"""A Hugging Face ``config.json`` as a model file: the Llama, Qwen2 and Qwen3 families, the
layer features each maps to, and the one-line refusals of what kareus does not compute.

The configs below carry the values of the models' published ``config.json`` files
(Qwen/Qwen3-1.7B, meta-llama/Llama-3.2-3B, meta-llama/Llama-3.3-70B-Instruct,
Qwen/Qwen2.5-1.5B on Hugging Face), written into ``tmp_path``: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from kareus.errors import KareusError
from kareus.model import files
from kareus.model.files import SpecFileError, load_model_file, model_from_hf_config
from kareus.model.workload import ModelArch, Workload, get_model

QWEN3_1_7B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
LLAMA_3_2_3B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}
LLAMA_3_3_70B: dict[str, Any] = {
    **LLAMA_3_2_3B, "hidden_size": 8192, "intermediate_size": 28672,
    "num_attention_heads": 64, "num_hidden_layers": 80, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN2_5_1_5B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
    "hidden_size": 1536, "intermediate_size": 8960, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 12,
    "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.fixture(autouse=True)
def _clean_registry():
    yield
    for name in list(files.registered_models()):
        files.unregister(name)


def _config(tmp_path: Path, d: dict[str, Any], folder: str = "model") -> Path:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d), encoding="utf-8")
    return path


@pytest.mark.parametrize(("config", "preset"), [
    (QWEN3_1_7B, "qwen3-1.7b"), (LLAMA_3_2_3B, "llama3.2-3b"), (LLAMA_3_3_70B, "llama3.3-70b"),
])
def test_the_published_configs_are_the_presets(tmp_path: Path, config: dict[str, Any],
                                               preset: str) -> None:
    arch = load_model_file(_config(tmp_path, config, folder=preset))
    assert arch == attrs.evolve(get_model(preset), name=preset)
    assert model_from_hf_config(config, name=preset) == get_model(preset)
    assert arch.is_preset  # named as the preset, with the preset's every field


def test_qwen2_has_a_qkv_bias_and_no_qk_norm(tmp_path: Path) -> None:
    arch = ModelArch.from_hf_config(_config(tmp_path, QWEN2_5_1_5B, folder="Qwen2.5-1.5B"))
    assert arch == ModelArch(name="Qwen2.5-1.5B", layers=28, hidden=1536, heads=12,
                             kv_heads=2, head_dim=128, ffn=8960, vocab=151936, qk_norm=False,
                             norm_eps=1e-6, qkv_bias=True, tied_embeddings=True)
    # Qwen2's config has no attention_bias key; its attention always has the QKV bias.
    assert "attention_bias" not in QWEN2_5_1_5B


def test_names_and_defaults(tmp_path: Path) -> None:
    # The config's own name first, then the folder (the HF cache's owner/model), then the
    # family; an explicit name beats them all.
    named = {**QWEN3_1_7B, "_name_or_path": "Qwen/Qwen3-1.7B"}
    assert load_model_file(_config(tmp_path, named)).name == "qwen/qwen3-1.7b"  # names: any case
    cache = "hub/models--Qwen--Qwen3-1.7B/snapshots/0123abc"
    assert load_model_file(_config(tmp_path, QWEN3_1_7B, folder=cache)).name == "qwen/qwen3-1.7b"
    assert model_from_hf_config(QWEN3_1_7B).name == "qwen3"
    assert model_from_hf_config(named, name="mine").name == "mine"
    # A minimal Llama config: the LlamaConfig defaults (no KV-head count: multi-head
    # attention; head_dim = hidden / heads; eps 1e-6; untied).
    tiny = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 8, "intermediate_size": 1024, "vocab_size": 1000}
    arch = model_from_hf_config(tiny, name="tiny")
    assert (arch.kv_heads, arch.head_dim, arch.norm_eps, arch.tied_embeddings) == (
        8, 64, 1e-6, False)
    # The "type" spelling of older rope_scaling dicts, and transformers' rope_parameters.
    assert model_from_hf_config({**tiny, "rope_scaling": {"type": "llama3"}}, name="t")
    assert model_from_hf_config({**tiny, "rope_parameters": {"rope_type": "default",
                                                             "rope_theta": 1e4}}, name="t")


def test_workload_from_hf_config(tmp_path: Path) -> None:
    path = _config(tmp_path, QWEN3_1_7B, folder="Qwen3-1.7B")
    wl = Workload.from_hf_config(path, tp=4, cp=2, pp=2, microbatch_size=16)
    # named after its folder (in lower case, as every name): exactly the preset
    assert wl.model == get_model("qwen3-1.7b") and wl.model.is_preset
    assert (wl.parallelism.tp, wl.parallelism.cp, wl.microbatch_size) == (4, 2, 16)
    # Not a preset: its whole architecture, features included, travels in to_dict.
    path = _config(tmp_path, QWEN3_1_7B, folder="my-qwen3")
    wl = Workload.from_hf_config(path, tp=4, cp=2, pp=2, microbatch_size=16)
    assert wl.model == attrs.evolve(get_model("qwen3-1.7b"), name="my-qwen3")
    d = wl.to_dict()["model"]
    assert isinstance(d, dict) and d["qk_norm"] is True and d["norm_eps"] == 1e-6
    assert Workload.from_dict(wl.to_dict()) == wl
    # register_model takes the config.json as it takes any model file.
    assert files.register_model(path) == wl.model
    assert Workload.preset("My-Qwen3", tp=4).model == wl.model
    files.unregister("my-qwen3")


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize(("config", "needle"), [
    ({**QWEN3_1_7B, "use_sliding_window": True}, "use_sliding_window true is not computed"),
    ({**QWEN3_1_7B, "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types other than 'full_attention'"),
    ({**QWEN3_1_7B, "num_experts": 128}, "num_experts 128 is not computed"),
    ({**QWEN3_1_7B, "num_experts_per_tok": 8}, "num_experts_per_tok 8 is not computed"),
    ({**LLAMA_3_2_3B, "num_local_experts": 8}, "num_local_experts 8 is not computed"),
    ({**LLAMA_3_2_3B, "hidden_act": "gelu"}, "hidden_act 'gelu' is not computed"),
    ({**LLAMA_3_2_3B, "mlp_bias": True}, "mlp_bias True is not computed"),
    ({**LLAMA_3_2_3B, "attention_bias": True}, "attention_bias True is not computed"),
    ({**QWEN3_1_7B, "attention_bias": True}, "in qwen3 it biases the output projection"),
    ({**LLAMA_3_2_3B, "attention_dropout": 0.1}, "attention_dropout 0.1 is not computed"),
    ({**LLAMA_3_2_3B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling of type 'yarn' is not computed"),
    ({**LLAMA_3_2_3B, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling of type 'dynamic'"),
    ({**LLAMA_3_2_3B, "quantization_config": {"quant_method": "fp8"}},
     "quantization_config is not computed"),
    ({**LLAMA_3_2_3B, "architectures": ["MistralForCausalLM"]},
     "architectures ['MistralForCausalLM'] is not one kareus computes"),
    # Qwen3 MoE is read (tests/model/test_moe_files.py); a qwen3 config naming it is not
    ({**QWEN3_1_7B, "architectures": ["Qwen3MoeForCausalLM"]},
     "model_type 'qwen3' does not match architectures Qwen3MoeForCausalLM"),
    ({**LLAMA_3_2_3B, "architectures": ["LlamaForCausalLM", "Qwen3ForCausalLM"]},
     "is not one kareus computes"),
    ({**LLAMA_3_2_3B, "model_type": "qwen3"}, "model_type 'qwen3' does not match"),
    ({**_without(LLAMA_3_2_3B, "architectures"), "model_type": "gemma"},
     "model_type 'gemma' is not one kareus computes"),
    (_without(LLAMA_3_2_3B, "hidden_size"), "missing hidden_size (a llama config needs it)"),
    (_without(QWEN3_1_7B, "num_key_value_heads"), "missing num_key_value_heads"),
    (_without(QWEN3_1_7B, "head_dim"), "missing head_dim (a qwen3 config needs it)"),
    ({**_without(LLAMA_3_2_3B, "head_dim"), "num_attention_heads": 7},
     "hidden_size 3072 is not a multiple of num_attention_heads 7"),
    ({**LLAMA_3_2_3B, "num_hidden_layers": "28"}, "num_hidden_layers must be a whole number"),
    ({**LLAMA_3_2_3B, "tie_word_embeddings": "true"}, "tie_word_embeddings must be true or"),
    ({**LLAMA_3_2_3B, "rms_norm_eps": 0}, "rms_norm_eps must be in (0, 1)"),
    ({**LLAMA_3_2_3B, "rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number"),
    ({**LLAMA_3_2_3B, "num_key_value_heads": 5}, "heads (24) must be a multiple of kv_heads"),
])
def test_what_kareus_does_not_compute_is_refused_in_one_line(
        tmp_path: Path, config: dict[str, Any], needle: str) -> None:
    path = _config(tmp_path, config)
    with pytest.raises(SpecFileError) as err:
        load_model_file(path)
    msg = str(err.value)
    assert needle in msg, msg
    assert "\n" not in msg and str(path) in msg
    assert isinstance(err.value, KareusError)


def test_a_kareus_model_file_is_not_taken_for_a_config(tmp_path: Path) -> None:
    # No architectures / model_type key: the kareus format, checked as such.
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"name": "x", "hidden_size": 1}))
    with pytest.raises(SpecFileError, match="unknown key.*'hidden_size'"):
        load_model_file(path)
