"""Runnable partitions on a GPU: the executor computes what running the ops plainly does.

Skipped without torch or without CUDA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.executor import TorchExecutor
from kareus.exec.torch_partition import (
    CallablePartition,
    runnable_partitions,
)
from kareus.model.config import ScheduleConfig
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.testing import RecordingCollective

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.gpu


class ScaleCollective(RecordingCollective):
    """A one-GPU stand-in for an all-reduce: multiplies in place on the given stream,
    after a delay kernel so that missing waits would show up as wrong results."""

    def all_reduce(self, tensor, stream, sms):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000)
            tensor.mul_(2.0)
        return tensor


def small_workload(cp: int = 1) -> Workload:
    m = ModelArch(name="small", layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                  ffn=1024, vocab=1000)
    return Workload(model=m, parallelism=Parallelism(tp=2, cp=cp), microbatch_size=4,
                    seq_len=256, nanobatches=2)


@gpu
@pytest.mark.parametrize("name", ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"])
def test_executed_partition_matches_plain_ops(name):
    part = runnable_partitions(small_workload(), [name])[name]
    ex = TorchExecutor(collective=ScaleCollective())
    slots = [s.name for s in part.slots] + [None]
    for slot in slots:
        prog = part.build(seed=7)
        ref = part.build(seed=7)
        for _ in range(3):  # three steps: the double buffers flip
            ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor,
                             ScheduleConfig(1980, 8, slot))
            prog.advance()
            ref.run_plain()
            ref.comm_tensor.mul_(2.0)
            ref.advance()
        torch.cuda.synchronize()
        for a, b in ((prog.output, ref.output), (prog.comm_tensor, ref.comm_tensor)):
            assert torch.equal(a, b), f"{name} slot={slot}: executed result differs"
        assert prog.comm_tensor.abs().sum() > 0


@gpu
def test_preset_partitions_build_and_run_at_real_shapes():
    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096, nanobatches=2)
    parts = runnable_partitions(wl)
    for name, p in parts.items():
        prog = p.build(seed=1)
        prog.run_plain()
        torch.cuda.synchronize()
        out = prog.output
        assert out.shape == (wl.tokens_per_nanobatch, wl.model.hidden), name
        assert torch.isfinite(out.float()).all(), name


@gpu
def test_callable_partition_runs_user_ops():
    a = torch.randn(256, 256, device="cuda")
    bufs = (torch.zeros(256, 256, device="cuda"), torch.zeros(256, 256, device="cuda"))
    holder = {}
    calls = []

    def op1():
        calls.append("op1")
        torch.matmul(a, a, out=holder["prog"].output)

    def op2():
        calls.append("op2")
        holder["prog"].output.add_(1.0)

    part = CallablePartition(
        name="mine", compute_ops=[ComputeOp(name="mm", kind=OpKind.GEMM, flops=1, bytes_moved=1),
                                  ComputeOp(name="add", kind=OpKind.ELEMENTWISE, flops=1,
                                            bytes_moved=1)],
        comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=4 * 256 * 256, group_size=2),
        callables=[op1, op2], comm_buffers=bufs)
    prog = part.build()
    holder["prog"] = prog
    ex = TorchExecutor(collective=ScaleCollective())
    ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, ScheduleConfig(1980, 4, "add"))
    prog.advance()
    ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, ScheduleConfig(1980, 4, "add"))
    torch.cuda.synchronize()
    assert calls == ["op1", "op2", "op1", "op2"]
    torch.testing.assert_close(prog.comm_tensor, 2.0 * (a @ a + 1.0))
