"""The DAG: topological relabelling and longest paths, one at a time and in batches."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests: the dev extra installs hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st

from kareus.model.dag import Dag
from kareus.model.pipeline import gpipe, one_f_one_b


@st.composite
def dags(draw):
    """A random DAG: edges only from a lower to a higher id of a random permutation."""
    n = draw(st.integers(1, 9))
    perm = draw(st.permutations(range(n)))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))
                  if pairs else st.just([]))
    return n, [(perm[i], perm[j]) for i, j in chosen]


def _brute_makespan(n, edges, dur):
    finish = {}

    def f(v):
        if v not in finish:
            finish[v] = max((f(u) for u, w in edges if w == v), default=0.0) + dur[v]
        return finish[v]

    return max(f(v) for v in range(n))


@settings(max_examples=60, deadline=None)
@given(dags(), st.integers(0, 10_000))
def test_order_and_longest_paths(dag_def, seed):
    n, edges = dag_def
    dag = Dag(n, edges)
    assert sorted(dag.order) == list(range(n))
    assert all(dag.pos[dag.order[i]] == i for i in range(n))
    assert all(dag.pos[u] < dag.pos[v] for u, v in edges)
    assert [(int(dag.pos[u]), int(dag.pos[v])) for u, v in edges] == dag.edges
    rng = np.random.default_rng(seed)
    dur = rng.uniform(0.5, 2.0, n)
    want = _brute_makespan(n, edges, dur)
    at_pos = dur[dag.order]
    assert dag.makespan(at_pos.tolist()) == pytest.approx(want, rel=1e-12)
    batch = np.vstack([at_pos, 2 * at_pos])
    assert dag.makespans(batch) == pytest.approx([want, 2 * want], rel=1e-12)
    ints = rng.integers(1, 5, n)
    got = dag.makespan(ints[dag.order].tolist())
    assert isinstance(got, int) and got == _brute_makespan(n, edges, ints)


@settings(max_examples=40, deadline=None)
@given(dags(), st.integers(0, 10_000))
def test_heads_and_tails_mark_the_critical_nodes(dag_def, seed):
    n, edges = dag_def
    dag = Dag(n, edges)
    d = np.random.default_rng(seed).integers(1, 5, n).tolist()
    heads, tails = dag.heads_tails(d)
    T = dag.makespan(d)
    for v in range(n):
        assert heads[v] + d[v] + tails[v] <= T
        assert heads[v] == max((heads[u] + d[u] for u in dag.preds[v]), default=0)
    assert any(heads[v] + d[v] + tails[v] == T for v in range(n))


def test_a_cycle_is_an_error():
    with pytest.raises(ValueError, match="cycle"):
        Dag(3, [(0, 1), (1, 2), (2, 0)])


def test_pipeline_schedules_are_dags():
    for sched in (one_f_one_b(4, 8), gpipe(3, 5)):
        dag = sched.dag()
        assert dag.num_nodes == len(sched)
        assert len(dag.edges) == len(sched.edges)
        assert repr(dag) == f"Dag(num_nodes={len(sched)}, edges={len(sched.edges)})"
        assert len(dag.sinks) == 1  # the first stage's last backward ends the iteration
