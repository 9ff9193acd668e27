"""kareus's planned layer computes a mixture-of-experts decoder layer (CPU, gloo, 2 ranks).

TP = 2 with sequence parallelism and EP = 2 over the same two ranks (Megatron-Core's MoE
parallel folding; each rank routes its sequence shard), and CP = 2 with EP = 2 over the
CP ranks and a shared expert (shared experts are not modelled at TP > 1), and EP = 2 over
two data-parallel replicas (each with its own microbatches), a Qwen3-style
layer (per-head query/key norm) whose MLP is 4 experts, top-2, under
every schedule (sequential, nanobatching, kareus with a plan, and the plan over two layers
chained as one stack; and, for layers run one by one (``chained_layers=False``), the plan
made for that), with full, selective and no recomputation: each rank's outputs, input
gradients and weight gradients in kareus's layout against the float64 reference layer
(attention as ``_reference.layer``, the MoE block as
[`moe_block_reference`][kareus.testing.moe_block_reference]), to fp32 tolerance. The
router's gradient is each rank's part (its tokens'), as the framework's own router hands
it back; the parent sums the parts as the framework does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _ranks import run_ranks  # tests/integrations, on sys.path under pytest and torchrun
from _reference import full_weights, layer, shard

from kareus.errors import ArgumentError
from kareus.model import cp_positions
from kareus.model.moe import MoEArch
from kareus.model.workload import ModelArch, Parallelism, Workload

HERE = Path(__file__).resolve().parent

EXPERTS, TOP_K, EXPERT_FFN, SHARED = 4, 2, 24, 40
SCHEDULES = ("sequential", "nanobatching", "kareus", "kareus-stack")


def workload(recompute: str, shared: bool, layout: str = "tp2-sp") -> Workload:
    """The tiny MoE workload of ``layout`` (a ``-unchained`` suffix: its layers run one by
    one, ``chained_layers=False``)."""
    layout, unchained, _ = layout.partition("-unchained")
    moe = MoEArch(experts=EXPERTS, experts_per_token=TOP_K, expert_ffn=EXPERT_FFN,
                  shared_experts=int(shared), shared_expert_ffn=SHARED if shared else 0)
    arch = ModelArch(name="tiny-moe", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8,
                     ffn=64, vocab=50, qk_norm=True, norm_eps=1e-6, moe=moe)
    par = {"tp2-sp": Parallelism(tp=2, sp=True, ep=2),
           "cp2": Parallelism(tp=1, cp=2, ep=2),  # EP over the CP ranks
           "dp2": Parallelism(tp=1, dp=2, ep=2),  # EP over two data-parallel replicas
           }[layout]
    return Workload(model=arch, parallelism=par,
                    microbatch_size=4, seq_len=16, num_microbatches=2, nanobatches=2,
                    recompute=recompute, chained_layers=not unchained)


def moe_weights(arch: ModelArch, seed: int) -> dict:
    """One layer's whole MoE weights in kareus's layout (every expert)."""
    g = torch.Generator().manual_seed(1000 + seed)
    m, h = arch.moe, arch.hidden
    w = {"Wr": torch.randn(h, m.experts, generator=g) * 0.5,
         "W1e": torch.randn(m.experts, h, 2 * m.expert_ffn, generator=g) * 0.2,
         "W2e": torch.randn(m.experts, m.expert_ffn, h, generator=g) * 0.2}
    if m.shared_experts:
        f = m.shared_experts * m.shared_expert_ffn
        w |= {"Wsg": torch.randn(h, f, generator=g) * 0.2,
              "Wsu": torch.randn(h, f, generator=g) * 0.2,
              "Wsd": torch.randn(f, h, generator=g) * 0.2}
    return w


def local_moe(w: dict, ep: int, ep_rank: int) -> dict:
    """EP rank ``ep_rank``'s experts (the router and shared experts replicated)."""
    n = w["W1e"].shape[0] // ep
    return {k: (v[ep_rank * n:(ep_rank + 1) * n] if k in ("W1e", "W2e") else v)
            for k, v in w.items()}


