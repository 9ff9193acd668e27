"""The collective backend as a dimension of the configuration space (kareus.model.config):
absent, every space, feature and plan is the three-knob one; present, it is searched."""

from __future__ import annotations

import pytest

from kareus.compose.plan import MicrobatchChoice
from kareus.model.config import FEATURE_NAMES, ConfigSpace, ScheduleConfig
from kareus.model.partition import build_partitions
from kareus.model.workload import Workload


def part():
    wl = Workload.preset("llama3.2-3b", tp=2, microbatch_size=2, seq_len=1024)
    return build_partitions(wl).types["fwd_attn"]


def test_without_backends_the_space_is_the_three_knob_one():
    p = part()
    space = ConfigSpace(p, "h200-sxm", comm_sms=[4, 8])
    assert space.backends == (None,) and space.feature_names == FEATURE_NAMES
    assert space.features().shape == (len(space), len(FEATURE_NAMES))
    assert len(space) == len(space.freqs_mhz) * 2 * len(space.slots)
    assert all(c.backend is None and "backend" not in c.to_dict() for c in space.configs)
    assert space.configs == [ScheduleConfig(f, s, slot) for f in space.freqs_mhz
                             for s in (4, 8) for slot in space.slots]
    assert "backends" not in repr(space)


def test_backends_multiply_the_space_and_add_a_feature():
    p = part()
    space = ConfigSpace(p, "h200-sxm", freqs_mhz=[1980], comm_sms=[4, 8],
                        backends=["own", "nccl_capped"])
    assert len(space) == 2 * 2 * len(space.slots)
    assert space.feature_names == (*FEATURE_NAMES, "backend")
    f = space.features()
    assert set(f[:, -1]) == {0.0, 1.0}
    c = space.configs[1]
    assert c.backend == "nccl_capped" and c in space
    assert ScheduleConfig.from_dict(c.to_dict()) == c
    assert str(c).endswith(", nccl_capped")
    assert ScheduleConfig(1980, 4, None) not in space
    with pytest.raises(ValueError, match="backend"):
        space.validate(ScheduleConfig(1980, 4, None, backend="mscclpp"))
    assert space.restrict(comm_sms=[4]).backends == ("own", "nccl_capped")
    with pytest.raises(ValueError, match="distinct"):
        ConfigSpace(p, "h200-sxm", backends=["own", "own"])


def test_plans_carry_a_backend_only_where_one_was_chosen():
    plain = MicrobatchChoice(freq_mhz=1980, configs={"fwd_attn": ScheduleConfig(1980, 8, None)})
    assert "backend" not in plain.to_dict()["configs"]["fwd_attn"]
    chosen = MicrobatchChoice(freq_mhz=1980, configs={
        "fwd_attn": ScheduleConfig(1980, 8, None, backend="own")})
    d = chosen.to_dict()
    assert d["configs"]["fwd_attn"]["backend"] == "own"
    assert MicrobatchChoice.from_dict(d).config("fwd_attn").backend == "own"
    assert "on own" in str(chosen)
