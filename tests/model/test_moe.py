"""Mixture-of-experts layers in the model: the MoEArch value object, expert parallelism in
the workload, the MoE layer's ops (FLOPs and bytes counted by hand for a small shape), the
expert-parallel all-to-alls, the partition types they make, parameters, memory and the
per-iteration gradient reduction."""

from __future__ import annotations

import attrs
import pytest

from kareus.errors import KareusError, WorkloadError
from kareus.model import build_partitions
from kareus.model.decoder import moe_decoder_layer
from kareus.model.memory import estimate_memory
from kareus.model.moe import MoEArch
from kareus.model.ops import CommKind, ComputeOp, OpKind
from kareus.model.partition import Partition, iteration_work, stage_params_per_rank
from kareus.model.workload import ModelArch, Parallelism, Workload, get_model
from kareus.testing import PartitionConformance, check_partition

# A small MoE shape whose counts are easy to check by hand: hidden 64, 8 experts of width
# 32, top-2, router in float32.
SMALL = ModelArch(name="small-moe", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                  ffn=128, vocab=256, moe=MoEArch(experts=8, experts_per_token=2,
                                                  expert_ffn=32))


def _wl(*, tp: int = 1, dp: int = 2, ep: int = 2, sp: bool = False, rho: float = 1.0,
        model: ModelArch = SMALL, **kw: object) -> Workload:
    """Two sequences of 16 tokens per microbatch in two nanobatches: 16 tokens per
    nanobatch and rank (tp=1)."""
    return Workload(model=model, parallelism=Parallelism(tp=tp, dp=dp, ep=ep, sp=sp),
                    microbatch_size=2, seq_len=16, num_microbatches=2, nanobatches=2,
                    routing_imbalance=rho, **kw)  # type: ignore[arg-type]


def _ops(wl: Workload) -> dict[str, ComputeOp]:
    ps = build_partitions(wl)
    return {op.name: op for p in ps for op in p.compute_ops}


# ----------------------------------------------------------------------------- MoEArch


@pytest.mark.parametrize("kwargs, needle", [
    (dict(experts=8, experts_per_token=9, expert_ffn=32), "at most moe.experts"),
    (dict(experts=1, experts_per_token=1, expert_ffn=32), "moe.experts must be in 2.."),
    (dict(experts=8, experts_per_token=2, expert_ffn=0), "moe.expert_ffn must be in 1.."),
    (dict(experts=8, experts_per_token=2, expert_ffn=32, shared_experts=1),
     "both 0 or both positive"),
    (dict(experts=8, experts_per_token=2, expert_ffn=32, router_dtype="fp32"),
     "moe.router_dtype must be one of float32"),
    (dict(experts=8, experts_per_token=2.0, expert_ffn=32), "must be a whole number"),
])
def test_moe_arch_refuses_what_is_not_a_mixture_of_experts(kwargs, needle):
    with pytest.raises(WorkloadError, match=needle) as err:
        MoEArch(**kwargs)
    assert "\n" not in str(err.value)


def test_moe_arch_from_dict_names_unknown_and_missing_fields():
    with pytest.raises(WorkloadError, match="unknown field.*top_k"):
        MoEArch.from_dict({"experts": 8, "top_k": 2, "expert_ffn": 32})
    with pytest.raises(WorkloadError, match="missing expert_ffn"):
        MoEArch.from_dict({"experts": 8, "experts_per_token": 2})
    moe = MoEArch.from_dict({"experts": 8, "experts_per_token": 2, "expert_ffn": 32})
    assert moe.to_dict() == {"experts": 8, "experts_per_token": 2, "expert_ffn": 32}
    assert MoEArch.from_dict(moe.to_dict()) == moe


def test_model_round_trips_with_its_experts_and_dense_models_write_no_moe_key():
    assert ModelArch.from_dict(SMALL.to_dict()) == SMALL
    assert SMALL.to_dict()["moe"] == {"experts": 8, "experts_per_token": 2, "expert_ffn": 32}
    dense = get_model("qwen3-1.7b")
    assert "moe" not in dense.to_dict()
    wl = Workload.preset("qwen3-1.7b", tp=2)
    assert "ep" not in wl.to_dict() and "routing_imbalance" not in wl.to_dict()


