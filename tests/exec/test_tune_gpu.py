"""The tuning path's GPU pieces on one GPU: the outside work's kernels, and runnable
partitions whose buffers come from the executor's backends (LoopbackCollective standing in
for communication). Skipped without torch or without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.collectives import LoopbackCollective  # noqa: E402
from kareus.exec.executor import TorchExecutor  # noqa: E402
from kareus.exec.outside_work import RunnableOutsideWork  # noqa: E402
from kareus.exec.torch_partition import RunnableTransformerPartition  # noqa: E402
from kareus.model.config import ScheduleConfig  # noqa: E402
from kareus.model.partition import build_partitions  # noqa: E402
from kareus.model.workload import Workload  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = pytest.mark.gpu


def workload() -> Workload:
    return Workload.preset("llama3.2-3b", tp=2, pp=1, microbatch_size=2, seq_len=1024,
                           nanobatches=2)


@gpu
@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_outside_work_runs_with_its_collective(phase):
    loop = LoopbackCollective()
    ex = TorchExecutor(collective=loop, default_collective=loop)
    wl = workload()
    work = build_partitions(wl).outside[(0, phase)]
    prog = RunnableOutsideWork(work, wl).build(seed=3, collective=ex)
    assert prog.comm_kind is None and len(prog.ops) == len(work.ops) + len(work.comms)
    assert loop.allocated == len(work.comms)  # the collective's buffer from the backend
    for _ in range(2):
        prog.run_plain()
    torch.cuda.synchronize()
    out = prog.state["loss"] if phase == "fwd" else prog.state["dtable"]
    assert torch.isfinite(out.float()).all()


@gpu
def test_runner_builds_buffers_through_the_executor_and_runs_named_backends():
    from kareus.exec.nvml import TorchPartitionRunner

    loop = LoopbackCollective()
    ex = TorchExecutor(collective=loop, backends={"loopback": loop}, default_collective=loop)
    wl = workload()
    model_part = build_partitions(wl).types["fwd_attn"]
    made = []

    def resolve(p):
        made.append(p)
        return RunnableTransformerPartition(p, wl)

    runner = TorchPartitionRunner(ex, resolve=resolve)
    step = runner.prepare(model_part, ScheduleConfig(1980, 8, "rope", backend="loopback"))
    assert loop.allocated == 2  # the double buffers, registered through the executor
    for _ in range(3):
        step()
    runner.synchronize()
    prog = runner.program(made[0])
    assert prog.step == 3 and torch.isfinite(prog.output.float()).all()
