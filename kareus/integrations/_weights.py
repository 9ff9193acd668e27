"""From a framework's weight layout to the one kareus's layer programs read.

A planned layer ([`PlannedLayer`][kareus.integrations.PlannedLayer]) takes this rank's
shard of seven weights, named and laid out as kareus's own decoder holds them
(``LAYER_WEIGHTS``), each ``[in, out]`` so that a projection is ``x @ W``, and two more
when the model normalizes each query and key head (``ModelArch.qk_norm``, as Qwen3 does):

======================  ===========================================================
``w_attn_norm``         ``[hidden]``: the attention's RMSNorm weight
``Wqkv``                ``[hidden, (q + 2 kv) / TP]``: this rank's query heads, then its
                        key heads, then its value heads (blocked, not interleaved per
                        group); RoPE rotates halves (``x[:d/2]`` with ``x[d/2:]``)
``Wo``                  ``[q / TP, hidden]``: the attention's output projection
``w_mlp_norm``          ``[hidden]``: the MLP's RMSNorm weight
``Wg``, ``Wu``          ``[hidden, ffn / TP]``: SwiGLU's gate and up projections
``Wd``                  ``[ffn / TP, hidden]``: the down projection
``w_q_norm``            ``[head_dim]``: the RMSNorm weight every query head is
                        normalized with before RoPE (``qk_norm`` models only)
``w_k_norm``            ``[head_dim]``: the same for every key head
======================  ===========================================================

[`layer_weights`][kareus.integrations.layer_weights] names a model's set, in the order a
planned layer takes them.

**The query/key norm weights under TP.** They are not sharded: every rank holds the whole
``[head_dim]`` weight and applies it to its own heads, so each rank's backward yields only
its heads' part of their gradient. A planned layer returns that part, exactly as the
framework's own norm module does under autograd; summing the parts over the TP ranks is
the framework's business (Megatron-Core sums the gradients of parameters named
``q_layernorm``/``k_layernorm`` over TP in ``finalize_model_grads`` when
``qk_layernorm`` is on), so kareus neither reduces them itself nor leaves a sum undone.

Frameworks hold them otherwise: ``torch.nn.Linear`` weights are ``[out, in]``,
Megatron-Core packs Q, K and V per query group and gate and up into one ``linear_fc1``,
torchtitan rotates interleaved pairs with complex numbers. The functions here turn a
framework's tensors into kareus's layout **with differentiable torch ops** (transposes,
views, slices, concatenation): the gradients a planned layer returns flow back through them
into the framework's own parameters by autograd, so whatever the framework hooks on its
parameters' gradients (Megatron-Core's ``main_grad`` accumulation, DTensor placements,
FSDP) sees them as from its own layer. A transpose is a view; a reordering costs one copy
of the weight per forward, small beside a layer's activations.

**Mixture of experts** (``ModelArch.moe``). An MoE layer's MLP weights are the router and
this rank's ``experts / EP`` local experts (expert tensor parallelism 1: each whole), plus
the shared experts when the model has them (replicated at TP = 1), named as the training
loop's decoder names them (``kareus.exec.train``), by
[`moe_weight_names`][kareus.integrations.moe_weight_names]:

======================  ===========================================================
``Wr``                  ``[hidden, experts]``: the router's GEMM (every expert's logit)
``W1e``                 ``[local experts, hidden, 2 expert_ffn]``: each local expert's
                        SwiGLU gate projection, then its up projection, side by side
                        (the gate's ``expert_ffn`` columns first), the local experts in
                        expert order
``W2e``                 ``[local experts, expert_ffn, hidden]``: their down projections
``Wsg``, ``Wsu``        ``[hidden, shared width]``: the shared experts' gate and up
                        projections (several shared experts side by side: one SwiGLU
                        MLP of their summed width)
``Wsd``                 ``[shared width, hidden]``: their down projection
======================  ===========================================================

EP rank ``r`` holds experts ``r * experts / EP`` to ``(r + 1) * experts / EP - 1``, as
Megatron-Core and torchtitan place them. [`experts_from_linears`][kareus.integrations.experts_from_linears]
reads per-expert ``[out, in]`` linears (Megatron-Core's ``SequentialMLP`` and
``TEGroupedMLP``), [`experts_from_stacked`][kareus.integrations.experts_from_stacked]
stacked ``[experts, out, in]`` gate, up and down tensors (torchtitan's ``GroupedExperts``).

Why rows can be permuted at all: attention scores are dot products of a query and a key
head, unchanged when both have their ``head_dim`` entries permuted the same way; so a model
that rotates interleaved pairs ``(2i, 2i+1)`` is the same model as one that rotates halves
``(i, i + d/2)`` with the rows of its query and key projections reordered
(``interleaved_rope=True``). Value rows are never permuted.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import ArgumentError

__all__ = ["LAYER_WEIGHTS", "MOE_WEIGHTS", "QK_NORM_WEIGHTS", "SHARED_EXPERT_WEIGHTS",
           "experts_from_linears", "experts_from_stacked", "gate_up_from_fused", "head_norm",
           "layer_weights", "linear", "moe_weight_names", "qkv_from_grouped",
           "qkv_from_separate"]

#: The weights of a planned layer, in the order [`PlannedLayer`][kareus.integrations.PlannedLayer] takes them.
LAYER_WEIGHTS = ("w_attn_norm", "Wqkv", "Wo", "w_mlp_norm", "Wg", "Wu", "Wd")

#: The per-head query and key RMSNorm weights a ``qk_norm`` model's layer adds (after ``LAYER_WEIGHTS``).
QK_NORM_WEIGHTS = ("w_q_norm", "w_k_norm")


#: The weights of an MoE layer's router and local experts (see the module docstring).
MOE_WEIGHTS = ("Wr", "W1e", "W2e")

#: The weights an MoE layer's shared experts add (after ``MOE_WEIGHTS``).
SHARED_EXPERT_WEIGHTS = ("Wsg", "Wsu", "Wsd")


def moe_weight_names(shared_experts: bool) -> tuple[str, ...]:
    """The names of an MoE layer's MLP weights in kareus's layout: ``MOE_WEIGHTS``, then,
    with shared experts (``MoEArch.shared_experts`` > 0), ``SHARED_EXPERT_WEIGHTS``."""
    return MOE_WEIGHTS + (SHARED_EXPERT_WEIGHTS if shared_experts else ())


def experts_from_linears(fc1: Any, fc2: Any) -> tuple[Any, Any]:
    """kareus's ``(W1e, W2e)`` from each local expert's fused gate/up projection
    (``[2 expert_ffn, hidden]``, the gate's rows first, as Megatron-Core's gated
    ``linear_fc1`` holds them) and its down projection (``[hidden, expert_ffn]``), in expert
    order: stacks of transposed views, differentiable, so the gradients reach each expert's
    own parameters.

    Args:
        fc1: The local experts' ``linear_fc1`` weights (a sequence, one per expert).
        fc2: Their ``linear_fc2`` weights.
    """
    import torch

    fc1, fc2 = list(fc1), list(fc2)
    if not fc1 or len(fc1) != len(fc2):
        raise ArgumentError(f"one fc1 and one fc2 weight per local expert, got {len(fc1)} and "
                            f"{len(fc2)}")
    for i, (w1, w2) in enumerate(zip(fc1, fc2, strict=True)):
        _require_2d(f"fc1[{i}]", w1)
        _require_2d(f"fc2[{i}]", w2)
    f2, h = fc1[0].shape
    if f2 % 2 or any(tuple(w.shape) != (f2, h) for w in fc1) or any(
            tuple(w.shape) != (h, f2 // 2) for w in fc2):
        raise ArgumentError("the experts' fc1 weights must all be [2 ffn, hidden] and their "
                            "fc2 weights [hidden, ffn], of one ffn and hidden")
    return torch.stack([w.t() for w in fc1]), torch.stack([w.t() for w in fc2])


def experts_from_stacked(w1: Any, w3: Any, w2: Any) -> tuple[Any, Any]:
    """kareus's ``(W1e, W2e)`` from the local experts' stacked ``[out, in]`` projections
    (torchtitan's ``GroupedExperts``: ``w1`` the gate and ``w3`` the up projection,
    ``[experts, expert_ffn, hidden]``; ``w2`` the down projection,
    ``[experts, hidden, expert_ffn]``): the gate and up transposed side by side (a copy,
    differentiable), the down projection transposed (a view)."""
    import torch

    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if getattr(w, "dim", None) is None or w.dim() != 3:
            raise ArgumentError(f"{name} must be a 3-D [experts, out, in] weight, got shape "
                                f"{tuple(getattr(w, 'shape', ()))}")
    e, f, h = w1.shape
    if tuple(w3.shape) != (e, f, h) or tuple(w2.shape) != (e, h, f):
        raise ArgumentError(f"w1 and w3 must be [experts, ffn, hidden] and w2 [experts, "
                            f"hidden, ffn], got {tuple(w1.shape)}, {tuple(w3.shape)}, "
                            f"{tuple(w2.shape)}")
    return torch.cat((w1.transpose(1, 2), w3.transpose(1, 2)), dim=2), w2.transpose(1, 2)


def layer_weights(qk_norm: bool, moe: Any = None) -> tuple[str, ...]:
    """The weights of one planned layer of a model, in the order a
    [`PlannedLayer`][kareus.integrations.PlannedLayer] takes them: ``LAYER_WEIGHTS``, then,
    when the model normalizes each query and key head (``qk_norm``, see
    [`ModelArch`][kareus.model.ModelArch]), ``QK_NORM_WEIGHTS``. A mixture-of-experts
    model's (``moe``, its [`MoEArch`][kareus.model.MoEArch]) has the MoE block's weights
    in place of the MLP's ``Wg``, ``Wu``, ``Wd``
    ([`moe_weight_names`][kareus.integrations.moe_weight_names])."""
    dense = LAYER_WEIGHTS if moe is None else tuple(
        n for n in LAYER_WEIGHTS if n not in ("Wg", "Wu", "Wd")) + moe_weight_names(
            bool(moe.shared_experts))
    return dense + (QK_NORM_WEIGHTS if qk_norm else ())


def linear(weight: Any) -> Any:
    """A ``torch.nn.Linear``-style ``[out, in]`` weight as ``[in, out]`` (a view)."""
    _require_2d("weight", weight)
    return weight.t()


def _halves_order(head_dim: int, device: Any) -> Any:
    """Row order taking interleaved RoPE pairs to halves: ``0, 2, 4, ..., 1, 3, 5, ...``."""
    import torch

    if head_dim % 2:
        raise ArgumentError(f"head_dim must be even for RoPE, got {head_dim}")
    return torch.cat((torch.arange(0, head_dim, 2, device=device),
                      torch.arange(1, head_dim, 2, device=device)))


def _rope_rows(w: Any, heads: int, head_dim: int) -> Any:
    """``w`` ([heads * head_dim, in]) with each head's rows in halves order."""
    order = _halves_order(head_dim, w.device)
    return w.reshape(heads, head_dim, -1).index_select(1, order).reshape(heads * head_dim, -1)


