"""The executor (kareus.exec.executor): ordering logic on a recording fake device (no
torch needed), plans, the role's conformance suite on TorchExecutor and on the recording
fake of kareus.testing."""

from __future__ import annotations

import attrs
import pytest

from kareus.errors import ConfigError, PlanError, UnknownSlotError
from kareus.exec.executor import (
    RecordingStreamBackend,
    TorchExecutor,
    computation_key,
    plan_config,
    plan_frequency,
)
from kareus.model.config import ScheduleConfig
from kareus.testing import (
    ExecutorConformance,
    RecordingCollective,
    RecordingExecutor,
    RecordingTrigger,
    make_test_plan,
)

OPS = ("attn_norm", "qkv", "rope", "attn_core", "out_proj")


def make(plan=None, **kw):
    dev = RecordingStreamBackend()
    coll = RecordingCollective(streams=dev)
    ex = TorchExecutor(collective=coll, streams=dev, plan=plan, **kw)
    return ex, dev, coll


@pytest.mark.parametrize("slot_index", range(len(OPS)))
def test_comm_waits_on_event_after_previous_op_and_before_slot_op(slot_index):
    ex, dev, coll = make()
    slot = OPS[slot_index]
    ex.run_partition([dev.op(n) for n in OPS], OPS, "buf", ScheduleConfig(1980, 8, slot))
    assert dev.launches("compute") == list(OPS)
    assert dev.launches("comm") == ["all_reduce(buf)"]
    assert coll.calls == [("all_reduce", "buf", 8)]
    # Log order: record on compute after op k-1, comm waits on that event, comm enqueued,
    # then op k on the compute stream.
    log = dev.log
    rec = next(i for i, e in enumerate(log) if e[0] == "record" and e[1] == "compute")
    ev = log[rec][2]
    assert dev.events[ev].after == slot_index  # exactly the ops before the slot precede it
    wait = log.index(("wait", "comm", ev))
    comm = log.index(("launch", "comm", "all_reduce(buf)"))
    op_k = log.index(("launch", "compute", slot))
    assert rec < wait < comm < op_k
    # Device order: the previous op happens before the collective; the collective does
    # not wait for the slot's op.
    if slot_index > 0:
        assert dev.happens_before(("compute", OPS[slot_index - 1]), ("comm", "all_reduce(buf)"))
    assert not dev.happens_before(("compute", slot), ("comm", "all_reduce(buf)"))
    # The compute stream joins the collective at the end of the partition.
    done = [e for e in log if e[0] == "record" and e[1] == "comm"]
    assert done and log[-1] == ("wait", "compute", done[-1][2])


def test_sequential_runs_comm_after_all_ops():
    ex, dev, _ = make()
    ex.run_partition([dev.op(n) for n in OPS], OPS, "buf", ScheduleConfig(1980, 4, None))
    for op in OPS:
        assert dev.happens_before(("compute", op), ("comm", "all_reduce(buf)"))
    # Next work on the compute stream comes after the collective.
    dev.launch("next")
    assert dev.happens_before(("comm", "all_reduce(buf)"), ("compute", "next"))


def test_overlapped_comm_is_joined_before_next_work():
    ex, dev, _ = make()
    ex.run_partition([dev.op(n) for n in OPS], OPS, "buf", ScheduleConfig(1980, 4, "qkv"))
    dev.launch("next")
    assert dev.happens_before(("comm", "all_reduce(buf)"), ("compute", "next"))
    assert not dev.happens_before(("comm", "all_reduce(buf)"), ("compute", "rope"))


def test_unknown_slot_is_rejected():
    ex, dev, _ = make()
    with pytest.raises(UnknownSlotError):
        ex.run_partition([dev.op(n) for n in OPS], OPS, "b", ScheduleConfig(1980, 4, "nope"))


