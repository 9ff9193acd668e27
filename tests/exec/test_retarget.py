"""Moving a running loop along its iteration frontier (kareus.exec.retarget and
TrainingLoop.retarget), on the CPU: the point switched at the next iteration, each point's
graphs captured once (the recording stream backend counts captures), clocks requested
through the trigger (nothing changed), every rank the same point (two gloo processes).

Skipped without torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch")

from kareus.compose import IterationFrontier, IterationPoint, MicrobatchChoice, Plan
from kareus.errors import ArgumentError, InfeasibleError, PlanError
from kareus.exec.executor import RecordingStreamBackend
from kareus.exec.retarget import FrontierSwitch, Target
from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives
from kareus.model.config import ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.pipeline import get_schedule
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.testing import RecordingExecutor, RecordingTrigger

REPO = Path(__file__).resolve().parents[2]


#: torch's intra-op threads: one (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def workload() -> Workload:
    m = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64,
                  vocab=50)
    return Workload(model=m, parallelism=Parallelism(tp=2, cp=1), microbatch_size=2,
                    seq_len=8, num_microbatches=2, nanobatches=2, recompute=True)


def plan_at(wl: Workload, freq: int, *, sms: int, time_s: float, energy_j: float) -> Plan:
    cfgs = {}
    for name, p in build_partitions(wl).types.items():
        slots = [s.name for s in p.slots]
        cfgs[name] = ScheduleConfig(freq, sms, slots[min(1, len(slots) - 1)])
    comps = get_schedule("1f1b", 1, wl.num_microbatches).stage_orders[0]
    return Plan(gpu="h200-sxm", num_stages=1, num_microbatches=wl.num_microbatches,
                choices=[MicrobatchChoice(freq_mhz=freq, configs=cfgs)],
                assignment={c.key(): 0 for c in comps}, time_s=time_s, energy_j=energy_j,
                dynamic_energy_j=energy_j - 2.0 * time_s, static_power_w=2.0,
                workload=wl.to_dict())


def frontier(wl: Workload) -> IterationFrontier:
    """Three points: fast (1980 MHz), middle (1620), slow (1410)."""
    plans = [plan_at(wl, 1980, sms=8, time_s=1.0, energy_j=10.0),
             plan_at(wl, 1620, sms=6, time_s=1.3, energy_j=9.0),
             plan_at(wl, 1410, sms=4, time_s=1.6, energy_j=8.0)]
    return IterationFrontier(points=[IterationPoint(time_s=p.time_s, energy_j=p.energy_j,
                                                    plan=p) for p in plans], label="kareus")


def loop_for(wl: Workload, plan: Plan, *, graphs: bool, trig: RecordingTrigger,
             streams: RecordingStreamBackend) -> TrainingLoop:
    groups = LoopbackGroups(tp=2, cp=1)
    capped, default, _ = make_collectives(groups, backend="loopback")
    return TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan, frequency=trig,
                        streams=streams, kernels="torch", device="cpu", dtype="float32",
                        graphs=graphs)


def test_target_picks_the_point_and_refuses_what_it_cannot_do():
    fr = frontier(workload())
    assert Target(deadline_s=1.4).index(fr) == 1
    assert Target(deadline_s=5.0).index(fr) == 2
    assert Target(energy_budget_j=9.5).index(fr) == 1
    # a straggler 1.35x slower: nothing gained finishing before 1.35 s
    assert Target(stage_slowdown={0: 1.35}).index(fr) == 1
    assert Target(stage_slowdown=[1.0]).index(fr) == 0
    with pytest.raises(InfeasibleError, match="deadline"):
        Target(deadline_s=0.5).index(fr)
    with pytest.raises(ArgumentError, match="exactly one"):
        Target(deadline_s=1.0, energy_budget_j=3.0)
    with pytest.raises(ArgumentError, match="exactly one"):
        Target()
    with pytest.raises(ArgumentError, match=">= 1"):
        Target(stage_slowdown={0: 0.5})
    with pytest.raises(ArgumentError, match="stage"):
        Target(stage_slowdown={1: 1.2}).index(fr, stages=1)
    with pytest.raises(ArgumentError, match="per-stage frontiers"):
        Target(stage_slowdown={0: 1.2}).index(fr, stages=2)
    assert Target(stage_slowdown={0: 1.35, 1: 1.35}).index(fr, stages=2) == 1


def test_the_switch_builds_one_executor_per_point_and_broadcast_decides():
    wl = workload()
    fr = frontier(wl)
    start = RecordingExecutor(plan=fr.points[0].plan)
    made: list[str] = []

    def make(plan: Plan) -> RecordingExecutor:
        made.append(plan.digest)
        return RecordingExecutor(plan=plan)

    sw = FrontierSwitch(fr, current=start, make_executor=make, decide=lambda i: 2)
    plan = sw.choose(Target(deadline_s=1.0))  # this rank wants 0; "rank 0" said 2
    assert plan is fr.points[2].plan
    ex = sw.executor(plan)
    assert sw.executor(plan) is ex and sw.built == 1 and made == [plan.digest]
    assert sw.executor(fr.points[0].plan) is start and sw.built == 1
    assert [h[1] for h in sw.history] == [2]
    bad = FrontierSwitch(fr, current=start, make_executor=make, decide=lambda i: 7)
    with pytest.raises(PlanError, match="same frontier"):
        bad.choose(Target(deadline_s=1.0))


def test_retarget_switches_at_the_next_step_and_replays_graphs_on_return():
    wl = workload()
    fr = frontier(wl)
    trig, dev = RecordingTrigger(), RecordingStreamBackend()
    loop = loop_for(wl, fr.points[0].plan, graphs=True, trig=trig, streams=dev)
    n = len(loop.computations)

    def kareus_captures() -> int:
        return len([e for e in dev.log if e[0] == "capture" and
                    str(e[2]).startswith("train:kareus")])

    def step_freqs() -> set[int]:
        """The clocks one step requested (a capturing step requests during its eager run
        and its capture too)."""
        before = len(trig.requests)
        loop.step("kareus")
        return {r[0] for r in trig.requests[before:]}

    assert step_freqs() == {1980} and kareus_captures() == n
    with pytest.raises(ArgumentError, match="frontier"):
        loop.retarget(deadline_s=2.0)
    plan = loop.retarget(deadline_s=2.0, frontier=fr)
    assert plan is fr.points[2].plan and loop.plan is fr.points[0].plan  # not yet
    assert kareus_captures() == n  # built, not captured before its first step
    assert step_freqs() == {1410} and loop.plan is plan
    assert kareus_captures() == 2 * n
    loop.retarget(deadline_s=1.0)  # back to the first point: its graphs, no capture
    assert step_freqs() == {1980} and kareus_captures() == 2 * n
    loop.retarget(stage_slowdown={0: 1.35})  # a straggler: the middle point
    assert step_freqs() == {1620} and kareus_captures() == 3 * n
    loop.retarget(energy_budget_j=8.5)
    assert step_freqs() == {1410} and kareus_captures() == 3 * n
    # the frontier given again: the points built so far (and their graphs) are kept
    loop.retarget(deadline_s=1.0, frontier=IterationFrontier(points=list(fr.points)))
    assert step_freqs() == {1980} and kareus_captures() == 3 * n
    assert loop.frontier_switch.built == 2
    # the collectives of the switched point run with its SM count
    seq = loop.executor.sequence("train:kareus")
    assert seq is not None and seq.key[1] == loop.plan.digest == fr.points[0].plan.digest


def test_a_deadline_change_mid_run():
    """Eager steps: iterations before the change request the fast point's clock, those
    after it the slow one's; the loss keeps falling (the same model, other schedules)."""
    wl = workload()
    fr = frontier(wl)
    trig = RecordingTrigger()
    loop = loop_for(wl, fr.points[0].plan, graphs=False, trig=trig,
                    streams=RecordingStreamBackend())
    n = len(loop.computations)
    losses, per_step = [], []
    for k in range(6):
        if k == 3:  # a new deadline arrives mid-run
            loop.retarget(deadline_s=1.7, frontier=fr)
        before = len(trig.requests)
        losses.append(float(loop.step("kareus")))
        per_step.append({r[0] if isinstance(r, tuple) else r
                         for r in trig.requests[before:]})
    assert per_step == [{1980}] * 3 + [{1410}] * 3
    assert len(trig.requests) == 6 * n
    assert losses[-1] < losses[0]


