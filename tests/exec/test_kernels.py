"""The kernel sets on the CPU: every op against an eager float64 evaluation of its
formula (outputs and gradients), the registry, and the autograd wrappers.

The plain-torch set runs here; the Triton set is checked on a GPU
(tests/exec/test_kernels_gpu.py) and, kareus's own Triton kernels, in Triton's
interpreter on the CPU (tests/exec/test_kernels_interpreted.py). Skipped without torch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.kernels import (
    KernelSet,
    ReferenceKernels,
    TorchKernels,
    available_kernels,
    get_kernels,
    register_kernels,
)
from kareus.exec.kernels import autograd as kag

BF16_TOL = 1e-2  # relative error of bf16 results against float64


def rel(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(g, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def norm64(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope64(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def cos_sin(seq, hd, dtype=torch.bfloat16):
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    ang = torch.cat((ang, ang), -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


SETS = [TorchKernels(), ReferenceKernels()]


@pytest.mark.parametrize("ks", SETS, ids=lambda k: k.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_rms_norm_and_its_backward_match_autograd_of_the_formula(ks, seed):
    g = gen(seed)
    x, dy = rnd(g, 37, 96), rnd(g, 37, 96)
    w = 1 + rnd(g, 96, scale=0.1)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = norm64(xd, wd)
    y.backward(dy.double())
    assert rel(ks.rms_norm(x, w), y.detach()) < BF16_TOL
    dx, dw = ks.rms_norm_bwd(dy, x, w)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert rel(dx, xd.grad) < BF16_TOL
    if ks.name != "reference":  # the old eager backward computed no weight gradient
        assert rel(dw, wd.grad) < BF16_TOL


@pytest.mark.parametrize("ks", SETS, ids=lambda k: k.name)
def test_the_residual_norms_default_to_the_separate_ops(ks):
    """``add_rms_norm`` and ``rms_norm_bwd_add`` of a set without fused kernels: exactly
    the addition, the norm, its backward, the residual gradient's addition and the weight
    gradient's accumulation (the reference set's backward has no ``dw``: the formula's)."""
    g = gen(3)
    x, r, dy, dres = (rnd(g, 37, 96) for _ in range(4))
    w, g0 = 1 + rnd(g, 96, scale=0.1), rnd(g, 96, scale=0.1)
    s, y = ks.add_rms_norm(x, r, w)
    assert torch.equal(s, x + r) and torch.equal(y, ks.rms_norm(x + r, w))
    dx, dw = ks.rms_norm_bwd(dy, x, w)
    if dw is None:
        from kareus.exec.kernels.base import rms_norm_weight_grad

        dw = rms_norm_weight_grad(dy, x)
        xd = x.double().requires_grad_()
        wd = w.double().requires_grad_()
        norm64(xd, wd).backward(dy.double())
        assert rel(dw, wd.grad) < BF16_TOL
    acc = g0.clone()
    assert torch.equal(ks.rms_norm_bwd_add(dy, x, w, dres, acc), dres + dx)
    assert torch.equal(acc, g0 + dw.to(acc.dtype))


@pytest.mark.parametrize("ks", SETS, ids=lambda k: k.name)
def test_rope_rotates_q_and_k_of_the_packed_qkv_and_its_backward_rotates_back(ks):
    g = gen(2)
    b, s, h, kvh, hd = 2, 6, 4, 2, 16
    qkv = rnd(g, b * s, (h + 2 * kvh) * hd)
    cos, sin = cos_sin(s, hd)
    q, k = ks.rope(qkv, cos, sin, heads=h, kv_heads=kvh)
    x = qkv.double().view(b, s, h + 2 * kvh, hd)
    c, sn = cos.double()[:, None], sin.double()[:, None]
    assert q.shape == (b, s, h, hd) and k.shape == (b, s, kvh, hd)
    assert rel(q, rope64(x[:, :, :h], c, sn)) < BF16_TOL
    assert rel(k, rope64(x[:, :, h:h + kvh], c, sn)) < BF16_TOL
    # Backward: the gradient of the rotation, from autograd in float64; dq arrives
    # transposed (attention's layout), dv is packed as is.
    xq = x.clone().requires_grad_()
    qq, kk = rope64(xq[:, :, :h], c, sn), rope64(xq[:, :, h:h + kvh], c, sn)
    vv = xq[:, :, h + kvh:]
    dq = rnd(g, b, h, s, hd).transpose(1, 2)
    dk, dv = rnd(g, b, s, kvh, hd), rnd(g, b, s, kvh, hd)
    torch.autograd.backward((qq, kk, vv), (dq.double(), dk.double(), dv.double()))
    dqkv = ks.rope_bwd(dq, dk, dv, cos, sin)
    assert dqkv.shape == qkv.shape
    assert rel(dqkv, xq.grad.view(b * s, -1)) < BF16_TOL


