"""A plain-PyTorch Llama decoder layer (autograd everywhere) and its tensor-parallel shards,
the reference the planned layer is checked against; with ``qk=True`` Qwen3's layer (each
query and key head RMS-normalized before RoPE, eps 1e-6). Test support, not a test module."""

from __future__ import annotations

import torch

from kareus.model.workload import ModelArch, Parallelism, Workload

F = torch.nn.functional


def workload(tp: int = 1, cp: int = 1, *, n: int = 2, mbs: int = 4, seq: int = 16,
             microbatches: int = 2, qk: bool = False, recompute: str = "full",
             head_dim: int = 8) -> Workload:
    qwen3 = {"qk_norm": True, "norm_eps": 1e-6} if qk else {}
    arch = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=head_dim,
                     ffn=64, vocab=50, **qwen3)
    return Workload(model=arch, parallelism=Parallelism(tp=tp, cp=cp), microbatch_size=mbs,
                    seq_len=seq, num_microbatches=microbatches, nanobatches=n,
                    recompute=recompute)


def full_weights(arch: ModelArch, seed: int) -> dict[str, torch.Tensor]:
    """One layer's whole (unsharded) weights, ``torch.nn.Linear`` layout ``[out, in]``."""
    g = torch.Generator().manual_seed(seed)
    h, hd = arch.hidden, arch.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    w = {"n1": 1 + 0.1 * torch.randn(h, generator=g), "wq": rnd(arch.heads * hd, h),
         "wk": rnd(arch.kv_heads * hd, h), "wv": rnd(arch.kv_heads * hd, h),
         "wo": rnd(h, arch.heads * hd), "n2": 1 + 0.1 * torch.randn(h, generator=g),
         "w1": rnd(arch.ffn, h), "w3": rnd(arch.ffn, h), "w2": rnd(h, arch.ffn)}
    if arch.qk_norm:  # one weight over head_dim for every query head, one for every key head
        w["qn"] = 1 + 0.1 * torch.randn(hd, generator=g)
        w["kn"] = 1 + 0.1 * torch.randn(hd, generator=g)
    return w


