"""The integrations' tests run tiny models: torch's intra-op threads only contend."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread():
    try:
        import torch
    except ImportError:  # the tests that need no torch still run
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
