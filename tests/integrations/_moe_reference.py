"""kareus's mixture-of-experts block in float64 plain PyTorch (autograd everywhere), the
reference the frameworks' MoE layers are checked against. Test support, not a test module.

The semantics (docs/integrations.md, "Mixture of experts"): logits = x @ W_router; each
token's top-k experts by logit; their probabilities a softmax over those k logits; the
output sum_k p_k * SwiGLU_k(x) (gate silu(x @ Wg) * (x @ Wu), then @ Wd), plus the shared
experts' SwiGLU output; dropless, nothing added to the loss. Ties in the top-k cannot be
relied on (a test's data keeps the logits apart).

Test-local until kareus.testing holds the library's own reference of its MoE block (it
will replace this module then).
"""

from __future__ import annotations

import torch

F = torch.nn.functional


def moe_block(x: torch.Tensor, w: dict[str, torch.Tensor], top_k: int) -> torch.Tensor:
    """The MoE block on tokens ``x`` (``[tokens, hidden]``) with *every* expert's weights
    (``W_router [hidden, E]``, ``Wg_experts``/``Wu_experts`` ``[E, hidden, f]``,
    ``Wd_experts [E, f, hidden]``, optional ``*_shared``), in ``x``'s dtype."""
    logits = x @ w["W_router"]
    top, idx = torch.topk(logits, top_k, dim=-1)
    probs = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    for e in range(w["W_router"].shape[1]):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok]
        y = (F.silu(h @ w["Wg_experts"][e]) * (h @ w["Wu_experts"][e])) @ w["Wd_experts"][e]
        out = out.index_add(0, tok, probs[tok, slot, None] * y)
    if "Wg_shared" in w:
        out = out + (F.silu(x @ w["Wg_shared"]) * (x @ w["Wu_shared"])) @ w["Wd_shared"]
    return out


def routing(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's chosen experts, sorted (``[tokens, k]``)."""
    return torch.topk(x @ w_router, top_k, dim=-1).indices.sort(dim=-1).values


def min_logit_gap(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th logit: how far the routing is
    from a tie (a test asserts it is well above float32 rounding)."""
    vals = torch.topk(x @ w_router, top_k + 1, dim=-1).values
    return float((vals[:, top_k - 1] - vals[:, top_k]).min())
