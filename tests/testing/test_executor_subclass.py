"""A user's own Executor: a small subclass that implements only the role's hooks passes the
conformance suite, applies a plan through the role's scopes, and trains the library's decoder
(kareus.exec.train) with the same losses as TorchExecutor."""

from __future__ import annotations

from typing import Any

import pytest

from kareus.errors import PlanError, UnknownSlotError
from kareus.exec import CollectiveBackend, CollectiveLaunch, Executor
from kareus.model.config import ScheduleConfig
from kareus.testing import RecordingCollective, check_executor, make_test_plan

OPS = ("attn_norm", "qkv", "rope", "attn_core", "out_proj")


# -- the subclass: what a user writes -------------------------------------------------------


class SyncExecutor(Executor):
    """Runs each collective right away, where the role launches it, through one backend
    (no side stream, so nothing to join), and keeps the clocks it is asked for."""

    def __init__(self, *, backend: CollectiveBackend, plan: Any = None,
                 digest_exchange: Any = None) -> None:
        super().__init__(plan=plan, digest_exchange=digest_exchange)
        self.backend = backend
        self.clocks: list[int] = []
        self.launched: list[tuple[str, str, int | None, str | None]] = []

    def launch_collective(self, launch: CollectiveLaunch) -> None:
        self.launched.append((launch.partition, launch.kind, launch.sms, launch.slot))
        if launch.kind == "all_reduce":
            self.backend.all_reduce(launch.tensor, None, launch.sms)
        else:
            getattr(self.backend, launch.kind)(launch.output, launch.tensor, None, launch.sms)

    def join_collective(self, handle: Any) -> None:
        pass  # the collective ran to completion in launch_collective

    def request_clock(self, freq_mhz: int) -> None:
        self.clocks.append(freq_mhz)


# -- the role's rules come with the template ------------------------------------------------


def test_a_subclass_of_the_hooks_alone_passes_the_conformance_suite():
    check_executor(lambda plan: SyncExecutor(backend=RecordingCollective(), plan=plan))


def test_the_subclass_drives_a_plan():
    plan = make_test_plan(freqs_mhz=(1980, 1410), slots=("rope", None), sms=(16, 4))
    backend = RecordingCollective()
    ex = SyncExecutor(backend=backend, plan=plan)
    with pytest.raises(PlanError, match="start"), ex.partition("fwd_attn"):
        pass
    ran: list[str] = []
    with ex:  # start(): the ranks agree on the plan
        for mb in (0, 1):
            with ex.microbatch(0, mb, "fwd"), ex.partition("fwd_attn", op_names=OPS) as part:
                part.communicate(f"x{mb}")
                for op in OPS:
                    part.op(op, ran.append, f"{op}{mb}")
    assert ex.clocks == [1980, 1410]
    assert ex.launched == [("fwd_attn", "all_reduce", 16, "rope"),
                           ("fwd_attn", "all_reduce", 4, None)]
    assert backend.calls == [("all_reduce", "x0", 16), ("all_reduce", "x1", 4)]
    assert ran == [f"{op}{mb}" for mb in (0, 1) for op in OPS]
    with pytest.raises(UnknownSlotError):
        ex.run_partition([ran.append] * len(OPS), OPS, "b", ScheduleConfig(1980, 8, "nope"))
    with pytest.raises(ValueError, match="n >= 2"):
        ex.run_nanobatched([ran.append] * len(OPS), OPS, ["y0"], ScheduleConfig(1980, 8, None))


def test_the_subclass_has_no_graphs_and_allocates_with_torch():
    torch = pytest.importorskip("torch")
    ex = SyncExecutor(backend=RecordingCollective())
    assert ex.graphs is False and ex.sequence("any") is None
    buf = ex.empty((3, 2), torch.float32, kind="all_gather")
    assert tuple(buf.shape) == (3, 2) and not bool(buf.any())


# -- the library's training loop and partition runner take it -------------------------------


