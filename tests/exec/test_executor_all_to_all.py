"""The executor launches an all-to-all as any collective: at its slot on the side stream,
with the configuration's SM count and the caller's splits (a mixture of experts' dispatch
and combine); the role refuses an all-to-all without splits and splits for any other kind
in one line, and routes the group ``"ep"`` to a per-group backend's ``for_group``."""

from __future__ import annotations

import pytest

from kareus.errors import ArgumentError
from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
from kareus.model.config import ScheduleConfig
from kareus.testing import RecordingCollective, RecordingExecutor

SPLITS = ([3, 1], [2, 2])


def _executor(coll):
    streams = RecordingStreamBackend()
    return TorchExecutor(collective=coll, streams=streams), streams


def test_run_partition_launches_the_all_to_all_at_its_slot_with_its_splits():
    coll = RecordingCollective(world_size=2)
    ex, streams = _executor(coll)
    coll._streams = streams
    ops = [lambda: streams.launch("a", streams.current_stream()),
           lambda: streams.launch("b", streams.current_stream())]
    ex.run_partition(ops, ["a", "b"], "sent", ScheduleConfig(1980, 8, "b"),
                     comm_kind="all_to_all", comm_output="received", comm_group="ep",
                     comm_splits=SPLITS)
    assert coll.calls == [("all_to_all", "sent", 8)]
    assert coll.splits == [([3, 1], [2, 2])]
    # after op a, on the side stream, right before op b, joined after it
    assert streams.log == [("launch", "compute", "a"), ("record", "compute", 0),
                           ("wait", "comm", 0),
                           ("launch", "comm", "all_to_all(sent->received)"),
                           ("record", "comm", 1), ("launch", "compute", "b"),
                           ("wait", "compute", 1)]


def test_nanobatched_and_exposed_all_to_alls_carry_the_splits():
    coll = RecordingCollective(world_size=2)
    ex, _ = _executor(coll)
    ex.run_nanobatched([lambda i: None], ["a"], ["s0", "s1", "s2"], ScheduleConfig(1980, 4, "a"),
                       comm_kind="all_to_all", comm_outputs=["r0", "r1", "r2"],
                       comm_splits=SPLITS)
    ex.run_collective("all_to_all", "x", "y", sms=2, group="ep", splits=SPLITS)
    assert [c[1] for c in coll.calls] == ["s0", "s1", "s2", "x"]
    assert coll.splits == [([3, 1], [2, 2])] * 4


def test_an_all_to_all_needs_its_splits_and_only_it_takes_them():
    ex = RecordingExecutor()
    cfg = ScheduleConfig(1980, 4, None)
    with pytest.raises(ArgumentError, match="all_to_all needs splits"):
        ex.run_partition([], [], "t", cfg, comm_kind="all_to_all", comm_output="o")
    with pytest.raises(ArgumentError, match="all_reduce takes no splits"):
        ex.run_partition([], [], "t", cfg, comm_kind="all_reduce", comm_splits=SPLITS)
    with pytest.raises(ArgumentError, match="two lists of row counts"):
        ex.run_collective("all_to_all", "t", "o", splits=[1, 2, 3])
    with pytest.raises(ArgumentError, match="all_to_all needs an output"):
        ex.run_collective("all_to_all", "t", splits=SPLITS)
    ex.run_partition([], [], "t", cfg, comm_kind="all_to_all", comm_output="o",
                     comm_group="ep", comm_splits=SPLITS)
    assert ("collective", "partition", "all_to_all", 4, None) in ex.log


def test_the_ep_group_goes_to_a_per_group_backend():
    ep = RecordingCollective(world_size=4)

    class PerGroup(RecordingCollective):
        def for_group(self, group):
            assert group == "ep"
            return ep

    ex, _ = _executor(PerGroup(world_size=2))
    ex.run_collective("all_to_all", "x", "y", sms=2, group="ep",
                      splits=([1, 1, 1, 1], [0, 2, 2, 0]))
    assert ep.splits == [([1, 1, 1, 1], [0, 2, 2, 0])]
