"""Planned layers replayed from graphs (``PlanApplier(graphs=True)``), on the CPU.

A CUDA graph cannot be captured here; a stand-in executor whose "graph" re-runs the
captured bodies on replay reads exactly what a graph reads: the static buffers the
runner copies the caller's tensors into, and the weights it reads in place. So a stale
input, a weight that should have been copied, or a capture shared by computations that
differ shows up as a wrong output or gradient against eager execution. (The clone of
the outputs and real capture are checked on a GPU: tests/integrations/test_layer_gpu.py.)
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode

from kareus.errors import ArgumentError
from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
from kareus.exec.train import LoopbackGroups, make_collectives
from kareus.integrations import PlanApplier
from kareus.testing import make_workload_plan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _reference import full_weights, planned_weights, workload


class _Pinned(TorchDispatchMode):
    """What a CUDA graph does to the tensors its work makes: every op that makes a new
    tensor makes it at the address it had when the graph was captured. Recording (the
    capture's run), each such op's result is kept in order; replaying, each such op's
    result is copied into the tensor kept for it, which is returned instead. So a
    replay overwrites what the capture made (a forward's kept activations, its outputs),
    as a graph's replay does, and whoever still holds one of those tensors sees it
    change. Views and ops that write into their inputs are left alone (they make no new
    storage)."""

    def __init__(self, kept: list[Any] | None) -> None:
        super().__init__()
        self.recording = kept is None
        self.kept: list[Any] = [] if kept is None else kept
        self.next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable or not isinstance(out, torch.Tensor):
            return out
        if self.recording:
            self.kept.append(out)
            return out
        pinned = self.kept[self.next]
        self.next += 1
        assert pinned.shape == out.shape and pinned.dtype == out.dtype, func
        pinned.copy_(out)
        return pinned


class _Rerun:
    def __init__(self, bodies, kept=None):
        self.bodies, self.kept = bodies, kept

    def replay(self, index=None):
        if self.kept is None:  # a plain re-run
            for body in self.bodies:
                body()
            return
        for body, kept in zip(self.bodies, self.kept, strict=True):
            with _Pinned(kept):
                body()


class RerunExecutor(TorchExecutor):
    """A TorchExecutor whose graphs re-run their bodies on replay (test stand-in), every
    tensor they make at the place it had at the capture (``_Pinned``), as a graph's
    replay writes it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(streams=RecordingStreamBackend(), graphs=True, **kw)
        self.captured: list[tuple[str, Any]] = []
        self.pools: list[tuple[str, Any]] = []  # the pool each capture was given (None: new)

    def capture(self, name, bodies, *, signature=None, warmup=1, pool=None):
        for _ in range(warmup):
            for body in bodies:
                body()
        kept = []
        for body in bodies:
            with _Pinned(None) as mode:
                body()
            kept.append(mode.kept)
        self.captured.append((name, signature))
        self.pools.append((name, pool))
        return _Rerun(bodies, kept)


def _same_runs(want, got):
    """Each run of ``got`` (output, input gradient, weight gradients) equals ``want``'s, to
    1e-6."""
    from _helpers import assert_runs_close  # tests/: on sys.path under pytest, not in workers

    for w, g in zip(want, got, strict=True):
        assert_runs_close(g, w, rtol=1e-6, atol=1e-6)


def _inputs(arch, seeds=(0, 1)):
    """A layer input ``[4, 8, hidden]`` a seed."""
    return [torch.randn(4, 8, arch.hidden, generator=torch.Generator().manual_seed(s))
            for s in seeds]


def _params(arch, seeds=(1, 2)):
    """A layer's weights a seed (``full_weights``), as parameters."""
    return [{k: torch.nn.Parameter(v) for k, v in full_weights(arch, s).items()}
            for s in seeds]


def _applier(wl, *, graphs, plan=None, schedule=None):
    groups = LoopbackGroups(tp=wl.parallelism.tp, cp=wl.parallelism.cp)
    capped, default, _ = make_collectives(groups, backend="loopback")
    kw: dict[str, Any] = {}
    if graphs:
        kw["baseline"] = RerunExecutor(collective=default, default_collective=default)
        if plan is not None:
            kw["executor"] = RerunExecutor(collective=capped, default_collective=default,
                                           plan=plan)
    return PlanApplier(workload=wl, groups=groups, plan=plan, schedule=schedule,
                       kernels="torch", graphs=graphs, **kw)


def _run(applier, params, xs, *, plan):
    """Two microbatches through a stack of two layers; the weights change in place
    between them (an optimizer step). Returns outputs, input and weight gradients."""
    arch = applier.workload.model
    outs = []
    for mb, x0 in enumerate(xs):
        x = x0.clone().requires_grad_(True)
        ws = [planned_weights(p, arch) for p in params]
        fwd = applier.microbatch(mb, "fwd") if plan else nullcontext()
        with fwd:
            y = applier.stack(len(params))(x, ws)
        bwd = applier.microbatch(mb, "bwd") if plan else nullcontext()
        with bwd:
            (y * (mb + 1.5)).square().sum().backward()
        grads = {f"{i}.{k}": p.grad.clone() for i, lp in enumerate(params)
                 for k, p in lp.items()}
        outs.append((y.detach().clone(), x.grad.clone(), grads))
        with torch.no_grad():
            for lp in params:
                for p in lp.values():
                    p.sub_(0.01 * p.grad.sign())
                    p.grad = None
    return outs



def _computation(key):
    """A graph's key without the copy it is (``("copy", j)``) and without the forward
    slot it is or reads (``("slot", n)``, or a kept-activations forward slot's key)."""
    key = key[:-2] if key[-2:-1] == ("copy",) else key
    key = key[:-2] if key[-2:-1] == ("slot",) else key
    key = key[:-1] if key and isinstance(key[-1], tuple) and "slot" in key[-1] else key
    # nor where it reads its inputs (``("in", x address, dy address)``: in place, or None)
    return tuple(k for k in key if not (isinstance(k, tuple) and k[:1] == ("in",)))


@pytest.mark.parametrize("recompute", ["full", "none", "selective"])
@pytest.mark.parametrize("schedule", ["sequential", "nanobatching", "kareus"])
def test_graphed_planned_stacks_compute_what_eager_ones_do(schedule, recompute):
    wl = workload(tp=1, cp=2, recompute=recompute)
    # under the plan, microbatch 1 runs unsplit: another choice, so graphs of its own
    plan = (make_workload_plan(wl, unsplit_microbatches=(1,)) if schedule == "kareus"
            else None)
    xs = _inputs(wl.model)
    results = []
    for graphs in (False, True):
        params = _params(wl.model)
        applier = _applier(wl, graphs=graphs, plan=plan,
                           schedule=None if plan else schedule)
        results.append(_run(applier, params, xs, plan=plan is not None))
        if graphs:
            ex = applier.executor if plan is not None else applier.baseline
            # a baseline: one forward and one backward graph, which the second microbatch
            # (other input, updated weights) replays; the plan: one pair per choice. A
            # graph is captured again only when a weight moved, and the only weight made
            # anew on every call is the concatenated QKV (index 1 of each layer). The
            # caller holds microbatch 0's output (``y``) while microbatch 1's forward runs,
            # so that forward replays a second copy of the graph (the first one's static
            # output is lent, not cloned)
            runner = applier._runner
            computations = {_computation(k) for k in runner._graphs}
            assert len(computations) == (4 if plan is not None else 2)
            assert len(runner._graphs) <= 2 * len(computations)
            assert runner.captures == len(ex.captured) >= len(runner._graphs)
            copied = {j for cap in runner._graphs.values() for row in cap.copied
                      for j, c in enumerate(row) if c}
            assert copied <= {1}
    _same_runs(*results)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_kept_activations_stay_in_their_forward_slot_until_its_backward(recompute):
    """Per-layer nodes, two microbatches in flight: each forward replays a slot whose
    activations are not lent (four: two layers x two microbatches), its backward reads them
    in place and frees it; a forward whose result needs no gradient frees its slot when
    dropped. Outputs and gradients equal eager execution."""
    wl = workload(tp=1, cp=2, recompute=recompute)
    arch = wl.model
    xs = _inputs(arch)
    results = []
    for graphs in (False, True):
        params = _params(arch)
        applier = _applier(wl, graphs=graphs, schedule="nanobatching")
        layer = applier.layer()
        got = []
        for _ in range(2):  # the second round replays the slots of the first
            ys, inputs = [], []
            for x0 in xs:  # both forwards first: both microbatches in flight
                x = x0.clone().requires_grad_(True)
                y = x
                for p in params:
                    y = layer(y, planned_weights(p, arch))
                ys.append(y)
                inputs.append(x)
            for y, x in zip(reversed(ys), reversed(inputs), strict=True):
                y.square().sum().backward()
                got.append((y.detach().clone(), x.grad.clone(),
                            {f"{i}.{k}": p.grad.clone() for i, lp in enumerate(params)
                             for k, p in lp.items()}))
                for lp in params:
                    for p in lp.values():
                        p.grad = None
        results.append(got)
        if graphs:
            runner = applier._runner
            slots = [c for caps in runner._slots.values() for c in caps]
            assert len(slots) == 4 and not any(c.lent for c in slots)
            # each forward slot in a pool of its own (its kept activations must not lie
            # where another graph's temporaries do); every backward graph in one shared
            # pool (they need their temporaries only while they run)
            pools = applier.baseline.pools
            fwd = [pool for name, pool in pools if ":fwd:" in name]
            bwd = [pool for name, pool in pools if ":bwd:" in name]
            assert len(fwd) >= 4 and set(fwd) == {None}  # (a moved weight captures again)
            assert len(bwd) >= 4 and bwd[0] is not None and set(bwd) == {bwd[0]}
            captured = runner.captures
            with torch.no_grad():  # no backward will come: the slot is freed when dropped
                layer(xs[0], planned_weights(params[0], arch))
            assert not any(c.lent for c in slots) and runner.captures == captured
    _same_runs(*results)


def test_a_graphed_backward_reads_its_own_forward_s_slot_once():
    """A second backward of the same graphed forward (retain_graph) is refused: its slot may
    hold another forward's activations by then. Eager, the kept activations are the node's
    own: a second backward gives the same gradients."""
    wl = workload(tp=1, cp=2, recompute="selective")
    arch = wl.model
    eager = _applier(wl, graphs=False, schedule="nanobatching")
    (params,), (x,) = _params(arch, (1,)), _inputs(arch, (0,))
    x.requires_grad_(True)
    y = eager.layer()(x, planned_weights(params, arch))
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    torch.testing.assert_close(x.grad, first)
    applier = _applier(wl, graphs=True, schedule="nanobatching")
    (params,), (x,) = _params(arch, (1,)), _inputs(arch, (0,))
    x.requires_grad_(True)
    y = applier.layer()(x, planned_weights(params, arch))
    y.sum().backward(retain_graph=True)
    applier.layer()(x.detach(), planned_weights(params, arch)).sum()  # the slot again
    with pytest.raises(ArgumentError, match="retain_graph"):
        y.sum().backward()


def test_a_weight_that_moves_is_copied_from_then_on():
    wl = workload(tp=1, cp=2)
    applier = _applier(wl, graphs=True)
    arch = wl.model
    params = _params(arch, (1,))
    x = torch.randn(4, 8, arch.hidden, generator=torch.Generator().manual_seed(0))
    xs = [x.clone(), x.clone()]  # inputs at two addresses: copied in (never read in place)
    stack = applier.stack(1)
    with torch.no_grad():
        stack(xs[0], [planned_weights(params[0], arch)])
    runner = applier._runner
    (cap,) = runner._graphs.values()
    # every weight is read where it lay at the capture
    assert cap.copied == [[False] * 7]
    names = ["w_attn_norm", "Wqkv", "Wo", "w_mlp_norm", "Wg", "Wu", "Wd"]
    # a parameter that moves (a framework that reallocates) is captured again, copied
    params[0]["w1"] = torch.nn.Parameter(params[0]["w1"].detach().clone() * 2)
    with torch.no_grad():
        got = stack(xs[1], [planned_weights(params[0], arch)])
        want = _applier(wl, graphs=False).stack(1)(x, [planned_weights(params[0], arch)])
    assert runner.captures == 2
    (cap,) = runner._graphs.values()
    assert cap.copied[0][names.index("Wg")]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_graphs_need_executors_that_capture():
    wl = workload(tp=2)
    groups = LoopbackGroups(tp=2)
    _, default, _ = make_collectives(groups, backend="loopback")
    eager = TorchExecutor(collective=default, default_collective=default,
                          streams=RecordingStreamBackend(), graphs=False)
    with pytest.raises(ArgumentError, match="graphs=True"):
        PlanApplier(workload=wl, groups=groups, kernels="torch", baseline=eager, graphs=True)
    if not torch.cuda.is_available():  # no device: the default executors cannot capture
        with pytest.raises(ArgumentError, match="graphs=True"):
            PlanApplier(workload=wl, groups=groups, kernels="torch", graphs=True)


def test_a_graphed_layer_under_a_plan_needs_its_microbatch_scope():
    from kareus.errors import PlanError

    wl = workload(tp=1, cp=2)
    applier = _applier(wl, graphs=True, plan=make_workload_plan(wl))
    x = torch.randn(4, 8, wl.model.hidden)
    (params,) = _params(wl.model, (1,))
    with pytest.raises(PlanError, match="microbatch"):
        applier.stack(1)(x, [planned_weights(params, wl.model)])


def test_every_body_is_warmed_up_twice_before_its_capture(monkeypatch):
    # the first call of a Triton op at a new signature compiles or fetches its kernel, the
    # second builds its lean launch: neither may happen inside a capture (on a fresh 1x H200
    # a graphed Qwen3 stack's first capture failed with one warm-up run, not with two)
    asked = []
    capture = RerunExecutor.capture

    def recording(self, name, bodies, *, signature=None, warmup=1):
        asked.append(warmup)
        return capture(self, name, bodies, signature=signature, warmup=warmup)

    monkeypatch.setattr(RerunExecutor, "capture", recording)
    wl = workload(tp=1, cp=2)
    params = _params(wl.model, (1,))
    xs = [torch.randn(4, 8, wl.model.hidden, generator=torch.Generator().manual_seed(0))]
    _run(_applier(wl, graphs=True, plan=None, schedule="sequential"), params, xs, plan=False)
    assert asked and set(asked) == {2}


# ---------------------------------------------------------------- inside an enclosing capture
class _Counting(_Rerun):
    replays = 0

    def replay(self, index=None):
        _Counting.replays += 1
        super().replay(index)


def _fake_capture(monkeypatch):
    """From now on the current CUDA stream reads as being captured (by someone else)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("schedule", ["nanobatching", "kareus"])
def test_inside_an_enclosing_capture_layers_launch_into_it(monkeypatch, schedule, graphs):
    # a step outside any capture (the framework's warm-up), then the same step while the
    # stream is captured: no graph of the applier's own is captured or replayed, and the
    # result is eager's
    monkeypatch.setattr(RerunExecutor, "capture",
                        lambda self, name, bodies, **kw: _Counting(bodies))
    wl = workload(tp=1, cp=2)
    plan = make_workload_plan(wl) if schedule == "kareus" else None
    xs = _inputs(wl.model)

    def params():
        return _params(wl.model)

    want = _run(_applier(wl, graphs=False, plan=plan, schedule=schedule), params(), xs,
                plan=plan is not None)
    applier = _applier(wl, graphs=graphs, plan=plan, schedule=schedule)
    _run(applier, params(), xs, plan=plan is not None)  # warm-up, outside
    captures, replays = (applier._runner.captures if graphs else 0), _Counting.replays
    _fake_capture(monkeypatch)
    got = _run(applier, params(), xs, plan=plan is not None)
    assert _Counting.replays == replays
    if graphs:
        assert applier._runner.captures == captures
    _same_runs(want, got)


def test_a_first_run_inside_a_capture_is_refused(monkeypatch):
    from kareus.errors import GraphCaptureError

    wl = workload(tp=1, cp=2)
    applier = _applier(wl, graphs=True)
    (params,) = _params(wl.model, (1,))
    x = torch.randn(4, 8, wl.model.hidden)
    _fake_capture(monkeypatch)
    with pytest.raises(GraphCaptureError, match="before it ever ran outside one"):
        applier.stack(1)(x, [planned_weights(params, wl.model)])
    assert applier._runner is None


def test_a_plan_that_differs_per_microbatch_needs_a_whole_step_capture(monkeypatch):
    from kareus.errors import PlanError

    wl = workload(tp=1, cp=2)
    plan = make_workload_plan(wl, freqs_mhz=(1980, 1410))  # two choices: two clocks
    xs = _inputs(wl.model)

    def params():
        return _params(wl.model, (1,))

    want = _run(_applier(wl, graphs=False, plan=plan), params(), xs, plan=True)
    per_mb, whole = (_applier(wl, graphs=True, plan=plan) for _ in range(2))
    whole.whole_step_capture = True
    for applier in (per_mb, whole):
        _run(applier, params(), xs, plan=True)
    with monkeypatch.context() as m:
        _fake_capture(m)
        with pytest.raises(PlanError, match="whole_step_capture=True"):
            _run(per_mb, params(), xs, plan=True)
        got = _run(whole, params(), xs, plan=True)
    _same_runs(want, got)
    # one choice for every microbatch: any capture takes it
    uniform = _applier(wl, graphs=True, plan=make_workload_plan(wl))
    _run(uniform, params(), xs, plan=True)
    _fake_capture(monkeypatch)
    _run(uniform, params(), xs, plan=True)


def test_the_plans_digest_exchange_is_refused_inside_a_capture(monkeypatch):
    from kareus.errors import PlanError

    wl = workload(tp=1, cp=2)
    groups = LoopbackGroups(tp=1, cp=2)
    applier = PlanApplier(workload=wl, groups=groups, plan=make_workload_plan(wl),
                          kernels="torch", start=False)
    _fake_capture(monkeypatch)
    with pytest.raises(PlanError, match="applier.start"), applier.microbatch(0, "fwd"):
        pass


def test_graphs_default_per_device(monkeypatch, caplog):
    import logging

    wl = workload(tp=1, cp=2)
    groups = LoopbackGroups(tp=1, cp=2)
    caplog.set_level(logging.INFO, logger="kareus")
    # no CUDA device: eager, said once
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = PlanApplier(workload=wl, groups=groups, kernels="torch")
    assert cpu.graphs is False and cpu.baseline.graphs is False
    assert "kareus planned layers: eager launches" in caplog.text
    # a device whose streams capture: graphs, said once
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = PlanApplier(workload=wl, groups=groups, kernels="torch",
                      streams=RecordingStreamBackend())
    assert gpu.graphs is True and gpu.baseline.graphs is True
    assert "kareus planned layers: own CUDA graphs" in caplog.text
    # told otherwise
    off = PlanApplier(workload=wl, groups=groups, kernels="torch",
                      streams=RecordingStreamBackend(), graphs=False)
    assert off.graphs is False and off.baseline.graphs is False


# ---------------------------------------------------------------- backward reads its forward's slot
@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("order", ["fwd-bwd", "all-forwards-first", "no-grad-forward-between"])
def test_a_graphed_backward_reads_what_its_forward_kept_in_place(order, held):
    # the backward graph reads the forward graph's static input and kept inputs where the
    # forward left them; another forward of the same graph before that backward first
    # gives the pending backward clones of them (copied back before its replay), so every
    # order of forwards and backwards computes what eager execution does. With the
    # forward's output still held (``held``: the loss saved it, the caller keeps it) its
    # static output is lent, so the next forward replays another copy of the graph, whose
    # slot is its own: nothing to load
    wl = workload(tp=1, cp=2)
    xs = _inputs(wl.model)
    results = []
    for graphs in (False, True):
        params = _params(wl.model)
        applier = _applier(wl, graphs=graphs, schedule="nanobatching")
        stack = applier.stack(2)

        def forward(x, params=params, stack=stack):
            return stack(x, [planned_weights(p, wl.model) for p in params])

        scale = torch.linspace(0.5, 1.5, wl.model.hidden)

        def loss(y, scale=scale):  # held: saves y for its backward; else no reference
            return y.square().sum() if held else (y * scale).sum()

        for _ in range(2):  # the first iteration captures (a weight made anew moves once)
            loads = applier._graphs_runner().loads if graphs else 0
            leaves = [x.clone().requires_grad_(True) for x in xs]
            if order == "all-forwards-first":
                ys, losses = [], []
                for x in leaves:
                    y = forward(x)
                    losses.append(loss(y))
                    ys.append(y if held else y.detach().clone())
                    del y
                for ls in reversed(losses):
                    ls.backward()
            else:
                ys = []
                for x in leaves:
                    y = forward(x)
                    ls = loss(y)
                    y = y if held else y.detach().clone()
                    if order == "no-grad-forward-between":
                        with torch.no_grad():
                            forward(x * 3)  # overwrites the slot; y's backward is pending
                    ls.backward()
                    ys.append(y)
        results.append(([y.detach() for y in ys], [x.grad for x in leaves],
                        {f"{i}.{k}": p.grad for i, lp in enumerate(params)
                         for k, p in lp.items()}))
        if graphs:
            runner = applier._runner
            expected = 0 if held else {"fwd-bwd": 0, "all-forwards-first": 1,
                                       "no-grad-forward-between": 2}[order]
            assert runner.loads - loads == expected
    (ye, dxe, ge), (yg, dxg, gg) = results
    for a, b in zip(ye + dxe, yg + dxg, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for k in ge:
        torch.testing.assert_close(gg[k], ge[k], rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("schedule", ["sequential", "kareus"])
def test_with_a_shared_pool_each_layer_replays_a_graph_of_its_own(schedule):
    # executors whose graphs share one memory pool (the default ones on a GPU): once a
    # layer's first weight has come back at its address, that layer gets graphs of its own
    # (at most the model's layer count of them)
    # reading its weights in place (only the QKV concatenation, made anew on every call,
    # is copied), and its backward reads its own forward's slot: no loads in the
    # per-microbatch order; the gradients are eager's
    wl = workload(tp=1, cp=2)
    plan = make_workload_plan(wl) if schedule == "kareus" else None
    xs = _inputs(wl.model)
    results, appliers = [], []
    for graphs in (False, True):
        params = _params(wl.model, (1, 2, 3))
        applier = _applier(wl, graphs=graphs, plan=plan,
                           schedule=None if plan else schedule)
        for ex in (applier.baseline, applier.executor):
            if ex is not None:
                ex.streams.shares_graph_pool = True
        layer = applier.layer()
        out = []
        for _ in range(3):  # iterations: the third runs every layer from its own graphs
            loads = applier._graphs_runner().loads if graphs else 0
            for mb, x0 in enumerate(xs):
                x = x0.clone().requires_grad_(True)
                with applier.microbatch(mb, "fwd") if plan else nullcontext():
                    y = x
                    for p in params:
                        y = layer(y, planned_weights(p, wl.model))
                with applier.microbatch(mb, "bwd") if plan else nullcontext():
                    y.square().sum().backward()
                out.append((y.detach(), x.grad))
        if graphs:
            assert applier._runner.loads == loads  # the last iteration loaded nothing
        grads = {f"{i}.{k}": p.grad for i, lp in enumerate(params) for k, p in lp.items()}
        results.append((out, grads))
        appliers.append(applier)
    runner = appliers[1]._runner
    own = [k for k in runner._graphs if _computation(k)[-1] is not None]
    # forward and backward of each layer, per plan choice (one here), up to the model's
    # layer count (2): the third layer replays the graph the others' first calls share
    # (a graph per layer, in as many copies as its outputs are held at once: a layer's
    # output is the next one's saved input until that backward)
    assert wl.model.layers == 2 and len({_computation(k) for k in own}) == 4
    assert any(_computation(k)[-1] is None for k in runner._graphs)
    for k in own:
        copied = {j for row in runner._graphs[k].copied for j, c in enumerate(row) if c}
        assert copied <= {1}
    (e_out, e_grads), (g_out, g_grads) = results
    for (ye, dxe), (yg, dxg) in zip(e_out, g_out, strict=True):
        torch.testing.assert_close(yg, ye, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dxg, dxe, rtol=1e-6, atol=1e-6)
    for k in e_grads:
        torch.testing.assert_close(g_grads[k], e_grads[k], rtol=1e-6, atol=1e-6, msg=k)


def test_inside_an_enclosing_capture_the_clock_requests_go_into_it(monkeypatch):
    # the microbatch scope's clock request goes to the trigger on the current (captured)
    # stream, as in eager execution: with the stream-ordered trigger's host-function
    # marker that is a host node of the enclosing graph, with event polling a one-line
    # GraphCaptureError from the trigger; never held back nor dropped
    from kareus.testing import RecordingTrigger

    wl = workload(tp=1, cp=2)
    plan = make_workload_plan(wl, freqs_mhz=(1980, 1410))
    groups = LoopbackGroups(tp=1, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    trigger = RecordingTrigger()
    trigger.capturable = True
    applier = PlanApplier(
        workload=wl, groups=groups, plan=plan, kernels="torch", graphs=True,
        whole_step_capture=True,
        baseline=RerunExecutor(collective=default, default_collective=default),
        executor=RerunExecutor(collective=capped, default_collective=default, plan=plan,
                               frequency=trigger))
    params = _params(wl.model, (1,))
    xs = _inputs(wl.model)
    _run(applier, params, xs, plan=True)  # warm-up, outside
    trigger.requests.clear()
    _fake_capture(monkeypatch)
    _run(applier, params, xs, plan=True)
    stream = applier.executor.streams.current_stream()
    assert trigger.requests == [(1980, stream), (1980, stream), (1410, stream),
                                (1410, stream)]


def test_a_graphed_applier_and_its_graphs_go_without_the_garbage_collector():
    # Graphs that only Python's cyclic garbage collector frees are destroyed whenever it
    # runs, which may be inside a later CUDA graph capture (anyone's), which that
    # invalidates: the runner, its forwards' slots and the executor's sequences hold no
    # reference cycle, so dropping the applier frees its graphs at once
    import gc
    import weakref

    wl = workload(tp=1, cp=2)
    groups = LoopbackGroups(tp=1, cp=2)
    _, default, _ = make_collectives(groups, backend="loopback")
    ex = TorchExecutor(collective=default, default_collective=default,
                       streams=RecordingStreamBackend(), graphs=True)
    applier = PlanApplier(workload=wl, groups=groups, kernels="torch", graphs=True,
                          baseline=ex)
    params = _params(wl.model)
    x = torch.randn(4, 8, wl.model.hidden, generator=torch.Generator().manual_seed(0))
    y = applier.stack(2)(x.requires_grad_(True), [planned_weights(p, wl.model)
                                                  for p in params])
    y.square().sum().backward()
    y = applier.stack(2)(x, [planned_weights(p, wl.model) for p in params])
    assert applier._runner.captures >= 2
    seqs = [weakref.ref(s) for s in ex._sequences.values()]
    refs = [weakref.ref(o) for o in (applier, applier._runner, ex)]
    assert seqs
    enabled = gc.isenabled()
    gc.disable()
    try:
        del applier, ex, y  # y's backward node (its forward's kept inputs) pending
        assert [r() for r in refs] == [None] * 3
        assert all(s() is None for s in seqs)
    finally:
        if enabled:
            gc.enable()
