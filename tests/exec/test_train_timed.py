"""The time-faithful one-GPU stand-in for a group's collectives (kareus.exec.train._timed)
on the CPU: it computes what the plain loopback computes, records the time it would hold
its SMs for (the dry path: no wait), takes uncapped collectives at the model's SM count,
says it is a stand-in and where its times come from, and the loop runs with it (losses
equal to the plain loopback's). The kernel itself is tested on a GPU
(tests/exec/test_timed_stand_in_gpu.py).

Skipped without torch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_train_loop import plan_for, workload

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.exec.collectives import CommSMCountError
from kareus.exec.executor import RecordingStreamBackend
from kareus.exec.train import (
    LOOPBACK_MODES,
    STAND_IN_LABEL,
    FixedRateCollectiveTimes,
    LoopbackGroupCollective,
    LoopbackGroups,
    TimedLoopbackGroupCollective,
    TrainingLoop,
    make_collectives,
    named_collectives,
)

#: torch's intra-op threads: one (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


RATE = FixedRateCollectiveTimes(gb_per_s_per_sm=10.0, link_gb_per_s=200.0, latency_s=5e-6,
                                uncapped_sms=24)


def test_the_fixed_rate_model():
    # all-reduce over 4: 2 x 3/4 of the message on the bus; 8 SMs x 10 GB/s = 80 GB/s
    assert RATE.time_s("all_reduce", 8_000_000, 4, 8, backend="nccl") == pytest.approx(
        5e-6 + 12e6 / 80e9)
    # the link caps it: 40 SMs would move 400 GB/s, the link 200
    assert RATE.time_s("all_gather", 8_000_000, 2, 40, backend="nccl") == pytest.approx(
        5e-6 + 4e6 / 200e9)
    assert RATE.time_s("reduce_scatter", 1000, 2, None, backend="own") == pytest.approx(
        5e-6 + 500 / 200e9)  # uncapped: 24 SMs, 240 GB/s > the link
    assert "not measured" in RATE.source("all_reduce", 4, backend="nccl")
    with pytest.raises(ArgumentError):
        FixedRateCollectiveTimes(gb_per_s_per_sm=0)


@pytest.mark.parametrize("group", [2, 4])
def test_it_computes_what_the_plain_loopback_computes_and_records_its_time(group):
    plain = LoopbackGroupCollective(group_size=group)
    timed = TimedLoopbackGroupCollective(group_size=group, times=RATE)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g)
    a, b = x.clone(), x.clone()
    plain.all_reduce(a, None, 8)
    timed.all_reduce(b, None, 8)
    assert torch.equal(a, b)
    out_a, out_b = torch.empty(group * 24), torch.empty(group * 24)
    plain.all_gather(out_a, x, None, 4)
    timed.all_gather(out_b, x, None, 4)
    assert torch.equal(out_a, out_b)
    big = torch.randn(group * 24, generator=g)
    rs_a, rs_b = torch.empty(24), torch.empty(24)
    plain.reduce_scatter(rs_a, big, None, None)
    timed.reduce_scatter(rs_b, big, None, None)
    assert torch.equal(rs_a, rs_b)
    # the time each would have held its SMs for: the model's, at the call's SM count and
    # size (bytes per the CommOp convention), 24 SMs for the uncapped call
    assert [(k, n, s) for k, n, s, _ in timed.timed] == [
        ("all_reduce", 96, 8), ("all_gather", group * 96, 4), ("reduce_scatter", group * 96, 24)]
    for kind, nbytes, sms, secs in timed.timed:
        assert secs == pytest.approx(RATE.time_s(kind, nbytes, group, sms, backend="nccl"))
    assert timed.calls == plain.calls  # (kind, elements, sms) as the plain one records


def test_refusals():
    with pytest.raises(ArgumentTypeError, match="CollectiveTimes"):
        TimedLoopbackGroupCollective(group_size=2, times=object())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="backend"):
        TimedLoopbackGroupCollective(group_size=2, times=RATE, backend="mscclpp")
    timed = TimedLoopbackGroupCollective(group_size=2, times=RATE)
    with pytest.raises(CommSMCountError, match="comm_sms"):
        timed.all_reduce(torch.ones(4), None, 0)
    groups = LoopbackGroups(tp=2, cp=2)
    with pytest.raises(ArgumentError, match="times="):
        make_collectives(groups, backend="loopback", loopback="faithful")
    with pytest.raises(ArgumentError, match="loopback must be one of"):
        make_collectives(groups, backend="loopback", loopback="fast")
    assert LOOPBACK_MODES == ("plain", "faithful")


def test_the_note_says_stand_in_and_where_the_times_come_from():
    groups = LoopbackGroups(tp=2, cp=2)
    capped, default, note = make_collectives(groups, backend="loopback", loopback="faithful",
                                             times=RATE)
    assert capped is not None and default is not None
    assert isinstance(capped.tp, TimedLoopbackGroupCollective)
    assert isinstance(capped.cp, TimedLoopbackGroupCollective)
    assert note.startswith(STAND_IN_LABEL) and "not measured" in note
    assert "group of 2" in note
    named = named_collectives(groups, {"own"}, loopback="faithful", times=RATE)
    assert named["own"].tp.backend == "own"  # the own kernels' times for an "own" plan
    _, _, plain = make_collectives(groups, backend="loopback")
    assert STAND_IN_LABEL not in plain


def test_the_loop_runs_with_it_and_trains_as_with_the_plain_loopback():
    wl = workload(2, 2)
    losses = {}
    for mode in LOOPBACK_MODES:
        groups = LoopbackGroups(tp=2, cp=2)
        capped, default, _ = make_collectives(groups, backend="loopback", loopback=mode,
                                              times=RATE if mode == "faithful" else None)
        loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                            default_collective=default, plan=plan_for(wl),
                            streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                            dtype="float32", lr=1e-2)
        losses[mode] = [float(loop.step(s)) for s in ("sequential", "nanobatching", "kareus")]
        if mode == "faithful":
            assert capped.tp.timed and capped.cp.timed
            # the plan's collectives at its SM count, the baselines' at the model's uncapped 24
            assert {s for _, _, s, _ in capped.tp.timed} >= {8, 24}
    assert losses["faithful"] == pytest.approx(losses["plain"], rel=1e-6)


def test_the_work_outside_partitions_runs_through_the_stand_in_too():
    groups = LoopbackGroups(tp=2, cp=2)
    capped, _, note = make_collectives(groups, backend="loopback", loopback="faithful",
                                       times=RATE)
    assert "outside partitions" in note
    plain = LoopbackGroups(tp=2, cp=2)
    x = torch.arange(8.0)
    a, b = x.clone(), x.clone()
    groups.all_reduce(a, group="tp")
    plain.all_reduce(b, group="tp")
    assert torch.equal(a, b)
    groups.all_reduce(a, group="tp", op="max")  # unchanged, and no collective timed
    assert torch.equal(a, b)
    out_a, out_b = torch.empty(16), torch.empty(16)
    groups.all_gather(out_a, x, group="cp")
    plain.all_gather(out_b, x, group="cp")
    assert torch.equal(out_a, out_b)
    rs_a, rs_b = torch.empty(4), torch.empty(4)
    groups.reduce_scatter(rs_a, x, group="cp")
    plain.reduce_scatter(rs_b, x, group="cp")
    assert torch.equal(rs_a, rs_b)
    # each held the uncapped SM count (24 in RATE) for its time
    assert [(k, s) for k, _, s, _ in capped.tp.timed] == [("all_reduce", 24)]
    assert [(k, s) for k, _, s, _ in capped.cp.timed] == [("all_gather", 24),
                                                         ("reduce_scatter", 24)]


_AGREE_SCRIPT = """
import json, sys, time
import torch
import torch.distributed as dist
from kareus.exec.executor import RecordingStreamBackend
from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives, measure_runs
from kareus.model.workload import ModelArch, Parallelism, Workload

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
arch = ModelArch(name="tiny", layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64,
                 vocab=50)
