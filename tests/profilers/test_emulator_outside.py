"""The emulator on work outside partitions: pipeline sends, cross-node collectives."""

from __future__ import annotations

import pytest

from kareus.model import Workload, build_partitions
from kareus.model.ops import CommKind, CommOp
from kareus.model.partition import OutsideWork
from kareus.profilers.emulator import EmulatedGPU, EmulatedProfiler


def test_pipeline_send_time_and_power() -> None:
    gpu = EmulatedGPU.from_spec("a100-40gb")
    prof = EmulatedProfiler(gpu, noise=0)
    nbytes = 25e6
    m = prof.measure_outside(OutsideWork(p2p_bytes=nbytes, p2p_cross_node=True), 1410,
                             group_size=1)
    want = gpu.network_latency_s + nbytes / (gpu.network_gb_per_s * 1e9)
    assert m.time_s == pytest.approx(want)
    wait_w = gpu.spec.idle_power_w + gpu.uncore_power_w
    assert m.energy_j == pytest.approx(wait_w * want + gpu.link_energy_pj_per_byte * 1e-12
                                       * nbytes)
    # Inside a node the send runs at NVLink's rate: faster.
    near = prof.measure_outside(OutsideWork(p2p_bytes=nbytes), 1410, group_size=1)
    assert near.time_s < m.time_s
    # Energy scales with the GPUs covered.
    m8 = prof.measure_outside(OutsideWork(p2p_bytes=nbytes, p2p_cross_node=True), 1410,
                              group_size=8)
    assert m8.energy_j == pytest.approx(8 * m.energy_j)


def test_cross_node_collectives_use_the_network() -> None:
    prof = EmulatedProfiler("h200-sxm", noise=0)
    ar = CommOp(name="dp", kind=CommKind.ALL_REDUCE, bytes=1 << 30, group_size=4)
    local = prof.measure_outside(OutsideWork(comms=(ar,)), 1980, group_size=1)
    remote = prof.measure_outside(OutsideWork(comms=(ar,), comms_cross_node=True), 1980,
                                  group_size=1)
    gpu = prof.emulated_gpu
    assert remote.time_s == pytest.approx(gpu.network_latency_s
                                          + ar.bus_bytes / (gpu.network_gb_per_s * 1e9))
    assert remote.time_s > 3 * local.time_s  # NIC ~45 GB/s vs NVLink ~300 GB/s


def test_iteration_tail_of_a_workload() -> None:
    wl = Workload.preset("llama3.2-3b", tp=4, pp=2, dp=4, num_microbatches=8)
    pset = build_partitions(wl)
    prof = EmulatedProfiler("h200-sxm", noise=0)
    tail = prof.measure_outside(pset.iteration, 1980, group_size=wl.parallelism.world_size)
    opt = prof.measure_outside(OutsideWork(ops=pset.iteration.ops), 1980,
                               group_size=wl.parallelism.world_size)
    assert tail.time_s > opt.time_s > 0  # the DP reduction adds to the optimizer step


def test_the_emulator_costs_the_model_s_layer_features() -> None:
    import attrs

    from kareus.model import ScheduleConfig

    prof = EmulatedProfiler("a100-40gb", noise=0)
    qwen3 = Workload.preset("qwen3-1.7b", tp=4, cp=2, pp=2, microbatch_size=16)
    plain = qwen3.with_(model=attrs.evolve(qwen3.model, name="plain", qk_norm=False,
                                           tied_embeddings=False))
    a, b = build_partitions(plain), build_partitions(qwen3)
    # qk-norm: the attention input's partition runs RoPE fused with the per-head norms:
    # one kernel with more FLOPs and table reads than RoPE's alone.
    cfg = ScheduleConfig(freq_mhz=1410, comm_sms=9, launch_slot=None)
    slow = prof.measure(b["fwd_attn_in_ag"], cfg)
    fast = prof.measure(a["fwd_attn_in_ag"], cfg)
    assert slow.time_s > fast.time_s and slow.energy_j > fast.energy_j
    # The fused op's slot is a launch point like any other (named after it).
    fused = prof.measure(b["fwd_attn_in_ag"], attrs.evolve(cfg, launch_slot="qk_norm_rope"))
    assert fused.time_s > 0
    # Tied embeddings over two stages: the gradients' all-reduce lengthens the tail.
    world = qwen3.parallelism.world_size
    tail = prof.measure_outside(b.iteration, 1410, group_size=world)
    untied = prof.measure_outside(a.iteration, 1410, group_size=world)
    assert tail.time_s > untied.time_s


def test_collectives_inside_a_node_of_a_job_over_several() -> None:
    # A CP group's gradient reduction on NVLink beside a tied all-reduce over the network.
    prof = EmulatedProfiler("h200-sxm", noise=0)
    rs = CommOp(name="cp_grad_reduce_scatter", kind=CommKind.REDUCE_SCATTER,
                bytes=1 << 30, group_size=2)
    ar = CommOp(name="embedding_grad_all_reduce", kind=CommKind.ALL_REDUCE, bytes=1 << 28,
                group_size=2)
    gpu = prof.emulated_gpu
    near = prof.measure_outside(OutsideWork(comms=(rs,)), 1980, group_size=1)
    mixed = prof.measure_outside(OutsideWork(comms=(rs, ar), comms_cross_node=True,
                                             comms_in_node=(rs.name,)), 1980, group_size=1)
    net = gpu.network_latency_s + ar.bus_bytes / (gpu.network_gb_per_s * 1e9)
    assert mixed.time_s == pytest.approx(near.time_s + net)
    far = prof.measure_outside(OutsideWork(comms=(rs, ar), comms_cross_node=True), 1980,
                               group_size=1)
    assert far.time_s > mixed.time_s  # the same reduce-scatter at the NIC's rate


def test_the_gradient_reduction_over_cp_lengthens_the_tail() -> None:
    # The README's job (TP=4 CP=2 PP=2, DP=1): the gradients' reduce-scatter and the
    # weights' all-gather over the CP group on NVLink, and the step over half the weights.
    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, pp=2, microbatch_size=16)
    work = build_partitions(wl).iteration
    prof = EmulatedProfiler("a100-40gb", noise=0)
    world = wl.parallelism.world_size
    tail = prof.measure_outside(work, 1410, group_size=world)
    rs, tied, ag = work.comms
    parts = [prof.measure_outside(OutsideWork(ops=work.ops), 1410, group_size=world),
             prof.measure_outside(OutsideWork(comms=(rs, ag)), 1410, group_size=world),
             prof.measure_outside(OutsideWork(comms=(tied,), comms_cross_node=True), 1410,
                                  group_size=world)]
    assert tail.time_s == pytest.approx(sum(m.time_s for m in parts), rel=0.02)
    assert parts[1].time_s > 0.5 * parts[0].time_s  # not a rounding error
