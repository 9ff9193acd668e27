"""build_partitions for layers run one by one (``Workload.chained_layers=False``).

Each layer is its own planned layer: nothing overlaps across a layer boundary, so per layer
its first unit runs bare and its last collective (and, under sequence parallelism, the
backward's opening all-gathers of the output gradient's first nanobatches) runs exposed;
the rest pairs as the chain does. The counts, the outside work that holds the bare
computation and the exposed collectives, the work conserved, the file format, and the
emulated cost (unchained >= chained) are checked here; the runtime's agreement with these
counts is tests/integrations/test_layer_unchained.py.
"""

from __future__ import annotations

import pytest

from kareus.errors import WorkloadError
from kareus.model import Workload, build_partitions
from kareus.model.ops import CommKind

#: (name, workload keywords) over the layouts and policies the builder knows.
CASES = {
    "tp4-cp2-full": dict(tp=4, cp=2, pp=2, microbatch_size=16, seq_len=4096),
    "tp2-none": dict(tp=2, recompute="none"),
    "tp2-selective-n4": dict(tp=2, recompute="selective", nanobatches=4),
    "tp2-full": dict(tp=2, recompute="full"),
    "tp2-sp-none": dict(tp=2, sp=True, recompute="none"),
    "tp2-sp-full-n4": dict(tp=2, sp=True, recompute="full", nanobatches=4),
    "tp2-seqsplit": dict(tp=2, microbatch_size=1, nanobatches=4, recompute="selective"),
    "tp1-cp2-none": dict(tp=1, cp=2, recompute="none"),
    "tp2-cp2-sp-full": dict(tp=2, cp=2, sp=True, recompute="full"),
}


def _pair(name: str) -> tuple[Workload, object, object]:
    wl = Workload.preset("qwen3-1.7b", **CASES[name])
    return wl, build_partitions(wl), build_partitions(wl.with_(chained_layers=False))


def test_chained_is_the_default_and_the_file_format_keeps_old_descriptions():
    wl = Workload.preset("qwen3-1.7b", tp=2)
    assert wl.chained_layers
    assert "chained_layers" not in wl.to_dict()  # every description written so far
    un = wl.with_(chained_layers=False)
    assert un.to_dict()["chained_layers"] is False
    assert Workload.from_dict(un.to_dict()) == un
    assert Workload.from_dict(wl.to_dict()) == wl
    assert "unchained layers" in un.describe() and "unchained" not in wl.describe()
    with pytest.raises(WorkloadError, match="chained_layers"):
        wl.with_(chained_layers="no")


@pytest.mark.parametrize("name", sorted(CASES))
def test_unchained_layers_do_the_same_work(name):
    wl, chained, un = _pair(name)
    for phase in ("fwd", "bwd"):
        for stage in range(wl.parallelism.pp):
            a = chained.computation_flops(stage, phase)
            b = un.computation_flops(stage, phase)
            assert b == pytest.approx(a, rel=1e-12), (phase, stage)
    assert un.model_flops_per_gpu_iteration() == pytest.approx(
        chained.model_flops_per_gpu_iteration(), rel=1e-12)


def test_per_layer_the_first_unit_runs_bare_and_the_last_collective_exposed():
    # TP=2, no SP: forward attn | all-reduce, mlp | all-reduce, 2 nanobatches. Chained,
    # the attention segment's first nanobatch overlaps the layer below's last all-reduce;
    # unchained it runs bare, and the layer's last all-reduce runs exposed.
    wl, chained, un = _pair("tp2-none")
    L, n = wl.layers_per_stage, wl.nanobatches
    assert chained.counts["fwd"] == {"fwd_attn": n * L, "fwd_mlp": n * L}
    assert un.counts["fwd"] == {"fwd_attn": (n - 1) * L, "fwd_mlp": n * L}
    extra = un.outside[(0, "fwd")].comms[len(chained.outside[(0, "fwd")].comms):]
    assert [c.kind for c in extra] == [CommKind.ALL_REDUCE] * L
    assert all(c.bytes == un.types["fwd_attn"].comm_op.bytes for c in extra)
    bare = un.outside[(0, "fwd")].ops[len(chained.outside[(0, "fwd")].ops):]
    assert [op.name for op in bare] == [op.name for op in un.types["fwd_attn"].compute_ops] * L
    # backward: the MLP segment's first nanobatch runs bare, the input norm's backward of
    # the first overlaps the last all-reduce, the others run bare; nothing exposed
    assert un.counts["bwd"]["bwd_attn_norm"] == L
    assert un.counts["bwd"]["bwd_mlp"] == (n - 1) * L
    assert len(un.outside[(0, "bwd")].comms) == len(chained.outside[(0, "bwd")].comms)
    assert [op.name for op in un.types["bwd_attn_norm"].compute_ops] == ["attn_norm_bwd"]


