"""torchtitan 0.3's Qwen3 MoE block computes kareus's MoE semantics (CPU, gloo, 2 ranks).

The worker builds a one-layer Qwen3 MoE model with torchtitan's own layer builder
(``load_balance_coeff=None``: no aux-loss-free balancing, which kareus refuses), parallelizes
it with torchtitan's own ``model.parallelize`` at ``expert_parallel_degree=2`` under the
``partial_dtensor`` SPMD backend (torchtitan's expert parallelism runs on the CPU there: its
standard dispatcher's all-to-alls are ``all_to_all_single`` with split sizes, which gloo
has; under the ``spmd_types`` backend they are list all-to-alls of uneven tensors, which
gloo refuses), in two layouts:

* ``ep2``: TP = 1, the two ranks' own tokens meeting in the expert-parallel all-to-alls;
* ``ep2-shared``: ``ep2`` with a shared expert (a ``FeedForward`` beside the routed ones);
* ``ep2-tp2-sp``: TP = 2 with sequence parallelism, EP = 2 over the same ranks: each rank
  routes its sequence shard.

It runs the block (``layers["0"].moe``) for two SGD steps (the router's gradient summed
over the ranks as torchtitan's data-parallel and TP reductions do; each rank's experts'
its own) and saves what the Megatron-Core harness saves, the weights read by
``kareus.integrations.torchtitan.moe_block_weights``. The parent checks them against
kareus's semantics in float64.

**Tolerance.** torchtitan's ``GroupedExperts`` casts the tokens and the expert weights to
bfloat16 in its forward whatever the model's dtype (its grouped GEMMs are bf16 GEMMs), so
the experts' outputs, and every gradient through them, agree with the float64 reference to
bfloat16's precision (relative 2e-2), not float32's; the routing (float32 router under
torchtitan's autocast) is compared exactly: the same experts for every token.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

HERE = Path(__file__).resolve().parent

SEQ, MBS, DIM, EXPERTS, TOP_K, EXPERT_FFN, LR = 16, 2, 32, 4, 2, 32, 0.1
SHARED_FFN = 40
#: variant -> (TP, shared expert): TP = 1 with and without a shared expert (torchtitan
#: splits shared experts over TP, which kareus does not model), TP = 2 with SP.
VARIANTS = {"ep2": (1, False), "ep2-shared": (1, True), "ep2-tp2-sp": (2, False)}


def _config(tp: int, shared: bool = False):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers
    from torchtitan.models.qwen3.model import Qwen3Model

    layers = _build_qwen3_moe_layers(
        n_layers=1, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=8, moe_hidden_dim=EXPERT_FFN,
        num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=8, max_seq_len=32, theta=1e6))
    for lc in layers:  # SDPA: flex has no CPU backward; no aux-loss-free balancing
        lc.attention.inner_attention = ScaledDotProductAttention.Config()
        lc.moe.load_balance_coeff = None
        if shared:
            from functools import partial

            from torchtitan.models.common.config_utils import make_ffn_config

            init = {"weight": partial(torch.nn.init.normal_, std=0.02)}
            lc.moe.shared_experts = make_ffn_config(dim=DIM, hidden_dim=SHARED_FFN,
                                                    w1_param_init=init, w2w3_param_init=init)
    return Qwen3Model.Config(
        dim=DIM, vocab_size=64,
        tok_embeddings=Embedding.Config(num_embeddings=64, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=1e-6),
        lm_head=Linear.Config(in_features=DIM, out_features=64), layers=layers)


def _worker(out_dir: str, variant: str) -> None:
    import torch.distributed as dist

    tp, shared = VARIANTS[variant]
    cfg = _config(tp, shared)  # imports torchtitan's models (its "fake" process-group backend)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

    from kareus.integrations.torchtitan import moe_block_weights, workload_from_torchtitan

    tt_parallel_dims.device_type = tt_utils.device_type = "cpu"
    dist_utils.set_spmd_backend("partial_dtensor")
    parallelism = ParallelismConfig(tensor_parallel_degree=tp, expert_parallel_degree=2,
                                    enable_sequence_parallel=tp > 1,
                                    spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, world_size=2)
    dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    wl = workload_from_torchtitan(cfg, tp=tp, sp=tp > 1, ep=2, dp=2 // tp, microbatch_size=MBS,
                                  seq_len=SEQ, num_microbatches=1, recompute="none")
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    moe = model.layers["0"].moe
    # whole weights, the same on every rank (the parallelized model keeps each rank's
    # experts); spread so that no token's top-k is near a tie
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        moe.router.gate.weight.normal_(0, 0.5, generator=g)
        for p in moe.routed_experts.parameters():
            p.normal_(0, 0.2, generator=g)
        if shared:
            for p in moe.shared_experts.parameters():
                p.normal_(0, 0.2, generator=g)
    with context():
        model.parallelize(dims)
    g = torch.Generator().manual_seed(11 + (rank if tp == 1 else 0))
    x_full = torch.randn(MBS, SEQ, DIM, generator=g)
    target_full = torch.randn(MBS, SEQ, DIM, generator=g)
    s = SEQ // tp
    tp_rank = rank if tp > 1 else 0
    x_local = x_full[:, tp_rank * s:(tp_rank + 1) * s].contiguous()
    target = target_full[:, tp_rank * s:(tp_rank + 1) * s].contiguous()
    params = dict(moe.named_parameters())
    steps = []
    for _ in range(2):
        weights = {k: v.detach().clone() for k, v in moe_block_weights(moe).items()}
        x = x_local.clone().requires_grad_(True)
        with context():
            out = moe(x)
            out = out.to_local() if hasattr(out, "to_local") else out
            assert out.shape == x.shape
            loss = (out * target).sum()
            loss.backward()
        grads = {}
        for name, p in params.items():
            grad = p.grad
            if name.startswith(("router.", "shared_experts.")):  # replicated: summed
                grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                if tp == 1:
                    dist.all_reduce(grad)
            else:  # this rank's experts, from every rank's tokens
                grad = grad.to_local()
            grads[name] = grad.detach().clone()
        steps.append({"weights": weights, "x": x_local, "target": target,
                      "out": out.detach().clone(), "x_grad": x.grad.detach().clone(),
                      "loss": float(loss), "grads": _in_kareus_layout(grads)})
        with torch.no_grad():
            for name, p in params.items():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.sub_(LR * grads[name])
                p.grad = None
    final = {k: v.detach().clone() for k, v in moe_block_weights(moe).items()}
    torch.save({"steps": steps, "final": final, "ep_rank": rank, "workload_moe": wl.model.moe,
                "ep": wl.parallelism.ep}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _in_kareus_layout(grads: dict) -> dict:
    """The module's gradients as ``moe_block_weights`` lays out the weights."""
    from kareus.integrations import experts_from_stacked

    p = "routed_experts.inner_experts."
    w1e, w2e = experts_from_stacked(grads[p + "w1_EFD"], grads[p + "w3_EFD"],
                                    grads[p + "w2_EDF"])
    out = {"Wr": grads["router.gate.weight"].t(), "W1e": w1e, "W2e": w2e}
    if "shared_experts.w1.weight" in grads:
        out |= {"Wsg": grads["shared_experts.w1.weight"].t(),
                "Wsu": grads["shared_experts.w3.weight"].t(),
                "Wsd": grads["shared_experts.w2.weight"].t()}
    return out


