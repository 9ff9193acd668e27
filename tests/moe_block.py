"""A mixture-of-experts block, forward and backward, through a kernel set's MoE ops, with
the expert-parallel all-to-alls simulated in one process, and its float64 autograd
reference (kareus.testing.moe_block_reference per rank): shared by the CPU and GPU kernel tests
(importable from every test: pytest puts tests/ on the path for its conftest.py)."""

from __future__ import annotations

import torch

from kareus.exec.kernels import TokenPermutation

F64 = torch.float64


def make(seed, *, ranks, t, h, E, fe, empty=(), popular=None, dtype=F64):
    """Per-rank inputs and shared weights; experts in ``empty`` are never chosen (a
    constant input column times a large negative router weight), ``popular`` is chosen
    by every token."""
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(ranks):
        x = torch.randn(t, h, generator=g, dtype=F64)
        x[:, 0] = 1.0
        xs.append(x.to(dtype))
    wr = torch.randn(h, E, generator=g, dtype=F64) * 0.5
    for e in empty:
        wr[0, e] = -100.0
    if popular is not None:
        wr[0, popular] = 100.0
    w1 = torch.randn(E, h, 2 * fe, generator=g, dtype=F64) * h ** -0.5
    w2 = torch.randn(E, fe, h, generator=g, dtype=F64) * fe ** -0.5
    dout = [torch.randn(t, h, generator=g, dtype=F64).to(dtype) for _ in range(ranks)]
    return xs, wr, w1.to(dtype), w2.to(dtype), dout


def dense_reference(xs, wr, w1, w2, dout, k):
    """Every rank's MoE output and the gradients, by autograd of kareus's reference block
    ([`moe_block_reference`][kareus.testing.moe_block_reference]) on each rank's tokens."""
    from kareus.testing import moe_block_reference

    xs = [x.detach().double().requires_grad_() for x in xs]
    wr, w1, w2 = (w.detach().double().requires_grad_() for w in (wr, w1, w2))
    outs = [moe_block_reference(x, wr, w1, w2, top_k=k) for x in xs]
    loss = sum((o * d.double()).sum() for o, d in zip(outs, dout, strict=True))
    loss.backward()
    return ([o.detach() for o in outs], [x.grad for x in xs], wr.grad, w1.grad, w2.grad)


def exchange(chunks_of):
    """An all-to-all in one process: ``chunks_of[s][r]`` (rows rank s sends rank r) ->
    per rank r, the received rows in source-rank order."""
    ranks = len(chunks_of)
    return [torch.cat([chunks_of[s][r] for s in range(ranks)]) for r in range(ranks)]


def split_rows(x, splits):
    return list(torch.split(x, splits))


def moe_block(ks, xs, wr, w1, w2, dout, *, k, ep, router_dtype="float64"):
    """Forward and backward of the MoE block on ``ep`` ranks through kernel set ``ks``
    (the all-to-alls simulated by ``exchange``)."""
    E = wr.shape[1]
    L = E // ep
    r_state = []
    dispatch = []
    for x in xs:
        logits = ks.router(x, wr, dtype=router_dtype)
        probs, idx = ks.router_topk(logits, k)
        rows, perm = ks.permute(x, idx, experts=E, ep=ep)
        assert isinstance(perm, TokenPermutation)
        r_state.append((logits, probs, idx, perm))
        dispatch.append(split_rows(rows, perm.input_splits()))
    received = exchange(dispatch)
    send = torch.stack([st[3].send_counts for st in r_state])  # [src, dst, L]
    e_state, combine = [], []
    for r in range(ep):
        counts = send[:, r, :]  # [src, L] rows received from each source per local expert
        lw1, lw2 = w1[r * L:(r + 1) * L], w2[r * L:(r + 1) * L]
        xs_sorted = ks.expert_sort(received[r], counts.tolist())
        local = counts.sum(0)
        h1 = ks.grouped_mm(xs_sorted, lw1, local.tolist())
        a = ks.expert_swiglu(h1)
        y = ks.grouped_mm(a, lw2, local)  # counts as a tensor too
        ys = ks.expert_unsort(y, counts)
        e_state.append((counts, xs_sorted, h1, a))
        combine.append(split_rows(ys, counts.sum(1).tolist()))
    back = exchange(combine)
    outs = [ks.unpermute(back[s], r_state[s][1], r_state[s][3]) for s in range(ep)]
    # backward
    grad_disp, dprobs_of = [], []
    for s in range(ep):
        _, probs, _, perm = r_state[s]
        drows, dprobs = ks.unpermute_bwd(dout[s], back[s], probs, perm)
        dprobs_of.append(dprobs)
        grad_disp.append(split_rows(drows, perm.input_splits()))
    grad_recv = exchange(grad_disp)
    dw1 = torch.zeros_like(w1)
    dw2 = torch.zeros_like(w2)
    grad_comb = []
    for r in range(ep):
        counts, xs_sorted, h1, a = e_state[r]
        lw1, lw2 = w1[r * L:(r + 1) * L], w2[r * L:(r + 1) * L]
        local = counts.sum(0).tolist()
        dy = ks.expert_unsort_bwd(grad_recv[r], counts)
        da = ks.grouped_mm(dy, lw2.transpose(1, 2), local)
        dw2[r * L:(r + 1) * L] = ks.grouped_mm_wgrad(a, dy, local)
        dh = ks.expert_swiglu_bwd(da, h1)
        dxs = ks.grouped_mm(dh, lw1.transpose(1, 2), local)
        dw1[r * L:(r + 1) * L] = ks.grouped_mm_wgrad(xs_sorted, dh, local)
        grad_comb.append(split_rows(ks.expert_sort_bwd(dxs, counts), counts.sum(1).tolist()))
    grad_rows = exchange(grad_comb)
    dxs_out = []
    dwr = torch.zeros(wr.shape, dtype=getattr(torch, router_dtype), device=wr.device)
    for s in range(ep):
        logits, probs, idx, perm = r_state[s]
        dx = ks.permute_bwd(grad_rows[s], perm)
        dlogits = ks.router_topk_bwd(dprobs_of[s], probs, idx, E)
        dx = dx + ks.router_dgrad(dlogits, wr, dtype=dx.dtype)
        dwr += ks.router_wgrad(xs[s], dlogits)
        dxs_out.append(dx)
    return outs, dxs_out, dwr, dw1, dw2
