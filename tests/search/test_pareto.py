import itertools

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.search.pareto import (
    hypervolume,
    hypervolume_improvement,
    pareto_front,
    pareto_mask,
    reference_point,
)

coords = st.floats(min_value=0.0, max_value=1.0, allow_nan=False, width=32)
point_lists = st.lists(st.tuples(coords, coords), min_size=0, max_size=25)
REF = np.array([1.5, 1.5])


def _brute_mask(p):
    n = len(p)
    mask = np.ones(n, dtype=bool)
    for i, j in itertools.product(range(n), range(n)):
        if i != j and np.all(p[j] <= p[i]) and np.any(p[j] < p[i]):
            mask[i] = False
    return mask


def _brute_hv(points, ref, grid=None):
    # Exact area of the union of rectangles by coordinate compression.
    p = np.asarray(points).reshape(-1, 2)
    p = p[(p[:, 0] < ref[0]) & (p[:, 1] < ref[1])]
    if len(p) == 0:
        return 0.0
    xs = np.unique(np.append(p[:, 0], ref[0]))
    area = 0.0
    for a, b in zip(xs[:-1], xs[1:]):
        ymin = p[p[:, 0] <= a][:, 1].min()
        area += (b - a) * (ref[1] - ymin)
    return area


@given(point_lists)
def test_front_is_mutually_nondominated_and_matches_brute_force(pts):
    p = np.array(pts, dtype=float).reshape(-1, 2)
    mask = pareto_mask(p)
    front = p[mask]
    for a, b in itertools.permutations(range(len(front)), 2):
        assert not (np.all(front[a] <= front[b]) and np.any(front[a] < front[b]))
    # Every point is either on the front or dominated by (or equal to) a front point.
    for q in p:
        assert np.any(np.all(front <= q, axis=1))
    unique_brute = {tuple(x) for x in p[_brute_mask(p)]}
    assert {tuple(x) for x in front} == unique_brute


@given(point_lists)
def test_hypervolume_matches_brute_force(pts):
    p = np.array(pts, dtype=float).reshape(-1, 2)
    assert hypervolume(p, REF) == pytest.approx(_brute_hv(p, REF), abs=1e-12)


@given(point_lists, st.tuples(coords, coords))
def test_adding_dominated_point_keeps_hypervolume(pts, extra):
    p = np.array(pts, dtype=float).reshape(-1, 2)
    if len(p) == 0:
        return
    anchor = p[0]
    dominated = anchor + np.abs(np.array(extra)) * 0.1
    assert hypervolume(np.vstack([p, dominated]), REF) == pytest.approx(hypervolume(p, REF))


@settings(max_examples=200)
@given(point_lists, st.lists(st.tuples(coords, coords), min_size=1, max_size=10))
def test_improvement_equals_hypervolume_difference(front, cands):
    f = np.array(front, dtype=float).reshape(-1, 2)
    c = np.array(cands, dtype=float)
    base = hypervolume(f, REF)
    expected = [hypervolume(np.vstack([f, ci[None]]), REF) - base for ci in c]
    got = hypervolume_improvement(c, f, REF)
    assert np.all(got >= 0)
    assert got == pytest.approx(expected, abs=1e-12)


def test_small_cases_by_hand():
    pts = [(1, 3), (2, 2), (3, 1), (3, 3)]
    assert pareto_front(pts).tolist() == [[1, 3], [2, 2], [3, 1]]
    assert hypervolume(pts, (4, 4)) == pytest.approx(1 * 1 + 1 * 2 + 1 * 3)
    assert hypervolume_improvement([(1, 1), (5, 5)], pts, (4, 4)).tolist() == [3.0, 0.0]
    assert reference_point(pts, margin=0.5).tolist() == [4.5, 4.5]
    with pytest.raises(ValueError):
        pareto_mask(np.zeros((3, 3)))
    with pytest.raises(ValueError):
        pareto_mask([(np.nan, 1.0)])
