"""Helpers of the MoE parity tests (test support, not a test module): the whole set of
experts from the EP ranks' local ones, kareus's semantics on it
([`moe_block_reference`][kareus.testing.moe_block_reference]), and how far a batch's routing
is from a tie."""

from __future__ import annotations

import torch

from kareus.testing import moe_block_reference


def full_weights(per_ep_rank: list[dict]) -> dict:
    """Every expert's weights: the EP ranks' local ``W1e``/``W2e`` side by side, in EP rank
    order; the router and shared experts (replicated) the first rank's."""
    full = dict(per_ep_rank[0])
    for k in ("W1e", "W2e"):
        full[k] = torch.cat([w[k] for w in per_ep_rank])
    return full


def moe(x: torch.Tensor, w: dict, top_k: int) -> torch.Tensor:
    """kareus's MoE block on tokens ``x`` with the whole weights ``w`` (kareus's names)."""
    shared = (w["Wsg"], w["Wsu"], w["Wsd"]) if "Wsg" in w else None
    return moe_block_reference(x, w["Wr"], w["W1e"], w["W2e"], top_k=top_k, shared=shared)


def min_logit_gap(x: torch.Tensor, w_router: torch.Tensor, top_k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th logit: how far the routing is
    from a tie (the tests assert it is well above float32 rounding)."""
    vals = torch.topk(x @ w_router, top_k + 1, dim=-1).values
    return float((vals[:, top_k - 1] - vals[:, top_k]).min())
