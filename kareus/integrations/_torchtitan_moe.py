"""The mixture-of-experts block of a torchtitan 0.3 Qwen3 MoE layer, read from its config.

kareus computes one MoE block (``kareus.model.moe``; ``kareus.integrations._megatron_moe``
says it in full): a bias-free router GEMM, the top-k of its logits, a softmax over those
``k`` logits, dropless all-to-all dispatch over the expert-parallel group (experts not split
over TP), bias-free SwiGLU experts whose outputs are weighted by their probabilities and
summed per token, optional shared experts, nothing added to the loss, the same routing
function at every step.

torchtitan 0.3's ``MoE`` (``torchtitan.models.common.moe``, what its Qwen3 MoE flavors
build) computes that with these settings of its configs (field: value, why):

* ``router`` (``TokenChoiceTopKRouter.Config``): ``score_func="softmax"`` with
  ``route_norm=True``: a softmax over all experts, the top-k of it, renormalised to sum to 1,
  which is the softmax over the top-k logits (torchtitan adds 1e-20 to the denominator,
  below float32's resolution of a sum near 1); ``route_scale`` 1.0; no group-limited routing
  (``num_expert_groups``, ``num_limited_groups`` ``None``); no ``_debug_force_load_balance``
  (the Trainer's ``debug.moe_force_load_balance``); a gate without bias. The gate runs
  under float32 autocast: ``MoEArch.router_dtype`` ``"float32"``.
* ``load_balance_coeff`` ``None``. torchtitan's default (1e-3, every Qwen3 MoE flavor) is
  auxiliary-loss-free load balancing: a per-expert bias (``expert_bias_E``) added to the
  scores that choose the experts, updated by the optimizer's pre-step hook from the token
  counts of every step, so the routing changes from step to step. kareus's router has no
  such bias: refused (set ``load_balance_coeff=None`` in each layer's ``moe`` config).
* ``routed_experts.token_dispatcher``: ``AllToAllTokenDispatcher.Config`` (``comm_backend
  ="standard"``: all-to-all over the ``ep`` mesh, local reordering at EP = 1); DeepEP,
  HybridEP (its ``non_blocking_capacity_factor`` drops tokens), MinimalAsyncEP and the
  quantised TorchAO dispatcher are refused.
* ``routed_experts.inner_experts``: torchtitan's own ``GroupedExperts.Config`` (``w1``
  gate, ``w3`` up, ``w2`` down, SwiGLU, no bias); converters that swap it (MXFP8, fused
  SwiGLU) are refused. Its forward casts tokens and weights to bfloat16 whatever the
  model's dtype: the expert GEMMs are bfloat16 GEMMs, as kareus's are in bf16 training.
* ``shared_experts``: ``None`` or a bias-free ``FeedForward.Config`` (one shared expert
  of its ``w1`` width).

Expert parallelism is ``parallelism.expert_parallel_degree`` (``Parallelism.ep``). At
``tensor_parallel_degree`` > 1 torchtitan shards the experts over TP when EP is 1 (kareus's
experts are never split over TP: refused) and, with EP, reuses the TP ranks to shard the
tokens, as Megatron-Core's sequence parallelism does (kareus's ``sp``).

Importing this module imports neither torch nor torchtitan.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import WorkloadError
from kareus.model.moe import MoEArch

__all__ = ["moe_of_layer"]

def _classes() -> Any:
    import types

    from torchtitan.models.common.feed_forward import FeedForward  # type: ignore[import]
    from torchtitan.models.common.moe import (  # type: ignore[import]
        GroupedExperts,
        MoE,
        RoutedExperts,
        TokenChoiceTopKRouter,
    )
    from torchtitan.models.common.token_dispatcher import (  # type: ignore[import]
        AllToAllTokenDispatcher,
    )

    return types.SimpleNamespace(MoE=MoE, GroupedExperts=GroupedExperts,
                                 RoutedExperts=RoutedExperts, Router=TokenChoiceTopKRouter,
                                 AllToAll=AllToAllTokenDispatcher, FeedForward=FeedForward)


def _refusals(where: str, moe: Any, dim: int) -> list[str]:
    """What kareus's MoE block does not compute of a layer's ``MoE.Config``, each one line
    naming torchtitan's field (the module docstring)."""
    tt = _classes()
    if type(moe) is not tt.MoE.Config:
        return [f"{where}'s moe is a {type(moe).__qualname__}: kareus reads torchtitan's MoE"]
    out: list[str] = []
    if moe.load_balance_coeff is not None:
        out.append(f"{where}'s moe.load_balance_coeff={moe.load_balance_coeff} is "
                   "auxiliary-loss-free load balancing (a per-expert routing bias updated "
                   "every optimizer step, so the routing changes over steps), which kareus's "
                   "router does not have: set load_balance_coeff=None")
    return out + _router_refusals(where, moe, dim, tt) + _experts_refusals(where, moe, dim, tt)


