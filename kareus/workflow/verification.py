"""A plan is a promise: ``kareus verify`` measures it where it runs and compares.

``kareus optimize`` composes an iteration time and energy for the plan it writes (and for
the systems it compares with, in ``results.json``). [`verify`][kareus.workflow.verification.verify]
trains the plan's job in the library's loop ([`TrainingLoop`][kareus.exec.train.TrainingLoop])
on this job's GPUs under ``torchrun``, the plan and each baseline in turn (interleaved
repeats, in an order shuffled from a seed, every run from the same weights), and sets what
it measured beside what was predicted:

* **time**: device-event time of each iteration, the slowest rank's;
* **energy**: NVML's energy counter read at its step edges
  ([`EnergyMeter`][kareus.profilers.EnergyMeter]) over each run's window, summed over the
  ranks, per iteration, and scaled to every GPU of the job exactly as the tune scales a
  partition measured on fewer GPUs than its group
  ([`Measurement.scaled_to_scope`][kareus.model.Measurement.scaled_to_scope]: a world of one
  standing in for a TP x CP group with loopback collectives counts the one GPU's energy
  ``TP x CP`` times). NVML does not split static from dynamic energy: the measured static
  energy is the static power the plan was composed with (the tune measured it) times the
  measured time, and the dynamic energy the rest;
* **how the GPU was fed**: the GPU-busy fraction (each system's iteration time with its
  steps queued behind a held GPU, [`kareus.exec.device_time`][kareus.exec.device_time],
  over the measured iteration time) and the mean SM clock of the windows.

Which systems: the plan (``kareus``) and, from ``results.json`` beside it (an optimize
output folder), Megatron-LM (the loop's ``sequential`` schedule) and nanobatching (its
``nanobatching`` schedule), each predicted at its maximum-throughput point. The Perseus
variants differ from those two by their clocks only; with clocks unchanged (the dry-run
controller, the only one used here) they would run as their base system, so they are not
run separately.

A system passes when its measured time and total energy are each within ``tolerance`` of
the prediction (static and dynamic energy are shown, not gated: their split is the
prediction's static power). The command exits non-zero when one does not.

Clocks are never changed: the plan's clock requests go to a
[`DryRunFrequencyController`][kareus.exec.DryRunFrequencyController] (stream-ordered on a
GPU), which records them.

``device="cpu"`` is a dry run for tests and demonstrations: one process, loopback groups,
eager ops on the CPU, and energy from a stand-in meter (the plan's average power per GPU
times host time) unless a fake NVML module is passed. **Its figures are not measurements**
and every output says so.

For a framework's own loop, [`PlanCheck`][kareus.workflow.verification.PlanCheck]
(``PlanApplier.measure()``) measures the iterations between its ``step()`` calls and
compares them with the plan the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kareus._check import check_number
from kareus._io import write_json_atomic
from kareus.compose import Plan
from kareus.errors import ArgumentError, HardwareError, OutputError, PlanError
from kareus.exec.frequency import FrequencyTrigger
from kareus.model.measurement import Measurement
from kareus.model.workload import Workload
from kareus.workflow.result import joules

__all__ = ["VERIFY_NAME", "VERIFY_SYSTEMS", "Figures", "JobLoop", "PlanCheck", "SystemCheck",
           "VerifyReport", "job_measurement", "open_job_loop", "verify"]

#: The file ``kareus verify`` writes (beside the plan by default).
VERIFY_NAME = "verify.json"

#: The systems verify runs: name in ``results.json`` -> the training loop's schedule.
VERIFY_SYSTEMS = {"megatron": "sequential", "nanobatching": "nanobatching",
                  "kareus": "kareus"}

_DRY_NOTE = ("CPU DRY RUN: NOT A MEASUREMENT. The ops ran eagerly on the CPU and the energy "
             "is a stand-in (the plan's average power per GPU x host time); it checks that "
             "the command runs end to end, nothing about the plan.")


@attrs.frozen(kw_only=True)
class Figures:
    """Time and energy of one iteration, energies over every GPU of the job.

    Attributes:
        time_s: Iteration time.
        static_j: Static energy (static power x time).
        dynamic_j: Dynamic energy (the rest).
        total_j: ``static_j + dynamic_j``.
    """

    time_s: float
    static_j: float
    dynamic_j: float
    total_j: float

    @classmethod
    def of_plan(cls, plan: Plan) -> Figures:
        """What the plan was composed to take."""
        return cls(time_s=plan.time_s, static_j=plan.energy_j - plan.dynamic_energy_j,
                   dynamic_j=plan.dynamic_energy_j, total_j=plan.energy_j)

    @classmethod
    def of_summary(cls, row: Mapping[str, Any]) -> Figures:
        """A system's row of ``results.json`` (``time_s``, ``static_j``, ``dynamic_j``,
        ``total_j``)."""
        try:
            return cls(time_s=float(row["time_s"]), static_j=float(row["static_j"]),
                       dynamic_j=float(row["dynamic_j"]), total_j=float(row["total_j"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"results.json: a system's row lacks {exc}: write it with "
                            "kareus optimize") from None

    @classmethod
    def of_measurement(cls, m: Measurement) -> Figures:
        """A measurement of the whole job."""
        return cls(time_s=m.time_s, static_j=m.static_energy_j, dynamic_j=m.dynamic_energy_j,
                   total_j=m.energy_j)

    def to_dict(self) -> dict[str, float]:
        """JSON-ready fields."""
        return attrs.asdict(self)


def job_measurement(*, time_s: float, energy_j: float, measured_gpus: int, job_gpus: int,
                    job_static_power_w: float) -> Measurement:
    """One iteration of the job from what ``measured_gpus`` GPUs drew, scaled to the
    ``job_gpus`` GPUs of the job as the tune scales a partition
    ([`Measurement.scaled_to_scope`][kareus.model.Measurement.scaled_to_scope]); the static
    power is the job's (``job_static_power_w``, what the plan was composed with).

    Args:
        time_s: Measured iteration time.
        energy_j: Energy of the measured GPUs per iteration (their sum).
        measured_gpus: GPUs whose energy was read.
        job_gpus: GPUs of the job.
        job_static_power_w: Static power of every GPU of the job together.
    """
    own = Measurement(time_s=time_s, energy_j=energy_j,
                      static_power_w=job_static_power_w * measured_gpus / job_gpus)
    return own.scaled_to_scope(measured_gpus=measured_gpus, scope_gpus=job_gpus)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


@attrs.frozen(kw_only=True)
class SystemCheck:
    """One system: predicted against measured.

    Attributes:
        system: Its name (``"kareus"``, ``"megatron"``, ``"nanobatching"``).
        schedule: The training loop's schedule that ran it.
        predicted: What the tune composed.
        measured: What the loop measured (energies scaled to the job): the mean over the
            runs whose energy was measured (``energy_runs`` of ``repeats``); ``None`` when
            no run's energy was (never a number that was not measured).
        time_s_spread: Sample standard deviation of the time over repeats.
        total_j_spread: Same for the total energy (``None`` without energy).
        repeats: Runs averaged.
        gpu_busy: The GPU-busy fraction of its windows (``None``: not measured, e.g. on
            the CPU).
        sm_clock_mhz: Mean SM clock the meter sampled in its windows.
        measured_time_s: The measured iteration time (also when the energy is missing).
        energy_method: How the energy was measured: ``"nvml_counter"`` (NVML's
            total-energy counter between its steps inside each window),
            ``"nvml_power_samples"`` (no counter step in a window: NVML's sampled power
            readings, coarser), several joined by ``" + "`` with their run counts where
            runs differed, ``"stand_in"`` (the CPU dry run: not a measurement), or
            ``None``.
        energy_runs: Runs whose energy was measured.
        iterations: Timed iterations per run (the mean; ``steps`` or more, lengthened
            for the energy counter).
    """

    system: str
    schedule: str
    predicted: Figures
    measured: Figures | None
    measured_time_s: float
    time_s_spread: float
    total_j_spread: float | None
    repeats: int
    gpu_busy: float | None = None
    sm_clock_mhz: float | None = None
    energy_method: str | None = None
    energy_runs: int = 0
    iterations: float = 0.0

    def ratios(self) -> dict[str, float | None]:
        """Measured over predicted, per figure (``None`` where there is none)."""
        m = self.measured
        return {"time_s": _ratio(self.measured_time_s, self.predicted.time_s),
                "static_j": None if m is None else _ratio(m.static_j, self.predicted.static_j),
                "dynamic_j": None if m is None else _ratio(m.dynamic_j,
                                                            self.predicted.dynamic_j),
                "total_j": None if m is None else _ratio(m.total_j, self.predicted.total_j)}

    def within(self, tolerance: float) -> bool:
        """Whether time and total energy are each within ``tolerance`` (a fraction) of the
        prediction (a missing energy fails)."""
        r = self.ratios()
        return all(v is not None and abs(v - 1.0) <= tolerance
                   for v in (r["time_s"], r["total_j"]))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, ratios included."""
        d = attrs.asdict(self, recurse=False)
        d["predicted"] = self.predicted.to_dict()
        d["measured"] = None if self.measured is None else self.measured.to_dict()
        d["ratios"] = self.ratios()
        return d


