"""The host in the emulator (EmulatedGPU.execution): graph replay keeps the GPU fed; eager
launches cost host time per op and collective, issued in program order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kareus.model import ScheduleConfig, Workload, build_partitions
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.model.partition import OpPartition, OutsideWork
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler
from kareus.profilers.emulator._host import DEFAULT_HOST_COSTS, HostCost, host_key
from kareus.profilers.emulator._opmodel import _prep_op
from kareus.profilers.emulator._sim import _collective, _Sim

REPO = Path(__file__).resolve().parents[2]
GPU = EmulatedGPU.from_spec("h200-sxm")
EAGER = GPU.with_(execution="eager")
AR = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**20, group_size=4)
# Twelve tiny elementwise ops (1 MB each: a few hundred ns of HBM time) and three big GEMMs
# (8192 x 8192 x 8192: about 1.3 ms each on an H200).
TINY = [ComputeOp(name=f"add{i}", kind=OpKind.ELEMENTWISE, flops=5e5, bytes_moved=1e6)
        for i in range(12)]
BIG = [ComputeOp(name=f"gemm{i}", kind=OpKind.GEMM, flops=2.0 * 8192**3,
                 bytes_moved=3 * 2 * 8192**2) for i in range(3)]


def _part(ops: list[ComputeOp], name: str) -> OpPartition:
    return OpPartition(name=name, compute_ops=tuple(ops), comm_op=AR)


def _profilers() -> tuple[EmulatedProfiler, EmulatedProfiler]:
    return (EmulatedProfiler(GPU, noise=0.0), EmulatedProfiler(GPU, noise=0.0,
                                                               execution="eager"))


def test_graphed_is_the_default_and_eager_an_option() -> None:
    assert GPU.execution == "graphed" and EmulatedProfiler("h200-sxm").execution == "graphed"
    assert EmulatedProfiler("a100-40gb", execution="eager").execution == "eager"
    with pytest.raises(ValueError, match="'graphed' or 'eager'"):
        EmulatedProfiler("h200-sxm", execution="lazy")
    with pytest.raises(ValueError, match="host_costs"):
        GPU.with_(host_costs=[("p", "op", 0.0, "zero")])
    with pytest.raises(ValueError, match="graph_launch_s"):
        GPU.with_(graph_launch_s=-1e-6)


def test_many_tiny_ops_are_host_bound_eagerly() -> None:
    """Eager: a run takes the host's issue time (every op's launch plus the collective's);
    graphed: the GPU's own time, kernels back to back."""
    part = _part(TINY, "tiny")
    graphed, eager = _profilers()
    cfg = ScheduleConfig(1980, 8, None)
    host = sum(GPU.host_s(o) for o in TINY) + GPU.collective_host_s
    assert host == pytest.approx(12 * 10e-6 + 20e-6)  # torch.add's 10 us, the collective's 20
    e = eager.trace(part, cfg)
    g = graphed.trace(part, cfg)
    assert e.host_bound and not g.host_bound
    assert e.host_s == pytest.approx(host) and g.host_s == pytest.approx(GPU.graph_launch_s)
    assert e.time_s == pytest.approx(host, rel=1e-6)  # the GPU waits on the host
    assert g.time_s < 0.5 * e.time_s
    # The GPU's own work is the same: the difference is waiting (idle and uncore power).
    assert eager.ground_truth(part, cfg).energy_j > graphed.ground_truth(part, cfg).energy_j


def test_big_gemms_are_gpu_bound_in_both_modes() -> None:
    part = _part(BIG, "big")
    graphed, eager = _profilers()
    for slot in (None, "gemm1"):
        cfg = ScheduleConfig(1980, 8, slot)
        e, g = eager.trace(part, cfg), graphed.trace(part, cfg)
        assert not e.host_bound and e.host_s == pytest.approx(3 * 18e-6 + 20e-6)
        assert e.time_s == pytest.approx(g.time_s, rel=0.02)
        assert (eager.ground_truth(part, cfg).energy_j
                == pytest.approx(graphed.ground_truth(part, cfg).energy_j, rel=0.02))


def test_the_host_issues_in_program_order_and_the_collective_at_its_slot() -> None:
    """One run with the host starting with the GPU (no lead): op k starts once the host has
    issued ops 0..k (and the collective, if it launches with op k or before); the collective
    launched with op 4 starts when the host has issued it, before op 4, not with op 4."""
    ops = [_prep_op(EAGER, o) for o in TINY]
    sim = _Sim(EAGER, ops)
    t, _, d = sim._run_once(1980, [_collective(EAGER, AR, 8, 4)], True, 0.0)
    assert d is not None
    comm_at = 4 * 10e-6 + 20e-6
    assert d["comm_start_s"] == pytest.approx(comm_at)
    # op 4 is issued 10 us after the collective: the collective did not wait for it.
    starts = [sum(d["op_times_s"][:i]) for i in range(len(ops))]
    assert starts[5] >= comm_at + 10e-6 - 1e-12
    # Op i ends no earlier than the host issued it (plus its gap).
    for i in range(len(ops)):
        issued = (i + 1) * 10e-6 + (20e-6 if i >= 4 else 0.0)
        assert starts[i] + d["op_times_s"][i] >= issued + EAGER.launch_overhead_s - 1e-12
    # The last op waits on the host: the run ends one gap and one tiny op after the host's
    # last issue.
    assert 12 * 10e-6 + 20e-6 + EAGER.launch_overhead_s < t < 12 * 10e-6 + 20e-6 + 5e-6