@pytest.mark.parametrize("ks", SETS, ids=lambda k: k.name)
def test_swiglu_and_its_backward_match_autograd_of_the_formula(ks):
    g = gen(3)
    gg, uu, da = rnd(g, 33, 70), rnd(g, 33, 70), rnd(g, 33, 70)
    gd, ud = gg.double().requires_grad_(), uu.double().requires_grad_()
    a = torch.nn.functional.silu(gd) * ud
    a.backward(da.double())
    assert rel(ks.swiglu(gg, uu), a.detach()) < BF16_TOL
    dg, du = ks.swiglu_bwd(da, gg, uu)
    assert rel(dg, gd.grad) < BF16_TOL and rel(du, ud.grad) < BF16_TOL


def test_attention_reads_grouped_kv_and_matches_the_copied_version():
    g = gen(4)
    q = torch.randn(2, 6, 32, 8, generator=g)
    k, v = torch.randn(2, 2, 32, 8, generator=g), torch.randn(2, 2, 32, 8, generator=g)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    for ks in SETS:
        torch.testing.assert_close(ks.attention(q, k, v), ref)
    assert isinstance(TorchKernels().attention_backend(q, k, v), str)


def test_matmul_accumulates_and_writes_into_out():
    g = gen(5)
    a, b, c = (torch.randn(8, 8, generator=g) for _ in range(3))
    out = c.clone()
    ks = TorchKernels()
    ks.matmul(a, b.t(), out=out, accumulate=True)
    torch.testing.assert_close(out, c + a @ b.t())
    torch.testing.assert_close(ks.matmul(a, b), a @ b)
    ks.matmul(a, b, out=out)
    torch.testing.assert_close(out, a @ b)
    with pytest.raises(ValueError, match="needs out"):
        ks.matmul(a, b, accumulate=True)


def test_registry_default_and_errors(monkeypatch):
    assert {"reference", "torch", "triton"} <= set(available_kernels())
    monkeypatch.delenv("KAREUS_KERNELS", raising=False)
    expected = "triton" if torch.cuda.is_available() else "torch"
    assert get_kernels().name == expected
    monkeypatch.setenv("KAREUS_KERNELS", "reference")
    assert get_kernels().name == "reference"
    ks = TorchKernels()
    assert get_kernels(ks) is ks
    with pytest.raises(ValueError, match="unknown kernel set"):
        get_kernels("nope")
    with pytest.raises(TypeError):
        get_kernels(3)

    class Mine(TorchKernels):
        name = "mine"

    register_kernels("mine", Mine)
    assert isinstance(get_kernels("mine"), Mine)
    names = get_kernels("mine").kernel_names()
    assert set(names) >= {"rms_norm", "rope", "swiglu", "attention", "matmul"}
    with pytest.raises(TypeError):
        KernelSet()  # abstract


def test_autograd_wrappers_give_the_formulas_gradients():
    g = gen(6)
    b, s, h, kvh, hd = 1, 4, 2, 1, 8
    x = rnd(g, b * s, 32, dtype=torch.float64).requires_grad_()
    w = (1 + rnd(g, 32, scale=0.1, dtype=torch.float64)).requires_grad_()
    y = kag.rms_norm(x, w, kernels="torch")
    y.square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    norm64(x2, w2).square().sum().backward()
    # PyTorch's fused RMSNorm rounds in its own order: float64 agreement to 1e-4.
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-6)

    gg = rnd(g, 5, 6, dtype=torch.float64).requires_grad_()
    uu = rnd(g, 5, 6, dtype=torch.float64).requires_grad_()
    kag.swiglu(gg, uu, kernels="torch").sum().backward()
    g2, u2 = gg.detach().clone().requires_grad_(), uu.detach().clone().requires_grad_()
    (torch.nn.functional.silu(g2) * u2).sum().backward()
    torch.testing.assert_close(gg.grad, g2.grad)
    torch.testing.assert_close(uu.grad, u2.grad)

    qkv = rnd(g, b * s, (h + 2 * kvh) * hd, dtype=torch.float64).requires_grad_()
    cos, sin = cos_sin(s, hd, torch.float64)
    q, k, v = kag.rope(qkv, cos, sin, heads=h, kv_heads=kvh, kernels="torch")
    (q.sum() * 2 + k.square().sum() + v.sum()).backward()
    q2 = qkv.detach().clone().requires_grad_()
    x = q2.view(b, s, h + 2 * kvh, hd)
    c, sn = cos[:, None], sin[:, None]
    (rope64(x[:, :, :h], c, sn).sum() * 2 + rope64(x[:, :, h:h + kvh], c, sn).square().sum()
     + x[:, :, h + kvh:].sum()).backward()
    torch.testing.assert_close(qkv.grad, q2.grad)


def test_runnable_partitions_take_a_kernel_set():
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.workload import ModelArch, Parallelism, Workload

    m = ModelArch(name="tiny", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32,
                  ffn=256, vocab=1000)
    wl = Workload(model=m, parallelism=Parallelism(tp=2), microbatch_size=2, seq_len=64,
                  nanobatches=2)
    outs = {}
    for name in ("reference", "torch"):
        p = runnable_partitions(wl, ["fwd_attn", "bwd_mlp"], kernels=name)
        progs = {n: q.build(device="cpu", seed=3) for n, q in p.items()}
        for prog in progs.values():
            prog.run_plain()
        outs[name] = {n: prog.output.clone() for n, prog in progs.items()}
    for n in outs["torch"]:
        assert rel(outs["torch"][n], outs["reference"][n]) < 2e-2, n
