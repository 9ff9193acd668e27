"""The decoder schedule (kareus.exec.schedule), which the training loop and the framework
adapters run, on fakes, no torch; its op order against the partition model's.

A RecordingExecutor records where each collective launches, with which SM count and
under which partition type; the ops are recorded by a fake model.
"""

from __future__ import annotations

from collections import Counter

import attrs
import pytest

from kareus.compose import MicrobatchChoice, Plan
from kareus.exec.executor import plan_config
from kareus.exec.schedule import (
    SCHEDULES,
    Comm,
    DefaultConfig,
    Op,
    clip_slot,
    match_type,
    pieces,
    run_computation,
    sp_backward_stream,
    stack_stream,
    type_shapes,
)
from kareus.exec.train import shuffled_order
from kareus.model.config import ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.pipeline import get_schedule
from kareus.model.workload import ModelArch, Parallelism, Workload
from kareus.testing import RecordingExecutor

ARCH = ModelArch(name="tiny", layers=3, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128,
                 vocab=101)
COMBOS = [(2, 1, True), (2, 1, False), (1, 2, False), (2, 2, True), (2, 2, False),
          (4, 2, True), (2, 1, "selective"), (1, 2, "selective"), (2, 2, "selective")]
#: Sequence-parallel layouts (TP > 1): (tp, cp, recompute policy).
SP_COMBOS = [(2, 1, "full"), (2, 1, "none"), (2, 2, "full"), (2, 2, "none"), (4, 2, "full"),
             (4, 2, "none"), (2, 1, "selective"), (2, 2, "selective")]


def workload(tp: int, cp: int, recompute: bool | str = True, n: int = 2, layers: int = 3,
             sp: bool = False) -> Workload:
    m = ModelArch(name="tiny", layers=layers, hidden=64, heads=8, kv_heads=4, head_dim=8,
                  ffn=128, vocab=101)
    return Workload(model=m, parallelism=Parallelism(tp=tp, cp=cp, sp=sp), microbatch_size=4,
                    seq_len=16, num_microbatches=2, nanobatches=n, recompute=recompute)


def stream_of(wl: Workload, phase: str) -> list:
    p = wl.parallelism
    return stack_stream(phase, wl.model.layers, tp=p.tp, cp=p.cp, recompute=wl.recompute,
                        qk_norm=wl.model.qk_norm, sp=p.sequence_parallel)


def plan_for(wl: Workload, *, pick: int = 1, sms: int = 8) -> Plan:
    """Every type at its slot ``pick`` (clipped) with ``sms + type index`` SMs."""
    ps = build_partitions(wl)
    cfgs = {}
    for k, (name, p) in enumerate(sorted(ps.types.items())):
        slots = [s.name for s in p.slots]
        cfgs[name] = ScheduleConfig(1980, sms + k,
                                    slots[min(pick, len(slots) - 1)] if slots else None)
    comps = get_schedule("1f1b", 1, wl.num_microbatches).stage_orders[0]
    return Plan(gpu="h200-sxm", num_stages=1, num_microbatches=wl.num_microbatches,
                choices=[MicrobatchChoice(freq_mhz=1980, configs=cfgs)],
                assignment={c.key(): 0 for c in comps}, time_s=1.0, energy_j=1.0,
                dynamic_energy_j=0.5, static_power_w=100.0, workload=wl.to_dict())


