"""Host time per planned-layer node on the applier's own graphs, measured on the CPU.

A planned layer replayed from CUDA graphs (``PlanApplier(graphs=True)``) costs the GPU one
graph launch per node, and the host everything around it: the autograd function, the
plan lookups, the graph's key, the checks that the inputs and weights lie where the graph
reads them, the lending bookkeeping of its static outputs, the replay call. Where that
host time exceeds the GPU time of the node (a small model: about 1 ms per layer node for
Qwen3-1.7B TP=4 CP=2 at 4 x 4096 on an H200, ``bench/planned_layers.py``), the GPU waits.

This bench measures that host time **without a GPU** (emulated: no CUDA call is made): the
applier's default executors on a stand-in stream backend whose graphs are captured as the
real ones are (the bodies run twice, then once "captured") and whose replay launches
nothing (``GraphSequence`` and everything above it run as on a GPU; the CUDA graph
launch itself is not in the figures, nor the CUDA copy kernels' launch cost: a copy of a
tiny CPU tensor stands in for each). The model is tiny (hidden 64, Qwen3's layout with
query/key norms), so the tensor work on the host is negligible against the Python around
it. With ``--device cuda`` (a GPU) it measures the real path instead: the applier's
default executors and their CUDA graphs, replayed, with heads of 64 (hidden 512), whose
GPU work is shorter than the host's, so the figures are the host's alone. Per schedule
(``sequential``, ``nanobatching``, ``kareus``
under the synthetic plan of ``kareus.testing.make_workload_plan``) and mode (``layers``:
one node per layer; ``stack``: one node for every layer), per node: the forward's host
microseconds (time of the layer call), the backward's (the autograd engine's backward of
the microbatch over its nodes), the **lead** (host time from the iteration's start through
its first node: what the GPU waits out before its first launch when the iteration starts
on an idle GPU, as ``bench/planned_layers.py`` times it), medians over ``--rounds`` timed
iterations after warm-up. Beside them, the **bare node** row: an autograd function with the
same inputs that does nothing but what any autograd node of a layer does (saves its input
and weights, hands out an output and preallocated weight gradients, which autograd
accumulates into ``.grad`` as it does the planned layers'): the floor of what a node
costs the host whoever runs it, for comparison. ``--profile`` prints the cProfile top
functions of one mode and schedule.

Usage::

    python bench/host_overhead.py                       # table
    python bench/host_overhead.py --json bench/results/host_overhead_cpu.json
    python bench/host_overhead.py --profile layers:kareus
    python bench/host_overhead.py --device cuda --json bench/results/host_overhead_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

SCHEDULES = ("sequential", "nanobatching", "kareus")
MODES = ("layers", "stack")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=200, help="timed iterations per row")
    ap.add_argument("--warmup", type=int, default=5, help="iterations before timing")
    ap.add_argument("--recompute", default="full", choices=("full", "selective", "none"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the applier's own CUDA graphs, replayed for real (a model "
                         "with heads of 64; the host time of the real path: graph "
                         "launches and copy kernels included)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", default=None, metavar="MODE:SCHEDULE",
                    help="print cProfile's top functions of that row (e.g. layers:kareus)")
    ap.add_argument("--top", type=int, default=30, help="functions --profile prints")
    return ap.parse_args(argv)


def _stand_in_executor_class() -> Any:
    """A ``TorchExecutor`` whose graphs replay nothing: its streams are a recording stand-in
    that says its graphs share one pool (as the applier's default streams on a GPU under
    full recomputation) and replays a graph as a no-op, so ``GraphSequence.replay`` and
    everything above it run as they do on a GPU."""
    from kareus.exec.executor import RecordingStreamBackend, TorchExecutor

    class _Graph:
        pass

    class StandInStreams(RecordingStreamBackend):
        shares_graph_pool = True

        def __init__(self, shared: bool) -> None:
            super().__init__()
            self.shares_graph_pool = shared
            self._capture_depth = 0

        def record_event(self, stream: Any) -> Any:  # no log search: O(1) per event
            self.log.clear()
            return super().record_event(stream)

        @contextlib.contextmanager
        def capture(self, pool: Any, *, name: str) -> Any:
            yield _Graph()

        def replay(self, graph: Any) -> None:
            pass

    class StandInExecutor(TorchExecutor):
        def __init__(self, *, shared: bool, **kw: Any) -> None:
            super().__init__(streams=StandInStreams(shared), graphs=True, **kw)

    return StandInExecutor


def _setup(args: argparse.Namespace, schedule: str) -> tuple[Any, Any, Any]:
    import torch

    from kareus.exec.train import LoopbackGroups, make_collectives
    from kareus.integrations import PlanApplier
    from kareus.model.workload import ModelArch, Parallelism, Workload
    from kareus.testing import make_workload_plan

    cuda = args.device == "cuda"
    # on a GPU, heads of 64 (the fused attention kernels' sizes), still a small model
    hd = 64 if cuda else 8
    arch = ModelArch(name="tiny-qwen3", layers=args.layers, hidden=8 * hd, heads=8,
                     kv_heads=8, head_dim=hd, ffn=16 * hd, vocab=100, qk_norm=True,
                     norm_eps=1e-6)
    wl = Workload(model=arch, parallelism=Parallelism(tp=4, cp=2), microbatch_size=4,
                  seq_len=32, num_microbatches=args.microbatches, nanobatches=2,
                  recompute=args.recompute)
    groups = LoopbackGroups(tp=4, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    plan = make_workload_plan(wl, sms=8)
    if cuda:  # the applier's default executors: CUDA graphs, replayed for real
        applier = PlanApplier(workload=wl, groups=groups, plan=plan, schedule=schedule,
                              collective=capped, default_collective=default, eps=1e-6,
                              graphs=True)
    else:
        ex_cls = _stand_in_executor_class()
        shared = args.recompute == "full"
        applier = PlanApplier(
            workload=wl, groups=groups, plan=plan, schedule=schedule, kernels="torch",
            eps=1e-6, graphs=True,
            baseline=ex_cls(shared=shared, collective=default, default_collective=default),
            executor=ex_cls(shared=shared, collective=capped, default_collective=default,
                            plan=plan))
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    a = wl.model
    q, kv, f = a.heads // 4 * a.head_dim, a.kv_heads // 4 * a.head_dim, a.ffn // 4
    shapes = {"w_attn_norm": (a.hidden,), "Wqkv": (a.hidden, q + 2 * kv), "Wo": (q, a.hidden),
              "w_mlp_norm": (a.hidden,), "Wg": (a.hidden, f), "Wu": (a.hidden, f),
              "Wd": (f, a.hidden), "w_q_norm": (a.head_dim,), "w_k_norm": (a.head_dim,)}
    weights = [{n: (torch.randn(s, generator=g) * 0.02).to(device, dtype).requires_grad_(True)
                for n, s in shapes.items()} for _ in range(args.layers)]
    shape = (wl.microbatch_size, wl.seq_len // 2, a.hidden)
    data = [(torch.randn(shape, generator=g).to(device, dtype),
             torch.randn(shape, generator=g).to(device, dtype))
            for _ in range(args.microbatches)]
    return applier, weights, data


class _Timer:
    """Host seconds of each forward node and each microbatch's backward."""

    def __init__(self) -> None:
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.scope: list[float] = []
        self.lead: list[float] = []


