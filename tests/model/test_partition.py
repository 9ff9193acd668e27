"""Partitions: launch slots, the partition builder, and the Partition conformance suite."""

from __future__ import annotations

import attrs
import pytest

from kareus.errors import WorkloadError
from kareus.model import (
    CommKind,
    CommOp,
    ComputeOp,
    LaunchSlot,
    OpKind,
    OpPartition,
    Partition,
    Workload,
    build_partitions,
    launch_slots,
)
from kareus.testing import PartitionConformance, check_partition


def _llama(**kw):
    base = dict(tp=4, microbatch_size=8, seq_len=4096)
    base.update(kw)
    return Workload.preset("llama3.2-3b", **base)


def test_fwd_mlp_gemm_flops_by_hand():
    wl = _llama()
    ps = build_partitions(wl)
    mlp = ps["fwd_mlp"]
    tokens, hidden, ffn, tp = 8 * 4096, 3072, 8192, 4
    gemm_flops_nb = sum(op.flops for op in mlp.compute_ops if op.kind is OpKind.GEMM)
    # Per microbatch (summed over the 2 nanobatches) the three GEMMs carry 2*T*h*ffn*3/tp.
    assert gemm_flops_nb * wl.nanobatches == pytest.approx(2 * tokens * hidden * ffn * 3 / tp)
    assert [op.name for op in mlp.compute_ops if op.kind is OpKind.GEMM] == ["gate", "up", "down"]


