"""Tuning a mixture-of-experts workload on one GPU: what the one-GPU stand-ins cannot do
for the expert-parallel group yet is refused in one line, before any GPU is touched."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kareus.errors import ArgumentError
from kareus.model.workload import Workload
from kareus.tune import one_gpu_backends


def test_faithful_loopback_refuses_the_expert_parallel_all_to_all():
    wl = Workload.preset("qwen3-30b-a3b", dp=8, ep=8)
    with pytest.raises(ArgumentError, match="no time-faithful stand-in for the "
                       "expert-parallel all-to-all yet") as err:
        one_gpu_backends(wl, loopback="faithful", gpu="h200-sxm")
    assert "\n" not in str(err.value)


def test_ep_beside_tp_on_one_gpu_is_refused():
    wl = Workload.preset("qwen3-30b-a3b", tp=2, sp=True, dp=4, ep=8)
    with pytest.raises(ArgumentError, match="--ep with --tp or --cp above 1"):
        one_gpu_backends(wl)
