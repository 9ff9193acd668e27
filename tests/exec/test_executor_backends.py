"""TorchExecutor's named backends and buffer allocation (kareus.exec.executor), on the
recording stream backend: a configuration's backend picks the collective that runs it, and
communication buffers come from a backend that registers memory."""

from __future__ import annotations

import pytest

from kareus.errors import ConfigError
from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
from kareus.model.config import ScheduleConfig
from kareus.testing import RecordingCollective

OPS = ["attn_norm", "qkv", "rope", "attn_core", "out_proj"]


class Registering(RecordingCollective):
    """A backend that hands out (fake) registered buffers."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.allocated = []

    def empty(self, shape, dtype):
        buf = Buffer((shape, dtype, len(self.allocated)))
        self.allocated.append(buf)
        return buf


class Buffer(tuple):
    def zero_(self):
        return self


def make():
    dev = RecordingStreamBackend()
    primary = RecordingCollective(streams=dev, name="nccl")
    own = Registering(streams=dev, name="own")
    ex = TorchExecutor(collective=primary, backends={"own": own, "nccl_capped": primary},
                       streams=dev)
    return ex, dev, primary, own


@pytest.mark.parametrize("nanobatched", [False, True])
def test_the_configuration_backend_runs_the_collective(nanobatched):
    ex, dev, primary, own = make()
    for backend in ("own", "nccl_capped", None):
        cfg = ScheduleConfig(1980, 8, "rope", backend=backend)
        if nanobatched:
            ex.run_nanobatched([dev.op(n) for n in OPS], OPS, ["a", "b"], cfg)
        else:
            ex.run_partition([dev.op(n) for n in OPS], OPS, "b", cfg)
    per_config = 2 if nanobatched else 1
    assert len(own.calls) == per_config
    assert len(primary.calls) == 2 * per_config  # nccl_capped by name, and by default
    assert all(sms == 8 for _, _, sms in own.calls + primary.calls)
    with pytest.raises(ConfigError, match="mscclpp"):
        ex.run_partition([dev.op(n) for n in OPS], OPS, "b",
                         ScheduleConfig(1980, 8, "rope", backend="mscclpp"))


def test_buffers_come_from_the_backend_that_registers_memory():
    ex, _, primary, own = make()
    a = ex.empty((4, 8), "bf16")
    b = ex.empty(16, "bf16")
    assert own.allocated == [a, b]
    assert ex.backend_for(None) is primary and ex.backend_for(8, "own") is own


def test_backends_are_type_checked():
    with pytest.raises(TypeError, match="backends"):
        TorchExecutor(collective=RecordingCollective(), backends={"own": object()})


class PerGroup(RecordingCollective):
    """A backend per group (as the training loop's GroupedCollective): all-reduces over
    one group, all-gathers and reduce-scatters over the other."""

    def __init__(self, tp, cp):
        super().__init__()
        self.tp, self.cp = tp, cp

    def backend_for(self, kind):
        b = self.tp if kind == "all_reduce" else self.cp
        if b is None:
            raise ValueError(kind)
        return b


def test_buffers_of_a_backend_per_group_are_registered_with_the_collectives_group():
    tp, cp = Registering(), Registering()
    ex = TorchExecutor(collective=PerGroup(tp, cp), streams=RecordingStreamBackend())
    a = ex.empty(8, "bf16")
    g = ex.empty(8, "bf16", kind="all_gather")
    assert tp.allocated == [a] and cp.allocated == [g]
    only_tp = TorchExecutor(collective=PerGroup(tp, None), backends={"own": Registering()},
                            streams=RecordingStreamBackend())
    r = only_tp.empty(4, "bf16", kind="reduce_scatter")  # no CP group: the next backend
    assert r in only_tp.backends["own"].allocated
