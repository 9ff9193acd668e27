"""Bus bandwidth of the SM-capped collective backends, side by side with uncapped NCCL.

Run one process per GPU, e.g. on 4x H200 (NVLink)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python -m torch.distributed.run --nproc_per_node=4 bench/collectives.py \
        --json bench/results/collectives_4xh200.json

For every op (all-reduce, all-gather, reduce-scatter), message size (default 1, 8,
64, 256 MiB of bf16) and SM count (default 1, 2, 4, 8, 16, 32) it times the own
kernels (:class:`~kareus.exec.collectives.OwnKernelCollective`) and NCCL capped at
the same CTA count (:class:`~kareus.exec.collectives.NCCLCappedCollective`), plus
NCCL with its own CTA choice ("uncapped") once per op and size. It prints a table
and writes every number to ``--json``.

Definitions (as nccl-tests): the message is the all-reduce tensor, the all-gather
output or the reduce-scatter input; algorithm bandwidth = message bytes / time; bus
bandwidth = algorithm bandwidth x 2(n-1)/n (all-reduce) or x (n-1)/n (the others).
Time per call is the slowest rank's mean over a batch of back-to-back calls (CUDA
events), the median over ``--trials`` batches. Batch lengths are agreed by all ranks
(max over ranks), so every rank issues the same calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _machine(torch: object) -> dict[str, object]:
    info: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "gpus": torch.cuda.device_count(),
        "sm_count": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(str(v) for v in torch.cuda.nccl.version()),
        "host_cpu": platform.processor() or platform.machine(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip().splitlines()
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        info["topology"] = topo.stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _time_per_call(torch, dist, fn, *, target_s: float, trials: int) -> float:
    """Median over trials of the slowest rank's mean time per call, in seconds."""
    dev = torch.cuda.current_device()
    fn()
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = torch.tensor([start.elapsed_time(end) / 1e3], device=dev)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)  # every rank agrees on the batch length
    iters = int(min(500, max(3, target_s / max(one.item(), 1e-6))))
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        dist.barrier()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end) / 1e3 / iters], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def _uncapped_call(dist, op: str, out, inp):
    if op == "all_reduce":
        return lambda: dist.all_reduce(out)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, inp)
    return lambda: dist.reduce_scatter_tensor(out, inp)


