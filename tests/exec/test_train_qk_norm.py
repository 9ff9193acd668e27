"""Qwen3's per-head query/key norms in the training loop run through the kernel set's fused
op (``KernelSet.qk_norm_rope`` / ``qk_norm_rope_bwd``), once per op of the layer's op list
(``decoder_layer(phase, qk_norm=True)``: recomputation included), never as separate norms
and RoPE; the float64 reference tests of ``test_train_loop.py`` check its math. CPU."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import pytest

torch = pytest.importorskip("torch")

from test_train_loop import plan_for, workload

from kareus.exec.executor import RecordingStreamBackend
from kareus.exec.kernels import TorchKernels
from kareus.exec.schedule import Op, stack_stream
from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives


class CountingKernels(TorchKernels):
    """The torch kernel set, counting the calls of its RoPE and query/key norm ops (and the
    norms over ``head_dim`` rows made outside ``qk_norm_rope``)."""

    def __init__(self, head_dim: int) -> None:
        self.hd = head_dim
        self.calls: Counter[str] = Counter()
        self._inside = False

    def qk_norm_rope(self, *a: Any, **k: Any) -> Any:
        self.calls["qk_norm_rope"] += 1
        self._inside = True
        try:
            return super().qk_norm_rope(*a, **k)
        finally:
            self._inside = False

    def qk_norm_rope_bwd(self, *a: Any, **k: Any) -> Any:
        self.calls["qk_norm_rope_bwd"] += 1
        self._inside = True
        try:
            return super().qk_norm_rope_bwd(*a, **k)
        finally:
            self._inside = False

    def rope(self, *a: Any, **k: Any) -> Any:
        self.calls["rope" if not self._inside else "rope (fused)"] += 1
        return super().rope(*a, **k)

    def rope_bwd(self, *a: Any, **k: Any) -> Any:
        self.calls["rope_bwd" if not self._inside else "rope_bwd (fused)"] += 1
        return super().rope_bwd(*a, **k)

    def rms_norm(self, x: Any, w: Any, eps: float = 1e-5) -> Any:
        if x.shape[-1] == self.hd and not self._inside:
            self.calls["head norm"] += 1
        return super().rms_norm(x, w, eps)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 2)])
def test_the_loop_runs_the_fused_op_once_per_op_of_the_list(tp, cp, recompute):
    wl = workload(tp, cp, recompute)
    wl = wl.with_(model=attrs.evolve(wl.model, qk_norm=True, norm_eps=1e-6))
    ks = CountingKernels(wl.model.head_dim)
    groups = LoopbackGroups(tp=tp, cp=cp)
    capped, default, _ = make_collectives(groups, backend="loopback")
    planned = tp * cp > 1  # kareus plans a job with a collective; else nanobatching
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan_for(wl) if planned else None,
                        streams=RecordingStreamBackend(), kernels=ks, device="cpu",
                        dtype="float32")
    assert loop.model.ks is ks
    # each computation in the workload's 2 nanobatches
    loss = float(loop.step("kareus" if planned else "nanobatching"))
    assert loss == loss  # finite
    want: Counter[str] = Counter()
    for phase in ("fwd", "bwd"):
        for item in stack_stream(phase, loop.layers, tp=tp, cp=cp, recompute=recompute,
                                 qk_norm=True):
            if isinstance(item, Op):
                want[item.name] += wl.nanobatches * wl.num_microbatches
    assert want["qk_norm_rope"] and want["qk_norm_rope_bwd"]
    assert ks.calls["qk_norm_rope"] == want["qk_norm_rope"]
    assert ks.calls["qk_norm_rope_bwd"] == want["qk_norm_rope_bwd"]
    # no RoPE and no per-head norm outside the fused op
    assert not {"rope", "rope_bwd", "head norm"} & set(ks.calls), ks.calls
