"""Fakes and conformance suites for testing kareus and plug-ins written for it.

* :class:`FakeProfiler` - a cheap analytic :class:`~kareus.exec.Profiler`: roofline op
  times, a communication kernel that speeds up with its SM count until the link
  saturates, a walk through the computation after the launch slot with fewer SMs and
  some HBM contention, and power that grows with frequency and voltage. It is a toy
  (the calibrated model is :class:`kareus.exec.emulator.EmulatedProfiler`), but it has
  the shape that matters to a search: a real time-energy trade-off across frequencies
  and SM counts, slots that matter, and seeded multiplicative noise.
* :func:`check_surrogate` - conformance checks for any :class:`~kareus.search.Surrogate`.
* :func:`check_acquisition_pass` - conformance checks for any
  :class:`~kareus.search.AcquisitionPass`.

Each check raises ``AssertionError`` saying what is wrong. To run them as separate
pytest tests, subclass :class:`SurrogateConformance` or :class:`AcquisitionPassConformance`
in a ``Test*`` class and implement the factory method::

    class TestMySurrogate(SurrogateConformance):
        def make_surrogate(self):
            return MySurrogate(seed=0)

This module imports neither pytest nor any hardware library.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kareus.model.config import ScheduleConfig
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.measurement import Measurement
from kareus.model.ops import CommKind
from kareus.model.partition import Partition
from kareus.model.profiler import Profiler
from kareus.search.acquisition import AcquisitionContext, AcquisitionPass
from kareus.search.surrogate import ObjectivePrediction, Surrogate

__all__ = [
    "AcquisitionPassConformance",
    "FakeProfiler",
    "SurrogateConformance",
    "check_acquisition_pass",
    "check_surrogate",
    "make_acquisition_context",
]


# -------------------------------------------------------------------------- FakeProfiler


class FakeProfiler(Profiler):
    """A cheap analytic profiler for tests (not calibrated; see the module docstring).

    Args:
        gpu: GPU preset name or spec.
        noise: Relative standard deviation of multiplicative noise on time and energy
            (0 = deterministic).
        seed: Seed of the noise.

    Attributes:
        calls: Every ``(partition name, config)`` measured, in order.
    """

    def __init__(self, gpu: str | GPUSpec = "a100-40gb", *, noise: float = 0.0,
                 seed: int = 0) -> None:
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        self.gpu = get_gpu(gpu)
        self.noise = float(noise)
        self.seed = int(seed)
        self._rng = np.random.default_rng(seed)
        self.calls: list[tuple[str, ScheduleConfig]] = []

    # Model constants (per GPU): per-SM copy throughput and comm power, as fractions.
    _PER_SM_GBPS = 18.0
    _MEM_CONTENTION = 0.35

    def _op_time(self, flops: float, nbytes: float, f: float, sms: int,
                 compute_bound: bool, contended: bool) -> float:
        g = self.gpu
        fr = f / g.max_clock_mhz
        compute = flops / (g.bf16_peak_tflops * 1e12 * (sms / g.sm_count) * fr)
        bw = g.hbm_bandwidth_gbps * 1e9 * min(1.0, 0.55 + 0.45 * fr)
        if contended:
            bw /= 1.0 + self._MEM_CONTENTION * (0.4 if compute_bound else 1.0)
        return max(compute, nbytes / bw) + 4e-6

    def _comm_time(self, partition: Partition, sms: int, f: float) -> float:
        c = partition.comm_op
        g = c.group_size
        factor = 2.0 * (g - 1) / g if c.kind is CommKind.ALL_REDUCE else (g - 1) / g
        rate = min(self.gpu.nvlink_bandwidth_gbps / 2, self._PER_SM_GBPS * sms) * 1e9
        rate *= 0.8 + 0.2 * f / self.gpu.max_clock_mhz
        return c.bytes * factor / rate + 8e-6

    def _simulate(self, partition: Partition, config: ScheduleConfig) -> tuple[float, float]:
        g = self.gpu
        f, s = float(config.freq_mhz), int(config.comm_sms)
        ops = partition.compute_ops
        t_comm = self._comm_time(partition, s, f)
        fr = f / g.max_clock_mhz
        volt = 0.65 + 0.35 * fr
        p_compute = (g.power_limit_w - g.static_power_w) * 0.9 * fr * volt ** 2
        p_comm = 40.0 * min(s, 32) / 32 * volt ** 2 + 25.0
        busy_compute = 0.0
        if config.launch_slot is None:
            t = sum(self._op_time(op.flops, op.bytes_moved, f, g.sm_count, op.compute_bound,
                                  False) for op in ops)
            busy_compute = t
            total = t + t_comm
        else:
            start = partition.slot(config.launch_slot).index
            total = 0.0
            for op in ops[:start]:
                total += self._op_time(op.flops, op.bytes_moved, f, g.sm_count,
                                       op.compute_bound, False)
            busy_compute = total
            left = t_comm
            for op in ops[start:]:
                if left <= 0:
                    d = self._op_time(op.flops, op.bytes_moved, f, g.sm_count,
                                      op.compute_bound, False)
                else:
                    slow = self._op_time(op.flops, op.bytes_moved, f, g.sm_count - s,
                                         op.compute_bound, True)
                    comm_rate = 1.0 / (1.0 + (0.25 if not op.compute_bound else 0.05))
                    if left >= slow * comm_rate:
                        d = slow
                        left -= slow * comm_rate
                    else:
                        frac = left / comm_rate / slow
                        fast = self._op_time(op.flops, op.bytes_moved, f, g.sm_count,
                                             op.compute_bound, False)
                        d = slow * frac + fast * (1 - frac)
                        left = 0.0
                total += d
                busy_compute += d
            total += max(left, 0.0)
        n = partition.comm_op.group_size
        dynamic = n * (p_compute * busy_compute + p_comm * t_comm)
        energy = total * g.static_power_w * n + dynamic
        return total, energy

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Model ``partition`` under ``config`` (scope: the partition's group of GPUs)."""
        if not isinstance(partition, Partition):
            raise TypeError(f"partition must be a kareus Partition, got "
                            f"{type(partition).__name__}")
        self.space(partition).validate(config)  # typed ConfigErrors for impossible configs
        self.calls.append((partition.name, config))
        t, e = self._simulate(partition, config)
        if self.noise > 0:
            t *= float(np.exp(self._rng.normal(0.0, self.noise)))
            e *= float(np.exp(self._rng.normal(0.0, self.noise)))
        n = partition.comm_op.group_size
        return Measurement(time_s=t, energy_j=e, static_power_w=self.gpu.static_power_w * n)

    def __repr__(self) -> str:
        return f"FakeProfiler({self.gpu.name!r}, noise={self.noise}, seed={self.seed})"


