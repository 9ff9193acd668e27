"""Why a wrong static power cannot explain a one-stage job's composed energy missing the
measured one (issue 36: ``kareus verify`` measured 5-9% more energy than composed on 1x
H200, with the times within 3%).

Each partition measurement is a total energy ``E`` over its time ``t``; composition keeps
``E - P x t`` (dynamic) and adds ``P x T`` back for the iteration, ``P`` the static power.
With one pipeline stage nothing idles, ``T`` is the sum of the ``t``, and ``P`` cancels: the
composed total is the sum of the measured totals whatever ``P`` is (only the static/dynamic
split moves). With several stages the bubbles are idle time, charged at ``P``: there it
matters. So for one stage a static power measured at idle (cooler, lower than under load)
is not a cause of a total-energy miss; what was measured is.
"""

from __future__ import annotations

import pytest

from kareus.model.measurement import Measurement
from kareus.model.profiler import ProfilerWrapper
from kareus.model.workload import Workload
from kareus.profilers import EmulatedProfiler
from kareus.workflow import compose_systems


class _StaticRelabelled(ProfilerWrapper):
    """The same measured times and total energies, with another static power per GPU."""

    def __init__(self, inner, per_gpu_w: float) -> None:
        super().__init__(inner)
        self.per_gpu_w = per_gpu_w

    def _relabel(self, m: Measurement, gpus: int) -> Measurement:
        return Measurement(time_s=m.time_s, energy_j=m.energy_j,
                           static_power_w=self.per_gpu_w * gpus)

    def measure(self, partition, config):
        return self._relabel(self.inner.measure(partition, config), partition.group_gpus)

    def measure_outside(self, work, freq_mhz, *, group_size, comm_sms=None):
        return self._relabel(self.inner.measure_outside(work, freq_mhz, group_size=group_size,
                                                        comm_sms=comm_sms), group_size)

    def static_power_w(self, group_size: int) -> float:
        return self.per_gpu_w * group_size


def _megatron(wl: Workload, per_gpu_w: float):
    prof = _StaticRelabelled(EmulatedProfiler("h200-sxm", noise=0.0, seed=0), per_gpu_w)
    res = compose_systems(wl, prof, systems=["megatron"], freqs_mhz=[1980])
    return res["megatron"].max_throughput()


@pytest.mark.parametrize("pp", [1, 2])
def test_static_power_moves_the_total_only_through_idle_pipeline_time(pp):
    wl = Workload.preset("qwen3-1.7b", tp=2, pp=pp, microbatch_size=1, seq_len=512,
                         num_microbatches=4)
    low, high = _megatron(wl, 60.0), _megatron(wl, 180.0)
    assert low.time_s == high.time_s
    assert high.energy_j - high.dynamic_energy_j > low.energy_j - low.dynamic_energy_j
    if pp == 1:  # nothing idles: the totals are the measured totals
        assert high.energy_j == pytest.approx(low.energy_j, rel=1e-12)
    else:  # the bubbles idle at the static power
        assert high.energy_j > low.energy_j * 1.001
