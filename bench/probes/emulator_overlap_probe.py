"""Overlap of GEMMs and an SM-capped all-reduce on real GPUs (kareus's own kernels and NCCL).

Per rank: a chain of 4 bf16 GEMMs 8192x4096 @ 4096x4096 and an all-reduce of 64 MiB, each
alone, and both together (the all-reduce launched first on a side stream, then the GEMMs),
at SM caps 2, 8 and 32, for kareus's own kernels and for NCCL capped at the same CTA count.
Each figure is the mean over ``--steps`` back-to-back steps, the median over ``--trials``
interleaved trials, on rank 0 (all ranks run the same calls). Default clocks, nothing
locked. The emulator's interference constants for a backend are fitted to these times by
``bench/probes/emulator_calibration.py --overlap-probe``-style code in ``docs/emulator.md``.

Usage::

    torchrun --standalone --nproc_per_node 2 bench/probes/emulator_overlap_probe.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=7)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    from kareus.exec.collectives import NCCLCappedCollective, OwnKernelCollective

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    backends = {"own": OwnKernelCollective(), "nccl": NCCLCappedCollective()}
    dev = torch.device("cuda", local)
    M, K, N = 8192, 4096, 4096
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) / 64 for _ in range(4)]
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    buf = torch.randn(M * K, device=dev, dtype=torch.bfloat16)  # 64 MiB
    side = torch.cuda.Stream()
    main_s = torch.cuda.current_stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def gemms() -> None:
        x = a
        for wi in w:
            torch.matmul(x, wi, out=c)
            x = c

    def step(kind: str, backend: str, sms: int) -> None:
        if kind in ("ar", "both"):
            side.wait_stream(main_s)
            backends[backend].all_reduce(buf, side, sms)
        if kind in ("gemm", "both"):
            gemms()
        main_s.wait_stream(side)

    def timed(kind: str, backend: str, sms: int) -> float:
        for _ in range(3):
            step(kind, backend, sms)
        torch.cuda.synchronize()
        dist.barrier()
        e0.record()
        for _ in range(args.steps):
            step(kind, backend, sms)
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / args.steps

    configs = [("gemm", "own", 1)] + [(k, b, s) for b in ("own", "nccl") for s in (2, 8, 32)
                                       for k in ("ar", "both")]
    res: dict[str, list[float]] = {f"{k}/{b}/{s}": [] for k, b, s in configs}
    for _ in range(args.trials):
        for k, b, s in configs:
            res[f"{k}/{b}/{s}"].append(timed(k, b, s))
    out = {"gpu": torch.cuda.get_device_name(), "world_size": world, "steps": args.steps,
           "trials": args.trials,
           "what": "ms per step, rank 0, median over trials of the mean over back-to-back steps; "
                   "gemm = 4 chained 8192x4096 @ 4096x4096 bf16 GEMMs; ar = all-reduce of 64 MiB "
                   "bf16 at the SM cap; both = the all-reduce on a side stream launched first, "
                   "then the GEMMs",
           "ms": {key: statistics.median(v) for key, v in res.items()},
           "ms_all_trials": res}
    if rank == 0:
        print(json.dumps(out["ms"], indent=1), flush=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
