"""Pareto fronts and hypervolume in two objectives, both minimised (time, energy).

The *front* of a set of points is its non-dominated subset: a point dominates
another if it is no worse in both objectives and better in at least one. The
*hypervolume* of a set against a reference point r is the area of the region
dominated by the set and bounded by r; it grows whenever the front improves, so it
measures the quality of a front in one number. The *hypervolume improvement* of a
candidate is how much the hypervolume would grow if the candidate were added.

Everything here is exact and sorts once: O(n log n) for the filter and the
hypervolume; hypervolume improvement of m candidates over a front of k points is
O((m + k) log k) through a sorted staircase and a prefix sum.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from kareus.errors import ArgumentError

__all__ = [
    "hypervolume",
    "hypervolume_improvement",
    "pareto_front",
    "pareto_mask",
    "reference_point",
]


def _as_points(points: ArrayLike) -> np.ndarray:
    p = np.asarray(points, dtype=np.float64)
    if p.size == 0:
        return p.reshape(0, 2)
    if p.ndim != 2 or p.shape[1] != 2:
        raise ArgumentError(f"points must have shape (n, 2), got {p.shape}")
    if not np.all(np.isfinite(p)):
        raise ArgumentError("points must be finite")
    return p


def pareto_mask(points: ArrayLike) -> np.ndarray:
    """Boolean mask of the non-dominated points (minimising both columns).

    Of exact duplicates on the front, the first is kept.
    """
    p = _as_points(points)
    n = len(p)
    mask = np.zeros(n, dtype=bool)
    if n == 0:
        return mask
    order = np.lexsort((np.arange(n), p[:, 1], p[:, 0]))  # by x, then y, then index
    ys = p[order, 1]
    # In that order a point is on the front iff its energy is strictly below every
    # energy before it (one sweep, vectorised as a running minimum).
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(ys)[:-1]))
    mask[order[ys < best_before]] = True
    return mask


def pareto_front(points: ArrayLike) -> np.ndarray:
    """The non-dominated points, sorted by the first objective."""
    p = _as_points(points)
    front = p[pareto_mask(p)]
    return front[np.argsort(front[:, 0], kind="stable")]


def reference_point(points: ArrayLike, margin: float = 0.1) -> np.ndarray:
    """A reference point ``(1 + margin) x`` the worst value of each objective."""
    p = _as_points(points)
    if len(p) == 0:
        raise ArgumentError("need at least one point for a reference point")
    return p.max(axis=0) * (1.0 + margin)


def _staircase(points: np.ndarray, ref: np.ndarray) -> np.ndarray:
    front = pareto_front(points)
    return front[(front[:, 0] < ref[0]) & (front[:, 1] < ref[1])]


def hypervolume(points: ArrayLike, ref: ArrayLike) -> float:
    """Area dominated by ``points`` and bounded by the reference point ``ref``.

    Points not strictly better than ``ref`` in both objectives add nothing.
    """
    r = np.asarray(ref, dtype=np.float64).reshape(2)
    front = _staircase(_as_points(points), r)
    if len(front) == 0:
        return 0.0
    xs = front[:, 0]
    ys = front[:, 1]
    widths = np.diff(np.append(xs, r[0]))
    return float(np.sum(widths * (r[1] - ys)))


def hypervolume_improvement(candidates: ArrayLike, front: ArrayLike, ref: ArrayLike) -> np.ndarray:
    """Hypervolume gained by adding each candidate, alone, to ``front``.

    Returns an array with one non-negative value per candidate (0 for a candidate the
    front dominates or that lies beyond ``ref``).
    """
    c = _as_points(candidates)
    r = np.asarray(ref, dtype=np.float64).reshape(2)
    stair = _staircase(_as_points(front), r)
    if len(c) == 0:
        return np.zeros(0)
    cx = np.minimum(c[:, 0], r[0])
    cy = np.minimum(c[:, 1], r[1])
    if len(stair) == 0:
        return np.maximum(r[0] - cx, 0) * np.maximum(r[1] - cy, 0)
    # The staircase's height h(x) = min y of front points with x_i <= x (r_y before the
    # first). The gain is the integral over [cx, r_x] of max(0, h(x) - cy). h is
    # non-increasing, so the integrand is positive on [cx, x*) where x* is the first
    # front x with y_i <= cy.
    xs = np.append(stair[:, 0], r[0])  # segment k spans [xs[k], xs[k+1]) at height ys[k]
    ys = stair[:, 1]
    # Breakpoints of h: before xs[0] the height is r_y.
    bx = np.concatenate(([-np.inf], xs))  # segment j spans [bx[j], bx[j+1]) at height bh[j]
    bh = np.concatenate(([r[1]], ys))
    # First segment index whose height <= cy: heights are decreasing.
    stop = np.searchsorted(-bh, -cy, side="left")  # first j with bh[j] <= cy
    # Integral of h over [cx, end) where end = bx[stop] (or r_x when stop == len(bh)).
    end = np.where(stop < len(bh), bx[np.minimum(stop, len(bh) - 1)], r[0])
    end = np.minimum(end, r[0])
    # Prefix integrals of h from xs[0]: area[k] = integral of h over [xs[0], xs[k]].
    seg_area = np.diff(xs) * ys
    area = np.concatenate(([0.0], np.cumsum(seg_area)))

    def integral_to(x: np.ndarray) -> np.ndarray:
        """Integral of h over [xs[0], x] for x >= xs[0] (0 for x below xs[0])."""
        k = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(ys) - 1)
        inside = x >= xs[0]
        val = area[k] + (x - xs[k]) * ys[k]
        return np.where(inside, val, 0.0)

    # Split [cx, end) at xs[0]: the part left of xs[0] has height r_y.
    left_hi = np.minimum(end, xs[0])
    left = np.maximum(left_hi - cx, 0.0) * r[1]
    lo = np.maximum(cx, xs[0])
    right = np.where(end > lo, integral_to(end) - integral_to(lo), 0.0)
    gain = left + right - np.maximum(end - cx, 0.0) * cy
    return np.maximum(gain, 0.0)
