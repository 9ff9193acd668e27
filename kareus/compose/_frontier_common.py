"""What the microbatch and the iteration frontiers share: the Pareto filter over points
and the checks of their JSON files."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from kareus.errors import PlanError
from kareus.search.pareto import pareto_mask

__all__ = ["FRONTIER_VERSION", "check_kind", "loads", "pareto_points"]

_P = TypeVar("_P")

#: Version of the frontier file formats (plans inside carry their own version).
FRONTIER_VERSION = 1


def pareto_points(points: Iterable[_P], key: Callable[[_P], tuple[float, float]]) -> tuple[_P, ...]:
    """The Pareto points of ``points`` in ``key`` (both minimised), sorted by the first.

    Of exact duplicates, the first is kept.
    """
    pts = list(points)
    if not pts:
        return ()
    arr = np.array([key(p) for p in pts], dtype=np.float64)
    mask = pareto_mask(arr)
    kept = np.nonzero(mask)[0]
    kept = kept[np.argsort(arr[kept, 0], kind="stable")]
    return tuple(pts[i] for i in kept.tolist())


def loads(text: str) -> Any:
    """Parse a frontier file's JSON text (PlanError if it is not JSON)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise PlanError(f"frontier file is not valid JSON: {exc}") from None


def check_kind(d: Any, kind: str) -> None:
    """Raise PlanError unless ``d`` is a frontier document of ``kind`` in this version."""
    if not isinstance(d, Mapping) or d.get("kind") != kind:
        raise PlanError(f"not a kareus {kind.replace('_', ' ')} file")
    if d.get("version") != FRONTIER_VERSION:
        raise PlanError(f"{kind.replace('_', ' ')} format version {d.get('version')!r} is not "
                        f"supported; this kareus reads version {FRONTIER_VERSION}")
