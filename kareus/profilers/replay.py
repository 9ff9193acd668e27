"""Replaying recorded measurements: a profiler that looks configurations up in a file.

A measured grid (every configuration of some partitions, profiled on real GPUs, as
``bench/h200_study.py`` writes it) lets the search, the composition and their tests
run on any CPU against what the hardware really did. [`ReplayProfiler`][kareus.profilers.ReplayProfiler]
answers ``measure(partition, config)`` from such a file: a configuration measured several
times answers with its samples in turn (so a search sees the real spread), and a
configuration never measured raises [`ConfigError`][kareus.errors.ConfigError] naming what
the file holds.

File format (JSON): ``gpu`` (preset name), ``static_power_w`` (of the measured group;
``static_power_scope_gpus`` says how many GPUs that is, else TP x CP of ``workload``),
``workload`` (optional, [`to_dict`][kareus.model.Workload.to_dict]) and
``measurements``: a list of rows, each with ``partition``, ``config``
([`to_dict`][kareus.model.ScheduleConfig.to_dict]), ``measurement``
([`to_dict`][kareus.model.Measurement.to_dict]) and ``kind`` (rows whose kind
is not in ``kinds`` are ignored; rows whose ``comm_sms`` is ``null`` are baselines
with the collective library's own SM count, kept in ``ReplayProfiler.baselines``).
Rows of kind ``"outside"`` hold work outside partitions: ``work`` (``work_key``),
``freq_mhz``, ``comm_sms`` (or ``null``) and ``group_size``.

``RecordingProfiler`` wraps any profiler and writes what it measured in this format,
so a run on real GPUs (or on the emulator) can be replayed exactly on any CPU. A row of a
profiler that says how it fed the GPU (the NVML profiler's
[MeasurementRecord.execution_facts][kareus.profilers.MeasurementRecord.execution_facts])
also holds ``execution`` (``"graphed"`` or ``"eager"``) and ``gpu_busy`` (the fraction of
the window the GPU was busy); replaying ignores them, and rows without them load as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kareus._io import read_json, write_text_atomic
from kareus.errors import DATA_ERRORS, ArgumentError, ConfigError, data_problem
from kareus.model.config import ConfigSpace, ScheduleConfig
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition
from kareus.model.profiler import Profiler, ProfilerWrapper

__all__ = ["RecordingProfiler", "ReplayProfiler", "work_key"]


def work_key(work: OutsideWork) -> str:
    """A stable content key of work outside partitions (its ops and collectives)."""
    content = {"ops": [[o.name, o.kind.value, o.flops, o.bytes_moved] for o in work.ops],
               "comms": [[c.name, c.kind.value, c.bytes, c.group_size] for c in work.comms]}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


class ReplayProfiler(Profiler):
    """Answers measurements from a recorded grid.

    Args:
        source: Path of the JSON file, or the loaded dict.
        gpu: GPU preset; ``None`` = the file's ``gpu``.
        kinds: Row kinds to replay (default: ``("grid", "repeat", "search", "nanobatch",
            "seq_default")``: every per-partition measurement of a scheduled config).
        samples: ``"cycle"`` answers a configuration's samples in turn; ``"mean"`` always
            answers their mean.

    Raises:
        ConfigError: The file is not a recording, a row is corrupt or of another GPU, or
            no row can be replayed (one line naming the row and what is wrong).
        ValueError: An unknown ``samples`` mode.
    """

    DEFAULT_KINDS = ("grid", "repeat", "search", "nanobatch", "seq_default")

    def __init__(self, source: str | os.PathLike[str] | Mapping[str, Any], *,
                 gpu: str | GPUSpec | None = None, kinds: Sequence[str] | None = None,
                 samples: str = "cycle") -> None:
        if isinstance(source, Mapping):
            data = dict(source)
            self.path: Path | None = None
        else:
            self.path = Path(source)
            data = read_json(self.path, error=ConfigError, what="recording")
        if samples not in ("cycle", "mean"):
            raise ArgumentError(f"samples must be 'cycle' or 'mean', got {samples!r}")
        self.samples = samples
        where = f"recording {self.path or '(dict)'}"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a JSON object with 'measurements', got "
                              f"{type(data).__name__}: the file is not a kareus recording")
        self.data = data
        recorded = data.get("gpu")
        if recorded is not None and not isinstance(recorded, str):
            raise ConfigError(f"{where}: gpu must be a preset name, got {recorded!r:.40}")
        self.gpu = get_gpu(gpu if gpu is not None else recorded or "h200-sxm")
        if recorded is not None and gpu is not None and self.gpu.name != recorded:
            raise ConfigError(f"recording {self.path or '(dict)'} was measured on {recorded}, "
                              f"not {self.gpu.name}: replay it as {recorded} (--gpu {recorded}) "
                              "or record on the GPU you want")
        self._outside: dict[tuple[str, int, int | None, int], list[Measurement]] = {}
        wanted = set(self.DEFAULT_KINDS if kinds is None else kinds)
        self._table: dict[tuple[str, ScheduleConfig], list[Measurement]] = {}
        self.baselines: dict[tuple[str, str], list[Measurement]] = {}
        row = None
        try:
            self._static_w = float(data["static_power_w"])
            if not 0 < self._static_w < float("inf"):
                raise ValueError(f"static_power_w must be a positive number, got "
                                 f"{data['static_power_w']!r:.40}")
            if "static_power_scope_gpus" in data:
                self.group_size = int(data["static_power_scope_gpus"])
            else:
                self.group_size = int(data.get("workload", {}).get("tp", 1)) * \
                    int(data.get("workload", {}).get("cp", 1))
            if self.group_size < 1:
                raise ValueError(f"the static power's group of {self.group_size} GPUs")
            rows = data.get("measurements", [])
            if not isinstance(rows, list):
                raise TypeError(f"measurements must be a list of rows, got "
                                f"{type(rows).__name__}")
            for i, entry in enumerate(rows):
                row = i
                self._add_row(entry, wanted)
        except ConfigError:
            raise
        except DATA_ERRORS as exc:
            at = "" if row is None else f" measurement row {row}:"
            raise ConfigError(f"{where}:{at} {data_problem(exc)}: the recording is corrupt; "
                              "record it again (--record FILE) or fix that row") from None
        if not self._table:
            raise ConfigError(f"{where}: no replayable measurements (rows with a comm_sms and "
                              f"a kind in {sorted(wanted)})")
        self._served: dict[Any, int] = {}
        self.calls = 0

    def _add_row(self, row: Any, wanted: set[str]) -> None:
        """File one measurement row (KeyError, TypeError, ValueError on a bad one)."""
        if not isinstance(row, Mapping):
            raise TypeError(f"a row must be an object, got {type(row).__name__}")
        if "measurement" not in row:
            return
        m = Measurement.from_dict(row["measurement"])
        if row.get("kind") == "outside":
            sms = row.get("comm_sms")
            okey = (str(row["work"]), int(row["freq_mhz"]), None if sms is None else int(sms),
                    int(row["group_size"]))
            self._outside.setdefault(okey, []).append(m)
            return
        cfg = row["config"]
        _check_row(cfg, self.gpu, self.path)
        if cfg.get("comm_sms") is None:
            self.baselines.setdefault((str(row["partition"]), str(row["kind"])),
                                      []).append(m)
            return
        if row.get("kind") not in wanted:
            return
        key = (str(row["partition"]), ScheduleConfig.from_dict(cfg))
        self._table.setdefault(key, []).append(m)

    # -- lookups -----------------------------------------------------------------------
    @property
    def partitions(self) -> list[str]:
        """Partition types in the file."""
        return sorted({p for p, _ in self._table})

    def configs(self, partition: str) -> list[ScheduleConfig]:
        """Configurations recorded for ``partition``."""
        return sorted((c for p, c in self._table if p == partition),
                      key=lambda c: (-c.freq_mhz, c.comm_sms, c.launch_slot or "~"))

    def samples_of(self, partition: str, config: ScheduleConfig) -> list[Measurement]:
        """Every recorded measurement of one configuration."""
        return list(self._table.get((partition, config), []))

    def space(self, partition: Partition) -> ConfigSpace:
        """The configurations to search for ``partition``: the recorded grid when it is a
        full product of its frequencies, SM counts and slots (a measured study), else the
        GPU's full space (a recorded search replays by asking the same configurations)."""
        try:
            return self.grid_space(partition)
        except ConfigError:
            if not self.configs(partition.name):
                raise
            return super().space(partition)

    def grid_space(self, partition: Partition) -> ConfigSpace:
        """The grid recorded for ``partition``, as a [`ConfigSpace`][kareus.model.ConfigSpace] (the file must hold
        the full product of its frequencies, SM counts and slots)."""
        cfgs = self.configs(partition.name)
        if not cfgs:
            raise ConfigError(f"no measurements of partition {partition.name!r}; the file has "
                              f"{', '.join(self.partitions)}")
        freqs = sorted({c.freq_mhz for c in cfgs}, reverse=True)
        sms = sorted({c.comm_sms for c in cfgs})
        named = [s.name for s in partition.slots if any(c.launch_slot == s.name for c in cfgs)]
        seq = any(c.launch_slot is None for c in cfgs)
        space = ConfigSpace(partition, self.gpu, freqs_mhz=freqs, comm_sms=sms, slots=named,
                            include_sequential=seq)
        missing = [c for c in space.configs if (partition.name, c) not in self._table]
        if missing:
            raise ConfigError(f"the recorded grid of {partition.name!r} is not a full product: "
                              f"{len(missing)} configurations missing, e.g. {missing[0]}")
        return space

    def baseline(self, partition: str, kind: str) -> Measurement:
        """Mean of the baseline rows of ``kind`` (e.g. ``"megatron"``, ``"nanobatch"``)."""
        ms = self.baselines.get((partition, kind))
        if not ms:
            have = sorted({k for p, k in self.baselines if p == partition})
            raise KeyError(f"no {kind!r} baseline for {partition!r}; recorded: {have}")
        return _mean(ms)

    # -- Profiler --------------------------------------------------------------------
    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """The recorded measurement of ``partition`` under ``config`` (samples in turn, or
        their mean).

        Raises:
            ConfigError: the configuration was never recorded for this partition.
        """
        key = (partition.name, config)
        ms = self._table.get(key)
        if not ms:
            have = self.configs(partition.name)
            hint = (f"{len(have)} configurations of {partition.name!r} are recorded "
                    f"(SM counts {sorted({c.comm_sms for c in have})}, slots "
                    f"{sorted({str(c.launch_slot) for c in have})}, "
                    f"MHz {sorted({c.freq_mhz for c in have})})" if have else
                    f"no configuration of {partition.name!r} is recorded (partitions: "
                    f"{', '.join(self.partitions)})")
            raise ConfigError(f"{config} was not measured: {hint}")
        self.calls += 1
        if self.samples == "mean":
            return _mean(ms)
        i = self._served.get(key, 0)
        self._served[key] = i + 1
        return ms[i % len(ms)]

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """The recorded measurement of work outside partitions at ``freq_mhz``.

        Raises:
            ConfigError: that work was never recorded at this clock and SM count.
        """
        key = (work_key(work), int(freq_mhz), None if comm_sms is None else int(comm_sms),
               int(group_size))
        ms = self._outside.get(key)
        if not ms:
            have = sorted({f for w, f, _, _ in self._outside if w == key[0]})
            raise ConfigError(
                f"work outside partitions ({len(work.ops)} ops, {len(work.comms)} collectives) "
                f"was not recorded at {freq_mhz} MHz" + (f"; recorded at {have} MHz" if have else
                "; record a run with RecordingProfiler to replay whole iterations"))
        self.calls += 1
        if self.samples == "mean":
            return _mean(ms)
        i = self._served.get(key, 0)
        self._served[key] = i + 1
        return ms[i % len(ms)]

    def static_power_w(self, group_size: int | None = None) -> float:
        """The recorded static power of the measured group (scaled per GPU for another
        ``group_size``)."""
        if group_size is None or group_size == self.group_size or self.group_size < 1:
            return self._static_w
        return self._static_w / self.group_size * group_size

    def __repr__(self) -> str:
        n = sum(len(v) for v in self._table.values())
        return (f"ReplayProfiler({self.path or 'dict'}: {n} measurements of "
                f"{len(self._table)} configurations, partitions {self.partitions})")

    @property
    def uses_gpus(self) -> bool:
        """``False``: a replay reads a file."""
        return False

    def identity(self) -> dict[str, Any]:
        """The class, how samples are answered and a digest of the recording."""
        blob = json.dumps(self.data, sort_keys=True, separators=(",", ":"), default=repr)
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}",
                "samples": self.samples,
                "data_digest": hashlib.sha256(blob.encode("utf-8")).hexdigest()}

    @property
    def measurement_count(self) -> int:
        """Measurements answered so far (``calls``)."""
        return self.calls

    def advance_measurements(self, count: int) -> None:
        """Count ``count`` answers given by copies (a pool's search tasks) as given here."""
        self.calls += int(count)


