"""Host time of one eager call of each kareus Triton op: lean launches, plain launches and
liger-kernel's, side by side, at the presets' shapes, on one GPU.

Eager training (no CUDA graphs) pays each op's host path on every call, and a small
model's ops run shorter than that path: the GPU waits on the host. This bench measures
that path for the ops of ``TritonKernels`` (``kareus.exec.kernels``): RMSNorm forward and
backward, RoPE forward and backward, SwiGLU forward and backward.

* Shapes: the runnable partitions' own inputs (``kareus.exec._transformer_ops``: the
  builders that make each op's inputs at a workload's per-rank nanobatch dimensions), for
  llama3.2-3b at TP=4, qwen3-1.7b at TP=4 CP=2 with microbatches of 8 and 16 sequences,
  and llama3.3-70b at TP=8; 4,096 tokens a sequence, each microbatch in 2 nanobatches.
* Paths: ``lean`` (``TritonKernels()``, the default: launches cached per signature and
  made through the compiled kernel's own launcher, kareus/exec/kernels/_launch.py),
  ``plain`` (``TritonKernels(lean=False)``: Triton's dispatch on every call, the path
  before lean launches), and ``liger`` (``TritonKernels(use_liger=True)``: liger-kernel's
  RMSNorm and SwiGLU forward, where it is installed).
* Host time: ``time.perf_counter_ns`` around each call (the call only: dropping its
  outputs afterwards is not counted), median over ``--rounds`` rounds of ``--calls``
  calls, the paths' rounds interleaved, after warm-up calls (compilation); during each
  round a ``torch.cuda._sleep`` kernel keeps the GPU busy, and the round counts only if
  the GPU was still busy after its last call (so no call waited on the GPU); the Python
  garbage collector is off while timing.
* GPU time: CUDA events around each call, median of ``--calls``, each after reading a
  256 MiB buffer (the L2 cache holds none of the op's data), lean path and liger.
* Python share: the lean path's host time again with its launches' C calls swapped for
  a no-op C call (``host_us_no_launch``: what the Python around the launches costs: key,
  lookup, outputs, addresses, stream; the rest of ``host_us`` is the CUDA launches).
* Also: whether the lean path took its fast launches at every op (``fast_path``), whether
  its outputs equal the plain path's bit for bit (``equal_to_plain``), and the bare cost
  of launching an empty kernel of 4 and of 30 arguments, plain and lean.

``--check`` exits 1 if any kareus op on the lean path takes more than 15 us of host time
per call (or missed its fast launches, or differs from the plain path).

Usage (one GPU; changes no GPU setting)::

    python bench/launch_cost.py --json bench/results/launch_cost_h200.json --check
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# (label, preset, parallelism, microbatch size): the presets' shapes (docs/kernels.md)
WORKLOADS: list[tuple[str, str, dict[str, int], int]] = [
    ("llama3.2-3b tp4 mb8", "llama3.2-3b", {"tp": 4}, 8),
    ("qwen3-1.7b tp4 cp2 mb8", "qwen3-1.7b", {"tp": 4, "cp": 2}, 8),
    ("qwen3-1.7b tp4 cp2 mb16", "qwen3-1.7b", {"tp": 4, "cp": 2}, 16),
    ("llama3.3-70b tp8 mb8", "llama3.3-70b", {"tp": 8}, 8),
]
SEQ_LEN = 4096
NANOBATCHES = 2
OPS = ("rms_norm", "rms_norm_bwd", "add_rms_norm", "rms_norm_bwd_add", "rope", "rope_bwd",
       "swiglu", "swiglu_bwd")
LIGER_OPS = ("rms_norm", "swiglu")
# The op's tag in kareus.exec.kernels._triton's plans (lean_status()).
LEAN_TAG = {"rms_norm": "rms_norm_fwd", "rms_norm_bwd": "rms_norm_bwd",
            "add_rms_norm": "add_rms_norm_fwd", "rms_norm_bwd_add": "rms_norm_bwd_add",
            "rope": "rope_qkv", "rope_bwd": "rope_bwd", "swiglu": "swiglu_fwd",
            "swiglu_bwd": "swiglu_bwd"}
BUDGET_US = 15.0
SPIN_CYCLES = 20_000_000  # about 10 ms of GPU spin at 2 GHz; lengthened 4x on a retry
SPIN_RETRIES = 3
WARMUP_CALLS = 3
FLUSH_ELEMENTS = 128 * 2**20  # bf16: 256 MiB, read before each GPU timing

try:  # --help and the CPU tests need neither; the measurement needs both
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - not installed, or broken
    triton = None

if triton is not None:
    @triton.jit
    def _bare4(X, a, b, n):
        # Stores nothing for the arguments this bench passes: launch cost only.
        if n < 0:
            tl.store(X, a + b)

    @triton.jit
    def _bare30(X, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16,
                a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29):
        if a29 < 0:
            tl.store(X, a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13
                     + a14 + a15 + a16 + a17 + a18 + a19 + a20 + a21 + a22 + a23 + a24
                     + a25 + a26 + a27 + a28)

HOST_METHOD = ("time.perf_counter_ns around each eager call (outputs dropped after the "
               "timer stops), GPU kept busy by torch.cuda._sleep so that no launch waits on "
               "it (a round counts only if the GPU was still busy after its last call), "
               "garbage collector off; median over all calls of all rounds")


def _device(torch: Any) -> Any:
    """The device the bench runs on: the current CUDA device."""
    return torch.device("cuda", torch.cuda.current_device())


def machine(torch: Any) -> dict[str, Any]:
    """The GPU, driver, host CPU and library versions (host time depends on the CPU)."""
    info: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["cpu"] = cpu
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    from kareus.exec.kernels.triton_ops import liger_version

    info["liger_kernel"] = liger_version()
    try:
        import pynvml

        pynvml.nvmlInit()
        drv = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = drv.decode() if isinstance(drv, bytes) else drv
    except Exception as exc:
        info["driver"] = f"unavailable ({exc})"
    return info


def op_calls(torch: Any, preset: str, par: dict[str, int], mb: int,
             sets: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """For each kernel set, op name -> zero-argument call of that op on the runnable
    partitions' inputs at this workload's shapes; and the shapes."""
    from kareus.exec._transformer_ops import _dims, _op_builders
    from kareus.model.workload import Workload

    wl = Workload.preset(preset, **par, microbatch_size=mb, seq_len=SEQ_LEN,
                         nanobatches=NANOBATCHES)
    d = _dims(wl)
    dev = _device(torch)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    ctx: dict[str, Any] = {"_gen": gen, "_device": dev, "_dtype": torch.bfloat16,
                           "_kernels": sets["lean"]}
    builders = _op_builders()
    for name in ("attn_norm", "attn_norm_bwd", "rope", "rope_bwd", "swiglu", "swiglu_bwd"):
        builders[name](torch, ctx, d, None)
    x, dy, w = ctx["x"], ctx["dy"], ctx["w_attn_norm"]
    qkv, cos, sin = ctx["qkv"], ctx["cos"], ctx["sin"]
    dq, dk, dv = (ctx[n].transpose(1, 2) for n in ("dq", "dk", "dv"))  # the op's layout
    g, u, da = ctx["g"], ctx["u"], ctx["da"]
    dw_out = torch.zeros_like(w)  # the fused backward accumulates into it
    calls = {}
    for path, ks in sets.items():
        calls[path] = {
            "rms_norm": lambda ks=ks: ks.rms_norm(x, w),
            "rms_norm_bwd": lambda ks=ks: ks.rms_norm_bwd(dy, x, w),
            "add_rms_norm": lambda ks=ks: ks.add_rms_norm(x, dy, w),
            "rms_norm_bwd_add": lambda ks=ks: ks.rms_norm_bwd_add(dy, x, w, dy, dw_out),
            "rope": lambda ks=ks: ks.rope(qkv, cos, sin, heads=d.heads, kv_heads=d.kvh),
            "rope_bwd": lambda ks=ks: ks.rope_bwd(dq, dk, dv, cos, sin),
            "swiglu": lambda ks=ks: ks.swiglu(g, u),
            "swiglu_bwd": lambda ks=ks: ks.swiglu_bwd(da, g, u),
        }
    shapes = {"tokens": d.t, "hidden": d.h, "heads": d.heads, "kv_heads": d.kvh,
              "head_dim": d.hd, "ffn": d.f, "seq": d.sq}
    return calls, shapes


def host_round_us(torch: Any, fn: Any, calls: int) -> list[float]:
    """Host microseconds of ``calls`` calls of ``fn``, timed while a spinning kernel keeps
    the GPU busy; retried with a longer spin when the calls outlast it."""
    cycles = SPIN_CYCLES
    for _ in range(SPIN_RETRIES + 1):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        spun = torch.cuda.Event()
        spun.record()
        times = []
        gc.disable()
        try:
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                r = fn()
                t1 = time.perf_counter_ns()
                del r
                times.append((t1 - t0) / 1e3)
        finally:
            gc.enable()
        busy = not spun.query()
        torch.cuda.synchronize()
        if busy:
            return times
        cycles *= 4
    raise RuntimeError("the calls outlasted every GPU spin: a call waits on the GPU")


def gpu_us(torch: Any, fn: Any, reps: int, flush: Any) -> float:
    """Median GPU microseconds of one call (CUDA events), each after an L2 flush."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # the host queues the runs ahead of the GPU
    for i in range(reps):
        flush.amax()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


