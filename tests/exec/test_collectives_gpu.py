"""GPU tests of the own SM-capped collectives (skipped without 2+ CUDA GPUs).

The pytest functions launch this file under ``torch.distributed.run`` (one process
per GPU); the ``__main__`` block is the worker. It can be run by hand too::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python -m torch.distributed.run --nproc_per_node=4 tests/exec/test_collectives_gpu.py \
        --mode correctness   # or --mode stress --calls 10000

Correctness mode, for every SM count from 1 to 32 and message sizes from 4 KiB to
256 MiB (odd element counts included), on fresh random inputs:

* all-reduce and reduce-scatter equal, bit for bit, an fp32 sum in rank order of the
  gathered inputs (what the kernels promise), and equal NCCL's result within bf16 /
  fp16 / fp32 rounding tolerance;
* all-gather equals NCCL's all-gather exactly;
* all-gather and reduce-scatter outputs are poisoned with NaN before every run, so an
  element the kernel fails to write shows; the all-reduce is in place, so an
  unwritten element keeps its input and fails the comparison;
* all-reduce results are bitwise identical on every rank;
* the same checks on registered tensors (``OwnKernelCollective.empty``), for both
  registered all-reduce algorithms.

Stress mode issues N back-to-back collectives with SM counts, ops, sizes and streams
drawn from one seeded generator (the same sequence on every rank), checking results
every 500 calls; a hang trips the kernels' spin timeout instead of stalling.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Message sizes in bytes of bf16 (halved element counts for fp32 keep the byte size).
SIZES_BYTES = [4096, 4096 + 2, 64 * 1024 - 6, MIB + 14, 3 * MIB + 2, 8 * MIB, 33 * MIB + 6, 256 * MIB]


def _gpu_count() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _launch(nproc: int, *args: str, timeout_s: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **NO_MULTICAST_ENV, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_own_collectives_match_reference_for_every_sm_count(nproc: int) -> None:
    if _gpu_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    proc = _launch(nproc, "--mode", "correctness", timeout_s=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "CORRECTNESS OK" in proc.stdout


@pytest.mark.gpu
@pytest.mark.slow
def test_ten_thousand_calls_with_changing_sm_counts_do_not_hang() -> None:
    n = _gpu_count()
    if n < 2:
        pytest.skip("needs 2 GPUs")
    nproc = 8 if n >= 8 else (4 if n >= 4 else 2)
    proc = _launch(nproc, "--mode", "stress", "--calls", "10000", timeout_s=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "STRESS OK calls=10000" in proc.stdout


# ============================================================== worker (torchrun)


def _init() -> tuple[object, object, int, int]:
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return torch, dist, dist.get_rank(), dist.get_world_size()


def _rank_order_sum(torch: object, parts: list) -> object:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


def _tolerance(dtype_name: str) -> dict[str, float]:
    return {"bfloat16": {"rtol": 1.6e-2, "atol": 3e-2}, "float16": {"rtol": 2e-3, "atol": 4e-3},
            "float32": {"rtol": 1e-5, "atol": 1e-5}}[dtype_name]


def _check_case(torch, dist, coll, rank: int, world: int, op: str, nbytes: int, dtype_name: str,
                sms: int, seed: int, stream, reg=None) -> list[str]:
    """Runs one collective and returns failure messages (empty when correct).

    With ``reg`` (a registered uint8 tensor from ``coll.empty``), the all-reduce
    tensor, the all-gather output or the reduce-scatter input is carved from it, at
    offset 0 on every rank, so the registered (zero-copy) kernels run.
    """
    dtype = getattr(torch, dtype_name)
    esize = torch.empty((), dtype=dtype).element_size()
    numel = max(1, nbytes // esize)
    dev = torch.cuda.current_device()
    gen = torch.Generator(device="cuda").manual_seed(seed * 1009 + rank)
    fails: list[str] = []
    tag = f"{op} {dtype_name} bytes={nbytes} numel={numel} sms={sms} registered={reg is not None}"

    def carve(n: int):
        return reg[: n * esize].view(dtype) if reg is not None else torch.empty(n, device=dev, dtype=dtype)

    if op == "all_reduce":
        x = torch.randn(numel, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        gathered = torch.empty(world * numel, device=dev, dtype=dtype)
        dist.all_gather_into_tensor(gathered, x)
        nccl = x.clone()
        dist.all_reduce(nccl)
        out = carve(numel)
        out.copy_(x)
        stream.wait_stream(torch.cuda.current_stream())
        coll.all_reduce(out, stream, sms)
        torch.cuda.current_stream().wait_stream(stream)
        ref = _rank_order_sum(torch, list(gathered.view(world, numel).unbind(0))).to(dtype)
        if not torch.equal(out, ref):
            bad = (out != ref).nonzero()
            fails.append(f"{tag}: {bad.numel()} elements differ from the rank-order fp32 sum, "
                         f"first at {bad[:4].flatten().tolist()}")
        if not torch.allclose(out.float(), nccl.float(), **_tolerance(dtype_name)):
            fails.append(f"{tag}: differs from NCCL beyond tolerance "
                         f"(max abs diff {(out.float() - nccl.float()).abs().max().item():.3g})")
        everyone = torch.empty(world * numel, device=dev, dtype=dtype)
        dist.all_gather_into_tensor(everyone, out)
        if not all(torch.equal(everyone.view(world, numel)[q], out) for q in range(world)):
            fails.append(f"{tag}: ranks hold different results")
    elif op == "all_gather":
        m = max(1, numel // world)
        x = torch.randn(m, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        ref = torch.empty(world * m, device=dev, dtype=dtype)
        dist.all_gather_into_tensor(ref, x)
        out = carve(world * m)
        out.fill_(float("nan"))
        stream.wait_stream(torch.cuda.current_stream())
        coll.all_gather(out, x, stream, sms)
        torch.cuda.current_stream().wait_stream(stream)
        if not torch.equal(out, ref):
            fails.append(f"{tag}: all-gather differs from NCCL in "
                         f"{(out != ref).sum().item()} elements (NaN = unwritten)")
    else:
        m = max(1, numel // world)
        x = carve(world * m)
        x.copy_(torch.randn(world * m, generator=gen, device=dev, dtype=torch.float32))
        gathered = torch.empty(world * world * m, device=dev, dtype=dtype)
        dist.all_gather_into_tensor(gathered, x)
        nccl = torch.empty(m, device=dev, dtype=dtype)
        dist.reduce_scatter_tensor(nccl, x)
        out = torch.full((m,), float("nan"), device=dev, dtype=dtype)
        stream.wait_stream(torch.cuda.current_stream())
        coll.reduce_scatter(out, x, stream, sms)
        torch.cuda.current_stream().wait_stream(stream)
        parts = [gathered.view(world, world, m)[q, rank] for q in range(world)]
        ref = _rank_order_sum(torch, parts).to(dtype)
        if not torch.equal(out, ref):
            fails.append(f"{tag}: {(out != ref).sum().item()} elements differ from the "
                         "rank-order fp32 sum (NaN = unwritten)")
        if not torch.allclose(out.float(), nccl.float(), **_tolerance(dtype_name)):
            fails.append(f"{tag}: differs from NCCL beyond tolerance")
    return fails


def _worker_correctness(args: argparse.Namespace) -> int:  # noqa: C901 - one worker checking every collective, size, dtype and SM count
    torch, dist, rank, world = _init()
    from kareus.exec.collectives import OwnKernelCollective

    coll = OwnKernelCollective(staging_bytes=600 * MIB, spin_timeout_s=60.0, memory=args.memory)
    stream = torch.cuda.Stream()
    ops = ("all_reduce", "all_gather", "reduce_scatter")
    cases: list[tuple[str, int, str, int]] = []
    max_sms = args.max_sms
    for sms in range(1, max_sms + 1):  # every SM count, sizes rotated across them
        for j, op in enumerate(ops):
            nbytes = SIZES_BYTES[(3 * sms + j) % len(SIZES_BYTES)]
            dtype = "float16" if sms % 5 == 0 else ("float32" if sms % 7 == 0 else "bfloat16")
            cases.append((op, nbytes, dtype, sms))
    for sms in sorted({1, 8, max_sms}):  # every size at a few SM counts
        for op in ops:
            for nbytes in SIZES_BYTES:
                cases.append((op, nbytes, "bfloat16", sms))
    for dtype in ("float16", "float32"):
        for op in ops:
            for nbytes in SIZES_BYTES[:6]:
                cases.append((op, nbytes, dtype, 4))
    # The one-shot all-reduce is the default only up to 256 KiB: check it on larger sizes too.
    one = OwnKernelCollective(staging_bytes=600 * MIB, algorithm="one_shot", spin_timeout_s=60.0,
                              memory=args.memory)
    fails: list[str] = []
    for i, (op, nbytes, dtype, sms) in enumerate(cases):
        fails += _check_case(torch, dist, coll, rank, world, op, nbytes, dtype, sms, i, stream)
    for i, nbytes in enumerate(SIZES_BYTES[:7]):
        fails += _check_case(torch, dist, one, rank, world, "all_reduce", nbytes, "bfloat16",
                             1 + (5 * i) % max_sms, 10_000 + i, stream)
    # Registered (zero-copy) kernels: every SM count, sizes rotated, both all-reduce
    # algorithms, plus every size at 1, 8 and 32 SMs.
    reg_cases = 0
    for alg in ("one_phase", "two_phase"):
        rc = OwnKernelCollective(staging_bytes=600 * MIB, registered_algorithm=alg,
                                 spin_timeout_s=60.0, memory=args.memory)
        big = rc.empty((max(SIZES_BYTES) + 4096) // 4, torch.float32)
        reg = big.view(torch.uint8)
        todo = [(op, SIZES_BYTES[(5 * sms + j) % len(SIZES_BYTES)], "bfloat16", sms)
                for sms in range(1, max_sms + 1) for j, op in enumerate(ops)
                if alg == "one_phase" or op == "all_reduce"]
        todo += [("all_reduce", nb, "bfloat16", sms) for sms in sorted({1, 8, max_sms})
                 for nb in SIZES_BYTES]
        todo += [("all_reduce", nb, dt, 3) for dt in ("float16", "float32") for nb in SIZES_BYTES[:6]]
        for i, (op, nbytes, dtype, sms) in enumerate(todo):
            fails += _check_case(torch, dist, rc, rank, world, op, nbytes, dtype, sms,
                                 20_000 + 100 * reg_cases + i, stream, reg=reg)
        reg_cases += len(todo)
        rc.close()
    torch.cuda.synchronize()
    counts = [None] * world
    dist.all_gather_object(counts, len(fails))
    for msg in fails[:20]:
        print(f"[rank {rank}] FAIL {msg}", flush=True)
    if rank == 0:
        total = len(cases) + 7 + reg_cases
        if sum(counts) == 0:
            print(f"CORRECTNESS OK world={world} cases={total} sms=1..{max_sms}", flush=True)
        else:
            print(f"CORRECTNESS FAILED world={world} failures per rank={counts}", flush=True)
    one.close()
    coll.close()
    dist.destroy_process_group()
    return 0 if sum(counts) == 0 else 1


def _worker_stress(args: argparse.Namespace) -> int:
    import random
    import time

    torch, dist, rank, world = _init()
    from kareus.exec.collectives import OwnKernelCollective

    coll = OwnKernelCollective(staging_bytes=64 * MIB, spin_timeout_s=60.0, memory=args.memory,
                               registered_algorithm=args.registered_algorithm)
    rng = random.Random(20261129)  # same sequence on every rank
    dev = torch.cuda.current_device()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    sizes = [2048, 32 * 1024 + 3, 512 * 1024, 4 * MIB + 5]  # bf16 elements
    gen = torch.Generator(device="cuda").manual_seed(rank)
    src = {n: torch.randn(world * n, generator=gen, device=dev).to(torch.bfloat16) for n in sizes}
    reg = coll.empty(world * max(sizes), torch.bfloat16)
    fails = 0
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.calls):
        op = rng.choice(("all_reduce", "all_gather", "reduce_scatter"))
        n = rng.choice(sizes)
        sms = rng.randint(1, args.max_sms)
        s = streams[rng.randrange(2)]
        check = (i + 1) % 500 == 0
        use_reg = rng.random() < 0.5  # registered (zero-copy) or plain tensors
        s.wait_stream(torch.cuda.current_stream())
        if use_reg:  # the shared registered buffer may still be in use on the other stream
            s.wait_stream(streams[0] if s is streams[1] else streams[1])
        with torch.cuda.stream(s):
            if op == "all_reduce":
                out = reg[:n] if use_reg else torch.empty(n, device=dev, dtype=torch.bfloat16)
                out.copy_(src[n][:n])
                coll.all_reduce(out, s, sms)
            elif op == "all_gather":
                out = reg[: world * n] if use_reg else torch.empty(world * n, device=dev,
                                                                   dtype=torch.bfloat16)
                coll.all_gather(out, src[n][:n], s, sms)
            else:
                inp = src[n]
                if use_reg:
                    inp = reg[: world * n]
                    inp.copy_(src[n])
                out = torch.empty(n, device=dev, dtype=torch.bfloat16)
                coll.reduce_scatter(out, inp, s, sms)
        if check:
            torch.cuda.current_stream().wait_stream(s)
            if op == "all_reduce":
                ref = src[n][:n].clone()
                dist.all_reduce(ref)
            elif op == "all_gather":
                ref = torch.empty(world * n, device=dev, dtype=torch.bfloat16)
                dist.all_gather_into_tensor(ref, src[n][:n])
            else:
                ref = torch.empty(n, device=dev, dtype=torch.bfloat16)
                dist.reduce_scatter_tensor(ref, src[n])
            if not torch.allclose(out.float(), ref.float(), rtol=1.6e-2, atol=3e-2):
                fails += 1
                print(f"[rank {rank}] call {i} {op} n={n} sms={sms}: wrong result", flush=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    counts = [None] * world
    dist.all_gather_object(counts, fails)
    if rank == 0:
        status = "OK" if sum(counts) == 0 else "FAILED"
        print(f"STRESS {status} calls={args.calls} world={world} sms=1..{args.max_sms} "
              f"wall_s={elapsed:.2f} checks={args.calls // 500} failures={counts}", flush=True)
    coll.close()
    dist.destroy_process_group()
    return 0 if sum(counts) == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("correctness", "stress"), required=True)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--max-sms", type=int, default=32)
    parser.add_argument("--memory", choices=("ipc", "symm_mem"), default="ipc")
    parser.add_argument("--registered-algorithm", default="auto")
    args = parser.parse_args(argv)
    os.environ.update(NO_MULTICAST_ENV)  # never NVLink multicast, whatever the caller set
    if args.mode == "correctness":
        return _worker_correctness(args)
    return _worker_stress(args)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
