"""optimize(..., pool=...): each partition type's search as a task of a
concurrent.futures executor (threads, processes, Ray), with the serial run's result."""

from __future__ import annotations

import json
import sys
import types
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kareus.compose import kareus_types
from kareus.model.partition import build_partitions
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.profilers.emulator import EmulatedProfiler
from kareus.search import SearchSpec
from kareus.testing import FakeProfiler
from kareus.workflow import OptimizationResult, optimize
from kareus.workflow.pools import SearchTask, task_gpus
from kareus.workflow.ray import RayExecutor

WL = Workload.preset("qwen3-1.7b", tp=2, pp=2, microbatch_size=4, num_microbatches=4)
KW: dict[str, Any] = {"budget": 10, "seed": 3, "progress": False}


def _logs(folder: Path) -> dict[str, list[str]]:
    """Each search log without its header line (which records when it was created)."""
    return {p.name: p.read_text().splitlines()[1:] for p in sorted(folder.glob("search-*.jsonl"))}


def _same(a: OptimizationResult, b: OptimizationResult) -> None:
    da, db = a.to_dict(), b.to_dict()
    for key in ("frontiers", "systems", "profiles_per_partition_type", "workload", "gpu"):
        assert da[key] == db[key], key
    assert a.select().digest == b.select().digest
    for name, fr in a.partition_frontiers().items():
        assert fr.to_dict() == b.partition_frontiers()[name].to_dict()


@pytest.fixture(scope="module")
def serial(tmp_path_factory: pytest.TempPathFactory) -> tuple[OptimizationResult, Path, int]:
    out = tmp_path_factory.mktemp("serial")
    prof = EmulatedProfiler("a100-40gb", seed=3)
    res = optimize(WL, profiler=prof, log_dir=out, **KW)
    return res, out, prof.calls