_NO_LAUNCH = "".format  # a C call that takes any arguments and does nothing


def no_launches(kt: Any) -> dict[tuple[int, str], Any]:
    """Swap every lean plan's launch calls (the generated functions' ``run<k>`` and
    ``launch<k>``) for a no-op C call; returns what to put back (:func:`put_back`)."""
    saved = {}
    for plan in list(kt._PLANS.values()):
        if plan.fast is None:
            continue
        g = plan.fast.__globals__
        for name in list(g):
            if name.startswith(("run", "launch")) and name[-1].isdigit():
                saved[(id(g), name)] = (g, g[name])
                g[name] = _NO_LAUNCH
    return saved


def put_back(saved: dict) -> None:
    for (_, name), (g, value) in saved.items():
        g[name] = value


def outputs_equal(torch: Any, a: Any, b: Any) -> bool:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return len(a) == len(b) and all(
        x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype
        and bool(torch.equal(x, y)) for x, y in zip(a, b))


def summarize(times: list[float], rounds: list[list[float]]) -> dict[str, Any]:
    q = statistics.quantiles(times, n=10)
    return {"host_us": statistics.median(times), "host_us_p10": q[0], "host_us_p90": q[-1],
            "host_us_round_medians": [statistics.median(r) for r in rounds],
            "calls": len(times)}


