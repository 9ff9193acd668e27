"""The adapters read a mixture-of-experts model into the MoE workload (``ModelArch.moe``,
``Parallelism.ep``) equal to the preset's, from Megatron-Core's ``TransformerConfig`` (a
duck-typed one, and the real one where Megatron-Core is installed), from Megatron-LM's flags
and from torchtitan's Qwen3 MoE configs; what kareus's MoE block does not compute is refused
in one line naming the framework's own setting; and the planned layers still refuse to run
an MoE model."""

from __future__ import annotations

import types

import attrs
import pytest

from kareus.errors import WorkloadError
from kareus.integrations._megatron_config import check_layer_config, workload_from_megatron
from kareus.integrations.megatron_args import MegatronArgsError, workload_from_megatron_args
from kareus.model.workload import Workload


def silu(x):  # named like torch.nn.functional.silu
    return x


#: Qwen/Qwen3-30B-A3B as a Megatron-Core config (the preset's model; EP 8 over 8 ranks).
QWEN3_30B_A3B = dict(
    num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
    kv_channels=128, ffn_hidden_size=6144, tensor_model_parallel_size=1,
    context_parallel_size=1, pipeline_model_parallel_size=1, recompute_granularity=None,
    gated_linear_unit=True, activation_func=silu, add_bias_linear=False,
    normalization="RMSNorm", qk_layernorm=True, sequence_parallel=False,
    layernorm_epsilon=1e-6, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
    num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
    expert_model_parallel_size=8, expert_tensor_parallel_size=1,
    moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32", moe_grouped_gemm=True,
    moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)

#: The same model as Megatron-LM flags.
QWEN3_FLAGS = (
    "--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 4 --kv-channels 128 --ffn-hidden-size 6144 --swiglu "
    "--disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-6 --qk-layernorm "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --hidden-dropout 0 "
    "--attention-dropout 0 --bf16 --seq-length 4096 --micro-batch-size 1 "
    "--global-batch-size 16 --padded-vocab-size 151936 --num-experts 128 --moe-router-topk 8 "
    "--moe-ffn-hidden-size 768 --expert-model-parallel-size 8 "
    "--moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-grouped-gemm "
    "--moe-permute-fusion --moe-aux-loss-coeff 0")


def _preset() -> Workload:
    return Workload.preset("qwen3-30b-a3b", dp=8, ep=8, microbatch_size=1, seq_len=4096,
                           num_microbatches=2, recompute="none")


def _read(**changes):
    config = types.SimpleNamespace(**{**QWEN3_30B_A3B, **changes})
    return workload_from_megatron(config, microbatch_size=1, seq_len=4096, num_microbatches=2,
                                  vocab_size=151936, dp=8, name="qwen3-30b-a3b")


def test_megatron_config_of_qwen3_30b_a3b_is_the_preset_s_workload():
    wl, want = _read(), _preset()
    assert wl.model == want.model
    assert wl.parallelism == want.parallelism
    assert wl == want.with_(nanobatches=wl.nanobatches)


def test_megatron_shared_experts_and_router_dtype_are_read():
    moe = _read(moe_shared_expert_intermediate_size=1536, moe_router_dtype=None,
                moe_ffn_hidden_size=None).model.moe
    assert (moe.shared_experts, moe.shared_expert_ffn) == (1, 1536)
    assert moe.router_dtype == "bfloat16"  # None: the model's dtype (bf16)
    assert moe.expert_ffn == 6144  # None: ffn_hidden_size, as Megatron-Core sets it
    assert _read(moe_router_dtype="fp64").model.moe.router_dtype == "float64"


