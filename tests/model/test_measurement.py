import math
import re

import pytest

from kareus.model import Measurement


def test_static_and_dynamic_split():
    m = Measurement(time_s=2.0, energy_j=500.0, static_power_w=100.0)
    assert m.static_energy_j == 200.0
    assert m.dynamic_energy_j == 300.0
    assert m.average_power_w == 250.0
    assert Measurement.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_invalid_values_rejected(bad):
    with pytest.raises(ValueError, match="finite and >= 0"):
        Measurement(time_s=bad, energy_j=1.0, static_power_w=1.0)
    with pytest.raises(ValueError):
        Measurement(time_s=1.0, energy_j=bad, static_power_w=1.0)


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("time_s", 1e308, "time_s must be at most 1e+09"),  # finite, but sums overflow
    ("energy_j", 10**400, "finite and >= 0"),  # an integer beyond float range
    ("static_power_w", 2e7, "static_power_w must be at most 1e+07"),
])
def test_values_beyond_any_run_are_rejected(field, value, needle):
    good = {"time_s": 1.0, "energy_j": 1.0, "static_power_w": 1.0}
    with pytest.raises(ValueError, match=re.escape(needle)):
        Measurement(**{**good, field: value})
