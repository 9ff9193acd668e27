"""The kareus workload of a Megatron-Core model, read from its ``TransformerConfig``.

Kept apart from ``kareus.integrations.megatron`` (which imports Megatron-Core at its top)
so that the reading and its refusals import and test without Megatron-Core installed: the
config is read by attribute (duck typing), and an attribute it lacks reads as
Megatron-Core's default for that field.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import ArgumentError, ArgumentTypeError, WorkloadError
from kareus.integrations._megatron_moe import moe_from_megatron, moe_refusals
from kareus.model.workload import ModelArch, Parallelism, Workload

__all__ = ["check_layer_config", "workload_from_megatron"]


#: Megatron-Core's defaults (``TransformerConfig``) of the fields read here.
_DEFAULTS: dict[str, Any] = {
    "num_query_groups": None, "kv_channels": None, "tensor_model_parallel_size": 1,
    "context_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "recompute_granularity": None, "gated_linear_unit": False, "activation_func": None,
    "add_bias_linear": True, "add_qkv_bias": False, "normalization": "LayerNorm",
    "qk_layernorm": False, "sequence_parallel": False, "num_moe_experts": None,
    "layernorm_epsilon": 1e-5, "multi_latent_attention": False, "hidden_dropout": 0.1,
    "attention_dropout": 0.1, "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False, "rotary_interleaved": False,
    "window_size": None, "softmax_scale": None, "attention_output_gate": False,
    "experimental_attention_variant": None, "fp16": False, "bf16": False,
    "params_dtype": None, "fp32_residual_connection": False, "qk_l2_norm": False,
    "qk_clip": False, "log_max_attention_logit": False, "cp_comm_type": None,
    "recompute_method": None, "recompute_num_layers": None, "recompute_modules": None,
    "distribute_saved_activations": False, "num_layers": None,
}

#: Megatron-Core's context-parallel communication types a kareus layer stands in for. A
#: kareus layer computes its attention itself, always by all-gathering the keys and values
#: over the CP group ("all_gather", kareus's pattern); Megatron's default ring ("p2p", what
#: ``None`` means) passes the same keys and values around the ring instead: the same exact
#: attention on the same load-balanced chunks, other communication, so a config asking for
#: it is accepted and runs kareus's all-gather (the plan costs what runs). The all-to-all
#: types ("a2a": heads scattered over the CP group; "a2a+p2p": hierarchical CP groups) are
#: a layout the user chose on purpose and kareus does not run: refused.
CP_COMM_TYPES = (None, "p2p", "all_gather")

#: The activations of a SwiGLU MLP (with ``gated_linear_unit``), by function name.
_SILU = ("silu", "swiglu")


def _get(config: Any, name: str) -> Any:
    return getattr(config, name, _DEFAULTS.get(name))


def _required(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if value is None:
        raise ArgumentError(f"the Megatron config has no {name}: pass a TransformerConfig "
                            "(or an object with its fields)")
    return int(value)


def _refusals(config: Any) -> list[str]:
    """What kareus's layer does not compute, each with what to set instead."""
    act = _get(config, "activation_func")
    act_name = getattr(act, "__name__", repr(act))
    dropout = max(float(_get(config, "hidden_dropout") or 0.0),
                  float(_get(config, "attention_dropout") or 0.0))
    checks: list[tuple[bool, str]] = [
        (bool(_get(config, "gated_linear_unit")) and act_name in _SILU,
         f"kareus's MLP is SwiGLU: set gated_linear_unit=True and activation_func=F.silu "
         f"(got gated_linear_unit={_get(config, 'gated_linear_unit')}, activation "
         f"{act_name})"),
        (not _get(config, "add_bias_linear") and not _get(config, "add_qkv_bias"),
         "kareus's projections have no bias: set add_bias_linear=False and "
         "add_qkv_bias=False"),
        (_get(config, "normalization") == "RMSNorm"
         and not _get(config, "layernorm_zero_centered_gamma"),
         f"kareus's norms are RMSNorm: set normalization='RMSNorm' (got "
         f"{_get(config, 'normalization')!r}) and layernorm_zero_centered_gamma=False"),
        (not _get(config, "qk_l2_norm"), "kareus's query/key norm is RMSNorm with a weight: "
         "set qk_l2_norm=False (qk_layernorm=True with normalization='RMSNorm' is computed)"),
        (not _get(config, "qk_clip") and not _get(config, "log_max_attention_logit"),
         "kareus's attention does not record the largest attention logit: set qk_clip=False "
         "and log_max_attention_logit=False"),
        (not _get(config, "multi_latent_attention"), "kareus's attention is grouped-query "
         "attention: multi-latent attention is not supported"),
        (not _get(config, "experimental_attention_variant")
         and not _get(config, "attention_output_gate") and _get(config, "window_size") is None,
         "kareus's attention is plain causal attention: set window_size=None, "
         "attention_output_gate=False and experimental_attention_variant=None"),
        (not _get(config, "apply_residual_connection_post_layernorm"),
         "kareus's layer is pre-norm: set apply_residual_connection_post_layernorm=False"),
        (not _get(config, "fp32_residual_connection"), "kareus's layer keeps its residual "
         "in the compute dtype: set fp32_residual_connection=False"),
        (not _get(config, "rotary_interleaved"), "kareus's RoPE rotates halves: set "
         "rotary_interleaved=False"),
        (_cp_comm_ok(config),
         f"kareus's layer all-gathers keys and values over the CP group (cp_comm_type "
         f"'all_gather', or Megatron's default ring 'p2p': the same attention); got "
         f"cp_comm_type={_get(config, 'cp_comm_type')!r}: set cp_comm_type='all_gather' or "
         "'p2p'"),
        (dropout == 0.0,
         f"kareus's layer computes without dropout and the config asks for {dropout} "
         "(Megatron-Core's default is 0.1): set hidden_dropout=0.0 and attention_dropout=0.0 "
         "(Megatron-LM: --hidden-dropout 0 --attention-dropout 0)"),
    ]
    refused = [msg for ok, msg in checks if not ok]
    refused += moe_refusals(config)
    scale = _softmax_scale_refusal(config)
    if scale is not None:
        refused.append(scale)
    try:
        _recompute_policy(config)
    except WorkloadError as exc:
        refused.append(str(exc))
    return refused


