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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--sms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--ops", nargs="+", default=["all_reduce", "all_gather", "reduce_scatter"])
    parser.add_argument("--backends", nargs="+", default=["own", "nccl_capped"])
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
    if "own" in args.backends:
        backends["own"] = OwnKernelCollective(staging_bytes=args.staging_mib * MIB, spin_timeout_s=60.0,
                                               memory=args.memory)
    build_s = time.perf_counter() - t_build
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
            calls = {"nccl_uncapped": _uncapped_call(dist, op, out, inp)}

            t = _time_per_call(torch, dist, calls["nccl_uncapped"], target_s=target_s, trials=args.trials)
            record(op, nbytes, "nccl_uncapped", None, t)
            for sms in args.sms:
                for name, b in backends.items():
                    t = _time_per_call(torch, dist, _backend_call(b, op, out, inp, sms), target_s=target_s, trials=args.trials)
                    extra = {}
                    if name == "own" and op == "all_reduce":
                        extra["algorithm"] = choose_all_reduce_algorithm(nbytes, world)
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
    """The issue's targets, evaluated on the measured rows."""
    out = []
    by = {(r["op"], r["size_bytes"], r["backend"], r["sms"]): r for r in rows}
    for (op, size, backend, sms), r in by.items():
        if backend != "own":
            continue
        nccl = by.get((op, size, "nccl_capped", sms))
        if nccl and sms <= 8 and size >= 8 * MIB:
            ratio = r["busbw_gbps"] / nccl["busbw_gbps"]
            out.append({"target": "own >= 1.5x nccl_capped at <=8 SMs, >=8 MiB", "op": op,
                        "size_bytes": size, "sms": sms, "ratio": round(ratio, 2), "met": ratio >= 1.5})
        unc = by.get((op, size, "nccl_uncapped", None))
        if unc and sms == 32 and size >= 256 * MIB:
            ratio = r["busbw_gbps"] / unc["busbw_gbps"]
            out.append({"target": "own at 32 SMs within 20% of uncapped NCCL, 256 MiB", "op": op,
                        "size_bytes": size, "sms": sms, "ratio": round(ratio, 2), "met": ratio >= 0.8})
    return out


def _print_table(rows: list[dict[str, object]], args: argparse.Namespace, world: int) -> None:
    print(f"\nbus bandwidth GB/s, {world} GPUs, {args.dtype}: own / nccl_capped at each SM count; "
          "nccl uncapped")
    head = f"{'op':<15}{'MiB':>6} " + "".join(f"{f'sms={s}':>15}" for s in args.sms) + f"{'uncapped':>10}"
    print(head)
    by = {(r["op"], r["size_bytes"], r["backend"], r["sms"]): r["busbw_gbps"] for r in rows}
    sizes = sorted({r["size_bytes"] for r in rows})
    for op in args.ops:
        for size in sizes:
            if (op, size, "nccl_uncapped", None) not in by:
                continue
            cells = []
            for s in args.sms:
                own = by.get((op, size, "own", s))
                nccl = by.get((op, size, "nccl_capped", s))
                cells.append(f"{own or 0:>7.0f}/{nccl or 0:<7.0f}")
            print(f"{op:<15}{size / MIB:>6.0f} " + "".join(cells)
                  + f"{by[(op, size, 'nccl_uncapped', None)]:>10.0f}")
    for t in _targets(rows):
        print(f"target {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['op']} "
              f"{t['size_bytes'] / MIB:g} MiB sms={t['sms']} ratio={t['ratio']}")


if __name__ == "__main__":
    sys.exit(main())
