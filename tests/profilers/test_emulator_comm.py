"""kareus.profilers.emulator._comm: the emulated GPU's collective curves."""

from __future__ import annotations

import pytest

from kareus.model.gpu import get_gpu
from kareus.profilers.emulator._comm import CommCurve, _comm_curves

KINDS = {"all_reduce", "all_gather", "reduce_scatter"}


@pytest.mark.parametrize("backend", ["own", "nccl"])
def test_every_kind_and_group_size_has_a_positive_curve(backend):
    curves = _comm_curves(get_gpu("h200-sxm"), backend)
    assert {(c.kind, c.group_size) for c in curves} == {(k, g) for k in KINDS for g in (2, 4)}
    for c in curves:
        assert isinstance(c, CommCurve)
        assert c.gb_per_s_per_sm > 0 and c.link_gb_per_s > c.gb_per_s_per_sm


@pytest.mark.parametrize("backend", ["own", "nccl"])
def test_h100_shares_the_h200_measurements(backend):
    assert _comm_curves(get_gpu("h100-sxm"), backend) == _comm_curves(get_gpu("h200-sxm"),
                                                                      backend)


@pytest.mark.parametrize("backend", ["own", "nccl"])
def test_other_gpus_scale_rate_by_clock_and_limit_by_nvlink(backend):
    a100, h200 = get_gpu("a100-40gb"), get_gpu("h200-sxm")
    clock = (a100.max_clock_mhz / 1980.0) ** 0.25 * (1.80 if backend == "own" else 1.0)
    link = a100.nvlink_bandwidth_gbps / 900.0
    for scaled, measured in zip(_comm_curves(a100, backend), _comm_curves(h200, backend)):
        assert (scaled.kind, scaled.group_size) == (measured.kind, measured.group_size)
        assert scaled.gb_per_s_per_sm == pytest.approx(measured.gb_per_s_per_sm * clock,
                                                       abs=0.006)
        assert scaled.link_gb_per_s == pytest.approx(measured.link_gb_per_s * link, abs=0.06)


def test_a100_own_all_reduce_is_inside_the_case_study_bounds():
    # the Kareus paper's A100 case study (TP=4, 1410 MHz): 4 SMs hid the all-reduce and
    # 3 did not, which bounds its per-SM rate to [35.8, 48.3) GB/s in the emulator's model
    (curve,) = [c for c in _comm_curves(get_gpu("a100-40gb"), "own")
                if c.kind == "all_reduce" and c.group_size == 4]
    assert 35.8 <= curve.gb_per_s_per_sm < 48.3


def test_unknown_backend_is_refused():
    with pytest.raises(KeyError):
        _comm_curves(get_gpu("h200-sxm"), "mscclpp-nvls")
