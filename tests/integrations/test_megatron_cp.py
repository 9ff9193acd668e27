"""kareus.integrations.megatron at TP=2 x CP=2 against Megatron-Core's own layers (CPU, gloo,
four processes), for Qwen3's layer (``qk_layernorm=True``, ``layernorm_epsilon=1e-6``, tied
embeddings).

Megatron-Core runs context parallelism only in Transformer Engine's attention (its local
``DotProductAttention`` refuses ``context_parallel_size > 1``), which has no CPU path; and
CP is an exact split of the whole-sequence computation. So the reference is Megatron's own
model without CP on the whole sequences, and kareus's model runs CP=2 on Megatron's own
chunks, in the same four processes:

1. ``initialize_model_parallel(tensor_model_parallel_size=2)`` (DP=2, both replicas fed
   the same whole sequences): Megatron's own layers (local spec) run 2 layers x 2
   microbatches (outputs, input gradients, parameter gradients), and the example's
   GPTModel (``examples/integrations/megatron_gpt.py``: Megatron DDP and Adam,
   ``get_forward_backward_func``) trains 2 iterations (losses, ``main_grad``s, weights);
2. ``destroy_model_parallel`` and ``initialize_model_parallel(tensor_model_parallel_size=2,
   context_parallel_size=2)``: kareus's layers (``kareus_layer_spec``, an applier on
   Megatron's TP and CP groups, a plan from ``workload_from_megatron(config)``) on the same
   weights, fed each rank's chunks as Megatron-Core's ``get_batch_on_this_cp_rank`` cuts
   them, with Megatron's RoPE table for this CP rank (``RotaryEmbedding`` slices it with
   ``get_pos_emb_on_this_cp_rank``): per layer under the schedules sequential, nanobatching
   and kareus, the output and input gradient equal the reference's rows of this rank's
   chunks and each parameter gradient, summed over the CP group, equals the reference's;
   then the GPTModel trains (unchained and ``chain_layers``), and the losses, every
   ``main_grad`` (Megatron's DDP averages over the context-parallel ranks) and the weights
   after two optimizer steps equal the reference's (fp32, 1e-4).
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "integrations"

SEQ, MBS, MICROBATCHES, TP, CP = 16, 2, 2, 2, 2
DIMS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=64, qk_layernorm=True, layernorm_epsilon=1e-6)
SCHEDULES = ("sequential", "nanobatching", "kareus")


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=what)


def _inputs():
    out = []
    for mb in range(MICROBATCHES):
        g = torch.Generator().manual_seed(100 + mb)
        x = torch.randn(SEQ, MBS, DIMS["hidden_size"], generator=g)
        c = torch.randn(SEQ, MBS, DIMS["hidden_size"], generator=g)
        out.append((x, c))
    return out


def _run_layers(layers, emb, xs, applier=None, pos=None):
    """Each microbatch through ``layers`` ([seq, batch, hidden]; ``pos``: this rank's rows),
    backward of ``(y * c).sum()``: the outputs and input gradients."""
    from contextlib import nullcontext

    outs = []
    for mb, (x, c) in enumerate(xs):
        if pos is not None:
            x, c = x[pos], c[pos]
        x = x.clone().requires_grad_(True)
        with applier.microbatch(mb, "fwd") if applier else nullcontext():
            y = x
            for lay in layers:
                y, _ = lay(hidden_states=y, attention_mask=None, rotary_pos_emb=emb)
        with applier.microbatch(mb, "bwd") if applier else nullcontext():
            (y * c).sum().backward()
        outs.append((y.detach(), x.grad.clone()))
    return outs


def _batches(vocab):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(MICROBATCHES):
        tok = torch.randint(0, vocab, (MBS, SEQ + 1), generator=g)
        out.append((tok[:, :-1], tok[:, 1:]))
    return out


def _reference(config, ex):
    """Megatron's own layers and GPTModel without CP, on the whole sequences."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    torch.manual_seed(1)
    own = [build_module(spec, config=config, layer_number=i + 1)
           for i in range(config.num_layers)]
    with torch.no_grad():
        for lay in own:  # norms away from 1, so that their gradients are checked
            for norm in (lay.input_layernorm, lay.pre_mlp_layernorm,
                         lay.self_attention.q_layernorm, lay.self_attention.k_layernorm):
                norm.weight.add_(0.1 * torch.randn(norm.weight.shape))
    states = [{k: v.clone() for k, v in lay.state_dict().items() if torch.is_tensor(v)}
              for lay in own]
    emb = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                          rotary_base=ex.ROTARY_BASE)(SEQ)
    layer_outs = _run_layers(own, emb, _inputs())
    layer_grads = [{n: p.grad.clone() for n, p in lay.named_parameters()} for lay in own]

    torch.manual_seed(0)
    model = ex.build_model(config, get_gpt_layer_local_spec(normalization="RMSNorm",
                                                            qk_layernorm=True),
                           SEQ, "cpu", tied=True)
    initial = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    losses = ex.train(model, config, _batches(ex.VOCAB), steps=2, seq_len=SEQ)
    return {"states": states, "layer_outs": layer_outs, "layer_grads": layer_grads,
            "initial": initial, "losses": losses,
            "main_grads": {n: p.main_grad.clone() for n, p in model.named_parameters()},
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _kareus_layers_match(config, wl, groups, plan, ref, ex):
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    from kareus.integrations import PlanApplier
    from kareus.integrations.megatron import kareus_layer_spec
    from kareus.model import cp_positions

    cp_group = parallel_state.get_context_parallel_group()
    pos = torch.tensor(cp_positions(SEQ, CP, groups.cp_rank))
    # Megatron's RoPE table of this CP rank: get_pos_emb_on_this_cp_rank's slice
    emb = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                          rotary_base=ex.ROTARY_BASE)(SEQ)
    assert emb.shape[0] == SEQ // CP
    partitions = {}
    for schedule in SCHEDULES:
        applier = PlanApplier(workload=wl, groups=groups, schedule=schedule,
                              plan=plan if schedule == "kareus" else None, kernels="torch",
                              rope_base=ex.ROTARY_BASE, eps=config.layernorm_epsilon,
                              record=True)
        spec = kareus_layer_spec(applier)
        mine = [build_module(spec, config=config, layer_number=i + 1)
                for i in range(config.num_layers)]
        for lay, state in zip(mine, ref["states"], strict=True):
            lay.load_state_dict(state, strict=False)
        outs = _run_layers(mine, emb, _inputs(), applier, pos)
        for (y, dx), (ry, rdx) in zip(outs, ref["layer_outs"], strict=True):
            _close(y, ry[pos], f"{schedule} output")
            _close(dx, rdx[pos], f"{schedule} input gradient")
        for i, lay in enumerate(mine):
            for n, p in lay.named_parameters():
                g = p.grad.clone()
                torch.distributed.all_reduce(g, group=cp_group)  # each rank: its chunks' part
                _close(g, ref["layer_grads"][i][n], f"{schedule} layer {i} {n}")
        partitions[schedule] = [(ph, k) for ph, k, _ in applier.partitions_run]
    return partitions