class _BareApplier:
    """Stands in for a ``PlanApplier`` in ``_iteration``: nodes of the bare autograd
    function (``_bare_function``), a scope that does nothing."""

    def __init__(self, torch: Any, weights: Any, x: Any) -> None:
        self.fn = _bare_function(torch)
        self.out = torch.empty_like(x)
        self.dx = torch.empty_like(x)
        self.grads = [[torch.zeros_like(p) for p in w.values()] for w in weights]

    @contextlib.contextmanager
    def microbatch(self, mb: int, phase: str) -> Any:
        yield None

    def layer(self) -> Any:
        return lambda y, w: self.fn.apply(self, 1, None, False, y, *w.values())

    def stack(self, layers: int) -> Any:
        return lambda y, ws: self.fn.apply(self, layers, None, False, y,
                                           *(p for w in ws for p in w.values()))


def _bare_function(torch: Any) -> Any:
    class BareNode(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, applier: Any, layers: int, positions: Any, documents: bool,
                    x: Any, *weights: Any) -> Any:
            ctx.applier, ctx.layers = applier, layers
            ctx.save_for_backward(x, *weights)
            return applier.out.detach()

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            ctx.saved_tensors  # noqa: B018 - unpacked, as a planned layer's backward does
            grads = [g.detach() for gs in ctx.applier.grads[:ctx.layers] for g in gs]
            return (None, None, None, None, ctx.applier.dx.detach(), *grads)

    return BareNode


