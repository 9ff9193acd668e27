"""kareus.profilers.collective_times: the collective times the time-faithful one-GPU
stand-in holds, from the H200 profile's measured curves (groups of 2 and 4) or the
emulator's link model (other group sizes, other GPUs), each saying which."""

from __future__ import annotations

import pytest

pytest.importorskip("attrs")

from kareus.errors import ArgumentError
from kareus.exec.train import CollectiveTimes
from kareus.model.ops import CommOp
from kareus.profilers import EmulatedCollectiveTimes, EmulatedGPU

MIB = 1 << 20


def test_measured_curves_where_the_profile_has_them():
    t = EmulatedCollectiveTimes("h200-sxm")
    assert isinstance(t, CollectiveTimes) and t.profile is not None
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for g in (2, 4):
            for backend in ("nccl", "own"):
                assert t.measured(kind, g, backend=backend)
                assert "MEASURED" in t.source(kind, g, backend=backend)
        assert not t.measured(kind, 8, backend="nccl")
        src = t.source(kind, 8, backend="nccl")
        assert "link model" in src and "nearest measured group of 4" in src


def test_the_time_is_the_emulated_collectives_without_its_launch():
    t = EmulatedCollectiveTimes("h200-sxm")
    g = EmulatedGPU.from_profile("h200-sxm", comm_backend="nccl")
    op = CommOp(name="x", kind="all_reduce", bytes=64 * MIB, group_size=4)
    assert t.time_s("all_reduce", 64 * MIB, 4, 8, backend="nccl") == pytest.approx(
        g.comm_time_s(op, 8, g.spec.max_clock_mhz) - g.launch_overhead_s)
    # more SMs: faster, until the link limit; more bytes: slower
    times = [t.time_s("all_reduce", 64 * MIB, 4, s, backend="nccl") for s in (2, 4, 8, 16)]
    assert times == sorted(times, reverse=True) and times[0] > 3 * times[-1]
    assert (t.time_s("all_gather", 128 * MIB, 2, 8, backend="own")
            > t.time_s("all_gather", 64 * MIB, 2, 8, backend="own"))
    # an uncapped collective takes the GPU's default CTA count
    assert t.sms_for(None) == g.spec.default_comm_sms
    assert t.time_s("reduce_scatter", MIB, 2, None, backend="nccl") == pytest.approx(
        t.time_s("reduce_scatter", MIB, 2, g.spec.default_comm_sms, backend="nccl"))
    # 64 MiB all-reduce over 4 H200s on 16 SMs: a few hundred microseconds
    assert 100e-6 < t.time_s("all_reduce", 64 * MIB, 4, 16, backend="nccl") < 1e-3


def test_without_a_profile_it_is_the_link_model_and_says_so():
    t = EmulatedCollectiveTimes("h200-sxm", profile=False)
    assert t.profile is None and not t.measured("all_reduce", 4, backend="nccl")
    assert "link model" in t.source("all_reduce", 4, backend="nccl")
    a100 = EmulatedCollectiveTimes("a100-40gb")
    assert "link model" in a100.source("all_gather", 2, backend="own")
    assert "no measured profile" in a100.describe()
    with pytest.raises(ArgumentError, match="backend"):
        t.time_s("all_reduce", MIB, 2, 4, backend="mscclpp")
    with pytest.raises(ArgumentError, match="freq_mhz"):
        EmulatedCollectiveTimes("h200-sxm", freq_mhz=0)
