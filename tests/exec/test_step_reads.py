"""What a captured step may read: only what outlives it.

A partition program's step is captured into CUDA graphs (two per configuration, one per
parity of its double buffers) and replayed many times. A graph reads and writes the
addresses it was captured with, so a step must read only tensors that live as long as the
program (its build-time inputs, weights and buffers) or that the same step made. A tensor
made by the previous step is replaced, and freed, when the next graph is captured, and a
replay then reads freed memory: the illegal memory access of the one-GPU tuning run on
1x H200, where the outside work's embedding backward read the final norm's gradient of the
step before. These tests run each program's steps on the CPU under a dispatch mode that
records every storage an op reads, and fail on a read of what an earlier step made.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import attrs
from torch.utils._python_dispatch import TorchDispatchMode

from kareus.exec.outside_work import RunnableOutsideWork
from kareus.exec.torch_partition import RunnableTransformerPartition
from kareus.model import ModelArch, Parallelism, Workload, build_partitions
from kareus.testing import RecordingExecutor

TINY = ModelArch(name="tiny", layers=2, hidden=64, heads=8, kv_heads=4, head_dim=8, ffn=128,
                 vocab=512)


def _workload(cp: int, sp: bool = False) -> Workload:
    return attrs.evolve(Workload.preset("qwen3-1.7b"), model=TINY,
                        parallelism=Parallelism(tp=4, pp=1, cp=cp, dp=1, sp=sp),
                        microbatch_size=2,
                        seq_len=64, num_microbatches=4, nanobatches=2)


def _storage(t):
    return t.untyped_storage().data_ptr()


class _Reads(TorchDispatchMode):
    """Storages each op reads that this step did not make, and what it made (fresh
    outputs: an in-place op's output is the tensor it was given)."""

    def __init__(self):
        super().__init__()
        self.made, self.inputs = set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read = {_storage(a) for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                if isinstance(a, torch.Tensor)}
        self.inputs += [(str(func), p) for p in read if p not in self.made]
        self.made |= {_storage(o) for o in torch.utils._pytree.tree_leaves(out)
                      if isinstance(o, torch.Tensor)} - read
        return out


def _stale_reads(prog, steps: int = 3):
    """Reads, in the last of ``steps`` steps, of what the step before it made (the steps
    alternate parities as the runner's do)."""
    seen = []
    with torch.no_grad():
        for _ in range(steps):
            with _Reads() as r:
                prog.run_plain()
            prog.advance()
            seen.append(r)
    assert seen[-1].inputs  # the step read its build-time inputs
    return [(f, p) for f, p in seen[-1].inputs if p in seen[-2].made]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("phase", ["fwd", "bwd", "iteration"])
def test_outside_work_reads_nothing_an_earlier_step_made(phase, sp):
    # sp: the embedding reduce-scattered, the final norm on the sequence shard and its
    # output all-gathered (TP collectives of the kinds CP runs, named for their group)
    wl = _workload(1, sp)
    pset = build_partitions(wl)
    work = pset.iteration if phase == "iteration" else pset.outside[(0, phase)]
    prog = RunnableOutsideWork(work, wl, dtype="float32").build(
        device="cpu", collective=RecordingExecutor())
    assert not _stale_reads(prog), f"a step of the {phase} outside work reads what the step " \
        "before made"


@pytest.mark.parametrize(("cp", "sp"), [(1, False), (2, False), (1, True), (2, True)])
def test_partitions_read_nothing_an_earlier_step_made(cp, sp):
    wl = _workload(cp, sp)
    for name, part in build_partitions(wl).types.items():
        prog = RunnableTransformerPartition(part, wl, dtype="float32").build(
            device="cpu", collective=RecordingExecutor())
        assert not _stale_reads(prog), f"a step of {name} reads what the step before made"
