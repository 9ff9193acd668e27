"""The training loop with nanobatches along the sequence (``Workload.sequence_split``:
microbatch_size 1, nanobatches > 1, CP = 1): nanobatch ``j`` is tokens ``[j c, (j+1) c)``
of the one sequence, its attention reads the keys and values of chunks ``0..j`` and its
attention backward adds to their dK and dV. The loss and every gradient equal the float64
autograd reference of the whole model on whole sequences:

* one process (TP = 1): the sequential and nanobatching schedules, 2 and 4 nanobatches,
  every recomputation policy;
* two processes over gloo (TP = 2): sequential, nanobatching and a kareus plan, every
  recomputation policy, Llama's and Qwen3's layers.

Skipped without torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch")

from kareus.errors import ArgumentError, WorkloadError
from kareus.exec.executor import RecordingStreamBackend
from kareus.exec.train import GroupedCollective, LoopbackGroups, TrainingLoop
from kareus.model.workload import ModelArch, Parallelism, Workload
from tests.exec.test_train_loop import QWEN3_FEATURES, GlooCollective, plan_for, reference

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("full", "selective", "none")


#: torch's intra-op threads: one (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def workload(tp: int, n: int, recompute: str, features: str = "llama") -> Workload:
    m = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64,
                  vocab=50)
    if features == "qwen3":
        m = attrs.evolve(m, **QWEN3_FEATURES)
    return Workload(model=m, parallelism=Parallelism(tp=tp), microbatch_size=1, seq_len=16,
                    num_microbatches=2, nanobatches=n, recompute=recompute)


def _equal(g, ref, tol=1e-6):
    """Equal to rounding: relative norm of the difference (the loop runs in float64; the
    reference returns its float64 gradients as float32, and the loop sums the loss in
    float32)."""
    return float((g.double() - ref.double()).norm() / max(ref.double().norm(), 1e-30)) < tol


def _check(loss, grads, ref_loss, ref):
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0)
    for k, g in grads.items():
        assert _equal(g, ref[k]), k


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("recompute", POLICIES)
def test_one_process_along_the_sequence_matches_autograd(n, recompute):
    wl = workload(1, n, recompute)
    assert wl.sequence_split
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1),
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float64", lr=1e-3)
    m = loop.model
    params = {k: v.clone() for k, v in m.params.items()}
    ref_loss, (ref,) = reference([params], wl.model, loop.layers, loop.batches,
                                 wl.num_microbatches * wl.seq_len)
    for schedule in ("sequential", "nanobatching"):
        loop.reset()
        if schedule == "nanobatching" and recompute == "full":
            # no collective: one piece per chunk, recomputed forward and backward together,
            # which cannot run the recomputed forward in chunk order: refused
            with pytest.raises(ArgumentError, match="full recomputation along the sequence"):
                loop.step(schedule)
            continue
        loss = float(loop.step(schedule))
        _check(loss, m.grads, ref_loss, ref)
        assert not m._kv_chunks and not m._dkv_from_later  # nothing left behind


def test_the_backward_runs_the_chunks_last_first():
    wl = workload(1, 4, "full")
    loop = TrainingLoop(workload=wl, groups=LoopbackGroups(tp=1),
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float64")
    m = loop.model
    m.phase, m.n = "bwd", 4
    assert [m.chunk("attn_core_bwd", i) for i in range(4)] == [3, 2, 1, 0]
    assert [m.chunk("attn_in_grad", i) for i in range(4)] == [3, 2, 1, 0]
    # full recomputation's forward runs in the forward's order
    assert [m.chunk("attn_core", i) for i in range(4)] == [0, 1, 2, 3]
    m._set_policy("selective")  # its attention core re-run belongs to the backward
    assert [m.chunk("attn_core", i) for i in range(4)] == [3, 2, 1, 0]
    m.phase = "fwd"
    assert [m.chunk("attn_core", i) for i in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", POLICIES)
def test_each_chunk_runs_as_its_partition_type(policy):
    """Under a plan, a unit whose type is one per chunk (its attention) runs as its chunk's:
    the forward's chunks in order, the backward's last first, full recomputation's forward
    in order (``kareus.model.partition``'s pairs)."""
    from kareus.exec.train import make_collectives
    from tests.exec.test_train_loop import plan_for as plan

    wl = workload(2, 2, policy)
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan(wl),
                        streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                        dtype="float64")
    loop.model.zero_grad()
    ran = {}
    for c in loop.computations[:2]:  # microbatch 0's forward, then (1F1B, 1 stage) its backward
        loop._run_computation("kareus", c)
        ran[c.phase] = [k for k, _ in loop.partitions_run]
    # the forward: the first unit runs alone; layer 1's attention overlaps layer 0's MLP
    # all-reduce with chunk 0, chunk 1 overlaps chunk 0's; the last all-reduce runs beside
    # nothing, with the SM count of the first unit's type (chunk 0's)
    assert [k for k in ran["fwd"] if k.startswith("fwd_attn")] == [
        "fwd_attn_c1", "fwd_attn_c0", "fwd_attn_c1", "fwd_attn_c0"]
    assert [k for k in ran["bwd"] if k.startswith("bwd_attn")] == ["bwd_attn_c1",
                                                                   "bwd_attn_c0"] * 2
    if policy == "full":
        # (the backward's first unit, chunk 0 of the top layer's recomputed attention,
        # runs beside nothing)
        assert [k for k in ran["bwd"] if k.startswith("fwd_attn")] == [
            "fwd_attn_c1", "fwd_attn_c0", "fwd_attn_c1"]


