"""Checks of plain arguments (numbers and counts) shared by the policy layers.

Each check raises a typed error whose one-line message names the argument and says what
to pass: [`ArgumentTypeError`][kareus.errors.ArgumentTypeError] for a value of the wrong
type, [`ArgumentError`][kareus.errors.ArgumentError] for a value out of range. ``bool`` is
not a number here (``True`` as a deadline is a mistake, not 1 second).

This module imports only the typed errors, so every layer may use it.
"""

from __future__ import annotations

import math
import numbers

from kareus.errors import ArgumentError, ArgumentTypeError, short_repr

__all__ = ["check_count", "check_number"]


def check_number(name: str, value: object, *, minimum: float | None = None,
                 positive: bool = False, allow_inf: bool = False) -> float:
    """``value`` as a float, refused unless it is a real number in range.

    Args:
        name: The argument's name, as the caller spells it (``"deadline_s"``).
        value: What was passed.
        minimum: Smallest value accepted (inclusive); ``None`` for no bound.
        positive: Refuse zero and negative values.
        allow_inf: Accept ``+inf`` (never ``-inf`` below a bound, never NaN).

    Raises:
        ArgumentTypeError: ``value`` is not a real number.
        ArgumentError: NaN, an infinity not allowed, or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number, not {type(value).__name__} "
                                f"{short_repr(value)}")
    try:
        x = float(value)
    except OverflowError:  # an integer beyond float range
        raise ArgumentError(f"{name} is too large: {short_repr(value)}") from None
    if math.isnan(x):
        raise ArgumentError(f"{name} is NaN: pass a number")
    if math.isinf(x) and not (allow_inf and x > 0):
        raise ArgumentError(f"{name} must be finite, not {x}")
    if positive and x <= 0:
        raise ArgumentError(f"{name} must be positive, not {value}")
    if minimum is not None and x < minimum:
        raise ArgumentError(f"{name} must be at least {minimum:g}, not {value}")
    return x


def check_count(name: str, value: object, *, minimum: int = 1,
                maximum: int | None = None) -> int:
    """``value`` as an int, refused unless it is a whole number in ``[minimum, maximum]``.

    Raises:
        ArgumentTypeError: ``value`` is not an integer (floats and bools included).
        ArgumentError: out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be a whole number, not {type(value).__name__} "
                                f"{short_repr(value)}")
    n = int(value)
    if n < minimum:
        raise ArgumentError(f"{name} must be at least {minimum}, not {n}")
    if maximum is not None and n > maximum:
        raise ArgumentError(f"{name} must be at most {maximum:,}, not {n:,}")
    return n