def _close(got, want, *, msg: str, rtol: float = 2e-2, atol: float = 2e-2) -> None:
    """bfloat16 tolerance (the module docstring), ``atol`` relative to the largest entry."""
    scale = max(1e-3, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * scale,
                               msg=lambda detail: f"{msg} (scale {scale:.3g}): {detail}")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_torchtitan_qwen3_moe_block_computes_kareus_semantics(tmp_path, variant):
    from _moe_checks import full_weights, min_logit_gap, moe  # tests/integrations
    from _ranks import run_ranks

    from kareus.model.moe import MoEArch

    res = run_ranks(__file__, tmp_path, 2, variant)
    shared = VARIANTS[variant][1]
    assert res[0]["ep"] == 2 and res[0]["workload_moe"] == MoEArch(
        experts=EXPERTS, experts_per_token=TOP_K, expert_ffn=EXPERT_FFN,
        shared_experts=int(shared), shared_expert_ffn=SHARED_FFN if shared else 0)

    by_ep = sorted(res, key=lambda r: r["ep_rank"])
    # each step from the weights the block holds then (bf16 experts: a float64 trajectory
    # of its own would drift from the block's by bf16 rounding, and could route otherwise)
    for step in range(2):
        w = {k: v.double().requires_grad_(True)
             for k, v in full_weights([r["steps"][step]["weights"] for r in by_ep]).items()}
        xs = [r["steps"][step]["x"].double().reshape(-1, DIM).requires_grad_(True)
              for r in res]
        for x in xs:
            assert min_logit_gap(x.detach(), w["Wr"].detach(), TOP_K) > 1e-4
        outs = [moe(x, w, TOP_K) for x in xs]
        loss = sum((o * r["steps"][step]["target"].double().reshape(o.shape)).sum()
                   for o, r in zip(outs, res, strict=True))
        loss.backward()
        total = sum(r["steps"][step]["loss"] for r in res)
        assert total == pytest.approx(float(loss.detach()), rel=2e-2, abs=2e-2)
        for o, x, r in zip(outs, xs, res, strict=True):
            mine = r["steps"][step]
            _close(mine["out"].double().reshape(o.shape), o.detach(), msg=f"step {step} out")
            _close(mine["x_grad"].double().reshape(x.shape), x.grad,
                   msg=f"step {step} input grad")
        grads = full_weights([r["steps"][step]["grads"] for r in by_ep])
        for k, v in w.items():
            _close(grads[k].double(), v.grad, msg=f"step {step} grad {k}")
        # the update: the next step's weights (or the final ones) are these less LR x the
        # reference's gradient
        after = full_weights([r["steps"][step + 1]["weights"] if step == 0 else r["final"]
                      for r in by_ep])
        for k, v in w.items():
            _close(after[k].double(), (v - LR * v.grad).detach(), msg=f"step {step} update {k}")
        # the router and the expert weights moved: the check is not of a fixed point
        assert not torch.equal(after["Wr"], full_weights(
            [r["steps"][step]["weights"] for r in by_ep])["Wr"])


