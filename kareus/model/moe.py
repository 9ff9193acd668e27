"""Mixture-of-experts layers: what a model's MoE block is made of.

A mixture-of-experts (MoE) decoder layer replaces the dense SwiGLU MLP by a *router* and
``experts`` SwiGLU MLPs of width ``expert_ffn``: the router (a ``hidden x experts`` GEMM,
then a softmax and a top-k) picks ``experts_per_token`` experts for each token, the token is
copied once per chosen expert (*permutation*), each expert runs its MLP on the tokens routed
to it (one *grouped GEMM* per projection runs every local expert's GEMM in one kernel), and
the outputs are weighted by the router's probabilities and summed back per token
(*un-permutation*). Optional *shared experts* are plain SwiGLU MLPs every token goes
through, beside the routed ones (DeepSeek's layout).

Under *expert parallelism* (EP, ``Parallelism.ep``) each of ``ep`` ranks holds
``experts / ep`` experts; the permuted tokens travel to their experts' ranks in an
all-to-all (*dispatch*) and back in another (*combine*), and the backward runs the two
again with the gradients. kareus models them as collectives of kind
[`CommKind.ALL_TO_ALL`][kareus.model.CommKind] that a partition overlaps with computation
that does not depend on them, like every other collective (``kareus.model.decoder`` has the
op order, ``kareus.model.partition`` the costs).

The layout kareus computes is Megatron-Core's all-to-all token dispatcher with "MoE parallel
folding" at an expert tensor-parallel size of 1 (``expert_tensor_parallel_size=1``,
Megatron-LM's ``--expert-tensor-parallel-size 1``; Megatron-Core's default is TP, which
differs at TP > 1): the experts are not split over TP; the ``ep`` ranks of an
expert-parallel group are consecutive ranks of one pipeline stage (``ep`` divides
``tp x cp x dp``, and divides the 8 GPUs of a node, so that the group's all-to-alls stay on
NVLink; the expert weights' gradients are reduced over the remaining ``tp x cp x dp / ep``
ranks); at TP > 1 sequence parallelism is required (Megatron-Core's ``MoELayer`` raises in
training without it), so each rank routes its own sequence shard. Dropless routing: every
token reaches its experts (no capacity factor, no dropped tokens).

Pure data; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kareus.errors import WorkloadError, short_repr

__all__ = ["ROUTER_DTYPES", "MoEArch"]

#: Router dtypes and their bytes per element: Megatron-Core's ``moe_router_dtype`` (``fp32``,
#: ``fp64``, or the model's dtype), spelt as torch spells them.
ROUTER_DTYPES: Mapping[str, int] = {"float32": 4, "bfloat16": 2, "float64": 8}

_MAX = 2**31 - 1


def _count(where: str, field: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{where}: moe.{field} must be a whole number (int), got "
                            f"{short_repr(value)}")
    if not minimum <= value <= _MAX:
        raise WorkloadError(f"{where}: moe.{field} must be in {minimum}..{_MAX:,}, got "
                            f"{short_repr(value)}")


@attrs.frozen(kw_only=True)
class MoEArch:
    """The mixture-of-experts block of a model's layers (see the module docstring).

    Attributes:
        experts: Routed experts per MoE layer (Qwen3 MoE's ``num_experts``, Mixtral's
            ``num_local_experts``, Megatron-Core's ``num_moe_experts``).
        experts_per_token: Experts each token is routed to, the router's top-k
            (``num_experts_per_tok``, ``moe_router_topk``).
        expert_ffn: Width of each expert's SwiGLU gate and up projections
            (``moe_intermediate_size``, ``moe_ffn_hidden_size``).
        shared_experts: Shared experts every token goes through beside the routed ones
            (0: none).
        shared_expert_ffn: Width of each shared expert's gate and up projections (0 when
            there are none).
        layer_step: Every ``layer_step``-th layer is an MoE layer, the others dense
            (Qwen3 MoE's ``decoder_sparse_step``); 1: every layer. Only 1 is costed yet:
            a workload of another step is refused.
        router_dtype: The dtype of the router's GEMM and softmax, one of
            ``ROUTER_DTYPES`` (Megatron-Core's ``moe_router_dtype="fp32"`` is
            ``"float32"``).
    """

    experts: int
    experts_per_token: int
    expert_ffn: int
    shared_experts: int = 0
    shared_expert_ffn: int = 0
    layer_step: int = 1
    router_dtype: str = "float32"

    def __attrs_post_init__(self) -> None:
        where = "mixture of experts"
        _count(where, "experts", self.experts, 2)
        _count(where, "experts_per_token", self.experts_per_token, 1)
        _count(where, "expert_ffn", self.expert_ffn, 1)
        _count(where, "shared_experts", self.shared_experts, 0)
        _count(where, "shared_expert_ffn", self.shared_expert_ffn, 0)
        _count(where, "layer_step", self.layer_step, 1)
        if self.experts_per_token > self.experts:
            raise WorkloadError(f"{where}: moe.experts_per_token ({self.experts_per_token}) "
                                f"must be at most moe.experts ({self.experts})")
        if (self.shared_experts > 0) != (self.shared_expert_ffn > 0):
            raise WorkloadError(f"{where}: moe.shared_experts and moe.shared_expert_ffn are "
                                f"both 0 or both positive, got {self.shared_experts} and "
                                f"{self.shared_expert_ffn}")
        if self.router_dtype not in ROUTER_DTYPES:
            raise WorkloadError(f"{where}: moe.router_dtype must be one of "
                                f"{', '.join(ROUTER_DTYPES)}, got {short_repr(self.router_dtype)}")

    @property
    def router_dtype_bytes(self) -> int:
        """Bytes per element of the router's logits and probabilities."""
        return ROUTER_DTYPES[self.router_dtype]

    def params_per_rank(self, hidden: int, *, ep: int = 1) -> float:
        """Parameters of one MoE block that one of ``ep`` expert-parallel ranks holds: its
        ``experts / ep`` experts (gate, up and down: ``3 x hidden x expert_ffn`` each), the
        router (``hidden x experts``, replicated) and the shared experts (replicated)."""
        routed = self.experts / ep * 3 * hidden * self.expert_ffn
        return (routed + hidden * self.experts
                + self.shared_experts * 3 * hidden * self.shared_expert_ffn)

    def expert_params_per_rank(self, hidden: int, *, ep: int = 1) -> float:
        """Parameters of the routed experts one of ``ep`` ranks holds (the ones whose
        gradients are reduced over the expert-data-parallel group, not the data-parallel
        one)."""
        return self.experts / ep * 3 * hidden * self.expert_ffn

    def to_dict(self) -> dict[str, object]:
        """Every field, JSON-ready; fields at their defaults left out."""
        d = attrs.asdict(self)
        for f in attrs.fields(MoEArch):
            if f.default is not attrs.NOTHING and d[f.name] == f.default:
                del d[f.name]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MoEArch:
        """Build and check from a dict of its fields (raises ``WorkloadError`` for an
        unknown key or a bad value)."""
        if not isinstance(d, Mapping):
            raise WorkloadError(f"moe must be a table of mixture-of-experts fields, got "
                                f"{type(d).__name__}")
        names = [f.name for f in attrs.fields(MoEArch)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise WorkloadError(f"moe: unknown field(s) {', '.join(map(str, unknown))} "
                                f"(known: {', '.join(names)})")
        missing = [n for n in ("experts", "experts_per_token", "expert_ffn") if n not in d]
        if missing:
            raise WorkloadError(f"moe: missing {', '.join(missing)}")
        return cls(**dict(d))
