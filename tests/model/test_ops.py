"""Operations: computation and communication kernels described by their work."""

from __future__ import annotations

import math

import pytest

from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind


def test_compute_bound_kinds_are_gemm_and_attention():
    assert {k for k in OpKind if k.compute_bound} == {OpKind.GEMM, OpKind.ATTENTION}
    op = ComputeOp(name="qkv", kind="gemm", flops=2e9, bytes_moved=1e6)
    assert op.kind is OpKind.GEMM and op.compute_bound
    assert op.arithmetic_intensity == pytest.approx(2000.0)
    assert ComputeOp(name="x", kind=OpKind.NORM, flops=1.0, bytes_moved=0.0
                     ).arithmetic_intensity == math.inf


def test_scaled_keeps_the_kind_and_scales_the_work():
    op = ComputeOp(name="up", kind=OpKind.GEMM, flops=4e9, bytes_moved=2e6)
    half = op.scaled(0.5, name="up_half")
    assert (half.name, half.kind, half.flops, half.bytes_moved) == ("up_half", OpKind.GEMM,
                                                                    2e9, 1e6)
    assert op.scaled(2.0).name == "up"


@pytest.mark.parametrize("kw, match", [
    (dict(name="", flops=1.0, bytes_moved=1.0), "needs a name"),
    (dict(name="x", flops=0.0, bytes_moved=0.0), "does no work"),
    (dict(name="x", flops=-1.0, bytes_moved=1.0), "flops must be a finite number"),
    (dict(name="x", flops=1.0, bytes_moved=math.nan), "bytes_moved must be a finite number"),
])
def test_compute_op_rejects_bad_work(kw, match):
    with pytest.raises(ValueError, match=match):
        ComputeOp(kind=OpKind.NORM, **kw)


def test_bus_bytes_follow_the_nccl_tests_convention():
    ar = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=8e6, group_size=4)
    ag = CommOp(name="ag", kind="all_gather", bytes=8e6, group_size=4)
    rs = CommOp(name="rs", kind=CommKind.REDUCE_SCATTER, bytes=8e6, group_size=4)
    assert ar.bus_bytes == pytest.approx(2 * 3 / 4 * 8e6)
    assert ag.bus_bytes == pytest.approx(3 / 4 * 8e6) == rs.bus_bytes
    a2a = CommOp(name="a2a", kind=CommKind.ALL_TO_ALL, bytes=8e6, group_size=4)
    assert a2a.bus_bytes == pytest.approx(3 / 4 * 8e6)  # (g-1)/g to the peers
    assert [k.short for k in CommKind] == ["ar", "ag", "rs", "a2a"]


def test_only_a_gemm_may_be_grouped():
    op = ComputeOp(name="expert_down", kind=OpKind.GEMM, flops=1e9, bytes_moved=1e6,
                   group_rows=12.5)
    assert op.grouped and op.scaled(2.0).group_rows == 12.5
    assert "group_rows" not in repr(op)  # a dense op's repr is as before the field
    assert not ComputeOp(name="g", kind=OpKind.GEMM, flops=1.0, bytes_moved=1.0).grouped
    with pytest.raises(ValueError, match="only a GEMM may be grouped"):
        ComputeOp(name="x", kind=OpKind.ELEMENTWISE, flops=1.0, bytes_moved=1.0, group_rows=4)


@pytest.mark.parametrize("kw, match", [
    (dict(bytes=1.0, group_size=1), "group_size >= 2"),
    (dict(bytes=0.0, group_size=2), "positive number of bytes"),
])
def test_comm_op_rejects_bad_collectives(kw, match):
    with pytest.raises(ValueError, match=match):
        CommOp(name="c", kind=CommKind.ALL_REDUCE, **kw)
