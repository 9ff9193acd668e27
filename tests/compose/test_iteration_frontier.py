"""The iteration frontier: Pareto filtering, selection under one constraint, JSON files."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.compose import IterationFrontier, IterationPoint, MicrobatchFrontier
from kareus.errors import PlanError


def test_frontiers_round_trip_through_json(composed, tmp_path):
    fr = composed["kareus"]
    path = tmp_path / "frontier.json"
    fr.save(path)
    again = IterationFrontier.load(path)
    assert np.array_equal(again.array(), fr.array())
    assert [p.plan.digest for p in again] == [p.plan.digest for p in fr]
    mf = composed.microbatch["kareus"][(1, "bwd")]
    mf2 = MicrobatchFrontier.from_json(mf.to_json())
    assert mf2.points == mf.points and mf2.by_freq == mf.by_freq
    with pytest.raises(PlanError, match="not a kareus iteration frontier"):
        IterationFrontier.from_json(mf.to_json())
    with pytest.raises(PlanError, match="not valid JSON"):
        IterationFrontier.from_json("{")


def test_from_points_keeps_the_pareto_points_fastest_first(composed):
    pts = list(composed["kareus"].points)
    plan = pts[0].plan
    # A dominated point and an exact tie in time are dropped; order does not matter.
    extra = [IterationPoint(time_s=pts[0].time_s * 2, energy_j=pts[0].energy_j * 2, plan=plan),
             IterationPoint(time_s=pts[0].time_s, energy_j=pts[0].energy_j * 1.5, plan=plan)]
    fr = IterationFrontier.from_points(list(reversed(pts)) + extra, label="x",
                                       stats={"a": 1})
    assert [p.time_s for p in fr] == [p.time_s for p in pts]
    assert fr.label == "x" and fr.stats == {"a": 1}
    assert fr[0] is pts[0] and len(fr) == len(pts)


def test_points_must_be_a_sorted_front(composed):
    a, b = composed["kareus"].points[:2]
    with pytest.raises(ValueError, match="strictly faster-and-costlier"):
        IterationFrontier(points=[b, a])


def test_hypervolume_and_empty_frontier(composed):
    fr = composed["kareus"]
    ref = fr.array().max(axis=0) * 1.1
    assert fr.hypervolume(ref) > 0
    empty = IterationFrontier.from_points([], label="none")
    assert len(empty) == 0 and "empty" in repr(empty)
    with pytest.raises(ValueError, match="empty"):
        empty.max_throughput()
    assert empty.array().shape == (0, 2)
