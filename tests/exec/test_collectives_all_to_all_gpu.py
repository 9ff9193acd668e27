"""The all-to-all on GPUs: the loopback stand-in and the timed stand-in's ``"cycle"`` kind on
one GPU; the NCCL capped backend against ``torch.distributed.all_to_all_single`` on two or
more (launched under ``torch.distributed.run``, one process per GPU, uneven splits and a
rank that receives nothing, for several SM caps). Skipped without CUDA GPUs::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python -m torch.distributed.run --nproc_per_node=2 tests/exec/test_collectives_all_to_all_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kareus.exec import collectives as C

REPO = Path(__file__).resolve().parents[2]
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_loopback_all_to_all_writes_every_received_row_on_its_stream():
    coll = C.LoopbackCollective()
    inp = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.full((1300, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    coll.all_to_all(out, inp, [200] * 5 + [300], [100] * 4 + [600] + [0], side, 8)
    side.synchronize()
    assert torch.equal(out[:1000], inp) and torch.equal(out[1000:], inp[:300])
    with pytest.raises(C.CommSMCountError):
        coll.all_to_all(out, inp, [1300], [1000], side, coll.sm_count)


def test_timed_stand_in_cycles_and_holds_its_time():
    pytest.importorskip("triton")
    from kareus.exec.kernels.timed_stand_in import timed_collective

    src = torch.randn(3000, 128, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty(4500, 128, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timed_collective("cycle", dst, src, group=1, ctas=4, duration_ns=0)  # compile
    start.record()
    timed_collective("cycle", dst, src, group=1, ctas=4, duration_ns=2_000_000)
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(dst[:3000], src) and torch.equal(dst[3000:], src[:1500])
    assert start.elapsed_time(end) >= 1.9  # ms


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_capped_all_to_all_matches_all_to_all_single():
    env = dict(os.environ, **NO_MULTICAST_ENV, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _worker() -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    coll = C.NCCLCappedCollective()
    g = torch.Generator(device="cpu").manual_seed(0)
    width = 2048  # a hidden size: rows of 4 KiB in bf16
    side = torch.cuda.Stream()
    for sms in (1, 2, 4, 8, 16, 32):
        # every rank draws the same table: rows rank s sends rank d (rank 1 gets none)
        table = torch.randint(0, 700, (world, world), generator=g)
        table[:, 1 % world] = 0
        ins = table[rank].tolist()
        outs = table[:, rank].tolist()
        inp = torch.randn(sum(ins), width, device="cuda", dtype=torch.bfloat16)
        out = torch.full((sum(outs), width), float("nan"), device="cuda", dtype=torch.bfloat16)
        ref = torch.empty_like(out)
        coll.all_to_all(out, inp, outs, ins, side, sms)
        side.synchronize()
        dist.all_to_all_single(ref, inp, outs, ins)
        torch.cuda.synchronize()
        assert torch.equal(out, ref), (rank, sms)
    coll.close()
    dist.destroy_process_group()
    print(f"rank {rank} ok")


if __name__ == "__main__":
    _worker()
