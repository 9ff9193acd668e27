"""The model's layer features (qk-norm, norm epsilon, QKV bias, tied embeddings): presets,
validation, and exactly what each adds to the op lists, the parameters and the iteration."""

from __future__ import annotations

import attrs
import pytest

from kareus.errors import WorkloadError
from kareus.model import ModelArch, OpKind, Workload, build_partitions, get_model
from kareus.model.memory import estimate_memory
from kareus.model.ops import CommKind
from kareus.model.partition import (
    ADAM_BYTES_PER_PARAM,
    PartitionSet,
    iteration_work,
    stage_params_per_rank,
)

PLAIN = ModelArch(name="plain", layers=4, hidden=1024, heads=16, kv_heads=4, head_dim=64,
                  ffn=2816, vocab=32000)
D = 2  # bf16


def _wl(model: ModelArch, **kw: object) -> Workload:
    base: dict[str, object] = dict(tp=4, cp=2, pp=2, microbatch_size=8, seq_len=2048)
    base.update(kw)
    return Workload.preset("qwen3-1.7b", **base).with_(model=model)  # type: ignore[arg-type]


def _shapes(wl: Workload) -> tuple[int, int, int]:
    """(tokens of one nanobatch on one rank, q width, kv width) per rank."""
    p, m = wl.parallelism, wl.model
    t = wl.microbatch_size // wl.nanobatches * wl.seq_len // p.cp
    return t, m.heads // p.tp * m.head_dim, m.kv_heads // p.tp * m.head_dim


def _ops(ps: PartitionSet, phase: str) -> dict[str, tuple[float, float]]:
    """Every op of a phase's partition types: name -> (FLOPs, bytes)."""
    out: dict[str, tuple[float, float]] = {}
    for part in ps:
        if part.name.startswith(phase):
            for op in part.compute_ops:
                out.setdefault(op.name, (op.flops, op.bytes_moved))
    return out


# ----------------------------------------------------------------------------- presets


def test_presets_carry_the_public_configs_features() -> None:
    q, l3, l70 = get_model("qwen3-1.7b"), get_model("llama3.2-3b"), get_model("llama3.3-70b")
    # Qwen/Qwen3-1.7B: qk-norm, rms_norm_eps 1e-6, tie_word_embeddings true, no bias.
    assert (q.qk_norm, q.norm_eps, q.tied_embeddings, q.qkv_bias) == (True, 1e-6, True, False)
    # meta-llama/Llama-3.2-3B: tie_word_embeddings true, rms_norm_eps 1e-5.
    assert (l3.qk_norm, l3.norm_eps, l3.tied_embeddings, l3.qkv_bias) == (False, 1e-5, True,
                                                                          False)
    # meta-llama/Llama-3.3-70B-Instruct: untied, rms_norm_eps 1e-5.
    assert (l70.qk_norm, l70.norm_eps, l70.tied_embeddings, l70.qkv_bias) == (False, 1e-5,
                                                                              False, False)
    # The published sizes: Qwen3-1.7B 1.7B parameters (embedding counted once), Llama 3.2
    # 3B 3.21B.
    assert q.params == 1_720_574_976 and 3.2e9 < l3.params < 3.22e9


def test_defaults_are_a_plain_llama_layer() -> None:
    assert (PLAIN.qk_norm, PLAIN.norm_eps, PLAIN.qkv_bias, PLAIN.tied_embeddings) == (
        False, 1e-5, False, False)
    ps = build_partitions(_wl(PLAIN, cp=1))
    assert [op.name for op in ps["fwd_attn"].compute_ops] == [
        "attn_norm", "qkv", "rope", "attn_core", "out_proj"]
    assert [op.name for op in ps["bwd_attn"].compute_ops][-3:] == [
        "rope_bwd", "qkv_dgrad", "qkv_wgrad"]
    # Without features the description holds no feature key (files and plans as before).
    assert set(PLAIN.to_dict()) == {"name", "layers", "hidden", "heads", "kv_heads",
                                    "head_dim", "ffn", "vocab"}


