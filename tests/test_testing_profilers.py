"""The project's own profilers pass the profiler conformance suite."""

import json
from pathlib import Path

import pytest

from kareus.exec.emulator import EmulatedProfiler
from kareus.exec.replay import ReplayProfiler
from kareus.model import Workload, build_partitions
from kareus.testing import FakeProfiler, ProfilerConformance, check_profiler

DATA = Path(__file__).resolve().parent.parent / "data" / "h200_llama3b_tp2_grid.json"


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
            from kareus.model import Measurement

            return Measurement(time_s=1e-3, energy_j=1.0, static_power_w=1.0)

    with pytest.raises(AssertionError, match="rejects_bad_configs"):
        check_profiler(lambda: NoValidation("h200-sxm"))
