"""Partition searches on a Ray cluster: a ``concurrent.futures.Executor`` of Ray tasks.

[`RayExecutor`][kareus.workflow.ray.RayExecutor] turns each task that ``optimize(..., pool=...)``
submits (one per partition type, [`SearchTask`][kareus.workflow.pools.SearchTask]) into a Ray task
that asks Ray for the GPUs its profiling group needs (the task's ``num_gpus``: the partition's TP x
CP GPUs on real hardware, none on the emulated GPU). Ray places the tasks on the cluster's nodes and
runs as many at once as the resources allow; kareus adds no scheduling of its own. Each
task's future is the one Ray gives (``ObjectRef.future()``).

Install with ``pip install 'kareus[ray]'``. Example::

    import ray
    from kareus import Workload, optimize
    from kareus.workflow.ray import RayExecutor

    ray.init(address="auto")  # or let RayExecutor start a local Ray
    with RayExecutor() as pool:
        result = optimize(Workload.preset("llama3.3-70b", tp=8, pp=4), gpu="h200-sxm",
                          pool=pool, log_dir="run/logs")

Ray's own documentation describes tasks, resources and futures:
https://docs.ray.io/en/latest/ray-core/tasks.html (``num_gpus``) and
https://docs.ray.io/en/latest/ray-core/actors/async_api.html (``ObjectRef.future()``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

from kareus.errors import ArgumentError

__all__ = ["RayExecutor"]


def _import_ray() -> Any:
    """The ``ray`` module, or a one-line ImportError that says how to install it."""
    try:
        import ray  # optional dependency: the [ray] extra
    except ImportError as exc:
        raise ImportError("RayExecutor needs Ray: pip install 'kareus[ray]'") from exc
    return ray


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` inside a Ray worker (the one function kareus registers with Ray)."""
    return fn(*args, **kwargs)


class RayExecutor(Executor):
    """A ``concurrent.futures.Executor`` whose tasks are Ray tasks.

    Args:
        num_gpus: GPUs each task asks for; ``None`` = the submitted callable's ``num_gpus``
            attribute (what [`SearchTask`][kareus.workflow.pools.SearchTask] carries), else 0.
        num_cpus: CPUs each task asks for (default 1).
        init: Keyword arguments for ``ray.init`` when Ray is not running yet (e.g.
            ``{"num_cpus": 4}`` for a local Ray, ``{"address": "auto"}`` to join a
            cluster); ``None`` = ``ray.init()``'s defaults. A Ray this executor started is
            shut down by [`shutdown`][kareus.workflow.ray.RayExecutor.shutdown].
        ray: The ``ray`` module (``None``: ``import ray``); a fake for tests.

    Raises:
        ImportError: Ray is not installed (``pip install 'kareus[ray]'``).
    """

    def __init__(self, *, num_gpus: float | None = None, num_cpus: float = 1,
                 init: Mapping[str, Any] | None = None, ray: Any = None) -> None:
        if ray is None:
            ray = _import_ray()
        if num_gpus is not None and num_gpus < 0:
            raise ArgumentError(f"num_gpus must be >= 0, got {num_gpus}")
        if num_cpus < 0:
            raise ArgumentError(f"num_cpus must be >= 0, got {num_cpus}")
        self._ray = ray
        self.num_gpus = num_gpus
        self.num_cpus = num_cpus
        self._started = False
        if not ray.is_initialized():
            ray.init(**dict(init or {}))
            self._started = True
        self._remote = ray.remote(_call)
        self._shutdown = False
        #: ``(num_gpus, num_cpus)`` of every task submitted, in order.
        self.requests: list[tuple[float, float]] = []

    def _gpus_for(self, fn: Callable[..., Any]) -> float:
        if self.num_gpus is not None:
            return self.num_gpus
        wanted = getattr(fn, "num_gpus", 0)
        return float(wanted) if isinstance(wanted, (int, float)) else 0.0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` as a Ray task asking for its GPUs; returns its future."""
        if self._shutdown:
            raise RuntimeError("cannot submit to a RayExecutor after shutdown")
        gpus = self._gpus_for(fn)
        self.requests.append((gpus, self.num_cpus))
        ref = self._remote.options(num_gpus=gpus, num_cpus=self.num_cpus).remote(
            fn, *args, **kwargs)
        return ref.future()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting tasks; shut Ray down if this executor started it."""
        self._shutdown = True
        if self._started:
            self._ray.shutdown()
            self._started = False