def measure_op(torch: Any, label: str, op: str, paths: list[str], calls: dict[str, Any],
               sets: dict[str, Any], args: argparse.Namespace, flush: Any) -> list[dict]:
    """Rows (one per path) of one op at one workload."""
    from kareus.exec.kernels import _triton as kt

    for p in paths:
        for _ in range(WARMUP_CALLS):
            calls[p][op]()
    rounds: dict[str, list[list[float]]] = {p: [] for p in paths}
    for _ in range(args.rounds):  # interleaved, so drift hits every path alike
        for p in paths:
            rounds[p].append(host_round_us(torch, calls[p][op], args.calls))
    status = kt.lean_status().get(LEAN_TAG[op], {})
    saved = no_launches(kt)
    try:
        bare = [host_round_us(torch, calls["lean"][op], args.calls) for _ in range(args.rounds)]
    finally:
        put_back(saved)
    lean_out, plain_out = calls["lean"][op](), calls["plain"][op]()
    equal = outputs_equal(torch, lean_out, plain_out)
    del lean_out, plain_out
    rows = []
    for p in paths:
        r = {"workload": label, "op": op, "path": p, "kernel": sets[p].kernel_names()[op],
             **summarize([t for rnd in rounds[p] for t in rnd], rounds[p])}
        if p == "lean":
            r["host_us_no_launch"] = statistics.median(t for rnd in bare for t in rnd)
            r["fast_path"] = bool(status) and status.get("fast") == status.get("signatures")
            r["equal_to_plain"] = equal
        if p in ("lean", "liger"):
            r["gpu_us"] = gpu_us(torch, calls[p][op], args.calls, flush)
        rows.append(r)
    return rows


