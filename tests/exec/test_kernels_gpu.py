"""The fused Triton kernel set on a GPU: each op (and liger-kernel's, when installed)
against an eager float64 evaluation of its formula, outputs and gradients, at shapes
with odd widths and strided inputs. Skipped without torch, Triton or CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from _helpers import cuda_marks

from kareus.exec.kernels import ReferenceKernels, get_kernels
from kareus.exec.kernels import autograd as kag
from kareus.exec.kernels.triton_ops import TritonKernels, liger_version

pytestmark = cuda_marks()

BF16_TOL = 1e-2
SETS = [False] + ([True] if liger_version() else [])


def rel(a, ref):
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def rnd(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("use_liger", SETS)
@pytest.mark.parametrize("rows,width", [(4099, 3072), (1000, 2048), (257, 8192), (33, 96)])
def test_rms_norm_forward_and_backward(use_liger, rows, width):
    ks = TritonKernels(use_liger=use_liger)
    torch.manual_seed(rows)
    x, dy, w = rnd(rows, width), rnd(rows, width), 1 + rnd(width, scale=0.1)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
    y.backward(dy.double())
    assert rel(ks.rms_norm(x, w), y.detach()) < BF16_TOL
    dx, dw = ks.rms_norm_bwd(dy, x, w)
    assert rel(dx, xd.grad) < BF16_TOL
    assert rel(dw, wd.grad) < BF16_TOL
    assert torch.equal(dx, ks.rms_norm_bwd(dy, x, w)[0])  # deterministic


@pytest.mark.parametrize("use_liger", SETS)
def test_the_fused_set_passes_the_kernel_conformance_suite(use_liger):
    """kareus.testing.check_kernels on the GPU in bf16 (the suite every kernel set of a
    user must pass; the torch and reference sets pass it on the CPU, the fused set also in
    Triton's interpreter)."""
    from kareus.testing import check_kernels

    check_kernels(TritonKernels(use_liger=use_liger), device="cuda", dtype="bfloat16")


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("rows,width", [(4099, 3072), (16384, 2048), (33, 96)])
def test_fused_residual_norms_equal_the_separate_ops_bit_for_bit(lean, rows, width):
    """``add_rms_norm`` and ``rms_norm_bwd_add`` in bf16 on the GPU: the same bits as the
    residual addition, the norm, its backward, the residual gradient's addition and the
    weight gradient's accumulation run one by one (what the training loop ran before it
    fused them), lean launches (three calls: plain, learned, fast) and plain."""
    ks = TritonKernels(lean=lean)
    torch.manual_seed(rows + width)
    x, r, dy, dres = (rnd(rows, width) for _ in range(4))
    w, g0 = 1 + rnd(width, scale=0.1), rnd(width, scale=0.1)
    s_ref = x + r
    y_ref = ks.rms_norm(s_ref, w)
    dx, dw = ks.rms_norm_bwd(dy, s_ref, w)
    for _ in range(3):
        s, y = ks.add_rms_norm(x, r, w)
        assert torch.equal(s, s_ref) and torch.equal(y, y_ref)
        acc = g0.clone()
        out = ks.rms_norm_bwd_add(dy, s_ref, w, dres, acc)
        assert torch.equal(out, dres + dx)
        assert torch.equal(acc, g0 + dw)
    main_grad = g0.float()  # a float32 gradient buffer: the separate ops' rounding
    ks.rms_norm_bwd_add(dy, s_ref, w, dres, main_grad)
    assert torch.equal(main_grad, g0.float() + dw.float())


@pytest.mark.parametrize("b,s,h,kvh,hd", [(2, 128, 6, 2, 128), (1, 64, 8, 1, 128),
                                          (3, 17, 3, 3, 64)])
def test_rope_forward_and_backward_on_strided_inputs(b, s, h, kvh, hd):
    ks, ref = TritonKernels(), ReferenceKernels()
    qkv = rnd(b * s, (h + 2 * kvh) * hd)
    ang = torch.randn(s, hd // 2, device="cuda", dtype=torch.float64)
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    q, k = ks.rope(qkv, cos, sin, heads=h, kv_heads=kvh)
    qr, kr = ref.rope(qkv.double(), cos.double(), sin.double(), heads=h, kv_heads=kvh)
    assert rel(q, qr) < BF16_TOL and rel(k, kr) < BF16_TOL
    dq = rnd(b, h, s, hd).transpose(1, 2)  # attention's gradient layout
    dk = rnd(b, kvh, s, hd).transpose(1, 2)
    dv = rnd(b, kvh, s, hd).transpose(1, 2)
    got = ks.rope_bwd(dq, dk, dv, cos, sin)
    want = ref.rope_bwd(dq.double(), dk.double(), dv.double(), cos.double(), sin.double())
    assert rel(got, want) < BF16_TOL
    nv = kvh * hd
    assert torch.equal(got[:, -nv:], dv.reshape(b * s, nv))  # dv copied exactly


@pytest.mark.parametrize("b,s,h,kvh", [(2, 2048, 4, 2), (1, 4096, 16, 8), (3, 37, 3, 1)])
def test_qk_norm_fused_with_rope_equals_the_separate_kernels(b, s, h, kvh):
    """On the GPU: the fused kernels agree with the Triton norm and RoPE kernels they
    replace within bf16 rounding (not bit for bit: the fused norm sums each head's squares
    in another order), and dv is copied exactly."""
    from kareus.exec.kernels import KernelSet

    ks, hd = TritonKernels(use_liger=False), 128
    torch.manual_seed(s)
    qkv = rnd(b * s, (h + 2 * kvh) * hd, scale=3.0)
    wq, wk = 1 + rnd(hd, scale=0.1), 1 + rnd(hd, scale=0.1)
    ang = torch.randn(s, hd // 2, device="cuda", dtype=torch.float64)
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    dq, dk, dv = (rnd(b, n, s, hd).transpose(1, 2) for n in (h, kvh, kvh))
    kw = {"heads": h, "kv_heads": kvh, "eps": 1e-6}
    q, k = ks.qk_norm_rope(qkv, wq, wk, cos, sin, **kw)
    q2, k2 = KernelSet.qk_norm_rope(ks, qkv, wq, wk, cos, sin, **kw)
    assert rel(q, q2) < 1e-3 and rel(k, k2) < 1e-3
    got = ks.qk_norm_rope_bwd(dq, dk, dv, qkv, wq, wk, cos, sin, eps=1e-6)
    sep = KernelSet.qk_norm_rope_bwd(ks, dq, dk, dv, qkv, wq, wk, cos, sin, eps=1e-6)
    for a, r in zip(got, sep):
        assert rel(a, r) < BF16_TOL
    nv = kvh * hd
    assert torch.equal(got[0][:, -nv:], dv.reshape(b * s, nv))


@pytest.mark.parametrize("use_liger", SETS)
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 3584), (7, 33)])
def test_swiglu_forward_and_backward(use_liger, shape):
    ks = TritonKernels(use_liger=use_liger)
    g, u, da = rnd(*shape), rnd(*shape), rnd(*shape)
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    a = torch.nn.functional.silu(gd) * ud
    a.backward(da.double())
    assert rel(ks.swiglu(g, u), a.detach()) < BF16_TOL
    dg, du = ks.swiglu_bwd(da, g, u)
    assert rel(dg, gd.grad) < BF16_TOL and rel(du, ud.grad) < BF16_TOL
    assert torch.equal(g, g.clone()) and ks.swiglu_bwd(da, g, u)[0].equal(dg)  # no in-place