# ------------------------------------------------------------------ the planned MoE layer

VOCAB, MICROBATCHES = 64, 2


def _model_worker(out_dir: str) -> None:
    """torchtitan's own two-layer Qwen3 MoE model and the same model under kareus's planned
    layers (``apply_plan``), TP = 2 with sequence parallelism and EP = 2 over the same two
    ranks, under every schedule: losses, logits and every parameter's gradient."""
    import copy
    from contextlib import nullcontext

    import torch.distributed as dist

    cfg = _config(2)
    cfg.layers = cfg.layers + [copy.deepcopy(cfg.layers[0])]  # two MoE layers
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

    import kareus.integrations.torchtitan as kt
    from kareus.testing import make_workload_plan

    tt_parallel_dims.device_type = tt_utils.device_type = "cpu"
    dist_utils.set_spmd_backend("partial_dtensor")
    parallelism = ParallelismConfig(tensor_parallel_degree=2, expert_parallel_degree=2,
                                    enable_sequence_parallel=True,
                                    spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(parallelism, world_size=2)
    dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    wl = kt.workload_from_torchtitan(cfg, tp=2, ep=2, microbatch_size=MBS, seq_len=SEQ,
                                     num_microbatches=MICROBATCHES, recompute="full")
    assert wl.parallelism.sequence_parallel
    plan = make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410),
                              unsplit_microbatches=(1,))
    torch.manual_seed(0)
    base = cfg.build()
    base.init_states()
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for layer in base.layers.values():
            layer.moe.router.gate.weight.normal_(0, 0.5, generator=g)
            for p in layer.moe.routed_experts.parameters():
                p.normal_(0, 0.2, generator=g)
    result: dict = {}
    start: list[list] = []  # torchtitan's weights (this rank's shards) at each step
    for schedule in ("torchtitan", "sequential", "nanobatching", "kareus"):
        model = copy.deepcopy(base)
        with context():
            model.parallelize(dims)
        applier = None
        if schedule != "torchtitan":
            applier = kt.apply_plan(model, workload=wl, mesh=dims, schedule=schedule,
                                    plan=plan if schedule == "kareus" else None,
                                    kernels="torch", record=True)
        losses, logits, grads = [], [], []
        for step in range(2):  # two SGD steps of two microbatches each
            with torch.no_grad():  # each step from torchtitan's own weights of that step
                if schedule == "torchtitan":
                    start.append([_local(p).clone() for p in model.parameters()])
                else:
                    for p, w in zip(model.parameters(), start[step], strict=True):
                        _local(p).copy_(w)
            for mb in range(MICROBATCHES):
                g = torch.Generator().manual_seed(10 + mb)
                tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
                with context():
                    with applier.microbatch(mb, "fwd") if applier else nullcontext():
                        out = model(tokens[:, :-1])
                    loss = cross_entropy_loss(out, tokens[:, 1:], global_vocab_size=VOCAB)
                    with applier.microbatch(mb, "bwd") if applier else nullcontext():
                        loss.backward()
                losses.append(float(_full(loss).detach()))
                logits.append(_full(out).detach().clone())
            grads.append({n: _full(p.grad).detach().clone()
                          for n, p in model.named_parameters()})
            with torch.no_grad(), context():
                for p in model.parameters():
                    p -= LR * p.grad
                    p.grad = None
        result[schedule] = {
            "losses": losses, "logits": logits, "grads": grads,
            "weights": {n: _full(p).detach().clone() for n, p in model.named_parameters()},
            "partitions": ([(ph, k) for ph, k, _ in applier.partitions_run]
                           if applier else [])}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.slow
