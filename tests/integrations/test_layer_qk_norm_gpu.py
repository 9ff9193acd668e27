"""Qwen3's per-head query/key norms in a planned layer on one GPU: the layer runs them fused
with RoPE (``KernelSet.qk_norm_rope`` / ``qk_norm_rope_bwd``, the Triton kernels of the
default set), never RoPE alone, from its own CUDA graphs (the default) and eagerly, and its
output and gradients match both the unfused composition (each head normalised by
``rms_norm``, then ``rope``: how the layer ran them before the fused op) and the float32
autograd reference layer, within bf16 rounding.

Skipped without torch or without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _helpers import (
    assert_run_as_close_as_torch,
    cuda_marks,
    qk_counting_kernels,
    rel_error,
    small_workload,
)
from _reference import full_weights, planned_weights, reference_run

from kareus.exec.kernels import KernelSet, get_kernels
from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier
from kareus.model.workload import Workload

pytestmark = cuda_marks()


def _workload(recompute: str) -> Workload:
    """A small Qwen3-shaped layer (per-head query/key norms, eps 1e-6)."""
    return small_workload(qk=True, name="small-qwen3", recompute=recompute)


@pytest.mark.parametrize("graphs", [None, False], ids=["graphed", "eager"])
@pytest.mark.parametrize("recompute", ["full", "none"])
def test_planned_layer_runs_the_fused_query_key_norm_and_matches_the_unfused_math(
        recompute, graphs):
    default = type(get_kernels(None))
    assert default.name == "triton" and default.qk_norm_rope is not KernelSet.qk_norm_rope
    wl = _workload(recompute)
    arch = wl.model
    dev = torch.device("cuda")
    # bf16-representable weights and input: the reference sees what the layer sees
    full = {k: v.to(dev, torch.bfloat16).float() for k, v in full_weights(arch, 3).items()}
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 512, arch.hidden, generator=g).to(dev, torch.bfloat16).float()
    c = torch.randn(4, 512, arch.hidden, generator=g).to(dev)

    out = {}
    for fused in (True, False):
        ks = qk_counting_kernels(fused)
        applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1),
                              schedule="nanobatching", kernels=ks, eps=arch.norm_eps,
                              graphs=graphs)
        p = {k: v.to(torch.bfloat16).requires_grad_(True) for k, v in full.items()}
        xb = x.to(torch.bfloat16).requires_grad_(True)
        for _ in range(2):  # the second call replays the graphs (graphed)
            for v in (*p.values(), xb):
                v.grad = None
            y = applier.layer()(xb, planned_weights(p, arch))
            (y.float() * c).sum().backward()
        torch.cuda.synchronize()
        out[fused] = (y.detach(), xb.grad.clone(), {k: v.grad.clone() for k, v in p.items()},
                      ks.calls)
    (y_f, dx_f, dw_f, calls_f), (y_u, dx_u, dw_u, calls_u) = out[True], out[False]
    assert calls_f["qk_norm_rope"] > 0 and calls_f["qk_norm_rope_bwd"] > 0, calls_f
    assert calls_f["rope"] == calls_f["rope_bwd"] == 0, calls_f
    assert calls_u["rope"] == calls_u["qk_norm_rope"] > 0, calls_u
    # fused against unfused: bf16 rounding apart
    assert rel_error(y_f, y_u) < 1e-2
    assert rel_error(dx_f, dx_u) < 2e-2
    for k in dw_f:
        assert rel_error(dw_f[k], dw_u[k]) < 2e-2, (k, rel_error(dw_f[k], dw_u[k]))
    # and against the float32 autograd reference layer, about as closely as PyTorch's own
    # bf16 autograd of the same layer is (bf16 rounding, not a bug)
    want = reference_run(x, full, arch, c)
    torch_bf16 = reference_run(x, full, arch, c, dtype=torch.bfloat16)
    assert_run_as_close_as_torch((y_f, dx_f, dw_f), torch_bf16, want)