def test_retarget_refuses_a_loop_without_plan_and_a_frontier_of_another_job():
    wl = workload()
    groups = LoopbackGroups(tp=2, cp=1)
    capped, default, _ = make_collectives(groups, backend="loopback")
    bare = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, streams=RecordingStreamBackend(),
                        kernels="torch", device="cpu", dtype="float32")
    with pytest.raises(PlanError, match="plan="):
        bare.retarget(deadline_s=1.0, frontier=frontier(wl))
    loop = loop_for(wl, frontier(wl).points[0].plan, graphs=False, trig=RecordingTrigger(),
                    streams=RecordingStreamBackend())
    other = wl.with_(seq_len=16)
    fr = frontier(wl)
    foreign = attrs.evolve(fr.points[2].plan, workload=other.to_dict())
    mixed = IterationFrontier(points=[fr.points[0], IterationPoint(
        time_s=1.6, energy_j=8.0, plan=foreign)])
    with pytest.raises(PlanError, match="another job"):
        loop.retarget(deadline_s=2.0, frontier=mixed)
    assert loop.plan.digest == fr.points[0].plan.digest
    loop.step("kareus")  # still the plan it ran


def _worker(out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    wl = workload()
    fr = frontier(wl)
    trig = RecordingTrigger()
    loop = loop_for(wl, fr.points[0].plan, graphs=False, trig=trig,
                    streams=RecordingStreamBackend())
    loop.step("kareus")
    # rank 1 asks for another point: rank 0 decides, both run its point
    plan = loop.retarget(deadline_s=2.0 if rank == 0 else 1.0, frontier=fr)
    before = len(trig.requests)
    loop.step("kareus")
    freqs = sorted({r[0] for r in trig.requests[before:]})
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"digest": plan.digest, "running": loop.plan.digest, "freqs": freqs}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_take_rank_zeros_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--standalone", str(Path(__file__).resolve()), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    slow = frontier(workload()).points[2].plan.digest
    assert [g["digest"] for g in got] == [slow, slow]
    assert [g["running"] for g in got] == [slow, slow]
    assert [g["freqs"] for g in got] == [[1410], [1410]]


if __name__ == "__main__":
    _worker(sys.argv[1])
