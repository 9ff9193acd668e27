"""Partition runners (kareus.exec.nvml._runner): the torch runner takes an Executor."""

from __future__ import annotations

import pytest

from kareus.exec.nvml import PartitionRunner, TorchPartitionRunner
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
