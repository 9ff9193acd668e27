"""One door for third-party systems: a plan applied in Megatron-Core, torchtitan or your own
model, and kareus beside Zeus and Perseus.

A plan from ``kareus optimize`` says, per microbatch computation, how each decoder layer's
collectives run beside its computation (launch slot, SM count, nanobatches) and at which
clock. kareus's own loop (``kareus.exec.train``) applies it to kareus's own decoder; this
package applies it to a decoder layer whose weights, data, optimizer, pipeline schedule and
checkpoints belong to a framework:

* [`PlanApplier`][kareus.integrations.PlanApplier] and
  [`PlannedLayer`][kareus.integrations.PlannedLayer]: the framework-neutral layer: your
  layer's weights (any PyTorch tensors, in kareus's layout through the helpers below), your
  TP/CP groups and a plan make a differentiable layer whose forward and backward run
  kareus's partition programs; [`PlannedStack`][kareus.integrations.PlannedStack] runs
  consecutive layers as one node, so collectives chain across layer boundaries as planned;
* the layout helpers (``LAYER_WEIGHTS``, with a ``qk_norm`` model's two more:
  [`layer_weights`][kareus.integrations.layer_weights]; [`linear`][kareus.integrations.linear],
  [`qkv_from_separate`][kareus.integrations.qkv_from_separate],
  [`qkv_from_grouped`][kareus.integrations.qkv_from_grouped],
  [`gate_up_from_fused`][kareus.integrations.gate_up_from_fused],
  [`head_norm`][kareus.integrations.head_norm]; a mixture-of-experts layer's router and
  experts: [`moe_weight_names`][kareus.integrations.moe_weight_names],
  [`experts_from_linears`][kareus.integrations.experts_from_linears],
  [`experts_from_stacked`][kareus.integrations.experts_from_stacked]): differentiable views
  of a framework's weights, so that gradients reach its parameters by autograd;
* ``kareus.integrations.megatron`` (``pip install "kareus[megatron]"``) and
  ``kareus.integrations.torchtitan`` (``pip install "kareus[torchtitan]"``): the same
  through each framework's extension points, imported on demand
  (``--spec kareus.integrations.megatron layer_spec`` in Megatron-LM's ``pretrain_gpt.py``;
  ``kareus.integrations.megatron_args`` reads a job's Megatron-LM flags without Megatron);
* ``kareus.integrations.zeus`` (``pip install "kareus[zeus]"``): a frequency controller backed
  by the Zeus daemon (zeusd) and an energy meter backed by Zeus's ZeusMonitor;
* ``kareus.integrations.perseus``: a plan's per-rank, per-microbatch frequencies in the
  schedule format Perseus's frequency server reads.

Importing this package imports neither torch's distributed side nor a framework, Zeus or
Perseus: each adapter module imports them when used.

The guide is docs/integrations.md; examples/ holds a hand-written tensor-parallel model
and the framework scripts.
"""

from __future__ import annotations

from kareus.integrations._layer import PlanApplier, PlannedLayer, PlannedStack
from kareus.integrations._weights import (
    LAYER_WEIGHTS,
    MOE_WEIGHTS,
    QK_NORM_WEIGHTS,
    SHARED_EXPERT_WEIGHTS,
    experts_from_linears,
    experts_from_stacked,
    gate_up_from_fused,
    head_norm,
    layer_weights,
    linear,
    moe_weight_names,
    qkv_from_grouped,
    qkv_from_separate,
)

__all__ = [
    "LAYER_WEIGHTS",
    "MOE_WEIGHTS",
    "PlanApplier",
    "PlannedLayer",
    "PlannedStack",
    "QK_NORM_WEIGHTS",
    "SHARED_EXPERT_WEIGHTS",
    "experts_from_linears",
    "experts_from_stacked",
    "gate_up_from_fused",
    "head_norm",
    "layer_weights",
    "linear",
    "moe_weight_names",
    "qkv_from_grouped",
    "qkv_from_separate",
]