def measure_workload(torch: Any, label: str, preset: str, par: dict[str, int], mb: int,
                     sets: dict[str, Any], args: argparse.Namespace,
                     flush: Any) -> tuple[list[dict], dict[str, Any]]:
    """Rows (workload, op, path) of one workload."""
    calls, shapes = op_calls(torch, preset, par, mb, sets)
    rows = []
    for op in OPS:
        paths = [p for p in sets if p != "liger" or op in LIGER_OPS]
        try:
            rows += measure_op(torch, label, op, paths, calls, sets, args, flush)
        except Exception as exc:  # reported in the rows and by --check; the run goes on
            err = f"{type(exc).__name__}: {exc}"[:500]
            print(f"{label} {op}: FAILED {err}", flush=True)
            rows += [{"workload": label, "op": op, "path": p, "error": err} for p in paths]
    del calls
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return rows, shapes


def bare_launches(torch: Any, args: argparse.Namespace) -> list[dict]:
    """Host time of an empty kernel of 4 and of 30 arguments: ``kernel[grid](...)`` and
    the lean launch of the same compiled kernel."""
    from kareus.exec.kernels import _launch

    if triton is None:
        return []
    k4, k30 = _bare4, _bare30
    x = torch.zeros(16, device=_device(torch), dtype=torch.float32)
    rt = _launch.runtime()
    rows = []
    for name, fn, ints in (("empty kernel, 4 arguments", k4, (3, 5, 7)),
                           ("empty kernel, 30 arguments", k30, tuple(range(3, 32)))):
        def plain(fn: Any = fn, ints: tuple = ints) -> None:
            fn[(1,)](x, *ints)

        rec: list = []
        _launch.plain_launch(fn, (1,), (x, *ints), {}, rec)
        sites = (_launch.lean_sites(rt, rec, (x,), {"X": 0}, {}) if rt is not None else None)
        paths = {"plain": plain}
        if sites is not None:
            site = sites[0]
            dev = rt.current_device()

            def lean(site: Any = site, dev: int = dev) -> None:
                site(rt.current_stream(dev), x.data_ptr())  # type: ignore[union-attr]
            paths["lean"] = lean
        for p, f in paths.items():
            for _ in range(WARMUP_CALLS):
                f()
            rounds = [host_round_us(torch, f, args.calls) for _ in range(args.rounds)]
            rows.append({"workload": "-", "op": name, "path": p, "kernel": f"triton "
                         f"{triton.__version__}",
                         **summarize([t for r in rounds for t in r], rounds)})
    return rows


def check(rows: list[dict], lean_available: bool) -> list[str]:
    """Why ``--check`` fails: each kareus op over budget on the lean path, without its
    fast launches, or different from the plain path."""
    bad = [] if lean_available else ["lean launches unavailable in this process"]
    for r in rows:
        if r["path"] != "lean" or r["workload"] == "-":
            continue
        where = f"{r['workload']} {r['op']}"
        if "error" in r:
            bad.append(f"{where}: {r['error']}")
            continue
        if r["host_us"] > BUDGET_US:
            bad.append(f"{where}: {r['host_us']:.1f} us > {BUDGET_US:.0f} us")
        if not r.get("fast_path"):
            bad.append(f"{where}: no fast launch")
        if not r.get("equal_to_plain"):
            bad.append(f"{where}: output differs from the plain path")
    return bad


