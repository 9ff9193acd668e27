"""The Profiler role (kareus.model.profiler): the contract's defaults, and every profiler of
the project (and the testing fake) passes the conformance suite (kareus.testing.profiler)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kareus.model import ConfigSpace, Measurement, Profiler, Workload, build_partitions
from kareus.model.config import ScheduleConfig
from kareus.model.gpu import get_gpu
from kareus.model.partition import OutsideWork
from kareus.profilers.emulator import EmulatedProfiler
from kareus.profilers.replay import ReplayProfiler
from kareus.testing import FakeProfiler, ProfilerConformance, check_profiler

DATA = Path(__file__).resolve().parents[2] / "data" / "h200_llama3b_tp2_grid.json"


def _partition():
    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=2, seq_len=1024)
    return build_partitions(wl)["fwd_attn"]


class _Constant(Profiler):
    """The smallest profiler: only measure() is implemented."""

    def __init__(self) -> None:
        self.gpu = get_gpu("h200-sxm")

    def measure(self, partition, config):
        return Measurement(time_s=1e-3, energy_j=1.0, static_power_w=self.static_power_w(4))


def test_the_role_is_abstract_in_measure_only():
    with pytest.raises(TypeError, match="measure"):
        Profiler()  # type: ignore[abstract]
    p = _Constant()
    part = _partition()
    # Defaults: the GPU's static power per GPU, the GPU's full space, no outside work.
    assert p.static_power_w(4) == pytest.approx(4 * p.gpu.static_power_w)
    space = p.space(part)
    assert isinstance(space, ConfigSpace) and space.partition is part
    assert len(space) == len(ConfigSpace(part, p.gpu))
    with pytest.raises(NotImplementedError, match="outside partitions"):
        p.measure_outside(OutsideWork(ops=(), comms=()), 1980, group_size=4)
    cfg = ScheduleConfig(1980, 8, None)
    assert p.measure(part, cfg).time_s == 1e-3


class TestEmulatedProfiler(ProfilerConformance):
    def make_profiler(self):
        return EmulatedProfiler("h200-sxm", seed=0)


class TestFakeProfiler(ProfilerConformance):
    def make_profiler(self):
        return FakeProfiler("a100-40gb", noise=0.01, seed=0)


@pytest.mark.skipif(not DATA.is_file(), reason="measured grid not in the checkout")
def test_replay_profiler_conforms_on_measured_grid():
    data = json.loads(DATA.read_text())
    w = data["workload"]
    wl = Workload.preset(w["model"], tp=w["tp"], microbatch_size=w["microbatch_size"],
                         seq_len=w["seq_len"], nanobatches=w["nanobatches"])
    part = build_partitions(wl)["fwd_attn"]
    check_profiler(lambda: ReplayProfiler(DATA), partition=part)


def test_a_broken_profiler_is_caught():
    class NoValidation(EmulatedProfiler):
        def measure(self, partition, config):
            return Measurement(time_s=1e-3, energy_j=1.0, static_power_w=1.0)

    with pytest.raises(AssertionError, match="rejects_bad_configs"):
        check_profiler(lambda: NoValidation("h200-sxm"))
