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
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _reference import full_weights, layer, planned_weights

from kareus.exec.kernels import KernelSet, get_kernels
from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier
from kareus.model.workload import ModelArch, Parallelism, Workload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _kernels(fused: bool) -> Any:
    """The default kernel set, counting its RoPE calls; ``fused=False``: query/key norm and
    RoPE by ``KernelSet``'s composition of ``rms_norm`` and ``rope`` (the unfused math)."""
    default = type(get_kernels(None))

    class Counting(default):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.calls: Counter[str] = Counter()

        def qk_norm_rope(self, *a: Any, **k: Any) -> Any:
            self.calls["qk_norm_rope"] += 1
            return (default.qk_norm_rope if fused else KernelSet.qk_norm_rope)(self, *a, **k)

        def qk_norm_rope_bwd(self, *a: Any, **k: Any) -> Any:
            self.calls["qk_norm_rope_bwd"] += 1
            return (default.qk_norm_rope_bwd if fused
                    else KernelSet.qk_norm_rope_bwd)(self, *a, **k)

        def rope(self, *a: Any, **k: Any) -> Any:
            self.calls["rope"] += 1
            return super().rope(*a, **k)

        def rope_bwd(self, *a: Any, **k: Any) -> Any:
            self.calls["rope_bwd"] += 1
            return super().rope_bwd(*a, **k)

    return Counting()


def _workload(recompute: str) -> Workload:
    """A small Qwen3-shaped layer (per-head query/key norms, eps 1e-6)."""
    m = ModelArch(name="small-qwen3", layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                  ffn=1024, vocab=1000, qk_norm=True, norm_eps=1e-6)
    return Workload(model=m, parallelism=Parallelism(tp=1, cp=1), microbatch_size=4,
                    seq_len=512, num_microbatches=2, nanobatches=2, recompute=recompute)


def _rel(got: Any, want: Any) -> float:
    g, w = got.detach().double(), want.detach().double()
    return float((g - w).norm() / max(float(w.norm()), 1e-12))


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
        ks = _kernels(fused)
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
    assert _rel(y_f, y_u) < 1e-2
    assert _rel(dx_f, dx_u) < 2e-2
    for k in dw_f:
        assert _rel(dw_f[k], dw_u[k]) < 2e-2, (k, _rel(dw_f[k], dw_u[k]))
    # and against the float32 autograd reference layer, about as closely as PyTorch's own
    # bf16 autograd of the same layer is (bf16 rounding, not a bug)
    ref_p = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    xr = x.clone().requires_grad_(True)
    yr = layer(xr, ref_p, arch)
    (yr * c).sum().backward()
    tb = {k: v.to(torch.bfloat16).requires_grad_(True) for k, v in full.items()}
    xt = x.to(torch.bfloat16).requires_grad_(True)
    yt = layer(xt, tb, arch)
    (yt.float() * c).sum().backward()
    pairs = [(y_f, yt, yr, "output"), (dx_f, xt.grad, xr.grad, "input gradient")]
    pairs += [(dw_f[k], tb[k].grad, ref_p[k].grad, k) for k in full]
    for got, torch_bf16, want, what in pairs:
        err, base = _rel(got, want), _rel(torch_bf16, want)
        assert err < max(2 * base, 5e-3), f"{what}: relative error {err:.3g}, torch {base:.3g}"
