"""Partition runners (kareus.profilers.nvml._runner): the torch runner takes an Executor."""

from __future__ import annotations

import pytest

from kareus.errors import GraphCaptureError
from kareus.profilers.nvml import PartitionRunner, TorchPartitionRunner
from kareus.testing import RecordingExecutor


def test_the_torch_runner_refuses_anything_but_an_executor():
    # Checked before torch is imported, so this runs without torch too.
    with pytest.raises(TypeError, match="Executor"):
        TorchPartitionRunner(object())  # type: ignore[arg-type]


def test_the_torch_runner_runs_only_runnable_partitions():
    pytest.importorskip("torch")
    runner = TorchPartitionRunner(RecordingExecutor(), seed=3)
    assert isinstance(runner, PartitionRunner)
    assert runner.executor.plan is None and runner.seed == 3
    from kareus.model import Workload, build_partitions

    part = build_partitions(Workload.preset("llama3.2-3b", tp=2, microbatch_size=2,
                                            seq_len=256))["fwd_attn"]
    with pytest.raises(TypeError, match="not runnable"):
        runner.program(part)  # a plain partition: it has no kernels to run


# -- graph-captured steps (the recording fake device captures) ------------------------------

OPS = ("norm", "proj")


def _runnable(dev, tag="a", *, outside=False):
    """A runnable partition whose ops log themselves on the fake device; its collective
    alternates between buffers ``<tag>0`` and ``<tag>1``."""
    from kareus.exec.torch_partition import CallablePartition
    from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind

    class Outside(CallablePartition):
        def build(self, **kw):
            prog = super().build(**kw)
            prog.comm_kind = None  # work that runs its collectives among its ops
            return prog

    cls = Outside if outside else CallablePartition
    return cls(name=f"part-{tag}",
               compute_ops=[ComputeOp(name=f"{tag}.{n}", kind=OpKind.GEMM, flops=1e9,
                                      bytes_moved=1e6) for n in OPS],
               comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=1e6, group_size=2),
               callables=[dev.op(f"{tag}.{n}") for n in OPS],
               comm_buffers=(f"{tag}0", f"{tag}1"))


def _graphed_runner(**kw):
    pytest.importorskip("torch")
    from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
    from kareus.testing import RecordingCollective

    dev = RecordingStreamBackend()
    coll = RecordingCollective(streams=dev)
    ex = TorchExecutor(collective=coll, streams=dev, **kw)
    return TorchPartitionRunner(ex), dev, coll


def _graph(dev, i):
    return dev.graphs[f"{TorchPartitionRunner.SEQUENCE}[{i}]"]


def test_a_graphed_step_replays_two_graphs_one_per_buffer_parity_in_turn():
    from kareus.model.config import ScheduleConfig

    runner, dev, coll = _graphed_runner()
    assert runner.graphs is True
    part = _runnable(dev)
    step = runner.prepare(part, ScheduleConfig(1980, 8, "a.proj"))
    assert runner.captures == 1
    # Warm-up (eager, both bodies) then the capture of both: each body is one whole step.
    assert [e for e in dev.log if e[0] in ("capture", "end_capture")] == [
        ("capture", "", "partition-runner[0]"), ("end_capture", "", "partition-runner[0]"),
        ("capture", "", "partition-runner[1]"), ("end_capture", "", "partition-runner[1]")]
    for i in (0, 1):
        g = _graph(dev, i)
        assert [e[2] for e in g if e[0] == "launch" and e[1] == "compute"] == ["a.norm",
                                                                                "a.proj"]
        # Step j reduces the buffer step j-1 wrote: the two graphs alternate the buffers.
        assert [e[2] for e in g if e[0] == "launch" and e[1] == "comm"] == [
            f"all_reduce(a{(i + 1) % 2})"]
    prog = runner.program(part)
    at = prog.step
    n = len(dev.log)
    calls = len(coll.calls)
    for _ in range(5):
        step()
    assert dev.log[n:] == [("replay", "compute", f"partition-runner[{i % 2}]") for i in range(5)]
    assert len(coll.calls) == calls  # a replay runs no Python: nothing is launched again
    assert prog.step == at + 5
    # The program stepped outside the runner no longer matches the graph to replay next.
    prog.advance()
    with pytest.raises(GraphCaptureError, match="parity|buffers"):
        step()


def test_another_configuration_releases_the_graphs_before_capturing_its_own():
    from kareus.model.config import ScheduleConfig

    runner, dev, _ = _graphed_runner()
    ex = runner.executor
    part = _runnable(dev)
    first = runner.prepare(part, ScheduleConfig(1980, 8, "a.proj"))
    old = ex.sequence(TorchPartitionRunner.SEQUENCE)
    first()
    seen = []
    capture = ex.capture

    def spy(name, bodies, **kw):
        seen.append(ex.sequence(name))  # what the executor still holds when capturing
        return capture(name, bodies, **kw)

    ex.capture = spy
    again = runner.prepare(part, ScheduleConfig(1980, 8, "a.proj"))  # the same: reused
    assert seen == [] and runner.captures == 1
    again()  # continues the sequence (graph 1 is next)
    runner.prepare(part, ScheduleConfig(1980, 16, None))
    assert seen == [None]  # released first
    assert runner.captures == 2 and ex.sequence(TorchPartitionRunner.SEQUENCE) is not old
    # Two replays later the program is at the parity it was first captured at.
    assert [e[2] for e in _graph(dev, 0) if e[0] == "launch" and e[1] == "comm"] == [
        "all_reduce(a1)"]
    other = _runnable(dev, "b")
    step = runner.prepare(other, ScheduleConfig(1980, 16, None))  # another partition
    assert runner.captures == 3 and seen == [None, None]
    step()
    assert dev.log[-1] == ("replay", "compute", "partition-runner[0]")
    runner.release()
    assert ex.sequence(TorchPartitionRunner.SEQUENCE) is None


def test_outside_work_is_captured_the_same_way():
    from kareus.model.config import ScheduleConfig

    runner, dev, coll = _graphed_runner()
    part = _runnable(dev, "o", outside=True)
    step = runner.prepare(part, ScheduleConfig(1980, 8, None))
    assert [e[2] for e in _graph(dev, 0) if e[0] == "launch"] == ["o.norm", "o.proj"]
    assert coll.calls == []  # its collectives are among its ops
    step()
    step()
    assert [e for e in dev.log if e[0] == "replay"] == [
        ("replay", "compute", "partition-runner[0]"), ("replay", "compute", "partition-runner[1]")]


def test_an_eager_executor_launches_every_op_and_captures_nothing():
    from kareus.model.config import ScheduleConfig

    runner, dev, coll = _graphed_runner(graphs=False)
    assert runner.graphs is False
    step = runner.prepare(_runnable(dev), ScheduleConfig(1980, 8, "a.proj"))
    step()
    step()
    assert not any(e[0] in ("capture", "replay") for e in dev.log)
    assert dev.launches("compute") == ["a.norm", "a.proj"] * 2
    assert [c[1] for c in coll.calls] == ["a1", "a0"]


def test_a_runner_that_cannot_tell_reports_no_queued_time():
    class Minimal(PartitionRunner):
        def prepare(self, partition, config):
            return lambda: None

        def synchronize(self):
            pass

        def mark(self):
            return 0.0

        def elapsed_s(self, a, b):
            return b - a

    r = Minimal()
    assert r.graphs is False
    assert r.queued_step_s(lambda: None, steps=10, host_step_s=1e-5) is None
