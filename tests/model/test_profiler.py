"""The Profiler role: one abstract method, defaults for the rest."""

from __future__ import annotations

import pytest

from kareus.model import (
    ConfigSpace,
    Measurement,
    OutsideWork,
    Partition,
    Profiler,
    ScheduleConfig,
    Workload,
    build_partitions,
    get_gpu,
)


class _Minimal(Profiler):
    """Implements only what the role requires."""

    def __init__(self) -> None:
        self.gpu = get_gpu("h200-sxm")

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        return Measurement(time_s=1e-3, energy_j=1.0, static_power_w=0.0)


def test_measure_is_the_one_abstract_method():
    with pytest.raises(TypeError):
        Profiler()  # type: ignore[abstract]
    assert Profiler.__abstractmethods__ == frozenset({"measure"})


def test_defaults():
    prof = _Minimal()
    assert prof.static_power_w(4) == pytest.approx(4 * prof.gpu.static_power_w)
    with pytest.raises(NotImplementedError, match="cannot measure work outside partitions"):
        prof.measure_outside(OutsideWork(), 1980, group_size=2)
    part = build_partitions(Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2,
                                            seq_len=1024, num_microbatches=2))["fwd_mlp"]
    space = prof.space(part)
    assert isinstance(space, ConfigSpace) and len(space) == len(ConfigSpace(part, prof.gpu))


class _DryClocks(_Minimal):
    """Measures at its default clock alone, and outside work too."""

    def clocks_mhz(self):
        return (1980,)

    def measure_outside(self, work, freq_mhz, *, group_size, comm_sms=None):
        return Measurement(time_s=2e-3, energy_j=2.0, static_power_w=0.0)


def test_a_wrapper_answers_as_its_inner_profiler():
    from kareus.model import ProfilerWrapper
    from kareus.profilers.replay import RecordingProfiler

    inner = _DryClocks()
    part = next(iter(build_partitions(Workload.preset("qwen3-1.7b", tp=2)).types.values()))
    for wrapper in (ProfilerWrapper(inner), RecordingProfiler(inner)):
        assert wrapper.gpu is inner.gpu
        assert wrapper.clocks_mhz() == (1980,)  # a recorder of dry-run clocks says so too
        assert wrapper.static_power_w(4) == inner.static_power_w(4)
        assert wrapper.space(part).freqs_mhz == inner.space(part).freqs_mhz
        assert wrapper.measures_outside_work
    assert ProfilerWrapper(_Minimal()).measures_outside_work is False  # as its inner
    with pytest.raises(TypeError, match="must be a kareus Profiler"):
        ProfilerWrapper(object())