def test_fwd_attn_flops_by_hand():
    wl = _llama()
    attn = build_partitions(wl)["fwd_attn"]
    t = 8 * 4096 // 2  # tokens per nanobatch
    q, kv, h = 24 * 128 // 4, 8 * 128 // 4, 3072
    ops = {op.name: op for op in attn.compute_ops}
    assert ops["qkv"].flops == pytest.approx(2 * t * h * (q + 2 * kv))
    assert ops["out_proj"].flops == pytest.approx(2 * t * q * h)
    # Causal attention: 4 * b * s^2 * heads * head_dim / 2 per nanobatch of b = 4 sequences.
    assert ops["attn_core"].flops == pytest.approx(4 * 4 * 4096**2 * (24 // 4) * 128 / 2)


def test_tp_partition_types_counts_and_comm():
    wl = _llama(pp=2, num_microbatches=4)
    ps = build_partitions(wl)
    assert set(ps.names) == {"fwd_attn", "fwd_mlp", "bwd_attn", "bwd_mlp"}
    per_stage = 28 // 2 * 2  # layers per stage x nanobatches
    assert ps.counts["fwd"] == {"fwd_attn": per_stage, "fwd_mlp": per_stage}
    # Full recomputation: the backward also re-runs the forward partitions.
    assert ps.counts["bwd"]["fwd_attn"] == per_stage
    assert ps.counts["bwd"]["bwd_mlp"] == per_stage
    comm = ps["fwd_attn"].comm_op
    assert comm.kind is CommKind.ALL_REDUCE and comm.group_size == 4
    assert comm.bytes == 8 * 4096 // 2 * 3072 * 2
    no_recompute = build_partitions(wl.with_(recompute=False))
    assert "fwd_attn" not in no_recompute.counts["bwd"]


def test_slots_merge_memory_bound_ops():
    mlp = build_partitions(_llama())["fwd_mlp"]
    assert [s.name for s in mlp.slots] == ["mlp_norm", "gate", "up", "swiglu", "down"]
    ops = [
        ComputeOp(name="a", kind="norm", flops=1, bytes_moved=10),
        ComputeOp(name="b", kind="elementwise", flops=1, bytes_moved=10),
        ComputeOp(name="g", kind="gemm", flops=100, bytes_moved=1),
        ComputeOp(name="c", kind="rope", flops=1, bytes_moved=10),
        ComputeOp(name="d", kind="activation", flops=1, bytes_moved=10),
        ComputeOp(name="h", kind="attention", flops=100, bytes_moved=1),
    ]
    slots = launch_slots(ops)
    assert [s.name for s in slots] == ["a", "g", "c", "h"]
    assert slots[0].op_names == ("a", "b")
    assert slots[2].op_names == ("c", "d")
    assert slots[1].compute_bound and not slots[0].compute_bound


def test_cp_adds_all_gather_and_reduce_scatter_kinds():
    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, pp=2, microbatch_size=16, seq_len=4096,
                         num_microbatches=8)
    ps = build_partitions(wl)
    kinds = {p.comm_op.kind for p in ps}
    assert kinds == {CommKind.ALL_REDUCE, CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER}
    ag = [p for p in ps if p.comm_op.kind is CommKind.ALL_GATHER]
    assert all(p.comm_op.group_size == 2 for p in ag)
    # Every layer's collectives are all counted: per nanobatch 3 in fwd (AG, AR, AR).
    n_fwd_comms = sum(ps.counts["fwd"].values())
    assert n_fwd_comms == 3 * 2 * 14


def test_single_nanobatch_is_sequential_only():
    ps = build_partitions(_llama(nanobatches=1, microbatch_size=8))
    assert all(not p.overlappable and p.slots == () for p in ps)


def test_no_collective_is_an_error():
    with pytest.raises(WorkloadError, match="tp >= 2 or cp >= 2"):
        build_partitions(Workload.preset("llama3.2-3b", tp=1, microbatch_size=2))


def test_outside_work_on_first_and_last_stage():
    wl = _llama(pp=4, num_microbatches=8)
    ps = build_partitions(wl)
    assert [op.name for op in ps.outside[(0, "fwd")].ops] == ["embedding"]
    last = ps.outside[(3, "fwd")]
    assert [op.name for op in last.ops] == ["final_norm", "lm_head", "loss"]
    assert ps.outside[(1, "fwd")].ops == ()
    lm = last.ops[1]
    assert lm.flops == pytest.approx(2 * 8 * 4096 * 3072 * (128256 / 4))
    assert ps.model_flops_per_gpu_iteration() > 0


def test_user_partition_validation():
    comm = CommOp(name="ar", kind="all_reduce", bytes=1e6, group_size=4)
    op = ComputeOp(name="x", kind="gemm", flops=1e9, bytes_moved=1e6)
    p = OpPartition(name="mine", compute_ops=[op], comm_op=comm)
    assert p.slots[0].name == "x"
    assert "mine" in repr(p)
    with pytest.raises(ValueError, match="unique"):
        OpPartition(name="dup", compute_ops=[op, op], comm_op=comm)
    with pytest.raises(ValueError, match="at least one"):
        OpPartition(name="empty", compute_ops=[], comm_op=comm)


def test_op_validation():
    with pytest.raises(ValueError, match="flops"):
        ComputeOp(name="x", kind="gemm", flops=-1, bytes_moved=1)
    with pytest.raises(ValueError, match="does no work"):
        ComputeOp(name="x", kind="gemm", flops=0, bytes_moved=0)
    with pytest.raises(ValueError):
        ComputeOp(name="x", kind="not-a-kind", flops=1, bytes_moved=1)
    with pytest.raises(ValueError, match="group_size"):
        CommOp(name="c", kind="all_reduce", bytes=1, group_size=1)
    ar = CommOp(name="c", kind="all_reduce", bytes=100, group_size=4)
    ag = CommOp(name="c", kind="all_gather", bytes=100, group_size=4)
    assert ar.bus_bytes == pytest.approx(150)
    assert ag.bus_bytes == pytest.approx(75)


# ------------------------------------------------------------------ conformance suite


class TestTransformerPartitionConformance(PartitionConformance):
    """A partition build_partitions makes, nanobatched (overlappable), with a CP collective."""

    def make_partition(self) -> Partition:
        wl = Workload.preset("qwen3-1.7b", tp=2, cp=2, pp=2, microbatch_size=2, seq_len=1024,
                             num_microbatches=2)
        return build_partitions(wl)["bwd_attn_out_rs"]


class TestSequentialPartitionConformance(PartitionConformance):
    """Without nanobatching a partition is not overlappable: no launch slots."""

    def make_partition(self) -> Partition:
        wl = Workload.preset("qwen3-1.7b", tp=2, pp=1, microbatch_size=2, seq_len=1024,
                             num_microbatches=2, nanobatches=1)
        return build_partitions(wl)["fwd_mlp"]


class TestOpPartitionConformance(PartitionConformance):
    def make_partition(self) -> Partition:
        return OpPartition(
            name="mine",
            compute_ops=[ComputeOp(name="norm", kind=OpKind.NORM, flops=1e6, bytes_moved=4e6),
                         ComputeOp(name="act", kind=OpKind.ACTIVATION, flops=1e6,
                                   bytes_moved=4e6),
                         ComputeOp(name="gemm", kind=OpKind.GEMM, flops=1e12, bytes_moved=1e8)],
            comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**24, group_size=4))


