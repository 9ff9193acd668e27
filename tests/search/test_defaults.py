"""The search's defaults: kareus's pass mix, the reference artifact's, the surrogates."""

from __future__ import annotations

from kareus.search import (
    SURROGATES,
    BootstrapEnsemble,
    GaussianProcessSurrogate,
    XGBoostSurrogate,
    allocate,
    default_passes,
    default_surrogate,
    prior_mean_passes,
    reference_passes,
    tree_surrogate,
)


def test_default_and_reference_mixes():
    mix = default_passes()
    assert [w for _, w in mix] == [0.3, 0.1, 0.2, 0.1, 0.1]
    assert [p.name for p, _ in mix] == ["hv-total", "hv-dynamic", "local",
                                        "hv-total-optimistic2", "hinge"]
    # In batches of 8, every pass gets a slot.
    assert allocate([w for _, w in mix], 8) == [3, 1, 2, 1, 1]
    # The reference artifact's mix: 40% total, 20% dynamic, 20% lowest time, the rest spread.
    assert [w for _, w in reference_passes()] == [0.4, 0.2, 0.2, 0.2]
    assert [p.name for p, _ in reference_passes()] == ["hv-total", "hv-dynamic", "hv-static",
                                                       "uncertainty"]


def test_prior_mean_mix_spreads_two_of_eight_over_the_clocks():
    mix = prior_mean_passes()
    assert [p.name for p, _ in mix] == ["hv-total", "hv-dynamic", "local",
                                        "hv-total-optimistic2", "clock-sweep"]
    assert allocate([w for _, w in mix], 8) == [3, 1, 1, 1, 2]


def test_surrogate_templates():
    gp = default_surrogate(3)
    assert isinstance(gp, GaussianProcessSurrogate) and not gp.fitted
    assert gp.features == (0, 1, 2, 3, 4) and gp.log_features == (1,)
    trees = tree_surrogate(3)
    assert isinstance(trees, BootstrapEnsemble) and trees.seed == 3
    assert trees.n_models == 5 and trees.fraction == 0.8
    assert isinstance(trees.base, XGBoostSurrogate) and trees.base.trend_features == (0,)
    assert set(SURROGATES) == {"gp", "trees"}
    assert type(SURROGATES["gp"](0)) is GaussianProcessSurrogate
    assert type(SURROGATES["trees"](0)) is BootstrapEnsemble