def _kareus_gpt_matches(config, wl, groups, plan, ref, ex, chained):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from kareus.integrations import PlanApplier
    from kareus.integrations.megatron import chain_layers, kareus_layer_spec, wrap_schedule

    applier = PlanApplier(workload=wl, groups=groups, plan=plan, kernels="torch",
                          rope_base=ex.ROTARY_BASE, eps=config.layernorm_epsilon, record=True)
    model = ex.build_model(config, kareus_layer_spec(applier), SEQ, "cpu", tied=True)
    model.load_state_dict(ref["initial"])
    if chained:
        chain_layers(model)
    # Megatron-Core's main branch made is_hybrid_cp a required argument (False: the
    # load-balanced chunks of every sequence, as 0.15 and 0.16 cut them) and takes the CP
    # group as an argument (its default, None, is the whole world there)
    hybrid = ({"is_hybrid_cp": False, "cp_group": parallel_state.get_context_parallel_group()}
              if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
              else {})
    batches = []  # Megatron's own chunking of the data
    for tok, lab in _batches(ex.VOCAB):
        part = get_batch_on_this_cp_rank({"tokens": tok.clone(), "labels": lab.clone()},
                                         **hybrid)
        batches.append((part["tokens"], part["labels"]))
    with wrap_schedule(applier):
        losses = ex.train(model, config, batches, steps=2, seq_len=SEQ)
    what = "chained" if chained else "layers"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-4,
                               atol=1e-5, msg=f"{what} losses")
    mine = dict(model.named_parameters())
    assert set(mine) == set(ref["weights"])
    for n, p in mine.items():
        _close(p.main_grad, ref["main_grads"][n], f"{what} main_grad {n}")
        _close(p.detach(), ref["weights"][n], f"{what} weight {n}")
    return losses, [(ph, k) for ph, k, _ in applier.partitions_run]


