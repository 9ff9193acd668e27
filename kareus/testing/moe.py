"""A reference mixture-of-experts block: plain autograd of the math kareus computes.

[`moe_block_reference`][kareus.testing.moe_block_reference] is the MoE block of a decoder
layer (``kareus.model.moe``; what the training loop's ``DecoderShard`` and the framework
adapters run op by op, through dispatch and combine all-to-alls over expert-parallel
ranks) written as one small differentiable function of whole tensors, with no
parallelism, no permutation and no kernels: pass float64 tensors that require grad, call
``backward`` on a loss of its output, and compare an implementation's output and
gradients with it to fp32 tolerance. It is the same math:

* router: ``logits = x @ router_weight``; each token's ``top_k`` largest logits and the
  softmax over them (Megatron-Core's default ``softmax`` score function with
  ``moe_router_pre_softmax=False``, Mixtral's router, Qwen3 MoE's with
  ``norm_topk_prob=True``); no auxiliary loss, no score bias, no capacity (dropless);
* experts: SwiGLU MLPs, expert ``e`` computing ``(silu(x G_e) * (x U_e)) W2[e]`` with
  ``W1[e] = [G_e | U_e]`` (gate then up along the output dimension, as Megatron-Core's
  fused ``linear_fc1`` and kareus's kernels store them, input-major);
* output: each token's experts' outputs weighted by their probabilities and summed, plus
  the shared experts' SwiGLU MLP of every token when given.

torch is imported inside the function.
"""

from __future__ import annotations

from typing import Any

from kareus.errors import ArgumentError

__all__ = ["moe_block_reference"]


def moe_block_reference(x: Any, router_weight: Any, expert_w1: Any, expert_w2: Any, *,
                        top_k: int, shared: tuple[Any, Any, Any] | None = None) -> Any:
    """The MoE block's output for the normed tokens ``x`` (see the module docstring).

    Args:
        x: The block's input, ``[tokens, hidden]`` (the post-attention norm's output).
        router_weight: ``[hidden, experts]``.
        expert_w1: Every expert's gate and up projections side by side,
            ``[experts, hidden, 2 ffn]`` (the gate's ``ffn`` columns first).
        expert_w2: Every expert's down projection, ``[experts, ffn, hidden]``.
        top_k: Experts per token (``MoEArch.experts_per_token``).
        shared: The shared experts' ``(gate [hidden, f], up [hidden, f], down [f, hidden])``
            (several shared experts side by side: one MLP of their summed width), or
            ``None``.

    Returns:
        ``[tokens, hidden]``: the routed experts' weighted sum, plus the shared experts'
        output.
    """
    import torch

    F = torch.nn.functional
    experts = router_weight.shape[1]
    if not 1 <= top_k <= experts:
        raise ArgumentError(f"top_k must be in 1..{experts}, got {top_k}")
    top, idx = torch.topk(x @ router_weight, top_k, dim=-1)
    probs = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for e in range(experts):
        hit = idx == e  # [tokens, top_k]: at most one True per row
        tokens = hit.any(dim=-1).nonzero().squeeze(1)
        if tokens.numel() == 0:
            continue
        weight = (probs * hit).sum(dim=-1)[tokens]
        gate, up = (x[tokens] @ expert_w1[e]).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ expert_w2[e]
        out = out.index_add(0, tokens, weight.unsqueeze(1) * y)
    if shared is not None:
        wg, wu, wd = shared
        out = out + (F.silu(x @ wg) * (x @ wu)) @ wd
    return out