@pytest.mark.parametrize(("change", "needle"), [
    ({"qk_norm": 1}, "qk_norm must be True or False, got 1"),
    ({"qkv_bias": "yes"}, "qkv_bias must be True or False"),
    ({"tied_embeddings": None}, "tied_embeddings must be True or False"),
    ({"norm_eps": 0.0}, "norm_eps must be a number in (0, 1)"),
    ({"norm_eps": 1.0}, "norm_eps must be a number in (0, 1)"),
    ({"norm_eps": float("nan")}, "norm_eps must be a number in (0, 1)"),
    ({"norm_eps": True}, "norm_eps must be a number in (0, 1)"),
    ({"norm_eps": "1e-5"}, "norm_eps must be a number in (0, 1)"),
])
def test_features_are_validated(change: dict[str, object], needle: str) -> None:
    with pytest.raises(WorkloadError) as err:
        attrs.evolve(PLAIN, **change)  # type: ignore[arg-type]
    assert needle in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- qk-norm


def test_qk_norm_runs_fused_with_rope() -> None:
    plain, normed = _wl(PLAIN), _wl(attrs.evolve(PLAIN, qk_norm=True))
    t, q, kv = _shapes(normed)
    hd, sq = PLAIN.head_dim, normed.seq_len // normed.parallelism.cp
    a, b = build_partitions(plain), build_partitions(normed)
    # Forward: one op in RoPE's place (KernelSet.qk_norm_rope): q and k read and written,
    # the two norm weights and the cos/sin tables read; 4 FLOPs per element for the norm
    # and 3 for the rotation.
    fwd = _ops(b, "fwd")
    assert fwd["qk_norm_rope"] == (7.0 * t * (q + kv),
                                   (2 * t * (q + kv) + 2 * hd + 2 * sq * hd) * D)
    part = b["fwd_attn_in_ag"]
    assert [op.name for op in part.compute_ops] == ["attn_norm", "qkv", "qk_norm_rope"]
    assert part.comm_op == a["fwd_attn_in_ag"].comm_op
    fused = next(op for op in part.compute_ops if op.name == "qk_norm_rope")
    assert fused.kind is OpKind.ROPE and not fused.compute_bound  # memory-bound
    assert part.flops - a["fwd_attn_in_ag"].flops == pytest.approx(4 * t * (q + kv))
    # Backward (KernelSet.qk_norm_rope_bwd): dQ, dK, dV, the pre-norm q and k, the weights
    # and the tables read; dQKV and the weights' float32 gradients written.
    bwd = _ops(b, "bwd")
    assert bwd["qk_norm_rope_bwd"] == (
        12.0 * t * (q + kv),
        (2 * t * (q + 2 * kv) + t * (q + kv) + 2 * hd + 2 * sq * hd) * D + 2 * hd * 4)
    bwd_in = next(p for p in b if p.name.startswith("bwd_attn_in"))
    assert [op.name for op in bwd_in.compute_ops] == [
        "qk_norm_rope_bwd", "qkv_dgrad", "qkv_wgrad"]
    # Nothing else moved: the same ops but RoPE's, with the same costs.
    assert {k: v for k, v in _ops(a, "fwd").items() if k != "rope"} == {
        k: v for k, v in fwd.items() if k != "qk_norm_rope"}
    assert {k: v for k, v in _ops(a, "bwd").items() if k != "rope_bwd"} == {
        k: v for k, v in bwd.items() if k != "qk_norm_rope_bwd"}
    assert "rope" not in fwd and "rope_bwd" not in bwd
    # Per microbatch, recomputation included: the forward op twice (forward and the
    # backward's re-run), the backward op once, for every layer of the stage.
    diff = b.computation_flops(0, "bwd") - a.computation_flops(0, "bwd")
    per_nb = 4 * t * (q + kv) + 9 * t * (q + kv)
    assert diff == pytest.approx(per_nb * normed.nanobatches * normed.layers_per_stage)


def test_qk_norm_takes_rope_s_launch_slot() -> None:
    a = build_partitions(_wl(PLAIN))["fwd_attn_in_ag"]
    b = build_partitions(_wl(attrs.evolve(PLAIN, qk_norm=True)))["fwd_attn_in_ag"]
    # One fused memory-bound op where RoPE was: the same slots, RoPE's named after it.
    assert [s.name for s in a.slots] == ["attn_norm", "qkv", "rope"]
    assert [s.name for s in b.slots] == ["attn_norm", "qkv", "qk_norm_rope"]
    assert not b.slot("qk_norm_rope").compute_bound
    bwd = next(p for p in build_partitions(_wl(attrs.evolve(PLAIN, qk_norm=True)))
               if p.name.startswith("bwd_attn_in"))
    assert bwd.slot("qk_norm_rope_bwd").op_names == ("qk_norm_rope_bwd",)


