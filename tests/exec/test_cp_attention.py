"""Context-parallel attention on Megatron-Core's load-balanced chunks (kareus.exec._cp_attention).

For every CP rank of CP = 2 and 3 (float64, CPU): the gathered keys and values put in
position order are the sequence's; the two causal pieces give the rows of whole-sequence
causal attention at the rank's positions, and their backward the gradients autograd gives
for those rows (dK/dV summed over the pieces, by position); the reduce-scatter layout is
the gather's adjoint. The runnable partitions' CP attention ops run (CP rank 0's work).
The GPU check of the flash op's lower-right alignment is in ``test_cp_attention_gpu``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec._cp_attention import (
    attention_pieces,
    cp_attention,
    cp_attention_bwd,
    order_kv,
    scatter_kv_grad,
)
from kareus.exec.kernels import get_kernels
from kareus.model import cp_positions

F = torch.nn.functional


def _gathered(k, v, cp):
    """What the all-gather returns: each rank's [2, b, its tokens, kvh, hd], rank-major."""
    parts = []
    for r in range(cp):
        pos = torch.tensor(cp_positions(k.shape[1], cp, r))
        parts.append(torch.stack((k[:, pos], v[:, pos])))
    return torch.stack(parts).reshape(-1)


@pytest.mark.parametrize("cp", [2, 3])
def test_pieces_are_whole_sequence_causal_attention(cp):
    g = torch.Generator().manual_seed(cp)
    b, s, heads, kvh, hd = 2, 12 * cp, 4, 2, 8
    q = torch.randn(b, s, heads, hd, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, kvh, hd, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, kvh, hd, generator=g, dtype=torch.float64)
    do = torch.randn(b, s, heads, hd, generator=g, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2),
                                         vr.transpose(1, 2), is_causal=True, enable_gqa=True)
    ks = get_kernels("torch")
    sq = s // cp
    gathered = _gathered(k, v, cp)
    kv = order_kv(gathered, cp=cp, b=b, sq=sq, kvh=kvh, hd=hd)
    assert torch.equal(kv[0], k) and torch.equal(kv[1], v)
    dkv_sum = torch.zeros(2, b, s, kvh, hd, dtype=torch.float64)
    rs_in = torch.zeros(cp, 2, b, sq, kvh, hd, dtype=torch.float64)
    for r in range(cp):
        pos = torch.tensor(cp_positions(s, cp, r))
        pieces = attention_pieces(sq, cp, r)
        ql = q[:, pos].transpose(1, 2)
        o, saved = cp_attention(ks, ql, kv[0].transpose(1, 2), kv[1].transpose(1, 2), pieces,
                                keep=True)
        o2, _ = cp_attention(ks, ql, kv[0].transpose(1, 2), kv[1].transpose(1, 2), pieces,
                             keep=False)
        torch.testing.assert_close(o, ref[:, :, pos].detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(o2, o, rtol=1e-10, atol=1e-10)
        dq, dkv = cp_attention_bwd(do[:, pos].transpose(1, 2), saved, pieces, keys=s)
        # autograd of the same rows: the output rows at this rank's positions
        gq, gk, gv = torch.autograd.grad(ref[:, :, pos], (qr, kr, vr),
                                         do[:, pos].transpose(1, 2), retain_graph=True)
        torch.testing.assert_close(dq.transpose(1, 2), gq[:, pos], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dkv[0], gk, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dkv[1], gv, rtol=1e-10, atol=1e-10)
        dkv_sum += dkv
        buf = torch.zeros(cp * 2 * b * sq * kvh * hd, dtype=torch.float64)
        scatter_kv_grad(dkv, buf, cp=cp, b=b, sq=sq, kvh=kvh, hd=hd)
        rs_in += buf.view(cp, 2, b, sq, kvh, hd)
    # the reduce-scatter hands each rank its chunks' summed gradients: the whole-sequence ones
    gk, gv = torch.autograd.grad(ref, (kr, vr), do.transpose(1, 2))
    for r in range(cp):
        pos = torch.tensor(cp_positions(s, cp, r))
        torch.testing.assert_close(rs_in[r, 0], gk[:, pos], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(rs_in[r, 1], gv[:, pos], rtol=1e-10, atol=1e-10)


def test_runnable_partitions_run_cp_rank_0_s_attention():
    from kareus.exec import runnable_partitions
    from kareus.model import build_partitions
    from kareus.model.workload import ModelArch, Parallelism, Workload

    m = ModelArch(name="tiny", layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64,
                  vocab=50)
    wl = Workload(model=m, parallelism=Parallelism(tp=2, cp=2), microbatch_size=2,
                  seq_len=16, num_microbatches=1, nanobatches=1)
    names = [n for n, p in build_partitions(wl).types.items()
             if any(o.name.startswith("attn_core") for o in p.compute_ops)]
    assert names
    for part in runnable_partitions(wl, names).values():
        prog = part.build(device="cpu", seed=0)
        prog.run_plain()
