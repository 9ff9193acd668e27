"""CallablePartition (kareus.exec.torch_partition): the Partition role's conformance suite
and its checks, on any CPU (its program is run on a GPU in test_torch_partition_gpu.py)."""

from __future__ import annotations

import pytest

from kareus.exec import CallablePartition
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.testing import PartitionConformance

OPS = [ComputeOp(name="mm", kind=OpKind.GEMM, flops=2e9, bytes_moved=4e6),
       ComputeOp(name="add", kind=OpKind.ELEMENTWISE, flops=1e6, bytes_moved=8e6)]
AR = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=4e6, group_size=2)


def _part(**kw: object) -> CallablePartition:
    args: dict[str, object] = {"name": "mine", "compute_ops": OPS, "comm_op": AR,
                               "callables": [lambda: None, lambda: None],
                               "comm_buffers": ["buf0", "buf1"]}
    args.update(kw)
    return CallablePartition(**args)  # type: ignore[arg-type]


class TestCallablePartitionConformance(PartitionConformance):
    def make_partition(self):
        return _part()


def test_program_runs_the_given_callables_in_op_order():
    calls: list[str] = []
    part = _part(callables=[lambda: calls.append("mm"), lambda: calls.append("add")])
    prog = part.build()
    assert list(prog.op_names) == ["mm", "add"]
    assert prog.comm_kind == "all_reduce"
    for op in prog.ops:
        op()
    assert calls == ["mm", "add"]


def test_bad_callables_and_buffers_are_refused():
    with pytest.raises(ValueError, match="2 ops but 1 callables"):
        _part(callables=[lambda: None])
    with pytest.raises(TypeError, match="callable"):
        _part(callables=[lambda: None, "not callable"])
    with pytest.raises(ValueError, match="two tensors"):
        _part(comm_buffers=["only one"])
    ag = CommOp(name="ag", kind=CommKind.ALL_GATHER, bytes=4e6, group_size=2)
    with pytest.raises(ValueError, match="needs two comm_outputs"):
        _part(comm_op=ag)
    assert _part(comm_op=ag, comm_outputs=["o0", "o1"]).build().comm_kind == "all_gather"
