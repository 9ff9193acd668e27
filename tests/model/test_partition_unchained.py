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

import collections

import attrs
import pytest

from kareus.errors import WorkloadError
from kareus.model import Workload, build_partitions
from kareus.model.moe import MoEArch
from kareus.model.ops import CommKind
from kareus.model.workload import ModelArch, Parallelism

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


# ------------------------------------------------------------------ mixture of experts

#: A mixture-of-experts model with a shared expert (the presets have none).
SHARED_MOE = ModelArch(name="shared-moe", layers=4, hidden=1024, heads=8, kv_heads=4,
                       head_dim=128, ffn=2048, vocab=1000, qk_norm=True,
                       moe=MoEArch(experts=16, experts_per_token=2, expert_ffn=512,
                                   shared_experts=1, shared_expert_ffn=1024))

#: (name, (model, workload keywords)): EP alone, EP beside TP under sequence parallelism,
#: EP over the CP ranks with a shared expert, one expert per EP rank (no sort), and the
#: recomputation policies.
MOE_CASES = {
    "ep8-none": ("qwen3-30b-a3b", dict(tp=1, dp=8, ep=8, recompute="none")),
    "ep8-full": ("qwen3-30b-a3b", dict(tp=1, dp=8, ep=8, recompute="full")),
    "ep8-selective-n4": ("qwen3-30b-a3b", dict(tp=1, dp=8, ep=8, recompute="selective",
                                               nanobatches=4)),
    "tp2-sp-ep4-full": ("qwen3-30b-a3b", dict(tp=2, sp=True, dp=4, ep=4, recompute="full")),
    "tp2-sp-ep4-selective": ("qwen3-30b-a3b", dict(tp=2, sp=True, dp=4, ep=4,
                                                   recompute="selective")),
    "cp2-ep2-shared-full": (SHARED_MOE, dict(tp=1, cp=2, ep=2, recompute="full")),
    "ep8-one-expert-each": (attrs.evolve(SHARED_MOE, moe=attrs.evolve(SHARED_MOE.moe, experts=8)),
                            dict(tp=1, dp=8, ep=8, recompute="none")),
}


def _moe_pair(name: str) -> tuple[Workload, object, object]:
    model, kw = MOE_CASES[name]
    base = dict(microbatch_size=4, seq_len=4096, nanobatches=2)
    wl = (Workload.preset(model, **{**base, **kw}) if isinstance(model, str)
          else Workload(model=model, parallelism=Parallelism(
              **{k: kw[k] for k in ("tp", "cp", "dp", "ep") if k in kw}),
              num_microbatches=4, recompute=kw["recompute"], **base))
    return wl, build_partitions(wl), build_partitions(wl.with_(chained_layers=False))


def _work(pset, phase: str) -> tuple[collections.Counter, collections.Counter]:
    """Every op and every collective stage 0 runs in one ``phase`` computation, by name,
    in partitions (times their counts) or outside them."""
    ops: collections.Counter = collections.Counter()
    comms: collections.Counter = collections.Counter()
    for name, c in pset.counts[phase].items():
        for op in pset.types[name].compute_ops:
            ops[op.name] += c
        comms[pset.types[name].comm_op.name] += c
    outside = pset.outside[(0, phase)]
    ops.update(op.name for op in outside.ops)
    comms.update(c.name for c in outside.comms)
    return ops, comms


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_unchained_moe_layers_do_the_same_work(name):
    wl, chained, un = _moe_pair(name)
    assert not un.workload.chained_layers
    L, n = wl.layers_per_stage, wl.nanobatches
    for phase in ("fwd", "bwd"):
        a_ops, a_comms = _work(chained, phase)
        b_ops, b_comms = _work(un, phase)
        assert b_comms == a_comms, phase  # every collective, once per layer and nanobatch
        assert b_comms["ep_all_to_all"] == 2 * n * L * (2 if phase == "bwd"
                                                         and wl.recompute == "full" else 1)
        # the runtime's recomputed forward stops at the combine (the un-permutation's output
        # is read by no backward op): the chained model counts it, a planned layer does not
        # run it
        recomputed_unpermute = n * L if phase == "bwd" and wl.recompute == "full" else 0
        assert a_ops - b_ops == collections.Counter({"unpermute": recomputed_unpermute}
                                                    if recomputed_unpermute else {}), phase
        assert b_ops - a_ops == collections.Counter(), phase
        assert not {"gate", "up", "down", "swiglu"} & set(b_ops)
        # every op of the layer once per layer and nanobatch (a recomputed one included)
        layer_ops = set(b_ops) - {op.name for op in chained.outside[(0, phase)].ops}
        assert {o: b_ops[o] for o in layer_ops} == dict.fromkeys(layer_ops, n * L), phase
    unpermute = next(op for p in un for op in p.compute_ops if op.name == "unpermute")
    extra = unpermute.flops * (n * L if wl.recompute == "full" else 0)
    assert un.computation_flops(0, "fwd") == pytest.approx(chained.computation_flops(0, "fwd"),
                                                           rel=1e-12)
    assert un.computation_flops(0, "bwd") + extra == pytest.approx(
        chained.computation_flops(0, "bwd"), rel=1e-12)


