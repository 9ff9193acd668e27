"""The planned layers of kareus.integrations on one GPU: fed, and as fast as one graph of the step?

A framework that hands its decoder layers to kareus (``kareus.integrations``) runs them
as autograd nodes: per layer (``PlannedLayer``, one node each) or as one
``PlannedStack``. This bench runs one iteration (``--microbatches`` microbatches, forward
and backward through the layers, each microbatch in its ``applier.microbatch`` scopes) on
one GPU, the group stood in for by the loopback collective, for each (mode, schedule):

* mode: ``layers`` (one node per layer) or ``stack`` (one node for all), each
  - eager (``PlanApplier(graphs=False)``),
  - ``+graphs``: replayed from the applier's own CUDA graphs (``graphs=True``),
  - ``@step``: eager layers inside **one CUDA graph of the step** (forward and backward of
    every microbatch captured together by ``torch.cuda.graph``, the weight gradients
    accumulated in place inside it), as torchtitan's default step capture or a user's own
    ``torch.cuda.graph`` runs them: the planned layers launch into that capture;
  (``--modes`` picks some; ``--no-graphs`` leaves out both graphed kinds);
* schedule: ``sequential``, ``nanobatching`` and ``kareus`` under a **synthetic** plan
  (``kareus.testing.make_workload_plan``: every partition type at its second slot with 8
  SMs): the figure is of the execution path, not of a searched plan (the loopback does
  not cap SMs anyway).

``--rows`` runs several shapes in one go (``LAYERS:MBSxSEQ`` each, e.g. the issue's
``4:4x4096,8:8x4096,14:8x4096``); the rows of one shape are timed in interleaved rounds
(a shuffled order per round). ``--issue-table`` is the whole comparison of own graphs
against one graph of the step: those three shapes, the modes ``layers+graphs``,
``stack+graphs``, ``layers@step``, ``stack@step``, 3 rounds, the GPU-only figure left
out (busy fractions kept): sized to finish within 8 minutes on one H200 (not yet timed
there; the wall time is printed and written to the JSON).

Per row: iteration time (device events, median over rounds), **vs step** = this row's
time over the ``@step`` row of the same layer mode and schedule (own graphs against one
graph of the step), **host ms** = the host's time to enqueue the iteration (medians over
the rounds: below the iteration time, the host ran ahead of the GPU), **lead ms** (own
graphs only) = the device time from the iteration's start event to the first graph launch
(an event recorded right before it: the host time of the first node, which the GPU waits
out; a step capture launches its one graph at once), **launch us** = the host time of
that first launch call (of the step capture's one launch in its rows;
``first_launch_host_s``), **less lead** = (time - lead) over the step's time, the
GPU-only time: the GPU's own time of the iteration (iterations enqueued behind a
sleeping kernel, so the host never holds the GPU back; ``n/a`` when the sleeping kernel ran
out before the host had enqueued them, which a host-bound iteration does), **fed** =
GPU-only / measured, kernels per iteration and the GPU-busy fraction of one profiled
iteration's span (torch.profiler, as ``bench/host_bound.py``: the union of kernel intervals
over first to last kernel). Per mode (JSON only): the memory its warm-up left reserved and
its peak allocation, every schedule of the mode together, and the graphs behind it
(``graphs``: the applier's own graphs, every copy included, or the step captures;
``graph_static_gib``: their static buffers, ``PlanApplier.graph_memory()``;
``reserved_per_graph_gib``: the reserved growth over the graphs).

Usage (one CUDA GPU; clocks are never changed)::

    python bench/planned_layers.py --json bench/results/planned_layers_h200.json
    python bench/planned_layers.py --rows 4:4x4096,8:8x4096,14:8x4096 \
        --modes layers+graphs,stack+graphs,layers@step,stack@step --json OUT.json
    python bench/planned_layers.py --issue-table --json OUT.json
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
KINDS = ("", "+graphs", "@step")
SCHEDULES = ("sequential", "nanobatching", "kareus")
#: The shapes and modes of ``--issue-table``.
ISSUE_ROWS = "4:4x4096,8:8x4096,14:8x4096"
ISSUE_MODES = "layers+graphs,stack+graphs,layers@step,stack@step"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-1.7b", help="a preset model")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--microbatch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds (each row once); default 5, 3 with --issue-table")
    ap.add_argument("--device", default=None, help="default: cuda when present")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model (hidden 64) for a smoke run of the code path")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-graphs", action="store_true",
                    help="leave out the graphed rows, own and step (they need a CUDA GPU)")
    ap.add_argument("--modes", default=None,
                    help="comma-separated modes to run (default: every one the device "
                         "runs): " + ", ".join(m + k for k in KINDS for m in MODES))
    ap.add_argument("--rows", default=None,
                    help="shapes LAYERS:MBSxSEQ, comma-separated (e.g. "
                         "4:4x4096,8:8x4096,14:8x4096); default: --layers, "
                         "--microbatch-size x --seq-len")
    ap.add_argument("--issue-table", action="store_true",
                    help="the three shapes of the own-graphs-against-step table (" +
                    ISSUE_ROWS + "), graphed and step modes, 3 rounds, no GPU-only figure")
    ap.add_argument("--no-gpu-only", action="store_true",
                    help="leave out the GPU-only time (iterations behind a sleeping kernel)")
    ap.add_argument("--gpu-only", action="store_true",
                    help="with --issue-table: keep the GPU-only time")
    args = ap.parse_args(argv)
    if args.issue_table:
        args.rows = args.rows or ISSUE_ROWS
        args.modes = args.modes or ISSUE_MODES
        args.no_gpu_only = not args.gpu_only
    if args.rounds is None:
        args.rounds = 3 if args.issue_table else 5
    return args


def _shapes(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """``(layers, microbatch_size, seq_len)`` of each shape ``--rows`` asks for."""
    if not args.rows:
        return [(args.layers, args.microbatch_size, args.seq_len)]
    out = []
    for item in args.rows.split(","):
        try:
            layers, rest = item.split(":")
            mbs, seq = rest.lower().split("x")
            out.append((int(layers), int(mbs), int(seq)))
        except ValueError:
            raise SystemExit(f"--rows: {item!r} is not LAYERS:MBSxSEQ (e.g. 8:8x4096)") from None
    return out


def _modes(args: argparse.Namespace, cuda: bool) -> list[str]:
    kinds = KINDS if cuda and not args.no_graphs else ("",)
    every = [m + k for k in kinds for m in MODES]
    if args.modes is None:
        return every
    asked = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in asked if m not in every]
    if bad:
        raise SystemExit(f"--modes: {bad} not among {every} (graphed modes need a CUDA GPU)")
    return asked


def _workload(args: argparse.Namespace, layers: int, mbs: int, seq: int) -> Any:
    from kareus.model.workload import ModelArch, Parallelism, Workload

    if args.tiny:
        arch = ModelArch(name="tiny", layers=layers, hidden=64, heads=8, kv_heads=4,
                         head_dim=8, ffn=128, vocab=100)
        return Workload(model=arch, parallelism=Parallelism(tp=args.tp, cp=args.cp),
                        microbatch_size=4, seq_len=32, num_microbatches=args.microbatches,
                        nanobatches=2)
    return Workload.preset(args.model, tp=args.tp, cp=args.cp, microbatch_size=mbs,
                           seq_len=seq, num_microbatches=args.microbatches, nanobatches=2)


def _weights(torch: Any, wl: Any, layers: int, device: Any, dtype: Any) -> list[dict[str, Any]]:
    """This rank's shard of ``layers`` layers' weights, in kareus's layout."""
    a, tp = wl.model, wl.parallelism.tp
    q, kv, f = a.heads // tp * a.head_dim, a.kv_heads // tp * a.head_dim, a.ffn // tp
    shapes = {"w_attn_norm": (a.hidden,), "Wqkv": (a.hidden, q + 2 * kv), "Wo": (q, a.hidden),
              "w_mlp_norm": (a.hidden,), "Wg": (a.hidden, f), "Wu": (a.hidden, f),
              "Wd": (f, a.hidden)}
    if a.qk_norm:  # Qwen3's per-head query and key norms
        shapes.update({"w_q_norm": (a.head_dim,), "w_k_norm": (a.head_dim,)})
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
        self.forward_backward(schedule)
        for w in self.weights:  # the optimizer's zero_grad, so grads do not pile up
            for t in w.values():
                t.grad = None

    def forward_backward(self, schedule: str) -> None:
        """Forward and backward of every microbatch (the gradients accumulate)."""
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


