"""The decoder layer's op order (kareus.model.decoder): the one description the partition
model and the runtime schedule both read."""

from __future__ import annotations

import pytest

from kareus.errors import ArgumentError
from kareus.model import (
    DECODER_LAYER,
    LayerCollective,
    LayerSegment,
    build_partitions,
    decoder_layer,
    layer_collectives,
)
from kareus.model.workload import ModelArch, Parallelism, Workload

ARCH = ModelArch(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
                 vocab=101)


def test_each_op_runs_once_per_layer_and_phase():
    for phase in ("fwd", "bwd"):
        names = decoder_layer(phase).op_names
        assert len(set(names)) == len(names)
    assert not set(DECODER_LAYER["fwd"].op_names) & set(DECODER_LAYER["bwd"].op_names)


def test_the_backward_tail_opens_the_first_segment_of_the_cycle():
    bwd = decoder_layer("bwd")
    assert bwd.tail == ("attn_norm_bwd",)
    cyc = bwd.cyclic_segments()
    assert cyc[0].op_names == ("attn_norm_bwd", *bwd.segments[0].op_names)
    assert cyc[1:] == bwd.segments[1:]
    assert decoder_layer("fwd").cyclic_segments() == decoder_layer("fwd").segments


def test_collectives_by_group_size():
    assert [c.tensor for c in layer_collectives(tp=2, cp=2)] == [
        "kv", "attn_out", "mlp_out", "mlp_in_grad", "kv_grad", "attn_in_grad"]
    assert [c.tensor for c in layer_collectives(tp=2, cp=1)] == [
        "attn_out", "mlp_out", "mlp_in_grad", "attn_in_grad"]
    assert {c.kind for c in layer_collectives(tp=1, cp=2)} == {"all_gather", "reduce_scatter"}
    assert layer_collectives(tp=1, cp=1) == ()


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (1, 2), (2, 2)])
def test_the_partition_model_costs_exactly_the_layers_ops(tp, cp, n, sp):
    wl = Workload(model=ARCH, parallelism=Parallelism(tp=tp, cp=cp, sp=sp), microbatch_size=2,
                  seq_len=64, num_microbatches=2, nanobatches=n)
    ps = build_partitions(wl)
    layout = wl.parallelism.sequence_parallel
    sizes = {"tp": tp, "cp": cp}
    for phase in ("fwd", "bwd"):
        layer = decoder_layer(phase, sp=layout)
        held = [p for p in ps if p.phase == phase]
        assert {op.name for p in held for op in p.compute_ops} == set(layer.op_names)
        # the collectives it overlaps are the layer's, by kind and group
        want = {(c.kind, c.group) for c in layer.collectives if sizes[c.group] > 1}
        assert {(p.comm_op.kind.value, p.comm_group) for p in held} == want
        # one microbatch computation runs every collective of every layer (2) once per
        # nanobatch
        running = [c for c in layer.collectives if sizes[c.group] > 1]
        assert sum(ps.counts[phase][p.name] for p in held) == len(running) * n * ARCH.layers


def test_bad_descriptions_are_refused():
    with pytest.raises(ArgumentError, match="one of"):
        LayerCollective("broadcast", "x", "tp", "qkv")
    with pytest.raises(ArgumentError, match="producer"):
        LayerSegment("s", ("qkv",), LayerCollective("all_reduce", "x", "tp", "down"))
    with pytest.raises(ArgumentError, match="phase"):
        decoder_layer("both")
    with pytest.raises(TypeError):
        DECODER_LAYER["fwd"] = DECODER_LAYER["bwd"]  # type: ignore[index]


def test_sequence_parallel_layout_has_the_same_ops_and_no_all_reduce():
    for phase in ("fwd", "bwd"):
        for qk in (False, True):
            assert (sorted(decoder_layer(phase, qk_norm=qk, sp=True).op_names)
                    == sorted(decoder_layer(phase, qk_norm=qk).op_names))
    assert decoder_layer("bwd", sp=True).tail == ()
    sp = layer_collectives(tp=2, cp=2, sp=True)
    assert [(c.kind, c.tensor) for c in sp if c.group == "tp"] == [
        ("all_gather", "attn_in"), ("reduce_scatter", "attn_out"), ("all_gather", "mlp_in"),
        ("reduce_scatter", "mlp_out"), ("reduce_scatter", "mlp_in_grad"),
        ("all_gather", "attn_out_grad"), ("reduce_scatter", "attn_in_grad"),
        ("all_gather", "mlp_out_grad")]
    # the CP collectives do not change with the TP layout
    assert ([c for c in sp if c.group == "cp"]
            == [c for c in layer_collectives(tp=2, cp=2) if c.group == "cp"])
    assert [c.group for c in layer_collectives(tp=1, cp=2, sp=True)] == ["cp", "cp"]


def test_selective_recomputation_reruns_the_attention_core_in_the_backward():
    for sp in (False, True):
        bwd = decoder_layer("bwd", sp=sp, recompute="selective")
        names = bwd.op_names
        assert names.count("attn_core") == 1
        assert names.index("attn_core") + 1 == names.index("out_dgrad")
        assert tuple(n for n in names if n != "attn_core") == decoder_layer("bwd", sp=sp).op_names
        assert decoder_layer("fwd", sp=sp, recompute="selective") == decoder_layer("fwd", sp=sp)
    assert decoder_layer("bwd", recompute="none") == decoder_layer("bwd")
    with pytest.raises(ArgumentError, match="recompute"):
        decoder_layer("bwd", recompute="attention")
