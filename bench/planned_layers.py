"""The planned layers of kareus.integrations on one GPU: is a framework's eager layer fed?

A framework that hands its decoder layers to kareus (``kareus.integrations``) runs them
eagerly, as autograd nodes: per layer (``PlannedLayer``, one node each) or as one
``PlannedStack``. This bench runs one iteration (``--microbatches`` microbatches, forward
and backward through ``--layers`` layers, each microbatch in its ``applier.microbatch``
scopes) on one GPU, the group stood in for by the loopback collective, for each
(mode, schedule):

* mode: ``layers`` (one node per layer) or ``stack`` (one node for all), each eager and,
  on a GPU, replayed from CUDA graphs (``layers+graphs``, ``stack+graphs``:
  ``PlanApplier(graphs=True)``; ``--no-graphs`` leaves those rows out);
* schedule: ``sequential``, ``nanobatching`` and ``kareus`` under a **synthetic** plan
  (``kareus.testing.make_workload_plan``: every partition type at its second slot with 8
  SMs): the figure is of the execution path, not of a searched plan (the loopback does
  not cap SMs anyway).

Per row: iteration time (device events, median over rounds in a shuffled order), the
GPU's own time of the iteration (iterations enqueued behind a sleeping kernel, so the host
never holds the GPU back; ``n/a`` when the sleeping kernel ran out before the host had
enqueued them, which a host-bound iteration does), **fed** = GPU-only / measured, kernels
per iteration and the GPU-busy fraction of one profiled iteration's span (torch.profiler,
as ``bench/host_bound.py``: the union of kernel intervals over first to last kernel).

Usage (one CUDA GPU; clocks are never changed)::

    python bench/planned_layers.py --json bench/results/planned_layers_h200.json
    python bench/planned_layers.py --device cpu --tiny   # a smoke run of the code path

Prints a table and writes JSON (``--json``): machine, driver, torch, every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
for _p in (str(_REPO), str(_REPO / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast

MODES = ("layers", "stack")
SCHEDULES = ("sequential", "nanobatching", "kareus")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-1.7b", help="a preset model")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each row once)")
    ap.add_argument("--device", default=None, help="default: cuda when present")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model (hidden 64) for a smoke run of the code path")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-graphs", action="store_true",
                    help="leave out the graphed rows (they need a CUDA GPU)")
    return ap.parse_args(argv)


def _workload(args: argparse.Namespace) -> Any:
    from kareus.model.workload import ModelArch, Parallelism, Workload

    if args.tiny:
        arch = ModelArch(name="tiny", layers=args.layers, hidden=64, heads=8, kv_heads=4,
                         head_dim=8, ffn=128, vocab=100)
        return Workload(model=arch, parallelism=Parallelism(tp=args.tp, cp=args.cp),
                        microbatch_size=4, seq_len=32, num_microbatches=args.microbatches,
                        nanobatches=2)
    return Workload.preset(args.model, tp=args.tp, cp=args.cp,
                           microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                           num_microbatches=args.microbatches, nanobatches=2)


def _weights(torch: Any, wl: Any, layers: int, device: Any, dtype: Any) -> list[dict[str, Any]]:
    """This rank's shard of ``layers`` layers' weights, in kareus's layout."""
    a, tp = wl.model, wl.parallelism.tp
    q, kv, f = a.heads // tp * a.head_dim, a.kv_heads // tp * a.head_dim, a.ffn // tp
    shapes = {"w_attn_norm": (a.hidden,), "Wqkv": (a.hidden, q + 2 * kv), "Wo": (q, a.hidden),
              "w_mlp_norm": (a.hidden,), "Wg": (a.hidden, f), "Wu": (a.hidden, f),
              "Wd": (f, a.hidden)}
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(layers):
        w = {}
        for name, shape in shapes.items():
            t = (torch.ones(shape) if len(shape) == 1
                 else torch.randn(shape, generator=g) * 0.02)
            w[name] = t.to(device, dtype).requires_grad_(True)
        out.append(w)
    return out


