"""The adapters refuse mixture-of-experts models in one line: Megatron-Core's
``num_moe_experts`` (a duck-typed config), torchtitan's Qwen3 MoE configs (the real ones,
where torchtitan is installed), and kareus's planned layer given an MoE workload."""

from __future__ import annotations

import types

import pytest

from kareus.errors import WorkloadError
from kareus.integrations._megatron_config import workload_from_megatron
from kareus.model.workload import Workload


def silu(x):  # named like torch.nn.functional.silu
    return x


def test_megatron_num_moe_experts_is_refused():
    config = types.SimpleNamespace(
        num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
        kv_channels=None, ffn_hidden_size=512, tensor_model_parallel_size=2,
        context_parallel_size=1, pipeline_model_parallel_size=1, recompute_granularity=None,
        gated_linear_unit=True, activation_func=silu, add_bias_linear=False,
        normalization="RMSNorm", qk_layernorm=False, sequence_parallel=True,
        num_moe_experts=8, moe_router_topk=2, expert_model_parallel_size=2,
        layernorm_epsilon=1e-5, multi_latent_attention=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True)
    with pytest.raises(WorkloadError, match="set num_moe_experts=None") as err:
        workload_from_megatron(config, microbatch_size=2, seq_len=128, num_microbatches=2,
                               vocab_size=1000)
    assert "not run in Megatron-Core yet" in str(err.value)


@pytest.mark.parametrize("flavor", ["debugmodel_moe", "30B-A3B"])
def test_torchtitan_qwen3_moe_is_refused(flavor):
    pytest.importorskip("torchtitan")
    qwen3 = pytest.importorskip("torchtitan.models.qwen3")
    from kareus.integrations.torchtitan import workload_from_torchtitan

    config = qwen3.qwen3_configs[flavor](attn_backend="flex")
    with pytest.raises(WorkloadError, match="is a mixture of experts") as err:
        workload_from_torchtitan(config, tp=2, microbatch_size=2, seq_len=64,
                                 num_microbatches=2)
    assert "\n" not in str(err.value)


def test_planned_layer_refuses_an_moe_workload():
    pytest.importorskip("torch")
    from kareus.exec.train import LoopbackGroups
    from kareus.integrations._layer import PlanApplier

    wl = Workload.preset("qwen3-30b-a3b", dp=2, ep=2, microbatch_size=2, seq_len=256)
    with pytest.raises(WorkloadError, match="kareus's planned layer does not compute moe"):
        PlanApplier(workload=wl, groups=LoopbackGroups(tp=1))