def test_autograd_wrappers_with_triton_match_the_eager_formulas():
    x = rnd(512, 3072).requires_grad_()
    w = (1 + rnd(3072, scale=0.1)).requires_grad_()
    dy = rnd(512, 3072)
    kag.rms_norm(x, w, kernels="triton").backward(dy)
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-5) * w2).backward(dy.double())
    assert rel(x.grad, x2.grad) < BF16_TOL and rel(w.grad, w2.grad) < BF16_TOL


def test_default_on_a_gpu_is_the_triton_set():
    assert get_kernels().name == "triton"


def test_partitions_with_fused_kernels_match_the_reference_formulas():
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.workload import ModelArch, Parallelism, Workload

    m = ModelArch(name="small", layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                  ffn=1024, vocab=1000)
    wl = Workload(model=m, parallelism=Parallelism(tp=2), microbatch_size=4, seq_len=256,
                  nanobatches=2)
    names = ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    outs = {}
    for kern in ("reference", "triton"):
        parts = runnable_partitions(wl, names, kernels=kern)
        outs[kern] = {}
        for n, p in parts.items():
            prog = p.build(seed=5)
            prog.run_plain()
            outs[kern][n] = prog.output.clone()
    for n in names:
        assert rel(outs["triton"][n], outs["reference"][n]) < 2e-2, n