@attrs.frozen(kw_only=True)
class VerifyReport:
    """What ``kareus verify`` found.

    Attributes:
        systems: Every system's check, kareus last.
        tolerance: The fraction each ratio may differ from 1.
        measured: Whether the figures are measurements (``False``: the CPU dry run).
        note: What the figures are (the machine, the stand-ins).
        facts: Everything else ``verify.json`` records (workload, plan, order, runs ...).
    """

    systems: tuple[SystemCheck, ...]
    tolerance: float
    measured: bool
    note: str
    facts: dict[str, Any] = attrs.field(factory=dict)

    @property
    def passed(self) -> bool:
        """Whether every system is within the tolerance."""
        return all(s.within(self.tolerance) for s in self.systems)

    def table(self) -> str:
        """Predicted against measured, side by side, one row per system."""
        head = (f"{'system':13s} {'':9s} {'time (s)':>9s} {'static (J)':>11s} "
                f"{'dynamic (J)':>12s} {'total (J)':>10s}  {'busy':>5s} {'SM MHz':>6s}")
        lines = ([] if self.measured else ["CPU DRY RUN: NOT A MEASUREMENT (see the note "
                                           "below)"])
        if self.facts.get("stand_in"):
            lines.append(f"{self.facts['stand_in']}: every measured figure below is a "
                         "stand-in's (see the note)")
        lines += [head, "-" * len(head)]

        def row(label: str, f: Figures | None, time_s: float) -> str:
            if f is None:
                return f"{'':13s} {label:9s} {time_s:9.4f} {'-':>11s} {'-':>12s} {'-':>10s}"
            return (f"{'':13s} {label:9s} {f.time_s:9.4f} {joules(f.static_j):>11s} "
                    f"{joules(f.dynamic_j):>12s} {joules(f.total_j):>10s}")

        for s in self.systems:
            lines.append(f"{s.system:13s} ({s.schedule})")
            lines.append(row("predicted", s.predicted, s.predicted.time_s))
            busy = "-" if s.gpu_busy is None else f"{s.gpu_busy:.2f}"
            clock = "-" if s.sm_clock_mhz is None else f"{s.sm_clock_mhz:.0f}"
            lines.append(row("measured", s.measured, s.measured_time_s)
                         + f"  {busy:>5s} {clock:>6s}")
            r = s.ratios()
            cells = [("-" if r[k] is None else f"{r[k]:.3f}") for k in
                     ("time_s", "static_j", "dynamic_j", "total_j")]
            ok = "ok" if s.within(self.tolerance) else f"OUTSIDE {100 * self.tolerance:g}%"
            lines.append(f"{'':13s} {'ratio':9s} {cells[0]:>9s} {cells[1]:>11s} "
                         f"{cells[2]:>12s} {cells[3]:>10s}  {ok}")
            lines.append(f"{'':13s} energy from {s.energy_method or 'NOTHING (not measured)'}"
                         f", {s.energy_runs} of {s.repeats} runs, {s.iterations:.0f} "
                         "iterations per run")
        lines.append("")
        lines.append(self.note)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The content of ``verify.json``."""
        return {"kind": "kareus-verify", "version": 1, "measured": self.measured,
                "note": self.note, "tolerance": self.tolerance, "passed": self.passed,
                "systems": {s.system: s.to_dict() for s in self.systems}, **self.facts}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``verify.json`` (atomically); returns its path."""
        p = Path(path)
        if p.is_dir():
            p = p / VERIFY_NAME
        if not p.parent.is_dir():
            raise OutputError(f"--out {p}: the folder {p.parent} does not exist")
        write_json_atomic(p, self.to_dict())
        return p