# ------------------------------------------------------------------ surrogate conformance


def _toy_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features shaped like ConfigSpace's (MHz, SMs, slot position, log intensity,
    sequential) and a smooth log-time-like target."""
    rng = np.random.default_rng(seed)
    f = rng.choice(np.arange(900, 1411, 30), n).astype(float)
    s = rng.integers(1, 33, n).astype(float)
    pos = rng.choice([0.0, 0.2, 0.5, 0.8, 1.0], n)
    lai = np.where(pos == 1.0, 0.0, rng.choice([0.5, 2.5], n))
    seq = (pos == 1.0).astype(float)
    x = np.column_stack([f, s, pos, lai, seq])
    y = np.log(1.0 / f * 1e3 + 3.0 / np.minimum(s, 12) + 0.5 * pos + 0.3 * seq)
    return x, y


def _check_type(make: Callable[[], Surrogate]) -> None:
    s = make()
    assert isinstance(s, Surrogate), f"factory returned {type(s).__name__}, not a Surrogate"
    assert not s.fitted, "a new surrogate must report fitted == False"


def _check_predict_before_fit(make: Callable[[], Surrogate]) -> None:
    x, _ = _toy_data(5, 0)
    try:
        make().predict(x)
    except RuntimeError:
        return
    raise AssertionError("predict before fit must raise RuntimeError")


def _check_fit_predict_shapes(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(60, 1)
    s = make()
    out = s.fit(x, y)
    assert out is s, "fit must return self"
    assert s.fitted, "fitted must be True after fit"
    p = s.predict(x[:17])
    assert isinstance(p, np.ndarray) and p.shape == (17,), \
        f"predict must return an array of shape (17,), got {getattr(p, 'shape', type(p))}"
    assert np.issubdtype(p.dtype, np.floating) and np.isfinite(p).all(), \
        "predictions must be finite floats"
    assert s.predict(x[:0]).shape == (0,), "predict on zero rows must return shape (0,)"


def _check_learns(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(300, 2)
    xt, yt = _toy_data(200, 3)
    p = make().fit(x, y).predict(xt)
    r2 = 1 - np.sum((p - yt) ** 2) / np.sum((yt - yt.mean()) ** 2)
    assert r2 >= 0.7, f"surrogate fits a smooth function poorly: held-out R^2 = {r2:.3f} < 0.7"


def _check_no_mutation(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(40, 4)
    x0, y0 = x.copy(), y.copy()
    s = make().fit(x, y)
    s.predict(x)
    assert np.array_equal(x, x0) and np.array_equal(y, y0), "fit/predict must not modify inputs"


def _check_bad_shapes(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(20, 5)
    for bad_x, bad_y, what in [(x, y[:-1], "y shorter than X"), (x[:, 0], y, "1-D X"),
                               (x, np.full(20, np.nan), "NaN targets")]:
        try:
            make().fit(bad_x, bad_y)
        except ValueError:
            continue
        raise AssertionError(f"fit must raise ValueError for {what}")


def _check_tiny_and_constant(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(10, 6)
    for n in (1, 2):
        p = make().fit(x[:n], y[:n]).predict(x)
        assert p.shape == (10,) and np.isfinite(p).all(), f"fit on {n} samples must predict"
    p = make().fit(x, np.full(10, 2.5)).predict(x)
    assert np.allclose(p, 2.5, atol=1e-3), "a constant target must be predicted as that constant"


def _check_clone(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(50, 7)
    s = make().fit(x, y)
    before = s.predict(x)
    c = s.clone(seed=123)
    assert type(c) is type(s), "clone must return the same type"
    assert c is not s and not c.fitted, "clone must return a new, unfitted surrogate"
    c.fit(x, -y)
    assert np.allclose(s.predict(x), before), "fitting a clone must not change the original"


def _check_spread(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(60, 8)
    s = make().fit(x, y)
    if not s.has_spread:
        try:
            s.predict_spread(x)
        except NotImplementedError:
            return
        raise AssertionError("has_spread is False, so predict_spread must raise "
                             "NotImplementedError")
    mean, spread = s.predict_spread(x)
    assert mean.shape == (60,) and spread.shape == (60,), "predict_spread shapes must be (n,)"
    assert np.isfinite(spread).all() and (spread >= 0).all(), "spread must be finite and >= 0"
    assert np.allclose(mean, s.predict(x)), "predict_spread's mean must equal predict"


def _check_deterministic(make: Callable[[], Surrogate]) -> None:
    x, y = _toy_data(80, 9)
    a = make().fit(x, y).predict(x)
    b = make().fit(x, y).predict(x)
    assert np.allclose(a, b), "two surrogates made alike and fitted alike must predict alike"


SURROGATE_CHECKS: dict[str, Callable[[Callable[[], Surrogate]], None]] = {
    "type": _check_type,
    "predict_before_fit": _check_predict_before_fit,
    "fit_predict_shapes": _check_fit_predict_shapes,
    "learns": _check_learns,
    "no_mutation": _check_no_mutation,
    "bad_shapes": _check_bad_shapes,
    "tiny_and_constant": _check_tiny_and_constant,
    "clone": _check_clone,
    "spread": _check_spread,
    "deterministic": _check_deterministic,
}


def check_surrogate(make: Callable[[], Surrogate], *, skip: tuple[str, ...] = ()) -> None:
    """Run every surrogate conformance check on surrogates made by ``make``.

    Args:
        make: Returns a new, unfitted surrogate each call (same settings and seed).
        skip: Names (keys of :data:`SURROGATE_CHECKS`) to skip, e.g. ``("deterministic",)``
            for a surrogate that cannot be seeded.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("surrogate", SURROGATE_CHECKS, skip, make)