def test_planned_moe_layers_are_torchtitan_s_qwen3_moe_blocks(tmp_path):
    """kareus's planned layers run torchtitan's Qwen3 MoE blocks (``apply_plan``) at TP = 2
    with sequence parallelism and EP = 2, two SGD steps of two microbatches, each step from
    torchtitan's own weights of that step: the losses, logits, every parameter's gradient
    (attention, norms, router, experts; the embedding and LM head through them) and the
    weights after the steps are torchtitan's own under the sequential, nanobatching and
    kareus schedules (a plan), to bfloat16 tolerance: torchtitan's experts compute in
    bf16, kareus's in the model's dtype (fp32 here). The kareus schedules' weights agree
    with one another to fp32 tolerance."""
    from _ranks import run_ranks

    res = run_ranks(__file__, tmp_path, 2, "model")
    for r in res:
        want = r["torchtitan"]
        for schedule in ("sequential", "nanobatching", "kareus"):
            got = r[schedule]
            assert got["losses"] == pytest.approx(want["losses"], rel=2e-2), schedule
            for a, b in zip(got["logits"], want["logits"], strict=True):
                _close(a.double(), b.double(), msg=f"{schedule} logits")
            # each step from torchtitan's weights of that step (a trajectory of kareus's own
            # would drift from torchtitan's bf16 experts' by bf16 rounding and, routing being
            # discontinuous, flip the top-k of the odd token whose logits nearly tie)
            for step, (mine, theirs) in enumerate(zip(got["grads"], want["grads"],
                                                      strict=True)):
                for n, g in theirs.items():
                    _close(mine[n].double(), g.double(), msg=f"{schedule} step {step} grad {n}")
            for n, w in want["weights"].items():
                _close(got["weights"][n].double(), w.double(), msg=f"{schedule} weight {n}")
            if schedule != "sequential":  # kareus's schedules: the same fp32 values
                for n, w in r["sequential"]["weights"].items():
                    torch.testing.assert_close(got["weights"][n], w, rtol=1e-4, atol=1e-5,
                                               msg=lambda m, n=n, s=schedule: f"{s} {n}: {m}")
        assert any("moe" in k for _, k in r["kareus"]["partitions"])
    assert res[0]["kareus"]["partitions"] == res[1]["kareus"]["partitions"]


if __name__ == "__main__":
    if sys.argv[2] == "model":
        _model_worker(sys.argv[1])
    else:
        _worker(sys.argv[1], sys.argv[2])
