"""kareus's own Triton kernels on the CPU, in Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter runs a kernel's program instances one by one with numpy, so the same
kernel source that runs on a GPU is checked here, on every landing, without one: each op
(RMSNorm forward and backward, RoPE over strided q and k views of the packed QKV, its
backward packing dv, SwiGLU forward and backward) against an eager float64 evaluation
of its formula, outputs and gradients, at odd widths and row counts; and whole runnable
partitions in float32 against the reference kernel set. Speed is not checked here (see
bench/op_roofline.py on a GPU), nor liger-kernel's kernels
(tests/exec/test_kernels_gpu.py).

The interpreter is chosen when ``triton.jit`` decorates a kernel, so the checks run in a
child process started with the variable set; it prints one JSON line per check. Skipped
without torch or Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BF16_TOL = 1e-2  # relative error of bf16 results against float64


def _checks() -> list[dict]:
    """Run in the child: every check, as ``{"name": ..., "rel": ...}`` (``rel``: relative
    error, or 0/1 for exact-equality checks)."""
    import torch

    from kareus.exec.kernels import ReferenceKernels
    from kareus.exec.kernels.triton_ops import TritonKernels

    def rel(a, ref):
        return float((a.double() - ref.double()).norm() / ref.double().norm())

    def rnd(g, *shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    ks, ref = TritonKernels(use_liger=False), ReferenceKernels()
    out: list[dict] = []

    def add(name, value):
        out.append({"name": name, "rel": value})

    for rows, width in ((257, 3072), (33, 96), (70, 2048)):
        g = torch.Generator().manual_seed(rows)
        x, dy, w = rnd(g, rows, width), rnd(g, rows, width), 1 + rnd(g, width, scale=0.1)
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
        y.backward(dy.double())
        tag = f"{rows}x{width}"
        add(f"rms_norm {tag}", rel(ks.rms_norm(x, w), y.detach()))
        dx, dw = ks.rms_norm_bwd(dy, x, w)
        add(f"rms_norm_bwd.dx {tag}", rel(dx, xd.grad))
        add(f"rms_norm_bwd.dw {tag}", rel(dw, wd.grad))
        one = ks._k.rms_norm_bwd(dy, x, w, 1e-5, programs_per_sm=rows)  # a program a block
        add(f"rms_norm_bwd.dx one block a program {tag}", rel(one[0], xd.grad))
        add(f"rms_norm_bwd.dw one block a program {tag}", rel(one[1], wd.grad))
        for sbn, sbp in ((16, 64), (128, 16)):  # other shapes of the dw partials' sum
            add(f"rms_norm_bwd.dw sum {sbn}x{sbp} {tag}",
                rel(ks._k.rms_norm_bwd(dy, x, w, 1e-5, sum_block_n=sbn, sum_block_p=sbp)[1],
                    wd.grad))
        again = ks.rms_norm_bwd(dy, x, w)
        add(f"rms_norm_bwd deterministic {tag}",
            0.0 if torch.equal(dx, again[0]) and torch.equal(dw, again[1]) else 1.0)
        # The fused residual ops equal the separate ops they replace, bit for bit (the
        # training loop's results do not move when it fuses them). In float32: the
        # interpreter rounds float32 to bf16 by truncation where a GPU and torch round to
        # nearest (tests/exec/test_kernels_gpu.py checks bf16 on a GPU).
        x, dy, w = x.float(), dy.float(), w.float()
        dx, dw = ks.rms_norm_bwd(dy, x, w)
        r, dres = rnd(g, rows, width).float(), rnd(g, rows, width).float()
        g0 = rnd(g, width, scale=0.1).float()
        s, ys = ks.add_rms_norm(x, r, w)
        add(f"add_rms_norm exact {tag}",
            0.0 if torch.equal(s, x + r) and torch.equal(ys, ks.rms_norm(x + r, w)) else 1.0)
        acc = g0.clone()
        fused = ks.rms_norm_bwd_add(dy, x, w, dres, acc)
        add(f"rms_norm_bwd_add exact {tag}",
            0.0 if torch.equal(fused, dres + dx) and torch.equal(acc, g0 + dw) else 1.0)
        ks.rms_norm_bwd_add(dy, x, w, dres, acc)  # accumulates again
        add(f"rms_norm_bwd_add accumulates {tag}",
            0.0 if torch.equal(acc, (g0 + dw) + dw) else 1.0)
        xs, rs = x[:, : width // 2], r[:, : width // 2]  # strided rows
        s2, y2 = ks.add_rms_norm(xs, rs, w[: width // 2])
        add(f"add_rms_norm strided exact {tag}",
            0.0 if torch.equal(s2, xs + rs) and torch.equal(y2, ks.rms_norm(xs + rs,
                                                                           w[: width // 2]))
            else 1.0)

    for b, s, h, kvh, hd in ((2, 32, 6, 2, 128), (1, 16, 8, 1, 128), (3, 17, 3, 3, 64)):
        g = torch.Generator().manual_seed(b * 1000 + s)
        tag = f"b{b} s{s} h{h} kv{kvh} hd{hd}"
        qkv = rnd(g, b * s, (h + 2 * kvh) * hd)
        ang = torch.randn(s, hd // 2, generator=g, dtype=torch.float64)
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        q, k = ks.rope(qkv, cos, sin, heads=h, kv_heads=kvh)
        qr, kr = ref.rope(qkv.double(), cos.double(), sin.double(), heads=h, kv_heads=kvh)
        add(f"rope.q {tag}", rel(q, qr))
        add(f"rope.k {tag}", rel(k, kr))
        dq = rnd(g, b, h, s, hd).transpose(1, 2)  # attention's gradient layout (strided)
        dk = rnd(g, b, kvh, s, hd).transpose(1, 2)
        dv = rnd(g, b, kvh, s, hd).transpose(1, 2)
        got = ks.rope_bwd(dq, dk, dv, cos, sin)
        want = ref.rope_bwd(dq.double(), dk.double(), dv.double(), cos.double(),
                            sin.double())
        add(f"rope_bwd {tag}", rel(got, want))
        nv = kvh * hd
        add(f"rope_bwd dv copied exactly {tag}",
            0.0 if torch.equal(got[:, -nv:], dv.reshape(b * s, nv)) else 1.0)
        # The row grid (the fallback for huge batches): the same values, bit for bit.
        qv, kv = (t.view(b, s, -1, hd) for t in (qkv[:, :h * hd], qkv[:, h * hd:(h + kvh) * hd]))
        q3, k3 = ks._k.rope_fwd(qv, kv, cos, sin, grid="rows", block_r=8)
        add(f"rope grid=rows equal {tag}",
            0.0 if torch.equal(q3, q) and torch.equal(k3, k) else 1.0)
        add(f"rope_bwd grid=rows equal {tag}",
            0.0 if torch.equal(ks._k.rope_bwd(dq, dk, dv, cos, sin, grid="rows"), got)
            else 1.0)

    # Query/key norm fused with RoPE: against float64, and (forward) bit for bit the
    # separate norm and RoPE kernels it replaces; the backward's dv copied exactly.
    for b, s, h, kvh, hd in ((2, 33, 4, 2, 16), (1, 70, 3, 1, 128)):
        g = torch.Generator().manual_seed(7 * s)
        tag = f"b{b} s{s} h{h} kv{kvh} hd{hd}"
        qkv = rnd(g, b * s, (h + 2 * kvh) * hd, scale=3.0)
        wq, wk = 1 + rnd(g, hd, scale=0.1), 1 + rnd(g, hd, scale=0.1)
        ang = torch.randn(s, hd // 2, generator=g, dtype=torch.float64)
        ang = torch.cat((ang, ang), -1)
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        dq = rnd(g, b, h, s, hd).transpose(1, 2)  # attention's gradient layout (strided)
        dk = rnd(g, b, kvh, s, hd).transpose(1, 2)
        dv = rnd(g, b, kvh, s, hd).transpose(1, 2)
        xd = qkv.double().requires_grad_()
        wqd, wkd = wq.double().requires_grad_(), wk.double().requires_grad_()
        full = xd.view(b, s, h + 2 * kvh, hd)
        cd, sd = cos.double()[None, :, None, :], sin.double()[None, :, None, :]

        def norm_rot(x, w, cd=cd, sd=sd):
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
            x1, x2 = x.chunk(2, -1)
            return x * cd + torch.cat((-x2, x1), -1) * sd

        qw, kw = norm_rot(full[:, :, :h], wqd), norm_rot(full[:, :, h:h + kvh], wkd)
        ((qw * dq.double()).sum() + (kw * dk.double()).sum()
         + (full[:, :, h + kvh:] * dv.double()).sum()).backward()
        q, k = ks.qk_norm_rope(qkv, wq, wk, cos, sin, heads=h, kv_heads=kvh, eps=1e-6)
        add(f"qk_norm_rope.q {tag}", rel(q, qw.detach()))
        add(f"qk_norm_rope.k {tag}", rel(k, kw.detach()))
        q2, k2 = super(TritonKernels, ks).qk_norm_rope(qkv, wq, wk, cos, sin, heads=h,
                                                       kv_heads=kvh, eps=1e-6)
        add(f"qk_norm_rope equals norm then rope {tag}",
            0.0 if torch.equal(q, q2) and torch.equal(k, k2) else 1.0)
        dqkv, dwq, dwk = ks.qk_norm_rope_bwd(dq, dk, dv, qkv, wq, wk, cos, sin, eps=1e-6)
        add(f"qk_norm_rope_bwd.dqkv {tag}", rel(dqkv, xd.grad))
        add(f"qk_norm_rope_bwd.dwq {tag}", rel(dwq, wqd.grad))
        add(f"qk_norm_rope_bwd.dwk {tag}", rel(dwk, wkd.grad))
        nv = kvh * hd
        add(f"qk_norm_rope_bwd dv copied exactly {tag}",
            0.0 if torch.equal(dqkv[:, -nv:], dv.reshape(b * s, nv)) else 1.0)

    for shape in ((64, 2048), (7, 33), (3, 4099)):
        g = torch.Generator().manual_seed(shape[1])
        gt, ut, da = rnd(g, *shape), rnd(g, *shape), rnd(g, *shape)
        gd, ud = gt.double().requires_grad_(), ut.double().requires_grad_()
        a = torch.nn.functional.silu(gd) * ud
        a.backward(da.double())
        tag = f"{shape[0]}x{shape[1]}"
        before = gt.clone()
        add(f"swiglu {tag}", rel(ks.swiglu(gt, ut), a.detach()))
        dg, du = ks.swiglu_bwd(da, gt, ut)
        add(f"swiglu_bwd.dg {tag}", rel(dg, gd.grad))
        add(f"swiglu_bwd.du {tag}", rel(du, ud.grad))
        add(f"swiglu_bwd leaves its inputs {tag}", 0.0 if torch.equal(gt, before) else 1.0)

    # Whole partitions in float32, the fused set against the reference formulas (same
    # seed): no bf16 rounding between ops, so they agree to float32 rounding.
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.workload import ModelArch, Parallelism, Workload

    m = ModelArch(name="small", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                  ffn=512, vocab=1000)
    wl = Workload(model=m, parallelism=Parallelism(tp=2), microbatch_size=2, seq_len=64,
                  nanobatches=2)
    names = ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]
    outs: dict[str, dict] = {}
    for kern in ("reference", "triton"):
        outs[kern] = {}
        for n, p in runnable_partitions(wl, names, kernels=kern, dtype="float32").items():
            prog = p.build(device="cpu", seed=5)
            prog.run_plain()
            outs[kern][n] = prog.output.clone()
    for n in names:
        add(f"partition {n}", rel(outs["triton"][n], outs["reference"][n]))

    # The kernel sets' conformance suite, float32 (kareus.testing.check_kernels).
    from kareus.testing import check_kernels

    try:
        check_kernels(TritonKernels(use_liger=False))
        add("conformance", 0.0)
    except AssertionError as exc:
        out.append({"name": f"conformance failed: {exc}"[:300], "rel": 1.0})
    return out


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KAREUS_KERNELS="")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r["rel"] for r in map(json.loads, done.stdout.splitlines())}


def test_every_fused_op_matches_its_formula_in_the_interpreter(interpreted):
    ops = {name.split()[0].split(".")[0] for name in interpreted}
    assert {"rms_norm", "rms_norm_bwd", "add_rms_norm", "rms_norm_bwd_add", "rope", "rope_bwd",
            "swiglu", "swiglu_bwd"} <= ops
    bad = {n: e for n, e in interpreted.items()
           if not n.startswith(("partition", "conformance")) and not e < BF16_TOL}
    assert not bad, bad


def test_the_fused_set_passes_the_kernel_conformance_suite_in_the_interpreter(interpreted):
    assert interpreted.get("conformance") == 0.0, [n for n in interpreted
                                                   if n.startswith("conformance")]


def test_partitions_with_fused_kernels_match_the_reference_in_the_interpreter(interpreted):
    parts = {n: e for n, e in interpreted.items() if n.startswith("partition")}
    assert len(parts) == 4
    bad = {n: e for n, e in parts.items() if not e < 1e-5}
    assert not bad, bad


if __name__ == "__main__":  # the child process
    for row in _checks():
        print(json.dumps(row))
