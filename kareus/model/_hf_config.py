"""Reading a Hugging Face ``config.json`` as a model file.

A model's ``config.json`` (the file ``transformers`` writes beside the weights) already holds
everything kareus needs to cost a decoder layer. This module maps the keys of three families
onto the fields of [`ModelArch`][kareus.model.ModelArch]:

| ``config.json`` key | ModelArch field | note |
|---|---|---|
| hidden_size | hidden | |
| num_hidden_layers | layers | |
| num_attention_heads | heads | |
| num_key_value_heads | kv_heads | Llama: absent or null means ``heads`` |
| head_dim | head_dim | absent or null: ``hidden_size / heads`` (Qwen3: needed) |
| intermediate_size | ffn | |
| vocab_size | vocab | |
| rms_norm_eps | norm_eps | absent: 1e-6 (the families' default) |
| tie_word_embeddings | tied_embeddings | absent: false (the families' default) |
| (family) | qkv_bias | Qwen2's attention always has a QKV bias |
| (family) | qk_norm | Qwen3 and Qwen3 MoE RMS-normalise q and k per head |
| num_experts | moe.experts | Qwen3 MoE (Mixtral: num_local_experts) |
| num_experts_per_tok | moe.experts_per_token | Qwen3 MoE, Mixtral |
| moe_intermediate_size | moe.expert_ffn | Qwen3 MoE (Mixtral: intermediate_size) |
| decoder_sparse_step | moe.layer_step | Qwen3 MoE; absent: 1 (every layer) |

Qwen3 MoE (``Qwen3MoeForCausalLM``, ``model_type`` ``qwen3_moe``) is read as a model whose
layers' MLP is a mixture of experts ([`MoEArch`][kareus.model.MoEArch]; no shared
expert; the router's softmax in float32, as ``transformers`` computes it): every layer must be
an MoE layer (``decoder_sparse_step`` 1, ``mlp_only_layers`` empty), and the router's
load-balancing loss must be off (``output_router_logits`` false: kareus does not cost it).
``norm_topk_prob`` must be true: kareus's router renormalises the top-k probabilities (a
softmax over the top-k logits, which the training loop and the planned layers compute);
``transformers``' ``Qwen3MoeConfig`` defaults to false (the top-k of a softmax over every
expert, not renormalised: another weighting of the experts), so a config without the key
is refused too (Qwen/Qwen3-30B-A3B's sets it true).

Mixtral (``MixtralForCausalLM``, ``model_type`` ``mixtral``) is read the same way: every
layer is MoE, ``num_local_experts`` experts of width ``intermediate_size`` (its ``ffn`` too),
``num_experts_per_tok`` of them per token, no query/key norm; refused: a sliding window
(``sliding_window`` set: Mistral's attention then reads a window, not the whole causal
prefix), routing noise (``router_jitter_noise`` other than 0) and the load-balancing loss
(``output_router_logits``). The other families' experts keys are refused.

Anything else a config asks for that changes the work and that kareus does not compute is
refused with a one-line ``SpecFileError`` naming the key, never approximated: sliding-window
attention (``use_sliding_window``, ``layer_types``), experts (``num_experts`` and the like), an
activation other than SiLU (``hidden_act``), ``attention_bias`` in Llama and Qwen3 (their
attention then biases the output projection too), ``mlp_bias``, attention dropout, quantised
weights, and RoPE scaling other than Llama 3's (``rope_type: llama3`` rescales RoPE's
frequencies, which changes no FLOP or byte count). Keys that change neither the work nor the
layer's structure (``rope_theta``, ``max_position_embeddings``, ``torch_dtype``, token ids,
``initializer_range``, ...) are ignored.

The family defaults above are those of the ``LlamaConfig``, ``Qwen2Config`` and ``Qwen3Config``
classes in the ``transformers`` library, so a hand-written config means what ``transformers``
would make of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kareus.model._spec_file import SpecFileError, _bool, _float, _int

__all__ = ["HF_ARCHITECTURES", "hf_arch_fields", "is_hf_config"]

#: The ``architectures`` entries kareus reads, and their ``model_type``.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

#: The families whose configs describe mixture-of-experts layers kareus reads.
_MOE_FAMILIES = ("qwen3_moe", "mixtral")

#: Keys of mixture-of-experts configs: any of them set means experts, which the dense
#: layer kareus costs does not have.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
             "moe_intermediate_size")

#: RoPE scaling kinds that leave the op list unchanged (``None``: no scaling).
_ROPE_TYPES = (None, "default", "llama3")


def is_hf_config(d: Mapping[str, Any]) -> bool:
    """Whether a parsed JSON object is a Hugging Face model config rather than a kareus
    model file (it names its ``architectures`` or ``model_type``; kareus's own model files
    have neither key)."""
    return "architectures" in d or "model_type" in d


def _family(d: Mapping[str, Any], where: str) -> str:
    known = ", ".join(HF_ARCHITECTURES)
    archs = d.get("architectures")
    model_type = d.get("model_type")
    if archs is not None:
        if (not isinstance(archs, list) or len(archs) != 1
                or archs[0] not in HF_ARCHITECTURES):
            raise SpecFileError(f"{where}: architectures {archs!r:.80} is not one kareus "
                                f"computes (it reads {known})")
        family = HF_ARCHITECTURES[archs[0]]
        if model_type is not None and model_type != family:
            raise SpecFileError(f"{where}: model_type {model_type!r:.40} does not match "
                                f"architectures {archs[0]} (model_type {family!r})")
        return family
    if model_type not in HF_ARCHITECTURES.values():
        raise SpecFileError(f"{where}: model_type {model_type!r:.40} is not one kareus computes "
                            f"(it reads {', '.join(sorted(set(HF_ARCHITECTURES.values())))})")
    return str(model_type)


def _needed(d: Mapping[str, Any], key: str, family: str, where: str) -> int:
    value = d.get(key)
    if value is None:
        raise SpecFileError(f"{where}: missing {key} (a {family} config needs it)")
    return _int(value, key, where)


def _refuse_unsupported(d: Mapping[str, Any], family: str, where: str) -> None:
    """One line naming the first key whose value asks for work kareus does not compute."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise SpecFileError(f"{where}: hidden_act {act!r:.40} is not computed: kareus's MLP "
                            "is SwiGLU (hidden_act 'silu')")
    if d.get("use_sliding_window") is True:
        raise SpecFileError(f"{where}: use_sliding_window true is not computed: kareus costs "
                            "full causal attention in every layer")
    layer_types = d.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
        raise SpecFileError(f"{where}: layer_types other than 'full_attention' are not "
                            "computed (sliding-window layers): kareus costs full causal "
                            "attention in every layer")
    if family == "qwen3_moe":
        _refuse_unsupported_moe(d, where)
    elif family == "mixtral":
        _refuse_unsupported_mixtral(d, where)
    else:
        for key in _MOE_KEYS:
            if d.get(key) not in (None, 0):
                raise SpecFileError(f"{where}: {key} {d[key]!r:.40} is not computed: kareus "
                                    f"costs experts of qwen3_moe and mixtral configs only, a "
                                    f"{family} config's MLP is dense")
    if family in ("llama", "qwen3", "qwen3_moe") and d.get("attention_bias") not in (None, False):
        raise SpecFileError(f"{where}: attention_bias {d['attention_bias']!r:.40} is not "
                            f"computed: in {family} it biases the output projection as well as "
                            "QKV, and kareus costs a QKV bias only")
    if d.get("mlp_bias") not in (None, False):
        raise SpecFileError(f"{where}: mlp_bias {d['mlp_bias']!r:.40} is not computed: "
                            "kareus's MLP has no bias")
    dropout = d.get("attention_dropout", 0.0)
    if dropout is not None and (isinstance(dropout, bool) or not isinstance(dropout, (int, float))
                                or dropout != 0):
        raise SpecFileError(f"{where}: attention_dropout {dropout!r:.40} is not computed: "
                            "kareus costs attention without dropout (0.0)")
    if d.get("quantization_config") is not None:
        raise SpecFileError(f"{where}: quantization_config is not computed: kareus costs "
                            "bf16 training of unquantised weights")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is None:
            continue
        kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else rope
        if kind not in _ROPE_TYPES:
            raise SpecFileError(f"{where}: {key} of type {kind!r:.40} is not computed: kareus "
                                "takes no scaling or Llama 3's (rope_type 'llama3')")


