"""The emulated GPU calibrated from a measured GPU profile (EmulatedGPU.from_profile)."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
from bench_scripts import load_bench

from kareus.model import ScheduleConfig, Workload, build_partitions
from kareus.model.gpu_profile import GPUProfile, GPUProfileError, OpProfile
from kareus.profilers.emulator import (
    EmulatedGPU,
    EmulatedProfiler,
    profile_workload,
    profile_workload_key,
)
from kareus.profilers.emulator._calibration import (
    TIMED_FLOOR_S,
    _op_power_terms,
    comm_curves,
    fit_comm_curve,
)
from kareus.profilers.emulator._opmodel import _prep_op, lookup

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profile() -> GPUProfile:
    return GPUProfile.preset("h200-sxm")


@pytest.fixture(scope="module")
def calibrated(profile: GPUProfile) -> EmulatedGPU:
    return EmulatedGPU.from_profile(profile, comm_backend="nccl")


def test_profile_workload_names_read_back() -> None:
    w = profile_workload("llama3.2-3b")
    assert (w.parallelism.tp, w.microbatch_size, w.nanobatches) == (4, 8, 2)
    key = profile_workload_key("llama3.2-3b", tp=2, microbatch_size=8, seq_len=4096,
                               nanobatches=2)
    assert key == "llama3.2-3b tp=2 cp=1 mbs=8 seq=4096 nb=2"
    w2 = profile_workload(key)
    assert (w2.parallelism.tp, w2.seq_len) == (2, 4096)
    assert profile_workload_key("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096,
                                nanobatches=2) == "llama3.2-3b"
    for bad in ("mistral", "llama3.2-3b tp=x", "llama3.2-3b pp=2", ""):
        with pytest.raises(GPUProfileError):
            profile_workload(bad)


def test_measured_op_reproduced_at_its_shape(profile: GPUProfile,
                                             calibrated: EmulatedGPU) -> None:
    """Each main-set record: the calibrated model's time of that op at the maximum clock
    equals the measured time less the fixed cost of timing one op alone, plus the gap
    before a kernel in a stream, and (loop unthrottled) its power the measured power."""
    fmax = calibrated.spec.max_clock_mhz
    parts = build_partitions(profile_workload("llama3.2-3b"))
    checked = 0
    for rec in profile.ops_of("llama3.2-3b", "fwd_attn") + profile.ops_of("llama3.2-3b",
                                                                          "fwd_mlp"):
        op = next(o for o in parts[rec.partition].compute_ops if o.name == rec.op)
        t = calibrated.op_time_s(op, fmax, partition=rec.partition)
        assert t == pytest.approx(rec.time_s - TIMED_FLOOR_S + calibrated.launch_overhead_s,
                                  rel=1e-3)
        if rec.power_w is not None and (rec.power_busy_fraction or 0) >= 0.97:
            prepped = _prep_op(calibrated, op, rec.partition)
            _, base, own = _op_power_terms(calibrated, prepped, fmax)
            assert base + own * prepped.power_scale == pytest.approx(rec.power_w, rel=1e-3)
        checked += 1
    assert checked == 10


def test_throttled_loop_power_matched_at_the_clock_it_ran(profile: GPUProfile,
                                                           calibrated: EmulatedGPU) -> None:
    """A GEMM whose loop ran slower than its timed runs (the power limit lowered the clock):
    at the clock where the calibrated time equals the loop's time per run, the calibrated
    power equals the measured power (or the factor hit its floor)."""
    rec = profile.op_profile("llama3.2-3b", "fwd_mlp", "gate")
    assert rec.power_busy_fraction is not None and rec.power_busy_fraction < 0.97
    op = next(o for o in build_partitions(profile_workload("llama3.2-3b"))["fwd_mlp"].compute_ops
              if o.name == "gate")
    prepped = _prep_op(calibrated, op, "fwd_mlp")
    target = (rec.time_s - TIMED_FLOOR_S) / rec.power_busy_fraction
    clocks = calibrated.spec.clocks_mhz
    f = max(c for c in clocks if _op_power_terms(calibrated, prepped, c)[0] >= target)
    assert f < calibrated.spec.max_clock_mhz
    _, base, own = _op_power_terms(calibrated, prepped, f)
    assert base + own * prepped.power_scale == pytest.approx(rec.power_w, rel=1e-3)


def test_kernel_sets_and_fallbacks(profile: GPUProfile) -> None:
    ref = EmulatedGPU.from_profile(profile, comm_backend="nccl", kernels="reference")
    fused = EmulatedGPU.from_profile(profile, comm_backend="nccl")
    part = build_partitions(Workload.preset("llama3.2-3b", tp=2, microbatch_size=8,
                                            seq_len=4096, nanobatches=2))["fwd_attn"]
    ops = {o.name: o for o in part.compute_ops}
    f = 1980
    # The eager RoPE (several passes) is an order of magnitude slower than the fused one.
    assert (ref.op_time_s(ops["rope"], f, partition="fwd_attn")
            > 8 * fused.op_time_s(ops["rope"], f, partition="fwd_attn"))
    # GEMMs are the same kernels in both sets: the reference set falls back to the main one.
    assert (ref.op_time_s(ops["qkv"], f, partition="fwd_attn")
            == fused.op_time_s(ops["qkv"], f, partition="fwd_attn"))
    # An op the profile never measured (the LM head) takes its kind's median factor.
    outside = build_partitions(Workload.preset("llama3.2-3b", tp=4)).outside
    lm = next(o for w in outside.values() for o in w.ops if o.name == "lm_head")
    cal = lookup(fused.op_calibration, None, lm, 1e-3)
    assert cal is not None and cal.partition == "*" and cal.op == "gemm"
    assert 0.9 < cal.time_factor < 1.3
    with pytest.raises(GPUProfileError, match="no kernel set"):
        EmulatedGPU.from_profile(profile, kernels="nonesuch")


def test_priority_of_kernel_sets(profile: GPUProfile) -> None:
    """A record of a higher-priority set wins for its (workload, partition, op)."""
    key = profile_workload_key("llama3.2-3b", tp=2, microbatch_size=8, seq_len=4096,
                               nanobatches=2)
    rec = OpProfile(workload=key, partition="fwd_attn", op="attn_core", kind="attention",
                    time_s=0.5e-3, kernels="probe")
    prof = attrs.evolve(profile, ops=(*profile.ops, rec))
    gpu = EmulatedGPU.from_profile(prof, comm_backend="nccl", kernels=("probe", "reference"))
    part = build_partitions(profile_workload(key))["fwd_attn"]
    attn = next(o for o in part.compute_ops if o.name == "attn_core")
    assert gpu.op_time_s(attn, 1980, partition="fwd_attn") == pytest.approx(
        0.5e-3 - TIMED_FLOOR_S + gpu.launch_overhead_s, rel=1e-3)
    assert "probe" in gpu.calibration


def test_profile_constants(profile: GPUProfile, calibrated: EmulatedGPU) -> None:
    assert calibrated.spec.idle_power_w == pytest.approx(profile.idle_power_w, rel=1e-4)
    assert calibrated.spec.static_power_w == pytest.approx(profile.static_power_w, rel=1e-4)
    assert calibrated.hbm_bytes_per_s == pytest.approx(profile.hbm_bandwidth_gbps * 1e9,
                                                       rel=1e-3)
    # Uncore: one spinning block at the maximum clock minus idle.
    spin = next(lp for lp in profile.load_powers if lp.load == "one spinning block")
    assert calibrated.uncore_power_w == pytest.approx(spin.power_w - profile.idle_power_w,
                                                      rel=1e-3)
    assert profile.digest[:12] in calibrated.calibration
    # A calibrated GPU measures like any other.
    part = build_partitions(Workload.preset("llama3.2-3b", tp=4))["fwd_attn"]
    m = EmulatedProfiler(calibrated, noise=0).measure(part, ScheduleConfig(1980, 8, "qkv"))
    assert m.time_s > 0 and m.static_power_w == pytest.approx(4 * profile.static_power_w,
                                                              rel=1e-4)


def test_comm_curve_fit_recovers_the_curve() -> None:
    r, link = 21.0, 330.0
    pts = {s: ((s * r) ** -2 + link ** -2) ** -0.5 for s in (1, 2, 4, 8, 16, 32)}
    rf, lf, err = fit_comm_curve(pts)
    assert rf == pytest.approx(r, rel=0.01) and lf == pytest.approx(link, rel=0.01)
    assert err < 0.005
    with pytest.raises(GPUProfileError):
        fit_comm_curve({4: 10.0})


def test_comm_curves_from_the_profile(profile: GPUProfile) -> None:
    curves = {(k, g): (r, lk) for k, g, r, lk in comm_curves(profile, "nccl")}
    assert set(curves) >= {("all_reduce", 2), ("all_reduce", 4), ("all_gather", 4)}
    # The fit reproduces the measured 64 MiB NCCL all-reduce on 2 GPUs within a few percent.
    r, lk = curves[("all_reduce", 2)]
    for pt in profile.collective_curve("nccl_capped", "all_reduce", 2, 64 * 2**20):
        pred = ((pt.comm_sms * r) ** -2 + lk ** -2) ** -0.5
        assert pred == pytest.approx(pt.bus_gbps, rel=0.08)
    with pytest.raises(GPUProfileError):
        comm_curves(profile, "mscclpp")


def test_shipped_name_and_path(tmp_path: Path, profile: GPUProfile) -> None:
    a = EmulatedGPU.from_profile("h200-sxm")
    path = profile.save(tmp_path / "p.json")
    b = EmulatedGPU.from_profile(path)
    assert a == b
    with pytest.raises(GPUProfileError):
        EmulatedGPU.from_profile(tmp_path / "missing.json")


def test_uncalibrated_emulator_unchanged() -> None:
    gpu = EmulatedGPU.from_spec("h200-sxm")
    assert gpu.op_calibration == () and gpu.calibration == ""
    op = build_partitions(Workload.preset("llama3.2-3b", tp=4))["fwd_attn"].compute_ops[2]
    assert _prep_op(gpu, op, "fwd_attn").power_scale == 1.0
    assert math.isfinite(gpu.op_time_s(op, 1980))


@pytest.mark.skipif(not (REPO / "data" / "h200_llama3b_tp2_grid13.json").exists(),
                    reason="needs the measured grid in data/")
def test_fidelity_bench_calibrated_is_closer_than_preset() -> None:
    """On a measured grid, the emulator calibrated with the kernels that ran errs less than
    the preset (the uncalibrated preset errs by about 28% on fwd_attn)."""
    fid = load_bench("emulator_fidelity")
    grid = REPO / "data" / "h200_llama3b_tp2_grid13.json"
    pre = fid.evaluate_grid(grid, "h200-sxm")
    cal = fid.evaluate_grid(grid, "h200-sxm", Path("h200-sxm"))
    for part in ("fwd_attn", "fwd_mlp"):
        assert (cal["partitions"][part]["time_median_abs_rel_err"]
                < pre["partitions"][part]["time_median_abs_rel_err"])
    assert cal["partitions"]["fwd_attn"]["time_median_abs_rel_err"] < 0.08
    assert "as run" in cal["emulator"] or "attention" in cal["emulator"]