def qkv_from_separate(wq: Any, wk: Any, wv: Any, *, head_dim: int,
                      interleaved_rope: bool = False) -> Any:
    """kareus's ``Wqkv`` from separate ``[out, in]`` query, key and value projections.

    Args:
        wq: ``[heads * head_dim, hidden]`` (this rank's heads).
        wk: ``[kv_heads * head_dim, hidden]``.
        wv: ``[kv_heads * head_dim, hidden]``.
        head_dim: Dimension of one head.
        interleaved_rope: The model rotates interleaved pairs ``(2i, 2i+1)`` (Meta's
            Llama reference and torchtitan, through complex numbers): reorder the query and
            key rows of each head so that rotating halves computes the same attention.

    Returns:
        ``[hidden, (heads + 2 kv_heads) * head_dim]``.
    """
    import torch

    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        _require_2d(name, w)
        if w.shape[0] % head_dim:
            raise ArgumentError(f"{name} has {w.shape[0]} rows, not a multiple of head_dim "
                                f"{head_dim}")
    if interleaved_rope:
        wq = _rope_rows(wq, wq.shape[0] // head_dim, head_dim)
        wk = _rope_rows(wk, wk.shape[0] // head_dim, head_dim)
    return torch.cat((wq, wk, wv), dim=0).t()


def qkv_from_grouped(weight: Any, *, heads: int, kv_heads: int, head_dim: int) -> Any:
    """kareus's ``Wqkv`` from a QKV projection packed per query group (Megatron-Core's
    ``linear_qkv``): the rows of each of the ``kv_heads`` groups are its
    ``heads / kv_heads`` query heads, then its key head, then its value head.

    Args:
        weight: ``[(heads + 2 kv_heads) * head_dim, hidden]``, this rank's groups.
        heads: Query heads of this rank.
        kv_heads: Key/value heads (query groups) of this rank.
        head_dim: Dimension of one head.

    Returns:
        ``[hidden, (heads + 2 kv_heads) * head_dim]``.
    """
    import torch

    _require_2d("weight", weight)
    if heads % kv_heads or weight.shape[0] != (heads + 2 * kv_heads) * head_dim:
        raise ArgumentError(f"a grouped QKV weight of {heads} query and {kv_heads} key/value "
                            f"heads of {head_dim} has {(heads + 2 * kv_heads) * head_dim} rows "
                            f"(and heads a multiple of kv_heads), got {weight.shape[0]}")
    g = heads // kv_heads
    w = weight.reshape(kv_heads, g + 2, head_dim, -1)
    q = w[:, :g].reshape(heads * head_dim, -1)
    k = w[:, g].reshape(kv_heads * head_dim, -1)
    v = w[:, g + 1].reshape(kv_heads * head_dim, -1)
    return torch.cat((q, k, v), dim=0).t()


def head_norm(weight: Any, *, interleaved_rope: bool = False) -> Any:
    """kareus's ``w_q_norm`` or ``w_k_norm`` from a model's per-head query or key RMSNorm
    weight (``[head_dim]``).

    The mean square a head is normalized by does not depend on the order of its entries,
    but the weight multiplies them one by one: when the projection's rows were reordered for
    interleaved RoPE (``qkv_from_separate(..., interleaved_rope=True)``), the weight's
    entries are reordered the same way (an index, differentiable); otherwise it is the
    weight itself.

    Args:
        weight: ``[head_dim]``.
        interleaved_rope: The model rotates interleaved pairs (see ``qkv_from_separate``).
    """
    if getattr(weight, "dim", None) is None or weight.dim() != 1:
        raise ArgumentError(f"a query/key norm weight is 1-D ([head_dim]), got shape "
                            f"{tuple(getattr(weight, 'shape', ()))}")
    if not interleaved_rope:
        return weight
    return weight.index_select(0, _halves_order(int(weight.shape[0]), weight.device))


def gate_up_from_fused(weight: Any) -> tuple[Any, Any]:
    """kareus's ``(Wg, Wu)`` from one ``[2 ffn, hidden]`` projection holding the gate's
    rows then the up projection's (Megatron-Core's gated ``linear_fc1``, per TP shard)."""
    _require_2d("weight", weight)
    if weight.shape[0] % 2:
        raise ArgumentError(f"a fused gate/up weight has an even number of rows, got "
                            f"{weight.shape[0]}")
    f = weight.shape[0] // 2
    return weight[:f].t(), weight[f:].t()


def _require_2d(name: str, w: Any) -> None:
    if getattr(w, "dim", None) is None or w.dim() != 2:
        raise ArgumentError(f"{name} must be a 2-D weight, got shape "
                            f"{tuple(getattr(w, 'shape', ()))}")