def test_qk_norm_fused_op_under_sequence_parallelism_and_selective_recompute() -> None:
    # SP: the fused op runs on the gathered tokens (as RoPE does), not on the shard.
    sp = _wl(attrs.evolve(PLAIN, qk_norm=True), sp=True, recompute="selective")
    plain = _wl(PLAIN, sp=True, recompute="selective")
    t, q, kv = _shapes(sp)
    fa, fb = _ops(build_partitions(plain), "fwd"), _ops(build_partitions(sp), "fwd")
    assert fb["qk_norm_rope"][0] == 7.0 * t * (q + kv)
    assert fa["rope"][0] == 3.0 * t * (q + kv)
    ba = _ops(build_partitions(sp), "bwd")
    assert "qk_norm_rope_bwd" in ba and "attn_core" in ba  # the selective re-run
    assert not {"rope", "rope_bwd", "q_norm", "k_norm", "q_norm_bwd", "k_norm_bwd"} & (
        set(fb) | set(ba))


def test_qk_norm_weights_and_saved_activations() -> None:
    normed = attrs.evolve(PLAIN, qk_norm=True)
    assert normed.params - PLAIN.params == PLAIN.layers * 2 * PLAIN.head_dim
    # Without recomputation kareus's layer keeps the projection's output before the norms
    # (the fused norm-and-RoPE backward's input: q, k and v, one tensor), no statistics (the
    # backward recomputes them); under CP (here 2) one more tensor than without qk-norm,
    # without CP the QKV projection kept anyway; what it keeps is counted against this
    # figure in tests/integrations/test_layer_memory.py
    wa, wb = _wl(PLAIN, recompute=False, pp=1), _wl(normed, recompute=False, pp=1)
    extra = 2 * (16 + 2 * 4) * 64 / 4  # per token, split over TP = 4
    tokens = 8 * 2048 / 2
    layers_in_flight = wa.layers_per_stage  # one stage: one microbatch in flight
    got = estimate_memory(wb).activations_bytes - estimate_memory(wa).activations_bytes
    assert got == pytest.approx(layers_in_flight * extra * tokens)
    wa1, wb1 = (w.with_(parallelism=attrs.evolve(w.parallelism, cp=1)) for w in (wa, wb))
    assert estimate_memory(wb1).activations_bytes == estimate_memory(wa1).activations_bytes


# ----------------------------------------------------------------------------- QKV bias


def test_qkv_bias_is_added_and_reduced_in_the_gemm_epilogues() -> None:
    plain, biased = _wl(PLAIN), _wl(attrs.evolve(PLAIN, qkv_bias=True))
    t, q, kv = _shapes(biased)
    n = q + 2 * kv
    a, b = build_partitions(plain), build_partitions(biased)
    fa, fb = _ops(a, "fwd"), _ops(b, "fwd")
    # Forward: one addition per output element, the bias read.
    assert fb["qkv"][0] - fa["qkv"][0] == t * n
    assert fb["qkv"][1] - fa["qkv"][1] == n * D
    # Backward: dQKV summed over the tokens in the wgrad GEMM (one addition per element),
    # the bias gradient written; the dgrad GEMM is unchanged.
    ba, bb = _ops(a, "bwd"), _ops(b, "bwd")
    assert bb["qkv_wgrad"][0] - ba["qkv_wgrad"][0] == t * n
    assert bb["qkv_wgrad"][1] - ba["qkv_wgrad"][1] == n * D
    assert bb["qkv_dgrad"] == ba["qkv_dgrad"]
    assert {k for k in fb if fb[k] != fa[k]} == {"qkv"}
    assert {k for k in bb if bb[k] != ba[k]} == {"qkv_wgrad"}
    # No op and no slot of its own.
    assert [s.name for s in a["fwd_attn_in_ag"].slots] == \
        [s.name for s in b["fwd_attn_in_ag"].slots]
    # Its parameters: (heads + 2 kv_heads) x head_dim per layer, split over TP.
    m = biased.model
    assert m.params - PLAIN.params == PLAIN.layers * (16 + 2 * 4) * 64
    assert stage_params_per_rank(biased) - stage_params_per_rank(plain) == pytest.approx(
        biased.layers_per_stage * (16 + 2 * 4) * 64 / 4)


# ----------------------------------------------------------------------------- tied embeddings


def test_tied_embeddings_halve_the_embedding_parameters() -> None:
    tied = attrs.evolve(PLAIN, tied_embeddings=True)
    assert PLAIN.embedding_params == 2 * tied.embedding_params == 2 * 32000 * 1024
    assert PLAIN.params - tied.params == 32000 * 1024