def test_presets_carry_the_public_configs():
    q = get_model("qwen3-30b-a3b")
    assert (q.layers, q.hidden, q.heads, q.kv_heads, q.head_dim, q.vocab) == (
        48, 2048, 32, 4, 128, 151936)
    assert q.qk_norm and q.norm_eps == 1e-6 and not q.tied_embeddings
    assert q.moe == MoEArch(experts=128, experts_per_token=8, expert_ffn=768)
    assert 30.4e9 < q.params < 30.6e9  # "30B": 30.5 B parameters
    m = get_model("mixtral-8x7b")
    assert m.moe == MoEArch(experts=8, experts_per_token=2, expert_ffn=14336)
    assert 46.6e9 < m.params < 46.8e9  # Mixtral 8x7B: 46.7 B parameters


# ----------------------------------------------------------------------------- workload


@pytest.mark.parametrize("kwargs, needle", [
    (dict(ep=3, dp=3), "ep=3 does not divide the 8 experts"),
    (dict(ep=16, dp=16, model=attrs.evolve(SMALL, moe=MoEArch(experts=16, experts_per_token=2,
                                                              expert_ffn=32))),
     "across nodes is not modelled"),
    (dict(ep=6, dp=6, model=attrs.evolve(SMALL, moe=MoEArch(experts=12, experts_per_token=2,
                                                            expert_ffn=32))),
     "use an ep that divides 8"),
    (dict(tp=2, ep=2, dp=1), "needs sequence parallelism"),
    (dict(rho=2.5), r"routing_imbalance must be a number in \[1, ep\] = \[1, 2\]"),
    (dict(rho=0.5), "routing_imbalance must be"),
    (dict(ep=2, model=attrs.evolve(SMALL, moe=None)), "ep=2 needs a mixture-of-experts"),
    (dict(model=attrs.evolve(SMALL, moe=MoEArch(experts=8, experts_per_token=2, expert_ffn=32,
                                                layer_step=2))),
     "moe.layer_step=2 .* is not costed yet"),
    (dict(tp=2, sp=True, ep=2, dp=1,
          model=attrs.evolve(SMALL, moe=MoEArch(experts=8, experts_per_token=2, expert_ffn=32,
                                                shared_experts=1, shared_expert_ffn=32))),
     "shared experts at TP=2 are not modelled"),
])
def test_workload_refuses_expert_parallelism_it_does_not_model(kwargs, needle):
    with pytest.raises(WorkloadError, match=needle) as err:
        _wl(**kwargs)
    assert "\n" not in str(err.value)


def test_ep_divides_tp_cp_dp():
    with pytest.raises(WorkloadError, match="ep=4 must divide tp x cp x dp = 2"):
        Parallelism(dp=2, ep=4)
    assert Parallelism(tp=2, dp=2, ep=4, sp=True).world_size == 4  # EP folds in


def test_workload_round_trips_ep_and_imbalance():
    wl = _wl(rho=1.5)
    back = Workload.from_dict(wl.to_dict())
    assert back == wl and back.parallelism.ep == 2 and back.routing_imbalance == 1.5
    assert "EP=2" in wl.describe() and "imbalance=1.5" in wl.describe()


# ----------------------------------------------------------------------------- ops


def test_moe_ops_counted_by_hand():
    # 16 tokens per nanobatch and rank, top-2: 32 rows sent; balanced, 32 received over
    # 8 / 2 = 4 local experts: 8 rows per expert.
    ops = _ops(_wl())
    t, h, k, E, fe, L, r, d, rd = 16, 64, 2, 8, 32, 4, 32, 2, 4
    router = ops["router"]
    assert router.kind is OpKind.GEMM
    assert router.flops == 2 * t * h * E
    assert router.bytes_moved == t * h * d + (h * E + t * E) * rd
    assert ops["router_topk"].bytes_moved == 2 * t * E * rd + t * k * (rd + 8)
    assert ops["permute"].bytes_moved == (t + t * k) * h * d + t * k * 8
    gu = ops["expert_gate_up"]
    assert gu.flops == 2 * r * h * 2 * fe
    assert gu.bytes_moved == (r * h + r * 2 * fe + L * h * 2 * fe) * d
    assert gu.grouped and gu.group_rows == r / L == 8
    down = ops["expert_down"]
    assert down.flops == 2 * r * fe * h
    assert down.bytes_moved == (r * fe + r * h + L * fe * h) * d
    assert ops["expert_swiglu"].bytes_moved == 3 * r * fe * d
    assert ops["expert_sort"].bytes_moved == ops["expert_unsort"].bytes_moved == 2 * r * h * d
    assert ops["unpermute"].bytes_moved == (t * k * h + t * h) * d + t * k * rd
    # backward: each grouped GEMM's data and weight gradient has its forward's FLOPs
    assert ops["expert_down_dgrad"].flops == ops["expert_down_wgrad"].flops == down.flops
    assert ops["expert_gate_up_dgrad"].flops == ops["expert_gate_up_wgrad"].flops == gu.flops
    assert ops["router_dgrad"].flops == ops["router_wgrad"].flops == router.flops
    # the routed experts' forward FLOPs: 6 x rows x hidden x expert width
    assert gu.flops + down.flops == 6 * r * h * fe
    # no dense MLP op in an MoE layer
    assert not {"gate", "up", "swiglu", "down", "down_dgrad", "up_wgrad"} & set(ops)


