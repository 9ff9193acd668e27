"""Absurd arguments to the public callables of kareus.model, kareus.search, kareus.compose
and kareus.testing's checks: each is refused with a typed kareus error (also the built-in
ValueError or TypeError that fits) whose one-line message names the parameter.

One row per (callable, parameter); each row is tried with every absurd value of its kind:
a value of the wrong type, negative, NaN, infinite, zero where a positive value is needed,
and huge where the parameter has a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from kareus.errors import KareusError

WRONG_TYPE = ["3", None, [1]]
COUNT = ["3", 2.5, True, -1, 0, math.nan, math.inf]          # a whole number >= 1
SEED = ["3", 2.5, True, -1, math.nan]                         # a whole number >= 0
POSITIVE = ["1", True, -1.0, 0.0, math.nan, -math.inf]        # a positive number (inf: no limit)
FINITE_POSITIVE = [*POSITIVE, math.inf, 10**400]
NONNEG = ["1", True, -1.0, math.nan, math.inf, 10**400]       # a finite number >= 0
FRACTION = ["1", True, -0.5, 0.0, 1.5, math.nan, math.inf]    # in (0, 1]
HUGE = [10**30]


def _space():  # type: ignore[no-untyped-def]
    from kareus.model import ConfigSpace, Workload, build_partitions

    part = build_partitions(Workload.preset("qwen3-1.7b", tp=2, microbatch_size=2,
                                            seq_len=1024)).types["fwd_mlp"]
    return ConfigSpace(part, "h200-sxm", freqs_mhz=[1980, 1410], comm_sms=[4, 8])


def _frontier():  # type: ignore[no-untyped-def]
    from kareus.compose import IterationFrontier, IterationPoint
    from kareus.testing import make_test_plan

    plan = make_test_plan()
    return IterationFrontier(points=[IterationPoint(time_s=plan.time_s, energy_j=plan.energy_j,
                                                    plan=plan)])


def _model(name: str) -> Callable[..., Any]:
    import kareus.model as m

    return getattr(m, name)


def _search(name: str) -> Callable[..., Any]:
    import kareus.search as s

    return getattr(s, name)


def _compose(name: str) -> Callable[..., Any]:
    import kareus.compose as c

    return getattr(c, name)


def _testing(name: str) -> Callable[..., Any]:
    import kareus.testing as t

    return getattr(t, name)


def _wl(**kw: Any) -> Any:
    return _model("Workload").preset("qwen3-1.7b", tp=2, **kw)


# (label, parameter, absurd values, call with the value)
ROWS: list[tuple[str, str, list[Any], Callable[[Any], Any]]] = [
    # kareus.model
    # (a clock or SM count of 0 is the space's to refuse: ConfigSpace.validate, below)
    ("ScheduleConfig", "freq_mhz", [*SEED, math.inf, *HUGE],
     lambda v: _model("ScheduleConfig")(v, 8)),
    ("ScheduleConfig", "comm_sms", [*SEED, math.inf, *HUGE],
     lambda v: _model("ScheduleConfig")(1410, v)),
    ("ConfigSpace.validate", "comm_sms", [0, 10_000],
     lambda v: _space().validate(_model("ScheduleConfig")(1410, v))),
    ("ConfigSpace.validate", "freq_mhz", [0, 1411],
     lambda v: _space().validate(_model("ScheduleConfig")(v, 8))),
    ("Measurement", "time_s", NONNEG,
     lambda v: _model("Measurement")(time_s=v, energy_j=1.0, static_power_w=1.0)),
    ("Measurement", "energy_j", NONNEG,
     lambda v: _model("Measurement")(time_s=1.0, energy_j=v, static_power_w=1.0)),
    ("Measurement", "static_power_w", NONNEG,
     lambda v: _model("Measurement")(time_s=1.0, energy_j=1.0, static_power_w=v)),
    *[("Parallelism", p, [*COUNT, *HUGE], lambda v, p=p: _model("Parallelism")(**{p: v}))
      for p in ("tp", "cp", "pp", "dp")],
    *[("Workload", p, [*COUNT, *HUGE], lambda v, p=p: _wl(**{p: v}))
      for p in ("microbatch_size", "seq_len", "num_microbatches", "nanobatches",
                "dtype_bytes")],
    ("Workload.preset", "name", [3, None, "no-such-model"],
     lambda v: _model("Workload").preset(v)),
    ("get_gpu", "gpu", [3, None, "no-such-gpu"], lambda v: _model("get_gpu")(v)),
    ("get_model", "model", [3, None, "no-such-model"], lambda v: _model("get_model")(v)),
    ("get_schedule", "schedule", [3, "no-such-schedule"],
     lambda v: _model("get_schedule")(v, 2, 2)),
    *[(f, "num_stages", COUNT, lambda v, f=f: _model(f)(v, 2))
      for f in ("one_f_one_b", "gpipe")],
    *[(f, "num_microbatches", COUNT, lambda v, f=f: _model(f)(2, v))
      for f in ("one_f_one_b", "gpipe")],
    # kareus.search
    ("SearchSpec", "budget", COUNT, lambda v: _search("SearchSpec")(budget=v)),
    ("SearchSpec", "batch_size", COUNT, lambda v: _search("SearchSpec")(batch_size=v)),
    ("SearchSpec", "seed", SEED, lambda v: _search("SearchSpec")(seed=v)),
    *[("MultiPassSearch", p, COUNT,
       lambda v, p=p: _search("MultiPassSearch")(_space(), **{p: v}))
      for p in ("batch_size", "budget", "initial_size", "stop_patience")],
    ("MultiPassSearch", "seed", SEED, lambda v: _search("MultiPassSearch")(_space(), seed=v)),
    ("MultiPassSearch", "stop_tol", NONNEG,
     lambda v: _search("MultiPassSearch")(_space(), stop_tol=v)),
    ("MultiPassSearch", "space", WRONG_TYPE, lambda v: _search("MultiPassSearch")(v)),
    ("default_initial_size", "budget", COUNT, lambda v: _search("default_initial_size")(v)),
    ("maximin_design", "n", COUNT, lambda v: _search("maximin_design")(_space(), v)),
    ("allocate", "k", ["3", 2.5, -1, math.nan], lambda v: _search("allocate")([1.0, 1.0], v)),
    ("HypervolumePass", "margin", NONNEG, lambda v: _search("HypervolumePass")(margin=v)),
    ("HypervolumePass", "optimism", NONNEG, lambda v: _search("HypervolumePass")(optimism=v)),
    ("BootstrapEnsemble", "n_models", COUNT,
     lambda v: _search("BootstrapEnsemble")(n_models=v)),
    ("BootstrapEnsemble", "fraction", FRACTION,
     lambda v: _search("BootstrapEnsemble")(fraction=v)),
    ("GaussianProcessSurrogate", "max_iter", COUNT,
     lambda v: _search("GaussianProcessSurrogate")(max_iter=v)),
    ("XGBoostSurrogate", "n_estimators", COUNT,
     lambda v: _search("XGBoostSurrogate")(n_estimators=v)),
    ("XGBoostSurrogate", "learning_rate", FINITE_POSITIVE,
     lambda v: _search("XGBoostSurrogate")(learning_rate=v)),
    # kareus.compose
    ("IterationFrontier.select", "deadline_s", POSITIVE,
     lambda v: _frontier().select(deadline_s=v)),
    ("IterationFrontier.select", "energy_budget_j", POSITIVE,
     lambda v: _frontier().select(energy_budget_j=v)),
    ("IterationComposer", "unit_s", FINITE_POSITIVE,
     lambda v: _compose("IterationComposer")(unit_s=v)),
    ("IterationComposer", "resolution", FRACTION,
     lambda v: _compose("IterationComposer")(resolution=v)),
    # kareus.testing
    ("FakeProfiler", "noise", NONNEG, lambda v: _testing("FakeProfiler")(noise=v)),
    ("FakeProfiler", "seed", SEED, lambda v: _testing("FakeProfiler")(seed=v)),
    ("FakeProfiler", "gpu", [3, "no-such-gpu"], lambda v: _testing("FakeProfiler")(v)),
    *[(f, "make", [3, None], lambda v, f=f: _testing(f)(v))
      for f in ("check_surrogate", "check_acquisition_pass", "check_profiler",
                "check_partition", "check_microbatch_composer", "check_iteration_composer")],
    *[(f, "skip", ["type", ("no-such-check",)], lambda v, f=f: _testing(f)(object, skip=v))
      for f in ("check_surrogate", "check_acquisition_pass", "check_profiler",
                "check_partition", "check_microbatch_composer", "check_iteration_composer")],
    ("make_acquisition_context", "n", COUNT, lambda v: _testing("make_acquisition_context")(v)),
]

CASES = [pytest.param(call, param, value, id=f"{label}-{param}-{value!r:.12}")
         for label, param, values, call in ROWS for value in values]


@pytest.mark.parametrize(("call", "param", "value"), CASES)
def test_an_absurd_argument_is_a_typed_error_naming_the_parameter(call, param, value):
    with pytest.raises(KareusError) as err:
        call(value)
    assert isinstance(err.value, (ValueError, TypeError))
    msg = str(err.value)
    names = {"name": ("model", "workload", "name"), "gpu": ("gpu", "GPU"),
             "model": ("model", "workload"), "schedule": ("schedule",)}.get(param, (param,))
    assert any(n in msg for n in names), f"{msg!r} does not name {param}"
    assert "\n" not in msg and " --" not in msg


def test_save_onto_a_folder_names_the_folder_not_a_temporary_file(tmp_path):
    from kareus.errors import OutputError
    from kareus.testing import make_test_plan

    for obj in (make_test_plan(), _frontier()):
        with pytest.raises(OutputError, match="is a folder, not a file") as err:
            obj.save(tmp_path)
        assert ".tmp" not in str(err.value) and isinstance(err.value, ValueError)


def test_select_with_both_limits_or_none_is_an_argument_error():
    from kareus.errors import ArgumentError, InfeasibleError

    fr = _frontier()
    for kwargs in ({}, {"deadline_s": 1.0, "energy_budget_j": 1.0}):
        with pytest.raises(ArgumentError, match="exactly one of deadline_s= or energy_budget_j=") \
                as err:
            fr.select(**kwargs)
        assert not isinstance(err.value, InfeasibleError)
    assert fr.select(deadline_s=math.inf) is fr[0].plan  # no limit: the lowest energy
    with pytest.raises(InfeasibleError, match="deadline"):  # a limit nothing meets
        fr.select(deadline_s=fr[0].time_s / 2)
