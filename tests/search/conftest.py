"""Shared fixtures for the search tests: small partitions and spaces (fast)."""

from __future__ import annotations

import pytest

from kareus.model import ConfigSpace, Workload, build_partitions


@pytest.fixture(scope="session")
def llama_partitions():
    return build_partitions(Workload.preset("llama3.2-3b", tp=4, microbatch_size=8))


@pytest.fixture
def small_space(llama_partitions) -> ConfigSpace:
    """3 freqs x 6 SM counts x 6 slots = 108 configurations."""
    return ConfigSpace(llama_partitions["fwd_attn"], "a100-40gb",
                       freqs_mhz=[1410, 1200, 990], comm_sms=[1, 2, 4, 8, 16, 32])


@pytest.fixture
def medium_space(llama_partitions) -> ConfigSpace:
    """6 freqs x 12 SM counts x 6 slots = 432 configurations."""
    return ConfigSpace(llama_partitions["fwd_attn"], "a100-40gb",
                       freqs_mhz=[1410, 1320, 1230, 1140, 1050, 960],
                       comm_sms=[1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32])