def _positions(wl: Workload, tp_rank: int, cp_rank: int):
    """This rank's tokens of each sequence: its sequence shard (TP, sequence parallel) or
    Megatron-Core's load-balanced chunks (CP)."""
    p = wl.parallelism
    if p.cp > 1:
        return torch.tensor(cp_positions(wl.seq_len, p.cp, cp_rank))
    s = wl.seq_len // p.tp
    return torch.arange(tp_rank * s, (tp_rank + 1) * s)


def _schedules(wl: Workload) -> tuple[str, ...]:
    """The schedules run: a stack of layers only where they chain."""
    return SCHEDULES if wl.chained_layers else tuple(
        s for s in SCHEDULES if not s.endswith("-stack"))


def _worker(out_dir: str, recompute: str, shared: str, layout: str) -> None:
    import torch.distributed as dist

    from kareus.exec.train import TorchParallelGroups
    from kareus.integrations import PlanApplier
    from kareus.testing import make_workload_plan

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    wl = workload(recompute, shared == "1", layout)
    par = wl.parallelism
    # the "framework's" groups (CP: the rest)
    base = TorchParallelGroups(tp=par.tp, ep=2, dp=par.dp)
    groups = TorchParallelGroups.from_groups(tp=base.tp_group if par.tp > 1 else None,
                                             cp=base.cp_group if par.cp > 1 else None,
                                             ep=base.ep_group)
    dp_rank = base.dp_rank
    arch = wl.model
    plan = make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410),
                              unsplit_microbatches=(1,))
    rows = _positions(wl, groups.tp_rank, groups.cp_rank)
    result = {"tp_rank": groups.tp_rank, "cp_rank": groups.cp_rank, "ep_rank": groups.ep_rank,
              "dp_rank": dp_rank}
    for schedule in _schedules(wl):
        stacked = schedule.endswith("-stack")
        applier = PlanApplier(workload=wl, groups=groups, schedule=schedule.split("-")[0],
                              plan=plan if schedule.startswith("kareus") else None,
                              kernels="torch", eps=arch.norm_eps, record=True)
        planned = applier.layer()
        layers = []
        for seed in (1, 2):
            dense = shard(full_weights(arch, seed), arch, par.tp, groups.tp_rank)
            dense = {k: v for k, v in dense.items() if k not in ("w1", "w2", "w3")}
            ps = {k: torch.nn.Parameter(v.clone()) for k, v in dense.items()}
            ps |= {k: torch.nn.Parameter(v.clone()) for k, v in local_moe(
                moe_weights(arch, seed), 2, groups.ep_rank).items()}
            layers.append(ps)

        outs = []
        for mb in range(wl.num_microbatches):
            g = torch.Generator().manual_seed(100 + mb + 1000 * dp_rank)  # a replica's data
            x = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g)
            c = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g)
            xl = x[:, rows].clone().requires_grad_(True)
            with applier.microbatch(mb, "fwd"):
                if stacked:
                    y = applier.stack(2)(xl, [_kareus(p, arch) for p in layers])
                else:
                    y = xl
                    for p in layers:
                        y = planned(y, _kareus(p, arch))
            with applier.microbatch(mb, "bwd"):
                (y * c[:, rows]).sum().backward()
            outs.append((y.detach(), xl.grad.clone()))
        result[schedule] = {"outs": outs,
                            "grads": [{k: p.grad.clone() for k, p in ps.items()}
                                      for ps in layers],
                            "partitions": [(ph, k) for ph, k, _ in applier.partitions_run]}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _kareus(ps: dict, arch: ModelArch) -> dict:
    """A layer's planned weights: the attention's through the dense helpers, the MoE
    block's already in kareus's layout."""
    from kareus.integrations import head_norm, linear, qkv_from_separate

    w = {"w_attn_norm": ps["n1"],
         "Wqkv": qkv_from_separate(ps["wq"], ps["wk"], ps["wv"], head_dim=arch.head_dim),
         "Wo": linear(ps["wo"]), "w_mlp_norm": ps["n2"],
         "w_q_norm": head_norm(ps["qn"]), "w_k_norm": head_norm(ps["kn"])}
    return w | {k: ps[k] for k in ("Wr", "W1e", "W2e", "Wsg", "Wsu", "Wsd") if k in ps}