def _worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.core import parallel_state

    sys.path.insert(0, str(EXAMPLE))
    import megatron_gpt as ex

    from kareus.exec.train import TorchParallelGroups
    from kareus.integrations import megatron_cpu
    from kareus.integrations.megatron import workload_from_megatron
    from kareus.testing import make_workload_plan

    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    megatron_cpu.install()
    ref = _reference(ex.make_config(TP, torch.float32, **DIMS), ex)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP,
                                             context_parallel_size=CP)
    config = ex.make_config(TP, torch.float32, **DIMS, context_parallel_size=CP)
    wl = workload_from_megatron(config, microbatch_size=MBS, seq_len=SEQ,
                                num_microbatches=MICROBATCHES, vocab_size=ex.VOCAB,
                                share_embeddings_and_output_weights=True)
    assert (wl.parallelism.tp, wl.parallelism.cp) == (TP, CP)
    groups = TorchParallelGroups.from_groups(
        tp=parallel_state.get_tensor_model_parallel_group(),
        cp=parallel_state.get_context_parallel_group())
    assert groups.cp_rank == parallel_state.get_context_parallel_rank()
    plan = make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410))
    out = {"tp_rank": groups.tp_rank, "cp_rank": groups.cp_rank,
           **_kareus_layers_match(config, wl, groups, plan, ref, ex)}
    out["losses"], out["gpt"] = _kareus_gpt_matches(config, wl, groups, plan, ref, ex, False)
    _, out["chained"] = _kareus_gpt_matches(config, wl, groups, plan, ref, ex, True)
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.megatron_line
def test_kareus_layers_at_tp2_cp2_are_megatron_s_layers_over_gloo(tmp_path):
    from _ranks import run_ranks  # tests/integrations, on sys.path under pytest

    res = run_ranks(__file__, tmp_path, TP * CP)
    assert sorted((r["tp_rank"], r["cp_rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for key in (*SCHEDULES, "gpt", "chained"):
        # every rank ran the same partitions; the CP ones (all-gather, reduce-scatter) too
        assert res[0][key] and all(r[key] == res[0][key] for r in res), key
    assert any("ag" in k or "gather" in k for _, k in res[0]["kareus"]), res[0]["kareus"]
    assert all(r["losses"] == res[0]["losses"] for r in res)


@pytest.mark.megatron_line
def test_the_cp_spec_has_the_local_spec_s_parameters():
    from kareus.exec.train import LoopbackGroups
    from kareus.integrations import PlanApplier
    from kareus.integrations.megatron import KareusCoreAttention, kareus_layer_spec
    from kareus.model.workload import ModelArch, Parallelism, Workload

    arch = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8,
                     ffn=64, vocab=50, qk_norm=True, norm_eps=1e-6)
    wl = Workload(model=arch, parallelism=Parallelism(tp=1, cp=2), microbatch_size=2,
                  seq_len=16, num_microbatches=2)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1, cp=2), schedule="sequential",
                          kernels="torch", eps=1e-6, start=False)
    spec = kareus_layer_spec(applier)
    assert spec.submodules.self_attention.submodules.core_attention is KareusCoreAttention
    assert list(KareusCoreAttention().state_dict()) == []
    one = kareus_layer_spec(None, qk_layernorm=True)  # CP=1: the local spec's attention
    assert one.submodules.self_attention.submodules.core_attention.__name__ == (
        "DotProductAttention")


@pytest.mark.megatron_line
def test_a_cp_config_under_a_cp1_applier_is_refused_before_megatron_builds_it():
    sys.path.insert(0, str(EXAMPLE))
    import megatron_gpt as ex
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from kareus.errors import WorkloadError
    from kareus.exec.train import LoopbackGroups
    from kareus.integrations import PlanApplier
    from kareus.integrations.megatron import KareusTransformerLayer, workload_from_megatron

    config = ex.make_config(1, torch.float32, **DIMS)  # CP=1
    wl = workload_from_megatron(config, microbatch_size=MBS, seq_len=SEQ,
                                num_microbatches=MICROBATCHES, vocab_size=ex.VOCAB)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="sequential",
                          kernels="torch", eps=1e-6, start=False)
    cp_config = ex.make_config(1, torch.float32, **DIMS, context_parallel_size=2)
    subs = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True).submodules
    with pytest.raises(WorkloadError, match="context_parallel_size=2, the workload's model CP=1"):
        KareusTransformerLayer(config=cp_config, submodules=subs, layer_number=1,
                               applier=applier)


if __name__ == "__main__":
    _worker(sys.argv[1])
