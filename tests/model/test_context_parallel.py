"""kareus.model.context_parallel: which tokens a CP rank holds (Megatron-Core's
load-balanced layout: 2 x CP chunks, rank r holding chunks r and 2 CP - 1 - r)."""

from __future__ import annotations

import pytest

from kareus.errors import ArgumentError
from kareus.model import cp_chunks, cp_positions


def test_positions_are_megatron_s_chunks():
    assert cp_chunks(1, 0) == (0,) and cp_positions(6, 1, 0) == list(range(6))
    assert [cp_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert cp_positions(8, 2, 0) == [0, 1, 6, 7] and cp_positions(8, 2, 1) == [2, 3, 4, 5]
    # every position once over the group
    assert sorted(p for r in range(3) for p in cp_positions(12, 3, r)) == list(range(12))


@pytest.mark.parametrize(("args", "match"), [((10, 3, 0), "2 x CP = 6"),
                                             ((8, 2, 2), r"CP rank must be in \[0, 2\)"),
                                             ((8, 0, 0), "cp must be >= 1")])
def test_bad_layouts_are_refused(args, match):
    with pytest.raises(ArgumentError, match=match):
        cp_positions(*args)