@pytest.mark.parametrize("pool", [ThreadPoolExecutor, ProcessPoolExecutor])
def test_pool_matches_serial(pool: type[Executor], serial: tuple[OptimizationResult, Path, int],
                             tmp_path: Path) -> None:
    ref, ref_logs, ref_calls = serial
    prof = EmulatedProfiler("a100-40gb", seed=3)
    with pool(max_workers=2) as ex:
        res = optimize(WL, profiler=prof, log_dir=tmp_path, pool=ex, **KW)
    _same(ref, res)
    assert _logs(tmp_path) == _logs(ref_logs)  # the logs came back into the run's folder
    assert prof.calls == ref_calls  # the noise stream is where the serial run left it
    lines = [json.loads(x) for x in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert sorted(r["type"] for r in lines) == sorted(ref.profiles)
    assert all(r["attempt"] == 1 and r["profiles"] == 10 for r in lines)


class _Reversed(Executor):
    """Runs each task when its result is asked for, the last submitted first."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Future[Any], Any]] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.tasks.append((fut, lambda: fn(*args, **kwargs)))
        if len(self.tasks) == len(kareus_types(WL)):  # the nanobatched and unsplit types
            for f, call in reversed(self.tasks):
                f.set_result(call())
        return fut


def test_tasks_in_any_order_give_the_serial_result(serial: tuple[OptimizationResult, Path, int],
                                                   tmp_path: Path) -> None:
    # The emulator's noise is keyed by what is measured, not by a stream shared by the run:
    # searches run last-first measure what the serial run measured.
    ref, ref_logs, ref_calls = serial
    prof = EmulatedProfiler("a100-40gb", seed=3)
    res = optimize(WL, profiler=prof, log_dir=tmp_path, pool=_Reversed(), **KW)
    _same(ref, res)
    assert _logs(tmp_path) == _logs(ref_logs)
    assert prof.calls == ref_calls


def test_resumes_from_the_run_folder(serial: tuple[OptimizationResult, Path, int],
                                     tmp_path: Path) -> None:
    # A run killed after part of one search: its log is resumed by the task, as serially.
    ref, ref_logs, _ = serial
    first = sorted(ref_logs.glob("search-*.jsonl"))[0]
    lines = first.read_text().splitlines()
    cut = next(i for i, x in enumerate(lines) if json.loads(x).get("n") == 4) + 1
    s_dir, p_dir = tmp_path / "serial", tmp_path / "pool"
    for d in (s_dir, p_dir):
        d.mkdir()
        (d / first.name).write_text("\n".join(lines[:cut]) + "\n")
        for other in ref_logs.glob("*manifest*"):  # what the killed run had written
            (d / other.name).write_bytes(other.read_bytes())
    a = optimize(WL, log_dir=s_dir, **KW)
    with ThreadPoolExecutor(max_workers=2) as ex:
        b = optimize(WL, log_dir=p_dir, pool=ex, **KW)
    _same(a, b)
    assert _logs(p_dir) == _logs(s_dir)
    assert len(_logs(p_dir)[first.name]) > cut  # the search went on from the cut


def test_rejects_what_is_not_an_executor() -> None:
    with pytest.raises(TypeError, match="concurrent.futures.Executor"):
        optimize(WL, pool=object(), **KW)  # type: ignore[arg-type]


def test_executor_the_old_name_of_pool_is_gone() -> None:
    # kareus.Executor is the role that runs plans; the pool of search tasks is pool= alone
    with ThreadPoolExecutor(max_workers=1) as ex, pytest.raises(TypeError, match="executor"):
        optimize(WL, executor=ex, **KW)  # type: ignore[call-arg]


def test_tasks_ask_for_their_profiling_group() -> None:
    pset = build_partitions(Workload.preset("qwen3-1.7b", tp=4, cp=2, pp=2, microbatch_size=4))
    part = next(iter(pset.types.values()))
    assert task_gpus(EmulatedProfiler("a100-40gb"), part, 8) == 0
    assert task_gpus(FakeProfiler(), part, 8) == 0  # a formula on the CPU says so

    class Silent(FakeProfiler):  # a profiler that does not say is taken to need its GPUs
        uses_gpus = Profiler.uses_gpus

    assert task_gpus(Silent(), part, 8) == 8


class _FakeRef:
    def __init__(self, value: Any) -> None:
        self._value = value

    def future(self) -> Future[Any]:
        f: Future[Any] = Future()
        f.set_result(self._value)
        return f


class _FakeRemote:
    def __init__(self, fn: Any, log: list[dict[str, Any]]) -> None:
        self.fn, self.log, self.opts = fn, log, {}

    def options(self, **opts: Any) -> _FakeRemote:
        new = _FakeRemote(self.fn, self.log)
        new.opts = opts
        return new

    def remote(self, *args: Any, **kwargs: Any) -> _FakeRef:
        self.log.append(self.opts)
        return _FakeRef(self.fn(*args, **kwargs))


def _fake_ray() -> types.SimpleNamespace:
    log: list[dict[str, Any]] = []
    state = {"up": False}
    return types.SimpleNamespace(
        log=log, state=state,
        is_initialized=lambda: state["up"],
        init=lambda **kw: state.update(up=True, kw=kw),
        shutdown=lambda: state.update(up=False),
        remote=lambda fn: _FakeRemote(fn, log))


def test_ray_executor_requests_each_tasks_gpus() -> None:
    ray = _fake_ray()
    task = types.SimpleNamespace(num_gpus=8)
    with RayExecutor(ray=ray, init={"num_cpus": 2}) as ex:
        assert ray.state["kw"] == {"num_cpus": 2}
        f = ex.submit(lambda *a: sum(a), 1, 2)
        assert f.result() == 3
        g = ex.submit(lambda: "ran")  # no num_gpus attribute: none asked for
        assert g.result() == "ran"
        assert ex._gpus_for(task) == 8.0
    assert ray.log == [{"num_gpus": 0.0, "num_cpus": 1}, {"num_gpus": 0.0, "num_cpus": 1}]
    assert not ray.state["up"]  # the executor started Ray, so it shut it down
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(print)
    assert RayExecutor(ray=ray, num_gpus=2)._gpus_for(task) == 2


def test_ray_executor_passes_search_tasks_gpus(tmp_path: Path) -> None:
    ray = _fake_ray()
    pset = build_partitions(WL)
    name, part = next(iter(pset.types.items()))
    task = SearchTask(name=name, partition=part, profiler=EmulatedProfiler("a100-40gb", seed=3),
                      search=SearchSpec(budget=4, seed=3), resume_text=None, log=True,
                      num_gpus=4)
    ex = RayExecutor(ray=ray)
    res = ex.submit(task).result()
    assert ray.log == [{"num_gpus": 4.0, "num_cpus": 1}]
    assert res.name == name and len(res.frontier.measured()) == 4 and res.noise_used == 4
    assert res.log_text is not None and res.log_text.count('"kind":"tell"') == 4


def test_ray_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"kareus\[ray\]"):
        RayExecutor()


@pytest.mark.slow
def test_optimize_on_a_local_ray_matches_serial(serial: tuple[OptimizationResult, Path, int],
                                                tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    ref, ref_logs, _ = serial
    if ray.is_initialized():  # pragma: no cover - another test left one running
        ray.shutdown()
    init = {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False}
    with RayExecutor(init=init) as ex:
        res = optimize(WL, log_dir=tmp_path, pool=ex, **KW)
        assert ex.requests == [(0.0, 1)] * len(ref.profiles)  # the emulator needs no GPU
    _same(ref, res)
    assert _logs(tmp_path) == _logs(ref_logs)


def test_pool_with_a_prior_model_matches_serial(tmp_path: Path) -> None:
    """``prior_model=`` travels with each task (a copy of the model): the pooled run's
    frontiers and logs are the serial run's."""
    from kareus.profilers.emulator import EmulatedGPU

    model = EmulatedGPU.from_spec("a100-40gb")

    def run(pool: Executor | None, out: Path) -> OptimizationResult:
        return optimize(WL, profiler=EmulatedProfiler(model.perturbed(2), seed=3),
                        log_dir=out, pool=pool, prior_model=EmulatedProfiler(model, noise=0.0),
                        **KW)

    ref = run(None, tmp_path / "serial")
    with ThreadPoolExecutor(max_workers=2) as ex:
        res = run(ex, tmp_path / "pool")
    _same(ref, res)
    assert _logs(tmp_path / "pool") == _logs(tmp_path / "serial")
    assert all('"prior_mean"' in p.read_text().splitlines()[0]
               for p in (tmp_path / "pool").glob("search-*.jsonl"))
