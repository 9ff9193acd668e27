"""A conformance suite for [`Partition`][kareus.model.Partition] implementations.

The search, the emulator and the executor read a partition through its role contract only:
``name``, ``compute_ops`` (in stream order), ``comm_op``, ``overlappable``,
``group_gpus`` (the scope of its measurements), and the launch ``slots`` derived from the
ops. [`check_partition`][kareus.testing.check_partition] runs every check of ``PARTITION_CHECKS`` on
partitions made by a factory; [`PartitionConformance`][kareus.testing.PartitionConformance] is the
same suite as pytest tests.

The checks: types and a name; unique op names; slots that point at the ops they name
(each slot's first op at its index, its ops consecutive, the slots in stream order, none
when the partition is not overlappable) and are found by [`slot`][kareus.model.Partition.slot];
a measurement scope that includes the collective's group (an expert-parallel
collective's, whose ranks span data-parallel replicas, aside: its scope is the stage's);
FLOPs and bytes that add up;
a configuration space (sequential included) over the slots; and a factory that describes
the same partition every time.
"""

from __future__ import annotations

from collections.abc import Callable

from kareus.model.config import ConfigSpace
from kareus.model.ops import CommOp, ComputeOp
from kareus.model.partition import Partition
from kareus.testing._suite import _add_tests, _run_checks

__all__ = ["PARTITION_CHECKS", "PartitionConformance", "check_partition"]


def _check_type(make: Callable[[], Partition]) -> None:
    p = make()
    assert isinstance(p, Partition), f"factory returned {type(p).__name__}, not a Partition"
    assert isinstance(p.name, str) and p.name, "name must be a non-empty string"
    assert isinstance(p.comm_op, CommOp), \
        f"comm_op must be a CommOp, got {type(p.comm_op).__name__}"
    assert isinstance(p.overlappable, bool), "overlappable must be a bool"
    assert isinstance(repr(p), str) and repr(p), "repr must be a non-empty string"


def _check_ops(make: Callable[[], Partition]) -> None:
    p = make()
    ops = p.compute_ops
    assert isinstance(ops, tuple) and ops, "compute_ops must be a non-empty tuple"
    assert all(isinstance(op, ComputeOp) for op in ops), "every compute op must be a ComputeOp"
    names = [op.name for op in ops]
    assert len(set(names)) == len(names), f"op names must be unique, got {names}"


def _check_slots(make: Callable[[], Partition]) -> None:
    p = make()
    ops = p.compute_ops
    slots = p.slots
    if not p.overlappable:
        assert slots == (), "a partition that is not overlappable has no launch slots"
        return
    assert slots, "an overlappable partition needs at least one launch slot"
    last = -1
    for s in slots:
        assert 0 <= s.index < len(ops), f"slot {s.name!r}: index {s.index} is not an op"
        assert s.index > last, "slots must be in stream order"
        last = s.index
        assert ops[s.index].name == s.name, \
            f"slot {s.name!r} starts at op {ops[s.index].name!r}"
        span = [op.name for op in ops[s.index:s.index + len(s.op_names)]]
        assert list(s.op_names) == span, \
            f"slot {s.name!r}: its ops {list(s.op_names)} are not the consecutive ops {span}"
        assert p.slot(s.name) == s, f"slot({s.name!r}) must return that slot"
    try:
        p.slot("\0 no such slot")
    except KeyError:
        pass
    else:
        raise AssertionError("slot() of an unknown name must raise KeyError")


def _check_scope(make: Callable[[], Partition]) -> None:
    p = make()
    g = p.group_gpus
    # An expert-parallel collective's ranks span data-parallel replicas: its partition's
    # scope is the stage's TP x CP GPUs, which need not hold the whole group
    spans_replicas = getattr(p, "comm_group", "") == "ep"
    assert isinstance(g, int) and g >= 1 and (spans_replicas or g >= p.comm_op.group_size), \
        (f"group_gpus (the measurement scope, {g!r}) must be an int that includes the "
         f"collective's group ({p.comm_op.group_size} GPUs)")


def _check_totals(make: Callable[[], Partition]) -> None:
    p = make()
    flops = sum(op.flops for op in p.compute_ops)
    moved = sum(op.bytes_moved for op in p.compute_ops)
    assert abs(p.flops - flops) <= 1e-9 * max(flops, 1.0), \
        f"flops {p.flops} is not the ops' total {flops}"
    assert abs(p.compute_bytes - moved) <= 1e-9 * max(moved, 1.0), \
        f"compute_bytes {p.compute_bytes} is not the ops' total {moved}"


def _check_config_space(make: Callable[[], Partition]) -> None:
    p = make()
    space = ConfigSpace(p, "a100-40gb")
    assert len(space) > 0, "the configuration space is empty"
    slots = {c.launch_slot for c in space.configs}
    assert None in slots, "the space must hold sequential execution"
    assert slots - {None} == {s.name for s in p.slots}, \
        "the space's launch slots must be the partition's"


def _check_stable(make: Callable[[], Partition]) -> None:
    a, b = make(), make()
    assert a.name == b.name and a.compute_ops == b.compute_ops and a.comm_op == b.comm_op, \
        "the factory must describe the same partition every time"
    assert a.slots == b.slots, "the slots must not change between instances"


#: Name -> check (each takes a factory of new partitions).
PARTITION_CHECKS: dict[str, Callable[[Callable[[], Partition]], None]] = {
    "type": _check_type,
    "ops": _check_ops,
    "slots": _check_slots,
    "scope": _check_scope,
    "totals": _check_totals,
    "config_space": _check_config_space,
    "stable": _check_stable,
}


def check_partition(make: Callable[[], Partition], *, skip: tuple[str, ...] = ()) -> None:
    """Run every partition conformance check on partitions made by ``make``.

    Args:
        make: Returns a new partition each call (the same one each time).
        skip: Names (keys of ``PARTITION_CHECKS``) to skip.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("partition", PARTITION_CHECKS, skip, make)


class PartitionConformance:
    """Mix-in: subclass in a ``Test*`` class and implement [`make_partition`][kareus.testing.PartitionConformance.make_partition]; pytest
    then runs one test per check of ``PARTITION_CHECKS``."""

    skip_checks: tuple[str, ...] = ()

    def make_partition(self) -> Partition:
        """A new partition under test."""
        raise NotImplementedError("implement make_partition() to return a new partition")


_add_tests(PartitionConformance, PARTITION_CHECKS, lambda self: (self.make_partition,))
