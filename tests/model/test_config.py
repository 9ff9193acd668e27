import numpy as np
import pytest

from kareus.errors import (
    ConfigError,
    InvalidSMCountError,
    UnknownSlotError,
    UnsupportedFrequencyError,
)
from kareus.model import FEATURE_NAMES, ConfigSpace, ScheduleConfig, Workload, build_partitions


@pytest.fixture(scope="module")
def attn():
    return build_partitions(Workload.preset("llama3.2-3b", tp=4, microbatch_size=8))["fwd_attn"]


def test_default_space_size_and_membership(attn):
    space = ConfigSpace(attn, "a100-40gb")
    assert len(space) == 18 * 32 * (5 + 1)
    assert len(space.configs) == len(space)
    c = ScheduleConfig(1410, 4, "qkv")
    assert c in space
    assert ScheduleConfig(1410, 4, None) in space
    assert ScheduleConfig(1400, 4, "qkv") not in space
    assert space.configs[space.index(c)] == c


def test_validation_errors_are_typed_and_helpful(attn):
    space = ConfigSpace(attn, "a100-40gb")
    with pytest.raises(InvalidSMCountError, match=r"1\.\.107"):
        space.validate(ScheduleConfig(1410, 108, "qkv"))
    with pytest.raises(InvalidSMCountError):
        space.validate(ScheduleConfig(1410, 0, "qkv"))
    with pytest.raises(UnsupportedFrequencyError, match="nearest supported: 1410"):
        space.validate(ScheduleConfig(1411, 4, "qkv"))
    with pytest.raises(UnknownSlotError, match="attn_norm, qkv, rope, attn_core, out_proj"):
        space.validate(ScheduleConfig(1410, 4, "nope"))
    with pytest.raises(ConfigError):
        ConfigSpace(attn, "a100-40gb", comm_sms=[200])
    with pytest.raises(UnsupportedFrequencyError):
        ConfigSpace(attn, "h200-sxm", freqs_mhz=[1000, 1001])
    with pytest.raises(TypeError):
        ConfigSpace("fwd_attn", "h200-sxm")  # type: ignore[arg-type]


def test_sequential_only_partition():
    p = build_partitions(Workload.preset("llama3.2-3b", tp=4, microbatch_size=8,
                                         nanobatches=1))["fwd_attn"]
    space = ConfigSpace(p, "h200-sxm")
    assert space.slots == (None,)
    with pytest.raises(UnknownSlotError, match="sequential only"):
        space.validate(ScheduleConfig(1980, 4, "qkv"))


def test_features_are_physical(attn):
    space = ConfigSpace(attn, "h200-sxm", freqs_mhz=[1980, 1500], comm_sms=[2, 16])
    X = space.features()
    assert X.shape == (len(space), len(FEATURE_NAMES))
    rows = {c: x for c, x in zip(space.configs, X)}
    seq = rows[ScheduleConfig(1500, 16, None)]
    assert tuple(seq) == (1500.0, 16.0, 1.0, 0.0, 1.0)
    norm = rows[ScheduleConfig(1980, 2, "attn_norm")]
    qkv = rows[ScheduleConfig(1980, 2, "qkv")]
    assert norm[2] == 0.0 and 0.0 < qkv[2] < 1.0  # slot position grows along the ops
    assert qkv[3] > norm[3]  # the GEMM is more compute-bound than the norm
    positions = [rows[ScheduleConfig(1980, 2, s.name)][2] for s in attn.slots]
    assert np.all(np.diff(positions) > 0)


def test_restrict_and_roundtrip(attn):
    space = ConfigSpace(attn, "h200-sxm")
    sub = space.restrict(freqs_mhz=[1980], comm_sms=[32], slots=[None])
    assert sub.configs == [ScheduleConfig(1980, 32, None)]
    c = ScheduleConfig(1500, 8, "rope")
    assert ScheduleConfig.from_dict(c.to_dict()) == c
    assert "sequential" in str(ScheduleConfig(1500, 8, None))


def test_configs_sort_with_sequential_and_slots_mixed():
    # Sequential (no slot) and slotted configurations at the same clock and SM count
    # must order without comparing None to a string (a plan's summary sorts them).
    a = ScheduleConfig(1410, 8, "qkv")
    b = ScheduleConfig(1410, 8, None)
    c = ScheduleConfig(1410, 8, "attn_norm")
    d = ScheduleConfig(1200, 16, "qkv")
    assert sorted([a, b, c, d]) == [d, b, c, a]
    assert b < c < a and not a < b
    assert max([a, b, c, d]) == a
    assert a == ScheduleConfig(1410, 8, "qkv") and len({a, b, c, d, a}) == 4


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"freq_mhz": float("inf")}, "freq_mhz must be a whole number"),
    ({"comm_sms": 4.7}, "comm_sms must be a whole number"),  # not truncated to 4
    ({"comm_sms": "4"}, "comm_sms must be a whole number"),
    ({"freq_mhz": True}, "freq_mhz must be a whole number"),
    ({"comm_sms": -1}, "comm_sms must be in 0..1,000,000"),
    ({"launch_slot": 3}, "launch_slot must be an op name"),
])
def test_a_configuration_of_the_wrong_kind_is_a_config_error(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        ScheduleConfig(**{"freq_mhz": 1410, "comm_sms": 4, "launch_slot": None, **kwargs})
    assert ScheduleConfig(np.int64(1410), 4.0).comm_sms == 4  # numpy ints, whole floats


def test_recompute_is_a_policy_and_booleans_read_as_full_or_none():
    from kareus.errors import WorkloadError

    with pytest.raises(WorkloadError, match="recompute must be one of none, selective, full"):
        Workload.preset("qwen3-1.7b", recompute="no")
    assert Workload.preset("qwen3-1.7b", tp=2, recompute=True).recompute == "full"
    assert Workload.preset("qwen3-1.7b", tp=2, recompute=False).recompute == "none"
    assert Workload.preset("qwen3-1.7b", tp=2, recompute="Selective").recompute == "selective"