def _router_refusals(where: str, moe: Any, dim: int, tt: Any) -> list[str]:
    router = moe.router
    if type(router) is not tt.Router.Config:
        return [f"{where}'s moe.router is a {type(router).__qualname__}: kareus reads "
                "torchtitan's TokenChoiceTopKRouter"]
    checks = [
        (router.score_func == "softmax" and router.route_norm,
         f"{where}'s router has score_func={router.score_func!r}, route_norm="
         f"{router.route_norm}: kareus's router is a softmax over the top-k logits "
         "(score_func='softmax', route_norm=True)"),
        (float(router.route_scale) == 1.0,
         f"{where}'s router scales its scores (route_scale={router.route_scale}): kareus's "
         "does not: set route_scale=1.0"),
        (router.num_expert_groups is None and router.num_limited_groups is None,
         f"{where}'s router limits each token to groups of experts (num_expert_groups, "
         "num_limited_groups): kareus's chooses among all: set both None"),
        (not getattr(router, "_debug_force_load_balance", False),
         f"{where}'s router forces round-robin routing (debug.moe_force_load_balance): kareus "
         "routes by the router's logits: turn it off"),
        (not getattr(router.gate, "bias", False),
         f"{where}'s router gate has a bias: kareus's router has none"),
        (int(router.gate.in_features) == dim
         and int(router.gate.out_features) == int(moe.num_experts) == int(router.num_experts),
         f"{where}'s router gate is {router.gate.in_features} x {router.gate.out_features} "
         f"for {moe.num_experts} experts of a model of dim {dim}"),
    ]
    return [msg for ok, msg in checks if not ok]


def _experts_refusals(where: str, moe: Any, dim: int, tt: Any) -> list[str]:
    routed = moe.routed_experts
    if type(routed) is not tt.RoutedExperts.Config:
        return [f"{where}'s moe.routed_experts is a {type(routed).__qualname__}: kareus reads "
                "torchtitan's RoutedExperts"]
    out: list[str] = []
    if type(routed.token_dispatcher) is not tt.AllToAll.Config:
        out.append(f"{where}'s token dispatcher is a "
                   f"{type(routed.token_dispatcher).__qualname__}: kareus's MoE layer is the "
                   "standard all-to-all dispatcher (comm_backend='standard')")
    inner = routed.inner_experts
    if type(inner) is not tt.GroupedExperts.Config:
        out.append(f"{where}'s experts are a {type(inner).__qualname__} (a converter's): "
                   "kareus computes torchtitan's GroupedExperts (bf16 SwiGLU GEMMs)")
    elif int(inner.dim) != dim or int(inner.num_experts) != int(moe.num_experts):
        out.append(f"{where}'s experts take {inner.dim} features for {inner.num_experts} "
                   f"experts, the model {dim} and {moe.num_experts}")
    shared = moe.shared_experts
    if shared is not None and type(shared) is not tt.FeedForward.Config:
        out.append(f"{where}'s shared experts are a {type(shared).__qualname__}: kareus "
                   "computes torchtitan's FeedForward (SwiGLU)")
    elif shared is not None and any(getattr(lin, "bias", False)
                                    for lin in (shared.w1, shared.w2, shared.w3)):
        out.append(f"{where}'s shared experts have biases: kareus's have none")
    return out


def moe_of_layer(where: str, lc: Any, dim: int) -> MoEArch:
    """The [`MoEArch`][kareus.model.MoEArch] of a torchtitan layer config whose ``moe`` is
    set (see the module docstring).

    Raises:
        WorkloadError: a setting kareus's MoE block does not compute (the first, one line
            naming torchtitan's field, with how many more).
    """
    moe = lc.moe
    refused = _refusals(where, moe, dim)
    if refused:
        raise WorkloadError(refused[0] + (f" (and {len(refused) - 1} more)"
                                          if len(refused) > 1 else ""))
    shared = moe.shared_experts
    return MoEArch(experts=int(moe.num_experts), experts_per_token=int(moe.router.top_k),
                   expert_ffn=int(moe.routed_experts.inner_experts.hidden_dim),
                   shared_experts=0 if shared is None else 1,
                   shared_expert_ffn=0 if shared is None else int(shared.w1.out_features),
                   router_dtype="float32")
