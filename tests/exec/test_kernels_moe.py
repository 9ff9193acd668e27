"""The mixture-of-experts kernels on the CPU: the whole MoE block (router, top-k,
permutation, the expert-parallel exchange simulated in one process, sort by local expert,
grouped SwiGLU expert GEMMs, un-permutation) and every backward op against torch autograd
of a dense per-token formula in float64, with uneven routing and experts that receive no
token; the orders against Megatron-Core's own ``permute`` and ``sort_chunks_by_idxs``; the
top-k's equality with Qwen3 MoE's / Mixtral's renormalised softmax; both grouped GEMM paths.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.errors import ArgumentError
from kareus.exec.kernels import ReferenceKernels, TokenPermutation, TorchKernels

F64 = torch.float64


def rel(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


class _Loop(TorchKernels):
    grouped_gemm = "loop"


class _Grouped(TorchKernels):
    grouped_gemm = "grouped_mm"


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
    """Every rank's MoE output and the gradients, by autograd of the per-token formula."""
    xs = [x.detach().double().requires_grad_() for x in xs]
    wr, w1, w2 = (w.detach().double().requires_grad_() for w in (wr, w1, w2))
    fe = w2.shape[1]
    outs = []
    for x in xs:
        logits = x @ wr
        top, idx = torch.topk(logits, k, dim=-1)
        p = torch.softmax(top, dim=-1)
        out = torch.zeros_like(x)
        for i in range(x.shape[0]):
            for j in range(k):
                e = int(idx[i, j])
                hh = x[i] @ w1[e]
                a = torch.nn.functional.silu(hh[:fe]) * hh[fe:]
                out[i] = out[i] + p[i, j] * (a @ w2[e])
        outs.append(out)
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
    dxs_out, dwr = [], torch.zeros(wr.shape, dtype=getattr(torch, router_dtype))
    for s in range(ep):
        logits, probs, idx, perm = r_state[s]
        dx = ks.permute_bwd(grad_rows[s], perm)
        dlogits = ks.router_topk_bwd(dprobs_of[s], probs, idx, E)
        dx = dx + ks.router_dgrad(dlogits, wr, dtype=dx.dtype)
        dwr += ks.router_wgrad(xs[s], dlogits)
        dxs_out.append(dx)
    return outs, dxs_out, dwr, dw1, dw2


CASES = {
    # ranks, tokens, hidden, experts, expert width, top-k, never-chosen experts, popular
    "ep1": (1, 13, 16, 4, 8, 2, (), None),
    "ep2_uneven": (2, 11, 16, 8, 8, 2, (1, 4, 5), 6),
    "ep4_empty_rank": (4, 7, 8, 8, 16, 3, (2, 3), 0),  # rank 1 receives no token at all
    "topk1": (2, 9, 16, 4, 8, 1, (), None),
}


@pytest.mark.parametrize("ks", [_Loop(), _Grouped(), ReferenceKernels()],
                         ids=["torch-loop", "torch-grouped_mm", "reference"])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_block_matches_autograd_float64(ks, case):
    ep, t, h, E, fe, k, empty, popular = CASES[case]
    xs, wr, w1, w2, dout = make(list(CASES).index(case), ranks=ep, t=t, h=h, E=E, fe=fe,
                                empty=empty, popular=popular)
    if isinstance(ks, _Grouped):  # torch._grouped_mm takes float32 / bfloat16, not float64
        xs, wr, w1, w2, dout = ([v.float() for v in xs], wr.float(), w1.float(), w2.float(),
                                [v.float() for v in dout])
        router_dtype, tol = "float32", 1e-5
    else:  # TorchKernels' SwiGLU computes in float32 (its formula), the reference's in float64
        router_dtype, tol = "float64", 1e-12 if isinstance(ks, ReferenceKernels) else 1e-6
    ref = dense_reference(xs, wr, w1, w2, dout, k)
    got = moe_block(ks, xs, wr, w1, w2, dout, k=k, ep=ep, router_dtype=router_dtype)
    for name, g, r in zip(("out", "dx"), got[:2], ref[:2], strict=True):
        for gr, rr in zip(g, r, strict=True):
            assert rel(gr, rr) < tol, name
    for name, g, r in zip(("dw_router", "dw_gate_up", "dw_down"), got[2:], ref[2:],
                          strict=True):
        assert rel(g, r) < tol, name
    for e in empty:  # experts without tokens get a zero gradient
        assert float(got[3][e].abs().max()) == 0.0
        assert float(got[4][e].abs().max()) == 0.0