def test_default_collective_used_for_uncapped_configs():
    dev = RecordingStreamBackend()
    capped, default = RecordingCollective(streams=dev), RecordingCollective(streams=dev)

    @attrs.frozen
    class Uncapped:
        freq_mhz: int = 1980
        comm_sms: None = None
        launch_slot: str | None = "qkv"

        @property
        def sequential(self):
            return self.launch_slot is None

    ex = TorchExecutor(collective=capped, default_collective=default, streams=dev)
    ex.run_partition([dev.op(n) for n in OPS], OPS, "b", Uncapped())
    assert capped.calls == [] and default.calls == [("all_reduce", "b", None)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_nanobatches_overlap_previous_comm(n):
    ex, dev, _ = make()
    ops = [(lambda name: (lambda i: dev.launch(f"{name}[{i}]")))(o) for o in OPS]
    bufs = [f"y{i}" for i in range(n)]
    ex.run_nanobatched(ops, OPS, bufs, ScheduleConfig(1980, 16, "rope"))
    assert dev.launches("comm") == [f"all_reduce(y{i})" for i in range(n)]
    for i in range(n):
        # nanobatch i's collective follows all of nanobatch i's computation...
        assert dev.happens_before(("compute", f"out_proj[{i}]"), ("comm", f"all_reduce(y{i})"))
    for i in range(1, n):
        # ...and overlaps nanobatch i+1's computation from its slot on.
        assert dev.happens_before(("compute", f"qkv[{i}]"), ("comm", f"all_reduce(y{i - 1})"))
        assert not dev.happens_before(("compute", f"rope[{i}]"),
                                      ("comm", f"all_reduce(y{i - 1})"))
    with pytest.raises(ValueError, match="n >= 2"):
        ex.run_nanobatched(ops, OPS, ["y0"], ScheduleConfig(1980, 16, "rope"))


def test_nanobatches_sequential_mode_never_overlaps():
    ex, dev, _ = make()
    ops = [(lambda name: (lambda i: dev.launch(f"{name}[{i}]")))(o) for o in OPS]
    ex.run_nanobatched(ops, OPS, ["y0", "y1"], ScheduleConfig(1980, 16, None))
    assert dev.happens_before(("comm", "all_reduce(y0)"), ("compute", "attn_norm[1]"))


# ----------------------------------------------------------------- plans and hooks


def test_digest_mismatch_refuses_to_run():
    ex, dev, _ = make(make_test_plan(), digest_exchange=lambda d: [d, d, "zzz", d])
    with pytest.raises(PlanError, match="rank 2: zzz"):
        ex.start()
    with pytest.raises(PlanError, match="start"), ex.partition("fwd_attn"):
        pass
    assert dev.log == []  # nothing ran


def test_digest_match_starts_and_hooks_follow_plan():
    plan = make_test_plan(freqs_mhz=(1500, 1410), slots=("qkv", None), sms=(8, 4))
    trigger = RecordingTrigger()
    ex, dev, coll = make(plan, frequency=trigger, digest_exchange=lambda d: [d] * 4)
    ex.start()
    with ex.microbatch(0, 0, "fwd"):
        assert ex.current == (0, 0, "fwd")
        with ex.partition("fwd_attn", op_names=OPS) as part:
            part.communicate("prev")
            for op in OPS:
                part.op(op, dev.launch, op)
    assert ex.current is None
    assert [(f, s.name) for f, s in trigger.requests] == [(1500, "compute")]
    assert coll.calls == [("all_reduce", "prev", 8)]
    assert dev.happens_before(("compute", "attn_norm"), ("comm", "all_reduce(prev)"))
    assert not dev.happens_before(("compute", "qkv"), ("comm", "all_reduce(prev)"))


def test_scope_checks_op_order_and_missing_comm():
    ex, dev, _ = make(make_test_plan(slots=("qkv", "qkv")), digest_exchange=lambda d: [d])
    ex.start()
    with pytest.raises(ConfigError, match="out of order"), ex.microbatch(0, 0, "fwd"), \
            ex.partition("fwd_attn", op_names=OPS) as part:
        part.communicate("x")
        part.op("qkv", dev.launch, "qkv")
    with pytest.raises(RuntimeError, match="communicate"), ex.microbatch(0, 1, "fwd"), \
            ex.partition("fwd_attn") as part:
        part.op("attn_norm", dev.launch, "a")
        part.op("qkv", dev.launch, "q")


def test_plan_accessors():
    plan = make_test_plan(freqs_mhz=(1980, 1410), slots=("qkv", None), sms=(16, 4))
    assert computation_key(0, 1, "fwd") == "s0.m1.fwd"
    assert plan_config(plan, "fwd_attn", (0, 1, "fwd")) == ScheduleConfig(1410, 4, None)
    assert plan_frequency(plan, 0, 0, "fwd") == 1980
    with pytest.raises(PlanError, match="microbatch"):
        plan_config(plan, "fwd_attn", None)
    with pytest.raises(PlanError, match="no configuration"):
        plan_config(plan, "bwd_mlp", (0, 0, "fwd"))
    with pytest.raises(PlanError, match="no computation"):
        plan_frequency(plan, 0, 5, "fwd")


@attrs.frozen
class _DuckPlan:
    """The shape the executor once accepted instead of a Plan: no longer a plan."""

    digest: str = "x"
    configs: dict = attrs.field(factory=dict)


def test_only_a_plan_is_a_plan():
    with pytest.raises(TypeError, match="Plan"):
        plan_config(_DuckPlan(), "fwd_attn", (0, 0, "fwd"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Plan"):
        plan_frequency(_DuckPlan(), 0, 0, "fwd")  # type: ignore[arg-type]


def test_constructor_type_checks():
    dev = RecordingStreamBackend()
    coll = RecordingCollective(streams=dev)
    with pytest.raises(TypeError, match="CollectiveBackend"):
        TorchExecutor(collective=object(), streams=dev)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CollectiveBackend"):
        TorchExecutor(collective=None, streams=dev)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="default_collective"):
        TorchExecutor(collective=coll, streams=dev,
                      default_collective=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Plan"):
        TorchExecutor(collective=coll, streams=dev, plan=_DuckPlan())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="StreamBackend"):
        TorchExecutor(collective=coll, streams=object())  # type: ignore[arg-type]

    class Trigger:  # a request() method is not enough: the role is FrequencyTrigger
        def request(self, freq_mhz, *, stream=None):
            return 0

    with pytest.raises(TypeError, match="FrequencyTrigger"):
        TorchExecutor(collective=coll, streams=dev, frequency=Trigger())  # type: ignore[arg-type]


def test_real_plan_drives_hooks_per_microbatch_computation():
    plan = make_test_plan(freqs_mhz=(1980, 1410), slots=("qkv", None), sms=(16, 4))
    trigger = RecordingTrigger()
    ex, dev, coll = make(plan, frequency=trigger, digest_exchange=lambda d: [d, d])
    ex.start()
    with pytest.raises(PlanError, match="microbatch"), ex.partition("fwd_attn"):
        pass
    for mb in (0, 1):
        with ex.microbatch(0, mb, "fwd"), ex.partition("fwd_attn") as part:
            part.communicate(f"x{mb}")
            for op in OPS:
                part.op(op, dev.launch, f"{op}{mb}")
    assert trigger.freqs_mhz == [1980, 1410]
    assert [c[2] for c in coll.calls] == [16, 4]
    assert dev.happens_before(("compute", "out_proj1"), ("comm", "all_reduce(x1)"))
    assert not dev.happens_before(("compute", "qkv0"), ("comm", "all_reduce(x0)"))


# ------------------------------------------------------------ the role's conformance


class _HostBuffers(RecordingCollective):
    """A recording backend whose buffers are host tensors (TorchExecutor.empty asks it)."""

    def empty(self, shape, dtype):
        import torch

        return torch.zeros(shape, dtype=dtype)


class TestTorchExecutorConformance(ExecutorConformance):
    def make_executor(self, plan):
        dev = RecordingStreamBackend()
        return TorchExecutor(collective=_HostBuffers(streams=dev), streams=dev,
                             plan=plan, digest_exchange=lambda d: [d, d])


class TestEagerTorchExecutorConformance(ExecutorConformance):
    def make_executor(self, plan):
        dev = RecordingStreamBackend()
        return TorchExecutor(collective=_HostBuffers(streams=dev), streams=dev, graphs=False,
                             plan=plan, digest_exchange=lambda d: [d, d])


class TestRecordingExecutorConformance(ExecutorConformance):
    def make_executor(self, plan):
        return RecordingExecutor(plan=plan, digest_exchange=lambda d: [d, d])


def test_conformance_catches_an_executor_that_skips_ops():
    from kareus.testing import check_executor

    class Lazy(RecordingExecutor):
        def run_partition(self, ops, op_names, comm_tensor, config, **kw):
            for fn in ops[:-1]:
                fn()

    with pytest.raises(AssertionError, match="run_partition"):
        check_executor(lambda plan: Lazy(plan=plan))


def test_recording_executor_records_what_the_torch_executor_launches():
    """The fake and the real executor agree on where each collective starts: the fake
    records the launch point, the real one's stream log shows it."""
    plan = make_test_plan(freqs_mhz=(1980, 1410), slots=("rope", None), sms=(16, 4))
    fake = RecordingExecutor(plan=plan)
    real, dev, _ = make(plan, digest_exchange=lambda d: [d])
    for ex in (fake, real):
        ex.start()
        for mb in (0, 1):
            with ex.microbatch(0, mb, "fwd"), ex.partition("fwd_attn", op_names=OPS) as part:
                part.communicate(f"x{mb}")
                for op in OPS:
                    part.op(op, dev.launch if ex is real else (lambda *_: None), f"{op}{mb}")
    assert fake.entries("microbatch") == [(0, 0, "fwd", 1980), (0, 1, "fwd", 1410)]
    assert fake.entries("collective") == [("fwd_attn", "all_reduce", 16, "rope"),
                                          ("fwd_attn", "all_reduce", 4, None)]
    # the real executor launched x0 right before rope0 and x1 after every op of mb 1
    launches = [e[2] for e in dev.log if e[0] == "launch"]
    assert launches.index("all_reduce(x0)") == launches.index("rope0") - 1
    assert launches.index("all_reduce(x1)") > launches.index("out_proj1")
    assert [op for _, op in fake.entries("op")[:5]] == list(OPS)


def test_collectives_run_on_a_high_priority_stream_unless_told_not():
    # High priority: the collective's thread blocks are dispatched ahead of the slot op's
    # pending ones, so it overlaps that op as the plan assumes.
    ex, _, _ = make()
    assert ex.comm_stream.high_priority and ex.comm_stream.name == "comm"
    ex, _, _ = make(comm_high_priority=False)
    assert not ex.comm_stream.high_priority


def test_run_collective_runs_on_the_current_stream_through_backend_for():
    """A collective by itself (the outside work's): on the compute stream, no side stream,
    no event; the backend for its SM count (the default collective for None)."""
    dev = RecordingStreamBackend()
    capped, default = RecordingCollective(streams=dev), RecordingCollective(streams=dev)
    ex = TorchExecutor(collective=capped, default_collective=default, streams=dev)
    dev.launch("before")
    ex.run_collective("all_reduce", "g", sms=8)
    ex.run_collective("all_gather", "x", "y")
    assert dev.launches("compute") == ["before", "all_reduce(g)", "all_gather(x->y)"]
    assert dev.launches("comm") == [] and not any(e[0] in ("record", "wait") for e in dev.log)
    assert capped.calls == [("all_reduce", "g", 8)] and default.calls == [("all_gather", "x", None)]
    with pytest.raises(ValueError, match="kind"):
        ex.run_collective("broadcast", "g")


def test_the_outside_works_collectives_run_through_the_executor():
    torch = pytest.importorskip("torch")
    from kareus.exec.outside_work import _comm_op
    from kareus.model.ops import CommKind, CommOp

    dev = RecordingStreamBackend()
    coll = _HostBuffers(streams=dev)
    ex = TorchExecutor(collective=coll, streams=dev)
    comm = CommOp(name="dp_grad", kind=CommKind.ALL_GATHER, bytes=64, group_size=2)
    run = _comm_op(torch, comm, ex, 4, 2, torch.device("cpu"), torch.float32)
    run()
    (kind, tensor, sms), = coll.calls
    assert (kind, sms, tuple(tensor.shape)) == ("all_gather", 4, (16,))
    assert dev.launches("comm") == []