def _reference(wl: Workload, dp_rank: int = 0):
    """The float64 layer on data-parallel replica ``dp_rank``'s microbatches."""
    arch = wl.model
    layers = []
    for seed in (1, 2):
        ws = {k: v.double().requires_grad_(True) for k, v in full_weights(arch, seed).items()
              if k not in ("w1", "w2", "w3")}
        ws |= {k: v.double().requires_grad_(True) for k, v in moe_weights(arch, seed).items()}
        layers.append(ws)
    outs = []
    for mb in range(wl.num_microbatches):
        g = torch.Generator().manual_seed(100 + mb + 1000 * dp_rank)
        x = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g).double()
        c = torch.randn(wl.microbatch_size, wl.seq_len, arch.hidden, generator=g).double()
        x.requires_grad_(True)
        y = x
        for ws in layers:
            y = layer(y, ws, arch, base=500000.0)
        (y * c).sum().backward()
        outs.append((y.detach(), x.grad.clone()))
    return outs, [{k: v.grad for k, v in ws.items()} for ws in layers]


def _close(got, want, what):
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * scale,
                               msg=lambda m: f"{what} (scale {scale:.3g}): {m}")


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "recompute", "shared"),
                         [("tp2-sp", "full", False), ("tp2-sp", "none", False),
                          ("cp2", "selective", True), ("dp2", "selective", True),
                          ("tp2-sp-unchained", "full", False),
                          ("cp2-unchained", "none", True)],
                         ids=["tp2-sp-full", "tp2-sp-none", "cp2-selective-shared",
                              "dp2-selective-shared", "tp2-sp-full-unchained",
                              "cp2-none-shared-unchained"])
def test_planned_moe_layer_computes_the_reference_under_every_schedule(tmp_path, layout,
                                                                        recompute, shared):
    res = run_ranks(__file__, tmp_path, 2, recompute, str(int(shared)), layout)
    wl = workload(recompute, shared, layout)
    dp = wl.parallelism.dp
    refs = [_reference(wl, d) for d in range(dp)]  # each replica's own microbatches
    for schedule in _schedules(wl):
        for r in res:
            outs = refs[r["dp_rank"]][0]
            rows = _positions(wl, r["tp_rank"], r["cp_rank"])
            for mb, ((y, dx), (ry, rdx)) in enumerate(zip(r[schedule]["outs"], outs,
                                                          strict=True)):
                _close(y, ry[:, rows], f"{schedule} mb {mb} output")
                _close(dx, rdx[:, rows], f"{schedule} mb {mb} input grad")
        for li in range(2):
            mine = [r[schedule]["grads"][li] for r in res]
            # the experts' gradients gather every replica's tokens routed to them; the
            # replicated weights' are each rank's part, summed over ranks by the framework
            want = {k: sum(ref[1][li][k] for ref in refs) for k in refs[0][1][li]}
            n = EXPERTS // 2
            for k, g in want.items():
                if k in ("W1e", "W2e"):  # each EP rank's experts
                    for r, m in zip(res, mine, strict=True):
                        e = r["ep_rank"]
                        _close(m[k], g[e * n:(e + 1) * n], f"{schedule} layer {li} {k}")
                elif k in ("wq", "wk", "wv", "wo"):  # TP shards
                    continue  # the dense layer's tests check the attention's shards
                else:  # replicated: each rank's part, summed as the framework sums it
                    _close(sum(m[k] for m in mine), g, f"{schedule} layer {li} {k}")
        # every rank ran the same partitions, the MoE all-to-alls among them
        assert res[0][schedule]["partitions"] == res[1][schedule]["partitions"]
    planned = {k for _, k in res[0]["kareus"]["partitions"]}
    assert planned and all("moe" in k or "attn" in k for k in planned)
    # unchained, each layer's un-permutation runs beside its own last combine (a type of
    # the unchained set only)
    assert ("fwd_moe_unpermute" in planned) == (not wl.chained_layers)


def test_planned_moe_layer_refuses_graphs():
    from kareus.exec.train import LoopbackGroups
    from kareus.integrations import PlanApplier

    wl = workload("full", False)
    with pytest.raises(ArgumentError, match="runs eagerly"):
        PlanApplier(workload=wl, groups=LoopbackGroups(tp=2, ep=2), graphs=True,
                    eps=wl.model.norm_eps)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4])
