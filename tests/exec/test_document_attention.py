"""Packed documents' block-causal attention (``kareus.exec.kernels.DocumentMask``): the
block-sparse FlexAttention path against the dense-mask SDPA path and an explicit softmax
reference.

On the CPU: the tiles the block mask skips, runs unmasked and evaluates, checked against
the dense mask tile by tile (padding, sequences starting mid-document, one document, a
document per token); FlexAttention's forward (eager: torch 2.13 runs it on the CPU, but
has no CPU backward) equal to the dense-mask path, grouped K/V included; the dense path's
explicit forward/backward pair against autograd on an explicit softmax. On a GPU (skipped
without CUDA): the compiled FlexAttention path equal to the dense-mask path in bf16,
forward and gradients, grouped K/V; a new batch's documents without recompiling; and both
inside a CUDA graph capture replayed on another batch's documents.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from _helpers import warm_up_on_a_side_stream

from kareus.errors import ArgumentError
from kareus.exec.kernels import DocumentMask, TorchKernels

F = torch.nn.functional


def packed(b: int, s: int, lengths: tuple[int, ...], *, offset: int = 0) -> torch.Tensor:
    """Positions of ``b`` sequences of ``s`` tokens: documents of ``lengths`` tokens in
    turn (row ``r`` starting ``r`` documents later in the cycle); with ``offset``, row 1
    starts mid-document (its first positions are not 0)."""
    rows = []
    for r in range(b):
        pos: list[int] = []
        i = r
        while len(pos) < s:
            pos += range(lengths[i % len(lengths)])
            i += 1
        rows.append(torch.tensor(pos[:s]))
    out = torch.stack(rows)
    if offset and b > 1:
        out[1, :offset] = torch.arange(7, 7 + offset)
    return out


def reference(q, k, v, positions):
    """Block-causal attention by an explicit softmax (float64 on the inputs' values)."""
    doc = torch.cumsum((positions == 0).long(), dim=1)
    s = q.shape[2]
    allowed = ((doc[:, :, None] == doc[:, None, :])
               & torch.ones(s, s, dtype=torch.bool, device=doc.device).tril())
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1) @ v


