"""The microbatch frontier: per-frequency fronts, the joint front, JSON files."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given
from hypothesis import strategies as st

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


def _nb_point(f: int, t: float, e: float, n: int) -> MicrobatchPoint:
    choice = MicrobatchChoice(freq_mhz=f, configs={"attn": ScheduleConfig(f, 8, None)},
                              nanobatches=n)
    return MicrobatchPoint(time_s=t, dynamic_energy_j=e, choice=choice)


_fronts = st.dictionaries(
    st.sampled_from([900, 1200, 1410]),
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=6),
    max_size=3)


@given(split=_fronts, unsplit=_fronts)
def test_union_is_the_pareto_union_and_keeps_each_points_nanobatches(split, unsplit):
    def frontier(fronts, n):
        return MicrobatchFrontier.from_fronts(0, "fwd", {
            f: [_nb_point(f, t / 10, e, n) for t, e in pts] for f, pts in fronts.items()})

    a, b = frontier(split, 2), frontier(unsplit, 1)
    u = MicrobatchFrontier.union([a, b])
    inputs = {f: [*a.at(f), *b.at(f)] for f in {*a.freqs_mhz, *b.freqs_mhz}}
    assert u.freqs_mhz == sorted(inputs, reverse=True)
    for f, pts in inputs.items():
        front = u.at(f)
        assert all(any(p is q for q in pts) for p in front)  # only input points
        for p in pts:  # every input point is weakly dominated by a point kept at f
            assert any(q.time_s <= p.time_s and q.dynamic_energy_j <= p.dynamic_energy_j
                       for q in front)
        for p in front:  # and the kept ones are mutually non-dominated
            assert not any(q is not p and q.time_s <= p.time_s
                           and q.dynamic_energy_j <= p.dynamic_energy_j
                           and (q.time_s, q.dynamic_energy_j) != (p.time_s, p.dynamic_energy_j)
                           for q in front)
    allp = [p for pts in inputs.values() for p in pts]
    for p in allp:
        assert any(q.time_s <= p.time_s and q.dynamic_energy_j <= p.dynamic_energy_j
                   for q in u.points)
    unsplit_ids = {id(p) for f in b.freqs_mhz for p in b.at(f)}
    assert all(p.nanobatches == (1 if id(p) in unsplit_ids else 2) for p in u.points)


def test_union_refuses_nothing_and_other_computations():
    fr = MicrobatchFrontier.from_fronts(0, "fwd", {1410: [_nb_point(1410, 1.0, 1.0, 1)]})
    with pytest.raises(ValueError, match="at least one"):
        MicrobatchFrontier.union([])
    other = MicrobatchFrontier.from_fronts(1, "fwd", {1410: [_nb_point(1410, 1.0, 1.0, 2)]})
    with pytest.raises(ValueError, match="different computations"):
        MicrobatchFrontier.union([fr, other])
    # a tie keeps the earlier frontier's point
    twin = MicrobatchFrontier.from_fronts(0, "fwd", {1410: [_nb_point(1410, 1.0, 1.0, 2)]})
    assert [p.nanobatches for p in MicrobatchFrontier.union([fr, twin])] == [1]
    assert [p.nanobatches for p in MicrobatchFrontier.union([twin, fr])] == [2]


def test_choice_nanobatches_round_trips_through_the_frontier_file(tmp_path):
    fr = MicrobatchFrontier.from_fronts(0, "bwd", {1410: [_nb_point(1410, 1.0, 2.0, 1)],
                                                   1200: [_nb_point(1200, 2.0, 1.0, 2)]})
    path = tmp_path / "mb.json"
    fr.save(path)
    again = MicrobatchFrontier.load(path)
    assert [p.nanobatches for p in again] == [1, 2] and again == fr
