"""Tests of the emulated profiler (kareus.profilers.emulator._profiler) on the emulated GPU.

The A100 tests reproduce the Kareus paper's case study (Llama 3.2 3B forward attention, TP=4)
qualitatively, noise off; the partition is the one ``build_partitions`` derives for
microbatch 8, sequence 4096 (two nanobatches), whose sizes may differ from the paper's.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.errors import InvalidSMCountError, UnknownSlotError, UnsupportedFrequencyError
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.partition import OpPartition, OutsideWork, build_partitions
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler


@pytest.fixture(scope="module")
def fwd_attn():
    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096)
    return build_partitions(wl)["fwd_attn"]


@pytest.fixture(scope="module")
def a100():
    return EmulatedProfiler("a100-40gb", noise=0.0)


def _best(prof, part, freq, slots, sms=range(1, 31)):
    """Lowest-energy (energy_j, config) over ``slots`` x ``sms`` at ``freq``."""
    return min((prof.measure(part, ScheduleConfig(freq, s, slot)).energy_j,
                ScheduleConfig(freq, s, slot)) for slot in slots for s in sms)


# ----------------------------------------------------------------------------- API


def test_is_a_profiler_and_measures(fwd_attn):
    prof = EmulatedProfiler("a100-40gb")
    assert isinstance(prof, Profiler)
    m = prof.measure(fwd_attn, ScheduleConfig(1410, 4, "qkv"))
    assert isinstance(m, Measurement)
    assert m.time_s > 0 and m.energy_j > m.static_energy_j
    assert m.static_power_w == pytest.approx(85.0 * 4)
    assert prof.static_power_w(4) == pytest.approx(340.0)
    assert prof.calls == 1


def test_default_gpu_and_type_checks(fwd_attn):
    assert EmulatedProfiler().gpu.name == "a100-40gb"
    with pytest.raises(TypeError):
        EmulatedProfiler(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        EmulatedProfiler("a100-40gb", noise=-0.1)
    with pytest.raises(ValueError):
        EmulatedProfiler("a100-40gb", group_gpus=0)
    with pytest.raises(TypeError):
        EmulatedProfiler("a100-40gb").measure("fwd_attn", ScheduleConfig(1410, 4))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        EmulatedProfiler("a100-40gb").measure(fwd_attn, (1410, 4, None))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        EmulatedGPU.from_spec("a100-40gb", gemm_efficiency=1.5)


def test_bad_configs_raise_typed_errors(fwd_attn, a100):
    with pytest.raises(UnsupportedFrequencyError):
        a100.measure(fwd_attn, ScheduleConfig(1411, 4, "qkv"))
    with pytest.raises(InvalidSMCountError):
        a100.measure(fwd_attn, ScheduleConfig(1410, 108, "qkv"))
    with pytest.raises(UnknownSlotError):
        a100.measure(fwd_attn, ScheduleConfig(1410, 4, "nope"))


def test_sequential_only_partition():
    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096, nanobatches=1)
    part = build_partitions(wl)["fwd_attn"]
    prof = EmulatedProfiler("a100-40gb", noise=0.0)
    assert prof.measure(part, ScheduleConfig(1410, 8, None)).time_s > 0
    with pytest.raises(UnknownSlotError):
        prof.measure(part, ScheduleConfig(1410, 8, "qkv"))


def test_scope_group_gpus(fwd_attn):
    one = EmulatedProfiler("a100-40gb", noise=0.0, group_gpus=1)
    four = EmulatedProfiler("a100-40gb", noise=0.0)
    eight = EmulatedProfiler("a100-40gb", noise=0.0, group_gpus=lambda p: 8)
    cfg = ScheduleConfig(1410, 4, "qkv")
    e1 = one.measure(fwd_attn, cfg)
    assert four.measure(fwd_attn, cfg).energy_j == pytest.approx(4 * e1.energy_j)
    m8 = eight.measure(fwd_attn, cfg)
    assert m8.energy_j == pytest.approx(8 * e1.energy_j)
    assert m8.static_power_w == pytest.approx(8 * 85.0)
    assert m8.time_s == pytest.approx(e1.time_s)


def test_outside_work():
    prof = EmulatedProfiler("h200-sxm", noise=0.0)
    gemm = ComputeOp(name="g", kind=OpKind.GEMM, flops=1e12, bytes_moved=1e8)
    ar = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26, group_size=4)
    ops_only = prof.measure_outside(OutsideWork(ops=[gemm]), 1980, group_size=4)
    both = prof.measure_outside(OutsideWork(ops=[gemm], comms=[ar]), 1980, group_size=4)
    assert ops_only.time_s > 1e12 / 1070e12
    assert both.time_s > ops_only.time_s
    assert both.static_power_w == pytest.approx(4 * prof.gpu.static_power_w)
    empty = prof.measure_outside(OutsideWork(), 1980, group_size=2)
    assert empty.time_s == 0.0 and empty.energy_j == 0.0
    with pytest.raises(UnsupportedFrequencyError):
        prof.measure_outside(OutsideWork(ops=[gemm]), 1981, group_size=4)
    with pytest.raises(ValueError):
        prof.measure_outside(OutsideWork(ops=[gemm]), 1980, group_size=0)


def test_preset_outside_work_of_a_workload():
    wl = Workload.preset("llama3.2-3b", tp=4, pp=2, microbatch_size=8, seq_len=4096)
    ps = build_partitions(wl)
    prof = EmulatedProfiler("a100-40gb", noise=0.0)
    for key, work in ps.outside.items():
        m = prof.measure_outside(work, 1410, group_size=4)
        assert m.time_s > 0, key


def test_user_partition_any_ops():
    part = OpPartition(
        name="mine",
        compute_ops=[ComputeOp(name="a", kind=OpKind.ELEMENTWISE, flops=1e6, bytes_moved=4e8),
                     ComputeOp(name="b", kind=OpKind.GEMM, flops=5e11, bytes_moved=1e8)],
        comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26, group_size=8))
    prof = EmulatedProfiler(EmulatedGPU.from_spec("h100-sxm"), noise=0.0)
    seq = prof.measure(part, ScheduleConfig(1980, 16, None))
    ovl = prof.measure(part, ScheduleConfig(1980, 16, "b"))
    assert ovl.time_s < seq.time_s


# ----------------------------------------------------------------------------- noise


def test_noise_is_deterministic_per_seed_and_call(fwd_attn):
    cfg = ScheduleConfig(1410, 4, "qkv")
    a = EmulatedProfiler("a100-40gb", seed=3)
    b = EmulatedProfiler("a100-40gb", seed=3)
    c = EmulatedProfiler("a100-40gb", seed=4)
    ra = [a.measure(fwd_attn, cfg) for _ in range(5)]
    rb = [b.measure(fwd_attn, cfg) for _ in range(5)]
    rc = [c.measure(fwd_attn, cfg) for _ in range(5)]
    assert ra == rb
    assert ra != rc
    assert len({m.energy_j for m in ra}) == 5  # each call draws new noise
    a.reset_noise()
    assert a.measure(fwd_attn, cfg) == ra[0]


def test_noise_off_is_ground_truth_and_noise_is_about_one_percent(fwd_attn):
    cfg = ScheduleConfig(1410, 6, "attn_core")
    exact = EmulatedProfiler("a100-40gb", noise=0.0)
    truth = exact.ground_truth(fwd_attn, cfg)
    assert exact.measure(fwd_attn, cfg) == truth
    noisy = EmulatedProfiler("a100-40gb", seed=1)
    rel = [noisy.measure(fwd_attn, cfg).energy_j / truth.energy_j - 1 for _ in range(400)]
    mean = sum(rel) / len(rel)
    sd = math.sqrt(sum((r - mean) ** 2 for r in rel) / len(rel))
    assert abs(mean) < 0.003
    assert 0.007 < sd < 0.013
    rel_t = [noisy.measure(fwd_attn, cfg).time_s / truth.time_s - 1 for _ in range(200)]
    sd_t = math.sqrt(sum(r * r for r in rel_t) / len(rel_t))
    assert 0.0015 < sd_t < 0.004  # time scatters a quarter as much as energy by default


# ----------------------------------------------------------------------------- physics


def test_sequential_is_compute_then_comm(fwd_attn):
    prof = EmulatedProfiler("a100-40gb", noise=0.0, power_limit=False)
    gpu = prof.emulated_gpu
    for f in (1410, 1005):
        tr = prof.trace(fwd_attn, ScheduleConfig(f, 8, None))
        compute = sum(gpu.op_time_s(op, f) for op in fwd_attn.compute_ops)
        comm = gpu.comm_time_s(fwd_attn.comm_op, 8, f)
        assert tr.time_s == pytest.approx(compute + comm, rel=1e-6)
        assert tr.exposed_comm_s == pytest.approx(comm, rel=1e-6)


def test_power_limit_lowers_the_clock():
    # H200 at its maximum clock under a dense GEMM exceeds 700 W: the GPU lowers its clock.
    part = OpPartition(
        name="gemms",
        compute_ops=[ComputeOp(name=f"g{i}", kind=OpKind.GEMM, flops=2.75e11, bytes_moved=1.7e8)
                     for i in range(3)],
        comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26, group_size=4))
    prof = EmulatedProfiler("h200-sxm", noise=0.0)
    tr = prof.trace(part, ScheduleConfig(1980, 32, "g0"))
    assert tr.power_limited and 1300 <= tr.freq_mhz <= 1710
    assert tr.average_power_w <= 700.0
    unlimited = EmulatedProfiler("h200-sxm", noise=0.0, power_limit=False)
    tu = unlimited.trace(part, ScheduleConfig(1980, 32, "g0"))
    assert tu.average_power_w > 700.0 and tu.time_s < tr.time_s
    # Idle-ish work (a lone collective on 2 SMs) is not limited.
    lone = prof.measure_outside(OutsideWork(comms=[part.comm_op]), 1980, group_size=1,
                                comm_sms=2)
    assert lone.average_power_w < 300.0


def test_dynamic_power_grows_faster_than_frequency(fwd_attn, a100):
    hi = a100.ground_truth(fwd_attn, ScheduleConfig(1410, 8, "qkv"))
    lo = a100.ground_truth(fwd_attn, ScheduleConfig(1005, 8, "qkv"))
    assert lo.time_s > hi.time_s
    assert lo.dynamic_energy_j < hi.dynamic_energy_j  # V(f)^2 falls with f


# ----------------------------------------------------------------------------- A100 case study


def _optimal_sms(prof, part, freq=1410, slot="qkv"):
    return _best(prof, part, freq, [slot])[1].comm_sms


def test_a100_two_sms_expose_communication(fwd_attn, a100):
    t2 = a100.trace(fwd_attn, ScheduleConfig(1410, 2, "qkv"))
    t4 = a100.trace(fwd_attn, ScheduleConfig(1410, 4, "qkv"))
    best = a100.trace(fwd_attn, ScheduleConfig(1410, _optimal_sms(a100, fwd_attn), "qkv"))
    assert t2.time_s > t4.time_s
    assert t2.exposed_comm_s > 0.25 * t2.time_s and t4.exposed_comm_s == 0.0
    assert best.exposed_comm_s < 0.05 * t2.exposed_comm_s


def test_a100_a_few_sms_are_energy_optimal(fwd_attn, a100):
    e = {s: a100.measure(fwd_attn, ScheduleConfig(1410, s, "qkv")).energy_j for s in (2, 4, 20)}
    assert e[4] < e[2]
    k = _optimal_sms(a100, fwd_attn)
    e_k = a100.measure(fwd_attn, ScheduleConfig(1410, k, "qkv")).energy_j
    assert 2 < k < 20
    assert e_k < e[2] and e_k < e[20]  # fewer SMs expose the comm, more slow Linear 1


def test_a100_four_sms_are_energy_optimal(fwd_attn, a100):
    # The Kareus paper's A100 case study: 4 SMs hid the all-reduce and used less energy than 2 and than 20. The
    # preset's collective rate is calibrated to the first half (4 hide, 3 do not:
    # bench/probes/emulator_a100_case_study.py); that 20 SMs cost more is a consequence, not an
    # input (of the link-limited collective, with the A100's tensor interference at 0).
    e = {s: a100.measure(fwd_attn, ScheduleConfig(1410, s, "qkv")).energy_j
         for s in range(2, 31)}
    assert min(e, key=e.get) == 4
    assert e[4] < e[2] and e[4] < e[20]
    assert a100.trace(fwd_attn, ScheduleConfig(1410, 4, "qkv")).exposed_comm_s == 0.0
    assert a100.trace(fwd_attn, ScheduleConfig(1410, 3, "qkv")).exposed_comm_s > 0.0
    # 20 SMs slow Linear 1 (the qkv GEMM loses SMs for as long as the collective runs).
    t4 = a100.trace(fwd_attn, ScheduleConfig(1410, 4, "qkv"))
    t20 = a100.trace(fwd_attn, ScheduleConfig(1410, 20, "qkv"))
    qkv = [s.name for s in fwd_attn.slots].index("qkv")
    assert t20.op_times_s[qkv] > t4.op_times_s[qkv]


def test_a100_four_beats_twenty_only_without_tensor_interference(fwd_attn):
    # docs/emulator.md: the A100's tensor interference is an assumption (0); at 20 SMs the
    # link-limited collective takes 3x the SM-seconds from the GEMMs, at 4 SMs it slows them
    # 1.6x as long. At the H200's NCCL value (0.58) 20 SMs cost less than 4.
    def energy(sms: int, delta: float) -> float:
        prof = EmulatedProfiler(EmulatedGPU.from_spec("a100-40gb", tensor_interference=delta),
                                noise=0.0)
        return prof.measure(fwd_attn, ScheduleConfig(1410, sms, "qkv")).energy_j

    assert energy(4, 0.0) < energy(20, 0.0)
    assert energy(20, 0.58) < energy(4, 0.58)


def test_a100_case_study_needs_faster_kernels_than_kareus_own(fwd_attn):
    # With kareus's own kernels as measured on H200 (clock-scaled, no A100 factor) 4 SMs
    # leave the all-reduce exposed: the case study's kernels were faster per SM.
    own_rate = round(25.1 * (1410 / 1980) ** 0.25, 2)
    gpu = EmulatedGPU.from_spec("a100-40gb", comm_backend="custom", comm_gb_per_s_per_sm=own_rate)
    prof = EmulatedProfiler(gpu, noise=0.0)
    assert prof.trace(fwd_attn, ScheduleConfig(1410, 4, "qkv")).exposed_comm_s > 0.0


def test_a100_norm_slot_costs_more_than_first_gemm(fwd_attn, a100):
    k = _optimal_sms(a100, fwd_attn)
    for s in (k, k + 2, 16):
        norm = a100.measure(fwd_attn, ScheduleConfig(1410, s, "attn_norm"))
        qkv = a100.measure(fwd_attn, ScheduleConfig(1410, s, "qkv"))
        assert norm.energy_j > qkv.energy_j
    assert (_best(a100, fwd_attn, 1410, ["attn_norm"])[0]
            > _best(a100, fwd_attn, 1410, ["qkv"])[0])


def test_a100_optimal_slot_moves_or_gap_shrinks_at_lower_clock(fwd_attn, a100):
    # The Kareus paper's A100 case study: at 1410 MHz the energy-optimal slot was Linear 1 (qkv); at 1100 MHz RoPE.
    # Either the optimum moves, or the gap between those two slots shrinks at the lower clock.
    f_low = a100.gpu.nearest_clock(1100)
    slots = [s.name for s in fwd_attn.slots]
    c_hi = _best(a100, fwd_attn, 1410, slots)[1]
    c_lo = _best(a100, fwd_attn, f_low, slots)[1]

    def rope_vs_qkv(f: int) -> float:
        return _best(a100, fwd_attn, f, ["rope"])[0] / _best(a100, fwd_attn, f, ["qkv"])[0] - 1

    assert c_lo.launch_slot != c_hi.launch_slot or rope_vs_qkv(f_low) < rope_vs_qkv(1410)


def test_a100_best_overlap_beats_sequential(fwd_attn, a100):
    space = ConfigSpace(fwd_attn, "a100-40gb", freqs_mhz=[1410], comm_sms=range(1, 33))
    ms = {c: a100.measure(fwd_attn, c) for c in space}
    seq = [m for c, m in ms.items() if c.launch_slot is None]
    ovl = [m for c, m in ms.items() if c.launch_slot is not None]
    best_ovl = min(ovl, key=lambda m: m.energy_j)
    assert best_ovl.energy_j < min(m.energy_j for m in seq)
    assert best_ovl.time_s < min(m.time_s for m in seq)


# ----------------------------------------------------------------------------- properties

_kinds = st.sampled_from(list(OpKind))


@st.composite
def _partitions(draw):
    n = draw(st.integers(1, 6))
    ops = []
    for i in range(n):
        kind = draw(_kinds)
        flops = draw(st.floats(1e6, 5e12))
        nbytes = draw(st.floats(1e5, 2e9))
        ops.append(ComputeOp(name=f"op{i}", kind=kind, flops=flops, bytes_moved=nbytes))
    comm = CommOp(name="c", kind=draw(st.sampled_from(list(CommKind))),
                  bytes=draw(st.floats(1e4, 5e8)), group_size=draw(st.sampled_from([2, 4, 8])))
    return OpPartition(name="p", compute_ops=ops, comm_op=comm)


@settings(max_examples=60, deadline=None)
@given(part=_partitions(), sms=st.integers(1, 64), data=st.data())
def test_property_bounds(part, sms, data):
    prof = EmulatedProfiler("h100-sxm", noise=0.0, group_gpus=1, power_limit=False)
    gpu = prof.emulated_gpu
    f = data.draw(st.sampled_from([1980, 1500, 990, 600]))
    slot = data.draw(st.sampled_from([None] + [s.name for s in part.slots]))
    tr = prof.trace(part, ScheduleConfig(f, sms, slot))
    compute_full = sum(gpu.op_time_s(op, f) for op in part.compute_ops)
    comm_alone = gpu.comm_time_s(part.comm_op, sms, f)
    assert tr.time_s >= compute_full * (1 - 1e-9)
    assert tr.time_s >= comm_alone * (1 - 1e-9)
    assert tr.time_s <= (compute_full + comm_alone) * 1.5 + 1e-9
    assert tr.energy_j >= gpu.spec.static_power_w * tr.time_s * (1 - 1e-9)
    assert math.isfinite(tr.energy_j)
    seq = prof.trace(part, ScheduleConfig(f, sms, None))
    assert seq.time_s == pytest.approx(compute_full + comm_alone, rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(part=_partitions(), sms=st.integers(1, 32), data=st.data())
def test_property_lower_clock_is_not_faster_without_hbm_sharing(part, sms, data):
    # With the collective moving no local HBM bytes, nothing a slower clock does can help:
    # every kernel's rate falls with the clock.
    gpu = EmulatedGPU.from_spec("a100-40gb").with_(comm_hbm_bytes_per_bus_byte=0.0)
    prof = EmulatedProfiler(gpu, noise=0.0, group_gpus=1, power_limit=False)
    slot = data.draw(st.sampled_from([None] + [s.name for s in part.slots]))
    times = [prof.ground_truth(part, ScheduleConfig(f, sms, slot)).time_s
             for f in (1410, 1200, 900, 600)]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:]))


@settings(max_examples=30, deadline=None)
@given(part=_partitions(), sms=st.integers(1, 32))
def test_property_sequential_lower_clock_is_not_faster(part, sms):
    prof = EmulatedProfiler("a100-40gb", noise=0.0, group_gpus=1, power_limit=False)
    times = [prof.ground_truth(part, ScheduleConfig(f, sms, None)).time_s
             for f in (1410, 1200, 900, 600)]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(times, times[1:]))


def test_lower_clock_can_shorten_a_collective_bound_overlap():
    # HBM is shared in proportion to demand. A memory-bound norm at a lower clock issues
    # fewer requests (below the issue knee), so the collective beside it, on the critical
    # path, gets more bandwidth and the partition ends sooner. Real GPUs share HBM this
    # way too; the search must be free to find such points, so the model keeps them.
    norm = ComputeOp(name="norm", kind=OpKind.NORM, flops=3.5e7, bytes_moved=1.1626e9)
    comm = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=1.0957e8, group_size=4)
    part = OpPartition(name="p", compute_ops=[norm], comm_op=comm)
    prof = EmulatedProfiler("a100-40gb", noise=0.0, group_gpus=1, power_limit=False)
    fast = prof.trace(part, ScheduleConfig(900, 6, "norm"))
    slow = prof.trace(part, ScheduleConfig(600, 6, "norm"))
    assert fast.comm_end_s == pytest.approx(fast.time_s)  # the collective is critical
    assert fast.exposed_comm_s > 0.1 * fast.time_s
    assert slow.compute_end_s > fast.compute_end_s  # the norm itself is slower ...
    assert slow.comm_end_s < 0.97 * fast.comm_end_s  # ... which frees HBM for the collective
    assert slow.time_s < 0.97 * fast.time_s
    # Without HBM sharing the effect is gone.
    alone = EmulatedProfiler(
        EmulatedGPU.from_spec("a100-40gb").with_(comm_hbm_bytes_per_bus_byte=0.0),
        noise=0.0, group_gpus=1, power_limit=False)
    assert (alone.trace(part, ScheduleConfig(600, 6, "norm")).time_s
            >= alone.trace(part, ScheduleConfig(900, 6, "norm")).time_s)


@settings(max_examples=30, deadline=None)
@given(part=_partitions())
def test_property_power_limit_respected(part):
    prof = EmulatedProfiler("h200-sxm", noise=0.0, group_gpus=1)
    tr = prof.trace(part, ScheduleConfig(1980, 16, part.slots[0].name))
    if tr.freq_mhz > prof.gpu.min_clock_mhz:
        assert tr.average_power_w <= prof.gpu.power_limit_w * (1 + 1e-9)



def test_scope_is_the_stage_for_context_parallel_partitions():
    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, microbatch_size=8, seq_len=8192)
    ps = build_partitions(wl)
    prof = EmulatedProfiler("a100-40gb", noise=0.0)
    for part in ps:
        assert part.group_gpus == 8
        cfg = ScheduleConfig(1410, 8, None)
        m = prof.measure(part, cfg)
        assert m.static_power_w == pytest.approx(8 * 85.0)
        one = EmulatedProfiler("a100-40gb", noise=0.0, group_gpus=1).measure(part, cfg)
        assert m.energy_j == pytest.approx(8 * one.energy_j)
    # A user partition without that information: the collective's group.
    user = OpPartition(name="u", compute_ops=[ComputeOp(name="g", kind=OpKind.GEMM, flops=1e11,
                                                        bytes_moved=1e8)],
                       comm_op=CommOp(name="ag", kind=CommKind.ALL_GATHER, bytes=2**24,
                                      group_size=2))
    assert prof.measure(user, ScheduleConfig(1410, 4, "g")).static_power_w == pytest.approx(170)


def test_sequence_parallel_collectives_cost_by_kind_and_group_size():
    """The TP all-gathers and reduce-scatters of the sequence-parallel layout move half the
    all-reduce's bus bytes of the same tensor, at their own measured curves; every SP type
    measures, sequential and overlapped."""
    wl = Workload.preset("llama3.2-3b", tp=4, cp=2, microbatch_size=8, seq_len=4096)
    plain = build_partitions(wl)
    sp = build_partitions(Workload.preset("llama3.2-3b", tp=4, cp=2, sp=True,
                                          microbatch_size=8, seq_len=4096))
    prof = EmulatedProfiler("h200-sxm", noise=0.0)
    gpu = prof.emulated_gpu
    ar = plain["fwd_attn_out_ar"].comm_op
    for name in ("fwd_attn_in_tp_ag", "fwd_attn_out_rs"):
        c = sp[name].comm_op
        assert c.bytes == ar.bytes and c.bus_bytes == ar.bus_bytes / 2
        rate = gpu.comm_bus_rate(16, 1980, kind=c.kind, group_size=4)
        assert rate != gpu.comm_bus_rate(16, 1980, kind=CommKind.ALL_REDUCE, group_size=4)
        assert gpu.comm_time_s(c, 16, 1980) == pytest.approx(
            gpu.launch_overhead_s + gpu.comm_latency_s + c.bus_bytes / rate)
        assert gpu.comm_time_s(c, 16, 1980) < 0.7 * gpu.comm_time_s(ar, 16, 1980)
    # the CP all-gather of K/V and the TP one of the normed input: same kind, own sizes
    assert sp["fwd_attn_in_cp_ag"].comm_op.group_size == 2
    for part in sp:
        slots = [None, *(s.name for s in part.slots)]
        for slot in (slots[0], slots[-1]):
            m = prof.measure(part, ScheduleConfig(1980, 16, slot))
            assert m.time_s > 0 and m.energy_j > 0