def test_under_sequence_parallelism_the_backward_opens_with_exposed_all_gathers():
    wl, chained, un = _pair("tp2-sp-full-n4")
    L, n = wl.layers_per_stage, wl.nanobatches
    extra = un.outside[(0, "bwd")].comms[len(chained.outside[(0, "bwd")].comms):]
    # the output gradient's all-gather of nanobatches 0 .. n-2 has no op beside it
    assert [c.kind for c in extra] == [CommKind.ALL_GATHER] * ((n - 1) * L)
    extra = un.outside[(0, "fwd")].comms[len(chained.outside[(0, "fwd")].comms):]
    assert [c.kind for c in extra] == [CommKind.REDUCE_SCATTER] * L


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_type_pairs_a_layer_s_first_unit_with_another_layer_s_collective(name):
    wl, chained, un = _pair(name)
    # every unchained type is a piece of one layer beside a collective of the same layer:
    # unchained, the types whose ops open a layer's computation are fewer per layer
    L = wl.layers_per_stage
    for phase in ("fwd", "bwd"):
        assert all(c % L == 0 for c in un.counts[phase].values())
        assert sum(un.counts[phase].values()) <= sum(chained.counts[phase].values())


def test_one_nanobatch_is_the_same_either_way():
    for name in sorted(CASES):
        wl = Workload.preset("qwen3-1.7b", **{**CASES[name], "nanobatches": 1,
                                              "microbatch_size": 8})
        a, b = build_partitions(wl), build_partitions(wl.with_(chained_layers=False))
        assert a.counts == b.counts and a.outside == b.outside, name


def test_full_recomputation_at_tp1_unchained_is_refused():
    wl = Workload.preset("qwen3-1.7b", tp=1, cp=2, recompute="full", chained_layers=False)
    with pytest.raises(WorkloadError, match="chained_layers=False"):
        build_partitions(wl)


def _emulated_time(pset, profiler, gpu) -> dict[str, float]:
    """Per phase: the fastest microbatch computation of stage 0 at the maximum clock,
    each type at its fastest configuration of kareus's space there (every launch slot and
    sequential, SM counts 4 .. 32), outside work included."""
    from kareus.model import ConfigSpace

    f = gpu.max_clock_mhz
    best: dict[str, float] = {}
    out = {}
    for phase in ("fwd", "bwd"):
        t = 0.0
        for name, c in pset.counts[phase].items():
            if name not in best:
                space = ConfigSpace(pset.types[name], gpu, freqs_mhz=(f,),
                                    comm_sms=(4, 8, 16, 24, 32))
                best[name] = min(profiler.measure(pset.types[name], cfg).time_s
                                 for cfg in space.configs)
            t += c * best[name]
        t += profiler.measure_outside(pset.outside[(0, phase)], f,
                                      group_size=pset.workload.parallelism.tp
                                      * pset.workload.parallelism.cp).time_s
        out[phase] = t
    return out


@pytest.mark.parametrize("name", ["tp2-none", "tp2-sp-full-n4", "tp4-cp2-full"])
def test_emulated_unchained_layers_cost_at_least_the_chain(name):
    from kareus.model import get_gpu
    from kareus.profilers import EmulatedProfiler

    gpu = get_gpu("a100-40gb")
    prof = EmulatedProfiler(gpu=gpu, noise=0.0)
    _, chained, un = _pair(name)
    a, b = _emulated_time(chained, prof, gpu), _emulated_time(un, prof, gpu)
    for phase in ("fwd", "bwd"):
        assert b[phase] >= a[phase] * (1 - 1e-9), (phase, a, b)
    assert b["fwd"] > a["fwd"]  # the exposed last collective of every layer
