"""How repeatable is the ranking of the 12 overlap-probe schedules on real GPUs?

The 4x H200 overlap probe (data/h200_tp4_overlap_probe.json) measured one
TP-like partition under 12 schedules (NCCL CTA cap x launch mode) once each, at default
clocks under the 700 W power limit. The emulator matches its worst row but not its best:
the measured best (NCCL default CTAs, all-reduce launched with the first GEMM) drew
678 W while its neighbours drew 698-727 W at the same power limit. This bench runs the
same 12 schedules ``--rounds`` times, in a different order each round (the same order on
every rank), and reports per schedule the spread of energy per step and average power
over the rounds, and which schedule is lowest-energy in each round: if the best row
changes between rounds, a single measurement cannot decide it.

Per step on each rank (as the probe): two memory-bound elementwise passes over a
96M-element bf16 tensor (``mul_``, ``add_``), three chained bf16 GEMMs 8192x4096 @
4096x4096, one NCCL all-reduce of 64 MiB over all ranks. Modes: ``seq`` (all-reduce after
the computation, one stream), ``with_mem`` (all-reduce on a side stream launched with the
first memory-bound op), ``with_gemm`` (launched with the first GEMM). ``cap``: NCCL
``min_ctas = max_ctas`` (``None``: NCCL's default). Energy: each rank's NVML
total-energy counter over a window of back-to-back steps (at least ``--window-s``; the
step count is fixed by rank 0 so every rank runs the same loop), per GPU. Default clocks,
nothing locked or changed.

Usage::

    torchrun --standalone --nproc_per_node 2 bench/probes/h200_overlap_repeat.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time

ROWS = [(None, "seq"), (None, "with_mem"), (None, "with_gemm"), (16, "with_mem"),
        (16, "with_gemm"), (8, "with_mem"), (8, "with_gemm"), (4, "seq"), (4, "with_mem"),
        (4, "with_gemm"), (2, "with_mem"), (2, "with_gemm")]


def _key(cap: int | None, mode: str) -> str:
    return f"{cap if cap is not None else 'default'}/{mode}"


def main() -> int:  # noqa: C901 - a linear bench script, one branch per option and output
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=1.5)
    ap.add_argument("--preheat-s", type=float, default=5.0)
    args = ap.parse_args()
    import pynvml
    import torch
    import torch.distributed as dist

    from kareus.exec.collectives import NCCLCappedCollective
    from kareus.profilers.nvml import nvml_device_index

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_device_index(local))  # by UUID
    capped = NCCLCappedCollective()

    dev = torch.device("cuda", local)
    big = torch.rand(96 * 2**20, device=dev, dtype=torch.bfloat16)
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    w = [torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) / 64 for _ in range(3)]
    c = [torch.empty(8192, 4096, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    buf = torch.randn(8192 * 4096, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    main_s = torch.cuda.current_stream()

    def allreduce(cap: int | None) -> None:
        if cap is None:
            dist.all_reduce(buf)
        else:
            capped.all_reduce(buf, torch.cuda.current_stream(), cap)

    def mem() -> None:
        big.mul_(1.0001)
        big.add_(0.0001)

    def gemms() -> None:
        x = a
        for i, wi in enumerate(w):
            torch.matmul(x, wi, out=c[i % 2])
            x = c[i % 2]

    def step(cap: int | None, mode: str) -> None:
        if mode == "seq":
            mem()
            gemms()
            allreduce(cap)
            return
        if mode == "with_gemm":
            mem()
        side.wait_stream(main_s)
        with torch.cuda.stream(side):
            allreduce(cap)
        if mode == "with_mem":
            mem()
        gemms()
        main_s.wait_stream(side)

    def agreed_steps(seconds_per_step: float) -> int:
        t = torch.tensor([seconds_per_step], device=dev, dtype=torch.float64)
        dist.broadcast(t, 0)
        return max(20, math.ceil(args.window_s / float(t.item())))

    for cap, _ in ROWS:  # create the capped communicators up front, in the same order
        if cap is not None:
            capped.group_for(cap)
    # Pre-heat with the GEMMs: the first rows must not run on a cold GPU.
    t_end = time.time() + args.preheat_s
    flag = torch.zeros(1, device=dev)
    while True:
        for _ in range(50):
            gemms()
        torch.cuda.synchronize()
        flag.fill_(1.0 if time.time() < t_end else 0.0)
        dist.broadcast(flag, 0)  # rank 0 decides when all stop
        if flag.item() == 0.0:
            break

    results: dict[str, list[dict[str, float]]] = {_key(*r): [] for r in ROWS}
    orders = []
    for rnd in range(args.rounds):
        order = list(ROWS)
        random.Random(1000 + rnd).shuffle(order)
        orders.append([_key(*r) for r in order])
        for cap, mode in order:
            for _ in range(10):
                step(cap, mode)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                step(cap, mode)
            torch.cuda.synchronize()
            n = agreed_steps((time.perf_counter() - t0) / 20)
            dist.barrier()
            torch.cuda.synchronize()
            e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            t0 = time.perf_counter()
            for _ in range(n):
                step(cap, mode)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            e1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            results[_key(cap, mode)].append({
                "round": rnd, "steps": n, "ms_per_step": (t1 - t0) / n * 1e3,
                "mj_per_step": (e1 - e0) / n, "avg_w": (e1 - e0) / 1e3 / (t1 - t0),
                "sm_clock_mhz_after": clock})
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        rows = {}
        for key in results:
            per_rank = [g[key] for g in gathered]  # type: ignore[index]
            per_round = []
            for rnd in range(args.rounds):
                recs = [pr[rnd] for pr in per_rank]
                per_round.append({
                    "ms_per_step": statistics.mean(r["ms_per_step"] for r in recs),
                    "mj_per_step_per_gpu": statistics.mean(r["mj_per_step"] for r in recs),
                    "avg_w_per_gpu": statistics.mean(r["avg_w"] for r in recs),
                    "sm_clock_mhz_after": [r["sm_clock_mhz_after"] for r in recs]})
            rows[key] = per_round
        best = [min(rows, key=lambda k, r=rnd: rows[k][r]["mj_per_step_per_gpu"])
                for rnd in range(args.rounds)]
        worst = [max(rows, key=lambda k, r=rnd: rows[k][r]["mj_per_step_per_gpu"])
                 for rnd in range(args.rounds)]
        print(f"{world}x {torch.cuda.get_device_name()}, {args.rounds} rounds; per GPU")
        print("| schedule | ms/step (median) | mJ/step median | min | max | spread | W min-max |")
        print("|---|---|---|---|---|---|---|")
        for key, pr in rows.items():
            e = [r["mj_per_step_per_gpu"] for r in pr]
            ws = [r["avg_w_per_gpu"] for r in pr]
            ms = statistics.median(r["ms_per_step"] for r in pr)
            print(f"| {key} | {ms:.3f} | {statistics.median(e):.1f} | {min(e):.1f} | "
                  f"{max(e):.1f} | {(max(e) - min(e)) / statistics.median(e):.1%} | "
                  f"{min(ws):.0f}-{max(ws):.0f} |")
        print("best per round:", best)
        print("worst per round:", worst)
        out = {"gpu": torch.cuda.get_device_name(), "world_size": world,
               "rounds": args.rounds, "window_s": args.window_s, "orders": orders,
               "torch": torch.__version__, "rows": rows, "best_per_round": best,
               "worst_per_round": worst, "per_rank": gathered}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
