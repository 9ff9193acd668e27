"""kareus verify on one GPU (a world of one, loopback groups standing in for TP=2 x CP=2):
an emulated plan of a small job run with its baselines in the graphed training loop, NVML
energy read and scaled to the job, the GPU-busy fraction and SM clocks of the windows.
Clocks are never changed. Needs a CUDA GPU and NVML."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from _helpers import cuda_marks

from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.workflow import optimize, verify

pytestmark = cuda_marks()


def _optimize_into(folder):
    """A small TP=2 x CP=2 job optimized on the H200 emulator (budget 4), saved in
    ``folder`` for ``verify``."""
    arch = ModelArch(name="small", layers=4, hidden=1024, heads=16, kv_heads=8, head_dim=64,
                     ffn=4096, vocab=32000)
    wl = Workload(model=arch, parallelism=Parallelism(tp=2, cp=2), microbatch_size=2,
                  seq_len=2048, num_microbatches=4, nanobatches=2)
    optimize(wl, "h200-sxm", budget=4, seed=0, progress=False).save(folder, figure=False)


def test_verify_measures_every_system_on_one_gpu(tmp_path):
    _optimize_into(tmp_path)
    rep = verify(tmp_path, steps=3, repeats=2, busy_steps=2)
    assert rep is not None and rep.measured
    assert [s.system for s in rep.systems] == ["megatron", "nanobatching", "kareus"]
    for s in rep.systems:
        # the windows last >= 0.5 s (7.5 of the counter's ~100 ms steps): the counter's
        # energy, not the power readings' fallback
        assert s.measured is not None and s.measured.total_j > 0
        assert s.energy_method == "nvml_counter" and s.energy_runs == 2, s
        assert s.gpu_busy is not None and 0 < s.gpu_busy <= 1
        assert s.sm_clock_mhz is not None and s.sm_clock_mhz > 0
        # energy per GPU per iteration is the measured power over time: a GPU draws
        # between 50 W and 1,000 W
        per_gpu_w = s.measured.total_j / 4 / s.measured_time_s
        assert 50 < per_gpu_w < 1000, per_gpu_w
    data = json.loads((tmp_path / "verify.json").read_text())
    assert data["job_gpus"] == 4 and data["measured_gpus"] == 1 and data["measured"]
    assert "dry-run" in data["clocks"]
    assert all(r["window_s"] >= 0.5 for r in data["runs"])


def test_verify_with_the_time_faithful_loopback_says_stand_in(tmp_path):
    _optimize_into(tmp_path)
    rep = verify(tmp_path, steps=3, repeats=1, busy_steps=0, loopback="faithful")
    assert rep is not None and rep.measured and rep.note.startswith("STAND-IN")
    for s in rep.systems:
        assert s.measured is not None and s.energy_method == "nvml_counter", s
    data = json.loads((tmp_path / "verify.json").read_text())
    assert data["loopback"] == "faithful" and "MEASURED curve" in data["collectives"]