class StepCapture:
    """One CUDA graph of the step around eager planned layers: the gradients zeroed, then
    the forward and backward of every microbatch (``Iteration.forward_backward``),
    captured by ``torch.cuda.graph`` after a warm-up on a side stream (PyTorch's recipe for
    whole-network capture), the weight gradients accumulated in place inside it. The
    planned layers see the capture and launch into it."""

    def __init__(self, torch: Any, it: Iteration) -> None:
        self.torch, self.it = torch, it
        self.graphs: dict[str, Any] = {}
        self.grads: list[Any] = []  # the gradients the graphs write (kept alive here)
        self.launch_s: float | None = None

    def _body(self, schedule: str) -> None:
        for t in self.grads:
            t.zero_()
        self.it.forward_backward(schedule)

    def step(self, schedule: str) -> None:
        g = self.graphs.get(schedule)
        if g is None:
            g = self.graphs[schedule] = self._capture(schedule)
        t0 = time.perf_counter()
        g.replay()
        self.launch_s = time.perf_counter() - t0  # the host time of the launch call

    def _capture(self, schedule: str) -> Any:
        torch = self.torch
        if not self.grads:
            for w in self.it.weights:
                for t in w.values():
                    t.grad = torch.zeros_like(t)
                    self.grads.append(t.grad)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(schedule)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._body(schedule)
        return g


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:  # as a graphed PlanApplier asks, but before any GEMM of the eager rows
        from kareus.exec import prefer_workspace_free_gemms

        prefer_workspace_free_gemms()
    modes = _modes(args, cuda)
    shapes = _shapes(args)
    out_rows: list[dict[str, Any]] = []
    workloads = []
    started = time.perf_counter()
    for layers, mbs, seq in shapes:
        wl = _workload(args, layers, mbs, seq)
        workloads.append(wl.to_dict())
        t0 = time.perf_counter()
        rows = _measure_shape(torch, args, wl, layers, modes, device)
        _print(rows, wl, args, layers, cuda)
        print(f"({time.perf_counter() - t0:.0f} s)\n")
        out_rows += rows
        if cuda:  # this shape's graphs and buffers go (the appliers and runners refer
            # to each other: a collection frees them) before the next shape's
            import gc

            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if args.json is not None:
        result = {"command": "python bench/planned_layers.py " + " ".join(argv or sys.argv[1:]),
                  "date": datetime.date.today().isoformat(), "workloads": workloads,
                  "rounds": args.rounds,
                  "plan": "synthetic (kareus.testing.make_workload_plan, slot 1, 8 SMs)",
                  "collective": "loopback (one GPU stands in for the group; SM caps not "
                                "applied)",
                  "rows": out_rows, "wall_s": time.perf_counter() - started}
        if cuda:
            from host_bound import _versions

            result["machine"] = _versions()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    return 0