def test_the_training_loop_runs_on_the_subclass_with_torch_executors_losses():
    torch = pytest.importorskip("torch")
    from kareus.compose import MicrobatchChoice, Plan
    from kareus.exec.executor import RecordingStreamBackend
    from kareus.exec.train import LoopbackGroups, TrainingLoop, make_collectives
    from kareus.model.partition import build_partitions
    from kareus.model.pipeline import get_schedule
    from kareus.model.workload import ModelArch, Parallelism, Workload

    arch = ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8,
                     ffn=64, vocab=50)
    wl = Workload(model=arch, parallelism=Parallelism(tp=2, cp=2), microbatch_size=4,
                  seq_len=8, num_microbatches=2, nanobatches=2)
    cfgs = {name: ScheduleConfig(1710, 8 + i, [s.name for s in p.slots][1])
            for i, (name, p) in enumerate(sorted(build_partitions(wl).types.items()))}
    comps = get_schedule("1f1b", 1, wl.num_microbatches).stage_orders[0]
    plan = Plan(gpu="h200-sxm", num_stages=1, num_microbatches=wl.num_microbatches,
                choices=[MicrobatchChoice(freq_mhz=1710, configs=cfgs)],
                assignment={c.key(): 0 for c in comps}, time_s=1.0, energy_j=1.0,
                dynamic_energy_j=0.5, static_power_w=100.0, workload=wl.to_dict())
    groups = LoopbackGroups(tp=2, cp=2)
    capped, default, _ = make_collectives(groups, backend="loopback")
    common: dict[str, Any] = dict(workload=wl, groups=groups, kernels="torch", device="cpu",
                                  dtype="float32", lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mine = TrainingLoop(executor=SyncExecutor(backend=capped, plan=plan),
                            baseline=SyncExecutor(backend=default), **common)
        ref = TrainingLoop(collective=capped, default_collective=default, plan=plan,
                           streams=RecordingStreamBackend(), **common)
        assert not mine.graphs and mine.plan is plan
        for schedule in mine.schedules:
            mine.reset()
            ref.reset()
            got = [float(mine.step(schedule)) for _ in range(2)]
            want = [float(ref.step(schedule)) for _ in range(2)]
            assert got == pytest.approx(want, rel=1e-6), schedule
    finally:
        torch.set_num_threads(threads)
    ex = mine.executor
    assert isinstance(ex, SyncExecutor)
    assert ex.clocks and set(ex.clocks) == {1710}
    assert {sms for _, _, sms, _ in ex.launched} == {c.comm_sms for c in cfgs.values()}
    assert all(b.device.type == "cpu" for b in mine.model.pool_buffers())


def test_the_training_loop_refuses_what_it_cannot_run():
    pytest.importorskip("torch")
    from kareus.exec.train import LoopbackGroups, TrainingLoop
    from kareus.model.workload import ModelArch, Parallelism, Workload

    arch = ModelArch(name="tiny", layers=1, hidden=32, heads=4, kv_heads=2, head_dim=8,
                     ffn=64, vocab=50)
    wl = Workload(model=arch, parallelism=Parallelism(tp=2), microbatch_size=2, seq_len=8,
                  num_microbatches=1, nanobatches=2)
    kw: dict[str, Any] = dict(workload=wl, groups=LoopbackGroups(tp=2), kernels="torch",
                              device="cpu", dtype="float32")
    with pytest.raises(TypeError, match="Executor"):
        TrainingLoop(baseline=object(), **kw)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="no plan"):
        TrainingLoop(executor=SyncExecutor(backend=RecordingCollective()), **kw)
    with pytest.raises(ValueError, match="collective"):
        TrainingLoop(**kw)


def test_the_partition_runner_runs_on_the_subclass():
    pytest.importorskip("torch")
    from kareus.exec.torch_partition import CallablePartition
    from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
    from kareus.profilers.nvml import TorchPartitionRunner

    ran: list[str] = []
    part = CallablePartition(
        name="p", compute_ops=[ComputeOp(name=n, kind=OpKind.GEMM, flops=1e9, bytes_moved=1e6)
                               for n in ("a", "b")],
        comm_op=CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=1e6, group_size=2),
        callables=[lambda: ran.append("a"), lambda: ran.append("b")],
        comm_buffers=("t0", "t1"))
    backend = RecordingCollective()
    runner = TorchPartitionRunner(SyncExecutor(backend=backend))
    assert runner.graphs is False
    step = runner.prepare(part, ScheduleConfig(1980, 12, "b"))
    step()
    step()
    assert ran == ["a", "b", "a", "b"]
    assert [(kind, sms) for kind, _, sms in backend.calls] == [("all_reduce", 12)] * 2
    runner.release()


def test_the_outside_works_collectives_run_on_the_subclass():
    torch = pytest.importorskip("torch")
    from kareus.exec.outside_work import _comm_op
    from kareus.model.ops import CommKind, CommOp

    backend = RecordingCollective()
    ex = SyncExecutor(backend=backend)
    comm = CommOp(name="dp_grad", kind=CommKind.REDUCE_SCATTER, bytes=64, group_size=2)
    _comm_op(torch, comm, ex, 6, 2, torch.device("cpu"), torch.float32)()
    assert ex.launched == [("dp_grad", "reduce_scatter", 6, None)]
    (kind, tensor, sms), = backend.calls
    assert (kind, sms, tuple(tensor.shape)) == ("reduce_scatter", 6, (32,))


def test_a_subclass_without_an_init_of_its_own_still_has_the_templates_state():
    class Bare(Executor):  # the hooks alone: no __init__
        def launch_collective(self, launch):
            return None

        def join_collective(self, handle):
            pass

        def request_clock(self, freq_mhz):
            pass

    def make(plan):
        ex = Bare()
        ex.plan = plan
        return ex

    check_executor(make)