def test_tied_embeddings_on_one_stage_shrink_the_step_and_memory() -> None:
    plain, tied = _wl(PLAIN, pp=1), _wl(attrs.evolve(PLAIN, tied_embeddings=True), pp=1)
    shared = 32000 * 1024 / 4  # one vocab x hidden matrix, split over TP = 4
    assert stage_params_per_rank(plain) - stage_params_per_rank(tied) == pytest.approx(shared)
    a, b = iteration_work(plain), iteration_work(tied)
    # The distributed optimizer's step covers 1 / (DP x CP) = 1/2 of the rank's parameters.
    assert a.ops[0].bytes_moved - b.ops[0].bytes_moved == pytest.approx(
        ADAM_BYTES_PER_PARAM * shared / 2)
    # One stage: no tied copy to keep in sync; only the gradients' reduction over CP.
    grad = ["cp_grad_reduce_scatter", "cp_param_all_gather"]
    assert [c.name for c in a.comms] == [c.name for c in b.comms] == grad
    ma, mb = estimate_memory(plain), estimate_memory(tied)
    assert ma.weights_bytes - mb.weights_bytes == pytest.approx(2 * shared)
    assert ma.optimizer_bytes - mb.optimizer_bytes == pytest.approx(12 * shared / 2)  # DP x CP = 2
    # The LM head's weight gradient goes into the embedding's: the same kernels per microbatch.
    assert build_partitions(plain).outside == build_partitions(tied).outside
    assert build_partitions(plain).types == build_partitions(tied).types


def test_tied_embeddings_across_stages_all_reduce_their_gradient() -> None:
    plain, tied = _wl(PLAIN), _wl(attrs.evolve(PLAIN, tied_embeddings=True))
    # Each end stage keeps its copy: the same parameters, the same step.
    assert stage_params_per_rank(plain) == stage_params_per_rank(tied)
    assert estimate_memory(plain) == estimate_memory(tied)
    a, b = iteration_work(plain), iteration_work(tied)
    assert a.ops == b.ops
    # Between the gradients' reduce-scatter over the CP group and the weights' all-gather.
    assert [c.name for c in a.comms] == ["cp_grad_reduce_scatter", "cp_param_all_gather"]
    assert [c.name for c in b.comms] == ["cp_grad_reduce_scatter",
                                         "embedding_grad_all_reduce", "cp_param_all_gather"]
    ar = b.comms[1]
    assert (ar.name, ar.kind, ar.group_size) == ("embedding_grad_all_reduce",
                                                 CommKind.ALL_REDUCE, 2)
    assert ar.bytes == 4 * 32000 / 4 * 1024  # fp32 gradient of one TP shard
    assert b.crosses_node(ar)  # 16 GPUs: the end stages on two nodes
    assert not b.crosses_node(b.comms[0])  # the CP group: inside its stage's node
    # Data parallelism too: the same order, over DP x CP.
    dp = iteration_work(_wl(attrs.evolve(PLAIN, tied_embeddings=True), dp=2))
    assert [c.name for c in dp.comms] == ["dp_cp_grad_reduce_scatter",
                                          "embedding_grad_all_reduce", "dp_cp_param_all_gather"]
    # A vocabulary TP does not divide: the padded shard.
    odd = _wl(attrs.evolve(PLAIN, vocab=32001, tied_embeddings=True))
    assert iteration_work(odd).comms[1].bytes == 4 * 8001 * 1024


def test_norm_eps_changes_no_work() -> None:
    a = build_partitions(_wl(PLAIN))
    b = build_partitions(_wl(attrs.evolve(PLAIN, norm_eps=1e-6)))
    assert a.types == b.types and a.outside == b.outside and a.iteration == b.iteration


def test_every_feature_together_is_the_sum_of_each() -> None:
    every = attrs.evolve(PLAIN, qk_norm=True, qkv_bias=True, tied_embeddings=True,
                         norm_eps=1e-6)
    base = build_partitions(_wl(PLAIN)).computation_flops(0, "bwd")
    one = sum(build_partitions(_wl(attrs.evolve(PLAIN, **{f: True}))).computation_flops(0, "bwd")
              - base for f in ("qk_norm", "qkv_bias", "tied_embeddings"))
    assert build_partitions(_wl(every)).computation_flops(0, "bwd") - base == pytest.approx(one)
    assert all(op.kind is OpKind.NORM for op in build_partitions(_wl(every))["fwd_attn_in_ag"]
               .compute_ops if op.name.endswith("_norm"))
