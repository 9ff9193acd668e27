"""The lockstep protocol of a tuning run: rank 0 leads, the other ranks follow.

Every rank of a tuning run must issue the same collectives in the same order. So only rank 0
runs the search and the composition: ``LockstepProfiler`` announces each measurement
(the partition, by its index in a ``Catalog`` every rank builds from the workload, and
the configuration, by value) with one broadcast, then measures it
together with the other ranks, which ``follow`` the announcements until rank 0 says it
is done. Nothing a rank decides alone changes how many collectives run.

Rank 0's measurements can be kept in a JSONL file (``cache``) and served from there by a
later run of the same command, without announcing them again. Each line also keeps how the
GPU was fed (``execution``, ``gpu_busy``) where the inner profiler says
([MeasurementRecord.execution_facts][kareus.profilers.MeasurementRecord.execution_facts]),
so that the run's host-bound measurements (``LockstepProfiler.host_bound``) include
those a resumed run serves from the file. Hardware-free: the inner profiler and the
coordinator are whatever the caller passes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kareus._logging import get_logger
from kareus.errors import ArgumentError, HardwareError
from kareus.model.config import ScheduleConfig
from kareus.model.measurement import Measurement
from kareus.model.partition import OutsideWork, Partition, build_partitions
from kareus.model.profiler import Profiler, ProfilerWrapper
from kareus.model.workload import Workload
from kareus.profilers.nvml import HOST_BOUND_BUSY, Coordinator

__all__ = ["Catalog", "LockstepProfiler", "follow"]

_log = get_logger("kareus.tune")


#: Announcement words: stop (``[0, ok]``), measure a partition, measure outside work.
_STOP, _MEASURE, _OUTSIDE = 0.0, 1.0, 2.0
_WIDTH = 7


def _variants(workload: Workload) -> list[Workload]:
    """The workloads whose partitions the five systems measure (kareus's, without
    nanobatching for the sequential systems, with two nanobatches for nanobatching)."""
    out = [workload, workload.with_(nanobatches=1)]
    if workload.nanobatches < 2:
        out.append(workload.with_(nanobatches=2))
    return out


class Catalog:
    """Every partition type and every outside work a tuning run may measure, in an order
    that every rank derives alike from the workload (so an index names the same thing on
    every rank).

    Args:
        workload: The workload tuned.

    Attributes:
        partitions: ``(partition type, the workload variant it belongs to)``, in order.
        outside: ``(outside work, the workload variant)``, in order (the work outside
            partitions of every stage and phase, and the once-per-iteration work where the
            partition builder models it).
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.partitions: list[tuple[Partition, Workload]] = []
        self.outside: list[tuple[OutsideWork, Workload]] = []
        for wl in _variants(workload):
            pset = build_partitions(wl)
            for part in pset.types.values():
                if all(part != p for p, _ in self.partitions):
                    self.partitions.append((part, wl))
            works = list(pset.outside.values())
            tail = getattr(pset, "iteration", None)  # once per iteration, where modelled
            if isinstance(tail, OutsideWork):
                works.append(tail)
            for work in works:
                if all(work != w for w, _ in self.outside):
                    self.outside.append((work, wl))

    def partition_index(self, partition: Partition) -> int:
        """The index of ``partition`` (a type of one of the variants).

        Raises:
            KeyError: it is none of the workload's partition types.
        """
        for i, (p, _) in enumerate(self.partitions):
            if p is partition or p == partition:
                return i
        raise KeyError(f"partition {partition.name!r} is not a type of {self.workload.describe()}")

    def outside_index(self, work: OutsideWork) -> int:
        """The index of ``work``.

        Raises:
            KeyError: it is none of the workload's outside works.
        """
        for i, (w, _) in enumerate(self.outside):
            if w == work:
                return i
        raise KeyError("outside work not of this workload")