def _refuse_router_logits(d: Mapping[str, Any], where: str) -> None:
    """The router's load-balancing loss (``output_router_logits``), which kareus does not
    cost, refused in one line."""
    if d.get("output_router_logits") not in (None, False):
        raise SpecFileError(f"{where}: output_router_logits {d['output_router_logits']!r:.40} "
                            "is not computed: kareus does not cost the router's "
                            "load-balancing loss (set it false)")


def _refuse_unsupported_moe(d: Mapping[str, Any], where: str) -> None:
    """One line naming the first key of a Qwen3 MoE config whose value kareus does not
    compute (module docstring)."""
    step = d.get("decoder_sparse_step", 1)
    if step is not None and step != 1:
        raise SpecFileError(f"{where}: decoder_sparse_step {step!r:.40} is not computed: "
                            "kareus costs models whose every layer is MoE (1)")
    dense = d.get("mlp_only_layers")
    if dense not in (None, []):
        raise SpecFileError(f"{where}: mlp_only_layers {dense!r:.60} is not computed: kareus "
                            "costs models whose every layer is MoE (an empty list)")
    _refuse_router_logits(d, where)
    if d.get("norm_topk_prob") is not True:
        raise SpecFileError(f"{where}: norm_topk_prob {d.get('norm_topk_prob')!r:.40} is not "
                            "computed: kareus's router renormalises the top-k probabilities "
                            "(a softmax over the top-k logits): set it true (absent means "
                            "transformers' default, false)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if d.get(key) not in (None, 0):
            raise SpecFileError(f"{where}: {key} {d[key]!r:.40} is not computed: a qwen3_moe "
                                "layer has no shared expert")


def _refuse_unsupported_mixtral(d: Mapping[str, Any], where: str) -> None:
    """One line naming the first key of a Mixtral config whose value kareus does not compute
    (module docstring)."""
    if d.get("sliding_window") is not None:
        raise SpecFileError(f"{where}: sliding_window {d['sliding_window']!r:.40} is not "
                            "computed: kareus costs full causal attention (null)")
    noise = d.get("router_jitter_noise", 0.0)
    if noise not in (None, 0, 0.0):
        raise SpecFileError(f"{where}: router_jitter_noise {noise!r:.40} is not computed: "
                            "kareus costs routing without noise (0.0)")
    _refuse_router_logits(d, where)


def _moe_fields(d: Mapping[str, Any], family: str, where: str) -> dict[str, Any]:
    """The [`MoEArch`][kareus.model.MoEArch] fields of a Qwen3 MoE or Mixtral config."""
    if family == "mixtral":
        return {"experts": _needed(d, "num_local_experts", family, where),
                "experts_per_token": _needed(d, "num_experts_per_tok", family, where),
                "expert_ffn": _needed(d, "intermediate_size", family, where)}
    return {"experts": _needed(d, "num_experts", "qwen3_moe", where),
            "experts_per_token": _needed(d, "num_experts_per_tok", "qwen3_moe", where),
            "expert_ffn": _needed(d, "moe_intermediate_size", "qwen3_moe", where)}


def hf_arch_fields(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The [`ModelArch`][kareus.model.ModelArch] fields of a Hugging Face config (all but
    ``name``), plus ``model_type`` (the family), checked as the module docstring says.

    Raises:
        SpecFileError: another family, a missing or ill-typed size, or a feature kareus does
            not compute (one line naming the key).
    """
    family = _family(d, where)
    _refuse_unsupported(d, family, where)
    hidden = _needed(d, "hidden_size", family, where)
    heads = _needed(d, "num_attention_heads", family, where)
    if family == "llama" and d.get("num_key_value_heads") is None:
        kv_heads = heads  # LlamaConfig: no KV-head count means multi-head attention
    else:
        kv_heads = _needed(d, "num_key_value_heads", family, where)
    if d.get("head_dim") is not None:
        head_dim = _int(d["head_dim"], "head_dim", where)
    elif family in ("qwen3", "qwen3_moe"):
        raise SpecFileError(f"{where}: missing head_dim (a {family} config needs it)")
    elif heads > 0 and hidden % heads == 0:
        head_dim = hidden // heads
    else:
        raise SpecFileError(f"{where}: no head_dim, and hidden_size {hidden} is not a "
                            f"multiple of num_attention_heads {heads}: give head_dim")
    eps = _float(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", where)
    if not math.isfinite(eps) or not 0 < eps < 1:
        raise SpecFileError(f"{where}: rms_norm_eps must be in (0, 1), got {eps!r}")
    tied = d.get("tie_word_embeddings", False)
    moe = {"moe": _moe_fields(d, family, where)} if family in _MOE_FAMILIES else {}
    return {
        "model_type": family,
        "layers": _needed(d, "num_hidden_layers", family, where),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "ffn": _needed(d, "intermediate_size", family, where),
        "vocab": _needed(d, "vocab_size", family, where),
        "qk_norm": family in ("qwen3", "qwen3_moe"),
        "norm_eps": eps,
        "qkv_bias": family == "qwen2",
        "tied_embeddings": _bool(tied, "tie_word_embeddings", where),
        **moe,
    }
