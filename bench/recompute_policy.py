"""kareus's planned layers against the same blocks torch.compile'd, at each recomputation policy.

The question (issue: recomputation as the user chooses it): is a layer kareus runs no slower
than what a user who does not use kareus would run, at the recomputation policy they
chose? On one GPU (TP = CP = 1: no collective, so this is the layer's execution path
alone), one iteration is ``--microbatches`` microbatches, each forward and backward through
``--layers`` decoder layers (RMSNorm, grouped-query attention with RoPE, SwiGLU), and for
each policy (``none``: every activation kept; ``selective``: the attention core re-run in
the backward, as Megatron-Core's default selective recomputation; ``full``: each layer
re-run from its input) the rows are:

* ``kareus-stack``: one ``PlannedStack`` of every layer (``kareus.integrations``), CUDA
  graphs on (``PlanApplier(graphs=True)``; the kept activations stay in the graphs'
  buffers), the workload's ``recompute`` the policy;
* ``kareus-layers``: the same as one ``PlannedLayer`` node per layer (a framework's
  layers, one autograd node each), graphs on;
* ``compiled``: the same block written in plain PyTorch (the same weights, the same
  RoPE, SDPA's causal attention with grouped heads) and ``torch.compile``'d per block, as
  torchtitan compiles its blocks: ``none`` plain, ``full`` the block under
  ``torch.utils.checkpoint`` (torchtitan's full activation checkpoint), ``selective`` a
  selective-checkpoint policy that recomputes the attention op only and saves every other
  op's output (Megatron-Core's ``core_attn`` recomputation, in PyTorch's own terms).

Per row: iteration time (device events; the median over ``--rounds`` rounds, the rows
interleaved in a shuffled order each round), the GPU's own time (the iteration enqueued
behind a sleeping kernel: ``bench/host_bound.py``'s ``_queued_time_s``), the GPU-busy
fraction of one profiled iteration's span (the union of kernel intervals over first to
last kernel), kernels per iteration, memory (below), and a check of the values: the first microbatch's output and one weight's gradient against the compiled
block's at the same policy (relative difference; bf16 on a GPU). The summary gives
kareus's time over the compiled block's per policy (the target: at most 1.0).

Memory, per row: ``kept_gib``, what one microbatch's forward keeps for its backward (on a
GPU what it leaves allocated, its output aside; kareus's rows on an eager run of the same
layers, since from graphs the kept tensors are the forward graph's buffers, allocated once;
on the CPU the bytes autograd saves) beside ``model_kept_gib``, the memory model's figure
for the same layers (``kareus.model.memory.kept_activation_bytes``); on a GPU
``footprint_gib``, the peak of reserved memory over an iteration from a base taken with
nothing cached, each system built and measured on its own (graph pools, their static
buffers and the kept activations in forward slots included: a replay allocates nothing, so
a peak of *allocated* memory around replays, ``peak_allocated_gib``, sees only the outputs
cloned out of the graphs and the gradients), and ``held_gib``, what stays allocated between
iterations (graphs' buffers).

Usage (one CUDA GPU; clocks are never changed)::

    python bench/recompute_policy.py --json bench/results/recompute_policy_h200.json
    python bench/recompute_policy.py --quick   # the code path on the CPU, a tiny model

Without CUDA and without ``--quick`` it says so and exits 0. Prints a table and writes
JSON (``--json``): the command, machine, workload, every row.
"""

from __future__ import annotations

import argparse
import datetime
import functools
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

