"""Runnable partitions executed with the own kernels on registered buffers (2 GPUs).

The pytest function launches this file under ``torch.distributed.run`` with two
processes (skipped without 2 CUDA GPUs); the ``__main__`` block is the worker. By hand::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python -m torch.distributed.run --nproc_per_node=2 tests/exec/test_registered_execution_gpu.py

Each rank builds partitions with ``build(collective=OwnKernelCollective(...))`` from its
own seed (so the ranks' data differ) and runs them through :class:`TorchExecutor` at
several launch slots and SM counts. It checks that:

* every communication buffer of the program is registered (``is_registered``), so the
  zero-copy kernels run, while a program built without the backend has plain buffers;
* each step's collective result equals, bit for bit, the reference computed from the
  collective's input through NCCL (all-gather exactly; all-reduce and reduce-scatter
  as the fp32 sum in rank order that the own kernels promise);
* the computation equals a program built with plain buffers and run op by op with the
  reference collective (bit for bit, except partitions with the attention backward,
  whose kernels may accumulate in a varying order: there within bf16 tolerance);
* after back-to-back steps without host synchronisation, every buffer still equals
  the plain-op reference, and all-reduce results are identical on both ranks;
* :class:`TorchPartitionRunner` (the profiler's runner) builds registered programs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
OK_LINE = "REGISTERED EXECUTION OK"


def _gpu_count() -> int:
    torch = pytest.importorskip("torch")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.slow
def test_partitions_run_on_registered_buffers_and_match_plain_ops() -> None:
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    env = dict(os.environ, **NO_MULTICAST_ENV, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert OK_LINE in proc.stdout


# ============================================================== worker (torchrun)


def _workloads():
    from kareus.model.workload import ModelArch, Parallelism, Workload

    small = ModelArch(name="small", layers=2, hidden=512, heads=8, kv_heads=4, head_dim=64,
                      ffn=1024, vocab=1000)

    def wl(tp: int, cp: int) -> Workload:
        return Workload(model=small, parallelism=Parallelism(tp=tp, cp=cp), microbatch_size=4,
                        seq_len=256, nanobatches=2)

    real = Workload.preset("llama3.2-3b", tp=2, microbatch_size=2, seq_len=4096, nanobatches=2)
    # (workload, partitions): all-reduce over TP, all-gather / reduce-scatter over CP,
    # and one partition at a real model's shapes (25 MiB buffers).
    return [(wl(2, 1), ["fwd_attn", "fwd_mlp", "bwd_mlp", "bwd_attn"]),
            (wl(2, 2), ["fwd_attn_in_ag", "fwd_attn_out_ag", "bwd_attn_out_rs",
                        "bwd_attn_in_rs"]),
            (real, ["fwd_mlp"])]


class _Reference:
    """The collectives through NCCL on the default group, with the own kernels' order."""

    def __init__(self, torch, dist, world: int) -> None:
        self.torch, self.dist, self.world = torch, dist, world

    def gather(self, t):
        out = self.torch.empty(self.world * t.numel(), device=t.device, dtype=t.dtype)
        self.dist.all_gather_into_tensor(out, t.contiguous().view(-1))
        return out.view(self.world, -1)

    def _rank_order_sum(self, rows, dtype):
        acc = rows[0].float()
        for r in rows[1:]:
            acc = acc + r.float()
        return acc.to(dtype)

    def result(self, kind: str, inp):
        """What ``kind`` gives this rank for input ``inp`` (the all-reduce: a new tensor)."""
        rows = self.gather(inp)
        if kind == "all_gather":
            return rows.reshape(-1)
        if kind == "all_reduce":
            return self._rank_order_sum(list(rows.unbind(0)), inp.dtype).view(inp.shape)
        m = inp.numel() // self.world
        rank = self.dist.get_rank()
        blocks = [row[rank * m:(rank + 1) * m] for row in rows.unbind(0)]
        return self._rank_order_sum(blocks, inp.dtype)

    def apply(self, prog) -> None:
        """Runs the reference collective on a program's current communication tensors."""
        res = self.result(prog.comm_kind, prog.comm_tensor)
        target = prog.comm_tensor if prog.comm_kind == "all_reduce" else prog.comm_output
        target.view(-1).copy_(res.view(-1))


def _seed_inputs(torch, prog, seed: int) -> None:
    """All-gather / reduce-scatter inputs are not written by the ops: give them data."""
    if prog.comm_kind == "all_reduce":
        return
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(2):
        buf = prog.comm_tensor
        buf.copy_(torch.randn(buf.shape, generator=g, device=buf.device).to(buf.dtype))
        prog.advance()


def _buffers(prog) -> list:
    out = []
    for _ in range(2):  # both sides of the double buffer
        out += [prog.comm_tensor] + ([prog.comm_output] if prog.comm_output is not None else [])
        prog.advance()
    return out


