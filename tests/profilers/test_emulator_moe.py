"""The emulator's mixture-of-experts models: the all-to-all's stated (uncalibrated) curve,
the grouped GEMM's tile model, and MoE partitions measured end to end."""

from __future__ import annotations

import pytest

from kareus.model import ScheduleConfig, Workload, build_partitions
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler
from kareus.profilers.emulator._opmodel import GROUPED_GEMM_TILE_ROWS, grouped_gemm_efficiency


@pytest.mark.parametrize("backend", ["own", "nccl"])
@pytest.mark.parametrize("group", [2, 4, 8])
def test_all_to_all_takes_the_all_gather_curve(backend, group):
    gpu = EmulatedGPU.preset("h200-sxm", comm_backend=backend)
    assert gpu.comm_curve(CommKind.ALL_TO_ALL, group) == gpu.comm_curve("all_gather", group)
    a2a = CommOp(name="a", kind=CommKind.ALL_TO_ALL, bytes=64 * 2**20, group_size=group)
    ag = CommOp(name="g", kind=CommKind.ALL_GATHER, bytes=64 * 2**20, group_size=group)
    for sms in (4, 16, 32):
        assert gpu.comm_time_s(a2a, sms, 1980) == gpu.comm_time_s(ag, sms, 1980)
    # and it is not the scalar fallback (the all-reduce's rate)
    assert gpu.comm_curve("all_to_all", group) != (gpu.comm_gb_per_s_per_sm,
                                                   gpu.comm_link_gb_per_s)


def test_calibrated_gpu_gives_the_all_to_all_its_all_gather_curve():
    gpu = EmulatedGPU.from_profile("h200-sxm")
    assert gpu.comm_curve("all_to_all", 8) == gpu.comm_curve("all_gather", 8)


def test_a_measured_all_to_all_curve_wins_over_the_stand_in():
    gpu = EmulatedGPU.preset("h200-sxm")
    mine = gpu.with_(comm_curves=(*gpu.comm_curves, ("all_to_all", 8, 30.0, 400.0)))
    assert mine.comm_curve("all_to_all", 8) == (30.0, 400.0)


@pytest.mark.parametrize("rows, eff", [(128, 1.0), (256, 1.0), (8, 8 / 128), (129, 129 / 256),
                                       (0, 1.0), (64.5, 64.5 / 128)])
def test_grouped_gemm_pads_each_experts_rows_to_whole_tiles(rows, eff):
    assert GROUPED_GEMM_TILE_ROWS == 128
    assert grouped_gemm_efficiency(rows) == pytest.approx(eff)


def test_a_grouped_gemm_of_small_experts_is_slower_than_its_flops():
    gpu = EmulatedGPU.preset("h200-sxm")
    flops = 2.0 * 8192 * 2048 * 1536
    plain = ComputeOp(name="g", kind=OpKind.GEMM, flops=flops, bytes_moved=1e8)
    whole = ComputeOp(name="g", kind=OpKind.GEMM, flops=flops, bytes_moved=1e8, group_rows=512)
    half = ComputeOp(name="g", kind=OpKind.GEMM, flops=flops, bytes_moved=1e8, group_rows=64)
    assert gpu.op_time_s(whole, 1980) == gpu.op_time_s(plain, 1980)
    # half of each tile is padding: about twice the tensor-core time (compute-bound)
    ratio = gpu.op_time_s(half, 1980) / gpu.op_time_s(plain, 1980)
    assert 1.8 < ratio < 2.05


def test_moe_partitions_measure_and_more_sms_speed_the_all_to_all():
    wl = Workload.preset("qwen3-30b-a3b", dp=8, ep=8, microbatch_size=4)
    ps = build_partitions(wl)
    prof = EmulatedProfiler("h200-sxm", noise=0.0)
    part = ps["fwd_moe_experts"]
    seq = [prof.measure(part, ScheduleConfig(1980, s, None)) for s in (8, 32)]
    assert seq[1].time_s < seq[0].time_s  # the sequential all-to-all on more SMs
    overlapped = prof.measure(part, ScheduleConfig(1980, 32, "expert_gate_up"))
    assert overlapped.time_s < seq[1].time_s  # beside the other nanobatch's experts


def test_measured_all_to_all_points_of_a_profile_replace_the_stand_in():
    import attrs

    from kareus.model.gpu_profile import CollectivePoint, GPUProfile

    profile = GPUProfile.preset("h200-sxm")
    # an all-to-all measured on 8 GPUs at 64 MiB: 20 GB/s per SM up to a 300 GB/s link
    points = tuple(CollectivePoint(backend="own", collective="all_to_all", group_size=8,
                                   size_bytes=64 * 2**20, comm_sms=s, time_s=1e-3,
                                   bus_gbps=min(20.0 * s, 300.0)) for s in (2, 4, 8, 32, 64))
    gpu = EmulatedGPU.from_profile(attrs.evolve(profile,
                                                collectives=profile.collectives + points))
    rate, link = gpu.comm_curve("all_to_all", 8)
    assert (rate, link) != gpu.comm_curve("all_gather", 8)
    assert 15 < rate < 25 and 250 < link < 350
