"""The emulated GPU's physical model (kareus.profilers.emulator._gpu, ._comm): op times,
collective rates and curves, and the value object."""

from __future__ import annotations

import attrs
import pytest

from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.profilers.emulator import CommCurve, EmulatedGPU


def test_roofline_knee_and_frequency_scaling():
    gpu = EmulatedGPU.from_spec("a100-40gb")
    gemm = ComputeOp(name="g", kind=OpKind.GEMM, flops=2e11, bytes_moved=5e7)
    norm = ComputeOp(name="n", kind=OpKind.NORM, flops=2e8, bytes_moved=2e8)
    # Compute-bound: time ~ 1/SMs; ~ 1/f at low clocks, flatter near the maximum clock
    # (the clock-independent feed ceiling: measured on H200, 0.82 -> 0.74 of peak).
    assert gpu.op_time_s(gemm, 1410, 54) / gpu.op_time_s(gemm, 1410) == pytest.approx(2.0, rel=0.02)
    assert gpu.op_time_s(gemm, 352) / gpu.op_time_s(gemm, 705) == pytest.approx(2.0, rel=0.05)
    assert 1.6 < gpu.op_time_s(gemm, 705) / gpu.op_time_s(gemm, 1410) < 2.0
    # Below peak, not at peak.
    assert gemm.flops / gpu.op_time_s(gemm, 1410) < 0.85 * 312e12
    # Memory-bound: nearly flat above the knee, slower well below it.
    hi, mid, lo = (gpu.op_time_s(norm, f) for f in (1410, 1005, 405))
    assert mid / hi < 1.05
    assert lo / hi > 1.3
    # Memory-bound near the HBM bandwidth.
    assert norm.bytes_moved / hi == pytest.approx(0.88 * 1555e9, rel=0.08)


def test_comm_throughput_saturates_and_is_mildly_frequency_dependent():
    gpu = EmulatedGPU.from_spec("h200-sxm")
    rates = [gpu.comm_bus_rate(s, 1980) for s in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert all(b > a for a, b in zip(rates, rates[1:]))
    assert rates[1] / rates[0] == pytest.approx(2.0, rel=0.05)  # linear in SMs when few
    assert rates[-1] < gpu.comm_link_gb_per_s * 1e9
    assert rates[-1] > 0.95 * gpu.comm_link_gb_per_s * 1e9
    slow = gpu.comm_bus_rate(4, 990)
    assert 0.75 < slow / gpu.comm_bus_rate(4, 1980) < 0.95
    for kind in CommKind:
        for g in (2, 4, 8):
            op = CommOp(name="c", kind=kind, bytes=2**26, group_size=g)
            assert gpu.comm_time_s(op, 8, 1980) > op.bus_bytes / (gpu.comm_link_gb_per_s * 1e9)


def test_emulated_gpu_is_a_frozen_value_object():
    gpu = EmulatedGPU.from_spec("h200-sxm")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        gpu.gemm_efficiency = 0.5  # type: ignore[misc]
    assert gpu.with_(gemm_efficiency=0.5).gemm_efficiency == 0.5
    assert EmulatedGPU.preset("a100-40gb").tensor_flops_per_clock_per_sm == 2048
    assert 0 < gpu.dynamic_scale(990) < gpu.dynamic_scale(1980) == pytest.approx(1.0)


def test_comm_backends_and_measured_curves():
    own = EmulatedGPU.from_spec("h200-sxm")
    nccl = EmulatedGPU.from_spec("h200-sxm", comm_backend="nccl")
    custom = EmulatedGPU.from_spec("h200-sxm", comm_gb_per_s_per_sm=40.0)
    assert own.comm_curve("all_reduce", 4) == (25.1, 301.0)
    assert nccl.comm_curve("all_reduce", 2) == (21.1, 324.0)
    assert own.comm_curve("all_reduce", 8) == own.comm_curve("all_reduce", 4)  # nearest group
    assert custom.comm_curves == () and custom.comm_curve("all_gather", 4)[0] == 40.0
    with pytest.raises(ValueError):
        EmulatedGPU.from_spec("h200-sxm", comm_backend="mpi")
    # Measured on 4x H200 (bench/results/collectives_4xh200_nvlink.json): kareus's own
    # all-reduce of 64 MiB moves 95 GB/s (bus) on 4 SMs and 278 GB/s on 32 SMs.
    op = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26, group_size=4)
    for sms, busbw in ((4, 95.0), (32, 278.0)):
        t = own.comm_time_s(op, sms, 1980)
        assert op.bus_bytes / t / 1e9 == pytest.approx(busbw, rel=0.08)
    a100 = EmulatedGPU.from_spec("a100-40gb")
    # H200's rate, clock-scaled, times the factor the A100 case study implies.
    assert a100.comm_curve("all_reduce", 4)[0] == pytest.approx(
        25.1 * (1410 / 1980) ** 0.25 * 1.80, abs=0.01)
    assert a100.comm_curve("all_gather", 2)[0] == pytest.approx(
        11.9 * (1410 / 1980) ** 0.25 * 1.80, abs=0.01)
    nccl_a100 = EmulatedGPU.from_spec("a100-40gb", comm_backend="nccl")
    assert nccl_a100.comm_curve("all_reduce", 4)[0] == pytest.approx(
        25.3 * (1410 / 1980) ** 0.25, abs=0.01)  # NCCL's kernels: no case-study factor
    assert a100.comm_curve("all_reduce", 4)[1] < 301.0  # NVLink 3


