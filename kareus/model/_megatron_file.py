"""Reading a Megatron-Core / Megatron-LM configuration as a model file.

A Megatron user already has the model written down in one of three forms, each readable by
``kareus optimize --model-file``:

* Megatron-LM's YAML configuration (``pretrain_gpt.py --yaml-cfg``: a ``language_model``
  section of ``TransformerConfig`` fields with ``activation_func: swiglu``, a
  ``model_parallel`` section, and Megatron-LM's other arguments at the top level);
* Megatron-LM's arguments as a flat JSON or YAML mapping (the attribute names of its parsed
  arguments: ``num_layers``, ``swiglu``, ``norm_epsilon``, ``group_query_attention``,
  ``untie_embeddings_and_output_weights``, ``vocab_size``, ...);
* a saved ``TransformerConfig`` (``dataclasses.asdict`` of it, as JSON or YAML: its field
  names, ``layernorm_epsilon``, ``gated_linear_unit`` with ``activation_func`` ``"silu"``,
  ``num_query_groups``), with the model's ``vocab_size`` beside it (``GPTModel``'s argument,
  not a config field) and, optionally, ``share_embeddings_and_output_weights``.

The file is recognised by its content (``language_model``, or ``num_layers``,
``hidden_size`` and ``num_attention_heads`` without Hugging Face's ``architectures`` /
``model_type``). The fields map onto [`ModelArch`][kareus.model.ModelArch] as
Megatron computes them: ``num_query_groups`` (only with ``group_query_attention`` in the
arguments form; as it is in the YAML's ``language_model`` and in a ``TransformerConfig``;
``null``: as many as heads), ``kv_channels`` (``null``: hidden / heads),
``ffn_hidden_size`` (``null``: 4 x hidden, or with Megatron-LM's ``swiglu`` the multiple of
64 below 8/3 x hidden), ``norm_epsilon`` / ``layernorm_epsilon``, ``qk_layernorm``,
``add_qkv_bias``; the vocabulary is ``padded_vocab_size`` when given, else ``vocab_size``
padded as Megatron-LM pads it when the file holds its arguments (``make_vocab_size_divisible_by``
x ``tensor_model_parallel_size``; the ``NullTokenizer`` adds one token), else ``vocab_size``
as it is; the embeddings are tied unless ``untie_embeddings_and_output_weights`` is true
(Megatron-LM's default) or ``share_embeddings_and_output_weights`` is false.

What the file asks for that kareus's layer does not compute is refused in one line naming
the field (``SpecFileError``), never approximated: an MLP other than SwiGLU, linear biases
(``add_bias_linear``, Megatron's default ``true``), a norm other than RMSNorm (Megatron's
default ``LayerNorm``), zero-centred gamma, an L2 query/key norm, dropout (Megatron's
default 0.1 for ``hidden_dropout`` and ``attention_dropout``), experts, multi-latent
attention, a sliding window, positions other than RoPE, partial or interleaved RoPE,
post-norm residuals. Parallelism, batch, optimizer and data fields are not part of a model
and are ignored (the CLI's options, or ``--megatron-args``, give them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kareus.model._spec_file import SpecFileError, _bool, _float, _int

__all__ = ["is_megatron_config", "megatron_arch_fields", "read_yaml"]

#: The largest YAML file read (a configuration is a few kilobytes).
_MAX_YAML_BYTES = 4 * 1024 * 1024


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``.yaml`` / ``.yml`` file's mapping (PyYAML's safe loader).

    Raises:
        SpecFileError: PyYAML is not installed, or the file is missing, too large, not
            YAML, or not a mapping.
    """
    p = Path(path)
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise SpecFileError(f"model file {p}: reading YAML needs PyYAML (pip install pyyaml), "
                            "or give the same fields as a .json file") from None
    try:
        if p.stat().st_size > _MAX_YAML_BYTES:
            raise SpecFileError(f"model file {p} is larger than {_MAX_YAML_BYTES:,} bytes: "
                                "give the model's configuration only")
        d = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecFileError(f"model file {p} does not exist: check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFileError(f"model file {p} cannot be read ({type(exc).__name__})") from None
    except yaml.YAMLError as exc:
        raise SpecFileError(f"model file {p} is not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise SpecFileError(f"model file {p} must hold a mapping of fields, got "
                            f"{type(d).__name__}")
    return d


def is_megatron_config(d: Mapping[str, Any]) -> bool:
    """Whether a parsed file is a Megatron-Core / Megatron-LM configuration (its
    ``language_model`` section, or Megatron's names of the dimensions, without Hugging
    Face's ``architectures`` / ``model_type``)."""
    if "architectures" in d or "model_type" in d:
        return False
    return isinstance(d.get("language_model"), Mapping) or all(
        k in d for k in ("num_layers", "hidden_size", "num_attention_heads"))


def _flatten(d: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """``(fields, whether they are Megatron-LM's arguments)``: the YAML form's sections
    merged over its top level."""
    flat = {k: v for k, v in d.items() if not isinstance(v, Mapping)}
    for section in ("language_model", "model_parallel"):
        if isinstance(d.get(section), Mapping):
            flat.update(d[section])
    arguments = "language_model" in d or any(
        k in d for k in ("swiglu", "norm_epsilon", "group_query_attention",
                         "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
                         "tokenizer_type", "padded_vocab_size"))
    return flat, arguments


def _activation(value: Any) -> str:
    name = getattr(value, "__name__", value)
    return str(name).rsplit(".", 1)[-1].lower() if name is not None else "none"


def megatron_arch_fields(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The [`ModelArch`][kareus.model.ModelArch] fields (without ``name``) of a Megatron
    configuration (see the module doc).

    Raises:
        SpecFileError: a dimension is missing or not a whole number, or the configuration
            asks for what kareus's layer does not compute (one line naming the field).
    """
    f, arguments = _flatten(d)

    def get(*names: str, default: Any = None) -> Any:
        for n in names:
            if n in f and f[n] is not None:
                return f[n]
        return default

    for field in ("num_layers", "hidden_size", "num_attention_heads"):
        if get(field) is None:
            raise SpecFileError(f"{where}: {field} is missing: a Megatron configuration gives "
                                "num_layers, hidden_size and num_attention_heads")
    layers = _int(f["num_layers"], "num_layers", where)
    hidden = _int(f["hidden_size"], "hidden_size", where)
    heads = _int(f["num_attention_heads"], "num_attention_heads", where)
    swiglu = (bool(get("swiglu", default=False))
              or (bool(get("gated_linear_unit", default=False))
                  and _activation(get("activation_func")) in ("silu", "swiglu"))
              or _activation(get("activation_func")) == "swiglu")
    dropout = {k: float(get(k, default=0.1)) for k in ("hidden_dropout", "attention_dropout")}
    act = get("activation_func")
    refusals = (
        (not swiglu, "swiglu" if arguments else "gated_linear_unit",
         f"kareus's MLP is SwiGLU (got activation {_activation(act)!r}): set "
         + ("swiglu: true" if arguments else "gated_linear_unit: true and activation_func: "
            "silu")),
        (bool(get("squared_relu", "quick_geglu", "openai_gelu", default=False)),
         "squared_relu", "kareus's MLP is SwiGLU: set squared_relu, quick_geglu and "
         "openai_gelu to false"),
        (bool(get("add_bias_linear", default=True)), "add_bias_linear",
         "kareus's projections have no bias (Megatron's default is true): set "
         "add_bias_linear: false"),
        (get("normalization", default="LayerNorm") != "RMSNorm", "normalization",
         f"kareus's norms are RMSNorm (Megatron's default is LayerNorm), got "
         f"{get('normalization', default='LayerNorm')!r}: set normalization: RMSNorm"),
        (bool(get("layernorm_zero_centered_gamma", "apply_layernorm_1p", default=False)),
         "layernorm_zero_centered_gamma", "kareus's RMSNorm multiplies by its weight: set "
         "layernorm_zero_centered_gamma (apply_layernorm_1p) to false"),
        (bool(get("qk_l2_norm", default=False)), "qk_l2_norm",
         "kareus's query/key norm is RMSNorm with a weight: set qk_l2_norm: false"),
        (any(v != 0.0 for v in dropout.values()), "hidden_dropout",
         f"kareus's layer computes without dropout (Megatron's default is 0.1), got "
         f"hidden_dropout {dropout['hidden_dropout']:g}, attention_dropout "
         f"{dropout['attention_dropout']:g}: set both to 0.0"),
        (get("num_moe_experts", "num_experts") is not None, "num_moe_experts",
         "kareus's layer has a dense MLP: set num_moe_experts (num_experts) to null"),
        (bool(get("multi_latent_attention", default=False)), "multi_latent_attention",
         "kareus's attention is grouped-query attention: set multi_latent_attention: false"),
        (get("window_size") is not None, "window_size",
         "kareus's attention is plain causal attention: set window_size: null"),
        (get("position_embedding_type", default="rope") != "rope", "position_embedding_type",
         "kareus's layer applies RoPE: set position_embedding_type: rope"),
        (float(get("rotary_percent", default=1.0)) != 1.0, "rotary_percent",
         "kareus's RoPE rotates whole heads: set rotary_percent: 1.0"),
        (bool(get("rotary_interleaved", default=False)), "rotary_interleaved",
         "kareus's RoPE rotates halves: set rotary_interleaved: false"),
        (bool(get("apply_residual_connection_post_layernorm", default=False)),
         "apply_residual_connection_post_layernorm",
         "kareus's layer is pre-norm: set apply_residual_connection_post_layernorm: false"),
    )
    for bad, _field, message in refusals:
        if bad:
            raise SpecFileError(f"{where}: {message}")
    # Megatron-LM's arguments gate num_query_groups by group_query_attention; its YAML's
    # language_model section and a TransformerConfig give it as it is (null: MHA).
    if arguments and "language_model" not in d and not get("group_query_attention",
                                                             default=False):
        kv_heads = heads
    else:
        kv_heads = _int(get("num_query_groups", default=heads), "num_query_groups", where)
    channels = get("kv_channels")
    if channels is None and hidden % heads:
        raise SpecFileError(f"{where}: hidden_size {hidden} is not a multiple of "
                            f"num_attention_heads {heads}: give kv_channels")
    head_dim = hidden // heads if channels is None else _int(channels, "kv_channels", where)
    ffn = get("ffn_hidden_size")
    if ffn is None:
        ffn = (int((4 * hidden * 2 / 3) / 64) * 64 if bool(get("swiglu", default=False))
               else 4 * hidden)
    return {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "ffn": _int(ffn, "ffn_hidden_size", where),
            "vocab": _vocab(get, arguments, where),
            "qk_norm": _bool(get("qk_layernorm", default=False), "qk_layernorm", where),
            "norm_eps": _float(get("norm_epsilon", "layernorm_epsilon", default=1e-5),
                               "layernorm_epsilon", where),
            "qkv_bias": _bool(get("add_qkv_bias", default=False), "add_qkv_bias", where),
            "tied_embeddings": _tied(get, where)}


def _vocab(get: Any, arguments: bool, where: str) -> int:
    padded = get("padded_vocab_size")
    if padded is not None:
        return _int(padded, "padded_vocab_size", where)
    vocab = get("vocab_size")
    if vocab is None:
        raise SpecFileError(f"{where}: vocab_size is missing: give the model's vocabulary "
                            "(vocab_size, or Megatron-LM's padded_vocab_size)")
    vocab = _int(vocab, "vocab_size", where)
    if not arguments:
        return vocab
    if get("tokenizer_type") == "NullTokenizer":
        vocab += 1  # its end-of-document token
    multiple = (_int(get("make_vocab_size_divisible_by", default=128),
                     "make_vocab_size_divisible_by", where)
                * _int(get("tensor_model_parallel_size", default=1),
                       "tensor_model_parallel_size", where))
    return int(math.ceil(vocab / multiple) * multiple)


def _tied(get: Any, where: str) -> bool:
    untie = get("untie_embeddings_and_output_weights")
    if untie is not None:
        return not _bool(untie, "untie_embeddings_and_output_weights", where)
    share = get("share_embeddings_and_output_weights")
    if share is not None:
        return _bool(share, "share_embeddings_and_output_weights", where)
    return True  # Megatron-LM's default: tied unless --untie-embeddings-and-output-weights
