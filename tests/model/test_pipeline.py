import pytest

from kareus.errors import UnknownPresetError
from kareus.model import Computation, get_schedule, gpipe, one_f_one_b


def test_1f1b_stage_orders():
    s = one_f_one_b(4, 8)
    assert len(s) == 4 * 8 * 2
    first = s.stage_orders[0]
    assert [c.phase for c in first[:4]] == ["fwd", "fwd", "fwd", "fwd"]
    assert first[4] == Computation(0, 0, "bwd")
    last = s.stage_orders[3]
    assert [(c.microbatch, c.phase) for c in last[:4]] == [(0, "fwd"), (0, "bwd"), (1, "fwd"),
                                                          (1, "bwd")]
    for order in s.stage_orders:
        assert sorted(order) == sorted({*order})  # no duplicates
        assert len(order) == 16


def test_1f1b_makespan_with_unit_times():
    # With forward 1 and backward 2 everywhere, 1F1B takes (M + PP - 1) * (1 + 2).
    pp, m = 4, 8
    s = one_f_one_b(pp, m)
    dur = {c: (1.0 if c.phase == "fwd" else 2.0) for c in s}
    assert s.makespan(dur) == pytest.approx((m + pp - 1) * 3.0)
    g = gpipe(pp, m)
    assert g.makespan({c: (1.0 if c.phase == "fwd" else 2.0) for c in g}) == pytest.approx(
        (m + pp - 1) * 3.0)


def test_topological_order_respects_edges():
    s = one_f_one_b(3, 5)
    pos = {c: i for i, c in enumerate(s.topological_order())}
    assert all(pos[u] < pos[v] for u, v in s.edges)


def test_keys_and_errors():
    c = Computation(2, 7, "bwd")
    assert Computation.from_key(c.key()) == c
    with pytest.raises(ValueError):
        Computation(0, 0, "sideways")
    with pytest.raises(UnknownPresetError, match="1f1b"):
        get_schedule("zb-v", 2, 2)
    with pytest.raises(ValueError):
        one_f_one_b(0, 4)