def _lean_cases():
    torch.manual_seed(0)
    x, dy, w = rnd(4099, 3072), rnd(4099, 3072), torch.nn.Parameter(1 + rnd(3072, scale=0.1))
    b, s, h, kvh, hd = 2, 128, 6, 2, 128
    qkv = rnd(b * s, (h + 2 * kvh) * hd)
    ang = torch.randn(s, hd // 2, device="cuda")
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    dq = rnd(b, h, s, hd).transpose(1, 2)
    dk, dv = rnd(b, kvh, s, hd).transpose(1, 2), rnd(b, kvh, s, hd).transpose(1, 2)
    g, u, da = rnd(1000, 3584), rnd(1000, 3584), rnd(1000, 3584)
    return {
        "rms_norm": lambda ks: (ks.rms_norm(x, w),),
        "rms_norm_bwd": lambda ks: ks.rms_norm_bwd(dy, x, w),
        "rope": lambda ks: ks.rope(qkv, cos, sin, heads=h, kv_heads=kvh),
        "rope_bwd": lambda ks: (ks.rope_bwd(dq, dk, dv, cos, sin),),
        "swiglu": lambda ks: (ks.swiglu(g, u),),
        "swiglu_bwd": lambda ks: ks.swiglu_bwd(da, g, u),
    }


def test_lean_launches_equal_plain_launches_bit_for_bit():
    from kareus.exec.kernels import _launch
    from kareus.exec.kernels import _triton as kt

    assert _launch.runtime() is not None, "lean launches unavailable on this GPU"
    kt.clear_plans()
    lean, plain = TritonKernels(), TritonKernels(lean=False)
    for op, call in _lean_cases().items():
        want = call(plain)
        for _ in range(3):  # the first call learns, the others launch lean
            got = call(lean)
            assert all(torch.equal(a, b) and a.stride() == b.stride()
                       for a, b in zip(got, want)), op
    status = kt.lean_status()
    assert status and all(s["fast"] == s["signatures"] for s in status.values()), status


def test_lean_launches_in_a_cuda_graph_and_on_two_streams():
    ks = TritonKernels()
    cases = _lean_cases()
    eager = {op: [t.clone() for t in call(ks)] for op, call in cases.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # another stream: its own partials buffer
        for op, call in cases.items():
            assert all(torch.equal(a, b) for a, b in zip(call(ks), eager[op])), op
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = {op: call(ks) for op, call in cases.items()}
    for _ in range(2):
        cases["rms_norm_bwd"](ks)  # eager calls between replays share nothing with it
        graph.replay()
    torch.cuda.synchronize()
    for op in cases:
        assert all(torch.equal(a, b) for a, b in zip(captured[op], eager[op])), op
