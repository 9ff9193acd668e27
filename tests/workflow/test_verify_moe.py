"""kareus verify of a mixture-of-experts plan on the CPU: an emulated optimize run for a tiny
MoE model at EP=2 over CP=2, verified in the training loop by one process standing in for
the CP and EP groups (the loopback, the MoE layer run eagerly): every system runs, and the
dry run says it is not a measurement.

Skipped without torch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fake_nvml import FakeNVML

from kareus.model.moe import MoEArch
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.workflow import optimize
from kareus.workflow.verification import verify


def test_verify_runs_an_moe_plan_in_the_training_loop(tmp_path):
    torch.set_num_threads(1)
    m = ModelArch(name="tiny-moe", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8,
                  ffn=64, vocab=50, moe=MoEArch(experts=4, experts_per_token=2, expert_ffn=16))
    wl = Workload(model=m, parallelism=Parallelism(tp=1, cp=2, ep=2), microbatch_size=2,
                  seq_len=8, num_microbatches=2, nanobatches=2, recompute="full")
    out = tmp_path / "opt"
    optimize(wl, "h200-sxm", budget=4, seed=1, progress=False).save(out, figure=False)
    rep = verify(out, device="cpu", steps=2, warmup=1, repeats=1,
                 nvml=FakeNVML(1, period_s=0.002, idle_w=100.0), busy_steps=0, out=tmp_path)
    assert rep is not None and not rep.measured and "NOT A MEASUREMENT" in rep.note
    assert [s.schedule for s in rep.systems] == ["sequential", "nanobatching", "kareus"]
    assert all(s.measured is not None and s.measured_time_s > 0 for s in rep.systems)