POLICIES = ("none", "selective", "full")
SYSTEMS = ("kareus-stack", "kareus-layers", "compiled")
ROPE_BASE = 500000.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=6144)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (each row once)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile's backend for the compiled rows")
    ap.add_argument("--no-graphs", action="store_true",
                    help="kareus's rows eager (default: CUDA graphs)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run on the CPU: a tiny model, fp32, one round, "
                         "torch.compile's aot_eager backend, kareus eager")
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def _workload(args: argparse.Namespace, policy: str) -> Any:
    from kareus.model.workload import ModelArch, Parallelism, Workload

    arch = ModelArch(name="bench-dense", layers=args.layers, hidden=args.hidden,
                     heads=args.heads, kv_heads=args.kv_heads,
                     head_dim=args.hidden // args.heads, ffn=args.ffn, vocab=32000)
    return Workload(model=arch, parallelism=Parallelism(tp=1, cp=1),
                    microbatch_size=args.microbatch_size, seq_len=args.seq_len,
                    num_microbatches=args.microbatches, nanobatches=1, recompute=policy)


def _weights(torch: Any, arch: Any, layers: int, device: Any, dtype: Any) -> list[dict]:
    """Every layer's weights in kareus's layout (``[in, out]`` matrices), leaves."""
    q, kv, h, f = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim, arch.hidden, \
        arch.ffn
    shapes = {"w_attn_norm": (h,), "Wqkv": (h, q + 2 * kv), "Wo": (q, h),
              "w_mlp_norm": (h,), "Wg": (h, f), "Wu": (h, f), "Wd": (f, h)}
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for _ in range(layers):
        w = {}
        for name, shape in shapes.items():
            t = (1.0 + 0.1 * torch.randn(shape, generator=g) if len(shape) == 1
                 else torch.randn(shape, generator=g) * 0.02)
            w[name] = t.to(device, dtype).requires_grad_(True)
        out.append(w)
    return out


def _rope_tables(torch: Any, seq: int, hd: int, device: Any, dtype: Any) -> tuple[Any, Any]:
    """cos and sin ``[seq, hd]`` of rotate-half RoPE, as kareus's layer builds them."""
    inv = 1.0 / (ROPE_BASE ** (torch.arange(0, hd, 2, device=device,
                                            dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def compiled_block(torch: Any, arch: Any, policy: str, backend: str, cos: Any,
                   sin: Any) -> Any:
    """``block(x, *weights) -> y``: the decoder layer in plain PyTorch, compiled, with
    the policy's recomputation (see the module docstring)."""
    F = torch.nn.functional
    heads, kvh, hd, eps = arch.heads, arch.kv_heads, arch.head_dim, arch.norm_eps

    def rms(x: Any, w: Any) -> Any:
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def rot(x: Any) -> Any:  # x [b, s, n, hd]
        half = x.shape[-1] // 2
        r = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[None, :, None, :] + r * sin[None, :, None, :]

    def layer(x: Any, w_an: Any, wqkv: Any, wo: Any, w_mn: Any, wg: Any, wu: Any,
              wd: Any) -> Any:
        b, s, h = x.shape
        qkv = (rms(x, w_an) @ wqkv).view(b, s, heads + 2 * kvh, hd)
        q = rot(qkv[:, :, :heads]).transpose(1, 2)
        k = rot(qkv[:, :, heads:heads + kvh]).transpose(1, 2)
        v = qkv[:, :, heads + kvh:].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + o.transpose(1, 2).reshape(b, s, heads * hd) @ wo
        x2 = rms(x, w_mn)
        return x + (F.silu(x2 @ wg) * (x2 @ wu)) @ wd

    from torch.utils.checkpoint import checkpoint

    if policy == "none":
        fn = layer
    elif policy == "full":
        def fn(*a: Any) -> Any:
            return checkpoint(layer, *a, use_reentrant=False)
    else:
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        attention = {getattr(torch.ops.aten, n).default for n in (
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_attention_math")
            if hasattr(torch.ops.aten, n)}

        def only_attention(ctx: Any, op: Any, *a: Any, **kw: Any) -> Any:
            return (CheckpointPolicy.PREFER_RECOMPUTE if op in attention
                    else CheckpointPolicy.MUST_SAVE)

        # a partial (not a lambda): what torch.compile traces through checkpoint
        contexts = functools.partial(create_selective_checkpoint_contexts, only_attention)

        def fn(*a: Any) -> Any:
            return checkpoint(layer, *a, use_reentrant=False, context_fn=contexts)
    return torch.compile(fn, backend=backend)


class Iteration:
    """One iteration (every microbatch forward and backward) of one system at one policy."""

    def __init__(self, torch: Any, system: str, run: Any, weights: list[dict],
                 xs: list[Any], dys: list[Any]) -> None:
        self.torch, self.system, self.run = torch, system, run
        self.weights, self.xs, self.dys = weights, xs, dys

    def step(self, schedule: str = "") -> None:
        for x, dy in zip(self.xs, self.dys, strict=True):
            self.run(x).backward(dy)
        for w in self.weights:  # the optimizer's zero_grad, so gradients do not pile up
            for t in w.values():
                t.grad = None

    def check(self) -> tuple[Any, Any]:
        """The first microbatch's output and the first layer's Wqkv gradient."""
        y = self.run(self.xs[0])
        y.backward(self.dys[0])
        g = self.weights[0]["Wqkv"].grad.detach().clone()
        for w in self.weights:
            for t in w.values():
                t.grad = None
        return y.detach().float(), g.float()


def _system(torch: Any, args: argparse.Namespace, system: str, policy: str,
            weights: list[dict], xs: list[Any], dys: list[Any], device: Any, dtype: Any,
            graphs: bool) -> Iteration:
    """One row's system, built on its own (a kareus row its own applier, so its graphs
    and their memory pools are its own: the footprint measured is this row's)."""
    from kareus.exec.train import LoopbackGroups
    from kareus.integrations import PlanApplier

    wl = _workload(args, policy)
    arch = wl.model
    cuda = device.type == "cuda"
    if system == "compiled":
        cos, sin = _rope_tables(torch, args.seq_len, arch.head_dim, device, dtype)
        block = compiled_block(torch, arch, policy, args.compile_backend, cos, sin)
        names = ("w_attn_norm", "Wqkv", "Wo", "w_mlp_norm", "Wg", "Wu", "Wd")

        def compiled(x: Any) -> Any:
            for w in weights:
                x = block(x, *(w[n] for n in names))
            return x

        return Iteration(torch, system, compiled, weights, xs, dys)
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=1), schedule="sequential",
                          kernels=None if cuda else "torch", graphs=graphs,
                          rope_base=ROPE_BASE, eps=arch.norm_eps)
    if system == "kareus-stack":
        stack = applier.stack(len(weights))

        def kareus_stack(x: Any) -> Any:
            return stack(x, weights)

        return Iteration(torch, system, kareus_stack, weights, xs, dys)
    layer = applier.layer()

    def kareus_layers(x: Any) -> Any:
        for w in weights:
            x = layer(x, w)
        return x

    return Iteration(torch, system, kareus_layers, weights, xs, dys)


def _footprint(torch: Any, it: Iteration) -> dict[str, float]:
    """The memory one system costs, measured on its own (the other rows' graphs idle):
    from a base taken after ``empty_cache`` (nothing cached outside graph pools), two
    iterations (compilation, graph captures), ``empty_cache`` again (the eager warm-ups'
    blocks), then one iteration. ``footprint_gib``: the peak of reserved memory over it,
    graph pools and their static buffers included (a replay allocates nothing, so a peak
    of allocated memory around replays sees none of what graphs hold); ``held_gib``: what
    stays allocated after it (graphs' static buffers and kept activations in forward
    slots; the weight gradients are dropped by the iteration); ``peak_allocated_gib``: the
    peak of allocated memory over it (around graphs: only what is allocated outside them,
    the outputs cloned out and the gradients)."""
    import gc

    gib = 2 ** 30
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base_reserved, base_alloc = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    for _ in range(2):
        it.step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    it.step()
    torch.cuda.synchronize()
    return {"footprint_gib": (torch.cuda.max_memory_reserved() - base_reserved) / gib,
            "held_gib": (torch.cuda.memory_allocated() - base_alloc) / gib,
            "peak_allocated_gib": (torch.cuda.max_memory_allocated() - base_alloc) / gib}


def _kept_bytes(torch: Any, it: Iteration, cuda: bool) -> int | None:
    """Bytes one microbatch's forward keeps for its backward (after one warm-up
    iteration). On a GPU: what the forward leaves allocated, its output aside; on the CPU
    (no allocator statistics): every tensor autograd saves, through
    ``saved_tensors_hooks``, each storage once, the weights and the input left out. For
    kareus the system runs eagerly here: from its own graphs a forward keeps its graph's
    buffers, allocated once when captured (the same tensors; ``held_gib``). ``None``
    where nothing is seen."""
    def zero() -> None:
        for w in it.weights:
            for t in w.values():
                t.grad = None

    it.run(it.xs[0]).backward(it.dys[0])  # warm-up: compilation, the programs' tables
    zero()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = it.run(it.xs[0])
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
        y.backward(it.dys[0])
        zero()
        return kept if kept > 0 else None
    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    exclude = {t.untyped_storage().data_ptr() for w in it.weights for t in w.values()}
    exclude.add(it.xs[0].untyped_storage().data_ptr())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = it.run(it.xs[0])
    y.backward(it.dys[0])
    zero()
    kept = sum(b for ptr, b in storages.items() if ptr not in exclude)
    return kept or None


def _rel(a: Any, b: Any) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - one bench, read top to bottom
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.quick
    if not cuda and not args.quick:
        print("bench/recompute_policy.py needs a CUDA GPU (--quick: a smoke run of the code "
              "path on the CPU)")
        return 0
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads, args.ffn = 2, 64, 4, 2, 128
        args.microbatch_size, args.seq_len, args.microbatches, args.rounds = 2, 32, 2, 1
        args.compile_backend = "aot_eager"
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # before any GEMM, as a graphed PlanApplier asks
        from kareus.exec import prefer_workspace_free_gemms

        prefer_workspace_free_gemms()
    dtype = torch.bfloat16 if cuda else torch.float32
    graphs = cuda and not args.no_graphs
    arch = _workload(args, "none").model
    weights = _weights(torch, arch, args.layers, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (args.microbatch_size, args.seq_len, args.hidden)
    xs = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(args.microbatches)]
    dys = [(torch.randn(shape, generator=g) * 1e-2).to(device, dtype) for _ in xs]
    its: dict[tuple[str, str], Iteration] = {}
    memory: dict[tuple[str, str], dict[str, float]] = {}
    for policy in args.policies:
        for system in SYSTEMS:
            it = its[(system, policy)] = _system(torch, args, system, policy, weights, xs,
                                                 dys, device, dtype, graphs)
            if cuda:  # each system's memory on its own, before the next is built
                memory[(system, policy)] = _footprint(torch, it)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(key: tuple[str, str]) -> float:
        sync()
        if not cuda:
            t0 = time.perf_counter()
            its[key].step()
            return time.perf_counter() - t0
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        its[key].step()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    rows = list(its)
    checks: dict[tuple[str, str], dict[str, float]] = {}
    for policy in args.policies:  # values first (compiles and captures on the way)
        want_y, want_g = its[("compiled", policy)].check()
        for system in SYSTEMS:
            y, gq = its[(system, policy)].check()
            checks[(system, policy)] = {"output_rel_diff": _rel(y, want_y),
                                        "grad_rel_diff": _rel(gq, want_g)}
    for key in rows:  # warm-up: kernels' first launches, graph captures
        timed(key)
    times: dict[tuple[str, str], list[float]] = {r: [] for r in rows}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = rows[:]
        rng.shuffle(order)
        for r in order:
            times[r].append(timed(r))
    out_rows = []
    for key in rows:
        system, policy = key
        row: dict[str, Any] = {"system": system, "policy": policy,
                               "iteration_s": statistics.median(times[key]),
                               "iteration_s_all": times[key], **checks[key]}
        if cuda:
            from host_bound import _profile_iteration, _queued_time_s

            row.update(memory[key])
            gpu_s, fed_ok = _queued_time_s(torch, its[key].step, 2)
            row.update(gpu_only_s=gpu_s if fed_ok else None, gpu_only_reliable=fed_ok,
                       **_profile_iteration(torch, its[key], ""))
        out_rows.append(row)
    from kareus.model.memory import kept_activation_bytes

    for row in out_rows:  # last: what autograd keeps (an eager run for kareus's rows)
        system, policy = row["system"], row["policy"]
        it = (its[(system, policy)] if system == "compiled" else
              _system(torch, args, system, policy, weights, xs, dys, device, dtype, False))
        kept = _kept_bytes(torch, it, cuda)
        row["kept_gib"] = None if kept is None else kept / 2 ** 30
        if system != "compiled":  # the memory model's figure for the same layers, less
            d = 2 if cuda else 4  # the first one's input (the caller's, counted above)
            wl = _workload(args, policy).with_(dtype_bytes=d)
            first_input = args.microbatch_size * args.seq_len * args.hidden * d
            row["model_kept_gib"] = (kept_activation_bytes(wl, layers=args.layers)
                                     - first_input) / 2 ** 30
    ratios = _ratios(out_rows)
    _print(out_rows, ratios, args, cuda, graphs)
    if args.json is not None:
        result: dict[str, Any] = {
            "command": "python bench/recompute_policy.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "machine_kind": "GPU" if cuda else "CPU smoke run (not a measurement)",
            "workload": _workload(args, "none").to_dict() | {"recompute": list(args.policies)},
            "layers": args.layers, "rounds": args.rounds, "graphs": graphs,
            "compile_backend": args.compile_backend, "dtype": str(dtype),
            "rows": out_rows, "kareus_over_compiled": ratios}
        if cuda:
            from host_bound import _versions

            result["machine"] = _versions()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per policy: each kareus row's iteration time over the compiled block's."""
    by = {(r["system"], r["policy"]): r["iteration_s"] for r in rows}
    out: dict[str, dict[str, float]] = {}
    for (system, policy), t in by.items():
        if system != "compiled" and ("compiled", policy) in by:
            out.setdefault(policy, {})[system] = t / by[("compiled", policy)]
    return out


def _print(rows: list[dict[str, Any]], ratios: dict[str, dict[str, float]],
           args: argparse.Namespace, cuda: bool, graphs: bool) -> None:
    print(f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} "
          f"KV heads, FFN {args.ffn}; {args.microbatches} microbatches of "
          f"{args.microbatch_size} x {args.seq_len}; TP=1; kareus graphs "
          f"{'on' if graphs else 'off'}; torch.compile backend {args.compile_backend}"
          + ("" if cuda else "; CPU smoke run, not a measurement"))
    head = f"{'system':<14} {'policy':<10} {'iteration ms':>12}"
    if cuda:
        head += (f" {'GPU-only ms':>11} {'busy':>5} {'kernels':>7} {'footprint GiB':>13}"
                 f" {'held GiB':>8}")
    head += f" {'kept MiB':>9} {'model MiB':>9} {'d(out)':>8} {'d(grad)':>8}"
    print(head)
    for r in rows:
        line = f"{r['system']:<14} {r['policy']:<10} {1e3 * r['iteration_s']:>12.3f}"
        if cuda:
            gpu, busy = r.get("gpu_only_s"), r.get("busy")
            line += (f" {'n/a' if gpu is None else f'{1e3 * gpu:.3f}':>11} "
                     f"{'n/a' if busy is None else f'{busy:.2f}':>5} "
                     f"{r.get('kernels', 0):>7} {r['footprint_gib']:>13.2f} "
                     f"{r['held_gib']:>8.2f}")
        kept, model = r.get("kept_gib"), r.get("model_kept_gib")
        line += (f" {'n/a' if kept is None else f'{kept * 1024:.2f}':>9}"
                 f" {'' if model is None else f'{model * 1024:.2f}':>9}")
        line += f" {r['output_rel_diff']:>8.1e} {r['grad_rel_diff']:>8.1e}"
        print(line)
    for policy, per in ratios.items():
        print(f"{policy}: kareus / compiled = " + ", ".join(
            f"{s} {v:.3f}" for s, v in per.items()))


if __name__ == "__main__":
    raise SystemExit(main())
