"""A conformance suite for [`Surrogate`][kareus.search.Surrogate] implementations.

[`check_surrogate`][kareus.testing.check_surrogate] runs every check of ``SURROGATE_CHECKS`` on
surrogates made by a factory; [`SurrogateConformance`][kareus.testing.SurrogateConformance] is the
same suite as pytest tests. The checks fit on toy data shaped like ConfigSpace's features (MHz, SMs,
slot position, log intensity, sequential) with a smooth log-time-like target: shapes (zero rows
included: ``predict`` returns shape ``(0,)``), fitting before predicting, a held-out R^2, no mutation of the inputs, typed errors for bad input, tiny and constant
data, unfitted clones, the spread, and determinism.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kareus.search.surrogate import Surrogate
from kareus.testing._suite import _add_tests, _run_checks

__all__ = ["SURROGATE_CHECKS", "SurrogateConformance", "check_surrogate"]


def _toy_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features shaped like ConfigSpace's (MHz, SMs, slot position, log intensity,
    sequential) and a smooth log-time-like target."""
    rng = np.random.default_rng(seed)
    f = rng.choice(np.arange(900, 1411, 30), n).astype(float)
    s = rng.integers(1, 33, n).astype(float)
    pos = rng.choice([0.0, 0.2, 0.5, 0.8, 1.0], n)
    lai = np.where(pos == 1.0, 0.0, rng.choice([0.5, 2.5], n))
    seq = (pos == 1.0).astype(float)
    x = np.column_stack([f, s, pos, lai, seq])
    y = np.log(1.0 / f * 1e3 + 3.0 / np.minimum(s, 12) + 0.5 * pos + 0.3 * seq)
    return x, y


def _check_type(make: Callable[[], Surrogate]) -> None:
    s = make()
    assert isinstance(s, Surrogate), f"factory returned {type(s).__name__}, not a Surrogate"
    assert not s.fitted, "a new surrogate must report fitted == False"


def _check_predict_before_fit(make: Callable[[], Surrogate]) -> None:
    x, _ = _toy_data(5, 0)
    try:
        make().predict(x)
    except RuntimeError:
        return
    raise AssertionError("predict before fit must raise RuntimeError")


def _check_fit_predict_shapes(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(60, 1)
    s = make()
    out = s.fit(x, y)
    assert out is s, "fit must return self"
    assert s.fitted, "fitted must be True after fit"
    p = s.predict(x[:17])
    assert isinstance(p, np.ndarray) and p.shape == (17,), \
        f"predict must return an array of shape (17,), got {getattr(p, 'shape', type(p))}"
    assert np.issubdtype(p.dtype, np.floating) and np.isfinite(p).all(), \
        "predictions must be finite floats"


def _check_zero_rows(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(30, 1)
    s = make().fit(x, y)
    p = s.predict(x[:0])
    assert isinstance(p, np.ndarray) and p.shape == (0,), \
        f"predict on zero rows must return shape (0,), got {getattr(p, 'shape', type(p))}"
    if s.has_spread:
        mean, spread = s.predict_spread(x[:0])
        assert mean.shape == (0,) and spread.shape == (0,), \
            "predict_spread on zero rows must return two arrays of shape (0,)"


def _check_learns(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(300, 2)
    xt, yt = _toy_data(200, 3)
    p = make().fit(x, y).predict(xt)
    r2 = 1 - np.sum((p - yt) ** 2) / np.sum((yt - yt.mean()) ** 2)
    assert r2 >= 0.7, f"surrogate fits a smooth function poorly: held-out R^2 = {r2:.3f} < 0.7"


def _check_no_mutation(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(40, 4)
    x0, y0 = x.copy(), y.copy()
    s = make().fit(x, y)
    s.predict(x)
    assert np.array_equal(x, x0) and np.array_equal(y, y0), "fit/predict must not modify inputs"


def _check_bad_shapes(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(20, 5)
    for bad_x, bad_y, what in [(x, y[:-1], "y shorter than X"), (x[:, 0], y, "1-D X"),
                               (x, np.full(20, np.nan), "NaN targets")]:
        try:
            make().fit(bad_x, bad_y)
        except ValueError:
            continue
        raise AssertionError(f"fit must raise ValueError for {what}")


def _check_tiny_and_constant(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(10, 6)
    for n in (1, 2):
        p = make().fit(x[:n], y[:n]).predict(x)
        assert p.shape == (10,) and np.isfinite(p).all(), f"fit on {n} samples must predict"
    p = make().fit(x, np.full(10, 2.5)).predict(x)
    assert np.allclose(p, 2.5, atol=1e-3), "a constant target must be predicted as that constant"


def _check_clone(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(50, 7)
    s = make().fit(x, y)
    before = s.predict(x)
    c = s.clone(seed=123)
    assert type(c) is type(s), "clone must return the same type"
    assert c is not s and not c.fitted, "clone must return a new, unfitted surrogate"
    c.fit(x, -y)
    assert np.allclose(s.predict(x), before), "fitting a clone must not change the original"


def _check_spread(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(60, 8)
    s = make().fit(x, y)
    if not s.has_spread:
        try:
            s.predict_spread(x)
        except NotImplementedError:
            return
        raise AssertionError("has_spread is False, so predict_spread must raise "
                             "NotImplementedError")
    mean, spread = s.predict_spread(x)
    assert mean.shape == (60,) and spread.shape == (60,), "predict_spread shapes must be (n,)"
    assert np.isfinite(spread).all() and (spread >= 0).all(), "spread must be finite and >= 0"
    assert np.allclose(mean, s.predict(x)), "predict_spread's mean must equal predict"


def _check_deterministic(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(80, 9)
    a = make().fit(x, y).predict(x)
    b = make().fit(x, y).predict(x)
    assert np.allclose(a, b), "two surrogates made alike and fitted alike must predict alike"


SURROGATE_CHECKS: dict[str, Callable[[Callable[[], Surrogate]], None]] = {
    "type": _check_type,
    "predict_before_fit": _check_predict_before_fit,
    "fit_predict_shapes": _check_fit_predict_shapes,
    "zero_rows": _check_zero_rows,
    "learns": _check_learns,
    "no_mutation": _check_no_mutation,
    "bad_shapes": _check_bad_shapes,
    "tiny_and_constant": _check_tiny_and_constant,
    "clone": _check_clone,
    "spread": _check_spread,
    "deterministic": _check_deterministic,
}


def check_surrogate(make: Callable[[], Surrogate], *, skip: tuple[str, ...] = ()) -> None:
    """Run every surrogate conformance check on surrogates made by ``make``.

    Args:
        make: Returns a new, unfitted surrogate each call (same settings and seed).
        skip: Names (keys of ``SURROGATE_CHECKS``) to skip, e.g. ``("deterministic",)``
            for a surrogate that cannot be seeded.

    Raises:
        AssertionError: naming the first check that fails, whether by an assertion or by
            any exception the surrogate raised inside it.
    """
    _run_checks("surrogate", SURROGATE_CHECKS, skip, make)


class SurrogateConformance:
    """Mix-in: subclass in a ``Test*`` class and implement [`make_surrogate`][kareus.testing.SurrogateConformance.make_surrogate]; pytest
    then runs one test per check. Set ``skip_checks`` to a tuple of names to skip."""

    skip_checks: tuple[str, ...] = ()

    def make_surrogate(self) -> Surrogate:
        """A new, unfitted surrogate to check (override in the test class)."""
        raise NotImplementedError("implement make_surrogate() to return a new surrogate")


_add_tests(SurrogateConformance, SURROGATE_CHECKS, lambda self: (self.make_surrogate,))