def _run_checks(what: str, checks: dict[str, Callable[..., None]], skip: tuple[str, ...],
                *args: Any) -> None:
    """Run ``checks`` (name -> check) on ``args``, naming the first that fails."""
    for name, check in checks.items():
        if name in skip:
            continue
        try:
            check(*args)
        except AssertionError as e:
            raise AssertionError(f"{what} conformance check {name!r} failed: {e}") from e


# ------------------------------------------------------------------- pass conformance


def make_acquisition_context(n: int = 200, *, m: int = 12, seed: int = 0,
                             spread: bool = True, n_chosen: int = 0,
                             unavailable: float = 0.3) -> AcquisitionContext:
    """A random but plausible context: ``n`` candidates with predictions, ``m`` observed
    points, a share ``unavailable`` of candidates not available, and ``n_chosen`` of them
    already chosen for the batch."""
    rng = np.random.default_rng(seed)
    t = rng.uniform(1e-3, 3e-3, n)
    d = 0.5 / t * 1e-3 * rng.uniform(0.8, 1.2, n)  # a time-energy trade-off
    pred = ObjectivePrediction(
        time_s=t, dynamic_energy_j=d, static_power_w=340.0,
        time_spread=rng.uniform(0, 0.2, n) if spread else None,
        dynamic_spread=rng.uniform(0, 0.2, n) if spread else None)
    available = rng.random(n) >= unavailable
    ot = rng.uniform(1e-3, 3e-3, m)
    od = 0.5 / ot * 1e-3 * rng.uniform(0.9, 1.3, m)
    ctx = AcquisitionContext(prediction=pred, available=available, observed_time_s=ot,
                             observed_energy_j=od + 340.0 * ot,
                             observed_static_power_w=np.full(m, 340.0),
                             rng=np.random.default_rng(seed + 1))
    if n_chosen:
        ctx = ctx.with_chosen(rng.choice(np.flatnonzero(ctx.available), n_chosen,
                                         replace=False))
    return ctx


