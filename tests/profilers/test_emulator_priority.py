"""The collective's stream priority in the emulator (EmulatedGPU.comm_priority): at "high"
(default) a collective launched with op k starts with op k; at "normal" once op k's blocks
are all dispatched, taken as op k's end."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

from kareus.model import ScheduleConfig, Workload, build_partitions
from kareus.model.ops import CommKind, CommOp, ComputeOp, OpKind
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler
from kareus.profilers.emulator._opmodel import _prep_op
from kareus.profilers.emulator._sim import _collective, _Sim

GPU = EmulatedGPU.from_spec("h200-sxm", comm_backend="nccl")
NORMAL = GPU.with_(comm_priority="normal")
OPS = [ComputeOp(name="norm", kind=OpKind.NORM, flops=2e8, bytes_moved=2e8),
       ComputeOp(name="gemm", kind=OpKind.GEMM, flops=4e11, bytes_moved=6e7),
       ComputeOp(name="act", kind=OpKind.ELEMENTWISE, flops=1e8, bytes_moved=1.5e8)]
AR = CommOp(name="ar", kind=CommKind.ALL_REDUCE, bytes=2**26, group_size=2)
# The measured 2x H200 grids' fwd_mlp: mlp_norm, gate, up, swiglu, down (GEMMs of 1536-2048
# output tiles of 128x256 on 132 SMs: they fill the GPU for many waves).
MLP = build_partitions(Workload.preset("llama3.2-3b", tp=2, microbatch_size=8, seq_len=4096,
                                       nanobatches=2))["fwd_mlp"]


def _run(gpu: EmulatedGPU, start: int | None) -> tuple[float, float, dict]:
    sim = _Sim(gpu, [_prep_op(gpu, o) for o in OPS])
    t, e, d = sim.run(1980, [_collective(gpu, AR, 16, start)], detail=True)
    assert d is not None
    return t, e, d


def test_high_is_the_default_and_unchanged() -> None:
    assert EmulatedGPU.from_spec("h200-sxm").comm_priority == "high"
    assert EmulatedProfiler("h200-sxm").comm_priority == "high"
    explicit = EmulatedGPU.from_spec("h200-sxm", comm_backend="nccl", comm_priority="high")
    assert explicit == GPU
    cfg = ScheduleConfig(1980, 16, "gate")
    plain = EmulatedProfiler(GPU, noise=0.0)
    keyword = EmulatedProfiler(GPU, noise=0.0, comm_priority="high")
    assert keyword.ground_truth(MLP, cfg) == plain.ground_truth(MLP, cfg)  # bit-identical
    # At high priority the collective starts with its slot's op (gate: after mlp_norm).
    tr = plain.trace(MLP, cfg)
    assert tr.comm_start_s == pytest.approx(tr.op_times_s[0], rel=1e-12)
    # A value stored when the priority was added (the emulator as of then, high priority,
    # with its 3-us gap per kernel; the graph-fed default since has 2 us: 5 kernels, 5 us).
    then = EmulatedProfiler(GPU.with_(launch_overhead_s=3e-6), noise=0.0)
    assert then.ground_truth(MLP, cfg).time_s == pytest.approx(2.0566377541168324e-3,
                                                               rel=1e-9)
    assert plain.ground_truth(MLP, cfg).time_s == pytest.approx(2.0566377541168324e-3 - 5e-6,
                                                                rel=1e-9)


def test_normal_delays_a_collective_launched_with_a_gpu_filling_gemm() -> None:
    cfg = ScheduleConfig(1980, 16, "gate")
    high = EmulatedProfiler(GPU, noise=0.0).trace(MLP, cfg)
    normal = EmulatedProfiler(GPU, noise=0.0, comm_priority="normal").trace(MLP, cfg)
    assert high.comm_start_s is not None and normal.comm_start_s is not None
    assert normal.comm_start_s > high.comm_start_s
    # The gate GEMM's blocks go first: the collective starts at its end (the many-wave
    # limit of its last wave), as if launched with the next op at high priority.
    gate_end = sum(normal.op_times_s[:2])
    assert normal.comm_start_s == pytest.approx(gate_end, rel=1e-12)
    at_up = EmulatedProfiler(GPU, noise=0.0).ground_truth(MLP, ScheduleConfig(1980, 16, "up"))
    assert EmulatedProfiler(NORMAL, noise=0.0).ground_truth(MLP, cfg) == at_up


def test_normal_with_the_last_op_is_sequential() -> None:
    prof = EmulatedProfiler(NORMAL, noise=0.0)
    last = prof.trace(MLP, ScheduleConfig(1980, 16, "down"))
    seq = prof.trace(MLP, ScheduleConfig(1980, 16, None))
    assert last.comm_start_s == pytest.approx(last.compute_end_s, rel=1e-12)
    assert last.time_s == pytest.approx(seq.time_s, rel=1e-12)
    assert last.energy_j == pytest.approx(seq.energy_j, rel=1e-12)
    # At high priority the same slot overlaps the last GEMM and is shorter.
    high = EmulatedProfiler(GPU, noise=0.0).trace(MLP, ScheduleConfig(1980, 16, "down"))
    assert high.time_s < last.time_s
    # The simulation alone: a collective launched with the last op runs after it.
    t_last, e_last, _ = _run(NORMAL, len(OPS) - 1)
    t_seq, e_seq, _ = _run(NORMAL, None)
    assert (t_last, e_last) == (t_seq, e_seq)


def test_normal_with_a_short_op_starts_after_it() -> None:
    _, _, high = _run(GPU, 0)
    _, _, normal = _run(NORMAL, 0)
    assert high["comm_start_s"] == 0.0
    norm_s = normal["op_times_s"][0]
    assert 0.0 < norm_s < 0.1 * sum(normal["op_times_s"])  # a short memory-bound op
    assert normal["comm_start_s"] == pytest.approx(norm_s, rel=1e-12)


def test_the_setting_is_validated_and_passed_through() -> None:
    with pytest.raises(ValueError, match="comm_priority"):
        GPU.with_(comm_priority="low")
    with pytest.raises(ValueError, match="comm_priority"):
        EmulatedProfiler(GPU, comm_priority="urgent")
    assert EmulatedGPU.from_spec("h200-sxm", comm_priority="normal").comm_priority == "normal"
    assert EmulatedGPU.preset("h200-sxm", comm_priority="normal").comm_priority == "normal"
    cal = EmulatedGPU.from_profile("h200-sxm", comm_backend="nccl", comm_priority="normal")
    assert cal.comm_priority == "normal" and "normal" not in cal.calibration
    # The profiler's own keyword wins over the GPU's; None keeps the GPU's.
    assert EmulatedProfiler(NORMAL).comm_priority == "normal"
    assert EmulatedProfiler(NORMAL, comm_priority="high").comm_priority == "high"
    assert EmulatedProfiler("h200-sxm", comm_priority="normal").emulated_gpu.comm_priority == (
        "normal")


def test_the_run_manifest_names_normal_priority_only() -> None:
    assert "comm_priority" not in EmulatedProfiler(GPU).identity()
    ident = EmulatedProfiler(GPU, comm_priority="normal").identity()
    assert ident["comm_priority"] == "normal"


def test_measured_data_are_emulated_at_the_priority_they_ran_with() -> None:
    from kareus.profilers.emulator import measured_priority

    assert measured_priority({}) == ("normal", "not recorded: the data predate the option "
                                               "(normal)")
    assert measured_priority({}, "measured")[0] == "normal"
    assert measured_priority({"comm_priority": "high"}) == ("high", "recorded in the data")
    assert measured_priority({"comm_priority": "high"}, "normal") == ("normal",
                                                                       "--comm-priority")
    for bad in ({"comm_priority": "low"}, ):
        with pytest.raises(ValueError, match="comm_priority"):
            measured_priority(bad)
    with pytest.raises(ValueError, match="comm_priority"):
        measured_priority({}, "urgent")


def test_fidelity_bench_emulates_a_grid_at_its_priority() -> None:
    fid = load_bench("emulator_fidelity")
    grid = fid.REPO / "data" / "h200_llama3b_tp2_grid13.json"
    if not grid.exists():
        pytest.skip("needs the measured grid in data/")
    normal = fid.evaluate_grid(grid, "h200-sxm")
    high = fid.evaluate_grid(grid, "h200-sxm", comm_priority="high")
    assert (normal["comm_priority"], high["comm_priority"]) == ("normal", "high")
    # Measured at normal priority: the rule ranks fwd_mlp's overlapped configurations
    # closer to the measurement than the emulator at high priority does.
    rho = {k: r["partitions"]["fwd_mlp"]["spearman_time_overlapped"]
           for k, r in (("normal", normal), ("high", high))}
    assert rho["normal"] > rho["high"] + 0.05


def test_calibration_emulates_the_probe_at_normal_priority() -> None:
    import json

    ec = load_bench("probes/emulator_calibration")
    if not ec.DATA.exists():
        pytest.skip("needs the measured probe in data/")
    data = json.loads(ec.DATA.read_text())
    err = {}
    for p in ("high", "normal"):
        rows, _ = ec.probe_rows(GPU.with_(comm_priority=p), data, 32)
        err[p] = {(r["cap"], r["mode"]): r["time_rel_err"] for r in rows}
    # seq is unaffected; the all-reduce launched with the first GEMM at 2 CTAs (on the
    # critical path) starts later at normal priority, closer to the measured time.
    assert err["normal"][(4, "seq")] == err["high"][(4, "seq")]
    assert abs(err["normal"][(2, "with_gemm")]) < abs(err["high"][(2, "with_gemm")])