def test_every_built_partition_conforms():
    wl = Workload.preset("llama3.2-3b", tp=2, cp=2, pp=2, microbatch_size=2, seq_len=1024,
                         num_microbatches=2)
    for part in build_partitions(wl):
        check_partition(lambda part=part: part)


def test_the_suite_catches_a_partition_whose_slots_lie():
    class _Lying(OpPartition):
        @property
        def slots(self) -> tuple[LaunchSlot, ...]:
            return tuple(reversed(super().slots))

    make = TestOpPartitionConformance().make_partition
    base = make()
    with pytest.raises(AssertionError, match="'slots'.*stream order"):
        check_partition(lambda: _Lying(name=base.name, compute_ops=base.compute_ops,
                                       comm_op=base.comm_op))


# ------------------------------------------------------------------ sequence parallelism


def test_sequence_parallel_collectives_move_the_all_reduces_tensor():
    """Under SP each TP all-reduce is a reduce-scatter plus an all-gather of the same
    ``tokens x hidden`` tensor: CommOp.bytes is the all-gather's gathered output and the
    reduce-scatter's input (the emulator moves ``bus_bytes``: half the all-reduce's)."""
    ar = build_partitions(_llama())
    sp = build_partitions(_llama(sp=True))
    act = 8 * 4096 // 2 * 3072 * 2  # one nanobatch of tokens x hidden, bf16
    assert ar["fwd_attn"].comm_op.bytes == act
    tp = [p for p in sp if p.comm_group == "tp"]
    assert {p.comm_op.kind for p in tp} == {CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER}
    assert all(p.comm_op.bytes == act and p.comm_op.group_size == 4 for p in tp)
    assert all(2 * p.comm_op.bus_bytes == ar["fwd_attn"].comm_op.bus_bytes for p in tp)


def test_sequence_parallel_norms_run_on_the_sequence_shard():
    ar = {op.name: op for p in build_partitions(_llama()) for op in p.compute_ops}
    sp = {op.name: op for p in build_partitions(_llama(sp=True)) for op in p.compute_ops}
    assert set(ar) == set(sp)
    for name in ar:
        if name in ("attn_norm", "mlp_norm", "attn_norm_bwd", "mlp_norm_bwd"):
            assert sp[name].bytes_moved * 4 == ar[name].bytes_moved
            assert sp[name].flops * 4 == ar[name].flops
        else:  # every other op sees the whole sequence, as before
            assert sp[name] == ar[name], name


