"""Qwen3's per-head query/key norms in planned layers run through the kernel set's fused op
(``KernelSet.qk_norm_rope`` / ``qk_norm_rope_bwd``), once per op of the layer's op list
(the backward's recomputation included), never as separate norms and RoPE, at positions
``0 .. seq - 1`` and at packed documents' per-token positions; ``test_layer.py`` and
``test_layer_positions.py`` check the math against the autograd reference. CPU."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _reference import full_weights, planned_weights, workload

from kareus.exec.kernels import TorchKernels
from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier


class _Counting(TorchKernels):
    """The torch set, counting its fused query/key norm calls and any RoPE or ``head_dim``
    norm run outside them."""

    def __init__(self, head_dim: int) -> None:
        self.hd, self.calls, self._inside = head_dim, Counter[str](), False

    def _fused(self, name: str, impl: Any, *a: Any, **k: Any) -> Any:
        self.calls[name] += 1
        self._inside = True
        try:
            return impl(*a, **k)
        finally:
            self._inside = False

    def qk_norm_rope(self, *a: Any, **k: Any) -> Any:
        return self._fused("qk_norm_rope", super().qk_norm_rope, *a, **k)

    def qk_norm_rope_bwd(self, *a: Any, **k: Any) -> Any:
        return self._fused("qk_norm_rope_bwd", super().qk_norm_rope_bwd, *a, **k)

    def rope(self, *a: Any, **k: Any) -> Any:
        if not self._inside:
            self.calls["rope"] += 1
        return super().rope(*a, **k)

    def rope_bwd(self, *a: Any, **k: Any) -> Any:
        if not self._inside:
            self.calls["rope_bwd"] += 1
        return super().rope_bwd(*a, **k)

    def rms_norm(self, x: Any, w: Any, eps: float = 1e-5) -> Any:
        if x.shape[-1] == self.hd and not self._inside:
            self.calls["head norm"] += 1
        return super().rms_norm(x, w, eps)


@pytest.mark.parametrize("packed", [False, True], ids=["positions", "packed-documents"])
@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_a_planned_layer_runs_the_fused_op_once_per_op(recompute, packed):
    wl = workload(qk=True, recompute=recompute)
    arch = wl.model
    ks = _Counting(arch.head_dim)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                          kernels=ks, eps=arch.norm_eps)
    p = {k: v.double().requires_grad_(True) for k, v in full_weights(arch, 2).items()}
    x = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, dtype=torch.float64,
                    requires_grad=True)
    positions = (torch.arange(wl.seq_len) % 5).expand(wl.microbatch_size, -1) if packed else None
    y = applier.layer()(x, planned_weights(p, arch), positions=positions)
    y.sum().backward()
    n = wl.nanobatches
    # forward once per nanobatch, again in the backward under full recomputation
    assert ks.calls["qk_norm_rope"] == n * (2 if recompute == "full" else 1), ks.calls
    assert ks.calls["qk_norm_rope_bwd"] == n, ks.calls
    assert not {"rope", "rope_bwd", "head norm"} & set(ks.calls), ks.calls
    assert p["qn"].grad is not None and p["kn"].grad is not None
    assert float(p["qn"].grad.abs().sum()) > 0 and float(p["kn"].grad.abs().sum()) > 0
