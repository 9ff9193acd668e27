"""Shared test set-up.

Hypothesis runs derandomized by default, so a test run is reproducible and CI cannot
fail on an example no one has seen before. To hunt for new counter-examples, run
``python -m pytest --hypothesis-profile=explore`` (random, many more examples) and turn
whatever it finds into a fixed test.
"""

from __future__ import annotations

try:
    from hypothesis import settings
except ImportError:  # a bare install (no dev extra): the property-test modules skip themselves
    pass
else:
    settings.register_profile("default", derandomize=True, deadline=None)
    settings.register_profile("explore", derandomize=False, max_examples=500, deadline=None)
    settings.load_profile("default")
