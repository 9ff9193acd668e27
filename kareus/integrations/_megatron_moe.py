"""The mixture-of-experts block of a Megatron-Core model, read from its ``TransformerConfig``.

kareus computes one MoE block (``kareus.model.moe``): a router GEMM (``hidden x experts``,
no bias) in the router dtype, the top-k of its logits, a softmax over those ``k`` logits
(the probabilities of the chosen experts, summing to 1), dropless token permutation to the
chosen experts (an all-to-all over the expert-parallel group, expert tensor parallelism 1),
each expert a bias-free SwiGLU MLP, its output weighted by its probability and summed back
per token, plus the optional shared experts' SwiGLU output; nothing is added to the loss.

That is what Megatron-Core's ``MoELayer`` computes with the all-to-all token dispatcher and
its ``TopKRouter`` at these settings (Megatron-Core 0.15 and 0.16; field: value, why):

* ``moe_token_dispatcher_type``: ``"alltoall"`` (the default ``"allgather"`` and ``"flex"``,
  DeepEP/HybridEP, move tokens otherwise and are refused; ``moe_enable_deepep`` too);
* ``expert_tensor_parallel_size``: 1 (``None`` means TP's size: accepted at TP = 1);
* ``moe_router_score_function``: ``"softmax"`` with ``moe_router_pre_softmax=False`` (its
  default: top-k of the logits, then a softmax over them; pre-softmax takes the top-k of a
  softmax over all experts without renormalising, another weighting) and
  ``moe_router_topk_scaling_factor`` ``None`` (or 1.0);
* ``moe_router_dtype``: ``"fp32"`` / ``"fp64"`` become ``MoEArch.router_dtype``
  ``"float32"`` / ``"float64"``; ``None`` computes the router in the model's dtype
  (``"bfloat16"`` with ``bf16``, ``"float32"`` in fp32; fp16 is refused);
* dropless: ``moe_expert_capacity_factor`` ``None``, no ``moe_pad_expert_input_to_capacity``,
  no ``moe_token_dropping``, no ``moe_router_padding_for_quantization`` (or ``_for_fp8``);
* no term in the loss and no routing that changes over steps: ``moe_aux_loss_coeff`` 0
  (every entry of a list; Megatron-Core adds no auxiliary loss then, whatever
  ``moe_router_load_balancing_type`` says, except ``"sinkhorn"``, which changes the routing
  and is refused), ``moe_z_loss_coeff`` ``None`` or 0, no ``moe_router_enable_expert_bias``
  (aux-loss-free balancing: a per-expert bias updated every step), no
  ``moe_input_jitter_eps``, no ``moe_router_force_load_balancing``, no
  ``moe_enable_routing_replay``;
* every token may go to every expert: no ``moe_router_num_groups`` / ``moe_router_group_topk``
  / ``moe_router_topk_limited_devices`` (group-limited routing);
* the probabilities weight the experts' outputs: no ``moe_apply_probs_on_input``; no
  ``moe_latent_size`` projections; shared experts without ``moe_shared_expert_gate`` (a
  sigmoid gate on their output);
* every layer MoE: ``moe_layer_freq`` 1 (or a list of ones);
* ``moe_layer_recompute`` off (recomputation is the workload's policy);
* no CUDA graphs (``cuda_graph_impl`` ``"none"``, ``enable_cuda_graph`` and
  ``external_cuda_graph`` off): kareus's MoE layer runs eagerly, its split sizes read on
  the host after the routing;
* ``overlap_moe_expert_parallel_comm`` off (Megatron-Core's combined 1F1B schedule, which
  overlaps one microbatch's all-to-alls with another's computation by calling the layer's
  parts itself: kareus plans that overlap, and its layer runs whole).

Accepted and read: ``num_moe_experts`` (``MoEArch.experts``), ``moe_router_topk``
(``experts_per_token``), ``moe_ffn_hidden_size`` (``expert_ffn``; ``None`` means
``ffn_hidden_size``, as Megatron-Core sets it), ``moe_shared_expert_intermediate_size``
(one shared expert of that width: Megatron-Core's size is the total of its shared experts,
whose sum is one SwiGLU MLP of the total width), ``expert_model_parallel_size``
(``Parallelism.ep``). Accepted because they compute the same values:
``moe_grouped_gemm`` / ``moe_use_legacy_grouped_gemm`` (one grouped GEMM for the local
experts instead of a loop), ``moe_permute_fusion`` and ``moe_router_fusion`` (fused
kernels), ``moe_shared_expert_overlap`` (the shared experts run beside the dispatch: the
placement kareus plans), ``moe_router_load_balancing_type`` other than ``"sinkhorn"`` at
coefficient 0, ``moe_token_drop_policy`` (no drops), ``moe_router_bias_update_rate``
(no bias), logging and DeepEP SM counts (no DeepEP).

Read by attribute (duck typing, like ``kareus.integrations._megatron_config``): a missing
field is Megatron-Core's default. Importing this module imports neither torch nor Megatron.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import WorkloadError
from kareus.model.moe import MoEArch

__all__ = ["MOE_DEFAULTS", "moe_from_megatron", "moe_refusals", "router_dtype_of"]

#: Megatron-Core's defaults (``TransformerConfig``, ``ModelParallelConfig``) of the MoE
#: fields read here.
MOE_DEFAULTS: dict[str, Any] = {
    "num_moe_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
    "moe_layer_freq": 1, "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None, "moe_input_jitter_eps": None,
    "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None, "moe_router_dtype": None,
    "moe_router_enable_expert_bias": False, "moe_router_force_load_balancing": False,
    "moe_router_num_groups": None, "moe_router_group_topk": None,
    "moe_router_topk_limited_devices": None, "moe_router_padding_for_quantization": False,
    "moe_router_padding_for_fp8": False, "moe_enable_routing_replay": False,
    "moe_token_dispatcher_type": "allgather", "moe_enable_deepep": False,
    "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
    "moe_token_dropping": False, "moe_apply_probs_on_input": False, "moe_latent_size": None,
    "moe_layer_recompute": False, "overlap_moe_expert_parallel_comm": False,
    "cuda_graph_impl": "none", "enable_cuda_graph": False, "external_cuda_graph": False,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None, "tensor_model_parallel_size": 1,
    "ffn_hidden_size": None, "bf16": False, "fp16": False,
}


def _get(config: Any, name: str) -> Any:
    return getattr(config, name, MOE_DEFAULTS.get(name))


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _every_layer(freq: Any) -> bool:
    """``moe_layer_freq`` says every layer is MoE: 1, or a list of ones."""
    if isinstance(freq, list | tuple):
        return len(freq) > 0 and all(int(f) == 1 for f in freq)
    return freq is not None and int(freq) == 1


def router_dtype_of(config: Any) -> str | None:
    """``MoEArch.router_dtype`` of a config's ``moe_router_dtype`` (``None``: the model's
    dtype), or ``None`` when it is none kareus computes (fp16)."""
    dtype = _get(config, "moe_router_dtype")
    if dtype == "fp32":
        return "float32"
    if dtype == "fp64":
        return "float64"
    if dtype is not None:
        return None
    if _get(config, "bf16"):
        return "bfloat16"
    return None if _get(config, "fp16") else "float32"


def moe_refusals(config: Any) -> list[str]:
    """What kareus's MoE block does not compute of a Megatron-Core MoE config (see the
    module docstring), each a line naming the field and what to set; empty for a dense
    config or one kareus computes."""
    if not _get(config, "num_moe_experts"):
        return []
    tp = int(_get(config, "tensor_model_parallel_size") or 1)
    etp = _get(config, "expert_tensor_parallel_size")
    etp = tp if etp is None else int(etp)
    aux = [float(c or 0.0) for c in _as_list(_get(config, "moe_aux_loss_coeff"))]
    balancing = _as_list(_get(config, "moe_router_load_balancing_type"))
    scale = _get(config, "moe_router_topk_scaling_factor")
    z_loss = _get(config, "moe_z_loss_coeff")
    dispatcher = _get(config, "moe_token_dispatcher_type")
    checks: list[tuple[bool, str]] = [
        (dispatcher == "alltoall" and not _get(config, "moe_enable_deepep"),
         f"kareus's MoE layer is Megatron-Core's all-to-all token dispatcher: set "
         f"moe_token_dispatcher_type='alltoall' (got {dispatcher!r}; Megatron-Core's default "
         "is 'allgather') and moe_enable_deepep=False"),
        (etp == 1, f"kareus's experts are not split over tensor parallelism: set "
                   f"expert_tensor_parallel_size=1 (got {etp}; None means TP's size)"),
        (_every_layer(_get(config, "moe_layer_freq")),
         f"kareus models models whose every layer is MoE: set moe_layer_freq=1 (got "
         f"{_get(config, 'moe_layer_freq')!r:.60})"),
        (_get(config, "moe_router_score_function") == "softmax"
         and not _get(config, "moe_router_pre_softmax"),
         f"kareus's router takes a softmax over the top-k logits: set "
         f"moe_router_score_function='softmax' and moe_router_pre_softmax=False (got "
         f"{_get(config, 'moe_router_score_function')!r}, "
         f"{bool(_get(config, 'moe_router_pre_softmax'))})"),
        (scale is None or float(scale) == 1.0,
         f"kareus's router does not scale its probabilities: set "
         f"moe_router_topk_scaling_factor=None (got {scale})"),
        (router_dtype_of(config) is not None,
         f"kareus's router computes in float32, float64 or bfloat16: set "
         f"moe_router_dtype='fp32' (got {_get(config, 'moe_router_dtype')!r} with fp16)"),
        (not any(aux), f"kareus's MoE layer adds no load-balancing loss: set "
                       f"moe_aux_loss_coeff=0.0 (got {_get(config, 'moe_aux_loss_coeff')})"),
        ("sinkhorn" not in balancing,
         "kareus's router routes by top-k, not Sinkhorn: set "
         "moe_router_load_balancing_type='none'"),
        (z_loss is None or float(z_loss) == 0.0,
         f"kareus's MoE layer adds no router z-loss: set moe_z_loss_coeff=None (got "
         f"{z_loss})"),
        (not _get(config, "moe_router_enable_expert_bias"),
         "kareus's routing has no per-expert bias updated over steps (aux-loss-free "
         "balancing): set moe_router_enable_expert_bias=False"),
        (_get(config, "moe_input_jitter_eps") is None,
         "kareus's router takes its input without noise: set moe_input_jitter_eps=None"),
        (not _get(config, "moe_router_force_load_balancing")
         and not _get(config, "moe_enable_routing_replay"),
         "kareus routes by the router's logits: set moe_router_force_load_balancing=False "
         "and moe_enable_routing_replay=False"),
        (not _get(config, "moe_router_num_groups") and not _get(config, "moe_router_group_topk")
         and not _get(config, "moe_router_topk_limited_devices"),
         "kareus's router chooses among all experts: set moe_router_num_groups=None and "
         "moe_router_group_topk=None (group-limited routing)"),
        (_get(config, "moe_expert_capacity_factor") is None
         or float(_get(config, "moe_expert_capacity_factor")) < 0,
         f"kareus's MoE layer is dropless: set moe_expert_capacity_factor=None (got "
         f"{_get(config, 'moe_expert_capacity_factor')})"),
        (not _get(config, "moe_pad_expert_input_to_capacity")
         and not _get(config, "moe_token_dropping")
         and not _get(config, "moe_router_padding_for_quantization")
         and not _get(config, "moe_router_padding_for_fp8"),
         "kareus's MoE layer neither drops nor pads tokens: set "
         "moe_pad_expert_input_to_capacity=False, moe_token_dropping=False and "
         "moe_router_padding_for_quantization=False"),
        (not _get(config, "moe_apply_probs_on_input"),
         "kareus weights the experts' outputs by the router's probabilities: set "
         "moe_apply_probs_on_input=False"),
        (_get(config, "moe_latent_size") is None,
         "kareus's experts take the hidden states themselves: set moe_latent_size=None"),
        (not _get(config, "moe_shared_expert_gate"),
         "kareus's shared experts have no gate: set moe_shared_expert_gate=False"),
        (not _get(config, "moe_layer_recompute"),
         "kareus's layer recomputes by the workload's policy: set moe_layer_recompute=False"),
        (_get(config, "cuda_graph_impl") in (None, "none")
         and not _get(config, "enable_cuda_graph") and not _get(config, "external_cuda_graph"),
         f"kareus's MoE layer runs eagerly (the rows each rank sends are known only after the "
         f"routing, on the host; a CUDA graph fixes them): set cuda_graph_impl='none' (got "
         f"{_get(config, 'cuda_graph_impl')!r}), enable_cuda_graph=False and "
         "external_cuda_graph=False"),
        (not _get(config, "overlap_moe_expert_parallel_comm"),
         "kareus plans the expert-parallel all-to-alls' overlap itself, and Megatron-Core's "
         "combined 1F1B schedule would run the layers' parts without kareus's layer: set "
         "overlap_moe_expert_parallel_comm=False"),
    ]
    return [msg for ok, msg in checks if not ok]


def moe_from_megatron(config: Any) -> tuple[MoEArch | None, int]:
    """``(ModelArch.moe, Parallelism.ep)`` of a Megatron-Core config: ``(None, 1)`` for a
    dense one.

    Raises:
        WorkloadError: the config asks for what kareus's MoE block does not compute (the
            first of ``moe_refusals``, with how many more), or expert parallelism without
            experts.
    """
    experts = _get(config, "num_moe_experts")
    ep = int(_get(config, "expert_model_parallel_size") or 1)
    if not experts:
        if ep != 1:
            raise WorkloadError(f"expert_model_parallel_size={ep} needs experts: set "
                                "num_moe_experts, or expert_model_parallel_size=1")
        return None, 1
    refused = moe_refusals(config)
    if refused:
        raise WorkloadError(refused[0] + (f" (and {len(refused) - 1} more)"
                                          if len(refused) > 1 else ""))
    ffn = _get(config, "moe_ffn_hidden_size")
    if ffn is None:
        ffn = _get(config, "ffn_hidden_size")
    shared = _get(config, "moe_shared_expert_intermediate_size")
    dtype = router_dtype_of(config)
    assert dtype is not None  # refused above
    moe = MoEArch(experts=int(experts), experts_per_token=int(_get(config, "moe_router_topk")),
                  expert_ffn=int(ffn), shared_experts=1 if shared else 0,
                  shared_expert_ffn=int(shared or 0), router_dtype=dtype)
    return moe, ep
