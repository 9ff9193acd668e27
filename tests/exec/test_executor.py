"""Ordering logic of the executor, on a recording fake device (no torch needed)."""

from __future__ import annotations

import attrs
import pytest

from kareus.errors import ConfigError, PlanError, UnknownSlotError
from kareus.exec.executor import (
    RecordingStreamBackend,
    TorchExecutor,
    plan_config,
    plan_frequency,
)
from kareus.model.config import ScheduleConfig

OPS = ("attn_norm", "qkv", "rope", "attn_core", "out_proj")


class FakeCollective:
    """Logs each collective as launched on the stream it is given, with its SM count."""

    def __init__(self, dev: RecordingStreamBackend) -> None:
        self.dev = dev
        self.calls: list[tuple[str, object, int | None]] = []

    def all_reduce(self, tensor, stream, sms):
        self.calls.append(("all_reduce", tensor, sms))
        self.dev.launch(f"all_reduce({tensor})", stream)
        return tensor

    def all_gather(self, output, input, stream, sms):
        self.calls.append(("all_gather", input, sms))
        self.dev.launch(f"all_gather({input}->{output})", stream)
        return output

    def reduce_scatter(self, output, input, stream, sms):
        self.calls.append(("reduce_scatter", input, sms))
        self.dev.launch(f"reduce_scatter({input}->{output})", stream)
        return output


def make(plan=None, **kw):
    dev = RecordingStreamBackend()
    coll = FakeCollective(dev)
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
    capped, default = FakeCollective(dev), FakeCollective(dev)

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


@attrs.frozen
class FakePlan:
    digest: str
    configs: dict
    freqs_mhz: dict = attrs.field(factory=dict)


def test_digest_mismatch_refuses_to_run():
    plan = FakePlan("abc", {"fwd_attn": ScheduleConfig(1980, 8, "qkv")})
    ex, _, _ = make(plan, digest_exchange=lambda d: [d, "abc", "zzz", d])
    with pytest.raises(PlanError, match="rank 2: zzz"):
        ex.start()
    with pytest.raises(PlanError, match="start"), ex.partition("fwd_attn"):
        pass


def test_digest_match_starts_and_hooks_follow_plan():
    plan = FakePlan("abc", {"fwd_attn": ScheduleConfig(1980, 8, "qkv")},
                    {(0, 0, "fwd"): 1500})
    requests = []

    class Trigger:
        def request(self, freq_mhz, *, stream=None):
            requests.append((freq_mhz, stream.name))

    ex, dev, coll = make(plan, frequency=Trigger(), digest_exchange=lambda d: [d] * 4)
    ex.start()
    with ex.microbatch(0, 0, "fwd"):
        assert ex.current == (0, 0, "fwd")
        with ex.partition("fwd_attn", op_names=OPS) as part:
            part.communicate("prev")
            for op in OPS:
                part.op(op, dev.launch, op)
    assert ex.current is None
    assert requests == [(1500, "compute")]
    assert coll.calls == [("all_reduce", "prev", 8)]
    assert dev.happens_before(("compute", "attn_norm"), ("comm", "all_reduce(prev)"))
    assert not dev.happens_before(("compute", "qkv"), ("comm", "all_reduce(prev)"))


def test_scope_checks_op_order_and_missing_comm():
    plan = FakePlan("d", {"fwd_attn": ScheduleConfig(1980, 8, "qkv")})
    ex, dev, _ = make(plan, digest_exchange=lambda d: [d])
    ex.start()
    with pytest.raises(ConfigError, match="out of order"), \
            ex.partition("fwd_attn", op_names=OPS) as part:
        part.communicate("x")
        part.op("qkv", dev.launch, "qkv")
    with pytest.raises(RuntimeError, match="communicate"), ex.partition("fwd_attn") as part:
        part.op("attn_norm", dev.launch, "a")
        part.op("qkv", dev.launch, "q")


