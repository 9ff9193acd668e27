"""The whole iteration in the model: pipeline sends and the per-iteration work."""

from __future__ import annotations

import pytest

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model import Workload, build_partitions
from kareus.model.ops import CommKind, CommOp
from kareus.model.partition import (
    ADAM_BYTES_PER_PARAM,
    OutsideWork,
    grad_reduction_crosses_node,
    iteration_work,
    pipeline_sends_cross_node,
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


# qwen3-1.7b: hidden 2048, 16 query heads and 8 KV heads of 128, MLP 6144, 28 layers,
# vocabulary 151,936, per-head query/key norms, tied embeddings.
def _qwen3_stage_params_by_hand(tp: int, pp: int) -> int:
    """Parameters one rank of the fullest stage holds, from qwen3-1.7b's sizes: its layers,
    one vocabulary matrix (the embedding or the LM head's copy; the tied matrix itself at
    PP = 1) and the final norm."""
    h, q, kv, f = 2048, 16 * 128, 8 * 128, 6144
    layer = (h * (q + 2 * kv) + q * h + 3 * h * f) // tp + 2 * h + 2 * 128  # + norms
    embed = 151_936 * h // tp
    return 28 // pp * layer + embed + h  # the embedding or LM head stage, + final norm


def _qwen3(**kw: object) -> Workload:
    return Workload.preset("qwen3-1.7b", microbatch_size=16, seq_len=4096,
                           num_microbatches=8, **kw)  # type: ignore[arg-type]


def test_gradients_reduced_over_cp_at_dp_1() -> None:
    # The README's job: TP=4 CP=2 PP=2 (16 GPUs), DP = 1. Both CP ranks of a TP shard hold
    # the same weights and computed their gradients from different tokens: Megatron-Core
    # reduces them over its dp_cp group (2 GPUs) and shards the optimizer over it.
    wl = _qwen3(tp=4, cp=2, pp=2)
    n = _qwen3_stage_params_by_hand(tp=4, pp=2)
    assert n == 254_014_976 == stage_params_per_rank(wl)
    work = iteration_work(wl)
    rs, tied, ag = work.comms
    assert (rs.name, rs.kind, rs.bytes, rs.group_size) == (
        "cp_grad_reduce_scatter", CommKind.REDUCE_SCATTER, 4 * n, 2)  # fp32 gradients
    assert (ag.name, ag.kind, ag.bytes, ag.group_size) == (
        "cp_param_all_gather", CommKind.ALL_GATHER, 2 * n, 2)  # bf16 weights
    assert tied.name == "embedding_grad_all_reduce"
    assert work.ops[0].bytes_moved == pytest.approx(ADAM_BYTES_PER_PARAM * n / 2)
    # The CP group is GPUs 4 apart inside its stage's 8: NVLink; the tied all-reduce joins
    # the two stages, on two nodes.
    assert work.comms_cross_node and work.comms_in_node == (rs.name, ag.name)
    assert not grad_reduction_crosses_node(wl)
    assert [work.crosses_node(c) for c in work.comms] == [False, True, False]
    plain = iteration_work(wl, distributed_optimizer=False)
    ar = plain.comms[0]
    assert (ar.name, ar.kind, ar.bytes, ar.group_size) == (
        "cp_grad_all_reduce", CommKind.ALL_REDUCE, 4 * n, 2)
    assert plain.ops[0].bytes_moved == pytest.approx(ADAM_BYTES_PER_PARAM * n)
    assert build_partitions(wl).iteration == work


def test_gradients_reduced_over_dp_x_cp() -> None:
    n = _qwen3_stage_params_by_hand(tp=4, pp=2)
    wl = _qwen3(tp=4, cp=2, pp=2, dp=2)  # 32 GPUs
    work = iteration_work(wl)
    rs, _, ag = work.comms
    assert (rs.name, rs.bytes, rs.group_size) == ("dp_cp_grad_reduce_scatter", 4 * n, 4)
    assert (ag.name, ag.bytes, ag.group_size) == ("dp_cp_param_all_gather", 2 * n, 4)
    assert work.ops[0].bytes_moved == pytest.approx(ADAM_BYTES_PER_PARAM * n / 4)
    # A group of 4 ranks (CP 4 apart, DP 8 apart) in a block of 16: on two nodes.
    assert grad_reduction_crosses_node(wl)
    assert work.comms_in_node == () and all(work.crosses_node(c) for c in work.comms)
    # TP=2 CP=2 DP=2 on one node of 8: everything over NVLink.
    small = _qwen3(tp=2, cp=2, pp=1, dp=2)
    one = iteration_work(small)
    n1 = _qwen3_stage_params_by_hand(tp=2, pp=1)  # tied on one stage: one matrix
    assert [(c.name, c.bytes, c.group_size) for c in one.comms] == [
        ("dp_cp_grad_reduce_scatter", 4 * n1, 4), ("dp_cp_param_all_gather", 2 * n1, 4)]
    assert not one.comms_cross_node and not any(one.crosses_node(c) for c in one.comms)


def test_data_parallel_alone_is_unchanged() -> None:
    # CP = 1: the group is the DP group, named and sized as before CP joined it, and the
    # work's repr (which keys the emulator's measurements) has no new field.
    n = _qwen3_stage_params_by_hand(tp=4, pp=2)
    wl = _qwen3(tp=4, pp=2, dp=2)  # 16 GPUs
    work = iteration_work(wl)
    assert [(c.name, c.kind, c.bytes, c.group_size) for c in work.comms] == [
        ("dp_grad_reduce_scatter", CommKind.REDUCE_SCATTER, 4 * n, 2),
        ("embedding_grad_all_reduce", CommKind.ALL_REDUCE, 4 * 151_936 // 4 * 2048, 2),
        ("dp_param_all_gather", CommKind.ALL_GATHER, 2 * n, 2)]
    assert work.ops[0].bytes_moved == pytest.approx(ADAM_BYTES_PER_PARAM * n / 2)
    # Megatron-LM's default order puts a stage's two replicas 4 ranks apart, in one node;
    # with --use-tp-pp-dp-mapping they sit 8 apart, on two nodes.
    assert work.comms_cross_node and work.comms_in_node == (
        "dp_grad_reduce_scatter", "dp_param_all_gather")
    mapped = iteration_work(_qwen3(tp=4, pp=2, dp=2, rank_order="tp-cp-ep-pp-dp"))
    assert mapped.comms == work.comms and mapped.comms_in_node == ()
    assert "comms_in_node" not in repr(mapped)
    # CP = DP = 1: no reduction at all.
    assert iteration_work(_qwen3(tp=4, pp=2)).comms[0].name == "embedding_grad_all_reduce"
    assert len(iteration_work(_qwen3(tp=4, pp=1)).comms) == 0


@pytest.mark.parametrize(("tp", "cp", "pp", "dp", "order", "crosses"), [
    (4, 2, 2, 1, "tp-cp-ep-dp-pp", False),  # CP ranks 4 apart in a block of 8
    (8, 2, 1, 1, "tp-cp-ep-dp-pp", True),   # a stage of 16 GPUs: its CP ranks 8 apart
    (2, 3, 2, 1, "tp-cp-ep-dp-pp", True),   # blocks of 6: the second straddles a node
    (1, 1, 1, 8, "tp-cp-ep-dp-pp", False),  # DP over one node
    (1, 1, 1, 16, "tp-cp-ep-dp-pp", True),
    (2, 1, 4, 2, "tp-cp-ep-dp-pp", False),  # DP inside PP: replicas 2 apart
    (2, 1, 4, 2, "tp-cp-ep-pp-dp", True),   # DP outside PP: replicas 8 apart
    (4, 2, 2, 1, "tp-cp-ep-pp-dp", False),  # DP = 1: the order does not matter
])
def test_gradient_group_layout(tp: int, cp: int, pp: int, dp: int, order: str,
                               crosses: bool) -> None:
    wl = Workload.preset("llama3.2-3b", tp=tp, cp=cp, pp=pp, dp=dp, seq_len=6144,
                         rank_order=order)
    assert grad_reduction_crosses_node(wl) is crosses


@pytest.mark.parametrize(("tp", "cp", "pp", "dp", "order", "crosses"), [
    (2, 1, 2, 1, "tp-cp-ep-dp-pp", False),  # 4 GPUs
    (8, 1, 2, 1, "tp-cp-ep-dp-pp", True),   # a stage per node
    (2, 1, 4, 2, "tp-cp-ep-dp-pp", True),   # stages 4 ranks apart: 0-3 / 4-7 / 8-11 / ...
    (2, 1, 4, 2, "tp-cp-ep-pp-dp", False),  # a replica's 4 stages in ranks 0-7
    (2, 1, 2, 4, "tp-cp-ep-dp-pp", True),   # stages 8 apart
    (2, 1, 2, 4, "tp-cp-ep-pp-dp", False),
    (1, 3, 2, 2, "tp-cp-ep-pp-dp", True),   # replicas of 6: the second straddles a node
])
def test_pipeline_send_layout(tp: int, cp: int, pp: int, dp: int, order: str,
                              crosses: bool) -> None:
    wl = Workload.preset("llama3.2-3b", tp=tp, cp=cp, pp=pp, dp=dp, rank_order=order,
                         seq_len=6144)
    assert pipeline_sends_cross_node(wl) is crosses
    assert build_partitions(wl).outside[(0, "fwd")].p2p_cross_node is crosses


def test_rank_order_global_ranks() -> None:
    from kareus.model import Parallelism

    p = Parallelism(tp=2, cp=2, pp=2, dp=3)
    ranks = {p.global_rank(tp=t, cp=c, dp=d, pp=s) for t in range(2) for c in range(2)
             for d in range(3) for s in range(2)}
    assert ranks == set(range(p.world_size))
    assert p.global_rank(dp=1) == 4 and p.global_rank(pp=1) == 12  # DP inside PP
    q = Parallelism(tp=2, cp=2, pp=2, dp=3, rank_order="tp-cp-ep-pp-dp")
    assert q.global_rank(pp=1) == 4 and q.global_rank(dp=1) == 8
    with pytest.raises(Exception, match="rank_order must be one of tp-cp-ep-dp-pp"):
        Parallelism(rank_order="pp-dp-tp")
    # Written only when not the default, and read back.
    wl = Workload.preset("llama3.2-3b", tp=2, pp=2, dp=2, rank_order="tp-cp-ep-pp-dp")
    assert wl.to_dict()["rank_order"] == "tp-cp-ep-pp-dp"
    assert Workload.from_dict(wl.to_dict()) == wl
    assert "rank_order" not in Workload.preset("llama3.2-3b", tp=2).to_dict()


def test_outside_work_comms_in_node() -> None:
    ar = CommOp(name="a", kind=CommKind.ALL_REDUCE, bytes=4, group_size=2)
    other = CommOp(name="b", kind=CommKind.ALL_REDUCE, bytes=4, group_size=2)
    plain = OutsideWork(comms=(ar,), p2p_bytes=3.0)
    assert repr(plain) == (
        "OutsideWork(ops=(), comms=(CommOp(name='a', kind=<CommKind.ALL_REDUCE: 'all_reduce'>,"
        " bytes=4, group_size=2),), comms_cross_node=False, p2p_bytes=3.0,"
        " p2p_cross_node=False)")
    mixed = OutsideWork(comms=(ar, other), comms_cross_node=True, comms_in_node=["a"])
    assert mixed.comms_in_node == ("a",) and repr(mixed).endswith("comms_in_node=('a',))")
    assert not mixed.crosses_node(ar) and mixed.crosses_node(other)
    assert mixed != OutsideWork(comms=(ar, other), comms_cross_node=True)
    assert not plain.crosses_node(ar)
    with pytest.raises(ArgumentError, match="comms_in_node"):
        OutsideWork(comms=(ar,), comms_in_node=("c",))
    with pytest.raises(ArgumentTypeError, match="comms_in_node"):
        OutsideWork(comms=(ar,), comms_in_node="a")  # type: ignore[arg-type]
