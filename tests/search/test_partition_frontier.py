"""PartitionFrontier: measured Pareto points, per-frequency fronts, predicted points, JSON."""

from __future__ import annotations

import pytest

from kareus.model import Measurement, ScheduleConfig
from kareus.search import Observation, PartitionFrontier


def obs(freq: int, sms: int, time_s: float, energy_j: float, *, static_w: float = 100.0,
        predicted: bool = False) -> Observation:
    return Observation(config=ScheduleConfig(freq, sms, "qkv"),
                       measurement=Measurement(time_s=time_s, energy_j=energy_j,
                                               static_power_w=static_w),
                       predicted=predicted)


@pytest.fixture
def frontier() -> PartitionFrontier:
    return PartitionFrontier.from_observations("fwd_attn", "a100-40gb", [
        obs(1410, 4, 1.0, 300.0),   # fastest
        obs(1410, 8, 1.1, 320.0),   # dominated by the first
        obs(1200, 4, 1.2, 250.0),   # slower, less energy
        obs(1200, 8, 1.3, 260.0),   # dominated in total energy, not in dynamic at 1200
        obs(990, 4, 0.9, 100.0, predicted=True),  # a prediction: never a measured point
    ])


def test_observation_delegates_to_its_measurement():
    o = obs(1410, 4, 2.0, 500.0, static_w=100.0)
    assert (o.time_s, o.energy_j, o.dynamic_energy_j) == (2.0, 500.0, 300.0)
    assert Observation.from_dict(o.to_dict()) == o
    assert Observation.from_dict({k: v for k, v in o.to_dict().items()
                                  if k != "predicted"}).predicted is False


def test_points_are_the_measured_front_fastest_first(frontier):
    assert len(frontier.measured()) == 4
    assert [(o.time_s, o.energy_j) for o in frontier.points] == [(1.0, 300.0), (1.2, 250.0)]
    assert frontier.freqs_mhz == [1410, 1200]  # 990 only predicted


def test_front_at_one_frequency(frontier):
    # At 1200 MHz in (time, dynamic energy): 1.2 s / 130 J and 1.3 s / 130 J; the first
    # dominates. In total energy the same.
    assert [o.config.comm_sms for o in frontier.front_at(1200)] == [4]
    assert [o.config.comm_sms for o in frontier.front_at(1410, energy="total")] == [4]
    assert frontier.front_at(990) == []
    assert [o.time_s for o in frontier.front_at(990, include_predicted=True)] == [0.9]
    with pytest.raises(ValueError, match="energy"):
        frontier.front_at(1410, energy="static")


def test_json_round_trip_and_repr(frontier):
    again = PartitionFrontier.from_dict(frontier.to_dict())
    assert again == frontier
    assert isinstance(again.observations, tuple)
    text = repr(frontier)
    assert "fwd_attn" in text and "4 measured, 2 Pareto points" in text
    empty = PartitionFrontier.from_observations("fwd_attn", "a100-40gb", [])
    assert empty.points == [] and "no measurements" in repr(empty)
