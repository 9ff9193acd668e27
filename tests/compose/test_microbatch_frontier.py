"""The microbatch frontier: per-frequency fronts, the joint front, JSON files."""

from __future__ import annotations

import json

import pytest

from kareus.compose import MicrobatchChoice, MicrobatchFrontier, MicrobatchPoint
from kareus.errors import PlanError
from kareus.model.config import ScheduleConfig


def _point(f: int, t: float, e: float, sms: int = 8, predicted: bool = False) -> MicrobatchPoint:
    choice = MicrobatchChoice(freq_mhz=f, configs={"attn": ScheduleConfig(f, sms, None)},
                              predicted=predicted)
    return MicrobatchPoint(time_s=t, dynamic_energy_j=e, choice=choice)


@pytest.fixture
def frontier() -> MicrobatchFrontier:
    return MicrobatchFrontier.from_fronts(1, "bwd", {
        1200: [_point(1200, 2.0, 5.0, 8), _point(1200, 1.5, 6.0, 16)],
        1410: [_point(1410, 1.0, 9.0, 8), _point(1410, 1.2, 8.0, 4, predicted=True)],
        900: [],
    })


def test_joint_front_and_per_frequency_fronts(frontier):
    assert frontier.freqs_mhz == [1410, 1200]  # descending, empty fronts dropped
    assert [p.time_s for p in frontier.at(1200)] == [1.5, 2.0]  # fastest first
    assert frontier.at(900) == ()
    times = [p.time_s for p in frontier]
    energies = [p.dynamic_energy_j for p in frontier]
    assert times == sorted(times) and energies == sorted(energies, reverse=True)
    assert len(frontier) == 4
    assert frontier.points[0].freq_mhz == 1410
    assert sum(p.predicted for p in frontier) == 1


def test_dominated_points_leave_the_joint_front():
    fr = MicrobatchFrontier.from_fronts(0, "fwd", {
        1410: [_point(1410, 1.0, 5.0)],
        1200: [_point(1200, 1.1, 6.0), _point(1200, 1.0, 5.0, 16)],  # dominated, duplicate
    })
    assert len(fr) == 1
    assert fr.points[0].choice.freq_mhz == 1410  # of exact duplicates, the first is kept


def test_json_round_trip(frontier, tmp_path):
    path = tmp_path / "mb.json"
    frontier.save(path)
    again = MicrobatchFrontier.load(path)
    assert again.points == frontier.points and again.by_freq == frontier.by_freq
    assert (again.stage, again.phase) == (1, "bwd")
    assert "stage 1 bwd" in repr(frontier) and "1 predicted" in repr(frontier)


def test_bad_files_raise_plan_error(frontier):
    d = frontier.to_dict()
    with pytest.raises(PlanError, match="version"):
        MicrobatchFrontier.from_dict({**d, "version": 99})
    with pytest.raises(PlanError, match="not a kareus microbatch frontier"):
        MicrobatchFrontier.from_dict({**d, "kind": "iteration_frontier"})
    with pytest.raises(PlanError, match="malformed microbatch frontier"):
        MicrobatchFrontier.from_dict({**d, "by_freq": {"1410": [{"time_s": 1.0}]}})
    with pytest.raises(PlanError, match="not valid JSON"):
        MicrobatchFrontier.from_json("[")
    assert json.loads(frontier.to_json())["kind"] == "microbatch_frontier"


def test_empty_frontier_repr():
    fr = MicrobatchFrontier.from_fronts(0, "fwd", {})
    assert len(fr) == 0 and "empty" in repr(fr)
