"""Workloads: a model architecture, its parallelism and its batch.

The presets carry the models' public architecture configs (the ``config.json`` published
with the weights of meta-llama/Llama-3.2-3B, Qwen/Qwen3-1.7B and
meta-llama/Llama-3.3-70B-Instruct on Hugging Face), layer features included: Qwen3-1.7B
normalises queries and keys per head (``qk_norm``), uses an RMSNorm epsilon of 1e-6 and ties
its input and output embeddings; Llama-3.2-3B ties its embeddings (epsilon 1e-5); Llama-3.3-70B
does not (epsilon 1e-5). Such a ``config.json`` is itself a model file
([`model_from_hf_config`][kareus.model.files.model_from_hf_config]). A
[`Workload`][kareus.model.Workload] checks that its parallelism divides the model (heads, KV
heads, FFN width, vocabulary, layers) and that its batch splits into nanobatches.

Nanobatching splits each microbatch along the batch dimension into
``nanobatches`` equal parts, so ``microbatch_size`` must be divisible by it;
``nanobatches=1`` means no split (communication cannot then overlap any
independent computation, and only sequential schedules exist).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kareus.errors import (
    ArgumentTypeError,
    KareusError,
    UnknownPresetError,
    WorkloadError,
    short_repr,
)
from kareus.model._hf_config import hf_arch_fields, is_hf_config
from kareus.model._megatron_file import is_megatron_config, megatron_arch_fields, read_yaml
from kareus.model._spec_file import (
    SpecFileError,
    _bool,
    _check_keys,
    _float,
    _int,
    _name,
    _read_table,
    _register,
)
from kareus.model.moe import MoEArch

__all__ = [
    "MODEL_PRESETS",
    "RANK_ORDERS",
    "RECOMPUTE_POLICIES",
    "ModelArch",
    "Parallelism",
    "Workload",
    "get_model",
    "load_model_file",
    "model_from_dict",
    "model_from_hf_config",
    "model_names",
    "recompute_policy",
    "register_model",
    "registered_models",
    "unregister_model",
]


#: GPUs per node: an expert-parallel group larger than one node's would cross the network
#: (``kareus.model.partition.GPUS_PER_NODE`` is the same figure; the 8-GPU NVLink nodes of
#: DGX A100 / H100 / H200 class machines).
_GPUS_PER_NODE = 8

#: How a job's global ranks are laid out over its parallel degrees, fastest first, spelt as
#: Megatron-Core spells its ``order``: ``"tp-cp-ep-dp-pp"`` (Megatron-Core's and
#: Megatron-LM's default, and torchtitan's device mesh ``[pp, dp, cp, tp]``: a pipeline
#: stage's data-parallel replicas sit next to each other, the stages furthest apart) and
#: ``"tp-cp-ep-pp-dp"`` (Megatron-LM's ``--use-tp-pp-dp-mapping``: the stages of one
#: replica next to each other). EP folds into the ranks of one stage either way
#: (``kareus.model.moe``). The order decides which groups cross nodes: the pipeline sends
#: and the gradient reductions (``kareus.model.partition``).
RANK_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")

#: The largest size or count a workload may hold: a 32-bit index (the kernels index
#: tensors with it), and low enough that FLOP and byte counts stay finite floats.
MAX_COUNT = 2**31 - 1


def _check_whole(field: str, value: object) -> None:
    """A typed error, not a TypeError from a comparison, for a count of the wrong type."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{field} must be a whole number (int), got {value!r:.40} "
                            f"({type(value).__name__})")


RECOMPUTE_POLICIES = ("none", "selective", "full")
"""Activation recomputation policies a [`Workload`][kareus.model.Workload] names."""


def recompute_policy(value: object) -> object:
    """A recomputation setting as a policy name: ``True``/``False`` (the older boolean
    field) as ``"full"``/``"none"``; a string in lower case; anything else as given, for
    the caller's check to refuse."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str):
        return value.strip().lower()
    return value


def _check_count(field: str, value: object) -> None:
    """A whole number in 1..``MAX_COUNT``, else a typed one-line error."""
    _check_whole(field, value)
    assert isinstance(value, int)
    if not 1 <= value <= MAX_COUNT:
        raise WorkloadError(f"{field} must be in 1..{MAX_COUNT:,}, got {short_repr(value)}")


def _lower(name: object) -> object:
    """Names are case-insensitive and kept in lower case (what files and results record)."""
    return name.lower() if isinstance(name, str) else name


def _as_float(value: object) -> object:
    """A whole number as a float (``1`` and ``1.0`` are one workload, one description);
    anything else as given, for the check to refuse."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _moe(value: object) -> MoEArch | None:
    """``ModelArch.moe`` from a [`MoEArch`][kareus.model.MoEArch], its dict or ``None``."""
    if value is None or isinstance(value, MoEArch):
        return value
    if isinstance(value, Mapping):
        return MoEArch.from_dict(value)
    raise WorkloadError(f"moe must be a MoEArch, a table of its fields or None, got "
                        f"{type(value).__name__}")


