"""Shared test set-up.

Hypothesis runs derandomized by default, so a test run is reproducible and CI cannot
fail on an example no one has seen before. To hunt for new counter-examples, run
``python -m pytest --hypothesis-profile=explore`` (random, many more examples) and turn
whatever it finds into a fixed test.

``one_torch_thread``: torch's intra-op threads set to one for a test (the modules of tiny
CPU models take it through ``pytestmark``); ``clean_spec_registry``: the models and GPUs a
test registered from spec files unregistered after it.
"""

from __future__ import annotations

import pytest

try:
    from hypothesis import settings
except ImportError:  # a bare install (no dev extra): the property-test modules skip themselves
    pass
else:
    settings.register_profile("default", derandomize=True, deadline=None)
    settings.register_profile("explore", derandomize=False, max_examples=500, deadline=None)
    settings.load_profile("default")


@pytest.fixture
def one_torch_thread():
    """torch's intra-op threads set to one for the test, restored after it: the models of
    the CPU tests are tiny, and more threads only contend (40x slower on a busy 2-core
    machine). A module takes it for every test with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def clean_spec_registry():
    """After the test, every model and GPU registered at run time (``kareus.model.files``)
    unregistered, so that no test sees another's."""
    from kareus.model import files

    yield
    for name in list(files.registered_models()) + list(files.registered_gpus()):
        files.unregister(name)


@pytest.fixture
def ctrl_c_delivered():
    """SIGINT raises ``KeyboardInterrupt`` in this process for the test, as in a terminal,
    restored after it: a process started in the background by a non-interactive shell
    (``command &``, ``nohup``) inherits SIGINT ignored, and Python then leaves it ignored,
    so an in-process Ctrl-C test would see nothing arrive."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