def test_bf16_block_close_to_float64():
    ks = TorchKernels()
    xs, wr, w1, w2, dout = make(3, ranks=2, t=32, h=32, E=8, fe=16, empty=(7,))
    lo = ([x.bfloat16() for x in xs], wr.float(), w1.bfloat16(), w2.bfloat16(),
          [d.bfloat16() for d in dout])
    ref = dense_reference(*lo, k=2)
    got = moe_block(ks, *lo, k=2, ep=2, router_dtype="float32")
    assert got[0][0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for g, r in zip(got[0] + got[1], ref[0] + ref[1], strict=True):
        assert rel(g, r) < 2e-2
    for g, r in zip(got[2:], ref[2:], strict=True):
        assert rel(g, r) < 2e-2


def test_topk_softmax_equals_renormalised_softmax_then_topk():
    # Megatron-Core's default (top-k, then softmax over the k) against Qwen3 MoE's
    # norm_topk_prob=True and Mixtral's (softmax over E, top-k, divide by the sum)
    ks = TorchKernels()
    logits = torch.randn(50, 16, generator=torch.Generator().manual_seed(0), dtype=F64)
    probs, idx = ks.router_topk(logits, 4)
    full = torch.softmax(logits, dim=-1)
    p_hf, idx_hf = torch.topk(full, 4, dim=-1)
    p_hf = p_hf / p_hf.sum(-1, keepdim=True)
    assert torch.equal(idx, idx_hf)
    assert torch.allclose(probs, p_hf, rtol=1e-14, atol=0)


def test_permutation_order_is_megatron_cores():
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    ks = TorchKernels()
    g = torch.Generator().manual_seed(1)
    t, E, k = 10, 6, 2
    x = torch.randn(t, 4, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    rows, perm = ks.permute(x, idx, experts=E, ep=3)
    routing_map = torch.zeros(t, E, dtype=torch.bool).scatter_(1, idx, True)
    mc_rows, _, mc_sorted = moe_utils.permute(x, routing_map)
    assert torch.equal(rows, mc_rows)
    assert torch.equal(perm.token_of_row, mc_sorted)
    assert perm.tokens_per_expert.tolist() == routing_map.sum(0).tolist()
    assert perm.input_splits() == routing_map.sum(0).view(3, 2).sum(1).tolist()
    assert perm.send_counts.shape == (3, 2) and perm.local_experts == 2


def test_expert_sort_is_megatron_cores_sort_chunks():
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    ks = TorchKernels()
    ep, L = 3, 4
    counts = torch.tensor([[2, 0, 1, 3], [0, 0, 4, 1], [5, 2, 0, 0]])
    rows = torch.arange(int(counts.sum()), dtype=torch.float32).unsqueeze(1).repeat(1, 2)
    # Megatron-Core's all-to-all dispatcher: sort_input_by_local_experts
    sort_idx = torch.arange(ep * L).reshape(-1, L).T.ravel()
    mc, _ = moe_utils.sort_chunks_by_idxs(rows, counts.ravel(), sort_idx)
    got = ks.expert_sort(rows, counts.tolist())
    assert torch.equal(got, mc)
    restore_idx = torch.arange(ep * L).reshape(L, -1).T.ravel()
    mc_back, _ = moe_utils.sort_chunks_by_idxs(mc, counts.T.ravel(), restore_idx)
    assert torch.equal(ks.expert_unsort(got, counts), mc_back)
    assert torch.equal(mc_back, rows)


def test_grouped_mm_paths_agree_with_empty_groups():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 16, generator=g)
    w = torch.randn(4, 16, 8, generator=g)
    dy = torch.randn(20, 8, generator=g)
    counts = [0, 12, 0, 8]
    a, b = _Loop(), _Grouped()
    assert torch.allclose(a.grouped_mm(x, w, counts), b.grouped_mm(x, w, counts), atol=1e-5)
    assert torch.allclose(a.grouped_mm_wgrad(x, dy, counts),
                          b.grouped_mm_wgrad(x, dy, torch.tensor(counts)), atol=1e-5)
    assert float(b.grouped_mm_wgrad(x, dy, counts)[0].abs().max()) == 0.0


def test_grouped_gemm_path_choice_and_names():
    from kareus.exec.kernels._moe import grouped_mm_path

    x, w = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 8, dtype=torch.bfloat16)
    assert grouped_mm_path(x, w) == "loop"  # the CPU: the loop
    assert grouped_mm_path(x, w, "grouped_mm") == "grouped_mm"
    assert "torch._grouped_mm" in TorchKernels().kernel_names()["grouped_mm"]
    assert "loop" in ReferenceKernels().kernel_names()["grouped_mm"]
    with pytest.raises(ArgumentError, match="grouped_gemm must be one of"):
        grouped_mm_path(x, w, "cutlass")


def test_bad_inputs_are_refused_in_one_line():
    ks = _Loop()
    x, w = torch.zeros(5, 4), torch.zeros(2, 4, 3)
    with pytest.raises(ArgumentError, match="sum to 4 rows"):
        ks.grouped_mm(x, w, [1, 3])
    with pytest.raises(ArgumentError, match="3 groups"):
        ks.grouped_mm(x, w, [1, 3, 1])
    with pytest.raises(ArgumentError, match="multiple of ep"):
        ks.permute(x, torch.zeros(5, 1, dtype=torch.long), experts=3, ep=2)
    with pytest.raises(ArgumentError, match="top-k"):
        ks.router_topk(torch.zeros(2, 3), 4)
    with pytest.raises(ArgumentError, match="table"):
        ks.expert_sort(x, [1, 2, 2])