def test_comm_curves_are_named_records_and_convert_from_tuples():
    gpu = EmulatedGPU.from_spec("h200-sxm")
    assert all(isinstance(c, CommCurve) for c in gpu.comm_curves)
    mine = gpu.with_(comm_curves=[("all_reduce", 4, 30, 400)])
    (curve,) = mine.comm_curves
    assert curve == CommCurve("all_reduce", 4, 30.0, 400.0)
    assert isinstance(curve.gb_per_s_per_sm, float) and curve.link_gb_per_s == 400.0
    assert mine.comm_curve("all_reduce", 2) == (30.0, 400.0)


def test_a_perturbed_gpu_is_another_gpu_of_the_same_kind():
    """``perturbed(seed)``: every constant of PERTURBED scaled by its own seeded factor
    (fractions capped at 1), the collective curves scaled with the scalar rates, op kinds
    given time and power factors; the datasheet kept; the same seed, the same GPU."""
    import math

    import pytest

    from kareus.errors import ArgumentError
    from kareus.profilers import EmulatedGPU

    base = EmulatedGPU.from_spec("h200-sxm")
    a, b = base.perturbed(0), base.perturbed(1)
    assert a == base.perturbed(0) and a != b and a.spec == base.spec
    assert "perturbed (seed 0, spread 0.1)" in a.calibration
    for name in EmulatedGPU.PERTURBED:
        x, y = getattr(base, name), getattr(a, name)
        assert y != x
        assert abs(math.log(y / x)) < 0.5 or y == 1.0  # 5 sd: a seeded draw (or capped)
    rate = a.comm_gb_per_s_per_sm / base.comm_gb_per_s_per_sm
    assert [c.gb_per_s_per_sm / d.gb_per_s_per_sm for c, d in
            zip(a.comm_curves, base.comm_curves)] == pytest.approx([rate] * len(a.comm_curves))
    assert {c.op for c in a.op_calibration if c.partition == "*"} == {
        "gemm", "attention", "elementwise"}
    assert a.tensor_interference >= base.tensor_interference
    assert base.perturbed(3, spread=0.0).gemm_efficiency == base.gemm_efficiency
    calibrated = EmulatedGPU.from_profile("h200-sxm").perturbed(0)
    assert len(calibrated.op_calibration) >= len(EmulatedGPU.from_profile("h200-sxm")
                                                 .op_calibration)
    with pytest.raises(ArgumentError, match="spread"):
        base.perturbed(0, spread=-1)
