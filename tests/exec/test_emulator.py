"""Tests of the emulated GPU and EmulatedProfiler."""

from __future__ import annotations

import pytest

from kareus.errors import InvalidSMCountError, UnknownSlotError, UnsupportedFrequencyError
from kareus.exec.emulator import EmulatedGPU, EmulatedProfiler
from kareus.exec.profiler import Profiler
from kareus.model.config import ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.partition import OpPartition, OutsideWork, build_partitions
from kareus.model.workload import Workload


@pytest.fixture(scope="module")
def fwd_attn():
    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096)
    return build_partitions(wl)["fwd_attn"]


def test_is_a_profiler_and_measures(fwd_attn):
    prof = EmulatedProfiler("a100-40gb")
    assert isinstance(prof, Profiler)
    m = prof.measure(fwd_attn, ScheduleConfig(1410, 4, "qkv"))
    assert isinstance(m, Measurement)
    assert m.time_s > 0 and m.energy_j > m.static_energy_j
    assert m.static_power_w == pytest.approx(85.0 * 4)


def test_bad_configs_raise_typed_errors(fwd_attn):
    prof = EmulatedProfiler("a100-40gb")
    with pytest.raises(UnsupportedFrequencyError):
        prof.measure(fwd_attn, ScheduleConfig(1411, 4, "qkv"))
    with pytest.raises(InvalidSMCountError):
        prof.measure(fwd_attn, ScheduleConfig(1410, 108, "qkv"))
    with pytest.raises(UnknownSlotError):
        prof.measure(fwd_attn, ScheduleConfig(1410, 4, "nope"))
    with pytest.raises(TypeError):
        EmulatedProfiler(object())  # type: ignore[arg-type]


def test_outside_work():
    prof = EmulatedProfiler("h200-sxm", noise=0)
    work = OutsideWork(ops=[ComputeOp(name="g", kind=OpKind.GEMM, flops=1e12, bytes_moved=1e8)],
                       comms=[CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26,
                                     group_size=4)])
    m = prof.measure_outside(work, 1980, group_size=4)
    assert m.time_s > 1e12 / 989e12
    assert m.static_power_w == pytest.approx(4 * 78.0)


def test_user_partition_any_ops():
    part = OpPartition(
        name="mine",
        compute_ops=[ComputeOp(name="a", kind=OpKind.ELEMENTWISE, flops=1e6, bytes_moved=4e8),
                     ComputeOp(name="b", kind=OpKind.GEMM, flops=5e11, bytes_moved=1e8)],
        comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26, group_size=8))
    prof = EmulatedProfiler(EmulatedGPU.from_spec("h100-sxm"), noise=0)
    seq = prof.measure(part, ScheduleConfig(1980, 16, None))
    ovl = prof.measure(part, ScheduleConfig(1980, 16, "b"))
    assert ovl.time_s < seq.time_s
