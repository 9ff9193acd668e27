"""Tuning a mixture-of-experts workload on one GPU: the one-GPU stand-ins include the
expert-parallel group (``LoopbackGroups(ep=...)``), beside the TP and CP groups' and
time-faithful too, built before any GPU is touched."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.train import LoopbackGroupCollective, TimedLoopbackGroupCollective
from kareus.model.workload import Workload
from kareus.tune import one_gpu_backends


def _all_to_all(backend) -> None:
    # every rank sends rank 0 what this one does: its first block, cycled over the output
    x = torch.arange(12.0).view(6, 2)
    out = torch.empty(4, 2)
    backend.all_to_all(out, x, [2, 2], [2, 4], None, 8)
    assert torch.equal(out, x[:2].repeat(2, 1))


def test_the_expert_parallel_group_has_a_plain_stand_in():
    wl = Workload.preset("qwen3-30b-a3b", dp=8, ep=8)
    named, default, note = one_gpu_backends(wl)
    ep = named["loopback"].for_group("ep")
    assert isinstance(ep, LoopbackGroupCollective) and ep.world_size == 8
    assert named["loopback"].backend_for("all_to_all") is ep
    _all_to_all(ep)
    assert "loopback" in note


def test_the_expert_parallel_group_beside_tp_has_a_time_faithful_stand_in():
    wl = Workload.preset("qwen3-30b-a3b", tp=2, sp=True, dp=4, ep=8)
    named, default, note = one_gpu_backends(wl, loopback="faithful", gpu="h200-sxm")
    ep = named["loopback"].for_group("ep")
    assert isinstance(ep, TimedLoopbackGroupCollective) and ep.world_size == 8
    assert named["loopback"].for_group("tp").world_size == 2
    _all_to_all(ep)  # on the CPU: the data, and the time it would hold
    (kind, nbytes, sms, secs), = ep.timed
    assert (kind, nbytes, sms) == ("all_to_all", 4 * 2 * 4, 8) and secs > 0
    assert "all_to_all over 8" in note and "STAND-IN" in note