class FakeModel:
    """Records ops; a collective's tensor is named by (comm, nanobatch)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def run_op(self, op: Op, nb: int) -> None:
        self.log.append(("ran", op.name, op.layer, nb))

    def comm_args(self, comm: Comm, nb: int) -> tuple[str, str | None]:
        t = f"{comm.name}@{comm.layer}#{nb}"
        return t, (None if comm.kind == "all_reduce" else t + ">out")


def run(wl: Workload, phase: str, schedule: str, plan: Plan | None = None):
    ex = RecordingExecutor(plan=plan)
    ex.start()
    model = FakeModel(ex.log)
    stack = pieces(stream_of(wl, phase))
    types = type_shapes(build_partitions(wl))
    n = 1 if schedule == "sequential" else wl.nanobatches
    if schedule == "kareus":
        with ex.microbatch(0, 0, phase):
            ran = run_computation(ex, stack, schedule=schedule, nanobatches=n,
                                  run_op=model.run_op, comm_args=model.comm_args, types=types,
                                  plan_config_of=lambda k: plan_config(plan, k, ex.current))
    else:
        ran = run_computation(ex, stack, schedule=schedule, nanobatches=n, run_op=model.run_op,
                              comm_args=model.comm_args, types=types)
    return ex, stack, ran


# ------------------------------------------------------------------ the stream


def test_forward_stream_of_a_tp_cp_layer():
    s = stack_stream("fwd", 1, tp=2, cp=2, recompute=True)
    names = [x.name if isinstance(x, Op) else f"<{x.kind}:{x.name}>" for x in s]
    assert names == ["attn_norm", "qkv", "rope", "<all_gather:kv>", "attn_core", "out_proj",
                     "<all_reduce:attn_out>", "mlp_norm", "gate", "up", "swiglu", "down",
                     "<all_reduce:mlp_out>"]


def test_the_stream_runs_the_decoder_layers_op_order():
    # One place writes the op order (kareus.model.DECODER_LAYER): the stream of one layer is
    # its ops and collectives, the partition model cuts the same ops, and both op tables
    # (the training loop's decoder, the runnable partitions' builders) hold exactly them.
    from kareus.exec._transformer_ops import _op_builders
    from kareus.exec.train import DecoderShard
    from kareus.model import DECODER_LAYER
    from kareus.model.decoder import decoder_layer

    fwd, bwd = DECODER_LAYER["fwd"], DECODER_LAYER["bwd"]
    stream = stack_stream("fwd", 1, tp=2, cp=2, recompute=True)
    assert tuple(x.name for x in stream if isinstance(x, Op)) == fwd.op_names
    assert [(x.kind, x.name) for x in stream if isinstance(x, Comm)] == [
        (c.kind, c.tensor) for c in fwd.collectives]
    stream = stack_stream("bwd", 1, tp=2, cp=2, recompute=False)
    assert tuple(x.name for x in stream if isinstance(x, Op)) == bwd.op_names
    names = set(fwd.op_names) | set(bwd.op_names)
    # the query/key norms: ops of the layer of a model that has them
    qk = {n for ph in ("fwd", "bwd") for n in decoder_layer(ph, qk_norm=True).op_names} - names
    assert qk == {"qk_norm_rope", "qk_norm_rope_bwd"}  # in RoPE's place, fused
    names |= qk
    stream = stack_stream("bwd", 1, tp=2, cp=2, recompute=False, qk_norm=True)
    assert tuple(x.name for x in stream if isinstance(x, Op)) == \
        decoder_layer("bwd", qk_norm=True).op_names
    # both also run the mixture-of-experts layer's ops (every variant: shared experts, the
    # received tokens' sort)
    from kareus.model.decoder import moe_decoder_layer

    moe = {n for ph in ("fwd", "bwd") for n in moe_decoder_layer(
        ph, shared_experts=True, sort_tokens=True).op_names}
    assert set(_op_builders()) == names | moe
    assert {n[len("_op_"):] for n in dir(DecoderShard) if n.startswith("_op_")} == names | moe
    ps = build_partitions(workload(2, 2))
    assert {op.name for p in ps for op in p.compute_ops} == names - qk
    wl_qk = workload(2, 2)
    wl_qk = wl_qk.with_(model=attrs.evolve(wl_qk.model, qk_norm=True))
    assert {op.name for p in build_partitions(wl_qk) for op in p.compute_ops} == (
        names - {"rope", "rope_bwd"})
    for p in ps:  # every type's ops in the layer's (cyclic) order
        order = (*bwd.tail, *bwd.op_names) if p.phase == "bwd" else fwd.op_names
        idx = [order.index(op.name) for op in p.compute_ops]
        assert idx == sorted(idx), p.name


def test_backward_stream_recomputes_each_layer_before_its_backward():
    s = stack_stream("bwd", 2, tp=2, cp=1, recompute=True)
    ops = [(x.name, x.layer) for x in s if isinstance(x, Op)]
    # layer 1 (top): recompute, backward; then layer 0's recompute; layer 1's norm
    # backward opens layer 0's backward; layer 0's norm backward is last.
    assert ops[:5] == [("attn_norm", 1), ("qkv", 1), ("rope", 1), ("attn_core", 1),
                       ("out_proj", 1)]
    k = ops.index(("attn_norm_bwd", 1))
    assert ops[k - 1] == ("down", 0) and ops[k + 1] == ("down_dgrad", 0)
    assert ops[-1] == ("attn_norm_bwd", 0)
    no_rc = [(x.name, x.layer) for x in stack_stream("bwd", 2, tp=2, cp=1, recompute=False)
             if isinstance(x, Op)]
    assert not any(n in ("qkv", "down") for n, _ in no_rc)


@pytest.mark.parametrize("tp,cp,recompute,sp",
                         [(*c, False) for c in COMBOS] + [(*c, True) for c in SP_COMBOS])
def test_every_piece_is_a_partition_type_with_its_collective(tp, cp, recompute, sp):
    """Each unit's ops and the collective it overlaps (kind and group) form a type of the
    partition model."""
    wl = workload(tp, cp, recompute, sp=sp)
    types = type_shapes(build_partitions(wl))
    for phase in ("fwd", "bwd"):
        stack = pieces(stream_of(wl, phase))
        assert all(p.comm is not None for p in stack[:-1])
        prev = None
        partial = 0
        for piece in stack:
            if prev is not None:
                hit = match_type(types, piece.op_names, prev.kind, prev.group)
                assert hit is not None, (phase, piece.op_names, prev.kind)
                assert types[hit[0]].comm_group == prev.group
                partial += types[hit[0]].op_names != piece.op_names
            if piece.comm is not None:  # the next nanobatch of the same piece
                hit = match_type(types, piece.op_names, piece.comm.kind, piece.comm.group)
                assert hit is not None, (phase, piece.op_names, piece.comm.kind)
                assert types[hit[0]].comm_group == piece.comm.group
            prev = piece.comm
        # only the ends of the stack are cut: the top layer's first backward piece and
        # the bottom layer's last one
        assert partial <= 2, (phase, partial)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_sequence_parallel_pieces_with_query_key_norm_are_partition_types(recompute):
    wl = workload(2, 2, recompute, sp=True)
    wl = wl.with_(model=attrs.evolve(wl.model, qk_norm=True))
    types = type_shapes(build_partitions(wl))
    for phase in ("fwd", "bwd"):
        for piece in pieces(stream_of(wl, phase)):
            if piece.comm is not None:
                hit = match_type(types, piece.op_names, piece.comm.kind, piece.comm.group)
                assert hit is not None and types[hit[0]].op_names == piece.op_names, (
                    phase, piece.op_names)


@pytest.mark.parametrize("tp,cp,recompute,sp",
                         [(*c, False) for c in COMBOS] + [(*c, True) for c in SP_COMBOS])
def test_partitions_per_computation_match_the_partition_model(tp, cp, recompute, sp):
    """The loop runs each type about as often per microbatch computation as the partition
    model counts it (the model pairs the last collective with the first piece: the tail)."""
    wl = workload(tp, cp, recompute, sp=sp)
    ps = build_partitions(wl)
    plan = plan_for(wl)
    for phase in ("fwd", "bwd"):
        _, _, ran = run(wl, phase, "kareus", plan)
        got, want = Counter(k for k, _ in ran), Counter(ps.counts[phase])
        assert sum(got.values()) == sum(want.values()), phase
        # at most the ends of the stack differ: with recomputation the first unit (the top
        # layer's recomputed attention) overlaps nothing, and the bottom layer's norm
        # backward overlaps the last collective instead of the top layer's
        assert set(got) == set(want) and all(abs(got[k] - want[k]) <= 1 for k in want), phase
        if wl.recompute != "full" or phase == "fwd":
            assert got == want, phase


def test_recomputation_without_tp_mixes_forward_and_backward_ops_in_one_piece():
    """TP=1, CP=2 with recomputation: the recomputed forward of a layer and its backward
    share the pieces between two collectives, which no partition type holds; such units
    run sequentially with the SM count of a type with that collective."""
    wl = workload(1, 2, True)
    plan = plan_for(wl)
    ps = build_partitions(wl)
    _, _, ran = run(wl, "fwd", "kareus", plan)
    assert Counter(k for k, _ in ran) == Counter(ps.counts["fwd"])
    _, stack, ran = run(wl, "bwd", "kareus", plan)
    types = type_shapes(ps)
    unmatched = [p for p in stack if p.comm is not None
                 and match_type(types, p.op_names, p.comm.kind) is None]
    assert unmatched
    for p in unmatched:  # each holds recomputed forward ops and backward ops
        assert {"attn_norm", "attn_core"} & set(p.op_names)
        assert any(n.endswith(("_bwd", "grad")) for n in p.op_names)
    sms = {c.comm_sms for cs in plan.partition_configs().values() for c in cs}
    assert all(cfg.comm_sms in sms for _, cfg in ran)
    assert any(cfg.launch_slot is None for _, cfg in ran)


def test_match_type_and_clip_slot():
    types = type_shapes(build_partitions(workload(2, 1)))
    assert match_type(types, ("mlp_norm", "gate", "up", "swiglu", "down"), "all_reduce") == (
        "fwd_mlp", 0)
    assert match_type(types, ("down_dgrad", "down_wgrad"), "all_reduce") == ("bwd_mlp", 1)
    assert match_type(types, ("qkv",), "all_gather") is None
    ops = types["bwd_mlp"].op_names
    assert clip_slot("attn_norm_bwd", ops, 1, ops[1:]) == "down_dgrad"  # before: first op
    assert clip_slot("gate_dgrad", ops, 1, ops[1:]) == "gate_dgrad"
    assert clip_slot("down_dgrad", ops, 0, ops[:1]) is None  # after the unit: sequential
    assert clip_slot(None, ops, 0, ops) is None
    with pytest.raises(ValueError):
        clip_slot("nope", ops, 0, ops)


# ------------------------------------------------------------------ the schedules


def _collectives(ex):
    return ex.entries("collective")


@pytest.mark.parametrize("tp,cp,recompute", [(2, 1, True), (2, 2, False), (1, 2, True)])
def test_kareus_launches_each_collective_at_the_plans_slot_with_its_sms(tp, cp, recompute):
    wl = workload(tp, cp, recompute)
    plan = plan_for(wl)
    cfgs = {k: v[0] for k, v in plan.partition_configs().items()}
    for phase in ("fwd", "bwd"):
        ex, stack, ran = run(wl, phase, "kareus", plan)
        log = ex.log
        for i, e in enumerate(log):
            if e[0] != "collective":
                continue
            _, key, kind, sms, slot = e
            assert sms == cfgs[key].comm_sms  # the type's SM count, always
            if slot is not None:  # launched right before that op, which comes next
                nxt = next(x for x in log[i + 1:] if x[0] == "op")
                assert nxt[2] == slot
        # every collective of every nanobatch runs once, in stream order
        n = wl.nanobatches
        want = [(p.comm.kind, f"{p.comm.name}@{p.comm.layer}#{nb}") for p in stack
                if p.comm is not None for nb in range(n)]
        got = [(e[2], e[1]) for e in log if e[0] == "communicate"]
        assert [k for k, _ in got] == [k for k, _ in want]
        assert len(_collectives(ex)) == len(want)
        # the ops: every op of every nanobatch once, piece by piece
        ops = [(e[1], e[2], e[3]) for e in log if e[0] == "ran"]
        assert ops == [(o.name, o.layer, nb) for p in stack for nb in range(n) for o in p.ops]
        # the clipped slots: a slot outside the unit runs at its first op or sequential
        for key, cfg in ran:
            assert cfg.comm_sms == cfgs[key].comm_sms
            assert cfg.launch_slot in (cfgs[key].launch_slot, None) or cfg.launch_slot in \
                types_ops(wl, key)


def types_ops(wl, key):
    return type_shapes(build_partitions(wl))[key].op_names


def test_sequential_runs_each_collective_after_its_own_ops_with_default_ctas():
    wl = workload(2, 2, True)
    for phase in ("fwd", "bwd"):
        ex, stack, _ = run(wl, phase, "sequential")
        log = ex.log
        comms = [i for i, e in enumerate(log) if e[0] == "collective"]
        assert len(comms) == sum(p.comm is not None for p in stack)
        for i in comms:
            _, key, kind, sms, slot = log[i]
            assert sms is None and slot is None
            prev_ops = [e for e in log[:i] if e[0] == "ran"]
            # the collective follows the last op of its piece, whole microbatch (nb 0)
            assert prev_ops[-1][3] == 0
        assert all(e[3] == 0 for e in log if e[0] == "ran")


def test_nanobatching_launches_with_the_next_units_first_op_with_default_ctas():
    wl = workload(2, 1, True)
    ex, stack, ran = run(wl, "fwd", "nanobatching")
    log = ex.log
    tail = 0
    for i, e in enumerate(log):
        if e[0] != "collective":
            continue
        assert e[3] is None  # the collective's own CTA count
        if e[4] is None:
            tail += 1
        else:
            nxt = next(x for x in log[i + 1:] if x[0] == "op")
            assert nxt[2] == e[4]
    assert tail == 1  # only the last collective is exposed
    assert all(isinstance(cfg, DefaultConfig) for _, cfg in ran)


def test_kareus_requests_the_plans_clock_and_baselines_do_not():
    wl = workload(2, 1)
    plan = plan_for(wl)
    ex, _, _ = run(wl, "fwd", "kareus", plan)
    assert ex.entries("microbatch") == [(0, 0, "fwd", 1980)]
    ex, _, _ = run(wl, "fwd", "nanobatching")
    assert ex.entries("microbatch") == []


def test_bad_arguments():
    wl = workload(2, 1)
    ex = RecordingExecutor()
    stack = pieces(stack_stream("fwd", 1, tp=2, cp=1, recompute=True))
    kw = dict(run_op=lambda op, nb: None, comm_args=lambda c, nb: ("t", None))
    with pytest.raises(ValueError, match="schedule"):
        run_computation(ex, stack, schedule="other", nanobatches=2, **kw)
    with pytest.raises(ValueError, match="nanobatches=1"):
        run_computation(ex, stack, schedule="sequential", nanobatches=2, **kw)
    with pytest.raises(ValueError, match="plan_config_of"):
        run_computation(ex, stack, schedule="kareus", nanobatches=2, **kw)
    with pytest.raises(ValueError):
        stack_stream("mid", 1, tp=2, cp=1, recompute=True)
    assert wl.nanobatches == 2 and SCHEDULES == ("sequential", "nanobatching", "kareus")


def test_shuffled_order_is_a_function_of_the_seed_alone():
    a = shuffled_order(SCHEDULES, 3, 0)
    assert a == shuffled_order(SCHEDULES, 3, 0)
    assert sorted(a) == sorted((s, r) for s in SCHEDULES for r in range(3))
    assert any(shuffled_order(SCHEDULES, 3, k) != a for k in range(1, 5))


def test_full_recomputation_skips_what_no_backward_reads_only_without_collectives():
    # TP = CP = 1 (no partition planned): the recomputed forward leaves out the down
    # projection, whose output (the layer's) no backward op reads, as torch.compile's
    # partitioner does; with a collective the recomputed forward is the forward phase its
    # partitions are costed as (the down projection and the output's collective included)
    from kareus.model.decoder import NOT_READ_BY_BACKWARD, decoder_layer

    fwd = decoder_layer("fwd").op_names
    for tp, cp in ((1, 1), (2, 1), (1, 2)):
        s = stack_stream("bwd", 2, tp=tp, cp=cp, recompute="full")
        again = [x.name for x in s if isinstance(x, Op) and x.name in fwd]
        skipped = tp == cp == 1
        want = [n for n in fwd if not (skipped and n in NOT_READ_BY_BACKWARD)] * 2
        assert again == want, (tp, cp)
        assert ("down" in again) is not skipped


@pytest.mark.parametrize("schedule", ["nanobatching", "kareus"])
@pytest.mark.parametrize("tp,cp,recompute", [(2, 1, "full"), (2, 2, "none"), (1, 2, "selective")])
def test_one_nanobatch_never_runs_ops_beside_a_collective(schedule, tp, cp, recompute):
    # At one nanobatch the ops after a collective read its result: a schedule that paired
    # them with it (as it pairs the next nanobatch's) raced on a GPU (the loop's TP=2
    # loopback losses drifted from the sequential schedule's on 1x H200; the CPU runs ops
    # in order and cannot see it). Each collective is joined before any later op runs,
    # and the run is the sequential schedule's, under a plan with its SM counts.
    wl = workload(tp, cp, recompute, n=1)
    plan = plan_for(wl) if schedule == "kareus" else None
    for phase in ("fwd", "bwd"):
        ex, _, ran = run(wl, phase, schedule, plan)
        log = [e for e in ex.log if e[0] in ("collective", "join", "ran")]
        for i, e in enumerate(log):
            if e[0] == "collective":
                assert log[i + 1] == ("join", e[1]), (phase, log[i:i + 3])
                assert e[4] is None  # launched after the piece's ops
        seq_ex, _, seq_ran = run(wl, phase, "sequential")
        assert [k for k, _ in ran] == [k for k, _ in seq_ran]
        assert [e for e in ex.log if e[0] == "ran"] == [e for e in seq_ex.log if e[0] == "ran"]
        if schedule == "kareus":
            sms = {e[1]: e[3] for e in ex.log if e[0] == "collective"}
            for key, cfg in ran:
                assert sms[key] == cfg.comm_sms == plan_config(plan, key, (0, 0, phase)).comm_sms


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_an_unsplit_computation_s_opening_collective_takes_its_phase_s_configuration(
        recompute):
    # Under sequence parallelism a backward opens with the all-gather of the output
    # gradient, which no type's ops hold; run unsplit under a plan it took "the first type
    # of its kind", a forward type that a real plan's backward choice does not configure
    # (PlanError mid-step). It now takes a type of its kind that the choice configures.
    from kareus.testing import make_workload_plan

    wl = workload(2, 1, recompute, sp=True)
    plan = make_workload_plan(wl, unsplit_microbatches=(0,))
    whole = wl.with_(nanobatches=1)
    types = type_shapes(build_partitions(whole))
    for phase in ("fwd", "bwd"):
        stream = stream_of(whole, phase)
        if phase == "bwd":  # as a planned layer runs it: dy gathered first
            stream = sp_backward_stream(stream, whole.model.layers, gather_input_grad=False)
        assert phase == "fwd" or not pieces(stream)[0].ops  # the opening collective
        ex = RecordingExecutor(plan=plan)
        ex.start()
        model = FakeModel(ex.log)
        with ex.microbatch(0, 0, phase):
            ran = run_computation(
                ex, pieces(stream), schedule="sequential", nanobatches=1,
                run_op=model.run_op, comm_args=model.comm_args, types=types,
                sequential_config_of=lambda k, ex=ex: plan_config(plan, k, ex.current))
        want = set(plan.choices[plan.assignment[f"s0.m0.{phase}"]].types)
        assert ran and {k for k, _ in ran} <= want, phase
