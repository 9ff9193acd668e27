"""Planned layers with nanobatches along the sequence (``Workload.sequence_split``: one
sequence per microbatch, nanobatches > 1, CP = 1): nanobatch ``j`` is tokens
``[j c, (j+1) c)``; its attention reads the keys and values of chunks ``0..j`` and its
backward adds to their dK and dV. Outputs, input and weight gradients equal the float64
reference of the whole layer on the whole sequence:

* one process (TP = 1): both baselines, layers and a stack, 2 and 4 nanobatches, the
  recomputation policies that run there (full recomputation along the sequence needs a
  collective between the recomputed forward and the backward: refused at TP = CP = 1);
* two processes over gloo (TP = 2): sequential, nanobatching, a kareus plan (one microbatch
  unsplit) on layers and on a stack, every recomputation policy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kareus.errors import ArgumentError, WorkloadError
from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier
from kareus.testing import make_workload_plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _ranks import run_ranks
from _reference import full_weights, layer, planned_weights, shard, workload


#: float64 throughout; the planned layer's RoPE tables come from float32 angles (as in
#: bf16 training), so even the unsplit sequential schedule differs from the reference by
#: ~1e-7 relative (a wrong chunk would differ by ~1e-2)
def _close(a, b, msg=""):
    """Relative norm of the difference under 1e-6."""
    err = float((a - b).norm() / b.norm())
    assert err < 1e-6, (msg, err)


def _weights(arch, seed):
    return {k: torch.nn.Parameter(v.double()) for k, v in full_weights(arch, seed).items()}


def _grads(params):
    out = {k: p.grad.clone() for k, p in params.items()}
    for p in params.values():
        p.grad = None
    return out


def _reference(arch, layers, x, c):
    x = x.detach().clone().requires_grad_(True)
    y = x
    for p in layers:
        y = layer(y, p, arch)
    (y * c).sum().backward()
    return y.detach(), x.grad.clone(), [_grads(p) for p in layers]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("recompute", ["selective", "none", "full"])
@pytest.mark.parametrize("how", ["layers", "stack"])
@pytest.mark.parametrize("schedule", ["sequential", "nanobatching"])
def test_a_planned_layer_along_the_sequence_is_the_reference_layer(schedule, how, recompute,
                                                                    n):
    wl = workload(n=n, mbs=1, recompute=recompute)
    assert wl.sequence_split
    arch = wl.model
    layers = [_weights(arch, seed) for seed in (1, 2)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, arch.hidden, generator=g, dtype=torch.float64)
    c = torch.randn(1, 16, arch.hidden, generator=g, dtype=torch.float64)
    ref_y, ref_dx, ref = _reference(arch, layers, x, c)

    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule=schedule,
                          kernels="torch", eps=arch.norm_eps)
    ws = [planned_weights(p, arch) for p in layers]
    xl = x.clone().requires_grad_(True)

    def run():
        if how == "stack":
            return applier.stack(len(layers))(xl, ws)
        y = xl
        for w in ws:
            y = applier.layer()(y, w)
        return y

    if schedule == "nanobatching" and recompute == "full":
        with pytest.raises(ArgumentError, match="full recomputation along the sequence"):
            (run() * c).sum().backward()
        return
    y = run()
    (y * c).sum().backward()
    _close(y.detach(), ref_y)
    _close(xl.grad, ref_dx)
    for p, want in zip(layers, ref, strict=True):
        for k, gr in _grads(p).items():
            _close(gr, want[k], k)


def test_what_planned_layers_do_not_run_along_the_sequence_is_refused():
    wl = workload(n=2, mbs=1, recompute="none")
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="nanobatching",
                          kernels="torch", eps=wl.model.norm_eps)
    x = torch.randn(1, 16, wl.model.hidden, dtype=torch.float64)
    ws = planned_weights(_weights(wl.model, 1), wl.model)
    with pytest.raises(WorkloadError, match="packed-document positions"):
        applier.layer()(x, ws, positions=torch.arange(16)[None])
    with pytest.raises(WorkloadError, match="along the sequence"):  # 15 tokens in 2 chunks
        applier.layer()(torch.randn(1, 15, wl.model.hidden, dtype=torch.float64), ws)


# ------------------------------------------------------------------ two ranks, gloo


def _worker(out_dir: str, qk: bool) -> None:
    import torch.distributed as dist

    from kareus.exec.train import TorchParallelGroups

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    groups = TorchParallelGroups(tp=2)
    result: dict = {"tp_rank": groups.tp_rank}
    for recompute in ("full", "selective", "none"):
        wl = workload(2, 1, n=2, mbs=1, microbatches=2, qk=qk, recompute=recompute)
        arch = wl.model
        plan = make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410),
                                  unsplit_microbatches=(1,))
        for schedule in ("sequential", "nanobatching", "kareus", "kareus-stack"):
            stacked = schedule.endswith("-stack")
            applier = PlanApplier(workload=wl, groups=groups, schedule=schedule.split("-")[0],
                                  plan=plan if schedule.startswith("kareus") else None,
                                  kernels="torch", eps=arch.norm_eps, record=True)
            layers = [{k: torch.nn.Parameter(v.double().clone()) for k, v in
                       shard(full_weights(arch, seed), arch, 2, groups.tp_rank).items()}
                      for seed in (1, 2)]
            outs = []
            for mb in range(wl.num_microbatches):
                g = torch.Generator().manual_seed(100 + mb)
                x = torch.randn(1, wl.seq_len, arch.hidden, generator=g, dtype=torch.float64)
                c = torch.randn(1, wl.seq_len, arch.hidden, generator=g, dtype=torch.float64)
                xl = x.clone().requires_grad_(True)
                with applier.microbatch(mb, "fwd"):
                    ws = [planned_weights(p, arch) for p in layers]
                    if stacked:
                        y = applier.stack(2)(xl, ws)
                    else:
                        y = xl
                        for w in ws:
                            y = applier.layer()(y, w)
                with applier.microbatch(mb, "bwd"):
                    (y * c).sum().backward()
                outs.append((y.detach(), xl.grad.clone()))
            result[(recompute, schedule)] = {
                "outs": outs, "grads": [{k: p.grad.clone() for k, p in ps.items()}
                                        for ps in layers],
                "partitions": [(ph, k) for ph, k, _ in applier.partitions_run]}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("qk", [False, True], ids=["llama", "qwen3"])
def test_gloo_tp2_along_the_sequence_matches_the_whole_layer(tmp_path, qk):
    res = run_ranks(__file__, tmp_path, 2, str(int(qk)))
    wl = workload(2, 1, n=2, mbs=1, microbatches=2, qk=qk)
    arch = wl.model
    layers = [_weights(arch, seed) for seed in (1, 2)]
    outs: list = []
    grads: list[dict] = []
    for mb in range(wl.num_microbatches):
        g = torch.Generator().manual_seed(100 + mb)
        x = torch.randn(1, wl.seq_len, arch.hidden, generator=g, dtype=torch.float64)
        c = torch.randn(1, wl.seq_len, arch.hidden, generator=g, dtype=torch.float64)
        y, dx, per_mb = _reference(arch, layers, x, c)
        outs.append((y, dx))
        grads = per_mb if mb == 0 else [{k: v + more[k] for k, v in a.items()}
                                        for a, more in zip(grads, per_mb, strict=True)]
    for recompute in ("full", "selective", "none"):
        for schedule in ("sequential", "nanobatching", "kareus", "kareus-stack"):
            got = {r["tp_rank"]: r[(recompute, schedule)] for r in res}
            for r in got.values():
                for (y, dx), (ry, rdx) in zip(r["outs"], outs, strict=True):
                    _close(y, ry)
                    _close(dx, rdx)
            for i, want in enumerate(grads):
                for k in ("qn", "kn") if qk else ():  # each TP rank its heads' part
                    _close(got[0]["grads"][i][k] + got[1]["grads"][i][k],
                                               want[k])
                for t in range(2):
                    want_shard = shard(want, arch, 2, t)
                    for k in set(want_shard) - {"qn", "kn"}:
                        _close(got[t]["grads"][i][k], want_shard[k], f"{recompute} {schedule} {k}")
        # under the plan each chunk's attention ran as its chunk's type (microbatch 0
        # split, the backward's chunks last first)
        parts = [k for ph, k in res[0][(recompute, "kareus")]["partitions"]]
        assert "bwd_attn_c1" in parts and "bwd_attn_c0" in parts


if __name__ == "__main__":
    _worker(sys.argv[1], bool(int(sys.argv[2])))
