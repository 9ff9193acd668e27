"""The whole iteration in the model: pipeline sends and the per-iteration work."""

from __future__ import annotations

import pytest

from kareus.model import Workload, build_partitions
from kareus.model.ops import CommKind
from kareus.model.partition import (
    ADAM_BYTES_PER_PARAM,
    OutsideWork,
    iteration_work,
    stage_params_per_rank,
)


def test_stage_params_sum_to_the_model() -> None:
    wl = Workload.preset("llama3.2-3b", tp=1, pp=1)
    assert stage_params_per_rank(wl) == pytest.approx(wl.model.params, rel=1e-9)
    # Split over TP (norms replicated) and PP (the embedding or LM head on an end stage).
    wl8 = Workload.preset("llama3.2-3b", tp=8, pp=2)
    m = wl8.model
    assert stage_params_per_rank(wl8) < m.params / 8
    assert stage_params_per_rank(wl8) > (m.params - 2 * m.vocab * m.hidden) / 16


def test_iteration_work_dp_and_optimizer() -> None:
    one = iteration_work(Workload.preset("llama3.3-70b", tp=8, pp=2))  # untied embeddings
    assert one.comms == () and len(one.ops) == 1
    n = stage_params_per_rank(Workload.preset("llama3.3-70b", tp=8, pp=2))
    assert one.ops[0].bytes_moved == pytest.approx(ADAM_BYTES_PER_PARAM * n)
    dp = Workload.preset("llama3.2-3b", tp=4, pp=2, dp=4)
    work = iteration_work(dp)
    kinds = [c.kind for c in work.comms]
    # llama3.2-3b ties its embeddings: the end stages' copies' gradients are summed
    # between the data-parallel reduction and the step.
    assert kinds == [CommKind.REDUCE_SCATTER, CommKind.ALL_REDUCE, CommKind.ALL_GATHER]
    assert [c.group_size for c in work.comms] == [4, 2, 4]
    assert work.comms_cross_node  # 32 GPUs: more than one node
    assert work.ops[0].bytes_moved == pytest.approx(
        ADAM_BYTES_PER_PARAM * stage_params_per_rank(dp) / 4)  # distributed optimizer
    plain = iteration_work(dp, distributed_optimizer=False)
    assert [c.name for c in plain.comms] == ["dp_grad_all_reduce", "embedding_grad_all_reduce"]
    assert build_partitions(dp).iteration == work


def test_pipeline_sends() -> None:
    wl = Workload.preset("llama3.2-3b", tp=8, pp=2, microbatch_size=8, seq_len=4096)
    out = build_partitions(wl).outside
    act = 8 * 4096 * 3072 * 2 / 8  # one microbatch's activations, bf16, 1/TP per rank
    assert out[(0, "fwd")].p2p_bytes == pytest.approx(act)
    assert out[(1, "fwd")].p2p_bytes == 0  # the last stage sends nothing forward
    assert out[(1, "bwd")].p2p_bytes == pytest.approx(act)
    assert out[(0, "bwd")].p2p_bytes == 0
    assert out[(0, "fwd")].p2p_cross_node  # 16 GPUs: the two stages on two nodes
    small = build_partitions(Workload.preset("llama3.2-3b", tp=2, pp=2)).outside
    assert not small[(0, "fwd")].p2p_cross_node
    assert OutsideWork().empty and not out[(0, "fwd")].empty
    with pytest.raises(ValueError):
        OutsideWork(p2p_bytes=-1.0)