@attrs.frozen(kw_only=True)
class ModelArch:
    """A decoder-only transformer with grouped-query attention and a SwiGLU MLP.

    Every layer is: RMSNorm, the fused QKV projection, RoPE on queries and keys, causal
    attention, the output projection, then RMSNorm and the SwiGLU MLP (gate, up, down), each
    block with a residual connection; the embedding before the first layer, a final RMSNorm,
    the LM head and the loss after the last. The layer features below change which kernels
    run and how much they move, so [`build_partitions`][kareus.model.build_partitions] costs
    them; their defaults are a plain Llama layer.

    Attributes:
        name: The model's name (a preset's or the user's; kept in lower case).
        layers: Transformer layers.
        hidden: Width of the residual stream.
        heads: Query heads.
        kv_heads: Key/value heads (grouped-query attention: ``heads`` is a multiple).
        head_dim: Width of one head.
        ffn: Width of the SwiGLU MLP's gate and up projections.
        vocab: Vocabulary size (rows of the embedding, columns of the LM head).
        qk_norm: Queries and keys are RMS-normalised per head (over ``head_dim``, one weight
            vector of ``head_dim`` each for q and k) after the QKV projection and before RoPE,
            as Qwen3 does.
        norm_eps: The epsilon every RMSNorm adds to the mean square (numerics only: it
            changes no FLOP or byte count, but the kernels must use the model's value).
        qkv_bias: The QKV projection adds a bias (``(heads + 2 kv_heads) x head_dim``
            values), as Qwen2 does; the output projection and the MLP have none.
        tied_embeddings: The LM head uses the input embedding's weight matrix (one
            ``vocab x hidden`` matrix, not two): its weight gradient accumulates into the
            embedding's.
        moe: The layers' mixture-of-experts block
            ([`MoEArch`][kareus.model.MoEArch]: experts, top-k, expert width, shared
            experts, router dtype) in place of the dense MLP; ``None`` (default): a dense
            SwiGLU MLP of width ``ffn``. A dict is read as ``MoEArch.from_dict`` reads it.
    """

    name: str = attrs.field(converter=_lower)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qk_norm: bool = False
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tied_embeddings: bool = False
    moe: MoEArch | None = attrs.field(default=None, converter=_moe)

    def __attrs_post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            _check_count(f"{self.name}: {field}", getattr(self, field))
        if self.heads % self.kv_heads:
            raise WorkloadError(f"{self.name}: heads ({self.heads}) must be a multiple of "
                                f"kv_heads ({self.kv_heads})")
        for field in ("qk_norm", "qkv_bias", "tied_embeddings"):
            if not isinstance(getattr(self, field), bool):
                raise WorkloadError(f"{self.name}: {field} must be True or False, got "
                                    f"{short_repr(getattr(self, field))}")
        eps = self.norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise WorkloadError(f"{self.name}: norm_eps must be a number in (0, 1) (RMSNorm's "
                                f"epsilon, e.g. 1e-5 or 1e-6), got {short_repr(eps)}")

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: the QKV (with its bias, if any), output and
        MLP weights (with ``moe``: the router, every expert and the shared experts), the two
        norm weights, and the q/k norm weights with ``qk_norm``."""
        return int(self.layer_params_per_rank(1))

    def layer_params_per_rank(self, tp: int, ep: int = 1) -> float:
        """Parameters of one transformer layer that one of ``tp`` tensor-parallel ranks
        holds: the projections (and the QKV bias, split with its output columns) divided
        over the ranks, the norm weights (the q/k norms' too) replicated on each. With
        ``moe``, the MoE block's share of one of ``ep`` expert-parallel ranks
        ([`MoEArch.params_per_rank`][kareus.model.MoEArch.params_per_rank]: experts
        not split over TP) in place of the dense MLP."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        mlp = 3 * self.hidden * self.ffn if self.moe is None else 0
        sharded = (self.hidden * qkv + self.heads * self.head_dim * self.hidden
                   + mlp + (qkv if self.qkv_bias else 0))
        replicated = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        moe = 0.0 if self.moe is None else self.moe.params_per_rank(self.hidden, ep=ep)
        return sharded / tp + replicated + moe

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding and the LM head together: one ``vocab x
        hidden`` matrix when they are tied, two otherwise."""
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Parameter count (a tied embedding and LM head counted once, untied ones once each)."""
        return self.layers * self.layer_params + self.embedding_params + self.hidden

    @property
    def is_preset(self) -> bool:
        """Whether this is exactly one of the built-in presets."""
        return MODEL_PRESETS.get(self.name) == self

    def to_dict(self) -> dict[str, object]:
        """Every field, JSON-ready (what [`from_dict`][kareus.model.ModelArch.from_dict] and
        model files take); a layer feature at its default is left out, so a model without
        features is written as before they existed (same plans, same digests)."""
        d = attrs.asdict(self)
        for f in attrs.fields(ModelArch):
            if f.name in _MODEL_FEATURES and d[f.name] == f.default:
                del d[f.name]
        if self.moe is not None:
            d["moe"] = self.moe.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ModelArch:
        """Build and check from a dict of its fields (raises ``SpecFileError``)."""
        return model_from_dict(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ModelArch:
        """Read a ``.toml`` or ``.json`` model file, or a Hugging Face ``config.json`` (see
        [`kareus.model.files`][kareus.model.files])."""
        return load_model_file(path)

    @classmethod
    def from_hf_config(cls, config: str | os.PathLike[str] | Mapping[str, Any], *,
                       name: str | None = None) -> ModelArch:
        """The architecture of a Hugging Face ``config.json`` (a local file or its dict),
        see [`model_from_hf_config`][kareus.model.files.model_from_hf_config]."""
        return model_from_hf_config(config, name=name)


#: The fields a model file must give.
_MODEL_FIELDS = ("name", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")
#: The layer features a model file may give (absent: the defaults of a plain Llama layer).
_MODEL_FEATURES = ("qk_norm", "norm_eps", "qkv_bias", "tied_embeddings", "moe")


def _build(kwargs: dict[str, Any], where: str) -> ModelArch:
    try:
        return ModelArch(**kwargs)
    except (KareusError, ValueError) as exc:
        raise SpecFileError(f"{where}: {exc}") from None


def model_from_dict(d: Mapping[str, Any], *, where: str = "model") -> ModelArch:
    """A [`ModelArch`][kareus.model.ModelArch] from a dict of its fields, checked.

    Args:
        d: ``name``, ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``ffn``,
            ``vocab`` (all needed), and optionally the layer features ``qk_norm``,
            ``qkv_bias``, ``tied_embeddings`` (true or false), ``norm_eps`` (a number) and
            ``moe`` (a table of [`MoEArch`][kareus.model.MoEArch] fields: ``[moe]`` in
            TOML); nothing else.
        where: What ``d`` is, for messages (a file name).

    Raises:
        SpecFileError: a missing field, an unknown key, a wrong type or an impossible value.
    """
    if not isinstance(d, Mapping):
        raise SpecFileError(f"{where}: expected a table of model fields, got "
                            f"{type(d).__name__}")
    _check_keys(d, _MODEL_FIELDS, where, optional=_MODEL_FEATURES)
    kwargs: dict[str, Any] = {"name": _name(d["name"], where)}
    for f in _MODEL_FIELDS[1:]:
        kwargs[f] = _int(d[f], f, where)
    for f in ("qk_norm", "qkv_bias", "tied_embeddings"):
        if f in d:
            kwargs[f] = _bool(d[f], f, where)
    if "norm_eps" in d:
        kwargs["norm_eps"] = _float(d["norm_eps"], "norm_eps", where)
    if "moe" in d:
        kwargs["moe"] = d["moe"]
    return _build(kwargs, where)


def model_from_hf_config(config: str | os.PathLike[str] | Mapping[str, Any], *,
                         name: str | None = None) -> ModelArch:
    """A [`ModelArch`][kareus.model.ModelArch] from a Hugging Face ``config.json``.

    The Llama, Qwen2 and Qwen3 families (``architectures`` ``LlamaForCausalLM``,
    ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, or ``model_type`` ``llama``, ``qwen2``,
    ``qwen3``) map onto kareus's layer: ``hidden_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` (else ``hidden_size /
    num_attention_heads``), ``intermediate_size``, ``vocab_size``, ``rms_norm_eps``,
    ``tie_word_embeddings``; Qwen2 has a QKV bias, Qwen3 normalises queries and keys per
    head. Qwen3 MoE (``Qwen3MoeForCausalLM``, ``qwen3_moe``) is read with its experts
    (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``: ``ModelArch.moe``)
    when every layer is MoE, and so is Mixtral (``MixtralForCausalLM``, ``mixtral``:
    ``num_local_experts`` experts of width ``intermediate_size``, without a sliding window). What a config asks for that kareus does not compute is refused,
    in one line naming the key: a sliding window, experts of another family, dense layers
    among MoE ones (``decoder_sparse_step``, ``mlp_only_layers``), the router's
    load-balancing loss (``output_router_logits``), an activation other than ``silu``, biases
    beyond Qwen2's QKV bias (``attention_bias`` in Llama and Qwen3 also adds one to the
    output projection; ``mlp_bias``), attention dropout, and RoPE scaling other than
    Llama 3's (which changes RoPE's frequencies, not its FLOPs). Nothing is downloaded.

    Args:
        config: The path of a local ``config.json``, or its parsed dict.
        name: The model's name; default: the config's ``_name_or_path``, else the name of
            the file's folder, else its ``model_type``.

    Raises:
        SpecFileError: the file cannot be read, or the config is of another family or asks
            for something kareus does not compute.
    """
    folder = ""
    if isinstance(config, Mapping):
        d, where = config, "Hugging Face config"
    else:
        d = _read_table(config, "model")
        where, folder = f"Hugging Face config {Path(config)}", _folder_name(Path(config))
    fields = hf_arch_fields(d, where)
    family = str(fields.pop("model_type"))
    if name is None:
        guess = d.get("_name_or_path")
        name = guess if isinstance(guess, str) and guess.strip() else (folder or family)
    return _build({"name": _name(name, where), **fields}, where)


def _folder_name(path: Path) -> str:
    """The model's name as the folder of its ``config.json`` gives it: ``owner/model`` in the
    Hugging Face cache (``models--owner--model/snapshots/<commit>/config.json``), else the
    folder's own name."""
    parent = path.resolve().parent
    repo = parent.parent.parent.name
    if parent.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--"):].replace("--", "/")
    return parent.name


def load_model_file(path: str | os.PathLike[str]) -> ModelArch:
    """Read a model architecture from a ``.toml`` or ``.json`` model file, from a
    Hugging Face ``config.json`` (recognised by its content: an ``architectures`` or
    ``model_type`` key; read as [`model_from_hf_config`][kareus.model.files.model_from_hf_config]
    does, named by its ``_name_or_path`` or its folder), or from a Megatron-Core /
    Megatron-LM configuration (``.json`` or ``.yaml``, recognised by its content; read as
    [`model_from_megatron_config`][kareus.model.files.model_from_megatron_config] does).

    Raises:
        SpecFileError: the file is missing, unreadable, not UTF-8, not TOML/JSON/YAML, or its
            content is not a valid architecture.
    """
    if Path(path).suffix.lower() in (".yaml", ".yml"):
        d = read_yaml(path)
        if not is_megatron_config(d):
            raise SpecFileError(f"model file {Path(path)}: a YAML model file is a Megatron "
                                "configuration (num_layers, hidden_size, num_attention_heads, "
                                "or a language_model section); write kareus's own fields as "
                                ".toml or .json")
        return model_from_megatron_config(path)
    d = _read_table(path, "model")
    if is_hf_config(d):
        return model_from_hf_config(path)
    if is_megatron_config(d):
        return model_from_megatron_config(path)
    return model_from_dict(d, where=f"model file {Path(path)}")


def model_from_megatron_config(config: str | os.PathLike[str] | Mapping[str, Any], *,
                               name: str | None = None) -> ModelArch:
    """A [`ModelArch`][kareus.model.ModelArch] from a Megatron-Core / Megatron-LM
    configuration: Megatron-LM's YAML (``--yaml-cfg``), its arguments as a flat JSON or YAML
    mapping, or a saved ``TransformerConfig`` with the model's ``vocab_size``; what it asks
    for that kareus's layer does not compute (dropout, biases, LayerNorm, experts, ...) is
    refused in one line naming the field. The fields and the rules are those of
    ``kareus.model.files`` (docs/integrations.md lists them).

    Args:
        config: The path of a ``.json`` / ``.yaml`` file, or its parsed mapping.
        name: The model's name; default: the file's name without its suffix
            (``megatron-gpt`` for a mapping). Plans compare architectures, not names.

    Raises:
        SpecFileError: the file cannot be read, or the configuration is not one kareus
            computes.
    """
    if isinstance(config, Mapping):
        d, where, stem = config, "Megatron config", "megatron-gpt"
    else:
        p = Path(config)
        d = read_yaml(p) if p.suffix.lower() in (".yaml", ".yml") else _read_table(p, "model")
        where, stem = f"Megatron config {p}", p.stem
    fields = megatron_arch_fields(d, where)
    return _build({"name": _name(name if name is not None else stem, where), **fields}, where)


MODEL_PRESETS: dict[str, ModelArch] = {
    "llama3.2-3b": ModelArch(name="llama3.2-3b", layers=28, hidden=3072, heads=24, kv_heads=8,
                             head_dim=128, ffn=8192, vocab=128256, norm_eps=1e-5,
                             tied_embeddings=True),
    "qwen3-1.7b": ModelArch(name="qwen3-1.7b", layers=28, hidden=2048, heads=16, kv_heads=8,
                            head_dim=128, ffn=6144, vocab=151936, qk_norm=True, norm_eps=1e-6,
                            tied_embeddings=True),
    "llama3.3-70b": ModelArch(name="llama3.3-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                              head_dim=128, ffn=28672, vocab=128256, norm_eps=1e-5,
                              tied_embeddings=False),
    # Mixture of experts. Qwen/Qwen3-30B-A3B's config.json: 48 layers, all MoE
    # (decoder_sparse_step 1, no mlp_only_layers), 128 experts of width 768, top-8, no shared
    # expert; ffn is the config's intermediate_size (its dense MLP width, which no layer
    # uses when every layer is MoE).
    "qwen3-30b-a3b": ModelArch(name="qwen3-30b-a3b", layers=48, hidden=2048, heads=32,
                               kv_heads=4, head_dim=128, ffn=6144, vocab=151936, qk_norm=True,
                               norm_eps=1e-6, tied_embeddings=False,
                               moe=MoEArch(experts=128, experts_per_token=8, expert_ffn=768)),
    # mistralai/Mixtral-8x7B-v0.1's config.json: 32 layers, every one MoE, 8 experts
    # (num_local_experts) of width 14336 (intermediate_size), top-2, no sliding window.
    "mixtral-8x7b": ModelArch(name="mixtral-8x7b", layers=32, hidden=4096, heads=32,
                              kv_heads=8, head_dim=128, ffn=14336, vocab=32000, norm_eps=1e-5,
                              tied_embeddings=False,
                              moe=MoEArch(experts=8, experts_per_token=2, expert_ffn=14336)),
}


_REGISTERED_MODELS: dict[str, ModelArch] = {}
"""Models registered at run time ([`register_model`][kareus.model.files.register_model]); written
only through ``register_model`` and ``unregister_model``."""


def registered_models() -> dict[str, ModelArch]:
    """Models registered at run time (not the presets), by name."""
    return dict(_REGISTERED_MODELS)


def unregister_model(name: str) -> None:
    """Forget the registered model of that name, in any case (presets stay)."""
    _REGISTERED_MODELS.pop(name.lower(), None)


def register_model(model: ModelArch | str | os.PathLike[str], *,
                   replace: bool = False) -> ModelArch:
    """Make a model known by name to [`get_model`][kareus.model.get_model] (and so to
    ``Workload.preset``).

    Args:
        model: A [`ModelArch`][kareus.model.ModelArch], or the path of a model file.
        replace: Allow replacing a registered model of the same name with a different one.

    The registry lives in this process only: nothing is written (a process of its own,
    such as a worker of a process pool, registers the model again).

    Returns:
        The registered architecture.

    Raises:
        SpecFileError: a bad file; the name is a preset's; or another model is registered
            under that name (and ``replace`` is false).

    Examples:
        A preset with fewer layers, under a name of its own:

        >>> import attrs
        >>> import kareus
        >>> from kareus.model import get_model
        >>> mine = attrs.evolve(get_model("qwen3-1.7b"), name="my-1.7b", layers=20)
        >>> kareus.register_model(mine) is mine
        True
        >>> kareus.Workload.preset("my-1.7b", tp=2).model.layers
        20
    """
    arch = model if isinstance(model, ModelArch) else load_model_file(model)
    return _register(_REGISTERED_MODELS, MODEL_PRESETS, arch.name, arch, name=arch.name,
                     kind="model", figures="sizes", replace=replace)


def model_names() -> list[str]:
    """Names of the model presets and of the models registered at run time."""
    return sorted({*MODEL_PRESETS, *_REGISTERED_MODELS})


def get_model(name: str | ModelArch) -> ModelArch:
    """Look up a model preset or registered model by name, in any case (a
    [`ModelArch`][kareus.model.ModelArch] passes through).

    Raises:
        UnknownPresetError: ``name`` is not a preset or a registered model; the message
            lists the known ones.
    """
    if isinstance(name, ModelArch):
        return name
    if not isinstance(name, str):
        raise ArgumentTypeError(f"model must be a preset name or a ModelArch, not "
                                f"{type(name).__name__}")
    key = name.lower()
    found = MODEL_PRESETS.get(key) or _REGISTERED_MODELS.get(key)
    if found is None:
        raise UnknownPresetError("workload", name, model_names())
    return found


@attrs.frozen(kw_only=True)
class Parallelism:
    """Tensor, context, pipeline and data parallel degrees, the TP layout, and the expert
    parallel degree.

    Attributes:
        tp, cp, pp, dp: The degrees.
        ep: Expert parallelism of a mixture-of-experts model: each of ``ep`` ranks holds
            ``experts / ep`` experts, and tokens travel to them in all-to-alls. It folds
            into the other degrees (no GPUs of its own, ``world_size`` unchanged): the
            ``ep`` ranks of a group are ranks of one pipeline stage, so ``ep`` divides
            ``tp x cp x dp`` (Megatron-Core's MoE parallel folding, expert tensor
            parallelism 1; ``kareus.model.moe``). 1: none.
        sp: Sequence parallelism (Megatron-LM's ``--sequence-parallel``, torchtitan's
            ``enable_sequence_parallel``): between the TP regions each TP rank holds
            ``1 / tp`` of the sequence, and each TP all-reduce is a reduce-scatter and an
            all-gather (``kareus.model.decoder``). With ``tp == 1`` it changes nothing (as
            in Megatron-LM, which turns it off there).
        rank_order: How the global ranks are laid out, one of ``RANK_ORDERS``
            (``global_rank``); the default is Megatron-Core's and torchtitan's.
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False
    ep: int = 1
    rank_order: str = RANK_ORDERS[0]

    def __attrs_post_init__(self) -> None:
        for field in ("tp", "cp", "pp", "dp", "ep"):
            _check_count(f"parallelism {field}", getattr(self, field))
        if not isinstance(self.sp, bool):
            raise WorkloadError(f"parallelism sp must be True or False, got {self.sp!r:.40}")
        if self.rank_order not in RANK_ORDERS:
            raise WorkloadError(f"parallelism rank_order must be one of {', '.join(RANK_ORDERS)} "
                                f"(Megatron-Core's order, fastest first), got "
                                f"{short_repr(self.rank_order)}")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise WorkloadError(f"parallelism ep={self.ep} must divide tp x cp x dp = "
                                f"{self.tp * self.cp * self.dp} (expert-parallel ranks are "
                                "ranks of one pipeline stage); raise dp or lower ep")

    @property
    def sequence_parallel(self) -> bool:
        """Whether the sequence-parallel layout runs: ``sp`` at ``tp > 1``."""
        return self.sp and self.tp > 1

    @property
    def world_size(self) -> int:
        """GPUs in the job."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def gpus_per_stage(self) -> int:
        """GPUs that run one pipeline stage of one data-parallel replica (TP x CP)."""
        return self.tp * self.cp

    def global_rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates under ``rank_order`` (TP fastest, then CP,
        then DP and PP in the order's sequence); ranks ``8 k .. 8 k + 7`` share node ``k``."""
        inner = tp + self.tp * cp
        if self.rank_order == "tp-cp-ep-pp-dp":
            return inner + self.tp * self.cp * (pp + self.pp * dp)
        return inner + self.tp * self.cp * (dp + self.dp * pp)


@attrs.frozen(kw_only=True)
class Workload:
    """A training job: model, parallelism, and the batch of one iteration.

    Attributes:
        model: The architecture.
        parallelism: TP, CP, PP, DP degrees.
        microbatch_size: Sequences per microbatch (per data-parallel replica).
        seq_len: Tokens per sequence.
        num_microbatches: Microbatches per iteration and replica.
        recompute: Activation recomputation, one of ``RECOMPUTE_POLICIES``: ``"full"`` (the
            backward re-runs each layer's forward; only layer inputs are kept),
            ``"selective"`` (the attention core is recomputed in the backward, as
            Megatron-LM's ``--recompute-activations``; everything else kept) or
            ``"none"`` (every activation the backward reads is kept). ``True`` and
            ``False`` are read as ``"full"`` and ``"none"``.
        nanobatches: Parts each microbatch is split into for overlap (>= 1): groups of
            its sequences, or, for a microbatch of one sequence, chunks of that sequence
            (``sequence_split``; CP = 1 only).
        dtype_bytes: Bytes per activation element (2 for bf16).
        routing_imbalance: Of a mixture-of-experts model under expert parallelism: the
            token rows the busiest expert-parallel rank receives over the mean (1.0:
            balanced routing, the default; at most ``ep``: every token on one rank). The
            busiest rank sets the pace of the all-to-alls and of the expert GEMMs, so both
            are costed at its load (``kareus.model.partition``).
        document_tokens: ``None`` (default): each sequence is one document, its attention
            causal over the whole sequence. Otherwise the sequences pack documents and
            the attention masks them (each token attends to the earlier tokens of its own
            document: torchtitan's FlexAttention / VarlenAttention ``block_causal``), and
            this is the documents' length in tokens as the cost model takes it: each
            sequence is cut into documents of ``document_tokens`` tokens (the last one
            the remainder), whose causal attention is costed (``document_pairs``: about
            ``seq_len x document_tokens / 2`` score pairs per sequence instead of
            ``seq_len^2 / 2``). For documents of varied lengths ``L_i`` the same work is
            ``sum L_i^2 / sum L_i`` (each token's document length, averaged over tokens:
            [`document_tokens_of`][kareus.model.document_tokens_of] measures it from a
            batch's positions), which is longer than their plain mean. CP = 1 only, and
            not with nanobatches along the sequence.
        chained_layers: Whether a stage's layers run as one chain (``True``, the default:
            kareus's training loop, a [`PlannedStack`][kareus.integrations.PlannedStack],
            torchtitan or Megatron-Core blocks chained by the adapters): layer ``l+1``'s
            first ops overlap layer ``l``'s last collective. ``False``: each layer runs as
            its own planned layer (one autograd node per layer: torchtitan's ``Trainer``,
            which wraps every block in FSDP, or Megatron-Core layers left unchained), so
            no collective overlaps across a layer boundary; ``build_partitions`` then
            costs, per layer, the computation that runs bare and the collectives that run
            exposed (``kareus.model.partition``).
    """

    model: ModelArch = attrs.field(converter=get_model)
    parallelism: Parallelism = attrs.field(factory=Parallelism)
    microbatch_size: int = 8
    seq_len: int = 4096
    num_microbatches: int = 8
    recompute: str = attrs.field(default="full", converter=recompute_policy)
    nanobatches: int = 2
    dtype_bytes: int = 2
    routing_imbalance: float = attrs.field(default=1.0, converter=_as_float)
    document_tokens: int | None = None
    chained_layers: bool = attrs.field(default=True)

    def __attrs_post_init__(self) -> None:
        m, p = self.model, self.parallelism
        if not isinstance(self.chained_layers, bool):
            raise WorkloadError(f"chained_layers must be True or False, got "
                                f"{self.chained_layers!r:.40}")
        for field in ("microbatch_size", "seq_len", "num_microbatches", "nanobatches",
                      "dtype_bytes"):
            _check_count(field, getattr(self, field))
        if self.document_tokens is not None:
            _check_count("document_tokens", self.document_tokens)
        if self.recompute not in RECOMPUTE_POLICIES:
            raise WorkloadError(f"recompute must be one of {', '.join(RECOMPUTE_POLICIES)}, "
                                f"got {self.recompute!r:.40}")
        checks = [
            (m.heads % p.tp == 0, f"TP={p.tp} does not divide the {m.heads} attention heads"),
            (m.kv_heads % p.tp == 0,
             f"TP={p.tp} does not divide the {m.kv_heads} KV heads (use TP <= {m.kv_heads})"),
            (m.ffn % p.tp == 0, f"TP={p.tp} does not divide the FFN width {m.ffn}"),
            (m.layers % p.pp == 0,
             f"PP={p.pp} does not divide the {m.layers} layers; choose a divisor of {m.layers}"),
            (self.seq_len % (2 * p.cp) == 0 or p.cp == 1,
             f"CP={p.cp} needs seq_len divisible by 2*CP={2 * p.cp} (load-balanced causal split)"),
            (not p.sequence_parallel or (self.seq_len // p.cp) % p.tp == 0,
             f"sequence parallelism at TP={p.tp} needs each rank's seq_len / CP = "
             f"{self.seq_len // p.cp} tokens per sequence divisible by TP"),
            (self.microbatch_size % self.nanobatches == 0 or self.microbatch_size == 1,
             f"microbatch_size={self.microbatch_size} does not split into "
             f"{self.nanobatches} nanobatches; use a divisor of the microbatch size (or "
             f"microbatch_size=1: one sequence, split along the sequence)"),
            (not self.sequence_split or p.cp == 1,
             f"nanobatches along the sequence (microbatch_size=1, nanobatches="
             f"{self.nanobatches}) are not modelled with CP={p.cp}: use nanobatches=1 or "
             f"cp=1"),
            (not self.sequence_split or self.seq_len % self.nanobatches == 0,
             f"seq_len={self.seq_len} does not split into {self.nanobatches} nanobatches "
             f"along the sequence; use a divisor of the sequence length"),
            (not self.sequence_split or not p.sequence_parallel
             or (self.seq_len // self.nanobatches) % p.tp == 0,
             f"sequence parallelism at TP={p.tp} needs each nanobatch's "
             f"{self.seq_len // self.nanobatches} tokens divisible by TP"),
            (self.num_microbatches >= 1, "num_microbatches must be >= 1"),
            (self.document_tokens is None or p.cp == 1,
             f"packed documents (document_tokens={self.document_tokens}) are modelled at "
             f"CP=1 only, got CP={p.cp}"),
            (self.document_tokens is None or not self.sequence_split,
             f"packed documents (document_tokens={self.document_tokens}) are not modelled "
             f"with nanobatches along the sequence (microbatch_size=1, nanobatches="
             f"{self.nanobatches}): use nanobatches=1 or a larger microbatch"),
        ]
        for ok, msg in checks:
            if not ok:
                raise WorkloadError(f"{m.name}: {msg}")
        self._check_moe()

    def _check_moe(self) -> None:
        """What kareus computes of a mixture of experts (``kareus.model.moe``), else one
        line naming the field."""
        m, p, rho = self.model, self.parallelism, self.routing_imbalance
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 1.0 <= rho <= p.ep:
            raise WorkloadError(f"{m.name}: routing_imbalance must be a number in [1, ep] = "
                                f"[1, {p.ep}] (the busiest expert-parallel rank's tokens over "
                                f"the mean), got {short_repr(rho)}")
        moe = m.moe
        if moe is None:
            if p.ep > 1:
                raise WorkloadError(f"{m.name}: ep={p.ep} needs a mixture-of-experts model "
                                    "(this one has a dense MLP): use ep=1")
            return
        checks = [
            (moe.layer_step == 1,
             f"moe.layer_step={moe.layer_step} (dense layers between MoE layers) is not "
             "costed yet: kareus models models whose every layer is MoE (layer_step=1)"),
            (moe.experts % p.ep == 0,
             f"ep={p.ep} does not divide the {moe.experts} experts"),
            # EP groups are consecutive ranks of a stage: inside one node when EP divides it
            (_GPUS_PER_NODE % p.ep == 0,
             f"ep={p.ep}: an expert-parallel all-to-all across nodes is not modelled; use an "
             f"ep that divides {_GPUS_PER_NODE} (one node's NVLink)"),
            (p.tp == 1 or p.sequence_parallel,
             f"MoE at TP={p.tp} needs sequence parallelism (sp=True, --sp), as Megatron-Core "
             "requires"),
            (p.tp == 1 or moe.shared_experts == 0,
             f"shared experts at TP={p.tp} are not modelled (Megatron-Core splits them over "
             "TP with collectives of their own): use tp=1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise WorkloadError(f"{m.name}: {msg}")

    @property
    def moe_tokens_per_rank(self) -> int:
        """Tokens of one microbatch one rank routes through its MoE block: its sequence
        shard under sequence parallelism (``tokens_per_rank / tp``), else
        ``tokens_per_rank``."""
        p = self.parallelism
        return self.tokens_per_rank // p.tp if p.sequence_parallel else self.tokens_per_rank

    @classmethod
    def preset(
        cls,
        name: str,
        *,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        dp: int = 1,
        sp: bool = False,
        ep: int = 1,
        rank_order: str = RANK_ORDERS[0],
        **kwargs: object,
    ) -> Workload:
        """A workload of a preset model, e.g. ``Workload.preset("llama3.2-3b", tp=4)``.

        The parallel degrees default to 1 (one GPU), which has no collective for kareus to
        schedule: ``kareus optimize --workload NAME`` runs ``Workload.preset(NAME, tp=4,
        pp=2)``, the other fields at their defaults (8 microbatches of 8 x 4096 tokens,
        2 nanobatches, recomputation).
        """
        return cls(model=get_model(name),
                   parallelism=Parallelism(tp=tp, cp=cp, pp=pp, dp=dp, sp=sp, ep=ep,
                                           rank_order=rank_order),
                   **kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_hf_config(
        cls,
        config: str | os.PathLike[str] | Mapping[str, Any],
        *,
        name: str | None = None,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        dp: int = 1,
        sp: bool = False,
        ep: int = 1,
        rank_order: str = RANK_ORDERS[0],
        **kwargs: object,
    ) -> Workload:
        """A workload of the model a Hugging Face ``config.json`` describes, e.g.
        ``Workload.from_hf_config("Qwen3-1.7B/config.json", tp=4, cp=2, pp=2)``.

        The architecture is read as
        [`model_from_hf_config`][kareus.model.files.model_from_hf_config] reads it (a local
        file or its dict; Llama, Qwen2, Qwen3); the other arguments are those of
        [`preset`][kareus.model.Workload.preset]. The model is not registered: to make its
        name known to [`get_model`][kareus.model.get_model] (as plans of it need), pass
        the architecture to [`register_model`][kareus.model.files.register_model].

        Raises:
            SpecFileError: the config cannot be read, or asks for what kareus does not compute.
            WorkloadError: the parallelism or batch does not fit the model.
        """
        arch = model_from_hf_config(config, name=name)
        par = Parallelism(tp=tp, cp=cp, pp=pp, dp=dp, sp=sp, ep=ep, rank_order=rank_order)
        return cls(model=arch, parallelism=par, **kwargs)  # type: ignore[arg-type]

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers on each pipeline stage."""
        return self.model.layers // self.parallelism.pp

    @property
    def sequence_split(self) -> bool:
        """Whether nanobatches split each microbatch along the sequence: a microbatch of one
        sequence (``microbatch_size == 1``) in ``nanobatches > 1`` parts, each a contiguous
        chunk of ``seq_len / nanobatches`` tokens whose causal attention reads the keys and
        values of its own and every earlier chunk (so its cost grows with its index;
        ``kareus.model.build_partitions`` costs each chunk). Otherwise nanobatches are
        ``microbatch_size / nanobatches`` whole sequences each."""
        return self.microbatch_size == 1 and self.nanobatches > 1

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one microbatch held by one rank (CP splits the sequence)."""
        return self.microbatch_size * self.seq_len // self.parallelism.cp

    @property
    def tokens_per_nanobatch(self) -> int:
        """Tokens of one nanobatch held by one rank."""
        return self.tokens_per_rank // self.nanobatches

    def with_(self, **changes: object) -> Workload:
        """A copy with some fields changed (validated again)."""
        return attrs.evolve(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line: model, parallelism and batch."""
        p = self.parallelism
        return (f"{self.model.name} TP={p.tp}{' SP' if p.sequence_parallel else ''} "
                f"CP={p.cp} PP={p.pp} DP={p.dp}{f' EP={p.ep}' if p.ep > 1 else ''} "
                f"{'' if p.rank_order == RANK_ORDERS[0] else f'order={p.rank_order} '}"
                f"mbs={self.microbatch_size} seq={self.seq_len} "
                f"microbatches={self.num_microbatches} nanobatches={self.nanobatches}"
                f"{'' if self.recompute == 'none' else f' recompute={self.recompute}'}"
                f"{f' imbalance={self.routing_imbalance:g}' if self.routing_imbalance != 1 else ''}"
                f"{'' if self.document_tokens is None else f' documents={self.document_tokens}'}"
                f"{'' if self.chained_layers else ' unchained layers'}")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready description: ``model`` is the whole architecture, name and features
        included, also for a preset (a preset may change between versions: a plan then still
        says which model it was made for, and [`from_dict`][kareus.model.Workload.from_dict]
        rebuilds that one). Descriptions written before this named a preset only; they still
        load, as the current preset. ``ep`` and ``routing_imbalance`` are written for a
        mixture-of-experts model only (a dense workload's description is as before);
        ``document_tokens`` is written where documents are masked (absent: one document per
        sequence); ``chained_layers`` only when it is ``False`` (a description without it
        means chained layers, as every one written before the setting did);
        ``rank_order`` only when it is not the default (descriptions written before the
        setting costed the ``"tp-cp-ep-pp-dp"`` layout; they load as the default, which
        differs only for jobs with ``dp > 1``, ``pp > 1`` and ``tp x cp`` under a node)."""
        p = self.parallelism
        model: object = self.model.to_dict()
        d: dict[str, object] = {
            "model": model, "tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "sp": p.sp,
            "microbatch_size": self.microbatch_size, "seq_len": self.seq_len,
            "num_microbatches": self.num_microbatches, "recompute": self.recompute,
            "nanobatches": self.nanobatches}
        if self.model.moe is not None:
            d["ep"] = p.ep
            d["routing_imbalance"] = self.routing_imbalance
        if self.document_tokens is not None:
            d["document_tokens"] = self.document_tokens
        if not self.chained_layers:
            d["chained_layers"] = False
        if p.rank_order != RANK_ORDERS[0]:
            d["rank_order"] = p.rank_order
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Workload:
        """Rebuild a workload from [`to_dict`][kareus.model.Workload.to_dict] (``results.json``, a plan's ``workload``).

        Raises:
            WorkloadError: a key is missing or the workload is invalid.
            UnknownPresetError: ``model`` names no preset or registered model.
            SpecFileError: ``model`` is an architecture with bad fields.
        """
        if not isinstance(d, dict) or "model" not in d:
            raise WorkloadError("a workload description needs at least the key 'model'")
        model = d["model"]
        arch = ModelArch.from_dict(model) if isinstance(model, dict) else get_model(str(model))
        par: dict[str, Any] = {k: int(d.get(k, 1))  # type: ignore[call-overload]
                               for k in ("tp", "cp", "pp", "dp", "ep")}
        par["sp"] = d.get("sp", False)
        if "rank_order" in d:
            par["rank_order"] = d["rank_order"]
        rest = {k: d[k] for k in ("microbatch_size", "seq_len", "num_microbatches",
                                  "recompute", "nanobatches", "dtype_bytes",
                                  "routing_imbalance", "document_tokens",
                                  "chained_layers") if k in d}
        return cls(model=arch, parallelism=Parallelism(**par), **rest)  # type: ignore[arg-type]
