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


def test_qk_norm_adds_per_head_norms_before_rope() -> None:
    plain, normed = _wl(PLAIN), _wl(attrs.evolve(PLAIN, qk_norm=True))
    t, q, kv = _shapes(normed)
    a, b = build_partitions(plain), build_partitions(normed)
    # Forward: q_norm and k_norm read and write q and k (2 elements moved per element,
    # 2 FLOPs per element moved), between the QKV GEMM and RoPE.
    fwd = _ops(b, "fwd")
    assert fwd["q_norm"] == (2.0 * 2 * t * q, 2 * t * q * D)
    assert fwd["k_norm"] == (2.0 * 2 * t * kv, 2 * t * kv * D)
    part = b["fwd_attn_in_ag"]
    names = [op.name for op in part.compute_ops]
    assert names == ["attn_norm", "qkv", "q_norm", "k_norm", "rope"]
    assert part.compute_bytes - a["fwd_attn_in_ag"].compute_bytes == pytest.approx(
        2 * t * (q + kv) * D)
    assert part.flops - a["fwd_attn_in_ag"].flops == pytest.approx(4 * t * (q + kv))
    # Backward: read the gradient and the saved input, write the input's gradient.
    bwd = _ops(b, "bwd")
    assert bwd["q_norm_bwd"] == (3.0 * 3 * t * q, 3 * t * q * D)
    assert bwd["k_norm_bwd"] == (3.0 * 3 * t * kv, 3 * t * kv * D)
    bwd_in = next(p for p in b if p.name.startswith("bwd_attn_in"))
    assert [op.name for op in bwd_in.compute_ops] == [
        "rope_bwd", "q_norm_bwd", "k_norm_bwd", "qkv_dgrad", "qkv_wgrad"]
    # Nothing else moved.
    assert {k: v for k, v in _ops(a, "fwd").items()} == {
        k: v for k, v in fwd.items() if k not in ("q_norm", "k_norm")}
    assert _ops(a, "bwd") == {k: v for k, v in bwd.items()
                              if k not in ("q_norm_bwd", "k_norm_bwd")}
    # Per microbatch, recomputation included: forward norms twice (forward and the
    # backward's re-run), backward norms once, for every layer of the stage.
    diff = b.computation_flops(0, "bwd") - a.computation_flops(0, "bwd")
    per_nb = 4 * t * (q + kv) + 9 * t * (q + kv)
    assert diff == pytest.approx(per_nb * normed.nanobatches * normed.layers_per_stage)


def test_qk_norm_shares_rope_s_launch_slot() -> None:
    a = build_partitions(_wl(PLAIN))["fwd_attn_in_ag"]
    b = build_partitions(_wl(attrs.evolve(PLAIN, qk_norm=True)))["fwd_attn_in_ag"]
    # Consecutive memory-bound ops share one slot, named after its first op: no new slot.
    assert [s.name for s in a.slots] == ["attn_norm", "qkv", "rope"]
    assert [s.name for s in b.slots] == ["attn_norm", "qkv", "q_norm"]
    assert b.slot("q_norm").op_names == ("q_norm", "k_norm", "rope")
    assert not b.slot("q_norm").compute_bound
    bwd = next(p for p in build_partitions(_wl(attrs.evolve(PLAIN, qk_norm=True)))
               if p.name.startswith("bwd_attn_in"))
    assert bwd.slot("rope_bwd").op_names == ("rope_bwd", "q_norm_bwd", "k_norm_bwd")


def test_qk_norm_weights_and_saved_activations() -> None:
    normed = attrs.evolve(PLAIN, qk_norm=True)
    assert normed.params - PLAIN.params == PLAIN.layers * 2 * PLAIN.head_dim
    # Without recomputation kareus's layer keeps the projection's output before the norms
    # (their input: q, k and v, one tensor), no statistics (the norms' backward recomputes
    # them); what it keeps is counted against this figure in
    # tests/integrations/test_layer_memory.py
    wa, wb = _wl(PLAIN, recompute=False, pp=1), _wl(normed, recompute=False, pp=1)
    extra = 2 * (16 + 2 * 4) * 64 / 4  # per token, split over TP = 4
    tokens = 8 * 2048 / 2
    layers_in_flight = wa.layers_per_stage  # one stage: one microbatch in flight
    got = estimate_memory(wb).activations_bytes - estimate_memory(wa).activations_bytes
    assert got == pytest.approx(layers_in_flight * extra * tokens)


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
    assert a.ops[0].bytes_moved - b.ops[0].bytes_moved == pytest.approx(
        ADAM_BYTES_PER_PARAM * shared)
    assert a.comms == b.comms == ()  # one stage: nothing to keep in sync
    ma, mb = estimate_memory(plain), estimate_memory(tied)
    assert ma.weights_bytes - mb.weights_bytes == pytest.approx(2 * shared)
    assert ma.optimizer_bytes - mb.optimizer_bytes == pytest.approx(12 * shared)
    # The LM head's weight gradient goes into the embedding's: the same kernels per microbatch.
    assert build_partitions(plain).outside == build_partitions(tied).outside
    assert build_partitions(plain).types == build_partitions(tied).types


def test_tied_embeddings_across_stages_all_reduce_their_gradient() -> None:
    plain, tied = _wl(PLAIN), _wl(attrs.evolve(PLAIN, tied_embeddings=True))
    # Each end stage keeps its copy: the same parameters, the same step.
    assert stage_params_per_rank(plain) == stage_params_per_rank(tied)
    assert estimate_memory(plain) == estimate_memory(tied)
    a, b = iteration_work(plain), iteration_work(tied)
    assert a.ops == b.ops and a.comms == ()
    (ar,) = b.comms
    assert (ar.name, ar.kind, ar.group_size) == ("embedding_grad_all_reduce",
                                                 CommKind.ALL_REDUCE, 2)
    assert ar.bytes == 4 * 32000 / 4 * 1024  # fp32 gradient of one TP shard
    assert b.comms_cross_node  # 16 GPUs: the end stages on two nodes
    # Data parallelism: between the gradients' reduce-scatter and the weights' all-gather.
    dp = iteration_work(_wl(attrs.evolve(PLAIN, tied_embeddings=True), dp=2))
    assert [c.name for c in dp.comms] == ["dp_grad_reduce_scatter", "embedding_grad_all_reduce",
                                          "dp_param_all_gather"]
    # A vocabulary TP does not divide: the padded shard.
    odd = _wl(attrs.evolve(PLAIN, vocab=32001, tied_embeddings=True))
    assert iteration_work(odd).comms[0].bytes == 4 * 8001 * 1024


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