# ------------------------------------------------------------------ inputs


def _load_inputs(plan: Plan | str | os.PathLike[str],
                 results: Mapping[str, Any] | str | os.PathLike[str] | None
                 ) -> tuple[Plan, dict[str, Any] | None, Path | None]:
    """The plan, ``results.json`` (beside a plan file, unless given) and the plan's
    folder."""
    where: Path | None = None
    if not isinstance(plan, Plan):
        path = Path(plan)
        if path.is_dir():
            path = path / "plan.json"
        plan = Plan.load(path)
        where = path.parent
    res: dict[str, Any] | None
    if results is None:
        found = where / "results.json" if where is not None else None
        res = (json.loads(found.read_text(encoding="utf-8"))
               if found is not None and found.is_file() else None)
    elif isinstance(results, Mapping):
        res = dict(results)
    else:
        try:
            res = json.loads(Path(results).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise PlanError(f"--results {results}: cannot read it ({exc})") from None
    if plan.workload is None:
        raise PlanError("the plan does not record its workload: make it with kareus optimize")
    if res is not None and res.get("workload") is not None:
        mine = Workload.from_dict(dict(plan.workload)).to_dict()
        theirs = Workload.from_dict(dict(res["workload"])).to_dict()
        if mine != theirs:
            raise PlanError("results.json is of another job than the plan: pass the "
                            "results.json of the run that wrote the plan (--results)")
    return plan, res, where


def _predictions(plan: Plan, results: Mapping[str, Any] | None,
                 systems: Sequence[str] | None) -> dict[str, Figures]:
    rows = dict((results or {}).get("systems") or {})
    wanted = list(systems) if systems is not None else [
        s for s in VERIFY_SYSTEMS if s == "kareus" or s in rows]
    unknown = [s for s in wanted if s not in VERIFY_SYSTEMS]
    if unknown:
        raise ArgumentError(f"--systems: {unknown} cannot be run by the training loop; "
                            f"choose from {list(VERIFY_SYSTEMS)}")
    out: dict[str, Figures] = {}
    for s in wanted:
        if s == "kareus":
            continue
        if s not in rows:
            raise PlanError(f"--systems names {s!r}, but no results.json beside the plan "
                            "predicts it: pass --results OUT/results.json")
        out[s] = Figures.of_summary(rows[s])
    if "kareus" in wanted:
        out["kareus"] = Figures.of_plan(plan)
    return out


# ------------------------------------------------------------------ stand-ins (CPU)


class _StandInMeter:
    """The CPU dry run's meter: a constant power per GPU, no counter, no clocks. NOT a
    measurement."""

    energy_method = "stand_in"

    def __init__(self, power_w: float) -> None:
        self.power_w = float(power_w)

    def energy_between(self, t0_s: float, t1_s: float) -> tuple[float, float, int]:
        return self.power_w * (t1_s - t0_s), t1_s - t0_s, 1

    def wait_edges(self, count: int, *, timeout_s: float = 0.5) -> None:
        return None

    def mean_sm_clock_mhz(self, t0_s: float, t1_s: float) -> float | None:
        return None

    def stop(self) -> None:
        return None


class _HostOrderTrigger(FrequencyTrigger):
    """Hands each clock request to its controller at once (on the CPU the host order is
    the stream order): the dry run's trigger."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller
        self._n = 0

    def request(self, freq_mhz: int, *, stream: Any = None) -> int:
        self._n += 1
        self.controller.set_frequency(int(freq_mhz), token=self._n)
        return self._n


# ------------------------------------------------------------------ running


def _world() -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def verify(plan: Plan | str | os.PathLike[str], *,
           results: Mapping[str, Any] | str | os.PathLike[str] | None = None,
           systems: Sequence[str] | None = None, steps: int = 4, warmup: int = 1,
           repeats: int = 2, order_seed: int = 0, seed: int = 0, tolerance: float = 0.10,
           device: str | None = None, backend: str | None = None, graphs: bool | None = None,
           kernels: Any = None, busy_steps: int = 2, nvml: Any = None,
           min_window_s: float | None = None, loopback: str = "plain",
           out: str | os.PathLike[str] | None = None,
           log: Callable[[str], None] | None = None) -> VerifyReport | None:
    """Run the plan and the baselines it was compared with; compare with the predictions.

    Call it on every rank of the job under ``torchrun`` (TP x CP processes, one GPU each),
    or in one process on one GPU, where loopback collectives stand in for the TP and CP
    groups as in the tune (the energy then scaled from one GPU to the job).

    Args:
        plan: The plan (a [`Plan`][kareus.compose.Plan], a ``plan.json``, or an optimize
            output folder).
        results: ``results.json`` of the run that wrote the plan (a path or its content);
            ``None``: the one beside the plan, if any (without it, only the plan is run).
        systems: Systems to run (of ``VERIFY_SYSTEMS``); ``None``: kareus and every
            baseline ``results.json`` predicts.
        steps: Timed iterations per run.
        warmup: Untimed iterations first in each run.
        repeats: Runs per system (interleaved, in an order shuffled from ``order_seed``).
        order_seed: Seed of the run order (the same on every rank).
        seed: Seed of the weights and data.
        tolerance: How far (a fraction) measured time and total energy may be from the
            prediction.
        device: ``"cuda"`` (default where there is one) or ``"cpu"`` (the dry run: NOT a
            measurement).
        backend: The collectives (``kareus.exec.train.BACKENDS``); default
            ``"nccl_capped"`` on several GPUs, ``"loopback"`` on one.
        graphs: Replay each computation from CUDA graphs (default on a GPU).
        kernels: The ops' kernel set (default: per device).
        busy_steps: Iterations queued behind a held GPU to time the GPU's own iteration
            (per system; 0: no busy fraction).
        nvml: A fake NVML module (tests); ``None``: ``pynvml`` on a GPU, the stand-in
            meter on the CPU.
        min_window_s: The shortest timed window of a run (s): iterations are added after
            ``steps`` until the window lasts this long, so that NVML's energy counter
            (which steps about every 100 ms on an H200) steps several times inside it;
            ``None``: [`min_energy_window_s`][kareus.exec.nvml_device.min_energy_window_s]
            of the meter (about 0.75 s on an H200; 0 for the CPU dry run's stand-in). A
            run whose window still holds no counter step takes its energy from NVML's
            sampled power readings, and ``verify.json`` says so (``energy_method``).
        loopback: In one process: ``"plain"`` (the loopback kernel of each collective's
            bytes, far shorter than the real collective) or ``"faithful"`` (each collective
            holds its SM count for the real collective's time at that count and size, from
            the measured collective curves or the emulator's link model:
            [`TimedLoopbackGroupCollective`][kareus.exec.train.TimedLoopbackGroupCollective]);
            every figure made with it is labelled a STAND-IN. Refused under ``torchrun``
            (the real collectives run there).
        out: Where rank 0 writes ``verify.json`` (a file or a folder; ``None``: beside a
            plan file, or nowhere for a plan object).
        log: Progress lines (rank 0).

    Returns:
        The report on rank 0, ``None`` on the other ranks.

    Raises:
        HardwareError: no CUDA device without ``device="cpu"``, or no energy counter.
        PlanError: the plan is not for a job the loop runs (PP or DP above 1), or
            ``results.json`` is of another job.
        ArgumentError: a bad option, or a world that is not the job's TP x CP.

    Examples:
        The CPU dry run of a tiny job's plan (its figures are NOT measurements: on a GPU,
        leave ``device`` out), writing ``verify.json`` beside the plan:

        >>> import tempfile
        >>> import kareus
        >>> arch = kareus.ModelArch(name="tiny", layers=2, hidden=32, heads=4, kv_heads=2,
        ...                         head_dim=8, ffn=64, vocab=50)
        >>> job = kareus.Workload(model=arch, parallelism=kareus.Parallelism(tp=2),
        ...                       microbatch_size=2, seq_len=8, num_microbatches=2)
        >>> out = tempfile.mkdtemp()
        >>> _ = kareus.optimize(job, "h200-sxm", budget=4, progress=False).save(
        ...     out, figure=False)
        >>> report = kareus.verify(out, device="cpu", steps=1, repeats=1)
        >>> [s.system for s in report.systems], report.measured
        (['megatron', 'nanobatching', 'kareus'], False)
        >>> sorted(report.systems[-1].ratios())
        ['dynamic_j', 'static_j', 'time_s', 'total_j']
    """
    if min(steps, repeats) < 1 or warmup < 0 or busy_steps < 0:
        raise ArgumentError("steps and repeats must be >= 1, warmup and busy_steps >= 0")
    if min_window_s is not None:
        min_window_s = check_number("min_window_s", min_window_s, minimum=0.0)
    tolerance = check_number("tolerance", tolerance, positive=True)
    plan, res, where = _load_inputs(plan, results)
    predicted = _predictions(plan, res, systems)
    t_begin = time.perf_counter()
    import torch

    from kareus.exec.train import measure_runs, shuffled_order

    with contextlib.ExitStack() as stack:
        job = open_job_loop(stack, plan, device=device, backend=backend, graphs=graphs,
                            kernels=kernels, seed=seed, nvml=nvml, loopback=loopback)
        loop, wl, cpu, rank, world = job.loop, job.workload, job.cpu, job.rank, job.world

        def say(msg: str) -> None:
            if log is not None and rank == 0:
                log(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}")

        schedules = [VERIFY_SYSTEMS[s] for s in predicted]
        for s in schedules:  # compilation, autotuning, graph capture
            loop.reset()
            loop.step(s)
        if not cpu:
            torch.cuda.synchronize()
        say(f"warmed up; {wl.describe()}, {loop.layers} layers; {job.collectives_note}")
        order = shuffled_order(schedules, repeats, order_seed)
        from kareus.exec.nvml_device import min_energy_window_s

        if (min_window_s is None and hasattr(job.meter, "step_period_s")
                and job.meter.step_period_s() is None):  # learn the counter's period
            job.meter.wait_edges(3, timeout_s=1.0)
        window = (min_window_s if min_window_s is not None else
                  0.0 if isinstance(job.meter, _StandInMeter) else
                  min_energy_window_s(job.meter))
        records = measure_runs(loop, order, steps=steps, warmup=warmup, meter=job.meter,
                               barrier=job.barrier, log=say, min_window_s=window,
                               agree=lambda n: max(job.gather(n)))
        busy_s: dict[str, float | None] = {s: None for s in schedules}
        if not cpu and busy_steps:
            busy_s = _queued_iteration_s(loop, schedules, busy_steps, torch)
        gathered = job.gather({"runs": [r.to_dict() for r in records], "busy": busy_s,
                               "fired": job.clock_requests()})
    if rank != 0:
        return None
    report = _report(plan, wl, predicted, order, gathered, steps=steps, world=world,
                     tolerance=tolerance, cpu=cpu, facts={
                         "collectives": job.collectives_note, "meter": job.meter_note,
                         "device": job.device_name, "warmup": warmup, "steps": steps,
                         "repeats": repeats, "order_seed": order_seed, "seed": seed,
                         "min_window_s": window, "loopback": job.loopback,
                         "stand_in": job.stand_in,
                         "graphs": bool(loop.graphs), "layers": loop.layers,
                         "elapsed_s": time.perf_counter() - t_begin})
    target = Path(out) if out is not None else (where / VERIFY_NAME if where else None)
    if target is not None:
        report.facts["path"] = str(report.save(target))
    return report


@attrs.frozen(kw_only=True)
class JobLoop:
    """The plan's job set up for measuring in this process
    ([`open_job_loop`][kareus.workflow.verification.open_job_loop]).

    Attributes:
        loop: The [`TrainingLoop`][kareus.exec.train.TrainingLoop] (the plan as its
            ``"kareus"`` schedule, and the baselines).
        workload: The plan's job.
        meter: The energy meter (an [`EnergyMeter`][kareus.profilers.EnergyMeter] started,
            or the CPU dry run's stand-in).
        cpu: Whether this is the CPU dry run (NOT a measurement).
        rank: This process's rank; ``world``: processes of the job here.
        device_name: The GPU's name (``"cpu"`` for the dry run).
        collectives_note: What runs the collectives (the loopback stand-in said so).
        meter_note: What the meter is.
        barrier: Every rank waits (``None`` in a world of one).
        gather: ``obj -> every rank's obj``.
        clock_requests: How many clock requests reached the dry-run controller.
        loopback: The one-GPU stand-in (``"plain"`` or ``"faithful"``), ``None`` with
            real collectives.
        stand_in: The STAND-IN label of a time-faithful loopback's figures, else ``None``.
    """

    loop: Any
    workload: Workload
    meter: Any
    cpu: bool
    rank: int
    world: int
    device_name: str
    collectives_note: str
    meter_note: str
    barrier: Callable[[], Any] | None
    gather: Callable[[Any], list[Any]]
    clock_requests: Callable[[], int]
    loopback: str | None = None
    stand_in: str | None = None


def open_job_loop(stack: contextlib.ExitStack, plan: Plan, *, device: str | None = None,
                  backend: str | None = None, graphs: bool | None = None, kernels: Any = None,
                  seed: int = 0, nvml: Any = None, loopback: str = "plain") -> JobLoop:
    """Set up the plan's job in this process as ``kareus verify`` does: the process group
    (several ranks) or loopback groups standing in for the job's (one), the collectives, a
    dry-run clock controller (stream-ordered on a GPU: clocks are never changed), the
    [`TrainingLoop`][kareus.exec.train.TrainingLoop] and the energy meter. ``stack`` closes
    what was opened. Arguments as [`verify`][kareus.workflow.verification.verify].

    Raises:
        PlanError: the plan's job has PP or DP above 1 (the loop runs one stage), or its
            layers are unchained (the loop chains them).
        HardwareError: no CUDA device without ``device="cpu"``; no energy counter.
        ArgumentError: a world that is neither one process nor the job's TP x CP.
    """
    wl = Workload.from_dict(dict(plan.workload or {}))
    p = wl.parallelism
    if p.pp != 1 or p.dp != 1:
        raise PlanError(f"kareus verify runs one pipeline stage of one data-parallel replica "
                        f"(the library's loop); the plan's job has PP={p.pp}, DP={p.dp}")
    if not wl.chained_layers:
        raise PlanError("kareus verify runs the plan in kareus's own training loop, whose "
                        "layers chain; the plan is for layers run one by one (chained_layers="
                        "false, e.g. torchtitan's Trainer): verifying it where it runs is not "
                        "done yet")
    import torch

    if device is None:
        if not torch.cuda.is_available():
            raise HardwareError("no CUDA device: verify measures on the job's GPUs; pass "
                                "--device cpu for the dry run (not a measurement)")
        device = "cuda"
    if device not in ("cuda", "cpu"):
        raise ArgumentError(f"--device must be cuda or cpu, got {device!r}")
    cpu = device == "cpu"
    _, world = _world()
    if cpu and world != 1:
        raise ArgumentError("the CPU dry run is one process (loopback groups stand in for "
                            "the job's): run it without torchrun")
    from kareus.exec.train import LOOPBACK_MODES

    if loopback not in LOOPBACK_MODES:
        raise ArgumentError(f"--loopback must be one of {LOOPBACK_MODES}, got {loopback!r}")
    if loopback != "plain" and world != 1:
        raise ArgumentError(f"--loopback {loopback} stands in for the groups in one process; "
                            f"{world} processes run the real collectives: leave it out")
    ctx = _setup(stack, plan, wl, cpu=cpu, world=world, backend=backend, graphs=graphs,
                 kernels=kernels, seed=seed, nvml=nvml, loopback=loopback)
    return JobLoop(loop=ctx["loop"], workload=wl, meter=ctx["meter"], cpu=cpu,
                   rank=ctx["rank"], world=world, device_name=ctx["device_name"],
                   collectives_note=ctx["collectives"], meter_note=ctx["meter_note"],
                   barrier=ctx["barrier"], gather=ctx["gather"],
                   clock_requests=ctx["fired"],
                   loopback=loopback if world == 1 and p.tp * p.cp > 1 else None,
                   stand_in=ctx.get("stand_in"))


def _setup(stack: contextlib.ExitStack, plan: Plan, wl: Workload, *, cpu: bool, world: int,
           backend: str | None, graphs: bool | None, kernels: Any, seed: int, nvml: Any,
           loopback: str = "plain") -> dict[str, Any]:
    """The process group, groups, collectives, trigger, loop and meter (closed by
    ``stack``)."""
    import torch
    import torch.distributed as dist

    from kareus.exec.executor import RecordingStreamBackend
    from kareus.exec.frequency import DryRunFrequencyController
    from kareus.exec.train import (
        LoopbackGroups,
        TorchParallelGroups,
        TrainingLoop,
        make_collectives,
        named_collectives,
    )

    p = wl.parallelism
    ctx: dict[str, Any] = {"rank": 0, "barrier": None, "device_name": "cpu"}
    if not cpu:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        ctx["device_name"] = torch.cuda.get_device_name(local)
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            stack.callback(dist.destroy_process_group)
    if world > 1:
        ctx["rank"] = dist.get_rank()
        ctx["barrier"] = dist.barrier
        if p.tp * p.cp != world:
            raise ArgumentError(f"the plan is for TP={p.tp} x CP={p.cp}: run it on that many "
                                f"GPUs (not {world}), or in one process on one GPU")
        groups: Any = TorchParallelGroups(tp=p.tp, ep=p.ep)
        backend = backend or "nccl_capped"
    else:
        groups = LoopbackGroups(tp=p.tp, cp=p.cp, ep=p.ep)
        if backend not in (None, "loopback"):
            raise ArgumentError("one process stands in for the job's groups with the "
                                "loopback collective: leave --backend out (or run on TP x CP "
                                "GPUs)")
        backend = "loopback"
    configs = [c for cs in plan.partition_configs().values() for c in cs]
    caps = tuple(sorted({c.comm_sms for c in configs}))
    named_wanted = {c.backend for c in configs if c.backend}
    times = None
    if loopback == "faithful" and world == 1 and p.tp * p.cp > 1:
        from kareus.exec.train import STAND_IN_LABEL
        from kareus.profilers.collective_times import EmulatedCollectiveTimes

        times = EmulatedCollectiveTimes(plan.gpu)
        ctx["stand_in"] = STAND_IN_LABEL
    mode = "faithful" if times is not None else "plain"
    if p.tp * p.cp > 1:
        capped, default, note = make_collectives(groups, backend=backend, caps=caps,
                                                 loopback=mode, times=times)
        named = (named_collectives(groups, named_wanted, caps=caps, loopback=mode,
                                   times=times)
                 if named_wanted and not cpu else {})
    else:
        capped = default = named = None  # type: ignore[assignment]
        note = "no collectives (TP = CP = 1)"
    if world == 1 and p.tp * p.cp > 1:
        note += (f"; one process stands in for the TP={p.tp} x CP={p.cp} group, its energy "
                 f"scaled from 1 GPU to the job's {p.tp * p.cp}")
    controller = DryRunFrequencyController(gpu=plan.gpu)
    trigger: Any
    if cpu:
        trigger = _HostOrderTrigger(controller)
        ctx["fired"] = lambda: len(controller.requests)
    else:
        from kareus.exec.frequency import StreamOrderedTrigger

        trigger = StreamOrderedTrigger(controller)
        stack.callback(trigger.close)
        ctx["fired"] = lambda: len(trigger.fired)
    extra: dict[str, Any] = ({"streams": RecordingStreamBackend(), "device": "cpu",
                              "dtype": "float32", "kernels": kernels or "torch"}
                             if cpu else {"kernels": kernels})
    loop = TrainingLoop(workload=wl, groups=groups, collective=capped,
                        default_collective=default, plan=plan, backends=named or None,
                        frequency=trigger, seed=seed, graphs=False if cpu else graphs,
                        **extra)
    ctx["loop"] = loop
    ctx["collectives"] = note
    if nvml is not None or not cpu:
        from kareus.profilers.nvml import EnergyMeter

        try:
            meter: Any = EnergyMeter(nvml=nvml, device_indices=[0] if cpu else None)
            meter.start()
        except Exception as exc:  # no counter: nothing to verify the energy with
            raise HardwareError(f"cannot read NVML's energy counter ({exc}): verify needs "
                                "it (nvidia-ml-py and an NVIDIA driver)") from exc
        stack.callback(meter.stop)
        ctx["meter_note"] = ("NVML energy counter, step-edge reads (EnergyMeter), this "
                             "process's GPU" + (" (a FAKE NVML module)" if cpu else ""))
    else:
        job = wl.parallelism.world_size
        meter = _StandInMeter(plan.energy_j / plan.time_s / job)
        ctx["meter_note"] = (f"STAND-IN: {meter.power_w:.1f} W per GPU (the plan's average) "
                             "x host time; not a measurement")
    ctx["meter"] = meter
    if world > 1:
        def gather(obj: Any) -> list[Any]:
            every: list[Any] = [None] * world
            dist.all_gather_object(every, obj)
            return every
        ctx["gather"] = gather
    else:
        ctx["gather"] = lambda obj: [obj]
    return ctx


def _queued_iteration_s(loop: Any, schedules: Sequence[str], steps: int, torch: Any
                        ) -> dict[str, float | None]:
    """Each schedule's GPU time per iteration, its steps queued behind a held GPU
    ([`kareus.exec.device_time`][kareus.exec.device_time]); every rank runs the same steps."""
    from kareus.exec.device_time import queued_time_s

    out: dict[str, float | None] = {}
    for s in schedules:
        loop.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop.step(s)
        host_s = time.perf_counter() - t0
        got = queued_time_s(functools.partial(loop.step, s), steps=steps, host_step_s=host_s)
        out[s] = got.step_s
    return out


def _spread(xs: Sequence[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _report(plan: Plan, wl: Workload, predicted: Mapping[str, Figures],
            order: Sequence[tuple[str, int]], every: Sequence[Mapping[str, Any]], *,
            steps: int, world: int, tolerance: float, cpu: bool,
            facts: dict[str, Any]) -> VerifyReport:
    """Merge the ranks' runs (slowest rank's time per iteration, energy summed over ranks)
    and compare with the predictions."""
    runs = []
    for k, (schedule, repeat) in enumerate(order):
        per = [e["runs"][k] for e in every]
        energies = [x["energy_j"] for x in per]
        clocks = [x.get("sm_clock_mhz") for x in per if x.get("sm_clock_mhz") is not None]
        methods = sorted({str(x.get("energy_method")) for x in per})
        runs.append({"schedule": schedule, "repeat": repeat,
                     # every rank ran the same iterations (agreed in measure_runs)
                     "step_time_s": [max(x["step_time_s"][i] for x in per)
                                     for i in range(min(len(x["step_time_s"]) for x in per))],
                     "window_s": max(x["window_s"] for x in per),
                     "energy_j": None if any(e is None for e in energies) else sum(energies),
                     "energy_j_by_rank": energies,
                     "energy_method": (None if any(e is None for e in energies) else
                                       " + ".join(methods)),
                     "energy_method_by_rank": [x.get("energy_method") for x in per],
                     "power_samples_by_rank": [x.get("power_samples", 0) for x in per],
                     "counter_steps_by_rank": [x["counter_steps"] for x in per],
                     "sub_powers_w_by_rank": [x.get("sub_powers_w", []) for x in per],
                     "sm_clock_mhz": statistics.fmean(clocks) if clocks else None,
                     "losses": per[0]["losses"]})
    job = wl.parallelism.world_size
    checks = []
    for system, pred in predicted.items():
        schedule = VERIFY_SYSTEMS[system]
        mine = [r for r in runs if r["schedule"] == schedule]
        times = [statistics.fmean(r["step_time_s"]) for r in mine]
        t = statistics.fmean(times)
        raw = [r["energy_j"] for r in mine if r["energy_j"] is not None]
        counts: dict[str, int] = {}
        for r in mine:
            if r["energy_j"] is not None:
                counts[r["energy_method"]] = counts.get(r["energy_method"], 0) + 1
        method = (None if not counts else next(iter(counts)) if len(counts) == 1 else
                  " + ".join(f"{m} ({n} runs)" for m, n in sorted(counts.items())))
        measured = None
        if raw:  # the runs whose energy was measured; none: no figure
            measured = Figures.of_measurement(job_measurement(
                time_s=t, energy_j=statistics.fmean(raw), measured_gpus=world, job_gpus=job,
                job_static_power_w=pred.static_j / pred.time_s))
        gpu_s = [e["busy"].get(schedule) for e in every]
        busy = (min(1.0, max(gpu_s) / t) if gpu_s and all(g is not None for g in gpu_s)
                else None)
        clocks = [r["sm_clock_mhz"] for r in mine if r["sm_clock_mhz"] is not None]
        checks.append(SystemCheck(
            system=system, schedule=schedule, predicted=pred, measured=measured,
            measured_time_s=t, time_s_spread=_spread(times),
            total_j_spread=_spread(raw) * job / world if measured is not None else None,
            repeats=len(mine), gpu_busy=busy,
            sm_clock_mhz=statistics.fmean(clocks) if clocks else None,
            energy_method=method, energy_runs=len(raw),
            iterations=statistics.fmean(len(r["step_time_s"]) for r in mine)))
    machine = f"{world}x {facts.get('device')}" if not cpu else "this machine's CPU"
    if cpu:
        note = _DRY_NOTE
    else:
        note = (f"Measured on {machine}: time = device events, slowest rank; energy = NVML "
                f"over {world} GPU(s) scaled to the job's {job} (static = the plan's static "
                "power x measured time), each run's window lengthened to "
                f"{facts.get('min_window_s') or 0:.2f} s or more for the counter to step "
                "inside it (the method of each figure: energy_method); clocks unchanged "
                "(dry-run controller)."
                + (" One process stood in for the job's groups (loopback collectives)."
                   if world == 1 and job > 1 else ""))
    if facts.get("stand_in"):
        note = (f"{facts['stand_in']}. " + note + " Collectives: "
                + str(facts.get("collectives")))
    facts = {**facts, "machine": machine, "workload": wl.to_dict(), "job_gpus": job,
             "measured_gpus": world,
             "plan": {"digest": plan.digest, "label": plan.label, "gpu": plan.gpu},
             "energy_scope": (f"total over the job's {job} GPUs per iteration: measured on "
                              f"{world} GPU(s) and scaled to {job} (energy and static power; "
                              "time as measured)" if world != job else
                              f"total over the job's {job} GPUs per iteration"),
             "clocks": ("not changed; the plan's clock requests went to a dry-run controller "
                        f"({every[0]['fired']} requests on rank 0)"),
             "order": [f"{s}#{r}" for s, r in order], "runs": runs,
             "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                 timespec="seconds")}
    return VerifyReport(systems=tuple(checks), tolerance=tolerance, measured=not cpu,
                        note=note, facts=facts)


# ------------------------------------------------------------------ a user's own loop


class PlanCheck:
    """Measures iterations of your own training loop and compares them with the plan.

    Use as a context manager around the iterations, calling
    [`step`][kareus.workflow.verification.PlanCheck.step] at the end of each (every rank alike)::

        with applier.measure(warmup=2) as check:
            for batch in data:
                train_step(batch)
                check.step()
        print(check.report.table())

    The first ``warmup`` iterations are not timed; the others are timed together (the
    device synchronised at both ends, so host gaps count, as they do in training), and
    NVML's energy counter is read at its step edges over the same window (time at least
    [`min_energy_window_s`][kareus.exec.nvml_device.min_energy_window_s], about 0.75 s on
    an H200, for the counter to step inside; a window without a counter step takes NVML's
    sampled power readings instead, and the report says which: ``energy_method``). Energy is summed
    over the ranks of torch's default process group and scaled to the job's GPUs as the
    tune scales (``measured_gpus`` of them read, ``workload.parallelism.world_size``
    stood for); the time is the slowest rank's.

    Args:
        plan: The plan applied.
        workload: Its job (default: the plan's workload).
        meter: An energy meter with ``energy_between`` (default: an
            [`EnergyMeter`][kareus.profilers.EnergyMeter] of this process's GPU, started
            on entry).
        warmup: Iterations not timed.
        tolerance: As [`verify`][kareus.workflow.verification.verify].
        measured_gpus: GPUs whose energy is read (default: the default group's size, 1
            without one).
        synchronize: Waits for the device (default: ``torch.cuda.synchronize`` on a GPU).
        gather: ``obj -> every rank's obj`` (default: over the default process group).
        clock: Host time.

    Attributes:
        report: The [`VerifyReport`][kareus.workflow.verification.VerifyReport] (set on exit, on
            rank 0 and every other rank alike).
    """

    def __init__(self, plan: Plan, *, workload: Workload | None = None, meter: Any = None,
                 warmup: int = 1, tolerance: float = 0.10, measured_gpus: int | None = None,
                 synchronize: Callable[[], None] | None = None,
                 gather: Callable[[Any], list[Any]] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(plan, Plan):
            raise ArgumentError(f"plan must be a kareus.compose.Plan, got {type(plan).__name__}")
        if warmup < 0:
            raise ArgumentError("warmup must be >= 0")
        self.plan = plan
        self.workload = workload or Workload.from_dict(dict(plan.workload or {}))
        self.tolerance = check_number("tolerance", tolerance, positive=True)
        self.warmup = int(warmup)
        self._meter, self._own_meter = meter, meter is None
        self._measured = measured_gpus
        self._sync = synchronize
        self._gather = gather
        self._clock = clock
        self._seen = 0
        self._t0: float | None = None
        self.report: VerifyReport | None = None

    def __enter__(self) -> PlanCheck:
        if self._meter is None:
            from kareus.profilers.nvml import EnergyMeter

            self._meter = EnergyMeter().start()
        if self._sync is None:
            self._sync = _cuda_sync()
        if self.warmup == 0:
            self._begin()
        return self

    def _begin(self) -> None:
        assert self._sync is not None
        self._sync()
        self._t0 = self._clock()

    def step(self) -> None:
        """The end of one iteration of the training loop."""
        self._seen += 1
        if self._seen == self.warmup:
            self._begin()

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.report = self._finish()
        finally:
            if self._own_meter and self._meter is not None:
                self._meter.stop()

    def _finish(self) -> VerifyReport:
        assert self._sync is not None
        self._sync()
        t1 = self._clock()
        timed = self._seen - self.warmup
        if self._t0 is None or timed < 1:
            raise ArgumentError(f"applier.measure() saw {self._seen} iteration(s) with "
                                f"warmup={self.warmup}: call check.step() after each "
                                "iteration, more than warmup times")
        e, d, counted = self._meter.energy_between(self._t0, t1)
        energy, method = None, None
        if counted >= 1 and d > 0:
            energy = e / d * (t1 - self._t0) / timed
            method = str(getattr(self._meter, "energy_method",
                                     f"{type(self._meter).__name__}.energy_between"))
        elif hasattr(self._meter, "mean_power_w"):  # no counter step: power readings
            power, _ = self._meter.mean_power_w(self._t0, t1)
            if power is not None:
                energy, method = power * (t1 - self._t0) / timed, "nvml_power_samples"
        mine = {"time_s": (t1 - self._t0) / timed, "energy_j": energy, "method": method}
        every = (self._gather or _default_gather)(mine)
        world = self._measured or len(every)
        t = max(x["time_s"] for x in every)
        energies = [x["energy_j"] for x in every]
        pred = Figures.of_plan(self.plan)
        job = self.workload.parallelism.world_size
        measured = None
        if all(x is not None for x in energies):
            measured = Figures.of_measurement(job_measurement(
                time_s=t, energy_j=sum(energies), measured_gpus=world, job_gpus=job,
                job_static_power_w=pred.static_j / pred.time_s))
        methods = sorted({str(x.get("method")) for x in every})
        check = SystemCheck(system="kareus", schedule="your loop", predicted=pred,
                            measured=measured, measured_time_s=t, time_s_spread=0.0,
                            total_j_spread=None, repeats=1,
                            energy_method=" + ".join(methods) if measured else None,
                            energy_runs=1 if measured else 0, iterations=timed)
        return VerifyReport(
            systems=(check,), tolerance=self.tolerance, measured=True,
            note=(f"Your loop: {timed} iteration(s) timed on the host (device synchronised "
                  f"at both ends), slowest of {len(every)} rank(s); energy from the meter "
                  f"over {world} GPU(s), scaled to the job's {job}."),
            facts={"iterations": timed, "warmup": self.warmup, "job_gpus": job,
                   "measured_gpus": world, "plan": {"digest": self.plan.digest}})


def _cuda_sync() -> Callable[[], None]:
    try:
        import torch
    except ImportError:
        return lambda: None
    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def _default_gather(obj: Any) -> list[Any]:
    try:
        import torch.distributed as dist
    except ImportError:
        return [obj]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every