@pytest.mark.parametrize("policy", POLICIES)
def test_the_forward_keeps_no_more_than_the_memory_model_counts(policy):
    """Each chunk's keys and values are written into the layer's buffer of the whole
    sequence, and chunk j's attention reads a view of its first (j + 1) c tokens: the keys
    and values are held once, not once more per later chunk (at most the memory model's
    count, which holds the QKV projection's output for the values)."""
    from kareus.exec.train import make_collectives
    from kareus.model.memory import kept_activation_bytes
    from tests.exec.test_train_loop import _kept_storage_bytes

    wl = workload(2, 2, policy)
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, streams=RecordingStreamBackend(),
                        kernels="torch", device="cpu", dtype="float32")
    fwd, bwd = (c for c in loop.computations if c.microbatch == 0)
    loop._run_computation("nanobatching", fwd)
    got = _kept_storage_bytes(loop.model.act)
    assert got <= kept_activation_bytes(wl.with_(dtype_bytes=4), layers=loop.layers)
    # only selective recomputation's backward reads the keys and values again
    assert bool(loop.model._kv_chunks) is (policy == "selective")
    loop._run_computation("nanobatching", bwd)
    assert not loop.model._kv_chunks


def test_what_the_loop_does_not_run_along_the_sequence_is_refused():
    from kareus.exec.train import make_collectives

    wl = workload(2, 2, "full")
    # a sequence the nanobatches do not divide, and CP > 1: the workload refuses them
    with pytest.raises(WorkloadError, match="does not split"):
        wl.with_(seq_len=15)
    with pytest.raises(WorkloadError, match="along the sequence"):
        wl.with_(parallelism=Parallelism(tp=2, cp=2))
    # sequence parallelism: the loop refuses it
    wl = wl.with_(parallelism=Parallelism(tp=2, sp=True))
    groups = LoopbackGroups(tp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    with pytest.raises(WorkloadError, match="without sequence parallelism"):
        TrainingLoop(workload=wl, groups=groups, collective=capped,
                     default_collective=default, streams=RecordingStreamBackend(),
                     kernels="torch", device="cpu", dtype="float64")


# ------------------------------------------------------------------ two ranks over gloo


def _worker(out_dir: str, features: str) -> None:
    import torch.distributed as dist

    from kareus.exec.train import TorchParallelGroups

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    groups = TorchParallelGroups(tp=2)
    result: dict = {"tp_rank": groups.tp_rank}
    for policy in POLICIES:
        wl = workload(2, 2, policy, features)
        coll = GroupedCollective(tp=GlooCollective(groups.tp_group), cp=None)
        loop = TrainingLoop(workload=wl, groups=groups, collective=coll, plan=plan_for(wl),
                            streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                            dtype="float64", lr=1e-3)
        result["params"] = {k: v.clone() for k, v in loop.model.params.items()}
        result["batches"] = loop.batches
        for s in loop.schedules:
            loop.reset()
            loss = float(loop.step(s))
            result[(policy, s)] = {"loss": loss, "grads": {k: v.clone() for k, v in
                                                          loop.model.grads.items()},
                                   "partitions": [k for k, _ in loop.partitions_run]}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("features", ["llama", "qwen3"])
def test_gloo_tp2_along_the_sequence_matches_the_whole_model(tmp_path, features):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", str(Path(__file__).resolve()), str(tmp_path), features]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    by = {r["tp_rank"]: r for r in res}
    shards = [by[t]["params"] for t in range(2)]
    wl = workload(2, 2, "full", features)
    ref_loss, ref = reference(shards, wl.model, wl.model.layers, res[0]["batches"],
                              wl.num_microbatches * wl.seq_len)
    for policy in POLICIES:
        for s in ("sequential", "nanobatching", "kareus"):
            for r in res:
                _check(r[(policy, s)]["loss"], r[(policy, s)]["grads"], ref_loss,
                       ref[r["tp_rank"]])
        # the kareus schedule ran each chunk's attention backward as its chunk's partition
        # type, the last chunk first (the last computation is a backward)
        kinds = res[0][(policy, "kareus")]["partitions"]
        assert [k for k in kinds if k.startswith("bwd_attn")] == ["bwd_attn_c1",
                                                                 "bwd_attn_c0"] * 2


if __name__ == "__main__":
    _worker(*sys.argv[1:])
