"""The tuning driver (kareus.tune) in a fake distributed world: 2-4 ranks as threads, each
with its own profiler that talks to the others the way the NVML profiler does.

What must hold: every rank issues the same collectives in the same order; rank 0 writes
the same outputs as the emulated job; a killed run resumes without measuring again what
it measured; a failure on rank 0 stops the others instead of leaving them waiting.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Sequence

import pytest

from kareus.compose.plan import Plan
from kareus.errors import HardwareError
from kareus.model.measurement import Measurement
from kareus.model.profiler import Profiler
from kareus.model.workload import Workload
from kareus.profilers.emulator import EmulatedProfiler
from kareus.profilers.nvml import Coordinator
from kareus.tune import Catalog, LockstepProfiler, follow, run_lockstep


class ThreadWorld:
    """Shared state of a world of ``n`` threads; each op is logged per rank."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list[list[float]] = [[] for _ in range(n)]
        self.logs: list[list[tuple[str, int]]] = [[] for _ in range(n)]


class ThreadCoordinator(Coordinator):
    """A coordinator over a :class:`ThreadWorld` (broadcast and sum through a barrier)."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self._rank = world, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.world.n

    def _exchange(self, op: str, values: Sequence[float]) -> list[list[float]]:
        w = self.world
        w.logs[self._rank].append((op, len(values)))
        w.slots[self._rank] = [float(v) for v in values]
        w.barrier.wait()
        every = [list(s) for s in w.slots]
        w.barrier.wait()
        if len({len(s) for s in every}) != 1:
            raise AssertionError(f"ranks disagree on the length of a {op}: {every}")
        return every

    def broadcast(self, values: Sequence[float]) -> list[float]:
        return self._exchange("broadcast", values)[0]

    def sum(self, values: Sequence[float]) -> list[float]:
        return [sum(col) for col in zip(*self._exchange("sum", values))]


class GroupProfiler(Profiler):
    """One rank's profiler: the emulator's numbers (no noise: every rank agrees), with the
    collectives a real group measurement makes (a step-count broadcast and an energy sum).

    ``fail_at``: raise on the n-th measurement, as every rank of a group does together.
    """

    def __init__(self, coord: Coordinator, *, fail_at: int | None = None) -> None:
        self.emu = EmulatedProfiler("h200-sxm", noise=0.0)
        self.gpu = self.emu.gpu
        self.coord = coord
        self.fail_at = fail_at
        self.calls: list[tuple] = []

    def _group(self, m: Measurement) -> Measurement:
        if self.fail_at is not None and len(self.calls) >= self.fail_at:
            raise HardwareError("the energy counter did not step (simulated kill)")
        self.coord.broadcast([1.0, 2.0])
        total = self.coord.sum([m.energy_j / self.coord.world_size])[0]
        return Measurement(time_s=m.time_s, energy_j=total, static_power_w=m.static_power_w)

    def measure(self, partition, config):
        self.calls.append(("p", partition.name, config))
        return self._group(self.emu.measure(partition, config))

    def measure_outside(self, work, freq_mhz, *, group_size, comm_sms=None):
        self.calls.append(("o", tuple(op.name for op in work.ops), freq_mhz, comm_sms))
        return self._group(self.emu.measure_outside(work, freq_mhz, group_size=group_size,
                                                    comm_sms=comm_sms))

    def static_power_w(self, group_size):
        return self.emu.static_power_w(group_size)

    def space(self, partition):
        # One clock, as on a machine whose clocks must not change; the default SM grid.
        return self.emu.space(partition).restrict(freqs_mhz=[1980], comm_sms=[4, 8, 16, 32])

    def clocks_mhz(self):
        return (1980,)


def workload() -> Workload:
    return Workload.preset("llama3.2-3b", tp=2, pp=2, microbatch_size=2, seq_len=1024,
                           num_microbatches=4, nanobatches=2)


def run_world(n, out, *, fail_at=None, profiler=None, **kw):
    """Run the driver on ``n`` thread ranks; returns (reports, errors, profilers, world)."""
    world = ThreadWorld(n)
    reports: list = [None] * n
    errors: list = [None] * n
    cls = profiler or GroupProfiler
    profs = [cls(ThreadCoordinator(world, r), fail_at=fail_at) for r in range(n)]

    def rank_main(r: int) -> None:
        try:
            reports[r] = run_lockstep(workload(), profiler=profs[r], coordinator=profs[r].coord,
                                      out_dir=out, budget=6, progress=False, **kw)
        except BaseException as exc:  # reported to the test
            errors[r] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return reports, errors, profs, world


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_issues_the_same_collectives_and_rank_0_writes_the_job(tmp_path, n):
    reports, errors, profs, world = run_world(n, tmp_path / "out")
    assert errors == [None] * n
    assert reports[0] is not None and all(r is None for r in reports[1:])
    # Same collectives, same order, same lengths; the same measurements on every rank.
    assert all(log == world.logs[0] for log in world.logs[1:])
    assert all(p.calls == profs[0].calls for p in profs[1:])
    kinds = {c[0] for c in profs[0].calls}
    assert kinds == {"p", "o"}  # partitions (kareus and the baselines) and outside work
    out = tmp_path / "out"
    for name in ("results.json", "plan.json", "tune.json", "kareus-manifest.json"):
        assert (out / name).is_file(), name
    # kareus's types: the nanobatched ones and the unsplit ones (keyed <type>@n1)
    kareus_keys = set(reports[0].result.partition_frontiers())
    assert kareus_keys > set(reports[0].result.partitions.types)
    assert {p.name[len("search-"):-len(".jsonl")] for p in (out / "logs").glob("search-*.jsonl")
            } == kareus_keys
    plan = Plan.load(out / "plan.json")
    assert set(plan.frequencies_mhz.values()) == {1980}
    results = json.loads((out / "results.json").read_text())
    assert set(results["systems"]) == {"megatron", "nanobatching", "perseus",
                                       "nanobatching+perseus", "kareus"}
    tune = json.loads((out / "tune.json").read_text())
    (run,) = tune["runs"]
    assert tune["world_size"] == n and tune["gpu_time_s"] == pytest.approx(run["wall_s"] * n)
    assert run["measured"] == tune["measurements"] == len(profs[0].calls)


def test_a_killed_run_resumes_without_measuring_again(tmp_path):
    ref_reports, errors, ref_profs, _ = run_world(3, tmp_path / "ref")
    assert errors == [None] * 3
    total = len(ref_profs[0].calls)
    assert total > 12

    out = tmp_path / "out"
    _, errors, first, world = run_world(3, out, fail_at=12)
    assert all(isinstance(e, HardwareError) for e in errors), errors
    assert all(len(p.calls) == 12 for p in first)
    assert all(log == world.logs[0] for log in world.logs[1:])

    reports, errors, second, world = run_world(3, out)
    assert errors == [None] * 3
    assert all(log == world.logs[0] for log in world.logs[1:])
    # Nothing measured twice: the resumed run measured only what the first did not (the
    # failed measurement itself is the one repeated).
    assert len(second[0].calls) == total - 11
    assert Counter(first[0].calls[:11]) + Counter(second[0].calls) == Counter(
        ref_profs[0].calls)
    assert reports[0].result.select().digest == ref_reports[0].result.select().digest
    # Run again: nothing left to measure; tune.json counts both runs' GPU time.
    _, errors, third, _ = run_world(3, out)
    assert errors == [None] * 3 and all(not p.calls for p in third)
    tune = json.loads((out / "tune.json").read_text())
    assert [r["measured"] for r in tune["runs"]] == [11, total - 11, 0]
    assert [r["completed"] for r in tune["runs"]] == [False, True, True]
    assert tune["gpu_time_s"] == pytest.approx(sum(r["gpu_time_s"] for r in tune["runs"]))


def test_a_failure_on_rank_0_stops_the_other_ranks(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")  # another job's output, no manifest: refused
    _, errors, profs, _ = run_world(3, out)
    assert errors[0] is not None and "HardwareError" not in type(errors[0]).__name__
    assert all(isinstance(e, HardwareError) and "rank 0" in str(e) for e in errors[1:])
    assert all(not p.calls for p in profs)


def test_only_some_types_writes_their_frontiers(tmp_path):
    reports, errors, profs, world = run_world(2, tmp_path / "out", types=["fwd_attn"])
    assert errors == [None, None]
    assert reports[0].result is None and set(reports[0].frontiers) == {"fwd_attn"}
    data = json.loads((tmp_path / "out" / "frontiers.json").read_text())
    assert set(data["frontiers"]) == {"fwd_attn"}
    assert {c[1] for c in profs[1].calls} == {"fwd_attn"}
    assert world.logs[0] == world.logs[1]


def test_the_catalog_and_the_announcements_name_the_same_thing_on_every_rank():
    wl = workload()
    a, b = Catalog(wl), Catalog(wl)
    assert [p.name for p, _ in a.partitions] == [p.name for p, _ in b.partitions]
    # Partition types of the sequential systems (no nanobatching) are in it too.
    assert {w.nanobatches for _, w in a.partitions} == {1, 2}
    world = ThreadWorld(2)
    lead = GroupProfiler(ThreadCoordinator(world, 0))
    other = GroupProfiler(ThreadCoordinator(world, 1))
    leader = LockstepProfiler(lead, coordinator=lead.coord, catalog=a,
                              backends=("own", "nccl_capped"))
    part = a.partitions[0][0]
    from kareus.model.config import ScheduleConfig

    cfgs = [ScheduleConfig(1980, 8, part.slots[-1].name, backend="own"),
            ScheduleConfig(1980, 16, None, backend="nccl_capped"), ScheduleConfig(1980, 4, None)]
    done: list = []
    t = threading.Thread(target=lambda: done.append(follow(
        other, coordinator=other.coord, catalog=b, backends=("own", "nccl_capped"))))
    t.start()
    for c in cfgs:
        leader.measure(part, c)
        leader.measure(part, c)  # the second is answered from what the first measured
    leader.finish()
    t.join(timeout=30)
    assert done == [3]
    assert [c[2] for c in other.calls] == cfgs


def test_backends_that_cannot_run_are_left_out_with_the_reason():
    from kareus.exec.collectives import CollectiveEnvironment
    from kareus.tune import tuning_backends

    built = []

    def maker(name):
        return lambda: built.append(name) or name

    both = {"own": maker("own"), "nccl_capped": maker("nccl_capped")}
    named, notes = tuning_backends(CollectiveEnvironment(world_size=4, sm_count=132), None, both)
    assert list(named) == ["own", "nccl_capped"] and notes == {} and built == list(named)
    named, notes = tuning_backends(CollectiveEnvironment(world_size=3, sm_count=132), None, both)
    assert list(named) == ["nccl_capped"] and "2, 4 or 8" in notes["own"]
    named, _ = tuning_backends(CollectiveEnvironment(world_size=2, sm_count=132), ["own"], both)
    assert list(named) == ["own"]
    with pytest.raises(HardwareError, match="max_ctas"):
        tuning_backends(CollectiveEnvironment(world_size=3, sm_count=132, nccl_cta_caps=False),
                        None, both)
    # TP=2 x CP=3: the own kernels cannot serve the CP group of 3.
    named, notes = tuning_backends(CollectiveEnvironment(world_size=6, sm_count=132), None, both,
                                   group_sizes=[2, 3])
    assert list(named) == ["nccl_capped"] and "has 3" in notes["own"]
    with pytest.raises(ValueError, match="mscclpp"):
        tuning_backends(CollectiveEnvironment(world_size=2, sm_count=132), ["mscclpp"], both)


def test_gpu_presets_are_found_from_the_device_name():
    from kareus.tune import detect_gpu_preset

    assert detect_gpu_preset("NVIDIA H200") == "h200-sxm"
    assert detect_gpu_preset("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    with pytest.raises(HardwareError, match="--gpu"):
        detect_gpu_preset("NVIDIA GeForce RTX 4090")


class FedProfiler(GroupProfiler):
    """A group profiler that also says how it fed the GPU (the Profiler role's ``execution``
    and ``last_facts``, as the NVML profiler says them): every fifth measurement's GPU was
    busy half its window (host-bound), the others 97%."""

    execution = "graphed"
    last_facts = None

    def _group(self, m: Measurement) -> Measurement:
        out = super()._group(m)
        self.last_facts = {"execution": "graphed",
                           "gpu_busy": 0.5 if len(self.calls) % 5 == 0 else 0.97}
        return out


def test_tune_json_says_how_the_gpus_were_fed_and_lists_the_host_bound(tmp_path):
    out = tmp_path / "out"
    reports, errors, profs, world = run_world(2, out, profiler=FedProfiler)
    assert errors == [None, None]
    assert all(log == world.logs[0] for log in world.logs[1:])
    total = len(profs[0].calls)
    flagged = total // 5
    assert flagged >= 2
    tune = json.loads((out / "tune.json").read_text())
    assert tune["execution"] == "graphed" and tune["host_bound_threshold"] == 0.9
    assert len(tune["host_bound"]) == flagged
    assert all(e["gpu_busy"] == 0.5 and e["execution"] == "graphed" for e in tune["host_bound"])
    kinds = {("partition" in e, "outside_work" in e) for e in tune["host_bound"]}
    assert kinds <= {(True, False), (False, True)}
    part = next(e for e in tune["host_bound"] if "partition" in e)
    assert set(part) == {"partition", "config", "gpu_busy", "execution"}
    assert "freq_mhz" in part["config"]
    report = reports[0]
    assert report.execution == "graphed" and list(report.host_bound) == tune["host_bound"]
    # Every measurement's line keeps how its GPU was fed.
    lines = [json.loads(x) for x in (out / "logs" / "measurements.jsonl").read_text().splitlines()]
    assert len(lines) == total and {x["execution"] for x in lines} == {"graphed"}
    assert sorted(x["gpu_busy"] for x in lines).count(0.5) == flagged

    # A resumed run serves them from the file and still lists them; a file of an older
    # kareus (no such fields) loads too, and lists none.
    reports, errors, profs, _ = run_world(2, out, profiler=FedProfiler)
    assert errors == [None, None] and not profs[0].calls
    assert len(reports[0].host_bound) == flagged
    stripped = [{"key": x["key"], "measurement": x["measurement"]} for x in lines]
    (out / "logs" / "measurements.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in stripped))
    reports, errors, profs, _ = run_world(2, out, profiler=FedProfiler)
    assert errors == [None, None] and not profs[0].calls
    assert reports[0].host_bound == () and reports[0].execution is None
    assert reports[0].info["measurements"] == total


def test_one_gpu_stands_in_for_each_group_at_its_size():
    # `kareus optimize --profiler nvml` on one GPU at TP=4, CP=2 stopped at once: the CP
    # all-gather's buffers are sized for a group of 2, and a world of one refused them
    # ("output must hold world_size x input.numel() = 1 x ..."). Each group's stand-in
    # now has its group's size; the partitions' own buffers run through it on a CPU.
    torch = pytest.importorskip("torch")
    from kareus.exec._partition_program import _comm_buffers
    from kareus.exec.executor import RecordingStreamBackend, TorchExecutor
    from kareus.model.config import ScheduleConfig
    from kareus.model.partition import build_partitions
    from kareus.tune import one_gpu_backends

    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, microbatch_size=2, seq_len=256)
    named, default, note = one_gpu_backends(wl)
    assert list(named) == ["loopback"] and "loopback" in note
    grouped = named["loopback"]
    assert grouped.backend_for("all_reduce").world_size == 4
    assert grouped.backend_for("all_gather").world_size == 2
    assert grouped.backend_for("reduce_scatter").world_size == 2
    ex = TorchExecutor(collective=grouped, backends=named, default_collective=default,
                       streams=RecordingStreamBackend(), graphs=False)
    kinds = set()
    for part in build_partitions(wl).types.values():
        comm = part.comm_op
        ins, outs = _comm_buffers(torch, comm, wl.dtype_bytes, torch.device("cpu"),
                                  torch.float32, (1,))
        src = ins[0].copy_(torch.arange(ins[0].numel(), dtype=torch.float32))
        kind = comm.kind.value
        kinds.add(kind)
        backend = grouped.backend_for(kind)
        if kind == "all_gather":  # the size check every capped backend makes
            assert outs[0].numel() == backend.world_size * src.numel()
        elif kind == "reduce_scatter":
            assert src.numel() == backend.world_size * outs[0].numel()
        ex.run_partition([], [], src, ScheduleConfig(1980, 8, None), comm_kind=kind,
                         comm_output=outs[0] if outs else None)
        if kind == "all_gather":  # every rank of the group holds this rank's shard
            assert torch.equal(outs[0].view(2, -1), src.view(1, -1).expand(2, -1))
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter"}


def test_one_gpu_can_stand_in_time_faithfully_and_says_so():
    pytest.importorskip("torch")
    from kareus.errors import ArgumentError
    from kareus.exec.train import STAND_IN_LABEL, TimedLoopbackGroupCollective
    from kareus.tune import one_gpu_backends

    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, microbatch_size=2, seq_len=256)
    named, default, note = one_gpu_backends(wl, loopback="faithful", gpu="h200-sxm")
    grouped = named["loopback"]
    tp, cp = grouped.backend_for("all_reduce"), grouped.backend_for("all_gather")
    assert isinstance(tp, TimedLoopbackGroupCollective) and tp.world_size == 4
    assert isinstance(cp, TimedLoopbackGroupCollective) and cp.world_size == 2
    assert note.startswith(STAND_IN_LABEL) and "MEASURED curve" in note
    assert default is grouped or default.backend_for("all_reduce") is tp
    with pytest.raises(ArgumentError, match="gpu="):
        one_gpu_backends(wl, loopback="faithful")


def test_the_last_line_counts_the_host_bound_measurements_and_says_what_to_do():
    from pathlib import Path

    from kareus.tune import TuneReport
    from kareus.tune._hardware import _host_bound_summary

    def report(execution, host_bound):
        return TuneReport(result=None, frontiers={}, paths={"tune": Path("tune.json")},
                          wall_s=1.0, world_size=1, gpu_time_s=1.0, measured=3, info={},
                          execution=execution, host_bound=tuple(host_bound))

    line = _host_bound_summary(report("eager", [
        {"partition": "fwd_attn", "config": {}, "gpu_busy": 0.42},
        {"outside_work": 0, "freq_mhz": 1980, "gpu_busy": 0.8}]))
    assert "eager execution; 2 measurement(s) host-bound" in line
    assert "42%, fwd_attn" in line and "CUDA graphs" in line and "host_bound" in line
    line = _host_bound_summary(report("graphed", [{"outside_work": 1, "gpu_busy": 0.5}]))
    assert "outside work 1" in line and "larger partitions" in line
    assert "no measurement was host-bound" in _host_bound_summary(report("graphed", []))