def test_imbalance_scales_the_busiest_ranks_rows_and_tokens_per_expert():
    balanced, skewed = _ops(_wl()), _ops(_wl(rho=1.5))
    assert skewed["expert_gate_up"].group_rows == 1.5 * 8
    assert skewed["expert_down"].flops == pytest.approx(1.5 * balanced["expert_down"].flops)
    # the router and permutation run on the rank's own tokens: unchanged
    assert skewed["router"] == balanced["router"]
    assert skewed["permute"] == balanced["permute"]


def test_ep_all_to_all_bytes():
    for rho in (1.0, 1.5):
        ps = build_partitions(_wl(rho=rho))
        comms = {p.comm_op for p in ps if p.comm_op.kind is CommKind.ALL_TO_ALL}
        assert len(comms) == 1
        (a2a,) = comms
        # tokens x top-k x hidden x dtype (x imbalance: the busiest rank's rows) per rank,
        # (EP-1)/EP of it over the links
        assert a2a.bytes == rho * 16 * 2 * 64 * 2
        assert a2a.bus_bytes == a2a.bytes * (2 - 1) / 2
        assert a2a.group_size == 2


def test_no_sort_with_one_expert_per_rank_and_shared_experts_beside_the_dispatch():
    one = attrs.evolve(SMALL, moe=MoEArch(experts=2, experts_per_token=1, expert_ffn=32,
                                          shared_experts=2, shared_expert_ffn=16))
    ops = _ops(_wl(model=one))
    assert "expert_sort" not in ops and "expert_unsort_bwd" not in ops
    t, h, fs, d = 16, 64, 32, 2
    assert ops["shared_gate"].flops == 2 * t * h * fs
    assert ops["shared_down"].bytes_moved == (t * fs + t * h + fs * h) * d
    # the unpermutation adds the shared experts' output
    assert ops["unpermute"].bytes_moved == (t * 1 * h + 2 * t * h) * d + t * 1 * 4
    fwd = moe_decoder_layer("fwd", shared_experts=True, sort_tokens=False)
    experts = fwd.segments[-1]
    assert experts.op_names[:4] == ("shared_gate", "shared_up", "shared_swiglu", "shared_down")
    assert experts.collective.tensor == "combine"


def test_sequence_parallel_moe_routes_the_shard():
    ops = _ops(_wl(tp=2, sp=True, ep=2, dp=1))
    # 32 tokens per microbatch, 16 per nanobatch; the TP=2 shard: 8 tokens routed
    assert ops["router"].flops == 2 * 8 * 64 * 8
    assert ops["expert_gate_up"].group_rows == 8 * 2 / 4


# ----------------------------------------------------------------------------- partitions


def test_partition_types_of_an_moe_layer_are_stable():
    assert build_partitions(_wl()).names == [
        "fwd_attn_moe_route", "fwd_moe_experts", "bwd_attn_moe_unpermute", "bwd_moe_experts"]
    sp = build_partitions(_wl(tp=2, sp=True, ep=2, dp=1))
    assert sp.names == [
        "fwd_attn_norm_ag", "fwd_attn_ag", "fwd_attn_rs", "fwd_moe_route_rs",
        "fwd_moe_route_a2a", "fwd_moe_experts", "fwd_attn_norm_a2a", "bwd_moe_unpermute",
        "bwd_moe_experts", "bwd_moe_route_a2a", "bwd_moe_route_ag", "bwd_attn_ag",
        "bwd_attn_rs", "fwd_attn_norm_rs"]
    dispatch = sp["fwd_moe_route_a2a"]
    assert dispatch.comm_op.kind is CommKind.ALL_TO_ALL and dispatch.comm_group == "ep"
    assert dispatch.group_gpus == 2  # the measurement's scope: the stage's TP x CP GPUs