def _backend_call(backend, op: str, out, inp, sms: int):
    if op == "all_reduce":
        return lambda: backend.all_reduce(out, None, sms)
    if op == "all_gather":
        return lambda: backend.all_gather(out, inp, None, sms)
    return lambda: backend.reduce_scatter(out, inp, None, sms)


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - a linear bench script, one branch per option and output
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--sms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--ops", nargs="+", default=["all_reduce", "all_gather", "reduce_scatter"])
    parser.add_argument("--backends", nargs="+", default=["own", "own_reg", "nccl_capped"],
                        choices=["own", "own_reg", "own_reg_two_phase", "nccl_capped"],
                        help="own: plain tensors; own_reg: tensors from OwnKernelCollective.empty()")
    parser.add_argument("--threads-per-block", type=int, default=None)
    parser.add_argument("--loads-in-flight", type=int, default=None)
    parser.add_argument("--tag", default="", help="label stored in the JSON")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--target-ms", type=float, default=20.0, help="length of one timed batch")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--staging-mib", type=int, default=600)
    parser.add_argument("--memory", choices=("ipc", "symm_mem"), default="ipc")
    args = parser.parse_args(argv)
    os.environ.update(NO_MULTICAST_ENV)

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from kareus.exec.collectives import (
        NCCLCappedCollective,
        OwnKernelCollective,
        bus_bandwidth_factor,
        choose_all_reduce_algorithm,
        choose_registered_all_reduce_algorithm,
    )

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.cuda.current_device()
    dtype = getattr(torch, args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()

    t_build = time.perf_counter()
    backends = {}
    kernel_opts = {"threads_per_block": args.threads_per_block, "loads_in_flight": args.loads_in_flight}
    if any(b.startswith("own") for b in args.backends):
        backends["own"] = OwnKernelCollective(staging_bytes=args.staging_mib * MIB, spin_timeout_s=60.0,
                                               memory=args.memory, **kernel_opts)
    build_s = time.perf_counter() - t_build
    if "own_reg_two_phase" in args.backends:
        backends["own_reg_two_phase"] = OwnKernelCollective(
            staging_bytes=args.staging_mib * MIB, spin_timeout_s=60.0, memory=args.memory,
            registered_algorithm="two_phase", **kernel_opts)
    # Registered tensors (allocated through the backend, mapped by every rank).
    reg_big = {name: b.empty(int(max(args.sizes_mib) * MIB) // 4 + 1024, torch.float32).view(torch.uint8)
               for name, b in backends.items() if name.startswith("own")}
    if "nccl_capped" in args.backends:
        backends["nccl_capped"] = NCCLCappedCollective()

    rows: list[dict[str, object]] = []
    gen = torch.Generator(device="cuda").manual_seed(rank)
    target_s = args.target_ms / 1e3

    def record(op: str, nbytes: int, backend: str, sms: int | None, t: float, **extra: object) -> None:
        algbw = nbytes / t / 1e9
        rows.append({"op": op, "size_bytes": nbytes, "backend": backend, "sms": sms,
                     "time_us": round(t * 1e6, 2), "algbw_gbps": round(algbw, 2),
                     "busbw_gbps": round(algbw * bus_bandwidth_factor(op, world), 2), **extra})

    for op in args.ops:
        for size_mib in args.sizes_mib:
            nbytes = int(size_mib * MIB) // (esize * world) * (esize * world)
            numel = nbytes // esize
            if op == "all_reduce":
                # In place, so values grow with every call; float adds run at the same
                # speed whatever the values, and the timing never reads them.
                inp = out = torch.randn(numel, generator=gen, device=dev).to(dtype)
            elif op == "all_gather":
                inp = torch.randn(numel // world, generator=gen, device=dev).to(dtype)
                out = torch.empty(numel, device=dev, dtype=dtype)
            else:
                inp = torch.randn(numel, generator=gen, device=dev).to(dtype)
                out = torch.empty(numel // world, device=dev, dtype=dtype)
            t = _time_per_call(torch, dist, _uncapped_call(dist, op, out, inp), target_s=target_s,
                               trials=args.trials)
            record(op, nbytes, "nccl_uncapped", None, t)
            for sms in args.sms:
                for name in args.backends:
                    extra: dict[str, object] = {}
                    if name == "nccl_capped":
                        fn = _backend_call(backends[name], op, out, inp, sms)
                    elif name == "own":
                        fn = _backend_call(backends["own"], op, out, inp, sms)
                        if op == "all_reduce":
                            extra["algorithm"] = choose_all_reduce_algorithm(nbytes, world)
                    else:  # own_reg / own_reg_two_phase: the same op on registered tensors
                        key = "own" if name == "own_reg" else name
                        if name == "own_reg_two_phase" and op != "all_reduce":
                            continue
                        big = reg_big[key]
                        r_out, r_inp = out, inp
                        if op == "all_reduce":
                            r_out = r_inp = big[: numel * esize].view(dtype)
                            r_out.copy_(out)
                        elif op == "all_gather":
                            r_out = big[: numel * esize].view(dtype)
                        else:
                            r_inp = big[: numel * esize].view(dtype)
                            r_inp.copy_(inp)
                        fn = _backend_call(backends[key], op, r_out, r_inp, sms)
                        if op == "all_reduce":
                            extra["algorithm"] = choose_registered_all_reduce_algorithm(
                                nbytes, world, "two_phase" if name == "own_reg_two_phase" else "auto")
                    t = _time_per_call(torch, dist, fn, target_s=target_s, trials=args.trials)
                    record(op, nbytes, name, sms, t, **extra)
            if rank == 0:
                print(f"# done {op} {nbytes / MIB:g} MiB", flush=True)

    if rank == 0:
        _print_table(rows, args, world)
        if args.json:
            doc = {
                "what": "Bus bandwidth (GB/s, nccl-tests definition) of SM-capped collectives vs "
                        "NCCL capped at the same CTA count and uncapped NCCL; time per call is the "
                        "slowest rank's mean over a batch, median of trials.",
                "command": " ".join(["python -m torch.distributed.run", f"--nproc_per_node={world}",
                                     *sys.argv]),
                "world_size": world,
                "dtype": args.dtype,
                "machine": _machine(torch),
                "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV},
                "own_first_use_build_and_setup_s": round(build_s, 2),
                "kernel_options": kernel_opts,
                "tag": args.tag,
                "rows": rows,
                "targets": _targets(rows),
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {args.json}")
    for b in backends.values():
        b.close()
    dist.destroy_process_group()
    return 0


def _targets(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The issue's targets, evaluated on the measured rows of each own backend."""
    out = []
    by = {(r["op"], r["size_bytes"], r["backend"], r["sms"]): r for r in rows}
    for (op, size, backend, sms), r in by.items():
        if not str(backend).startswith("own"):
            continue
        nccl = by.get((op, size, "nccl_capped", sms))
        if nccl and sms <= 8 and size >= 8 * MIB:
            ratio = r["busbw_gbps"] / nccl["busbw_gbps"]
            out.append({"target": "busbw >= 1.5x nccl_capped (<=8 SMs, >=8 MiB)", "backend": backend,
                        "op": op, "size_bytes": size, "sms": sms, "ratio": round(ratio, 2),
                        "met": ratio >= 1.5})
        unc = by.get((op, size, "nccl_uncapped", None))
        if unc and sms == 32 and size >= 256 * MIB:
            ratio = r["busbw_gbps"] / unc["busbw_gbps"]
            out.append({"target": "busbw >= 0.8x uncapped NCCL (32 SMs, 256 MiB)", "backend": backend,
                        "op": op, "size_bytes": size, "sms": sms, "ratio": round(ratio, 2),
                        "met": ratio >= 0.8})
    return out


def _print_table(rows: list[dict[str, object]], args: argparse.Namespace, world: int) -> None:
    names = [b for b in args.backends]
    print(f"\nbus bandwidth GB/s, {world} GPUs, {args.dtype}; each cell: {' / '.join(names)}; "
          "last column: NCCL uncapped")
    width = 6 * len(names) + 2
    print(f"{'op':<15}{'MiB':>5} " + "".join(f"{f'sms={s}':>{width}}" for s in args.sms) + f"{'uncapped':>10}")
    by = {(r["op"], r["size_bytes"], r["backend"], r["sms"]): r["busbw_gbps"] for r in rows}
    sizes = sorted({r["size_bytes"] for r in rows})
    for op in args.ops:
        for size in sizes:
            if (op, size, "nccl_uncapped", None) not in by:
                continue
            cells = []
            for s in args.sms:
                vals = [by.get((op, size, n, s)) for n in names]
                cells.append("/".join("-" if v is None else f"{v:.0f}" for v in vals).rjust(width))
            print(f"{op:<15}{size / MIB:>5.0f} " + "".join(cells)
                  + f"{by[(op, size, 'nccl_uncapped', None)]:>10.0f}")
    targets = _targets(rows)
    for backend in names:
        mine = [t for t in targets if t["backend"] == backend]
        for kind in sorted({t["target"] for t in mine}):
            sel = [t for t in mine if t["target"] == kind]
            met = sum(t["met"] for t in sel)
            worst = min(sel, key=lambda t: t["ratio"])
            print(f"target {backend}: {kind}: met {met}/{len(sel)}; worst {worst['op']} "
                  f"{worst['size_bytes'] / MIB:g} MiB sms={worst['sms']} ratio={worst['ratio']}")


if __name__ == "__main__":
    sys.exit(main())