def test_sequence_parallel_types_are_named_by_kind_and_group():
    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, sp=True, microbatch_size=4, seq_len=4096,
                         num_microbatches=2)
    ps = build_partitions(wl)
    # a segment overlapping a TP and a CP collective of one kind: named by group and kind
    assert {"fwd_attn_in_tp_ag", "fwd_attn_in_cp_ag", "bwd_attn_in_tp_rs",
            "bwd_attn_in_cp_rs"} <= set(ps.names)
    assert ps["fwd_attn_in_cp_ag"].comm_op.group_size == 2
    assert ps["fwd_attn_in_tp_ag"].comm_op.group_size == 4
    assert ps["fwd_attn_in_cp_ag"].compute_ops == ps["fwd_attn_in_tp_ag"].compute_ops
    # one type per (segment, collective kind and group): no two share ops and collective
    keys = [(p.phase, tuple(op.name for op in p.compute_ops), p.comm_op.kind, p.comm_group)
            for p in ps]
    assert len(set(keys)) == len(keys)
    # names follow the structure only: the same for another batch size
    assert build_partitions(wl.with_(microbatch_size=2)).names == ps.names
    # without nanobatching each segment has its own collective only
    one = build_partitions(wl.with_(nanobatches=1))
    assert "fwd_attn_norm" in one.names and one["fwd_attn_norm"].comm_op.kind is \
        CommKind.ALL_GATHER


def test_sequence_parallel_at_tp1_is_the_plain_layout():
    wl = Workload.preset("qwen3-1.7b", cp=2, microbatch_size=2, seq_len=1024)
    assert build_partitions(wl.with_(parallelism=attrs.evolve(wl.parallelism, sp=True))
                            ).types == build_partitions(wl).types


def test_sequence_parallel_outside_work():
    """The embedding's output is reduce-scattered instead of all-reduced; the final norm runs
    on the shard and is all-gathered before the LM head; backward, the LM head's input
    gradient is reduce-scattered and the final norm's output gradient all-gathered."""
    wl = _llama(pp=2, num_microbatches=4, sp=True)
    ps = build_partitions(wl)
    plain = build_partitions(_llama(pp=2, num_microbatches=4))
    act = 8 * 4096 * 3072 * 2
    first, last = ps.outside[(0, "fwd")], ps.outside[(1, "fwd")]
    assert [(c.kind, c.bytes) for c in first.comms] == [(CommKind.REDUCE_SCATTER, act)]
    assert [(c.kind, c.bytes) for c in last.comms] == [(CommKind.ALL_GATHER, act)]
    assert [c.kind for c in ps.outside[(1, "bwd")].comms] == [CommKind.REDUCE_SCATTER,
                                                               CommKind.ALL_GATHER]
    assert ps.outside[(0, "bwd")].comms == ()  # the bottom layer's all-gather feeds it
    norm = {op.name: op for op in last.ops}["final_norm"]
    assert norm.bytes_moved * 4 == {op.name: op for op in plain.outside[(1, "fwd")].ops
                                    }["final_norm"].bytes_moved
    # the pipeline sends the rank's sequence shard: the same bytes as its 1/TP share
    assert first.p2p_bytes == plain.outside[(0, "fwd")].p2p_bytes


def test_every_sequence_parallel_partition_conforms():
    wl = Workload.preset("llama3.2-3b", tp=2, cp=2, pp=2, sp=True, microbatch_size=2,
                         seq_len=1024, num_microbatches=2)
    for part in build_partitions(wl):
        check_partition(lambda part=part: part)


@pytest.mark.parametrize("sp", [False, True])
def test_selective_recomputation_costs_the_attention_core_again_in_the_backward(sp):
    none = build_partitions(_llama(recompute="none", sp=sp))
    sel = build_partitions(_llama(recompute="selective", sp=sp))
    assert set(sel.names) == set(none.names)
    fwd_core = next(op for p in sel if p.phase == "fwd" for op in p.compute_ops
                    if op.name == "attn_core")
    for p in sel:
        if p.phase != "bwd":
            assert p == none[p.name]
            continue
        names = [op.name for op in p.compute_ops]
        if "out_dgrad" in names:  # the recomputed core runs right before it, at its cost
            i = names.index("out_dgrad")
            assert i > 0 and p.compute_ops[i - 1] == fwd_core
            assert names[:i - 1] + names[i:] == [op.name for op in none[p.name].compute_ops]
            assert any(s.name == "attn_core" for s in p.slots)
        else:
            assert p == none[p.name]
    # no forward partition is re-run: only full recomputation counts them in the backward
    assert sel.counts == none.counts
    assert (sel.computation_flops(0, "bwd") - none.computation_flops(0, "bwd")
            == pytest.approx(fwd_core.flops * 28 * 2))


