"""Runnable mixture-of-experts partitions on the CPU: every partition type of MoE workloads
(EP alone, with CP and shared experts and routing imbalance, with TP under sequence
parallelism, one expert per rank) builds at the partition model's shapes and runs through
the executor, its all-to-all given the program's splits; the writer op fills the send
buffer; the shapes are the ones the partition model costs (FLOPs of every GEMM); the
splits agree between every pair of ranks. Skipped without torch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
from kareus.exec.torch_partition import runnable_partitions
from kareus.model.config import ScheduleConfig
from kareus.model.moe import MoEArch
from kareus.model.ops import OpKind
from kareus.model.partition import build_partitions
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.testing import RecordingCollective


def moe_model(shared: bool = False, experts: int = 8, qwen3: bool = False) -> ModelArch:
    return ModelArch(name="tinymoe", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64,
                     ffn=512, vocab=1000, qk_norm=qwen3, norm_eps=1e-6 if qwen3 else 1e-5,
                     moe=MoEArch(experts=experts, experts_per_token=2, expert_ffn=128,
                                 shared_experts=1 if shared else 0,
                                 shared_expert_ffn=64 if shared else 0))


WORKLOADS = {
    "ep2": (moe_model(), Parallelism(ep=2, dp=2), 1.0),
    "ep4_cp2_shared_imbalanced": (moe_model(shared=True), Parallelism(ep=4, dp=4, cp=2), 1.5),
    "tp2_sp_ep2_qk_norm": (moe_model(qwen3=True), Parallelism(tp=2, ep=2, sp=True), 1.0),
    "ep8_one_expert_per_rank": (moe_model(), Parallelism(ep=8, dp=8), 1.25),
}


def workload(key: str) -> Workload:
    m, p, imbalance = WORKLOADS[key]
    return Workload(model=m, parallelism=p, microbatch_size=2, seq_len=128, nanobatches=2,
                    routing_imbalance=imbalance)


class HostAllToAll(RecordingCollective):
    """Collectives on the host for a group of identical ranks; the all-to-all writes the
    received rows from the sent ones, repeated (the loopback stand-in's data) and records
    its splits."""

    def __init__(self, world: int) -> None:
        super().__init__(world_size=world)
        self.a2a: list[tuple[list[int], list[int]]] = []

    def all_reduce(self, tensor, stream, sms):
        return tensor.mul_(self.world_size)

    def all_gather(self, output, input, stream, sms):
        output.view(self.world_size, -1).copy_(input.view(1, -1).expand(self.world_size, -1))
        return output

    def reduce_scatter(self, output, input, stream, sms):
        output.view(-1).copy_(input.view(self.world_size, -1).sum(0))
        return output

    def all_to_all(self, output, input, output_splits, input_splits, stream, sms):
        from kareus.exec.collectives._loopback import cycle_rows

        assert sum(output_splits) == output.shape[0] and sum(input_splits) == input.shape[0]
        self.a2a.append((list(output_splits), list(input_splits)))
        return cycle_rows(torch, output, input)


MOE_OPS = {"router", "router_topk", "permute", "expert_sort", "expert_gate_up",
           "expert_swiglu", "expert_down", "expert_unsort", "unpermute", "unpermute_bwd",
           "permute_bwd", "router_topk_bwd", "router_dgrad", "router_wgrad"}


@pytest.mark.parametrize("key", list(WORKLOADS))
def test_every_moe_partition_builds_and_runs_with_its_all_to_all(key):
    wl = workload(key)
    parts = runnable_partitions(wl, dtype="float32", kernels="torch")
    seen = set()
    a2a_types = 0
    for part in parts.values():
        seen |= {op.name for op in part.compute_ops}
        coll = HostAllToAll(part.comm_op.group_size)
        prog = part.build(device="cpu", seed=1)
        ex = TorchExecutor(collective=coll, streams=RecordingStreamBackend())
        slot = part.slots[len(part.slots) // 2].name
        for _ in range(2):
            ex.run_partition(prog.ops, prog.op_names, prog.comm_tensor,
                             ScheduleConfig(1980, 8, slot), comm_kind=prog.comm_kind,
                             comm_output=prog.comm_output,
                             comm_group=getattr(prog, "comm_group", None),
                             comm_splits=prog.comm_splits)
            prog.advance()
        if prog.comm_kind != "all_to_all":
            assert prog.comm_splits is None
            continue
        a2a_types += 1
        ep = wl.parallelism.ep
        rows = part.dims.moe.rows
        assert prog.comm_group == "ep"
        assert prog.comm_tensor.shape == prog.comm_output.shape == (rows, wl.model.hidden)
        assert coll.a2a == [tuple(map(list, prog.comm_splits))] * 2
        assert len(prog.comm_splits[0]) == ep == len(prog.comm_splits[1])
        if prog.writer is not None:  # the writer filled (a prefix of) both send buffers
            assert prog.comm_tensor.abs().sum() > 0 and prog.output.abs().sum() > 0
            assert torch.isfinite(prog.comm_output).all()
    assert a2a_types >= 4
    sorts = {"expert_sort", "expert_unsort"}  # one expert per rank: nothing to sort
    assert MOE_OPS - (set() if wl.model.moe.experts > wl.parallelism.ep else sorts) <= seen
    if wl.model.moe.shared_experts:
        assert {"shared_gate", "shared_down", "shared_up_dgrad", "shared_up_wgrad"} <= seen


def test_the_writers_are_the_ops_that_make_the_sent_tensor():
    writers = {}
    for key in ("ep2", "ep8_one_expert_per_rank"):
        for name, part in runnable_partitions(workload(key), dtype="float32").items():
            if part.comm_op.kind.value == "all_to_all":
                writers[(key, name)] = part.build(device="cpu").writer
    assert writers[("ep2", "fwd_attn_moe_route")] == "permute"
    assert writers[("ep2", "fwd_moe_experts")] == "expert_unsort"
    assert writers[("ep2", "bwd_attn_moe_unpermute")] == "unpermute_bwd"
    assert writers[("ep2", "bwd_moe_experts")] == "expert_sort_bwd"
    # one expert per rank: no sort; the combine sends expert_down's output, the dispatch
    # gradient expert_gate_up_dgrad's (not the weight gradient the op order ends with)
    assert writers[("ep8_one_expert_per_rank", "fwd_moe_experts")] == "expert_down"
    assert writers[("ep8_one_expert_per_rank", "bwd_moe_experts")] == "expert_gate_up_dgrad"


def _gemm_flops(name, md, h):
    """FLOPs of each MoE GEMM at the runnable partition's shapes."""
    r, tm, E, fe, fs = md.rows, md.tm, md.experts, md.fe, md.fs
    return {"router": 2 * tm * h * E, "router_dgrad": 2 * tm * E * h,
            "router_wgrad": 2 * h * tm * E,
            "expert_gate_up": 2 * r * h * 2 * fe, "expert_down": 2 * r * fe * h,
            "expert_down_dgrad": 2 * r * h * fe, "expert_down_wgrad": 2 * r * fe * h,
            "expert_gate_up_dgrad": 2 * r * 2 * fe * h,
            "expert_gate_up_wgrad": 2 * h * r * 2 * fe,
            **{n: 2 * tm * h * fs for n in ("shared_gate", "shared_up", "shared_down",
                                            "shared_down_dgrad", "shared_down_wgrad",
                                            "shared_gate_dgrad", "shared_up_dgrad",
                                            "shared_gate_wgrad", "shared_up_wgrad")}}.get(name)


@pytest.mark.parametrize("key", list(WORKLOADS))
def test_runnable_shapes_are_the_costed_shapes(key):
    wl = workload(key)
    parts = runnable_partitions(wl)
    checked = 0
    for part in parts.values():
        md = part.dims.moe
        for op in part.compute_ops:
            want = _gemm_flops(op.name, md, wl.model.hidden)
            if want is None or op.kind is not OpKind.GEMM:
                continue
            assert op.flops == pytest.approx(want, rel=1e-12), (part.name, op.name)
            checked += 1
        if part.comm_op.kind.value == "all_to_all":  # the bytes the emulator moves
            assert part.comm_op.bytes == pytest.approx(md.rows * wl.model.hidden
                                                       * wl.dtype_bytes, rel=1e-12)
            assert sum(md.local_counts) == md.rows == sum(map(sum, md.recv_counts))
            assert len(md.local_counts) == wl.model.moe.experts // wl.parallelism.ep
    assert checked > 0
    assert len(build_partitions(wl)) == len(parts)


@pytest.mark.parametrize(("rows", "ep"), [(256, 8), (250, 8), (7, 4), (3, 2)])
def test_splits_agree_between_every_pair_of_ranks(rows, ep):
    from kareus.exec._transformer_ops import _MoEDims

    md = _MoEDims(tm=1, k=1, experts=ep, ep=ep, fe=1, fs=0, router_dtype="float32",
                  rows=rows, local_counts=(rows,), recv_counts=((rows,),))
    splits = [md.splits(r) for r in range(ep)]
    for r in range(ep):
        outs, ins = splits[r]
        assert sum(outs) == sum(ins) == rows
        for q in range(ep):  # what r sends q is what q expects from r
            assert ins[q] == splits[q][0][r]


def test_a_rank_of_the_expert_group_takes_its_splits():
    wl = workload("ep2")
    part = runnable_partitions(wl, ["fwd_moe_experts"], dtype="float32")["fwd_moe_experts"]

    class Rank1(HostAllToAll):
        rank = 1  # type: ignore[assignment]

    assert part.build(device="cpu", collective=Rank1(2)).comm_splits == ([128, 128],
                                                                         [128, 128])


def test_the_profilers_runner_runs_an_all_to_all_partition():
    from kareus.exec.torch_partition import RunnableTransformerPartition
    from kareus.profilers.nvml import TorchPartitionRunner

    class CPUPartition(RunnableTransformerPartition):
        def build(self, *, device=None, seed=0, collective=None):
            return super().build(device="cpu", seed=seed, collective=collective)

    wl = workload("ep4_cp2_shared_imbalanced")
    base = runnable_partitions(wl, ["fwd_moe_experts"], dtype="float32")["fwd_moe_experts"]
    part = CPUPartition(base.partition, wl, dtype="float32")
    class Allocating(HostAllToAll):  # the executor asks its backend for the buffers
        def empty(self, shape, dtype):
            return torch.zeros(shape, dtype=dtype)

    coll = Allocating(4)
    runner = TorchPartitionRunner(TorchExecutor(collective=coll,
                                                streams=RecordingStreamBackend()), seed=2)
    step = runner.prepare(part, ScheduleConfig(1980, 8, "expert_gate_up"))
    for _ in range(3):
        step()
    assert len(coll.a2a) >= 3 and set(map(repr, coll.a2a)) == {repr(([48] * 4, [48] * 4))}