@pytest.mark.parametrize("name", sorted(MOE_CASES))
def test_unchained_moe_layer_runs_its_first_piece_bare_and_its_tails_after_the_last_collective(
        name):
    wl, chained, un = _moe_pair(name)
    L = wl.layers_per_stage
    for phase in ("fwd", "bwd"):
        assert all(c % L == 0 for c in un.counts[phase].values())
        bare = [op.name for op in un.outside[(0, phase)].ops[
            len(chained.outside[(0, phase)].ops):]]
        assert len(bare) % L == 0
        per_layer = bare[:len(bare) // L]
        # the layer's first unit runs bare; its last piece (the ops after its last collective
        # that runs: the tail, and at TP = 1 the attention backward before it) runs beside
        # that collective in the first nanobatch, and bare in the later ones (after the
        # last piece of the one before, which launches no collective)
        first = "unpermute_bwd" if phase == "bwd" and wl.recompute != "full" else "attn_norm"
        assert per_layer[0] == first, (phase, per_layer)
        tail = "unpermute" if phase == "fwd" else "attn_norm_bwd"
        (last,) = [t for t in un.types.values()
                   if t.phase == phase and t.compute_ops[-1].name == tail]
        assert un.counts[phase][last.name] == L
        n = wl.nanobatches
        last_ops = [op.name for op in last.compute_ops]
        assert per_layer[len(per_layer) - (n - 1) * len(last_ops):] == last_ops * (n - 1), (
            phase, per_layer)
        assert per_layer.count(tail) == n - 1, (phase, per_layer)
        # an MoE layer exposes no collective: its last one has the last piece beside it,
        # and no output-gradient all-gather opens its backward under sequence parallelism
        assert un.outside[(0, phase)].comms == chained.outside[(0, phase)].comms


@pytest.mark.parametrize("name", ["ep8-none", "ep8-full", "tp2-sp-ep4-full",
                                  "cp2-ep2-shared-full"])
def test_emulated_unchained_moe_layers_cost_at_least_the_chain(name):
    from kareus.model import get_gpu
    from kareus.profilers import EmulatedProfiler

    gpu = get_gpu("h200-sxm")
    prof = EmulatedProfiler(gpu=gpu, noise=0.0)
    _, chained, un = _moe_pair(name)
    a, b = _emulated_time(chained, prof, gpu), _emulated_time(un, prof, gpu)
    for phase in ("fwd", "bwd"):
        # the backward under full recomputation runs one op fewer per layer (the recomputed
        # un-permutation): allow its cost
        assert b[phase] >= a[phase] * (1 - (1e-3 if phase == "bwd" else 1e-9)), (phase, a, b)
    assert b["fwd"] > a["fwd"]  # the first piece and the last tail bare in every layer