def _same(torch, a, b, exact: bool) -> bool:
    if exact:
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a.float(), b.float(), rtol=1.6e-2, atol=3e-2))


def _run_case(torch, coll, ex, ref_coll, part, seed: int, tag: str) -> list[str]:
    from kareus.model.config import ScheduleConfig

    fails: list[str] = []
    exact = "attn_core_bwd" not in [op.name for op in part.compute_ops]
    prog = part.build(seed=seed, collective=coll)
    ref = part.build(seed=seed)
    _seed_inputs(torch, prog, seed + 1)
    _seed_inputs(torch, ref, seed + 1)
    if not all(coll.is_registered(b) for b in _buffers(prog)):
        fails.append(f"{tag}: a communication buffer of the program is not registered")
    if any(coll.is_registered(b) for b in _buffers(ref)):
        fails.append(f"{tag}: a program built without the backend has registered buffers")
    slots = [s.name for s in part.slots]
    for i, slot in enumerate([slots[0], slots[len(slots) // 2], None]):
        cfg = ScheduleConfig(1980, (4, 16, 8)[i], slot)
        for step in range(3):
            # The collective's input was written by the previous step; keep a copy.
            torch.cuda.synchronize()
            inp = prog.comm_tensor.clone()
            ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, cfg,
                             comm_kind=prog.comm_kind, comm_output=prog.comm_output)
            torch.cuda.synchronize()
            got = prog.comm_tensor if prog.comm_kind == "all_reduce" else prog.comm_output
            want = ref_coll.result(prog.comm_kind, inp)
            if not torch.equal(got.view(-1), want.view(-1)):
                bad = int((got.view(-1) != want.view(-1)).sum())
                fails.append(f"{tag} {cfg} step {step}: {prog.comm_kind} differs from the "
                             f"reference in {bad} of {want.numel()} elements")
            ref.run_plain()
            ref_coll.apply(ref)
            if not _same(torch, prog.output, ref.output, exact):
                fails.append(f"{tag} {cfg} step {step}: computed output differs from plain ops")
            prog.advance()
            ref.advance()
    # Back to back, no host synchronisation: the executor's stream order alone.
    cfg = ScheduleConfig(1980, 8, slots[-1])
    for _ in range(6):
        ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor, cfg,
                         comm_kind=prog.comm_kind, comm_output=prog.comm_output)
        prog.advance()
        ref.run_plain()
        ref_coll.apply(ref)
        ref.advance()
    torch.cuda.synchronize()
    for j, (a, b) in enumerate(zip(_buffers(prog), _buffers(ref))):
        if not _same(torch, a, b, exact):
            fails.append(f"{tag} back-to-back: buffer {j} differs from the plain-op reference")
    if prog.comm_kind == "all_reduce":
        reduced = prog.output  # the buffer the last step's collective reduced
        rows = ref_coll.gather(reduced)
        if not torch.equal(rows[0], rows[1]):
            fails.append(f"{tag} back-to-back: all-reduce results differ between ranks")
    return fails


def main() -> int:
    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST_ENV)  # never NVLink multicast, whatever the caller set
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"run with --nproc_per_node=2 (the partitions' groups are 2 GPUs), "
                         f"got {world}")

    from kareus.exec.collectives import OwnKernelCollective
    from kareus.exec.executor import TorchExecutor
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.config import ScheduleConfig
    from kareus.profilers.nvml import TorchPartitionRunner

    coll = OwnKernelCollective(spin_timeout_s=60.0)
    ex = TorchExecutor(collective=coll)
    ref_coll = _Reference(torch, dist, world)
    fails: list[str] = []
    cases = 0
    for w, names in _workloads():
        parts = runnable_partitions(w, names)
        for name in names:
            tag = f"{name} (tp={w.parallelism.tp} cp={w.parallelism.cp} {w.model.name})"
            fails += _run_case(torch, coll, ex, ref_coll, parts[name],
                               seed=100 * cases + rank, tag=tag)
            cases += 1
    # The profiler's runner hands the executor's backend to build().
    part = runnable_partitions(_workloads()[0][0], ["fwd_mlp"])["fwd_mlp"]
    runner = TorchPartitionRunner(ex, seed=7)
    step = runner.prepare(part, ScheduleConfig(1980, 8, "gate"))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    prog = runner.program(part)
    if not (coll.is_registered(prog.comm_tensor) and coll.is_registered(prog.output)):
        fails.append("TorchPartitionRunner built a program with unregistered buffers")

    counts: list = [None] * world
    dist.all_gather_object(counts, len(fails))
    for msg in fails[:20]:
        print(f"[rank {rank}] FAIL {msg}", flush=True)
    if rank == 0:
        if sum(counts) == 0:
            print(f"{OK_LINE} world={world} partitions={cases}", flush=True)
        else:
            print(f"REGISTERED EXECUTION FAILED failures per rank={counts}", flush=True)
    coll.close()
    dist.destroy_process_group()
    return 0 if sum(counts) == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