def _mean(ms: Iterable[Measurement]) -> Measurement:
    ms = list(ms)
    return Measurement(time_s=sum(m.time_s for m in ms) / len(ms),
                       energy_j=sum(m.energy_j for m in ms) / len(ms),
                       static_power_w=ms[0].static_power_w)


def _check_row(cfg: Any, gpu: GPUSpec, path: Path | None) -> None:
    """Refuse a recorded configuration the GPU cannot run (a clock it lacks, an SM count
    outside ``1..SMs - 1``): such a row is corrupt or from another GPU."""
    where = f"recording {path or '(dict)'}"
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{where}: a row's config is not an object: {cfg!r:.60}")
    sms, freq = cfg.get("comm_sms"), cfg.get("freq_mhz")
    if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int)
                            or not 1 <= sms <= gpu.sm_count - 1):
        raise ConfigError(f"{where}: a row has comm_sms={sms!r:.20}, impossible on {gpu.name} "
                          f"(1..{gpu.sm_count - 1}): the recording is corrupt or of another GPU")
    if freq is not None and (isinstance(freq, bool) or not isinstance(freq, int)
                             or not gpu.supports_clock(freq)):
        raise ConfigError(f"{where}: a row has freq_mhz={freq!r:.20}, not a clock of "
                          f"{gpu.name}: the recording is corrupt or of another GPU")


