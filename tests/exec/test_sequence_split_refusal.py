"""Nanobatches along the sequence are costed by the model and the emulator; the runnable
partitions split along the batch only, so they refuse such a workload in one line (no
partition of zero sequences measured silently)."""

from __future__ import annotations

import pytest

from kareus.errors import WorkloadError
from kareus.exec.torch_partition import runnable_partitions
from kareus.model.workload import Workload


def test_runnable_partitions_refuse_nanobatches_along_the_sequence():
    wl = Workload.preset("qwen3-1.7b", tp=2, microbatch_size=1, seq_len=1024, nanobatches=2)
    with pytest.raises(WorkloadError, match="microbatch_size=1 holds one sequence") as err:
        runnable_partitions(wl)
    assert "\n" not in str(err.value)
    assert runnable_partitions(wl.with_(nanobatches=1))  # unsplit: runs
