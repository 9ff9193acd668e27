"""What the two frontier levels share: the Pareto filter over points, file checks."""

from __future__ import annotations

import pytest

from kareus.compose._frontier_common import FRONTIER_VERSION, check_kind, loads, pareto_points
from kareus.errors import PlanError


def test_pareto_points_sorted_by_time_first_duplicate_kept():
    pts = [("a", 3.0, 1.0), ("b", 1.0, 3.0), ("c", 2.0, 2.0), ("d", 2.0, 2.0), ("e", 2.5, 2.5),
           ("f", 1.0, 4.0)]
    kept = pareto_points(pts, lambda p: (p[1], p[2]))
    assert [p[0] for p in kept] == ["b", "c", "a"]
    assert pareto_points([], lambda p: (0.0, 0.0)) == ()


def test_file_checks():
    check_kind({"kind": "iteration_frontier", "version": FRONTIER_VERSION}, "iteration_frontier")
    with pytest.raises(PlanError, match="not a kareus iteration frontier file"):
        check_kind({"kind": "plan"}, "iteration_frontier")
    with pytest.raises(PlanError, match="version 0 is not supported"):
        check_kind({"kind": "iteration_frontier", "version": 0}, "iteration_frontier")
    assert loads('{"a": 1}') == {"a": 1}
    with pytest.raises(PlanError, match="not valid JSON"):
        loads("{")