def _encode_config(part: Partition, cfg: ScheduleConfig, backends: Sequence[str]) -> list[float]:
    slots = [s.name for s in part.slots]
    slot = -1 if cfg.launch_slot is None else slots.index(cfg.launch_slot)
    backend = -1 if cfg.backend is None else list(backends).index(cfg.backend)
    return [float(cfg.freq_mhz), float(cfg.comm_sms), float(slot), float(backend)]


def _decode_config(part: Partition, words: Sequence[float], backends: Sequence[str]
                   ) -> ScheduleConfig:
    freq, sms, slot, backend = (int(round(w)) for w in words[:4])
    return ScheduleConfig(freq, sms, None if slot < 0 else part.slots[slot].name,
                          backend=None if backend < 0 else list(backends)[backend])


class LockstepProfiler(ProfilerWrapper):
    """Rank 0's profiler in a tuning run: announces each measurement, then measures it with
    the other ranks (which run ``follow``).

    Measurements made before (``cache``) are answered without measuring again.

    Args:
        inner: This rank's profiler (collective over the group, e.g. an
            [`NVMLProfiler`][kareus.profilers.NVMLProfiler]).
        coordinator: Agreement among the ranks (rank 0 is this one).
        catalog: The catalog every rank built from the workload.
        backends: The backend names configurations may carry, in the same order on
            every rank.
        cache: A JSONL file of earlier measurements, read now and appended to.
    """

    def __init__(self, inner: Profiler, *, coordinator: Coordinator, catalog: Catalog,
                 backends: Sequence[str] = (), cache: str | os.PathLike[str] | None = None
                 ) -> None:
        super().__init__(inner)
        if coordinator.rank != 0:
            raise ArgumentError("the LockstepProfiler runs on rank 0; other ranks call follow()")
        self.coord = coordinator
        self.catalog = catalog
        self.backends = tuple(backends)
        self.cache = None if cache is None else Path(cache)
        self._known: dict[str, Measurement] = {}
        self._facts: dict[str, dict[str, Any]] = {}
        self._broken = False
        self._finished = False
        #: Measurements made in this run (not served from the cache).
        self.measured = 0
        if self.cache is not None and self.cache.is_file():
            with open(self.cache, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        rec = json.loads(line)
                        self._known[rec["key"]] = Measurement.from_dict(rec["measurement"])
                        facts = {k: rec[k] for k in ("execution", "gpu_busy") if k in rec}
                        if facts:  # lines of older runs have none
                            self._facts[rec["key"]] = facts
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut short by a kill: measured again
            _log.info("resuming: %d measurements in %s", len(self._known), self.cache)

    @property
    def known(self) -> int:
        """Measurements made so far, in this run and the runs it resumes."""
        return len(self._known)

    def _remember(self, key: str, m: Measurement, facts: dict[str, Any]) -> None:
        self._known[key] = m
        if facts:
            self._facts[key] = dict(facts)
        if self.cache is not None:
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cache, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"key": key, "measurement": m.to_dict(), **facts}) + "\n")

    @property
    def executions(self) -> list[str]:
        """The execution modes of the measurements known (``"graphed"``, ``"eager"``),
        each once, in order of first use."""
        return list(dict.fromkeys(f["execution"] for f in self._facts.values()
                                  if isinstance(f.get("execution"), str)))

    def host_bound(self) -> list[dict[str, Any]]:
        """The measurements known whose GPU was busy less than
        ``HOST_BOUND_BUSY`` of their window: each as
        ``{"partition", "config", "gpu_busy"}`` (or ``{"outside_work", "freq_mhz",
        "comm_sms", "group_size", "gpu_busy"}``), lowest fraction first."""
        out = []
        for key, facts in self._facts.items():
            busy = facts.get("gpu_busy")
            if not isinstance(busy, (int, float)) or busy >= HOST_BOUND_BUSY:
                continue
            what = json.loads(key)
            if what[0] == "p":
                entry: dict[str, Any] = {"partition": what[2], "config": what[3]}
            else:
                entry = {"outside_work": what[1], "freq_mhz": what[2], "group_size": what[3],
                         "comm_sms": what[4]}
            out.append({**entry, "gpu_busy": float(busy),
                        **({"execution": facts["execution"]} if "execution" in facts else {})})
        return sorted(out, key=lambda e: e["gpu_busy"])

    def _announce(self, words: Sequence[float]) -> None:
        self.coord.broadcast(list(words) + [0.0] * (_WIDTH - len(words)))

    def _collective(self, words: list[float], run: Callable[[], Measurement]
                    ) -> tuple[Measurement, dict[str, Any]]:
        if self._broken or self._finished:
            raise HardwareError("the tuning run's ranks are no longer in step (an earlier "
                                "measurement failed); run the same command again to resume")
        self._announce(words)
        before = self.inner.last_facts
        try:
            m = run()
        except BaseException:
            # The group failed together (a measurement's failure is decided collectively):
            # the followers left their loop too, so nothing more is announced.
            self._broken = True
            raise
        self.measured += 1
        return m, self.facts_since(before)

    def measure(self, partition: Partition, config: ScheduleConfig) -> Measurement:
        """Announce, then measure ``partition`` under ``config`` with every rank."""
        idx = self.catalog.partition_index(partition)
        key = json.dumps(["p", idx, partition.name, config.to_dict()], sort_keys=True)
        if key not in self._known:
            words = [_MEASURE, float(idx), *_encode_config(partition, config, self.backends)]
            self._remember(key, *self._collective(
                words, lambda: self.inner.measure(partition, config)))
        return self._known[key]

    def measure_outside(self, work: OutsideWork, freq_mhz: int, *, group_size: int,
                        comm_sms: int | None = None) -> Measurement:
        """Announce, then measure the outside work with every rank."""
        idx = self.catalog.outside_index(work)
        key = json.dumps(["o", idx, int(freq_mhz), int(group_size), comm_sms])
        if key not in self._known:
            words = [_OUTSIDE, float(idx), float(freq_mhz), float(group_size),
                     -1.0 if comm_sms is None else float(comm_sms)]
            self._remember(key, *self._collective(words, lambda: self.inner.measure_outside(
                work, int(freq_mhz), group_size=group_size, comm_sms=comm_sms)))
        return self._known[key]

    def finish(self, ok: bool = True) -> None:
        """Tell the followers that the run is over (``ok``: it succeeded). Once."""
        if self._finished or self._broken:
            return
        self._finished = True
        self._announce([_STOP, 1.0 if ok else 0.0])