def _iteration(applier: Any, mode: str, weights: Any, data: Any, t: _Timer | None) -> None:
    clock = time.perf_counter
    start = clock()
    lead = None  # through the iteration's first node
    for mb, (x, dy) in enumerate(data):
        s0 = clock()
        with applier.microbatch(mb, "fwd"):
            s1 = clock()
            if mode == "stack":
                y = applier.stack(len(weights))(x, weights)
                if t is not None:
                    t.fwd.append(clock() - s1)
            else:
                layer, y = applier.layer(), x
                for w in weights:
                    a = clock()
                    y = layer(y, w)
                    if t is not None:
                        t.fwd.append(clock() - a)
            if lead is None:
                lead = t.fwd[-len(weights) if mode == "layers" else -1] + (s1 - start) \
                    if t is not None else 0.0
            s2 = clock()
        s3 = clock()
        with applier.microbatch(mb, "bwd"):
            s4 = clock()
            y.backward(dy)
            s5 = clock()
        s6 = clock()
        if t is not None:
            t.bwd.append(s5 - s4)
            t.scope.append((s1 - s0) + (s3 - s2) + (s4 - s3) + (s6 - s5))
    if t is not None and lead is not None:
        t.lead.append(lead)
    for w in weights:
        for p in w.values():
            p.grad = None


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (mode, schedule) row, and the bare node's: host microseconds per node."""
    import torch

    rows = []
    for mode in MODES:
        for schedule in (*SCHEDULES, "bare node"):
            applier, weights, data = _setup(args, "sequential" if schedule == "bare node"
                                            else schedule)
            runner = None
            if schedule == "bare node":
                applier = _BareApplier(torch, weights, data[0][0])
            for _ in range(args.warmup):
                _iteration(applier, mode, weights, data, None)
            runner = getattr(applier, "_runner", None)
            captures = runner.captures if runner is not None else 0
            t = _Timer()
            for _ in range(args.rounds):
                _iteration(applier, mode, weights, data, t)
            nodes = args.layers if mode == "layers" else 1
            after = runner.captures if runner is not None else 0
            rows.append({"mode": mode, "schedule": schedule, "layers": args.layers,
                         "nodes_per_phase": nodes,
                         "fwd_us_per_node": 1e6 * statistics.median(t.fwd),
                         "bwd_us_per_node": 1e6 * statistics.median(t.bwd) / nodes,
                         "lead_us": 1e6 * statistics.median(t.lead),
                         "scopes_us_per_microbatch": 1e6 * statistics.median(t.scope),
                         "graphs": (applier.graph_memory().graphs if runner is not None
                                    else 0),
                         "captures_while_timed": after - captures})
    return rows


def profile(args: argparse.Namespace, which: str) -> str:
    mode, schedule = which.split(":")
    applier, weights, data = _setup(args, schedule)
    for _ in range(args.warmup):
        _iteration(applier, mode, weights, data, None)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.rounds):
        _iteration(applier, mode, weights, data, None)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    return out.getvalue()


def _commit() -> str | None:
    """The commit of the kareus measured (its checkout's ``git rev-parse``), if any."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        print(profile(args, args.profile))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    torch.set_num_threads(1)
    rows = measure(args)
    how = ("the applier's own CUDA graphs replayed on the GPU (host time: no synchronisation "
           "inside the iteration)" if args.device == "cuda" else
           "CPU-measured with a stand-in replay (emulated: no CUDA call, no graph launch)")
    print(f"host time per planned-layer node on graphs=True, {how}; {args.layers} layers, "
          f"{args.microbatches} microbatches, recompute={args.recompute}, median of "
          f"{args.rounds} iterations")
    print(f"{'mode':<7} {'schedule':<13} {'fwd us/node':>11} {'bwd us/node':>11} "
          f"{'lead us':>8} {'scopes us/mb':>12} {'graphs':>6}")
    for r in rows:
        print(f"{r['mode']:<7} {r['schedule']:<13} {r['fwd_us_per_node']:>11.1f} "
              f"{r['bwd_us_per_node']:>11.1f} {r['lead_us']:>8.1f} "
              f"{r['scopes_us_per_microbatch']:>12.1f} {r['graphs']:>6}")
    if args.json is not None:
        result = {"command": "python bench/host_overhead.py " + " ".join(argv or sys.argv[1:]),
                  "date": datetime.date.today().isoformat(),
                  "machine": {"cpu": platform.processor() or platform.machine(),
                              "python": platform.python_version(),
                              "torch": torch.__version__},
                  "measured": how, "device": args.device, "code": _commit(), "rows": rows}
        if args.device == "cuda":
            result["machine"]["gpu"] = torch.cuda.get_device_name()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