wl = Workload(model=arch, parallelism=Parallelism(tp=2), microbatch_size=2, seq_len=8,
              num_microbatches=1, nanobatches=1)
groups = LoopbackGroups(tp=2)
capped, default, _ = make_collectives(groups, backend="loopback")
loop = TrainingLoop(workload=wl, groups=groups, collective=capped, default_collective=default,
                    streams=RecordingStreamBackend(), kernels="torch", device="cpu",
                    dtype="float32")
step = loop.step
def slow(schedule):  # rank 1 is five times slower per iteration
    out = step(schedule)
    time.sleep(0.02 if rank == 1 else 0.004)
    return out
loop.step = slow
(rec,) = measure_runs(loop, [("sequential", 0)], steps=2, warmup=0, min_window_s=0.3)
json.dump({"iterations": len(rec.step_time_s), "window_s": rec.window_s},
          open(sys.argv[1] + f"/rank{rank}.json", "w"))
dist.destroy_process_group()
"""


def test_ranks_of_different_pace_run_the_same_iterations(tmp_path):
    # each rank lengthens its window by its own pace; the iterations added are agreed
    # (the largest) over the default process group, or the ranks' collectives would not
    # pair up
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "agree.py"
    script.write_text(_AGREE_SCRIPT)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(script), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert a["iterations"] == b["iterations"] > 2
    assert min(a["window_s"], b["window_s"]) >= 0.3