def shard(w: dict[str, torch.Tensor], arch: ModelArch, tp: int, rank: int
          ) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s shard, as Megatron-LM splits a layer (heads, FFN units)."""
    hd = arch.head_dim
    q, kv, f = arch.heads // tp * hd, arch.kv_heads // tp * hd, arch.ffn // tp
    return {"n1": w["n1"], "n2": w["n2"], **{k: w[k] for k in ("qn", "kn") if k in w},
            "wq": w["wq"][rank * q:(rank + 1) * q], "wk": w["wk"][rank * kv:(rank + 1) * kv],
            "wv": w["wv"][rank * kv:(rank + 1) * kv], "wo": w["wo"][:, rank * q:(rank + 1) * q],
            "w1": w["w1"][rank * f:(rank + 1) * f], "w3": w["w3"][rank * f:(rank + 1) * f],
            "w2": w["w2"][:, rank * f:(rank + 1) * f]}


def _rope(x: torch.Tensor, base: float, interleaved: bool,
          inv: torch.Tensor | None = None,
          positions: torch.Tensor | None = None) -> torch.Tensor:
    b, s, d = x.shape[0], x.shape[1], x.shape[3]
    if inv is None:
        inv = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    pos = (torch.arange(s).expand(b, s) if positions is None else positions).float().cpu()
    ang = (pos[..., None] * inv.cpu()).to(x.device)  # [batch, seq, d / 2]
    if interleaved:  # pairs (2i, 2i+1), as complex numbers
        c = torch.view_as_complex(x.float().reshape(*x.shape[:-1], d // 2, 2))
        rot = c * torch.polar(torch.ones_like(ang), ang)[:, :, None]
        return torch.view_as_real(rot).flatten(-2).to(x.dtype)
    ang = torch.cat((ang, ang), -1)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    cos, sin = ang.cos()[:, :, None].to(x.dtype), ang.sin()[:, :, None].to(x.dtype)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def layer(x: torch.Tensor, w: dict[str, torch.Tensor], arch: ModelArch, *,
          base: float = 500000.0, interleaved: bool = False,
          inv: torch.Tensor | None = None,
          positions: torch.Tensor | None = None, documents: bool = False) -> torch.Tensor:
    """The whole layer on whole weights: RMSNorm, causal GQA with RoPE (at ``positions``,
    ``[batch, seq]``, default ``0 .. seq - 1``), SwiGLU (a model with ``moe``: the MoE
    block of ``kareus.testing.moe_block_reference`` on ``w``'s ``Wr``, ``W1e``, ``W2e``),
    residuals; with ``documents`` the
    attention masks the packed documents of ``positions`` (a document starts at position
    0; torchtitan's document mask), by explicit scores and softmax."""
    b, s, h = x.shape
    hd, eps = arch.head_dim, arch.norm_eps
    y = F.rms_norm(x, (h,), w["n1"], eps)
    q, k = F.linear(y, w["wq"]).view(b, s, -1, hd), F.linear(y, w["wk"]).view(b, s, -1, hd)
    if arch.qk_norm:  # per head, before RoPE
        q, k = F.rms_norm(q, (hd,), w["qn"], eps), F.rms_norm(k, (hd,), w["kn"], eps)
    q = _rope(q, base, interleaved, inv, positions)
    k = _rope(k, base, interleaved, inv, positions)
    v = F.linear(y, w["wv"]).view(b, s, -1, hd)
    if documents:  # explicit: scores, the mask, softmax (no SDPA on either side)
        doc = torch.cumsum((positions == 0).int(), dim=1) - 1
        allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(s, s, dtype=torch.bool,
                                                                   device=x.device).tril()
        rep = q.shape[2] // k.shape[2]
        qt, kt = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, 1)
        vt = v.transpose(1, 2).repeat_interleave(rep, 1)
        scores = (qt @ kt.transpose(-1, -2)) / hd ** 0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        o = scores.softmax(-1) @ vt
    else:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, enable_gqa=True)
    x = x + F.linear(o.transpose(1, 2).reshape(b, s, -1), w["wo"])
    y = F.rms_norm(x, (h,), w["n2"], eps)
    if arch.moe is not None:  # the MoE block (kareus's layout, every expert): the library's
        from kareus.testing import moe_block_reference

        shared = (w["Wsg"], w["Wsu"], w["Wsd"]) if "Wsg" in w else None
        return x + moe_block_reference(y.reshape(b * s, h), w["Wr"], w["W1e"], w["W2e"],
                                       top_k=arch.moe.experts_per_token,
                                       shared=shared).view(b, s, h)
    return x + F.linear(F.silu(F.linear(y, w["w1"])) * F.linear(y, w["w3"]), w["w2"])


def reference_run(x: torch.Tensor, w: dict[str, torch.Tensor], arch: ModelArch,
                  c: torch.Tensor, *, dtype: torch.dtype | None = None,
                  **kw: object
                  ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor | None]]:
    """``layer`` (``kw``: its keywords) by autograd on copies of ``x`` and ``w`` (cast to
    ``dtype`` if given: PyTorch's own autograd of the layer in that precision), under the
    loss ``sum(y * c)`` in ``c``'s dtype: the output (detached), the input gradient and
    every weight's gradient, by name."""
    xr = x.detach().to(dtype or x.dtype, copy=True).requires_grad_(True)
    pr = {k: v.detach().to(dtype or v.dtype, copy=True).requires_grad_(True)
          for k, v in w.items()}
    y = layer(xr, pr, arch, **kw)  # type: ignore[arg-type]
    (y.to(c.dtype) * c).sum().backward()
    return y.detach(), xr.grad, {k: v.grad for k, v in pr.items()}


def planned_weights(p: dict[str, torch.Tensor], arch: ModelArch, *,
                    interleaved: bool = False) -> dict[str, torch.Tensor]:
    """kareus's layout of a (sharded) layer's weights, through the public helpers."""
    from kareus.integrations import head_norm, linear, qkv_from_separate

    out = {"w_attn_norm": p["n1"],
           "Wqkv": qkv_from_separate(p["wq"], p["wk"], p["wv"], head_dim=arch.head_dim,
                                     interleaved_rope=interleaved),
           "Wo": linear(p["wo"]), "w_mlp_norm": p["n2"], "Wg": linear(p["w1"]),
           "Wu": linear(p["w3"]), "Wd": linear(p["w2"])}
    if arch.qk_norm:  # the norm weights' entries follow the rows' order
        out["w_q_norm"] = head_norm(p["qn"], interleaved_rope=interleaved)
        out["w_k_norm"] = head_norm(p["kn"], interleaved_rope=interleaved)
    return out