# ------------------------------------------------------------------ nanobatches along the sequence


def _one_sequence(n=2, **kw):
    base = dict(tp=4, microbatch_size=1, seq_len=8192, nanobatches=n, num_microbatches=4)
    base.update(kw)
    return Workload.preset("llama3.2-3b", **base)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_sequence_chunks_cost_their_causal_attention_exactly(n, recompute):
    """Chunk i of n (c tokens) attends to the keys of chunks 0..i: (i + 1/2) c^2 query-key
    pairs, as the half score matrix of the whole sequence counts them (the chunks add up to
    it); every other op is the same in every chunk."""
    wl = _one_sequence(n, recompute=recompute)
    assert wl.sequence_split
    ps = build_partitions(wl)
    whole = build_partitions(wl.with_(nanobatches=1))
    c, heads, hd, kv = 8192 // n, 24 // 4, 128, 8 * 128 // 4
    cores = {}
    for p in ps:
        for op in p.compute_ops:
            if op.name == "attn_core" and p.phase == "fwd":
                i = int(p.name.rsplit("_c", 1)[1])
                assert op.flops == pytest.approx(4 * (i + 0.5) * c * c * heads * hd)
                # its queries and output, the K and V of chunks 0..i
                assert op.bytes_moved == (2 * c * heads * hd + 2 * (i + 1) * c * kv) * 2
                cores[i] = op
    assert sorted(cores) == list(range(n))
    # the split costs the whole microbatch's work, no more, no less
    for phase in ("fwd", "bwd"):
        assert ps.computation_flops(0, phase) == pytest.approx(
            whole.computation_flops(0, phase))
    # per layer and phase each chunk's attention runs once
    for phase in ("fwd", "bwd"):
        chunk_types = [t for t in ps.counts[phase] if "_c" in t and ps[t].phase == phase]
        assert sum(ps.counts[phase][t] for t in chunk_types) == n * 28
    # the ops that do not attend are the batch split's (the same tokens per nanobatch)
    batch = build_partitions(Workload.preset("llama3.2-3b", tp=4, microbatch_size=n,
                                             seq_len=8192 // n, nanobatches=n,
                                             num_microbatches=4, recompute=recompute))
    assert ps["fwd_mlp"] == batch["fwd_mlp"] and ps["bwd_mlp"] == batch["bwd_mlp"]


def test_sequence_chunks_run_forward_in_order_and_backward_in_reverse():
    """The forward's first chunk (chunk 0) overlaps the collective of the segment before it;
    the backward runs the chunks in reverse (a chunk's attention backward adds to the
    earlier chunks' dK and dV), so there the last chunk does."""
    ps = build_partitions(_one_sequence(2, cp=1, sp=True))
    assert ps["fwd_attn_ag_c0"].comm_op.kind is CommKind.ALL_GATHER  # after attn_norm's
    assert ps["fwd_attn_rs_c1"].comm_op.kind is CommKind.REDUCE_SCATTER  # chunk 0's own
    assert ps["bwd_attn_ag_c1"].comm_op.kind is CommKind.ALL_GATHER  # after mlp_norm_bwd's
    assert ps["bwd_attn_rs_c0"].comm_op.kind is CommKind.REDUCE_SCATTER  # chunk 1's own
    # the norms run on each chunk's sequence shard: tokens / nanobatches / TP
    norm = next(op for op in ps["fwd_attn_norm_ag"].compute_ops)
    assert norm.bytes_moved == 2 * (8192 // 2 // 4) * 3072 * 2


def test_sequence_split_refusals():
    with pytest.raises(WorkloadError, match="not modelled with CP=2"):
        _one_sequence(2, tp=2, cp=2)
    with pytest.raises(WorkloadError, match="does not split into 3 nanobatches along the seq"):
        _one_sequence(3)
    with pytest.raises(WorkloadError, match="does not split into 4 nanobatches"):
        _one_sequence(4, microbatch_size=2)
    assert not _one_sequence(1).sequence_split
