"""Plugging your own Surrogate and Profiler into kareus, checked by the conformance suites.

Run: python examples/custom_plugins.py   (CPU only; a few seconds)
"""

from __future__ import annotations

import numpy as np

from kareus.model import Measurement, Workload, build_partitions
from kareus.profilers import EmulatedProfiler, Profiler
from kareus.search import BootstrapEnsemble, MultiPassSearch, Surrogate
from kareus.testing import check_profiler, check_surrogate


class QuadraticRidge(Surrogate):
    """Ridge regression on quadratic features: a smooth, cheap alternative to boosted trees.

    Features are standardised, then expanded with their squares and pairwise products.
    """

    def __init__(self, *, alpha: float = 1e-2) -> None:
        self.alpha = alpha
        self._coef: np.ndarray | None = None

    def _expand(self, X: np.ndarray) -> np.ndarray:
        z = (X - self._mu) / self._sd
        cols = [np.ones(len(z)), *z.T]
        d = z.shape[1]
        cols += [z[:, i] * z[:, j] for i in range(d) for j in range(i, d)]
        return np.column_stack(cols)

    def fit(self, X, y):  # type: ignore[no-untyped-def]
        X = np.asarray(X, dtype=float)
        y = np.asarray(y, dtype=float)
        if X.ndim != 2 or y.shape != (len(X),) or len(X) == 0:
            raise ValueError("X must be (n, d) and y (n,), with n >= 1")
        if not (np.isfinite(X).all() and np.isfinite(y).all()):
            raise ValueError("X and y must be finite")
        self._mu = X.mean(axis=0)
        self._sd = np.where(X.std(axis=0) > 0, X.std(axis=0), 1.0)
        A = self._expand(X)
        reg = self.alpha * np.eye(A.shape[1])
        reg[0, 0] = 0.0  # do not shrink the intercept
        self._coef = np.linalg.solve(A.T @ A + reg, A.T @ y)
        return self

    def predict(self, X):  # type: ignore[no-untyped-def]
        if self._coef is None:
            raise RuntimeError("fit the surrogate before predicting")
        X = np.asarray(X, dtype=float)
        if len(X) == 0:
            return np.zeros(0)
        return self._expand(X) @ self._coef

    @property
    def fitted(self) -> bool:
        return self._coef is not None

    def clone(self, *, seed: int | None = None) -> QuadraticRidge:
        return QuadraticRidge(alpha=self.alpha)  # unfitted; nothing to seed


class MyClusterProfiler(Profiler):
    """A profiler for your own measurement harness.

    Here the 'harness' is the emulator plus a fixed per-run overhead your launcher adds;
    in real use, ``_run`` would launch the partition under the configuration on your GPUs
    and read time and energy from your meters.
    """

    def __init__(self, gpu: str = "h200-sxm", *, overhead_s: float = 20e-6) -> None:
        self._inner = EmulatedProfiler(gpu, seed=0)
        self.gpu = self._inner.gpu
        self.overhead_s = overhead_s

    def measure(self, partition, config):  # type: ignore[no-untyped-def]
        self.space(partition).validate(config)  # typed errors for impossible configurations
        m = self._inner.measure(partition, config)
        extra_j = self.overhead_s * m.static_power_w
        return Measurement(time_s=m.time_s + self.overhead_s, energy_j=m.energy_j + extra_j,
                           static_power_w=m.static_power_w)

    def measure_outside(self, work, freq_mhz, *, group_size, comm_sms=None):  # type: ignore[no-untyped-def]
        return self._inner.measure_outside(work, freq_mhz, group_size=group_size,
                                           comm_sms=comm_sms)


def main() -> None:
    check_surrogate(lambda: QuadraticRidge())
    print("QuadraticRidge passes the surrogate conformance suite")
    check_profiler(lambda: MyClusterProfiler())
    print("MyClusterProfiler passes the profiler conformance suite")

    wl = Workload.preset("llama3.2-3b", tp=4, microbatch_size=8, seq_len=4096)
    part = build_partitions(wl)["fwd_mlp"]
    profiler = MyClusterProfiler()
    search = MultiPassSearch(profiler.space(part), budget=48, seed=0,
                             surrogate=BootstrapEnsemble(base=QuadraticRidge(), n_models=5))
    frontier = search.run(profiler, part, progress=False)
    print(frontier)


if __name__ == "__main__":
    main()
