"""A conformance suite for [`AcquisitionPass`][kareus.search.AcquisitionPass] implementations.

[`make_acquisition_context`][kareus.testing.make_acquisition_context] builds a random but plausible
[`AcquisitionContext`][kareus.search.AcquisitionContext] (a fake for pass authors' own tests);
[`check_acquisition_pass`][kareus.testing.check_acquisition_pass] runs every check of
``PASS_CHECKS`` on passes made by a factory;
[`AcquisitionPassConformance`][kareus.testing.AcquisitionPassConformance] is the same suite as
pytest tests. The checks: valid picks that fill the share, edge cases (k = 0, nothing available,
fewer candidates than k, one observed point), contexts without spread or with candidates already
chosen, and purity and determinism of ``select``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kareus._check import check_count, check_number
from kareus.errors import ArgumentError
from kareus.search import AcquisitionContext, AcquisitionPass, ObjectivePrediction
from kareus.testing._suite import _add_tests, _run_checks

__all__ = ["PASS_CHECKS", "AcquisitionPassConformance", "check_acquisition_pass",
           "make_acquisition_context"]


def make_acquisition_context(n: int = 200, *, m: int = 12, seed: int = 0,
                             spread: bool = True, n_chosen: int = 0,
                             unavailable: float = 0.3) -> AcquisitionContext:
    """A random but plausible context: ``n`` candidates with predictions, ``m`` observed
    points, a share ``unavailable`` of candidates not available, and ``n_chosen`` of them
    already chosen for the batch."""
    n = check_count("n", n)
    m = check_count("m", m)
    seed = check_count("seed", seed, minimum=0)
    check_number("unavailable", unavailable, minimum=0)
    if not unavailable < 1:
        raise ArgumentError(f"unavailable must be below 1 (a share of the candidates), got "
                            f"{unavailable}")
    rng = np.random.default_rng(seed)
    t = rng.uniform(1e-3, 3e-3, n)
    d = 0.5 / t * 1e-3 * rng.uniform(0.8, 1.2, n)  # a time-energy trade-off
    pred = ObjectivePrediction(
        time_s=t, dynamic_energy_j=d, static_power_w=340.0,
        time_spread=rng.uniform(0, 0.2, n) if spread else None,
        dynamic_spread=rng.uniform(0, 0.2, n) if spread else None)
    available = rng.random(n) >= unavailable
    ot = rng.uniform(1e-3, 3e-3, m)
    od = 0.5 / ot * 1e-3 * rng.uniform(0.9, 1.3, m)
    ctx = AcquisitionContext(prediction=pred, available=available, observed_time_s=ot,
                             observed_energy_j=od + 340.0 * ot,
                             observed_static_power_w=np.full(m, 340.0),
                             rng=np.random.default_rng(seed + 1))
    if n_chosen:
        ctx = ctx.with_chosen(rng.choice(np.flatnonzero(ctx.available), n_chosen,
                                         replace=False))
    return ctx


def _valid_picks(picks: Any, ctx: AcquisitionContext, k: int) -> np.ndarray:
    arr = np.asarray(picks)
    assert arr.ndim == 1, f"select must return a 1-D array of indices, got shape {arr.shape}"
    assert arr.size == 0 or np.issubdtype(arr.dtype, np.integer), \
        f"select must return integer indices, got dtype {arr.dtype}"
    assert arr.size <= k, f"select returned {arr.size} > k={k} candidates"
    assert len(set(arr.tolist())) == arr.size, "select returned a candidate twice"
    assert ((arr >= 0) & (arr < ctx.n_candidates)).all(), "select returned an out-of-range index"
    assert ctx.available[arr].all(), "select returned a candidate that is not available"
    return arr


def _check_pass_basic(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    assert isinstance(p, AcquisitionPass), f"factory returned {type(p).__name__}"
    assert isinstance(p.name, str) and p.name, "name must be a non-empty string"
    for seed in range(3):
        ctx = make_acquisition_context(seed=seed)
        for k in (1, 5, 17):
            arr = _valid_picks(p.select(ctx, k), ctx, k)
            assert arr.size == min(k, int(ctx.available.sum())), \
                f"select must fill its share: asked {k}, got {arr.size}"


def _check_pass_edges(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    ctx = make_acquisition_context(seed=4)
    assert _valid_picks(p.select(ctx, 0), ctx, 0).size == 0, "k=0 must select nothing"
    none = AcquisitionContext(prediction=ctx.prediction,
                              available=np.zeros(ctx.n_candidates, dtype=bool),
                              observed_time_s=ctx.observed_time_s,
                              observed_energy_j=ctx.observed_energy_j,
                              observed_static_power_w=ctx.observed_static_power_w)
    assert _valid_picks(p.select(none, 5), none, 5).size == 0, \
        "with nothing available, select must return nothing"
    few = make_acquisition_context(n=10, seed=5, unavailable=0.7)
    arr = _valid_picks(p.select(few, 10), few, 10)
    assert arr.size == int(few.available.sum()), "select must take every available candidate " \
        "when k exceeds them"
    one = make_acquisition_context(m=1, seed=6)
    _valid_picks(p.select(one, 4), one, 4)


def _check_pass_variants(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    for kwargs in ({"spread": False}, {"n_chosen": 6}):
        ctx = make_acquisition_context(seed=7, **kwargs)  # type: ignore[arg-type]
        arr = _valid_picks(p.select(ctx, 8), ctx, 8)
        assert arr.size == 8, f"select must fill its share in a context with {kwargs}"
        assert not np.isin(arr, ctx.chosen).any(), "select picked a candidate already chosen"


def _check_pass_pure(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    ctx = make_acquisition_context(seed=8)
    avail = ctx.available.copy()
    t = ctx.prediction.time_s.copy()
    p.select(ctx, 9)
    assert np.array_equal(ctx.available, avail), "select must not modify context.available"
    assert np.array_equal(ctx.prediction.time_s, t), "select must not modify predictions"
    a = np.asarray(make().select(make_acquisition_context(seed=9), 9))
    b = np.asarray(make().select(make_acquisition_context(seed=9), 9))
    assert np.array_equal(a, b), "select must be deterministic for a given context and rng seed"


PASS_CHECKS: dict[str, Callable[[Callable[[], AcquisitionPass]], None]] = {
    "basic": _check_pass_basic,
    "edges": _check_pass_edges,
    "variants": _check_pass_variants,
    "pure": _check_pass_pure,
}


def check_acquisition_pass(make: Callable[[], AcquisitionPass], *,
                           skip: tuple[str, ...] = ()) -> None:
    """Run every acquisition-pass conformance check on passes made by ``make``.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("acquisition pass", PASS_CHECKS, skip, make)


class AcquisitionPassConformance:
    """Mix-in: subclass in a ``Test*`` class and implement [`make_pass`][kareus.testing.AcquisitionPassConformance.make_pass]."""

    skip_checks: tuple[str, ...] = ()

    def make_pass(self) -> AcquisitionPass:
        """A new pass to check (override in the test class)."""
        raise NotImplementedError("implement make_pass() to return a new pass")


_add_tests(AcquisitionPassConformance, PASS_CHECKS, lambda self: (self.make_pass,))
