"""Plain torch.distributed collectives with NCCL's own CTA count
(kareus.exec.collectives._process_group): the backend of the systems that do not cap SMs."""

from __future__ import annotations

import pytest

from kareus.exec.collectives import CollectiveBackend, ProcessGroupCollective


def test_it_is_a_complete_collective_backend():
    assert issubclass(ProcessGroupCollective, CollectiveBackend)
    assert not ProcessGroupCollective.__abstractmethods__  # every op and property given
    assert ProcessGroupCollective.name == "process_group"


class RecordingDist:
    """torch.distributed stand-in: records the flat-tensor collectives it is asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object, object, object]] = []

    def __getattr__(self, name):
        if name not in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            raise AttributeError(name)

        def call(*args, group=None):
            self.calls.append((name, *args, group))
        return call


@pytest.mark.parametrize(("op", "dist_call"), [("all_gather", "all_gather_into_tensor"),
                                               ("reduce_scatter", "reduce_scatter_tensor")])
def test_process_group_collective_shard_ops_call_the_flat_tensor_collectives(op, dist_call):
    torch = pytest.importorskip("torch")
    group = object()
    coll = ProcessGroupCollective(group=group)
    coll._dist = RecordingDist()
    full, shard = torch.zeros(2, 3, 4), torch.zeros(3, 4)
    output, input = (full, shard) if op == "all_gather" else (shard, full)
    assert getattr(coll, op)(output, input, None, 7) is output  # sms is ignored
    ((name, out_flat, in_flat, got_group),) = coll._dist.calls
    assert (name, got_group) == (dist_call, group)
    # flat views of the caller's tensors (the same memory), output first
    assert out_flat.shape == (output.numel(),) and out_flat.data_ptr() == output.data_ptr()
    assert in_flat.shape == (input.numel(),) and in_flat.data_ptr() == input.data_ptr()