def test_plan_accessors():
    cfg = ScheduleConfig(1500, 4, None)

    class ByMethod:
        digest = "x"

        def config_for(self, key):
            return cfg

        def frequency_for(self, stage, mb, phase):
            return 1410 if phase == "bwd" else None

    assert plan_config(ByMethod(), "any") == cfg
    assert plan_frequency(ByMethod(), 0, 1, "bwd") == 1410
    assert plan_frequency(ByMethod(), 0, 1, "fwd") is None
    d = FakePlan("y", {"t": cfg.to_dict()})
    assert plan_config(d, "t") == cfg
    with pytest.raises(PlanError, match="no configuration"):
        plan_config(d, "other")


def test_constructor_type_checks():
    dev = RecordingStreamBackend()
    with pytest.raises(TypeError, match="CollectiveBackend"):
        TorchExecutor(collective=object(), streams=dev)
    with pytest.raises(TypeError, match="digest"):
        TorchExecutor(collective=FakeCollective(dev), streams=dev, plan=object())
    with pytest.raises(TypeError, match="StreamBackend"):
        TorchExecutor(collective=FakeCollective(dev), streams=object())


def test_real_plan_drives_hooks_per_microbatch_computation():
    from kareus.compose.plan import MicrobatchChoice, Plan

    fast = MicrobatchChoice(freq_mhz=1980, configs={"fwd_attn": ScheduleConfig(1980, 16, "qkv")})
    slow = MicrobatchChoice(freq_mhz=1410, configs={"fwd_attn": ScheduleConfig(1410, 4, None)})
    plan = Plan(gpu="h200-sxm", num_stages=1, num_microbatches=2, choices=[fast, slow],
                assignment={"s0.m0.fwd": 0, "s0.m1.fwd": 1}, time_s=1.0, energy_j=1.0,
                dynamic_energy_j=0.5, static_power_w=100.0)
    requests = []

    class Trigger:
        def request(self, freq_mhz, *, stream=None):
            requests.append(freq_mhz)

    ex, dev, coll = make(plan, frequency=Trigger(), digest_exchange=lambda d: [d, d])
    ex.start()
    with pytest.raises(PlanError, match="microbatch"), ex.partition("fwd_attn"):
        pass
    for mb in (0, 1):
        with ex.microbatch(0, mb, "fwd"), ex.partition("fwd_attn") as part:
            part.communicate(f"x{mb}")
            for op in OPS:
                part.op(op, dev.launch, f"{op}{mb}")
    assert requests == [1980, 1410]
    assert [c[2] for c in coll.calls] == [16, 4]
    assert dev.happens_before(("compute", "out_proj1"), ("comm", "all_reduce(x1)"))
    assert not dev.happens_before(("compute", "qkv0"), ("comm", "all_reduce(x0)"))


# ------------------------------------------------------------------ ProcessGroupCollective


class RecordingDist:
    """torch.distributed stand-in: records the flat-tensor collectives it is asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, object, object]] = []

    def __getattr__(self, name):
        if name not in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            raise AttributeError(name)

        def call(*args, group=None):
            self.calls.append((name, *args, group))
        return call


@pytest.mark.parametrize(("op", "dist_call"), [("all_gather", "all_gather_into_tensor"),
                                               ("reduce_scatter", "reduce_scatter_tensor")])
def test_process_group_collective_shard_ops_call_the_flat_tensor_collectives(op, dist_call):
    torch = pytest.importorskip("torch")
    from kareus.exec.executor import ProcessGroupCollective

    group = object()
    coll = ProcessGroupCollective(group=group)
    coll._dist = RecordingDist()
    full, shard = torch.zeros(2, 3, 4), torch.zeros(3, 4)
    output, input = (full, shard) if op == "all_gather" else (shard, full)
    assert getattr(coll, op)(output, input, None, 7) is output  # sms is ignored
    ((name, out_flat, in_flat, got_group),) = coll._dist.calls
    assert (name, got_group) == (dist_call, group)
    # flat views of the caller's tensors (the same memory), output first
    assert out_flat.shape == (output.numel(),) and out_flat.data_ptr() == output.data_ptr()
    assert in_flat.shape == (input.numel(),) and in_flat.data_ptr() == input.data_ptr()