LAYOUTS = {
    "mixed": (3, 300, (40, 1, 97, 128, 5, 300)),
    "mid_document_start": (2, 256, (90, 30)),
    "one_document": (2, 200, (1000,)),
    "token_documents": (1, 130, (1,)),
    "tile_aligned": (2, 256, (128,)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("block", [16, 32, 128])
def test_tiles_are_the_dense_mask_s(name, block):
    b, s, lengths = LAYOUTS[name]
    docs = DocumentMask(packed(b, s, lengths, offset=5 if "mid" in name else 0))
    partial, full = docs.tiles(block)
    dense = docs.dense()[:, 0]
    n = -(-s // block)
    assert partial.shape == full.shape == (b, n, n)
    for bi in range(b):
        for i in range(n):
            for j in range(n):
                tile = dense[bi, i * block:(i + 1) * block, j * block:(j + 1) * block]
                whole = tile.shape == (block, block)
                assert bool(full[bi, i, j]) == (whole and bool(tile.all())), (bi, i, j)
                assert bool(partial[bi, i, j]) == (bool(tile.any())
                                                   and not bool(full[bi, i, j])), (bi, i, j)
    # the tiles skipped: every tile above the diagonal, and more with short documents
    skipped = int((~(partial | full)).sum())
    assert skipped >= b * n * (n - 1) // 2


def test_the_block_mask_holds_the_tiles_in_order():
    docs = DocumentMask(packed(2, 300, (40, 200, 60)))
    bm = docs.block_mask(32)
    partial, full = docs.tiles(32)
    assert tuple(bm.kv_num_blocks.shape) == (2, 1, 10)
    assert torch.equal(bm.kv_num_blocks[:, 0], partial.sum(-1).int())
    assert torch.equal(bm.full_kv_num_blocks[:, 0], full.sum(-1).int())
    for bi in range(2):
        for i in range(10):
            k = int(bm.kv_num_blocks[bi, 0, i])
            assert bm.kv_indices[bi, 0, i, :k].tolist() == torch.nonzero(
                partial[bi, i]).flatten().tolist()
    assert docs.block_mask(32) is bm  # built once per batch
    assert docs.rows(0, 1) is docs.rows(0, 1) and docs.rows(0, 2) is docs


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flex_forward_equals_the_dense_mask_on_the_cpu(kv_heads, dtype):
    # torch 2.13 runs FlexAttention's forward on the CPU (eagerly, unfused) but has no CPU
    # backward: the gradients are compared on a GPU (test_flex_equals_the_mask_path_bf16)
    g = torch.Generator().manual_seed(0)
    b, s, h, hd = 3, 300, 4, 16
    q = torch.randn(b, h, s, hd, generator=g, dtype=dtype)
    k = torch.randn(b, kv_heads, s, hd, generator=g, dtype=dtype)
    v = torch.randn(b, kv_heads, s, hd, generator=g, dtype=dtype)
    pos = packed(b, s, (40, 1, 97, 128, 5), offset=3)
    docs = DocumentMask(pos)
    mask_ks, flex_ks = TorchKernels(), TorchKernels()
    flex_ks.documents_backend = "flex"
    assert mask_ks.document_backend(q) == "mask"  # the CPU's default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        got = flex_ks.attention(q, k, v, mask=docs)
        part = flex_ks.attention(q[1:], k[1:], v[1:], mask=docs.rows(1, 3))
    want = mask_ks.attention(q, k, v, mask=docs)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(part, want[1:], **tol)
    torch.testing.assert_close(want.double(), reference(q.double(), k.double(), v.double(),
                                                        pos), rtol=1e-5, atol=1e-6)


def test_the_dense_path_s_explicit_backward_is_autograd_s():
    g = torch.Generator().manual_seed(1)
    b, s, h, kvh, hd = 2, 96, 4, 2, 8
    q, k, v = (torch.randn(b, n, s, hd, generator=g, dtype=torch.float64)
               for n in (h, kvh, kvh))
    pos = packed(b, s, (10, 33, 7))
    ks = TorchKernels()
    saved = ks.attention_fwd(q, k, v, mask=DocumentMask(pos))
    assert saved.backend == "autograd"
    do = torch.randn(b, h, s, hd, generator=g, dtype=torch.float64)
    dq, dk, dv = ks.attention_bwd(do, saved)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = reference(qr, kr, vr, pos)
    o.backward(do)
    torch.testing.assert_close(saved.output, o.detach())
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want)


def test_bad_document_inputs_are_refused():
    q = torch.randn(2, 4, 32, 8)
    docs = DocumentMask(packed(2, 32, (5,)))
    ks = TorchKernels()
    ks.documents_backend = "varlen"
    with pytest.raises(ArgumentError, match="documents_backend"):
        ks.attention(q, q, q, mask=docs)
    with pytest.raises(ArgumentError, match="document mask is for 2 x 32"):
        TorchKernels().attention(q[:, :, :16], q[:, :, :16], q[:, :, :16], mask=docs)
    with pytest.raises(ArgumentError, match=r"\[batch, seq\]"):
        DocumentMask(torch.zeros(32))


# ------------------------------------------------------------------ on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _qkv(b, s, h, kvh, hd, seed, dev):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, hd, generator=g).to(dev, torch.bfloat16)
            for n in (h, kvh, kvh)]


def _fwd_bwd(ks, q, k, v, docs, do):
    saved = ks.attention_fwd(q, k, v, mask=docs)
    return (saved.output, *ks.attention_bwd(do, saved))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_flex_equals_the_mask_path_bf16(kv_heads):
    # the compiled FlexAttention kernel against SDPA with the dense mask, bf16: output and
    # every gradient, both within bf16 rounding of the float64 explicit reference
    dev = torch.device("cuda")
    b, s, h, hd = 2, 1024, 8, 128
    q, k, v = _qkv(b, s, h, kv_heads, hd, 0, dev)
    do = _qkv(b, s, h, h, hd, 1, dev)[0]
    pos = packed(b, s, (300, 17, 128, 600), offset=9).to(dev)
    docs = DocumentMask(pos)
    flex, mask = TorchKernels(), TorchKernels()
    mask.documents_backend = "mask"
    assert flex.document_backend(q) == "flex"  # the GPU's default
    got = _fwd_bwd(flex, q, k, v, docs, do)
    want = _fwd_bwd(mask, q, k, v, docs, do)
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    o = reference(qr, kr, vr, pos)
    o.backward(do.double())
    exact = (o.detach(), qr.grad, kr.grad, vr.grad)
    for what, a, m, e in zip(("output", "dq", "dk", "dv"), got, want, exact, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == m.shape, what
        assert _rel(a, m) < 2e-2, (what, _rel(a, m))
        assert _rel(a, e) <= max(2 * _rel(m, e), 1e-2), (what, _rel(a, e), _rel(m, e))


@pytest.mark.gpu
@gpu
def test_flex_inside_a_cuda_graph_follows_each_batch_s_documents():
    # built and run in the capture: the block mask from the positions' tensor, the compiled
    # kernel forward and backward; replayed on another batch's documents (copied into the
    # captured tensors), it equals eager execution on them. A new batch does not recompile.
    import torch._dynamo

    dev = torch.device("cuda")
    b, s, h, kvh, hd = 2, 2048, 8, 2, 128
    ks = TorchKernels()
    q, k, v = _qkv(b, s, h, kvh, hd, 0, dev)
    do = _qkv(b, s, h, h, hd, 1, dev)[0]
    first = packed(b, s, (1000, 300, 17)).to(dev)
    second = packed(b, s, (128, 900, 1024), offset=40).to(dev)
    pos = first.clone()

    def body():
        return _fwd_bwd(ks, q, k, v, DocumentMask(pos), do)

    warm_up_on_a_side_stream(body)
    with torch._dynamo.config.patch(error_on_recompile=True):
        want = _fwd_bwd(ks, q, k, v, DocumentMask(second), do)  # no recompile
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = body()
    pos.copy_(second)
    graph.replay()
    torch.cuda.synchronize()
    for what, a, w in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        assert _rel(a, w) < 1e-3, (what, _rel(a, w))
    pos.copy_(first)
    graph.replay()
    torch.cuda.synchronize()
    want_first = _fwd_bwd(ks, q, k, v, DocumentMask(first), do)
    assert _rel(got[0], want_first[0]) < 1e-3
