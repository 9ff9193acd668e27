"""Qwen3's per-head query/key norms in the training loop on one GPU: the decoder runs them
fused with RoPE (``KernelSet.qk_norm_rope`` / ``qk_norm_rope_bwd``, the Triton kernels of
the default set), never RoPE alone, and its loss and gradients match both the unfused
composition (each head normalised by ``rms_norm``, then ``rope``: how the decoder ran them
before the fused op) and the float64 autograd reference, within bf16 rounding.

``qk_counting_kernels`` (tests/_helpers.py) is shared with
``tests/integrations/test_layer_qk_norm_gpu.py``.
Skipped without torch or without CUDA.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _helpers import cuda_marks, qk_counting_kernels, rel_error, small_workload
from test_train_loop import assert_bf16_step, step_reference

from kareus.exec.kernels import KernelSet, get_kernels
from kareus.exec.train import LoopbackGroups, TrainingLoop
from kareus.model.workload import Workload

pytestmark = cuda_marks()


def check_default_set_fuses() -> None:
    """On this machine the default kernel set is Triton's, whose query/key norm and RoPE
    are its own fused kernels (not ``KernelSet``'s composition)."""
    default = type(get_kernels(None))
    assert default.name == "triton"
    assert default.qk_norm_rope is not KernelSet.qk_norm_rope
    assert default.qk_norm_rope_bwd is not KernelSet.qk_norm_rope_bwd


def check_calls(fused: Counter[str], unfused: Counter[str]) -> None:
    """The fused set ran the fused ops forward and backward and never RoPE alone; the
    unfused one ran RoPE inside its composition as often."""
    assert fused["qk_norm_rope"] > 0 and fused["qk_norm_rope_bwd"] > 0, fused
    assert fused["rope"] == fused["rope_bwd"] == 0, fused
    assert unfused["rope"] == unfused["qk_norm_rope"] > 0, unfused
    assert unfused["rope_bwd"] == unfused["qk_norm_rope_bwd"] > 0, unfused


def workload(recompute: str) -> Workload:
    return small_workload(qk=True, name="small-qwen3", seq=256, recompute=recompute)


def _step(wl: Workload, ks: Any, schedule: str) -> tuple[float, dict[str, Any], Any, Any]:
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1), kernels=ks, lr=1e-3)
    m = loop.model
    g = torch.Generator().manual_seed(5)  # norm weights not all ones, the same in each run
    with torch.no_grad():
        for layer in range(loop.layers):
            for name in ("w_q_norm", "w_k_norm"):
                p = m.params[f"l{layer}.{name}"]
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
    params = {k: v.detach().float().cpu().clone() for k, v in m.params.items()}
    loss = float(loop.step(schedule))
    grads = {k: v.detach().float().cpu().clone() for k, v in m.grads.items()}
    return loss, grads, params, loop


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
@pytest.mark.parametrize("schedule", ["sequential", "nanobatching"])
def test_loop_runs_the_fused_query_key_norm_and_matches_the_unfused_math(schedule, recompute):
    check_default_set_fuses()
    wl = workload(recompute)
    fused, unfused = qk_counting_kernels(True), qk_counting_kernels(False)
    loss_f, grads_f, params, loop = _step(wl, fused, schedule)  # graphed (the GPU default)
    loss_u, grads_u, params_u, _ = _step(wl, unfused, schedule)
    check_calls(fused.calls, unfused.calls)
    assert all(torch.equal(params[k], params_u[k]) for k in params)
    # fused against unfused: the same function, bf16 rounding apart
    assert loss_f == pytest.approx(loss_u, rel=5e-3)
    for k in grads_f:
        assert rel_error(grads_f[k], grads_u[k]) < 2e-2, (k, rel_error(grads_f[k], grads_u[k]))
    # and against the float64 autograd reference of the whole model
    assert_bf16_step(loss_f, grads_f, *step_reference(loop, params))
