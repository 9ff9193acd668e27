"""The initial design: maximin designs, the systems' own configurations, and their mix."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.model import ConfigSpace, ScheduleConfig
from kareus.search import default_initial_size, maximin_design, system_config_indices
from kareus.search._initial_design import initial_design


def test_maximin_design_fills_the_space(medium_space):
    idx = maximin_design(medium_space, 16, seed=3)
    assert len(idx) == len(set(idx)) == 16
    cfgs = [medium_space.configs[i] for i in idx]
    slots = [c.launch_slot for c in cfgs]
    counts = [slots.count(s) for s in medium_space.slots]
    assert max(counts) - min(counts) <= 1  # slots balanced, sequential included
    assert len({c.freq_mhz for c in cfgs}) == 6  # every frequency level used
    assert len({c.comm_sms for c in cfgs}) >= 9
    assert idx == maximin_design(medium_space, 16, seed=3)


def test_maximin_beats_random_on_spread(medium_space):
    from kareus.search._initial_design import _unit_coordinates

    coords = _unit_coordinates(medium_space)

    def min_dist(idx):
        p = coords[idx]
        d = np.sqrt(((p[:, None, :2] - p[None, :, :2]) ** 2).sum(-1)
                    + (p[:, None, 2] != p[None, :, 2]))
        np.fill_diagonal(d, np.inf)
        return d.min()

    rng = np.random.default_rng(0)
    rand = np.median([min_dist(rng.choice(len(coords), 16, replace=False)) for _ in range(30)])
    assert min_dist(maximin_design(medium_space, 16, seed=0)) > rand


def test_tiny_space_design(small_space):
    tiny = small_space.restrict(freqs_mhz=[1410], comm_sms=[4], slots=["qkv"])
    assert maximin_design(tiny, 5) == [0]


def test_system_configs_outside_the_space_are_skipped(medium_space):
    low = medium_space.restrict(comm_sms=[1, 2, 4, 8], slots=["qkv", "rope"])
    # No 32 SMs: the largest SM count stands in; no sequential slot: only the slotted one.
    assert [low.configs[i] for i in system_config_indices(low)] == [ScheduleConfig(1410, 8, "qkv")]


def test_initial_design_opens_with_the_system_configs_then_fills(medium_space):
    opening = system_config_indices(medium_space)
    design = initial_design(medium_space, 16, seed=4)
    assert design[:2] == opening and len(design) == len(set(design)) == 16
    assert set(design[2:]) == set(maximin_design(medium_space, 14, seed=4)) - set(opening)
    assert initial_design(medium_space, 16, system_configs=False, seed=4) == \
        maximin_design(medium_space, 16, seed=4)
    assert initial_design(medium_space, 1, seed=4) == opening[:1]
    rnd = initial_design(medium_space, 16, kind="random", seed=4)
    assert rnd[:2] == opening and len(set(rnd)) == 16
    with pytest.raises(ValueError, match="initial_design"):
        initial_design(medium_space, 16, kind="sobol")


def test_default_initial_size_is_half_the_budget_between_8_and_16():
    sizes = {b: default_initial_size(b) for b in (1, 6, 8, 10, 12, 16, 24, 31, 32, 96, 224)}
    assert sizes == {1: 1, 6: 6, 8: 8, 10: 8, 12: 8, 16: 8, 24: 12, 31: 15, 32: 16, 96: 16,
                     224: 16}


def test_design_balances_slot_backend_pairs(small_space):
    two = ConfigSpace(small_space.partition, "a100-40gb", freqs_mhz=[1410],
                      comm_sms=[2, 4, 8, 16], backends=["own", "nccl_capped"])
    idx = maximin_design(two, 12, seed=1)
    cfgs = [two.configs[i] for i in idx]
    assert len(set(idx)) == 12
    pairs = [(c.launch_slot, c.backend) for c in cfgs]
    assert len(set(pairs)) == 12  # 12 of the 12 slot-backend pairs, each once
    assert {c.backend for c in cfgs} == {"own", "nccl_capped"}
