"""A planned mixture-of-experts layer on one GPU, on the default kernel set (its MoE kernels:
router, top-k, permutation, ``grouped_mm`` on ``torch._grouped_mm`` where the GPU has it,
SwiGLU, un-permutation), eagerly (an MoE layer takes no CUDA graph): two float32 Qwen3-style
MoE layers, chained and one by one, with and without a shared expert, under each
recomputation policy, against the float64 reference layer (attention as
``_reference.layer``, the MoE block as ``kareus.testing.moe_block_reference``), TF32 off.
One GPU holds one EP rank: EP = 1 (every expert local), TP = 1 (no collective).

Skipped without torch or without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _reference import full_weights, layer

from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier, head_norm, linear, qkv_from_separate
from kareus.model.moe import MoEArch
from kareus.model.workload import ModelArch, Parallelism, Workload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _workload(recompute: str, shared: bool) -> Workload:
    moe = MoEArch(experts=8, experts_per_token=2, expert_ffn=128,
                  shared_experts=int(shared), shared_expert_ffn=256 if shared else 0)
    arch = ModelArch(name="moe-gpu", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                     ffn=512, vocab=128, qk_norm=True, norm_eps=1e-6, moe=moe)
    return Workload(model=arch, parallelism=Parallelism(), microbatch_size=2, seq_len=128,
                    num_microbatches=1, nanobatches=1, recompute=recompute)


def _weights(arch: ModelArch, seed: int) -> dict:
    w = {k: v for k, v in full_weights(arch, seed).items() if k not in ("w1", "w2", "w3")}
    g = torch.Generator().manual_seed(50 + seed)
    m, h = arch.moe, arch.hidden
    w |= {"Wr": torch.randn(h, m.experts, generator=g) * 0.5,
          "W1e": torch.randn(m.experts, h, 2 * m.expert_ffn, generator=g) * 0.05,
          "W2e": torch.randn(m.experts, m.expert_ffn, h, generator=g) * 0.05}
    if m.shared_experts:
        f = m.shared_expert_ffn
        w |= {"Wsg": torch.randn(h, f, generator=g) * 0.05,
              "Wsu": torch.randn(h, f, generator=g) * 0.05,
              "Wsd": torch.randn(f, h, generator=g) * 0.05}
    return w


def _planned(w: dict, arch: ModelArch) -> dict:
    out = {"w_attn_norm": w["n1"],
           "Wqkv": qkv_from_separate(w["wq"], w["wk"], w["wv"], head_dim=arch.head_dim),
           "Wo": linear(w["wo"]), "w_mlp_norm": w["n2"],
           "w_q_norm": head_norm(w["qn"]), "w_k_norm": head_norm(w["kn"])}
    return out | {k: w[k] for k in ("Wr", "W1e", "W2e", "Wsg", "Wsu", "Wsd") if k in w}


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stack"])
@pytest.mark.parametrize(("recompute", "shared"), [("full", False), ("none", True),
                                                    ("selective", False)])
def test_planned_moe_layer_on_the_gpu_kernels(recompute, shared, stacked):
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: fp32 GEMMs
    try:
        _check(recompute, shared, stacked)
    finally:
        torch.set_float32_matmul_precision(precision)


def _check(recompute: str, shared: bool, stacked: bool) -> None:
    wl = _workload(recompute, shared)
    arch = wl.model
    dev = torch.device("cuda")
    ws = [_weights(arch, seed) for seed in (1, 2)]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g)
    c = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g)

    # the reference, float64 on the CPU
    ref_w = [{k: v.double().requires_grad_(True) for k, v in w.items()} for w in ws]
    xr = x.double().requires_grad_(True)
    y = xr
    for w in ref_w:
        y = layer(y, w, arch, base=500000.0)
    (y * c.double()).sum().backward()

    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="sequential",
                          eps=arch.norm_eps)
    assert applier.graphs is False  # an MoE layer runs eagerly
    mine = [{k: torch.nn.Parameter(v.to(dev)) for k, v in w.items()} for w in ws]
    xm = x.to(dev).requires_grad_(True)
    with applier.microbatch(0, "fwd"):
        if stacked:
            ym = applier.stack(2)(xm, [_planned(w, arch) for w in mine])
        else:
            ym = xm
            for w in mine:
                ym = applier.layer()(ym, _planned(w, arch))
    with applier.microbatch(0, "bwd"):
        (ym * c.to(dev)).sum().backward()

    def close(got, want, what):
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(got.detach().cpu().double(), want.detach(), rtol=1e-4,
                                   atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")

    close(ym, y, "output")
    close(xm.grad, xr.grad, "input grad")
    for i, (m, r) in enumerate(zip(mine, ref_w, strict=True)):
        for k, p in m.items():
            close(p.grad, r[k].grad, f"layer {i} {k}")