def print_table(rows: list[dict]) -> None:
    by = {(r["workload"], r["op"], r["path"]): r for r in rows}
    keys = list(dict.fromkeys((r["workload"], r["op"]) for r in rows))
    print(f"\n{'workload':24} {'op':27} {'lean us':>8} {'python':>7} {'plain us':>9} "
          f"{'liger us':>9} {'GPU us':>7}  fast  equal")
    for w, op in keys:
        lean, plain, liger = (by.get((w, op, p)) for p in ("lean", "plain", "liger"))

        def fmt(r: dict | None, k: str = "host_us", width: int = 8) -> str:
            return f"{r[k]:{width}.1f}" if r and r.get(k) is not None else f"{'-':>{width}}"
        fast = "-" if not lean or "fast_path" not in lean else ("yes" if lean["fast_path"]
                                                                 else "NO")
        if any(r and "error" in r for r in (lean, plain, liger)):
            fast = "ERR"
        eq = "-" if not lean or "equal_to_plain" not in lean else (
            "yes" if lean["equal_to_plain"] else "NO")
        print(f"{w:24} {op:27} {fmt(lean)} {fmt(lean, 'host_us_no_launch', 7)} "
              f"{fmt(plain, width=9)} {fmt(liger, width=9)} {fmt(lean, 'gpu_us', 7)}  "
              f"{fast:4}  {eq}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", default=None, help="write the full result here")
    ap.add_argument("--calls", type=int, default=30, help="timed calls a round (>= 30)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per op and path")
    ap.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS),
                    help="comma-separated labels of WORKLOADS")
    ap.add_argument("--no-liger", action="store_true", help="skip liger-kernel's path")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 if a kareus op's lean host time exceeds {BUDGET_US:.0f} us")
    args = ap.parse_args(argv)
    if args.calls < 30:
        ap.error("--calls must be at least 30")
    chosen = [w for w in WORKLOADS if w[0] in args.workloads.split(",")]
    if not chosen:
        ap.error(f"no known workload in {args.workloads!r}; labels: "
                 f"{', '.join(w[0] for w in WORKLOADS)}")
    try:
        import torch
    except ImportError:
        print("launch_cost.py: needs PyTorch with CUDA (torch is not installed)",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("launch_cost.py: needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    try:
        from kareus.exec.kernels import _launch
        from kareus.exec.kernels.triton_ops import TritonKernels, liger_version
    except ImportError as exc:
        print(f"launch_cost.py: needs Triton ({exc})", file=sys.stderr)
        return 2
    t0 = time.time()
    rt = _launch.runtime()
    sets: dict[str, Any] = {"lean": TritonKernels(), "plain": TritonKernels(lean=False)}
    liger_note = None if liger_version() else "not installed"
    if liger_version() and not args.no_liger:
        try:  # a liger-kernel that fails here is reported, not a failed run
            lig = TritonKernels(use_liger=True)
            x = torch.randn(64, 256, device=_device(torch), dtype=torch.bfloat16)
            lig.rms_norm(x, torch.ones(256, device=x.device, dtype=x.dtype))
            lig.swiglu(x, x)
            torch.cuda.synchronize()
            sets["liger"] = lig
        except Exception as exc:
            liger_note = f"failed: {type(exc).__name__}: {exc}"[:300]
            print(f"liger-kernel left out: {liger_note}", flush=True)
    out: dict[str, Any] = {
        "command": "python bench/launch_cost.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "machine": machine(torch), "host_method": HOST_METHOD,
        "lean_runtime": {"available": rt is not None,
                         "triton": getattr(rt, "version", None)},
        "budget_us": BUDGET_US, "paths": {p: repr(ks) for p, ks in sets.items()},
        "liger_note": liger_note,
        "seq_len": SEQ_LEN, "nanobatches": NANOBATCHES, "workloads": {}, "rows": []}
    print(f"lean launches: {'available' if rt is not None else 'UNAVAILABLE'} "
          f"(triton {out['machine']['triton']}); paths: {', '.join(sets)}", flush=True)

    def save() -> None:  # after every stage, so a run cut short keeps what it measured
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    flush = torch.empty(FLUSH_ELEMENTS, device=_device(torch), dtype=torch.bfloat16).normal_()
    for label, preset, par, mb in chosen:
        rows, shapes = measure_workload(torch, label, preset, par, mb, sets, args, flush)
        out["rows"] += rows
        out["workloads"][label] = {"preset": preset, **par, "microbatch_size": mb, **shapes}
        print(f"{label} measured ({time.time() - t0:.0f} s)", flush=True)
        save()
    del flush
    try:
        out["rows"] += bare_launches(torch, args)
    except Exception as exc:  # context only: never fails the run
        out["bare_launch_error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"bare launches: FAILED {out['bare_launch_error']}", flush=True)
    bad = check(out["rows"], rt is not None)
    out["check"] = {"budget_us": BUDGET_US, "met": not bad, "missed": bad}
    out["elapsed_s"] = time.time() - t0
    save()
    print_table(out["rows"])
    print(f"\nlean host time <= {BUDGET_US:.0f} us per kareus op: "
          f"{'MET' if not bad else 'MISSED'}" + ("" if not bad else ": " + "; ".join(bad)))
    print(f"elapsed {out['elapsed_s']:.0f} s")
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
