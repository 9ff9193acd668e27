"""smoothed_frontier: measured configurations valued by surrogates fitted on all of them."""

from __future__ import annotations

import numpy as np
import pytest

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model import ConfigSpace
from kareus.profilers.emulator import EmulatedProfiler
from kareus.search import Observation, PartitionFrontier, PriorMean, smoothed_frontier


def _measured(space: ConfigSpace, n: int, *, noise: float = 0.01, seed: int = 0
              ) -> tuple[PartitionFrontier, list[Observation]]:
    """n random configurations measured with ``noise``, and the same noise-free."""
    rng = np.random.default_rng(seed)
    configs = [space.configs[i] for i in rng.choice(len(space), size=n, replace=False)]
    noisy = EmulatedProfiler("a100-40gb", noise=noise, seed=seed)
    exact = EmulatedProfiler("a100-40gb", noise=0.0)
    obs = [Observation(config=c, measurement=noisy.measure(space.partition, c)) for c in configs]
    truth = [Observation(config=c, measurement=exact.measure(space.partition, c))
             for c in configs]
    return PartitionFrontier.from_observations(space.partition.name, "a100-40gb", obs), truth


def _log_errors(obs: list[Observation], truth: list[Observation]) -> tuple[float, float]:
    t = np.log([o.time_s for o in obs]) - np.log([o.time_s for o in truth])
    e = np.log([o.energy_j for o in obs]) - np.log([o.energy_j for o in truth])
    return float(np.sqrt(np.mean(t ** 2))), float(np.sqrt(np.mean(e ** 2)))


def test_smoothing_pools_the_noise_of_single_measurements_out(medium_space):
    # The emulator's noise: about 1% on energy, a quarter of that on time. Energy is where
    # the luck of a single measurement sits; time keeps its sharp corners (where a
    # collective just hides), which a smooth model rounds off a little.
    pf, truth = _measured(medium_space, 120)
    smooth = smoothed_frontier(pf, medium_space, seed=0)
    raw_t, raw_e = _log_errors(list(pf.observations), truth)
    sm_t, sm_e = _log_errors(list(smooth.observations), truth)
    assert raw_e > 0.008  # 1% noise
    assert sm_e < 0.7 * raw_e, (raw_e, sm_e)
    assert sm_t < 1.1 * raw_t, (raw_t, sm_t)


def test_smoothing_keeps_the_configurations_and_their_static_power(medium_space):
    pf, _ = _measured(medium_space, 40)
    smooth = smoothed_frontier(pf, medium_space)
    assert [o.config for o in smooth.observations] == [o.config for o in pf.observations]
    assert [o.measurement.static_power_w for o in smooth.observations] == \
        [o.measurement.static_power_w for o in pf.observations]
    assert not any(o.predicted for o in smooth.observations)
    assert (smooth.partition, smooth.gpu) == (pf.partition, pf.gpu)
    again = smoothed_frontier(pf, medium_space)  # deterministic for a seed
    assert [o.measurement for o in again.observations] == \
        [o.measurement for o in smooth.observations]


def test_a_configuration_measured_twice_is_kept_once(small_space):
    pf, _ = _measured(small_space, 20)
    twice = PartitionFrontier.from_observations(pf.partition, pf.gpu,
                                                [*pf.observations, pf.observations[3]])
    smooth = smoothed_frontier(twice, small_space)
    assert [o.config for o in smooth.observations] == [o.config for o in pf.observations]


def test_smoothing_around_a_model_of_the_gpu(medium_space):
    # The prior mean is a model that is only roughly right (another emulated GPU's
    # constants, as the calibrated emulator is beside a real GPU); the surrogates smooth the
    # residual from it.
    from kareus.profilers.emulator import EmulatedGPU

    model = EmulatedProfiler(EmulatedGPU.from_spec("a100-40gb").perturbed(3), noise=0.0)
    mean = PriorMean.from_profiler(medium_space, model)
    for seed in (0, 1):
        pf, truth = _measured(medium_space, 120, seed=seed)
        smooth = smoothed_frontier(pf, medium_space, prior_mean=mean)
        raw_t, raw_e = _log_errors(list(pf.observations), truth)
        sm_t, sm_e = _log_errors(list(smooth.observations), truth)
        assert sm_e < 0.6 * raw_e, (seed, raw_e, sm_e)
        assert sm_t < 1.25 * raw_t, (seed, raw_t, sm_t)


def test_too_few_measurements_are_returned_as_they_are(small_space):
    pf, _ = _measured(small_space, 1)
    assert smoothed_frontier(pf, small_space) is pf
    empty = PartitionFrontier.from_observations(pf.partition, pf.gpu, [])
    assert smoothed_frontier(empty, small_space) is empty


def test_smoothing_refuses_what_it_cannot_smooth(small_space, medium_space):
    pf, _ = _measured(medium_space, 10)
    with pytest.raises(ArgumentError, match="not in the space"):
        smoothed_frontier(pf, small_space)  # medium_space's clocks and SM counts
    o = pf.observations[0]
    predicted = PartitionFrontier.from_observations(
        pf.partition, pf.gpu, [*pf.observations,
                               Observation(config=o.config, measurement=o.measurement,
                                           predicted=True)])
    with pytest.raises(ArgumentError, match="predicted"):
        smoothed_frontier(predicted, medium_space)
    with pytest.raises(ArgumentError, match="prior_mean predicts"):
        smoothed_frontier(pf, medium_space,
                          prior_mean=PriorMean.from_profiler(small_space,
                                                             EmulatedProfiler("a100-40gb",
                                                                              noise=0.0)))
    with pytest.raises(ArgumentTypeError, match="PartitionFrontier"):
        smoothed_frontier(list(pf.observations), medium_space)  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError, match="PriorMean"):
        smoothed_frontier(pf, medium_space, prior_mean=[1.0])  # type: ignore[arg-type]


def test_keep_time_smooths_the_energy_alone(medium_space):
    pf, truth = _measured(medium_space, 120)
    both = smoothed_frontier(pf, medium_space)
    energy = smoothed_frontier(pf, medium_space, keep_time=True)
    assert [o.time_s for o in energy.observations] == [o.time_s for o in pf.observations]
    assert [o.dynamic_energy_j for o in energy.observations] == \
        pytest.approx([o.dynamic_energy_j for o in both.observations], rel=1e-12)
    _, raw_e = _log_errors(list(pf.observations), truth)
    _, sm_e = _log_errors(list(energy.observations), truth)
    assert sm_e < 0.7 * raw_e