@pytest.mark.parametrize("field, value, needle", [
    ("moe_token_dispatcher_type", "allgather", "moe_token_dispatcher_type='alltoall'"),
    ("moe_token_dispatcher_type", "flex", "moe_token_dispatcher_type='alltoall'"),
    ("expert_tensor_parallel_size", 2, "expert_tensor_parallel_size=1"),
    ("moe_layer_freq", 2, "moe_layer_freq=1"),
    ("moe_layer_freq", [1, 0] * 24, "moe_layer_freq=1"),
    ("moe_router_score_function", "sigmoid", "moe_router_score_function='softmax'"),
    ("moe_router_pre_softmax", True, "moe_router_pre_softmax=False"),
    ("moe_router_topk_scaling_factor", 2.5, "moe_router_topk_scaling_factor=None"),
    ("moe_aux_loss_coeff", 1e-2, "moe_aux_loss_coeff=0.0"),
    ("moe_aux_loss_coeff", [0.0, 1e-3], "moe_aux_loss_coeff=0.0"),
    ("moe_router_load_balancing_type", "sinkhorn", "not Sinkhorn"),
    ("moe_z_loss_coeff", 1e-3, "moe_z_loss_coeff=None"),
    ("moe_router_enable_expert_bias", True, "moe_router_enable_expert_bias=False"),
    ("moe_input_jitter_eps", 0.01, "moe_input_jitter_eps=None"),
    ("moe_router_force_load_balancing", True, "moe_router_force_load_balancing=False"),
    ("moe_router_num_groups", 8, "moe_router_num_groups=None"),
    ("moe_expert_capacity_factor", 1.0, "moe_expert_capacity_factor=None"),
    ("moe_pad_expert_input_to_capacity", True, "moe_pad_expert_input_to_capacity=False"),
    ("moe_apply_probs_on_input", True, "moe_apply_probs_on_input=False"),
    ("moe_latent_size", 256, "moe_latent_size=None"),
    ("moe_shared_expert_gate", True, "moe_shared_expert_gate=False"),
    ("moe_layer_recompute", True, "moe_layer_recompute=False"),
    ("overlap_moe_expert_parallel_comm", True, "overlap_moe_expert_parallel_comm=False"),
    ("cuda_graph_impl", "transformer_engine", "cuda_graph_impl='none'"),
    ("enable_cuda_graph", True, "enable_cuda_graph=False"),
])
def test_megatron_moe_settings_kareus_does_not_compute_are_refused(field, value, needle):
    with pytest.raises(WorkloadError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")) as err:
        _read(**{field: value})
    assert "\n" not in str(err.value)


def test_megatron_expert_tensor_parallel_none_is_tp():
    # None means TP's size: at TP = 2 that splits the experts, refused; at TP = 1 it is 1
    with pytest.raises(WorkloadError, match="got 2; None means TP's size"):
        _read(expert_tensor_parallel_size=None, tensor_model_parallel_size=2,
              sequence_parallel=True)
    assert _read(expert_tensor_parallel_size=None).parallelism.ep == 8


def test_megatron_ep_without_experts_is_refused():
    with pytest.raises(WorkloadError, match="expert_model_parallel_size=8 needs experts"):
        _read(num_moe_experts=None, moe_ffn_hidden_size=None)


def test_megatron_layer_checks_its_moe_config_against_the_workload():
    config = types.SimpleNamespace(**{**QWEN3_30B_A3B, "tensor_model_parallel_size": 2,
                                      "sequence_parallel": True})
    wl = _read(tensor_model_parallel_size=2, sequence_parallel=True)
    check_layer_config(config, wl.model, tp=2, ep=8)  # the same model: accepted
    with pytest.raises(WorkloadError, match="expert_model_parallel_size=8, the workload EP=4"):
        check_layer_config(config, wl.model, tp=2, ep=4)
    # the block differs: another router dtype, another top-k
    bf16 = types.SimpleNamespace(**{**vars(config), "moe_router_dtype": None})
    with pytest.raises(WorkloadError, match="mixture of experts is MoEArch") as err:
        check_layer_config(bf16, wl.model, tp=2)
    assert "router_dtype='bfloat16'" in str(err.value) and "\n" not in str(err.value)
    dense = attrs.evolve(wl.model, moe=None)
    with pytest.raises(WorkloadError, match="workload's model None"):
        check_layer_config(config, dense, tp=2)


def test_megatron_real_transformer_config_is_read_the_same():
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    fields = {**QWEN3_30B_A3B, "activation_func": F.silu}
    config = TransformerConfig(**fields)
    wl = workload_from_megatron(config, microbatch_size=1, seq_len=4096, num_microbatches=2,
                                vocab_size=151936, dp=8, name="qwen3-30b-a3b")
    assert wl.model == _preset().model and wl.parallelism.ep == 8


def test_megatron_lm_flags_are_the_preset_s_workload():
    wl = workload_from_megatron_args(QWEN3_FLAGS, dp=8, name="qwen3-30b-a3b")
    want = _preset()
    assert wl.model == want.model and wl.parallelism == want.parallelism
    assert wl.num_microbatches == 2


@pytest.mark.parametrize("add, error, needle", [
    ("--moe-aux-loss-coeff 1e-2", WorkloadError, "moe_aux_loss_coeff=0.0"),
    ("--moe-expert-capacity-factor 1.25", WorkloadError, "dropless"),
    ("--moe-router-score-function sigmoid", WorkloadError, "moe_router_score_function"),
    ("--moe-router-enable-expert-bias", WorkloadError, "moe_router_enable_expert_bias"),
    ("--moe-z-loss-coeff 1e-3", WorkloadError, "moe_z_loss_coeff"),
    ("--moe-router-num-groups 8 --moe-router-group-topk 2", WorkloadError,
     "moe_router_num_groups"),
    ("--expert-tensor-parallel-size 2", WorkloadError, "expert_tensor_parallel_size=1"),
    ("--moe-layer-freq 2", MegatronArgsError, "--moe-layer-freq 1"),
    ("--moe-layer-freq ([1]*47+[0])", MegatronArgsError, "--moe-layer-freq 1"),
    ("--moe-use-upcycling", MegatronArgsError, "does not read --moe-use-upcycling"),
])
def test_megatron_lm_moe_flags_kareus_does_not_compute_are_refused(add, error, needle):
    with pytest.raises(error, match=needle.replace("-", r"\-")) as err:
        workload_from_megatron_args(QWEN3_FLAGS + " " + add, dp=8)
    assert "\n" not in str(err.value)


def test_megatron_lm_default_dispatcher_is_refused():
    flags = QWEN3_FLAGS.replace("--moe-token-dispatcher-type alltoall", "")
    with pytest.raises(WorkloadError, match="Megatron-Core's default is 'allgather'"):
        workload_from_megatron_args(flags, dp=8)


# ------------------------------------------------------------------ torchtitan


def _qwen3_moe(flavor: str = "30B-A3B", *, balanced: bool = True):
    pytest.importorskip("torchtitan")
    qwen3 = pytest.importorskip("torchtitan.models.qwen3")
    config = qwen3.qwen3_configs[flavor](attn_backend="flex")
    if balanced:
        for layer in config.layers:
            layer.moe.load_balance_coeff = None
    return config


def _tt_workload(config, **kw):
    from kareus.integrations.torchtitan import workload_from_torchtitan

    args = dict(tp=1, microbatch_size=1, seq_len=4096, num_microbatches=2, dp=8, ep=8,
                recompute="none", name="qwen3-30b-a3b")
    return workload_from_torchtitan(config, **{**args, **kw})


def test_torchtitan_qwen3_30b_a3b_is_the_preset_s_workload():
    wl, want = _tt_workload(_qwen3_moe()), _preset()
    # torchtitan's MoE config has no dense width (no layer of an all-MoE model has one):
    # its ffn is the experts' width; every other field is the preset's
    assert wl.model.ffn == want.model.moe.expert_ffn
    assert attrs.evolve(wl.model, ffn=want.model.ffn) == want.model
    assert wl.parallelism == want.parallelism


def test_torchtitan_default_aux_loss_free_balancing_is_refused():
    with pytest.raises(WorkloadError, match="load_balance_coeff=None") as err:
        _tt_workload(_qwen3_moe("debugmodel_moe", balanced=False))
    assert "\n" not in str(err.value) and "layer 0" in str(err.value)


@pytest.mark.parametrize("change, needle", [
    (lambda r: setattr(r, "score_func", "sigmoid"), "score_func='sigmoid'"),
    (lambda r: setattr(r, "route_norm", False), "route_norm=False"),
    (lambda r: setattr(r, "route_scale", 2.5), "route_scale=1.0"),
    (lambda r: (setattr(r, "num_expert_groups", 8), setattr(r, "num_limited_groups", 2)),
     "num_expert_groups"),
    (lambda r: setattr(r, "_debug_force_load_balance", True), "moe_force_load_balance"),
])
def test_torchtitan_router_settings_kareus_does_not_compute_are_refused(change, needle):
    config = _qwen3_moe()
    change(config.layers[5].moe.router)
    with pytest.raises(WorkloadError, match=needle) as err:
        _tt_workload(config)
    assert "layer 5" in str(err.value) and "\n" not in str(err.value)


def test_torchtitan_other_dispatchers_are_refused():
    config = _qwen3_moe()
    from torchtitan.models.common.token_dispatcher import HybridEPTokenDispatcher

    routed = config.layers[0].moe.routed_experts
    routed.token_dispatcher = HybridEPTokenDispatcher.Config(
        num_experts=128, top_k=8, non_blocking_capacity_factor=1.0, hidden_dim=2048)
    with pytest.raises(WorkloadError, match="HybridEPTokenDispatcher"):
        _tt_workload(config)


def test_torchtitan_experts_split_over_tp_are_refused():
    with pytest.raises(WorkloadError, match="expert_parallel_degree > 1"):
        _tt_workload(_qwen3_moe(), tp=2, sp=True, ep=1)
    assert _tt_workload(_qwen3_moe(), tp=2, sp=True, ep=2, dp=4).parallelism.ep == 2


def test_torchtitan_planned_layers_check_the_moe_block_against_the_workload():
    from kareus.integrations.torchtitan import apply_plan

    config = _qwen3_moe()
    wl = _tt_workload(config)
    other = wl.with_(model=attrs.evolve(wl.model, moe=attrs.evolve(wl.model.moe,
                                                                   experts_per_token=4)))
    with pytest.raises(WorkloadError, match="the model's layers have moe=MoEArch") as err:
        apply_plan(config, workload=other)
    assert "\n" not in str(err.value)


def test_planned_layer_refuses_an_ep_group_that_is_not_the_workload_s():
    pytest.importorskip("torch")
    from kareus.exec.train import LoopbackGroups
    from kareus.integrations._layer import PlanApplier

    # (EP over data-parallel replicas is computed: tests/integrations/test_layer_moe.py)
    # the groups' EP group must be the workload's
    wl = Workload.preset("qwen3-30b-a3b", tp=2, sp=True, ep=2, microbatch_size=2,
                         seq_len=256)
    with pytest.raises(WorkloadError, match="expert-parallel group has 1 ranks"):
        PlanApplier(workload=wl, groups=LoopbackGroups(tp=2), eps=1e-6)