def _softmax_scale_refusal(config: Any) -> str | None:
    """The refusal of an attention scale other than kareus's ``1/sqrt(head_dim)``, or
    ``None``. Checked with the layer's config too, not only when a workload is read from it:
    Megatron-Core's µP (``use_mup``, on its main branch) sets ``softmax_scale`` in the
    config's ``__post_init__``, so a config can carry another scale than its dimensions say."""
    scale = _get(config, "softmax_scale")
    if scale is None:
        return None
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size",
                                                                          None)
    channels = _get(config, "kv_channels")
    head_dim = (int(channels) if channels is not None
                else int(hidden) // int(heads) if heads and hidden else None)
    if head_dim and abs(float(scale) - head_dim ** -0.5) <= 1e-9:
        return None
    return (f"kareus's attention scales scores by 1/sqrt(head_dim); the config sets "
            f"softmax_scale={scale}: set softmax_scale=None")


def _recompute_policy(config: Any) -> str:
    """The recomputation policy (``Workload.recompute``) a Megatron-Core config asks for:
    ``recompute_granularity=None`` is ``"none"``; ``"selective"`` with ``recompute_modules``
    ``["core_attn"]`` (Megatron-Core 0.16's default) is ``"selective"`` (the attention core
    re-run in the backward); ``"full"`` with a ``recompute_method`` that recomputes every
    layer (``"uniform"``, or ``"block"`` with ``recompute_num_layers`` at least the layers
    of a pipeline stage) is ``"full"``: each layer re-run in its backward from its input.
    Megatron's uniform units of several layers keep fewer inputs than kareus, which keeps
    each layer's (the same values; a memory difference of at most one input per layer).

    Raises:
        WorkloadError: a setting kareus's layer does not run (other modules, part of the
            layers recomputed, saved activations distributed), naming the field.
    """
    granularity = _get(config, "recompute_granularity")
    if granularity is None:
        return "none"
    if granularity == "selective":
        modules = _get(config, "recompute_modules")
        modules = ["core_attn"] if modules is None else list(modules)
        if modules != ["core_attn"]:
            raise WorkloadError(f"kareus's selective recomputation re-runs the attention core "
                                f"only; the config has recompute_modules={modules}: set "
                                "recompute_modules=['core_attn']")
        return "selective"
    if granularity != "full":
        raise WorkloadError(f"recompute_granularity must be None, 'selective' or 'full' for a "
                            f"kareus layer, got {granularity!r:.40}")
    method, count = _get(config, "recompute_method"), _get(config, "recompute_num_layers")
    layers, pp = _get(config, "num_layers"), _get(config, "pipeline_model_parallel_size") or 1
    per_stage = -(-int(layers) // int(pp)) if layers else None
    every = (method == "uniform" and count is not None and int(count) >= 1) or (
        method == "block" and count is not None and per_stage is not None
        and int(count) >= per_stage)
    if not every:
        raise WorkloadError(f"kareus's full recomputation re-runs every layer; the config has "
                            f"recompute_method={method!r} with recompute_num_layers={count}: "
                            "set recompute_method='uniform' and recompute_num_layers=1")
    if _get(config, "distribute_saved_activations"):
        raise WorkloadError("kareus keeps each layer's input whole on every TP rank: set "
                            "distribute_saved_activations=False")
    return "full"


def _cp_comm_ok(config: Any) -> bool:
    if int(_get(config, "context_parallel_size") or 1) == 1:
        return True  # no CP communication at all
    kinds = _get(config, "cp_comm_type")
    kinds = kinds if isinstance(kinds, list | tuple) else [kinds]
    return all(k in CP_COMM_TYPES for k in kinds)


def _eps(config: Any) -> float:
    eps = _get(config, "layernorm_epsilon")
    try:
        value = float(eps)
    except (TypeError, ValueError):
        raise WorkloadError(f"layernorm_epsilon must be a number, got {eps!r}") from None
    if not 0.0 < value < 1.0:
        raise WorkloadError(f"layernorm_epsilon must be in (0, 1), got {eps!r}")
    return value


def _sequence_parallel(config: Any, tp: int) -> bool:
    """Whether the config's layers run sequence-parallel: ``sequence_parallel`` at TP > 1
    (at TP = 1 Megatron-Core's scatter and gather are no-ops, as kareus's ``sp`` is)."""
    return bool(_get(config, "sequence_parallel")) and int(tp) > 1


def check_layer_config(config: Any, arch: ModelArch, tp: int, cp: int = 1,
                       recompute: str | None = None, *, sp: bool | None = None,
                       ep: int | None = None) -> None:
    """Check a Megatron-Core layer's own config against the model a workload describes,
    whatever made that workload (``workload_from_megatron``, a preset, a hand-made
    [`ModelArch`][kareus.model.ModelArch]): kareus's layer computes the workload's model, so
    a config that asks for anything else is refused, in one line naming the config's field.

    Args:
        config: The layer's ``TransformerConfig``.
        arch: The workload's model.
        tp: The workload's TP degree.
        recompute: The workload's recomputation policy (``None``: not compared); the
            config's (``recompute_granularity`` and its companions) must be the same.

    Raises:
        WorkloadError: the config asks for what kareus's layer does not compute (the first
            of ``workload_from_megatron``'s refusals), or one of its fields differs from the
            workload's model (dimensions, ``qk_layernorm``, ``layernorm_epsilon``,
            ``add_qkv_bias``), TP, CP, the recomputation policy, or (``sp`` given: the
            workload's ``Parallelism.sequence_parallel``) ``sequence_parallel``; a mixture
            of experts whose block (experts, top-k, widths, shared experts, router dtype)
            or (``ep`` given) ``expert_model_parallel_size`` differs from the workload's.
    """
    refused = _refusals(config)
    if refused:
        raise WorkloadError(refused[0])
    heads = _required(config, "num_attention_heads")
    groups = _get(config, "num_query_groups")
    channels = _get(config, "kv_channels")
    mine: list[tuple[str, Any, Any, str]] = [
        ("hidden_size", _required(config, "hidden_size"), arch.hidden, "hidden"),
        ("num_attention_heads", heads, arch.heads, "heads"),
        ("num_query_groups", heads if groups is None else int(groups), arch.kv_heads,
         "kv_heads"),
        ("kv_channels", (_required(config, "hidden_size") // heads if channels is None
                         else int(channels)), arch.head_dim, "head_dim"),
        ("ffn_hidden_size", _required(config, "ffn_hidden_size"), arch.ffn, "ffn"),
        ("qk_layernorm", bool(_get(config, "qk_layernorm")), arch.qk_norm, "qk_norm"),
        ("add_qkv_bias", bool(_get(config, "add_qkv_bias")), arch.qkv_bias, "qkv_bias"),
        ("tensor_model_parallel_size", int(_get(config, "tensor_model_parallel_size") or 1),
         int(tp), "TP"),
        ("context_parallel_size", int(_get(config, "context_parallel_size") or 1), int(cp),
         "CP"),
    ]
    if sp is not None:  # the layout of the hidden states between layers
        mine.append(("sequence_parallel", _sequence_parallel(config, tp), bool(sp),
                     "parallelism sp (at TP > 1)"))
    for field, got, want, theirs in mine:
        if got != want:
            raise WorkloadError(f"the Megatron config has {field}={got}, the workload's model "
                                f"{theirs}={want}: make the workload with "
                                "workload_from_megatron(config, ...)")
    moe, config_ep = moe_from_megatron(config)
    if moe != arch.moe:
        raise WorkloadError(f"the Megatron config's mixture of experts is {moe}, the "
                            f"workload's model {arch.moe} (num_moe_experts, moe_router_topk, "
                            "moe_ffn_hidden_size, moe_shared_expert_intermediate_size, "
                            "moe_router_dtype): make the workload with "
                            "workload_from_megatron(config, ...)")
    if ep is not None and moe is not None and config_ep != int(ep):
        raise WorkloadError(f"the Megatron config has expert_model_parallel_size={config_ep}, "
                            f"the workload EP={ep}: make the workload with "
                            "workload_from_megatron(config, ...)")
    eps = _eps(config)
    if abs(eps - arch.norm_eps) > 1e-12 * max(1.0, eps):
        raise WorkloadError(f"the Megatron config has layernorm_epsilon={eps:g}, the "
                            f"workload's model norm_eps={arch.norm_eps:g}: make the workload "
                            "with workload_from_megatron(config, ...)")
    policy = _recompute_policy(config)
    if recompute is not None and policy != recompute:
        raise WorkloadError(f"the Megatron config has recompute_granularity="
                            f"{_get(config, 'recompute_granularity')!r} (recompute "
                            f"{policy!r}), the workload recompute={recompute!r}: make the "
                            "workload with workload_from_megatron(config, ...)")


def _dtype_bytes(config: Any) -> int:
    if _get(config, "bf16") or _get(config, "fp16"):
        return 2
    itemsize = getattr(_get(config, "params_dtype"), "itemsize", None)
    return int(itemsize) if itemsize else 4


def workload_from_megatron(config: Any, *, microbatch_size: int, seq_len: int,
                           num_microbatches: int, vocab_size: int, nanobatches: int = 2,
                           name: str = "megatron-gpt", tp: int | None = None,
                           cp: int | None = None, pp: int | None = None,
                           dp: int | None = None, ep: int | None = None,
                           share_embeddings_and_output_weights: bool = False) -> Workload:
    """The [`Workload`][kareus.model.Workload] of a Megatron-Core GPT model: what a plan for
    its decoder layers is made for (``kareus optimize``, ``kareus.optimize``).

    The partition types of the plan are exactly the model's layers: the dimensions come
    from the config (``hidden_size``, ``num_attention_heads``, ``num_query_groups``, ``None``
    for as many as heads, ``kv_channels``, ``None`` for ``hidden / heads``,
    ``ffn_hidden_size``, ``num_layers``), the parallel degrees from its
    ``tensor_model_parallel_size``, ``context_parallel_size`` and
    ``pipeline_model_parallel_size`` unless given, the batch from the arguments.
    Context parallelism is Megatron-Core's load-balanced layout, which is kareus's
    (``kareus.model.cp_positions``; ``seq_len`` must split into 2 x CP chunks); its
    ``cp_comm_type`` may be ``None``/``"p2p"`` (Megatron's ring) or ``"all_gather"``,
    which compute the same attention (a kareus layer all-gathers; ``CP_COMM_TYPES``),
    not the all-to-all types.

    ``sequence_parallel`` becomes the workload's ``Parallelism.sp``: kareus's layer then
    takes and returns Megatron's sequence-sharded hidden states (``[s / TP, b, h]``), with
    the TP all-gathers and reduce-scatters Megatron's own layer runs.

    The workload's recomputation policy is the config's: ``recompute_granularity=None``
    keeps every activation (``"none"``), ``"selective"`` with ``recompute_modules=
    ["core_attn"]`` re-runs the attention core in the backward (``"selective"``), ``"full"``
    with a ``recompute_method`` that recomputes every layer re-runs each layer from its
    input (``"full"``; the kareus layer recomputes itself, so run the layers chained,
    ``chain_layers(model)``, where Megatron's block would wrap them in its own checkpoint).
    Any other recomputation setting is refused, naming the field.

    The layer features are read too: ``qk_layernorm`` (with ``normalization="RMSNorm"``:
    each query and key head RMS-normalized over ``head_dim`` before RoPE, as Qwen3 does;
    Megatron's ``self_attention.q_layernorm`` and ``k_layernorm``) becomes the model's
    ``qk_norm``, ``layernorm_epsilon`` its ``norm_eps`` (any value; the
    [`PlanApplier`][kareus.integrations.PlanApplier]'s ``eps`` must be the same), and
    ``share_embeddings_and_output_weights`` (``GPTModel``'s argument, not the config's) its
    ``tied_embeddings``: the embeddings and the output layer stay Megatron's, so tying them
    changes nothing kareus runs, only the model the plan's iteration costs.

    A mixture-of-experts config (``num_moe_experts``) becomes the model's
    [`MoEArch`][kareus.model.MoEArch] and ``expert_model_parallel_size`` the workload's
    ``Parallelism.ep``: Megatron-Core's ``MoELayer`` with the all-to-all token dispatcher,
    expert tensor parallelism 1, softmax over the top-k logits, dropless, no auxiliary loss
    (``kareus.integrations._megatron_moe`` maps every MoE field; what kareus does not
    compute, e.g. a capacity factor, ``moe_aux_loss_coeff`` above 0, the z-loss, expert
    bias, sigmoid scores, group-limited routing, the all-gather or flex dispatchers, dense
    layers between MoE layers, is refused in one line naming the field). Such a workload is
    planned and emulated (``kareus optimize``) and runs in kareus's planned layer
    (``kareus_layer_spec``: Megatron-Core's local MoE spec, ``SequentialMLP`` experts).

    A config kareus's layer does not compute is refused rather than approximated: kareus's
    layer is a pre-norm Llama or Qwen3 layer (RMSNorm, causal grouped-query attention with
    rotate-half RoPE, a bias-free SwiGLU MLP) without dropout: a dropout rate above 0
    would train another model than the config says, silently, so it is refused too (Llama-style
    models train without it; Megatron-Core's default is 0.1: set both rates to 0.0).

    Args:
        config: A ``megatron.core.transformer.TransformerConfig`` (or any object with its
            fields; a missing field reads as Megatron-Core's default).
        microbatch_size: Sequences per microbatch (per data-parallel replica).
        seq_len: Tokens per sequence.
        num_microbatches: Microbatches per iteration (``get_forward_backward_func``'s).
        vocab_size: The model's vocabulary (``GPTModel``'s ``vocab_size``).
        nanobatches: Parts each microbatch is split into by the plan's baseline.
        name: The model's name in the workload and the plan.
        tp: Override the config's tensor-parallel degree.
        cp: Override the config's context-parallel degree.
        pp: Override the config's pipeline-parallel degree.
        dp: The data-parallel degree (default 1: a plan of one stage does not depend on it;
            under expert parallelism ``ep`` must divide ``tp x cp x dp``).
        ep: Override the config's expert-parallel degree (``expert_model_parallel_size``).
        share_embeddings_and_output_weights: ``GPTModel``'s argument of that name (the
            output layer reuses the input embedding).

    Raises:
        WorkloadError: the config describes a layer kareus does not compute (one line
            naming the field to set), or the dimensions do not divide.
        ArgumentError: the config lacks a dimension.
    """
    if not isinstance(share_embeddings_and_output_weights, bool):
        raise ArgumentTypeError("share_embeddings_and_output_weights must be a bool, got "
                                f"{type(share_embeddings_and_output_weights).__name__}")
    refused = _refusals(config)
    eps = _eps(config)
    cp_ = int(cp if cp is not None else (_get(config, "context_parallel_size") or 1))
    if refused:
        raise WorkloadError(refused[0] + (f" (and {len(refused) - 1} more)"
                                          if len(refused) > 1 else ""))
    hidden = _required(config, "hidden_size")
    heads = _required(config, "num_attention_heads")
    groups = _get(config, "num_query_groups")
    kv_heads = heads if groups is None else int(groups)
    channels = _get(config, "kv_channels")
    if channels is None and hidden % heads:
        raise WorkloadError(f"hidden_size={hidden} is not a multiple of num_attention_heads="
                            f"{heads}: set kv_channels")
    head_dim = hidden // heads if channels is None else int(channels)
    moe, ep_ = moe_from_megatron(config)
    arch = ModelArch(name=name, layers=_required(config, "num_layers"), hidden=hidden,
                     heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     ffn=_required(config, "ffn_hidden_size"), vocab=int(vocab_size),
                     qk_norm=bool(_get(config, "qk_layernorm")), norm_eps=eps,
                     tied_embeddings=bool(share_embeddings_and_output_weights), moe=moe)
    par = Parallelism(
        tp=int(tp if tp is not None else (_get(config, "tensor_model_parallel_size") or 1)),
        cp=cp_,
        pp=int(pp if pp is not None else (_get(config, "pipeline_model_parallel_size") or 1)),
        dp=int(dp if dp is not None else 1), sp=bool(_get(config, "sequence_parallel")),
        ep=int(ep if ep is not None else ep_))
    return Workload(model=arch, parallelism=par, microbatch_size=microbatch_size,
                    seq_len=seq_len, num_microbatches=num_microbatches,
                    recompute=_recompute_policy(config),
                    nanobatches=nanobatches, dtype_bytes=_dtype_bytes(config))