def _measure_shape(torch: Any, args: argparse.Namespace, wl: Any, layers: int,
                   modes: list[str], device: Any) -> list[dict[str, Any]]:
    """Every (mode, schedule) row of one shape, timed in interleaved rounds."""
    from kareus.exec.train import LoopbackGroups, make_collectives
    from kareus.integrations import PlanApplier
    from kareus.testing import make_workload_plan

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    p = wl.parallelism
    groups = LoopbackGroups(tp=p.tp, cp=p.cp)
    capped, default, _ = make_collectives(groups, backend="loopback")
    plan = make_workload_plan(wl, sms=8)
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (wl.microbatch_size, wl.seq_len // p.cp, wl.model.hidden)
    xs = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(args.microbatches)]
    dys = [torch.randn(shape, generator=g).to(device, dtype) * 1e-3 for _ in xs]
    its: dict[str, Any] = {}
    for mode in modes:
        own = mode.endswith("+graphs")
        appliers = {s: PlanApplier(workload=wl, groups=groups, plan=plan, schedule=s,
                                   collective=capped, default_collective=default,
                                   kernels=None if cuda else "torch", graphs=own,
                                   eps=wl.model.norm_eps,
                                   whole_step_capture=mode.endswith("@step"))
                    for s in SCHEDULES}
        # each mode its own weights (the same values): a step graph owns its gradients
        it = Iteration(torch, appliers, mode.split("+")[0].split("@")[0],
                       _weights(torch, wl, layers, device, dtype), xs, dys)
        its[mode] = StepCapture(torch, it) if mode.endswith("@step") else it

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    clock = _Clock(torch, its, cuda)
    timed = clock.timed
    rows = [(m, s) for m in its for s in SCHEDULES]
    # warm-up: programs, buffers, kernels' first launches, captures (a step capture
    # warms its planned layers up on a side stream, outside the capture, first); per
    # mode, the memory its warm-up leaves reserved (programs, graphs and their pools, and
    # the caching allocator's blocks) and its peak allocation
    memory: dict[str, dict[str, float]] = {}
    for m in its:
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_reserved()
        for s in SCHEDULES:
            timed(m, s)
        if cuda:
            sync()
            growth = (torch.cuda.memory_reserved() - before) / 2**30
            memory[m] = {"reserved_growth_gib": growth,
                         "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                         **_graph_memory(its[m], growth)}
    times: dict[tuple[str, str], list[float]] = {r: [] for r in rows}
    clock.hosts.clear()  # the rounds' only
    clock.leads.clear()
    clock.launches.clear()
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = rows[:]
        rng.shuffle(order)
        for r in order:
            times[r].append(timed(*r))
    out_rows = []
    for m, s in rows:
        row: dict[str, Any] = {"layers": layers, "microbatch_size": wl.microbatch_size,
                               "seq_len": wl.seq_len, "microbatches": args.microbatches,
                               "mode": m, "schedule": s, **memory.get(m, {}),
                               "iteration_s": statistics.median(times[(m, s)]),
                               "iteration_s_all": times[(m, s)]}
        if (m, s) in clock.hosts:
            row["host_s"] = statistics.median(clock.hosts[(m, s)])
        if (m, s) in clock.leads:
            row["lead_s"] = statistics.median(clock.leads[(m, s)])
        if (m, s) in clock.launches:
            row["first_launch_host_s"] = statistics.median(clock.launches[(m, s)])
        if cuda:
            row.update(_device_figures(torch, args, its[m], s, row["iteration_s"]))
        out_rows.append(row)
    _versus_step(out_rows)
    return out_rows


def _versus_step(rows: list[dict[str, Any]]) -> None:
    """Each row's time over the ``@step`` row of its layer mode and schedule (own graphs,
    or eager, against one graph of the step), with and without its lead."""
    by = {(r["mode"], r["schedule"]): r for r in rows}
    for r in rows:
        base = r["mode"].split("+")[0].split("@")[0]
        step = by.get((base + "@step", r["schedule"]))
        r["vs_step"] = (r["iteration_s"] / step["iteration_s"]
                        if step is not None and not r["mode"].endswith("@step") else None)
        if r["vs_step"] is not None and "lead_s" in r:
            r["vs_step_less_lead"] = (r["iteration_s"] - r["lead_s"]) / step["iteration_s"]


class _Clock:
    """One iteration of a (mode, schedule), timed from an idle device: device events
    around it (host time on the CPU), and on a GPU the host's time to enqueue it and, for
    the applier's own graphs, the lead to its first graph launch (``_LeadProbe``)."""

    def __init__(self, torch: Any, its: dict[str, Any], cuda: bool) -> None:
        self.torch, self.its, self.cuda = torch, its, cuda
        self.probes = {m: _LeadProbe(torch, it) for m, it in its.items()
                       if cuda and m.endswith("+graphs")}
        self.hosts: dict[tuple[str, str], list[float]] = {}
        self.leads: dict[tuple[str, str], list[float]] = {}
        self.launches: dict[tuple[str, str], list[float]] = {}

    def timed(self, mode: str, schedule: str) -> float:
        torch, step = self.torch, self.its[mode].step
        if not self.cuda:
            t0 = time.perf_counter()
            step(schedule)
            return time.perf_counter() - t0
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        probe = self.probes.get(mode)
        if probe is not None:
            probe.arm()
        a.record()
        t0 = time.perf_counter()
        step(schedule)
        host = time.perf_counter() - t0
        b.record()
        b.synchronize()
        self.hosts.setdefault((mode, schedule), []).append(host)
        if probe is not None and probe.event is not None:
            self.leads.setdefault((mode, schedule), []).append(
                a.elapsed_time(probe.event) / 1e3)
            self.launches.setdefault((mode, schedule), []).append(probe.launch_s)
        elif isinstance(self.its[mode], StepCapture):
            self.launches.setdefault((mode, schedule), []).append(self.its[mode].launch_s)
        return a.elapsed_time(b) / 1e3


class _LeadProbe:
    """The device time from an iteration's start to its first graph launch, for the
    applier's own graphs: while armed, the next graph launch of any of the mode's appliers
    first records a CUDA event on the stream it launches on (the GPU, idle since the start
    event, reaches it as soon as the host enqueues it). The appliers' stream backends'
    ``replay`` is wrapped on the instance."""

    def __init__(self, torch: Any, it: Any) -> None:
        self.torch, self.event, self.armed = torch, None, False
        self.launch_s: float | None = None  # the host time of that launch call
        seen: set[int] = set()
        for applier in it.appliers.values():
            for ex in (applier.baseline, applier.executor):
                streams = getattr(ex, "streams", None)
                if streams is None or id(streams) in seen:
                    continue
                seen.add(id(streams))
                streams.replay = self._wrap(streams.replay)

    def _wrap(self, replay: Any) -> Any:
        def first_launch(graph: Any) -> None:
            if not self.armed:
                replay(graph)
                return
            self.armed = False
            self.event = self.torch.cuda.Event(enable_timing=True)
            self.event.record()
            t0 = time.perf_counter()
            replay(graph)
            self.launch_s = time.perf_counter() - t0
        return first_launch

    def arm(self) -> None:
        self.armed, self.event, self.launch_s = True, None, None


def _device_figures(torch: Any, args: argparse.Namespace, it: Any, schedule: str,
                    iteration_s: float) -> dict[str, Any]:
    """The GPU-only time and fed fraction (unless ``--no-gpu-only``), and the kernels and
    busy fraction of one profiled iteration."""
    from host_bound import _profile_iteration, _queued_time_s

    out: dict[str, Any] = {}
    if not args.no_gpu_only:
        gpu_s, fed_ok = _queued_time_s(torch, lambda: it.step(schedule), 2)
        # GPU-only time is reliable only when the sleeping kernel outlasted the
        # enqueueing (a host-bound iteration enqueues slower than it assumes)
        out.update(gpu_only_s=gpu_s if fed_ok else None, gpu_only_reliable=fed_ok,
                   fed=min(1.0, gpu_s / iteration_s) if fed_ok else None)
    out.update(**_profile_iteration(torch, _Stepper(it), schedule))
    return out


def _graph_memory(it: Any, growth_gib: float) -> dict[str, Any]:
    """The graphs behind one mode: its appliers' own (``PlanApplier.graph_memory``) or its
    step captures, their static buffers and the reserved growth per graph."""
    if isinstance(it, StepCapture):
        n, static, lending = len(it.graphs), 0, 0
    else:
        mems = [a.graph_memory() for a in it.appliers.values()]
        n = sum(m.graphs for m in mems)
        static = sum(m.static_bytes for m in mems)
        lending = sum(m.lending for m in mems)
    return {"graphs": n, "graphs_lending": lending, "graph_static_gib": static / 2**30,
            "reserved_per_graph_gib": growth_gib / n if n else None}


class _Stepper:
    """``step(schedule)`` of one mode, for the profiler helper."""

    def __init__(self, it: Any) -> None:
        self.it = it

    def step(self, schedule: str) -> None:
        self.it.step(schedule)


def _print(rows: list[dict[str, Any]], wl: Any, args: argparse.Namespace, layers: int,
           cuda: bool) -> None:
    p = wl.parallelism
    print(f"{wl.model.name} TP={p.tp} CP={p.cp}, {layers} layers, {args.microbatches} "
          f"microbatches of {wl.microbatch_size} x {wl.seq_len}; loopback; synthetic plan")
    head = f"{'mode':<13} {'schedule':<13} {'iteration ms':>12} {'vs step':>7}"
    if cuda:
        head += (f" {'host ms':>7} {'lead ms':>7} {'launch us':>9} {'less lead':>9}"
                 f" {'GPU-only ms':>11} {'fed':>5} {'busy':>5} {'kernels':>7}")
    print(head)
    for r in rows:
        vs = r.get("vs_step")
        line = (f"{r['mode']:<13} {r['schedule']:<13} {1e3 * r['iteration_s']:>12.3f} "
                f"{'' if vs is None else f'{vs:.3f}':>7}")
        if cuda:
            busy, gpu, fed = r.get("busy"), r.get("gpu_only_s"), r.get("fed")
            host, lead, less = r.get("host_s"), r.get("lead_s"), r.get("vs_step_less_lead")
            launch = r.get("first_launch_host_s")
            line += (f" {'' if host is None else f'{1e3 * host:.3f}':>7}"
                     f" {'' if lead is None else f'{1e3 * lead:.3f}':>7}"
                     f" {'' if launch is None else f'{1e6 * launch:.1f}':>9}"
                     f" {'' if less is None else f'{less:.3f}':>9}"
                     f" {'n/a' if gpu is None else f'{1e3 * gpu:.3f}':>11} "
                     f"{'n/a' if fed is None else f'{fed:.2f}':>5} "
                     f"{'n/a' if busy is None else f'{busy:.2f}':>5} "
                     f"{r.get('kernels', 0):>7}")
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
