"""Runnable mixture-of-experts partitions over two gloo processes on the CPU: each rank
builds the all-to-all partition types with its own splits (the busiest rank's rows, an odd
count, so the two ranks' splits differ), runs them through the executor on the
process-group backend, and receives exactly what the other rank sent
(``torch.distributed.all_to_all_single`` of the same buffers as the reference)."""

from __future__ import annotations

import pytest


def _worker() -> None:
    import torch
    import torch.distributed as dist

    from kareus.exec.collectives import ProcessGroupCollective
    from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
    from kareus.exec.torch_partition import runnable_partitions
    from kareus.model.config import ScheduleConfig
    from kareus.model.moe import MoEArch
    from kareus.model.workload import ModelArch, Parallelism, Workload

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    m = ModelArch(name="tinymoe", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                  ffn=128, vocab=100, moe=MoEArch(experts=4, experts_per_token=2,
                                                  expert_ffn=32))
    # 128 tokens x top-2 x 257/256: 257 rows, split 129 + 128 one way, 128 + 129 the other
    wl = Workload(model=m, parallelism=Parallelism(ep=2, dp=2), microbatch_size=2,
                  seq_len=128, nanobatches=2, routing_imbalance=257 / 256)
    coll = ProcessGroupCollective()
    ex = TorchExecutor(collective=coll, streams=RecordingStreamBackend())
    runs = 0
    for name, part in runnable_partitions(wl, dtype="float32", kernels="torch").items():
        if part.comm_op.kind.value != "all_to_all":
            continue
        prog = part.build(device="cpu", seed=10 + rank, collective=coll)
        outs, ins = prog.comm_splits
        assert sum(outs) == sum(ins) == 257
        assert (outs, ins) == (([129, 128], [129, 128]) if rank == 0
                               else ([128, 129], [128, 129])), (rank, prog.comm_splits)
        received = 0.0
        for _ in range(2):
            ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor,
                             ScheduleConfig(1980, 8, part.slots[-1].name),
                             comm_kind="all_to_all", comm_output=prog.comm_output,
                             comm_group=prog.comm_group, comm_splits=prog.comm_splits)
            ref = torch.empty_like(prog.comm_output)
            dist.all_to_all_single(ref, prog.comm_tensor, list(outs), list(ins))
            assert torch.equal(ref, prog.comm_output), (name, rank)
            received += float(prog.comm_output.abs().sum())
            prog.advance()
        # the second step sends what the writer wrote in the first (build and step 1)
        assert received > 0 or prog.writer is None, name
        runs += 1
    assert runs == 4, runs
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok")


def test_moe_partitions_exchange_rows_between_two_gloo_ranks():
    pytest.importorskip("torch")
    from _helpers import run_gloo_ranks

    run_gloo_ranks(__file__)


if __name__ == "__main__":
    _worker()
