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

from moe_block import dense_reference, make, moe_block

from kareus.errors import ArgumentError
from kareus.exec.kernels import ReferenceKernels, TorchKernels

F64 = torch.float64


def rel(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


class _Loop(TorchKernels):
    grouped_gemm = "loop"


class _Grouped(TorchKernels):
    grouped_gemm = "grouped_mm"


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


def test_out_arguments_write_the_same_values_in_place():
    ks = _Loop()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 8, generator=g)
    idx = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 1], [0, 1], [3, 2]])
    rows, perm = ks.permute(x, idx, experts=4, ep=2)
    buf = torch.full((12, 8), float("nan"))
    got, _ = ks.permute(x, idx, experts=4, ep=2, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf, rows)
    counts = [[2, 1], [3, 0]]
    for fn in (ks.expert_sort, ks.expert_unsort, ks.expert_sort_bwd, ks.expert_unsort_bwd):
        buf = torch.full((6, 8), float("nan"))
        assert torch.equal(fn(x, counts, out=buf), fn(x, counts)) and torch.equal(buf, fn(x, counts))
    w = torch.randn(2, 8, 4, generator=g)  # rows of 16 bytes (torch._grouped_mm)
    buf = torch.full((6, 4), float("nan"))
    for k in (_Loop(), _Grouped()):
        assert torch.allclose(k.grouped_mm(x, w, [4, 2], out=buf), k.grouped_mm(x, w, [4, 2]))
    probs = torch.rand(6, 2, generator=g)
    dout = torch.randn(6, 8, generator=g)
    buf = torch.full((12, 8), float("nan"))
    drows, dprobs = ks.unpermute_bwd(dout, rows, probs, perm, out=buf)
    want = ks.unpermute_bwd(dout, rows, probs, perm)
    assert drows.data_ptr() == buf.data_ptr()
    assert torch.equal(drows, want[0]) and torch.equal(dprobs, want[1])


def test_router_dtype_by_name_or_torch_dtype():
    ks = TorchKernels()
    x, w = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(4, 5, dtype=torch.bfloat16)
    assert ks.router(x, w).dtype == torch.float32
    assert ks.router(x, w, dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ArgumentError, match="router dtype must be a floating dtype"):
        ks.router(x, w, dtype=torch.int32)


@pytest.mark.parametrize("ks", [ReferenceKernels(), _Loop()], ids=["reference", "torch-loop"])
def test_autograd_wrappers_give_autograds_gradients(ks):
    from kareus.exec.kernels import autograd as kag

    xs, wr, w1, w2, dout = make(7, ranks=1, t=9, h=8, E=4, fe=4, empty=(2,))
    ref = dense_reference(xs, wr, w1, w2, dout, 2)
    x = xs[0].clone().requires_grad_()
    wr_, w1_, w2_ = (w.clone().requires_grad_() for w in (wr, w1, w2))
    logits = kag.moe_router(x, wr_, dtype="float64", kernels=ks)
    probs, idx = kag.moe_router_topk(logits, 2, kernels=ks)
    rows, perm = kag.moe_permute(x, idx, experts=4, ep=2, kernels=ks)
    # The rows come in (rank, local expert) chunks; sorted as a [2, 2] table they are in
    # (local expert, rank) order: global experts 0, 2, 1, 3, whose weights are taken so.
    table = perm.send_counts
    xs_sorted = kag.moe_expert_sort(rows, table, kernels=ks)
    order = [0, 2, 1, 3]
    groups = table.t().reshape(-1).tolist()
    h1 = kag.moe_grouped_mm(xs_sorted, w1_[order], groups, kernels=ks)
    a = kag.moe_expert_swiglu(h1, kernels=ks)
    y = kag.moe_grouped_mm(a, w2_[order], groups, kernels=ks)
    out = kag.moe_unpermute(kag.moe_expert_unsort(y, table, kernels=ks), probs, perm,
                            kernels=ks)
    (out * dout[0]).sum().backward()
    tol = 1e-12 if isinstance(ks, ReferenceKernels) else 1e-6
    assert rel(out.detach(), ref[0][0]) < tol
    for got, want in ((x.grad, ref[1][0]), (wr_.grad, ref[2]), (w1_.grad, ref[3]),
                      (w2_.grad, ref[4])):
        assert rel(got, want) < tol


def test_routing_and_unpermutation_match_megatron_cores_functions():
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    ks = TorchKernels()
    g = torch.Generator().manual_seed(9)
    t, E, k, h = 17, 8, 2, 6
    logits = torch.randn(t, E, generator=g)
    probs, idx = ks.router_topk(logits, k)
    mc_probs, mc_map = moe_utils.topk_routing_with_score_function(logits, k)
    dense = torch.zeros(t, E).scatter_(1, idx, probs)
    assert torch.equal(mc_map, dense > 0)
    assert torch.allclose(mc_probs, dense, rtol=1e-6, atol=0)
    x = torch.randn(t, h, generator=g)
    rows, perm = ks.permute(x, idx, experts=E, ep=4)
    y = torch.randn(t * k, h, generator=g)  # the experts' outputs, in the permuted order
    mc_out = moe_utils.unpermute(y, perm.token_of_row, x.shape, probs=mc_probs,
                                 routing_map=mc_map)
    assert torch.allclose(ks.unpermute(y, probs, perm), mc_out, rtol=1e-5, atol=1e-6)