class RecordingProfiler(ProfilerWrapper):
    """Wraps a profiler and keeps every measurement it makes, to save as a replay file.

    Args:
        inner: The profiler that measures.

    Example::

        rec = RecordingProfiler(NVMLProfiler(...))
        result = optimize(workload, profiler=rec)
        rec.save("my-run.json", what="...")   # replay: ReplayProfiler("my-run.json")
    """

    def __init__(self, inner: Profiler) -> None:
        super().__init__(inner)
        self.rows: list[dict[str, Any]] = []
        self._earlier: set[int] = set()  # ids of the rows add_earlier put in (kept alive)

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Measure with the wrapped profiler and record the row."""
        before = self.inner.last_facts
        m = self.inner.measure(partition, config)
        self.rows.append({"kind": "grid", "partition": partition.name,
                          "config": config.to_dict(), "measurement": m.to_dict(),
                          **self.facts_since(before)})
        return m

    def add_earlier(self, partition_name: str, config: ScheduleConfig,
                    measurement: Measurement) -> bool:
        """Record a measurement of ``partition_name`` made before this profiler was used:
        one a resumed search read back from its log instead of measuring it again.

        It goes ahead of this profiler's own rows of the same configuration, as it was
        measured first (a replay answers a configuration's samples in turn), and after the
        earlier rows of it added before (two partitions of one name, such as the nanobatched
        and the unsplit ``fwd_mlp``, were measured in the order they are added), so the file
        replays the run as one uninterrupted run would have recorded it. Returns False,
        recording nothing, when the same row is recorded already (it was measured here).
        """
        row = {"kind": "grid", "partition": partition_name, "config": config.to_dict(),
               "measurement": measurement.to_dict()}
        if any({k: r.get(k) for k in row} == row for r in self.rows):  # facts aside
            return False
        own = [i for i, r in enumerate(self.rows) if r.get("kind") == "grid"
               and r.get("partition") == partition_name and r.get("config") == row["config"]
               and id(r) not in self._earlier]
        self.rows.insert(own[0] if own else len(self.rows), row)
        self._earlier.add(id(row))
        return True

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Measure outside work with the wrapped profiler and record the row."""
        before = self.inner.last_facts
        m = self.inner.measure_outside(work, freq_mhz, group_size=group_size,
                                       comm_sms=comm_sms)
        self.rows.append({"kind": "outside", "work": work_key(work), "freq_mhz": int(freq_mhz),
                          "comm_sms": comm_sms, "group_size": int(group_size),
                          "measurement": m.to_dict(), **self.facts_since(before)})
        return m

    def to_dict(self, *, what: str = "", workload: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:
        """The replay file's content."""
        return {"what": what or f"measurements recorded from {self.inner!r}",
                "gpu": self.gpu.name, "static_power_w": self.inner.static_power_w(1),
                "static_power_scope_gpus": 1,
                **({"workload": dict(workload)} if workload is not None else {}),
                "measurements": list(self.rows)}

    def save(self, path: str | os.PathLike[str], *, what: str = "",
             workload: Mapping[str, Any] | None = None) -> Path:
        """Write the replay file (JSON) and return its path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(
            p, json.dumps(self.to_dict(what=what, workload=workload), indent=0) + "\n")

    def __repr__(self) -> str:
        return f"RecordingProfiler({self.inner!r}: {len(self.rows)} measurements)"