def follow(inner: Profiler, *, coordinator: Coordinator, catalog: Catalog,
           backends: Sequence[str] = ()) -> int:
    """The other ranks' side of a tuning run: measure what rank 0 announces, until it stops.

    Args:
        inner: This rank's profiler.
        coordinator: Agreement among the ranks.
        catalog: The catalog every rank built from the workload.
        backends: The backend names, in rank 0's order.

    Returns:
        Measurements made.

    Raises:
        HardwareError: rank 0 stopped because its run failed.
    """
    count = 0
    while True:
        words = coordinator.broadcast([0.0] * _WIDTH)
        cmd = words[0]
        if cmd == _STOP:
            if words[1] <= 0:
                raise HardwareError("rank 0's tuning run failed (its output says why); this "
                                    "rank stopped with it")
            return count
        if cmd == _MEASURE:
            part, _ = catalog.partitions[int(round(words[1]))]
            inner.measure(part, _decode_config(part, words[2:], backends))
        elif cmd == _OUTSIDE:
            work, _ = catalog.outside[int(round(words[1]))]
            sms = int(round(words[4]))
            inner.measure_outside(work, int(round(words[2])), group_size=int(round(words[3])),
                                  comm_sms=None if sms < 0 else sms)
        else:
            raise HardwareError(f"unknown announcement {words!r} from rank 0")
        count += 1
