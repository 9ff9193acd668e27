"""What the NVML profiler offers a tuning run (kareus.profilers.nvml._profiler): its clocks (set
per candidate only by a controller that changes clocks, else the default clock alone), its
backends as a dimension of the space, and the work outside partitions; on a fake NVML."""

from __future__ import annotations

import pytest
from fake_nvml import FakeNVML
from test_nvml_profiler import PART, make

from kareus.errors import HardwareError
from kareus.exec.frequency import DryRunFrequencyController, NVMLFrequencyController
from kareus.model.config import ScheduleConfig
from kareus.model.gpu import get_gpu
from kareus.model.partition import OutsideWork, build_partitions
from kareus.model.workload import Workload

H200 = get_gpu("h200-sxm")


@pytest.mark.parametrize("controller", [None, "dry-run"])
def test_without_clock_control_only_the_default_clock_is_measured(controller):
    ctrl = DryRunFrequencyController(gpu=H200) if controller else None
    prof, *_ = make(frequency=ctrl)
    try:
        assert not prof.clocks_controlled
        assert prof.freqs_mhz == prof.clocks_mhz() == (1980,)
        assert "not controlled" in prof.clock_note and "1980 MHz" in prof.clock_note
        space = prof.space(PART)
        assert space.freqs_mhz == (1980,) and space.backends == (None,)
        prof.measure(PART, ScheduleConfig(1980, 4, "mm"))
        with pytest.raises(HardwareError, match="cannot measure at 1500 MHz"):
            prof.measure(PART, ScheduleConfig(1500, 4, "mm"))
    finally:
        prof.close()
    assert ctrl is None or ctrl.requests == []  # nothing was ever asked of the clocks


def test_a_clock_controller_opens_the_frequency_dimension_and_gives_the_clock_back():
    nvml = FakeNVML(period_s=0.02)
    ctrl = NVMLFrequencyController(device_indices=[0], nvml=nvml, gpu=H200,
                                   handle_signals=False)
    prof, *_ = make(nvml, frequency=ctrl, freqs_mhz=[1980, 1500, 1215])
    try:
        assert prof.clocks_controlled and prof.freqs_mhz == (1980, 1500, 1215)
        assert prof.space(PART).freqs_mhz == (1980, 1500, 1215)
        prof.measure(PART, ScheduleConfig(1500, 4, "mm"))
        assert nvml.devices[0].locked == (1500, 1500)
        prof.measure(PART, ScheduleConfig(1215, 4, "mm"))
        assert nvml.devices[0].locked == (1215, 1215)
    finally:
        prof.close()
    assert nvml.devices[0].locked is None  # restored by close()
    ctrl.close()


def test_several_backends_are_a_dimension_of_the_space():
    prof, *_ = make(backends=["own", "nccl_capped"], comm_sms=[4, 8])
    one, *_ = make(backends=["nccl_capped"], comm_sms=[4, 8])
    try:
        space = prof.space(PART)
        assert space.backends == ("own", "nccl_capped")
        assert len(space) == 2 * len(one.space(PART))
        assert {c.backend for c in space.configs} == {"own", "nccl_capped"}
        assert space.features().shape[1] == 6
        assert one.space(PART).backends == (None,)  # one backend: no dimension
    finally:
        prof.close()
        one.close()


def test_outside_work_is_measured_through_its_runnable_once_built():
    work = build_partitions(Workload.preset("llama3.2-3b", tp=2, microbatch_size=2,
                                            seq_len=1024)).outside[(0, "fwd")]
    built: list = []

    def outside(w: OutsideWork, sms):
        built.append((w, sms))
        return PART  # the fake runner runs any partition

    prof, *_ = make(outside=outside)
    try:
        a = prof.measure_outside(work, 1980, group_size=2)
        b = prof.measure_outside(work, 1980, group_size=2)
        assert a.time_s > 0 and b.energy_j > 0
        assert built == [(work, None)]
        a1 = prof.measure_outside(work, 1980, group_size=1)  # this profiler's group: as measured
        assert a1.energy_j == prof.records[-1].measurement.energy_j
        assert (prof.records[-1].measured_gpus, prof.records[-1].scope_gpus) == (1, 1)
        # Asked for over 4 GPUs (one measured here): scaled to their scope, once
        c = prof.measure_outside(work, 1980, group_size=4)
        assert (prof.records[-1].measured_gpus, prof.records[-1].scope_gpus) == (1, 4)
        assert c.energy_j == prof.records[-1].measurement.energy_j
        assert c.energy_j / c.time_s == pytest.approx(4 * a1.energy_j / a1.time_s, rel=0.1)
        assert c.static_power_w == pytest.approx(4 * prof.static_power_w(1))
        assert prof.records[-1].config == ScheduleConfig(1980, H200.default_comm_sms, None)
    finally:
        prof.close()
    bare, *_ = make()
    try:
        with pytest.raises(NotImplementedError):
            bare.measure_outside(work, 1980, group_size=2)
    finally:
        bare.close()