class Iteration:
    """One iteration of planned layers under each schedule (``step(schedule)``)."""

    def __init__(self, torch: Any, appliers: dict[str, Any], mode: str, weights: Any,
                 xs: list[Any], dys: list[Any]) -> None:
        self.torch, self.appliers, self.mode = torch, appliers, mode
        self.weights, self.xs, self.dys = weights, xs, dys

    def step(self, schedule: str) -> None:
        applier = self.appliers[schedule]
        for mb, (x, dy) in enumerate(zip(self.xs, self.dys, strict=True)):
            with applier.microbatch(mb, "fwd"):
                if self.mode == "stack":
                    y = applier.stack(len(self.weights))(x, self.weights)
                else:
                    layer, y = applier.layer(), x
                    for w in self.weights:
                        y = layer(y, w)
            with applier.microbatch(mb, "bwd"):
                y.backward(dy)
        for w in self.weights:  # the optimizer's zero_grad, so grads do not pile up
            for t in w.values():
                t.grad = None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from kareus.exec.train import LoopbackGroups, make_collectives
    from kareus.integrations import PlanApplier
    from kareus.testing import make_workload_plan

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:  # as a graphed PlanApplier asks, but before any GEMM of the eager rows
        from kareus.exec import prefer_workspace_free_gemms

        prefer_workspace_free_gemms()
    dtype = torch.bfloat16 if cuda else torch.float32
    wl = _workload(args)
    p = wl.parallelism
    groups = LoopbackGroups(tp=p.tp, cp=p.cp)
    capped, default, _ = make_collectives(groups, backend="loopback")
    plan = make_workload_plan(wl, sms=8)
    graphs = (False, True) if cuda and not args.no_graphs else (False,)
    appliers = {g: {s: PlanApplier(workload=wl, groups=groups, plan=plan, schedule=s,
                                   collective=capped, default_collective=default,
                                   kernels=None if cuda else "torch", graphs=g)
                    for s in SCHEDULES} for g in graphs}
    weights = _weights(torch, wl, args.layers, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (wl.microbatch_size, wl.seq_len // p.cp, wl.model.hidden)
    xs = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(args.microbatches)]
    dys = [torch.randn(shape, generator=g).to(device, dtype) * 1e-3 for _ in xs]
    its = {m + ("+graphs" if g else ""): Iteration(torch, appliers[g], m, weights, xs, dys)
           for g in graphs for m in MODES}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(mode: str, schedule: str) -> float:
        sync()
        if not cuda:
            t0 = time.perf_counter()
            its[mode].step(schedule)
            return time.perf_counter() - t0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        its[mode].step(schedule)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    rows = [(m, s) for m in its for s in SCHEDULES]
    for m, s in rows:  # warm-up: programs, buffers, kernels' first launches, captures
        timed(m, s)
    times: dict[tuple[str, str], list[float]] = {r: [] for r in rows}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = rows[:]
        rng.shuffle(order)
        for r in order:
            times[r].append(timed(*r))
    out_rows = []
    for m, s in rows:
        row: dict[str, Any] = {"mode": m, "schedule": s,
                               "iteration_s": statistics.median(times[(m, s)]),
                               "iteration_s_all": times[(m, s)]}
        if cuda:
            from host_bound import _profile_iteration, _queued_time_s

            gpu_s, fed_ok = _queued_time_s(torch, lambda m=m, s=s: its[m].step(s), 2)
            # GPU-only time is reliable only when the sleeping kernel outlasted the
            # enqueueing (a host-bound iteration enqueues slower than the estimate assumes)
            row.update(gpu_only_s=gpu_s if fed_ok else None, gpu_only_reliable=fed_ok,
                       fed=min(1.0, gpu_s / row["iteration_s"]) if fed_ok else None,
                       **_profile_iteration(torch, _Stepper(its[m]), s))
        out_rows.append(row)
    _print(out_rows, wl, args, cuda)
    if args.json is not None:
        result = {"command": "python bench/planned_layers.py " + " ".join(argv or sys.argv[1:]),
                  "date": datetime.date.today().isoformat(), "workload": wl.to_dict(),
                  "layers": args.layers, "rounds": args.rounds,
                  "plan": "synthetic (kareus.testing.make_workload_plan, slot 1, 8 SMs)",
                  "collective": "loopback (one GPU stands in for the group; SM caps not "
                                "applied)",
                  "rows": out_rows}
        if cuda:
            from host_bound import _versions

            result["machine"] = _versions()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


class _Stepper:
    """``step(schedule)`` of one mode, for the profiler helper."""

    def __init__(self, it: Iteration) -> None:
        self.it = it

    def step(self, schedule: str) -> None:
        self.it.step(schedule)


def _print(rows: list[dict[str, Any]], wl: Any, args: argparse.Namespace, cuda: bool) -> None:
    p = wl.parallelism
    print(f"{wl.model.name} TP={p.tp} CP={p.cp}, {args.layers} layers, {args.microbatches} "
          f"microbatches of {wl.microbatch_size} x {wl.seq_len}; loopback; synthetic plan")
    head = f"{'mode':<13} {'schedule':<13} {'iteration ms':>12}"
    if cuda:
        head += f" {'GPU-only ms':>11} {'fed':>5} {'busy':>5} {'kernels':>7}"
    print(head)
    for r in rows:
        line = f"{r['mode']:<13} {r['schedule']:<13} {1e3 * r['iteration_s']:>12.3f}"
        if cuda:
            busy, gpu, fed = r.get("busy"), r.get("gpu_only_s"), r.get("fed")
            line += (f" {'n/a' if gpu is None else f'{1e3 * gpu:.3f}':>11} "
                     f"{'n/a' if fed is None else f'{fed:.2f}':>5} "
                     f"{'n/a' if busy is None else f'{busy:.2f}':>5} "
                     f"{r.get('kernels', 0):>7}")
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
