"""Why do GEMMs slow down beside a collective? Separate SM occupancy from memory traffic.

Runs on one GPU at default clocks (nothing locked). A chain of 4 bf16 GEMMs 8192x4096 @
4096x4096 is timed alone and beside ``k`` side-stream blocks that each fill one SM
(1024 threads and 200 KiB of shared memory, so no GEMM block can share the SM):

* ``spin``: the blocks only spin on the clock (SMs taken, no memory traffic);
* ``copy``: the blocks copy a 2 GiB buffer with 16-byte loads and stores (SMs taken
  plus HBM traffic, like a collective's local side).

The side kernels are launched first, then the GEMMs, each side kernel lasting about
as long as the GEMM chain alone. Runs alternate (alone, spin, copy) to cancel clock drift.
Also times the copy kernel alone, to see how much it slows down beside the GEMMs.

Usage (on the GPU machine): ``python bench/probes/emulator_interference_probe.py --json OUT.json``
"""

from __future__ import annotations

import argparse
import json
import statistics

SRC = r"""
extern "C" __global__ void spin(long long cycles) {
  extern __shared__ char smem[];
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
  if (cycles < 0) smem[threadIdx.x] = 1;
}
extern "C" __global__ void copy(const int4* __restrict__ src, int4* __restrict__ dst,
                                long long n, int reps) {
  extern __shared__ char smem[];
  for (int r = 0; r < reps; ++r)
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
      dst[i] = src[i];
  if (reps < 0) smem[threadIdx.x] = 1;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--trials", type=int, default=15)
    args = ap.parse_args()
    import cupy as cp
    import torch

    dev = torch.device("cuda")
    mod = cp.RawModule(code=SRC)
    spin, copy = mod.get_function("spin"), mod.get_function("copy")
    smem = 200 * 1024
    for f in (spin, copy):
        f.max_dynamic_shared_size_bytes = smem
    side = torch.cuda.Stream()
    cside = cp.cuda.ExternalStream(side.cuda_stream)
    M, K, N = 8192, 4096, 4096
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = [torch.randn(K, N, device=dev, dtype=torch.bfloat16) / 64 for _ in range(4)]
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    src = cp.zeros(2**29, dtype=cp.int32)  # 2 GiB
    n16_max = src.nbytes // 16
    dst = cp.empty_like(src)
    e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def gemms() -> None:
        x = a
        for wi in w:
            torch.matmul(x, wi, out=c)
            x = c

    def timed(launch_side) -> tuple[float, float]:
        """(GEMM chain ms, side kernel ms) with the side kernel launched first."""
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        e[2].record(side)
        if launch_side is not None:
            with side:
                launch_side()
        e[3].record(side)
        torch.cuda.current_stream().wait_event(e[2])
        e[0].record()
        gemms()
        e[1].record()
        torch.cuda.synchronize()
        return e[0].elapsed_time(e[1]), e[2].elapsed_time(e[3])

    for _ in range(30):
        gemms()
    torch.cuda.synchronize()
    alone = statistics.median(timed(None)[0] for _ in range(10))
    # Spin cycles ~ the chain's time at ~1.5-2 GHz.
    cycles = int(alone * 1e-3 * 1.9e9)

    def copy_n16(k: int) -> int:
        # About as long as the GEMM chain: k blocks move ~25 GB/s each (first guess);
        # each 16-byte element is read once and written once.
        return min(n16_max, int(alone * 1e-3 * k * 25e9 / 32))

    out: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "gemm_chain_alone_ms": alone,
                              "rows": []}
    rows: list[dict[str, float]] = out["rows"]  # type: ignore[assignment]
    for k in (2, 8, 16, 32, 64):
        n16 = copy_n16(k)
        reps = 1
        # Copy kernel alone (no GEMMs): its time and bandwidth.
        cs = []
        for _ in range(3):
            torch.cuda.synchronize()
            e[2].record(side)
            with side:
                copy((k,), (1024,), (src, dst, cp.int64(n16), cp.int32(reps)), shared_mem=smem,
                     stream=cside)
            e[3].record(side)
            torch.cuda.synchronize()
            cs.append(e[2].elapsed_time(e[3]))
        copy_alone = statistics.median(cs)
        res = {"alone": [], "spin": [], "copy": [], "copy_side": [], "spin_side": []}
        for _ in range(args.trials):
            res["alone"].append(timed(None)[0])
            g, s = timed(lambda k=k: spin((k,), (1024,), (cp.int64(cycles),), shared_mem=smem,
                                          stream=cside))
            res["spin"].append(g)
            res["spin_side"].append(s)
            g, s = timed(lambda k=k, n16=n16: copy(
                (k,), (1024,), (src, dst, cp.int64(n16), cp.int32(1)), shared_mem=smem,
                stream=cside))
            res["copy"].append(g)
            res["copy_side"].append(s)
        med = {key: statistics.median(v) for key, v in res.items()}
        row = {"k_sms": k, "gemm_alone_ms": med["alone"], "gemm_beside_spin_ms": med["spin"],
               "spin_ms": med["spin_side"], "gemm_beside_copy_ms": med["copy"],
               "copy_beside_gemm_ms": med["copy_side"], "copy_alone_ms": copy_alone,
               "copy_bytes": 32.0 * n16,
               "copy_alone_gbps": 32.0 * n16 / (copy_alone * 1e-3) / 1e9,
               "copy_beside_gemm_gbps": 32.0 * n16 / (med["copy_side"] * 1e-3) / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
