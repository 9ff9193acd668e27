"""The event-driven simulation of one GPU's two streams (kareus.profilers.emulator._sim)."""

from __future__ import annotations

import pytest

from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.profilers.emulator import EmulatedGPU
from kareus.profilers.emulator._opmodel import _prep_op
from kareus.profilers.emulator._sim import _Collective, _collective, _Sim

GPU = EmulatedGPU.from_spec("h200-sxm")
OPS = [ComputeOp(name="norm", kind=OpKind.NORM, flops=2e8, bytes_moved=2e8),
       ComputeOp(name="gemm", kind=OpKind.GEMM, flops=4e11, bytes_moved=6e7),
       ComputeOp(name="act", kind=OpKind.ELEMENTWISE, flops=1e8, bytes_moved=1.5e8)]
AR = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26, group_size=4)


def _sim() -> _Sim:
    return _Sim(GPU, [_prep_op(GPU, o) for o in OPS])


def test_collective_record_names_its_fields() -> None:
    c = _collective(GPU, AR, 16, 1)
    assert isinstance(c, _Collective)
    assert (c.bus_bytes, c.sms, c.start_op, c.kind, c.group_size) == (
        AR.bus_bytes, 16, 1, "all_reduce", 4)
    assert c.hbm_bytes_per_bus_byte == GPU.comm_hbm_bytes_per_bus_byte
    ag = _collective(GPU, CommOp(name="ag", kind=CommKind.ALL_GATHER, bytes=2**26, group_size=4),
                     16, None)
    # Ring all-gather moves 2/3 of the local HBM bytes of all-reduce per bus byte.
    assert ag.hbm_bytes_per_bus_byte == pytest.approx(2 / 3 * c.hbm_bytes_per_bus_byte)


def test_sequential_run_is_compute_then_the_collective_alone() -> None:
    sim = _sim()
    compute_s, _, _ = sim.run(1980, [])
    t, e, d = sim.run(1980, [_collective(GPU, AR, 16, None)], detail=True)
    assert d is not None
    assert d["compute_end_s"] == pytest.approx(compute_s)
    assert d["comm_start_s"] == pytest.approx(compute_s)
    assert d["exposed_comm_s"] == pytest.approx(t - compute_s)
    assert t == pytest.approx(compute_s + GPU.comm_time_s(AR, 16, 1980), rel=1e-6)
    assert e > 0 and len(d["op_times_s"]) == len(OPS)


def test_overlapped_collective_starts_with_its_slot_op_and_hides_time() -> None:
    sim = _sim()
    seq, _, _ = sim.run(1980, [_collective(GPU, AR, 16, None)])
    t, _, d = sim.run(1980, [_collective(GPU, AR, 16, 1)], detail=True)
    assert d is not None
    assert d["comm_start_s"] == pytest.approx(d["op_times_s"][0])  # with op 1, after op 0
    # Exposed: only the part of the collective after the computation ended.
    assert d["exposed_comm_s"] == pytest.approx(
        max(0.0, d["comm_end_s"] - d["compute_end_s"]), abs=1e-12)
    assert t < seq  # overlap hides part of the collective


def test_at_most_one_collective_may_overlap() -> None:
    with pytest.raises(ValueError, match="at most one"):
        _sim().run(1980, [_collective(GPU, AR, 8, 0), _collective(GPU, AR, 8, 1)])
