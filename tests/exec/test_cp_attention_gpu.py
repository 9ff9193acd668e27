"""Context-parallel attention on a GPU: the non-square causal pieces run on the flash op
called directly (its ``is_causal`` aligned to the lower right), not on the masked fallback,
and they equal whole-sequence causal attention at the rank's positions (bf16, against a
float32 reference), forward and backward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _helpers import cuda_marks

pytestmark = cuda_marks()

F = torch.nn.functional


@pytest.mark.parametrize("cp", [2, 4])
def test_pieces_run_on_flash_and_equal_causal_attention(cp):
    from kareus.exec._cp_attention import attention_pieces, cp_attention, cp_attention_bwd
    from kareus.exec.kernels import get_kernels
    from kareus.model import cp_positions

    g = torch.Generator(device="cuda").manual_seed(cp)
    b, s, heads, kvh, hd = 2, 512 * cp, 16, 8, 128

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    q, k, v, do = rnd(b, s, heads, hd), rnd(b, s, kvh, hd), rnd(b, s, kvh, hd), rnd(b, s, heads, hd)
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr.transpose(1, 2), kr.transpose(1, 2),
                                         vr.transpose(1, 2), is_causal=True, enable_gqa=True)
    ks = get_kernels()
    for r in range(cp):
        pos = torch.tensor(cp_positions(s, cp, r), device="cuda")
        pieces = attention_pieces(s // cp, cp, r)
        o, saved = cp_attention(ks, q[:, pos].transpose(1, 2), k.transpose(1, 2),
                                v.transpose(1, 2), pieces, keep=True)
        backends = [sv.backend for p, sv in zip(pieces, saved, strict=True) if not p.square]
        assert backends and set(backends) == {"flash"}, backends
        torch.testing.assert_close(o.float(), ref[:, :, pos].detach(), rtol=2e-2, atol=2e-2)
        dq, dkv = cp_attention_bwd(do[:, pos].transpose(1, 2), saved, pieces, keys=s)
        gq, gk, gv = torch.autograd.grad(ref[:, :, pos], (qr, kr, vr),
                                         do[:, pos].transpose(1, 2).float(), retain_graph=True)
        torch.testing.assert_close(dq.transpose(1, 2).float(), gq[:, pos], rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(dkv[0].float(), gk, rtol=5e-2, atol=5e-2)
        torch.testing.assert_close(dkv[1].float(), gv, rtol=5e-2, atol=5e-2)