def test_steady_state_host_bound_run_takes_the_host_time() -> None:
    """Back to back, the host issues run n+1 while the GPU finishes run n: a host-bound run
    takes exactly the host's time, not the host's time plus the last kernel."""
    sim = _Sim(EAGER, [_prep_op(EAGER, o) for o in TINY])
    comms = [_collective(EAGER, AR, 8, None)]
    once, _, _ = sim._run_once(1980, comms, False, 0.0)
    steady, _, d = sim.run(1980, comms, detail=True)
    assert d is not None and d["host_bound"] and d["lead_s"] > 0
    assert steady == pytest.approx(sim.host_s(comms), rel=1e-9) and once > steady


def test_nanobatching_doubles_the_eager_launches() -> None:
    """A microbatch in two nanobatches runs every partition twice as often, at the same
    host cost per run: twice the host time per microbatch, while the GPU work is the same."""
    eager = EmulatedProfiler("h200-sxm", noise=0.0, execution="eager")
    host: dict[int, float] = {}
    for nb in (1, 2):
        ps = build_partitions(Workload.preset("qwen3-1.7b", tp=4, cp=2, microbatch_size=8,
                                              nanobatches=nb))
        cfgs = {n: ScheduleConfig(1980, 8, None) for n in ps.types}
        host[nb] = sum(count * eager.trace(ps.types[name], cfgs[name]).host_s
                       for phase in ps.counts.values() for name, count in phase.items())
    assert host[2] == pytest.approx(2 * host[1], rel=1e-9)


def test_nanobatched_attention_is_host_bound_eagerly_and_fed_graphed() -> None:
    """Qwen3-1.7B at TP=4, CP=2, microbatch 8 x 4096 in two nanobatches: its first attention
    partition (RMSNorm, the QKV GEMM, the per-head q and k RMSNorms fused with RoPE) takes
    less GPU time than its eager launches."""
    part = build_partitions(Workload.preset("qwen3-1.7b", tp=4, cp=2, microbatch_size=8,
                                            nanobatches=2))["fwd_attn_in_ag"]
    graphed, eager = (EmulatedProfiler("h200-sxm", noise=0.0, execution=x)
                      for x in ("graphed", "eager"))
    cfg = ScheduleConfig(1980, 8, "attn_norm")
    g, e = graphed.trace(part, cfg), eager.trace(part, cfg)
    assert e.host_bound and not g.host_bound
    # the norm, the collective, the GEMM, and the fused q/k norm and RoPE at RoPE's host
    # cost (one launch, as the layer without qk-norm has)
    assert e.time_s == pytest.approx(89e-6 + 20e-6 + 18e-6 + 99e-6)
    assert 1.5 < e.time_s / g.time_s < 4.0


def test_outside_work_pays_its_launches_eagerly() -> None:
    work = OutsideWork(ops=tuple(TINY[:4]), comms=(AR,))
    graphed, eager = _profilers()
    g = graphed.measure_outside(work, 1980, group_size=1)
    e = eager.measure_outside(work, 1980, group_size=1)
    assert e.time_s == pytest.approx(4 * 10e-6 + 20e-6, rel=1e-6) and g.time_s < e.time_s


def test_host_costs_from_records_before_defaults() -> None:
    op = ComputeOp(name="attn_core_bwd", kind=OpKind.ATTENTION, flops=1e9, bytes_moved=1e6)
    assert host_key(op) == "attention_bwd" and GPU.host_s(op) == pytest.approx(124e-6)
    fwd = ComputeOp(name="attn_core", kind=OpKind.ATTENTION, flops=1e9, bytes_moved=1e6)
    assert GPU.host_s(fwd) == pytest.approx(72e-6)
    gpu = GPU.with_(host_costs=[HostCost("*", "attention_bwd", 50e-6, "kind"),
                                ("*", "attn_core_bwd", 40e-6, "name"),
                                ("bwd_attn", "attn_core_bwd", 30e-6, "partition")])
    assert gpu.host_s(op, "bwd_attn") == pytest.approx(30e-6)
    assert gpu.host_s(op, "bwd_attn_out_ar") == pytest.approx(40e-6)
    assert GPU.with_(host_costs=[("*", "attention_bwd", 50e-6, "kind")]).host_s(op) == 50e-6
    assert gpu.collective_host_s == pytest.approx(20e-6)


def test_defaults_are_the_middle_of_the_measured_ranges() -> None:
    """Every default that cites data/host_launch_h200.json is the middle of the range (or
    the figure) recorded there."""
    data = json.loads((REPO / "data" / "host_launch_h200.json").read_text())["host_us_per_call"]
    figures = {"gemm": data["cublas_gemm_through_torch"], "attention": data["sdpa_forward"],
               "attention_bwd": data["sdpa_backward"], "rope": data["rope"],
               "norm": data["rmsnorm_forward_liger_kernel"], "elementwise": data["torch.add"]}
    by_kind = {c.op: c for c in DEFAULT_HOST_COSTS}
    for kind, fig in figures.items():
        mid = (fig[0] + fig[1]) / 2 if isinstance(fig, list) else fig
        assert by_kind[kind].host_s == pytest.approx(mid * 1e-6)
        assert "data/host_launch_h200.json" in by_kind[kind].source
    assert by_kind["activation"].host_s == pytest.approx(
        (data["triton_launch_4_args"] + data["torch.empty"]) * 1e-6)
    for c in DEFAULT_HOST_COSTS:
        assert c.source.startswith("estimate") or "data/host_launch_h200.json" in c.source