def test_every_moe_op_is_in_one_partition_per_nanobatch_and_phase():
    # Without recomputation, each forward op runs once per nanobatch and layer: the
    # instance counts add up to 2 nanobatches x 2 layers for every op.
    wl = _wl(recompute="none")
    ps = build_partitions(wl)
    per_op: dict[str, int] = {}
    for name, count in ps.counts["fwd"].items():
        for op in ps[name].compute_ops:
            per_op[op.name] = per_op.get(op.name, 0) + count
    assert set(per_op.values()) == {4}
    assert {"router", "expert_gate_up", "unpermute", "attn_core"} <= set(per_op)


def test_expert_parallelism_alone_has_collectives_to_plan():
    ps = build_partitions(_wl(ep=2, dp=2))
    assert all(p.comm_op.kind is CommKind.ALL_TO_ALL for p in ps)
    with pytest.raises(WorkloadError, match=r"or expert parallelism \(ep >= 2\)"):
        build_partitions(_wl(ep=1, dp=2))


# ----------------------------------------------------------------------------- params


def test_experts_are_split_over_ep_and_reduced_over_the_expert_data_parallel_group():
    wl = _wl(ep=2, dp=4)
    h = 64
    experts_per_rank = 2 * 4 * 3 * h * 32  # 2 layers x 4 local experts
    dense_wl = _wl(ep=1, dp=4)
    assert (stage_params_per_rank(dense_wl) - stage_params_per_rank(wl)
            == experts_per_rank)  # EP=1 holds all 8 experts: twice as many
    work = iteration_work(wl)
    by_name = {c.name: c for c in work.comms}
    n = stage_params_per_rank(wl)
    assert by_name["dp_grad_reduce_scatter"].bytes == int(4 * (n - experts_per_rank))
    assert by_name["dp_grad_reduce_scatter"].group_size == 4
    assert by_name["edp_grad_reduce_scatter"].bytes == int(4 * experts_per_rank)
    assert by_name["edp_grad_reduce_scatter"].group_size == 2  # tp x cp x dp / ep
    (step,) = work.ops
    assert step.bytes_moved == pytest.approx(
        30.0 * ((n - experts_per_rank) / 4 + experts_per_rank / 2))


def test_the_dense_parameters_are_reduced_over_dp_x_cp():
    # Megatron-Core reduces the non-expert gradients over its dp_cp group and the experts'
    # over the expert-data-parallel group (tp x cp x dp / ep ranks, which holds CP already).
    h = 64
    experts_per_rank = 2 * 4 * 3 * h * 32  # 2 layers x 4 local experts (EP = 2)
    for dp, names in [(2, ["dp_cp_grad_reduce_scatter", "edp_grad_reduce_scatter",
                           "dp_cp_param_all_gather", "edp_param_all_gather"]),
                      (1, ["cp_grad_reduce_scatter", "cp_param_all_gather"])]:  # edp of 1
        wl = Workload(model=SMALL, parallelism=Parallelism(cp=2, dp=dp, ep=2),
                      microbatch_size=2, seq_len=16, num_microbatches=2, nanobatches=2)
        work = iteration_work(wl)
        n = stage_params_per_rank(wl)
        assert [c.name for c in work.comms] == names
        dense = work.comms[0]
        assert (dense.bytes, dense.group_size) == (int(4 * (n - experts_per_rank)), 2 * dp)
        edp = 2 * dp // 2
        (step,) = work.ops
        assert step.bytes_moved == pytest.approx(
            30.0 * ((n - experts_per_rank) / (2 * dp) + experts_per_rank / edp))
        mem = estimate_memory(wl)
        assert mem.optimizer_bytes == pytest.approx(step.bytes_moved / 30.0 * 12)


def test_memory_counts_the_ranks_experts_only():
    full = estimate_memory(Workload.preset("qwen3-30b-a3b", dp=8, ep=8, microbatch_size=4))
    one = estimate_memory(Workload.preset("qwen3-30b-a3b", dp=8, ep=1, microbatch_size=4))
    assert full.weights_bytes < one.weights_bytes / 4
    assert full.total_bytes < 141 * 1024**3  # fits an H200 at EP=8