def _valid_picks(picks: Any, ctx: AcquisitionContext, k: int) -> np.ndarray:
    arr = np.asarray(picks)
    assert arr.ndim == 1, f"select must return a 1-D array of indices, got shape {arr.shape}"
    assert arr.size == 0 or np.issubdtype(arr.dtype, np.integer), \
        f"select must return integer indices, got dtype {arr.dtype}"
    assert arr.size <= k, f"select returned {arr.size} > k={k} candidates"
    assert len(set(arr.tolist())) == arr.size, "select returned a candidate twice"
    assert ((arr >= 0) & (arr < ctx.n_candidates)).all(), "select returned an out-of-range index"
    assert ctx.available[arr].all(), "select returned a candidate that is not available"
    return arr


def _check_pass_basic(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    assert isinstance(p, AcquisitionPass), f"factory returned {type(p).__name__}"
    assert isinstance(p.name, str) and p.name, "name must be a non-empty string"
    for seed in range(3):
        ctx = make_acquisition_context(seed=seed)
        for k in (1, 5, 17):
            arr = _valid_picks(p.select(ctx, k), ctx, k)
            assert arr.size == min(k, int(ctx.available.sum())), \
                f"select must fill its share: asked {k}, got {arr.size}"


def _check_pass_edges(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    ctx = make_acquisition_context(seed=4)
    assert _valid_picks(p.select(ctx, 0), ctx, 0).size == 0, "k=0 must select nothing"
    none = AcquisitionContext(prediction=ctx.prediction,
                              available=np.zeros(ctx.n_candidates, dtype=bool),
                              observed_time_s=ctx.observed_time_s,
                              observed_energy_j=ctx.observed_energy_j,
                              observed_static_power_w=ctx.observed_static_power_w)
    assert _valid_picks(p.select(none, 5), none, 5).size == 0, \
        "with nothing available, select must return nothing"
    few = make_acquisition_context(n=10, seed=5, unavailable=0.7)
    arr = _valid_picks(p.select(few, 10), few, 10)
    assert arr.size == int(few.available.sum()), "select must take every available candidate " \
        "when k exceeds them"
    one = make_acquisition_context(m=1, seed=6)
    _valid_picks(p.select(one, 4), one, 4)


def _check_pass_variants(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    for kwargs in ({"spread": False}, {"n_chosen": 6}):
        ctx = make_acquisition_context(seed=7, **kwargs)  # type: ignore[arg-type]
        arr = _valid_picks(p.select(ctx, 8), ctx, 8)
        assert arr.size == 8, f"select must fill its share in a context with {kwargs}"
        assert not np.isin(arr, ctx.chosen).any(), "select picked a candidate already chosen"


def _check_pass_pure(make: Callable[[], AcquisitionPass]) -> None:
    p = make()
    ctx = make_acquisition_context(seed=8)
    avail = ctx.available.copy()
    t = ctx.prediction.time_s.copy()
    p.select(ctx, 9)
    assert np.array_equal(ctx.available, avail), "select must not modify context.available"
    assert np.array_equal(ctx.prediction.time_s, t), "select must not modify predictions"
    a = np.asarray(make().select(make_acquisition_context(seed=9), 9))
    b = np.asarray(make().select(make_acquisition_context(seed=9), 9))
    assert np.array_equal(a, b), "select must be deterministic for a given context and rng seed"


PASS_CHECKS: dict[str, Callable[[Callable[[], AcquisitionPass]], None]] = {
    "basic": _check_pass_basic,
    "edges": _check_pass_edges,
    "variants": _check_pass_variants,
    "pure": _check_pass_pure,
}


def check_acquisition_pass(make: Callable[[], AcquisitionPass], *,
                           skip: tuple[str, ...] = ()) -> None:
    """Run every acquisition-pass conformance check on passes made by ``make``.

    Raises:
        AssertionError: naming the first check that fails.
    """
    _run_checks("acquisition pass", PASS_CHECKS, skip, make)


# ------------------------------------------------------------------ pytest mix-ins


def _add_tests(cls: type, checks: dict[str, Callable[..., None]],
               args: Callable[[Any], tuple[Any, ...]]) -> type:
    """Give ``cls`` one pytest test per check, called with ``args(self)``."""
    for name, check in checks.items():
        def test(self: Any, _check: Callable[..., None] = check, _name: str = name) -> None:
            if _name in getattr(self, "skip_checks", ()):
                return
            _check(*args(self))
        test.__name__ = f"test_conformance_{name}"
        test.__doc__ = f"Conformance check {name!r}."
        setattr(cls, test.__name__, test)
    return cls


class SurrogateConformance:
    """Mix-in: subclass in a ``Test*`` class and implement :meth:`make_surrogate`; pytest
    then runs one test per check. Set ``skip_checks`` to a tuple of names to skip."""

    skip_checks: tuple[str, ...] = ()

    def make_surrogate(self) -> Surrogate:
        raise NotImplementedError("implement make_surrogate() to return a new surrogate")


class AcquisitionPassConformance:
    """Mix-in: subclass in a ``Test*`` class and implement :meth:`make_pass`."""

    skip_checks: tuple[str, ...] = ()

    def make_pass(self) -> AcquisitionPass:
        raise NotImplementedError("implement make_pass() to return a new pass")


_add_tests(SurrogateConformance, SURROGATE_CHECKS, lambda self: (self.make_surrogate,))
_add_tests(AcquisitionPassConformance, PASS_CHECKS, lambda self: (self.make_pass,))


# -------------------------------------------------------------------- profiler conformance


def _default_partition() -> Partition:
    from kareus.model.partition import build_partitions  # noqa: PLC0415
    from kareus.model.workload import Workload  # noqa: PLC0415

    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=2, seq_len=1024)
    return build_partitions(wl)["fwd_attn"]


def _sample_configs(profiler: Profiler, partition: Partition, k: int = 6) -> list[ScheduleConfig]:
    space = profiler.space(partition)
    cfgs = space.configs
    idx = np.unique(np.linspace(0, len(cfgs) - 1, min(k, len(cfgs))).round().astype(int))
    picks = [cfgs[i] for i in idx]
    seq = [c for c in cfgs if c.launch_slot is None]
    if seq and seq[0] not in picks:
        picks.append(seq[0])
    return picks


def _check_profiler_type(make: Callable[[], Profiler], partition: Partition) -> None:
    from kareus.model.config import ConfigSpace  # noqa: PLC0415

    p = make()
    assert isinstance(p, Profiler), f"factory returned {type(p).__name__}, not a Profiler"
    assert isinstance(p.gpu, GPUSpec), "profiler.gpu must be a GPUSpec"
    space = p.space(partition)
    assert isinstance(space, ConfigSpace) and len(space) > 0, \
        "space(partition) must return a non-empty ConfigSpace"
    assert space.partition.name == partition.name, "space(partition) is of another partition"


def _check_profiler_measurements(make: Callable[[], Profiler], partition: Partition) -> None:
    p = make()
    for c in _sample_configs(p, partition):
        m = p.measure(partition, c)
        assert isinstance(m, Measurement), f"measure must return a Measurement, got {type(m)}"
        assert m.time_s > 0 and m.energy_j > 0, f"{c}: time and energy must be > 0, got {m}"
        assert m.static_power_w > 0, f"{c}: static_power_w must be > 0"


def _check_profiler_static_power(make: Callable[[], Profiler], partition: Partition) -> None:
    p = make()
    for g in (1, 2, 4, 8):
        w = p.static_power_w(g)
        assert np.isfinite(w) and w > 0, f"static_power_w({g}) must be finite and > 0, got {w}"
    assert p.static_power_w(8) > p.static_power_w(1), "more GPUs must draw more static power"


def _check_profiler_rejects_bad_configs(make: Callable[[], Profiler],
                                        partition: Partition) -> None:
    from kareus.errors import ConfigError  # noqa: PLC0415

    p = make()
    good = _sample_configs(p, partition, 1)[0]
    bad = [ScheduleConfig(good.freq_mhz, p.gpu.sm_count + 5, good.launch_slot),
           ScheduleConfig(good.freq_mhz, 0, good.launch_slot),
           ScheduleConfig(p.gpu.max_clock_mhz + 1, good.comm_sms, good.launch_slot),
           ScheduleConfig(good.freq_mhz, good.comm_sms, "no-such-slot")]
    for c in bad:
        try:
            p.measure(partition, c)
        except ConfigError:
            continue
        raise AssertionError(f"measure must raise a kareus ConfigError for {c}")


PROFILER_CHECKS: dict[str, Callable[[Callable[[], Profiler], Partition], None]] = {
    "type": _check_profiler_type,
    "measurements": _check_profiler_measurements,
    "static_power": _check_profiler_static_power,
    "rejects_bad_configs": _check_profiler_rejects_bad_configs,
}


def check_profiler(make: Callable[[], Profiler], *, partition: Partition | None = None,
                   skip: tuple[str, ...] = ()) -> None:
    """Run every profiler conformance check on profilers made by ``make``.

    Args:
        make: Returns a new profiler each call.
        partition: A partition the profiler can measure; ``None`` = a small Llama 3.2 3B
            forward-attention partition at TP=4.
        skip: Names (keys of :data:`PROFILER_CHECKS`) to skip.

    Raises:
        AssertionError: naming the first check that fails.
    """
    part = _default_partition() if partition is None else partition
    _run_checks("profiler", PROFILER_CHECKS, skip, make, part)


class ProfilerConformance:
    """Mix-in: subclass in a ``Test*`` class and implement :meth:`make_profiler` (and
    optionally :meth:`make_partition`); pytest then runs one test per check."""

    skip_checks: tuple[str, ...] = ()

    def make_profiler(self) -> Profiler:
        raise NotImplementedError("implement make_profiler() to return a new profiler")

    def make_partition(self) -> Partition:
        return _default_partition()


_add_tests(ProfilerConformance, PROFILER_CHECKS,
           lambda self: (self.make_profiler, self.make_partition()))
__all__ += ["PROFILER_CHECKS", "ProfilerConformance", "check_profiler"]
