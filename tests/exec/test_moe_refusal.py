"""Mixture-of-experts layers are planned and emulated everywhere; the runnable partitions
(tests/exec/test_torch_partition_moe.py) and the training loop (tests/exec/test_train_moe.py)
compute them, and every layer that does not yet refuses an MoE workload in one line before
it builds anything (never a dense layer run in its place)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kareus.errors import WorkloadError
from kareus.exec.torch_partition import runnable_partitions
from kareus.exec.train import LoopbackGroups, TrainingLoop, refuse_uncomputed
from kareus.model.workload import Workload

MOE = Workload.preset("qwen3-30b-a3b", dp=2, ep=2, microbatch_size=2, seq_len=256,
                      num_microbatches=1)


def _one_line(err: pytest.ExceptionInfo[WorkloadError]) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_refuse_uncomputed_names_the_experts():
    with pytest.raises(WorkloadError) as err:
        refuse_uncomputed(MOE.model, where="here", computes=frozenset({"qk_norm", "norm_eps"}))
    assert "does not compute moe (mixture-of-experts layers" in _one_line(err)


def test_runnable_partitions_take_an_moe_workload():
    parts = runnable_partitions(MOE)  # built lazily: nothing is allocated here
    assert any(p.comm_op.kind.value == "all_to_all" for p in parts.values())


def test_training_loop_computes_moe_and_refuses_what_it_does_not_run():
    # the loop computes the MoE layer (no refusal of moe); groups of other degrees than the
    # workload's are refused in one line
    with pytest.raises(WorkloadError) as err:
        TrainingLoop(workload=MOE, groups=LoopbackGroups(tp=4))
    msg = _one_line(err)
    assert "does not compute moe" not in msg and "TP=4" in msg