def test_errors_are_kareus_errors():
    with pytest.raises(KareusError):
        _wl(ep=3, dp=3)


def test_model_flops_are_the_mean_ranks_under_imbalance():
    balanced = build_partitions(_wl()).model_flops_per_gpu_iteration()
    skewed = build_partitions(_wl(rho=1.5))
    assert skewed.model_flops_per_gpu_iteration() == balanced
    # while the busiest rank's partitions do more
    assert (skewed["fwd_moe_experts"].flops
            > build_partitions(_wl())["fwd_moe_experts"].flops)


def test_selective_recomputation_and_context_parallelism_with_experts():
    ps = build_partitions(_wl(recompute="selective"))
    ops = [o.name for o in ps["bwd_attn_moe_unpermute"].compute_ops]
    assert ops.index("attn_core") == ops.index("out_dgrad") - 1  # recomputed before it
    cp = Workload(model=SMALL, parallelism=Parallelism(cp=2, dp=1, ep=2), microbatch_size=2,
                  seq_len=16, num_microbatches=2, nanobatches=2)
    names = build_partitions(cp).names
    assert names == ["fwd_attn_in_ag", "fwd_attn_out_moe_route_ag",
                     "fwd_attn_out_moe_route_a2a", "fwd_moe_experts", "fwd_attn_in_a2a",
                     "bwd_attn_in_moe_unpermute", "bwd_moe_experts", "bwd_attn_out_a2a",
                     "bwd_attn_out_rs", "fwd_attn_in_rs"]
    # CP splits the sequence: each rank routes its 8 of the nanobatch's 16 tokens
    router = next(o for o in build_partitions(cp)["fwd_attn_out_moe_route_a2a"].compute_ops
                  if o.name == "router")
    assert router.flops == 2 * 8 * 64 * 8


def test_a_whole_imbalance_is_the_same_workload_as_its_float():
    assert _wl(rho=1) == _wl(rho=1.0)
    assert isinstance(_wl(rho=2).routing_imbalance, float)
    with pytest.raises(WorkloadError, match="routing_imbalance"):
        _wl(rho=True)  # type: ignore[arg-type]


class TestMoEPartitionConformance(PartitionConformance):
    """An expert-parallel partition: the all-to-all's 8 ranks span DP replicas, so its
    scope (one stage's TP x CP GPUs) does not hold the collective's group."""

    def make_partition(self) -> Partition:
        wl = Workload.preset("qwen3-30b-a3b", dp=8, ep=8, microbatch_size=2, seq_len=1024)
        part = build_partitions(wl)["fwd_moe_experts"]
        assert part.group_gpus == 1 and part.comm_op.group_size == 8
        return part


def test_every_built_moe_partition_conforms():
    for kw in (dict(dp=8, ep=8), dict(tp=2, sp=True, dp=4, ep=8), dict(cp=2, dp=4, ep=8)):
        wl = Workload.preset("qwen3-30b-a3b", microbatch_size=2, seq_len=1024, **kw)
        for part in build_partitions(wl):
            check_partition(lambda part=part: part)


def test_the_scope_exception_is_the_expert_parallel_group_only():
    part = build_partitions(_wl())["fwd_moe_experts"]
    not_ep = attrs.evolve(part, comm_group="tp")
    with pytest.raises(AssertionError, match="must be an int that includes the collective"):
        check_partition(lambda: not_ep)


def test_unchained_moe_layers_are_costed_from_the_moe_layer():
    # each layer its own planned layer: the pieces are the MoE layer's (router, experts,
    # all-to-alls, the forward's un-permutation after the combine), never the dense MLP's
    # (tests/model/test_partition_unchained.py checks the counts and the work)
    wl = _wl(chained_layers=False)
    ps = build_partitions(wl)
    names = {op.name for p in ps for op in p.compute_ops} | {
        op.name for work in ps.outside.values() for op in work.ops}
    assert {"router", "expert_gate_up", "unpermute", "unpermute_bwd"} <= names
    assert not names & {"gate", "up", "down", "swiglu"}
    assert {p.comm_op.kind for p in ps} == {CommKind.ALL_TO_ALL}
