"""bench/host_bound.py on a CPU: its command line, its refusal without a GPU, and the
GPU-busy fraction it computes from a profile's kernel intervals."""

from __future__ import annotations

import math
import types

import pytest
from bench_scripts import load_bench

hb = load_bench("host_bound")


def test_command_line_and_refusal_without_a_gpu(capsys):
    args = hb.parse_args(["--loop", "--quick", "--only", "qwen"])
    assert args.loop and args.quick and args.only == "qwen"
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is not reachable")
    assert hb.main(["--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_sp_runs_the_loop_jobs_in_the_sequence_parallel_layout_under_their_sp_plan():
    from kareus.compose.plan import Plan
    from kareus.exec.train import check_plan_workload

    assert hb.parse_args([]).sp == "off"
    jobs = hb.loop_jobs(hb.parse_args(["--loop", "--only", "qwen3", "--sp", "both"]))
    assert [(label, wl.parallelism.sequence_parallel) for label, _, _, wl in jobs] == [
        ("qwen3-1.7b tp4cp2", False), ("qwen3-1.7b tp4cp2 sp", True)]
    for _, plan_path, _, wl in jobs:  # each plan is for its layout (the loop checks it)
        check_plan_workload(Plan.load(plan_path), wl)
    (label, plan, _, wl), = hb.loop_jobs(hb.parse_args(["--only", "llama", "--sp", "on"]))
    assert plan is None and wl.parallelism.sp  # no SP plan: the baselines only


def test_busy_fraction_is_the_union_of_kernel_intervals_over_their_span(monkeypatch):
    class Ev:
        def __init__(self, start, end):
            self.device_type = "DeviceType.CUDA"
            self.time_range = types.SimpleNamespace(start=start, end=end)
            self.name = "k"

    events = [Ev(0, 10), Ev(5, 20), Ev(30, 40), Ev(40, 50)]  # busy 20 + 20 of 50

    class Prof:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def events(self):
            return events

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None))
    import torch.profiler as tp

    monkeypatch.setattr(tp, "profile", lambda **kw: Prof())
    loop = types.SimpleNamespace(step=lambda s: None)
    out = hb._profile_iteration(fake_torch, loop, "sequential")
    assert out["kernels"] == 4
    assert out["busy"] == pytest.approx(40 / 50)
    assert out["span_s"] == pytest.approx(50e-6)
    assert out["idle_s"] == pytest.approx(10e-6)


def test_idle_gaps_are_binned_and_charged_to_the_kernel_that_ends_them():
    ks = [(0.0, 10.0, "gemm"), (11.5, 20.0, "norm"), (20.0, 30.0, "gemm"),
          (34.0, 40.0, "add"), (35.0, 36.0, "comm"), (100.0, 110.0, "gemm")]
    out = hb.kernel_timeline(ks)
    assert out["kernels"] == 6 and out["span_s"] == pytest.approx(110e-6)
    assert out["busy"] == pytest.approx((30 - 1.5 + 6 + 10) / 110)
    assert out["idle_s"] == pytest.approx((1.5 + 4 + 60) * 1e-6)
    by_bin = {g["up_to_us"]: (g["count"], g["idle_s"]) for g in out["gaps"]}
    assert by_bin[2.0] == (1, pytest.approx(1.5e-6))
    assert by_bin[5.0] == (1, pytest.approx(4e-6))
    assert by_bin[math.inf] == (1, pytest.approx(60e-6))
    assert sum(c for c, _ in by_bin.values()) == 3
    top = {k["name"]: k for k in out["top_kernels"]}
    assert [k["name"] for k in out["top_kernels"]][:3] == ["gemm", "add", "norm"]
    assert top["gemm"]["calls"] == 3 and top["gemm"]["gpu_s"] == pytest.approx(30e-6)
    assert top["comm"]["idle_before_s"] == 0.0  # inside a busy stretch
    assert hb.kernel_timeline([]) == {"kernels": 0, "busy": None, "span_s": None}


def test_the_emulated_comparison_reads_the_committed_result():
    """bench/probes/host_bound_emulated.py on the committed H200 result: one row per measured
    partition, the measured ratio read back, the emulated ratios at least 1 (eager never
    beats graph replay in the emulator)."""
    import json
    from pathlib import Path

    emu = load_bench("probes/host_bound_emulated")
    path = Path(__file__).resolve().parents[2] / "bench" / "results" / "host_bound_h200.json"
    result = json.loads(path.read_text(encoding="utf-8"))
    rows = emu.compare(result)
    assert len(rows) == len(result["partitions"])
    for r, m in zip(rows, result["partitions"]):
        assert r["measured_eager_over_graphed"] == pytest.approx(m["eager_s"] / m["graphed_s"])
        assert r["emulated_eager_over_graphed"] >= 1.0 - 1e-9


def test_loss_curves_with_a_non_finite_loss_never_compare_equal():
    """A NaN loss made `max` of the relative differences order-dependent (it read 0.0 for
    runs that had diverged): now any non-finite loss is an infinite difference."""
    import math

    assert hb.loss_rel_diff([2.0, 1.0], [2.0, 1.01]) == pytest.approx(0.01)
    assert hb.loss_rel_diff([2.0, math.nan], [2.0, math.nan]) == math.inf
    assert hb.loss_rel_diff([2.0, 1.0], [2.0, math.inf]) == math.inf
    assert hb.loss_rel_diff([2.0], [2.0, 1.0]) == math.inf


def test_the_loss_noise_floor_is_the_spread_of_repeated_runs():
    runs = [{"losses": [10.0, 2.0]}, {"losses": [10.0, 2.1]}, {"losses": [10.0, 1.98]}]
    assert hb.loss_noise_floor(runs) == pytest.approx(0.05)
    assert hb.loss_noise_floor(runs[:1]) is None


def test_the_clock_sampler_runs_the_window_and_averages_what_nvml_reads(monkeypatch):
    """Without NVML the window runs and its clock is unknown; with a (fake) NVML, the mean
    of the SM clocks read while the window ran."""
    import time

    off = hb.ClockSampler(nvml=False)
    assert off.mean_mhz(lambda: 7) == (7, None)
    reads = iter([1500, 1700] + [1600] * 10_000)
    fake = types.SimpleNamespace(NVML_CLOCK_SM=0,
                                 nvmlDeviceGetClockInfo=lambda h, kind: next(reads))
    on = hb.ClockSampler(period_s=0.001, nvml=False)
    on._handle, on._nvml = object(), fake
    out, mhz = on.mean_mhz(lambda: time.sleep(0.02) or "done")
    assert out == "done" and 1500 <= mhz <= 1700
