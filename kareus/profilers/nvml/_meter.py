"""Step-edge reads of NVML's total-energy counter on a background thread.

The counter steps about every 100 ms on an H200; the energy between two of its steps is
exact, and their host times are known to about the polling period, so average power
over an edge-to-edge span of a few steps is accurate to a fraction of a percent. Each
step also records how long before it was seen the old value was last read; a step seen
much later than usual (the polling thread kept off a busy CPU) does not bound a span.

A window shorter than the counter's step period may hold no step at all (an H200's
counter steps every ~100 ms, ``data/h200_nvml_energy_counter.json``; a training
iteration of a small model takes ~10 ms). Callers make their windows long enough
([`min_energy_window_s`][kareus.exec.nvml_device.min_energy_window_s]); the meter also
samples NVML's power reading (``nvmlDeviceGetPowerUsage``) every 50 ms, so that a
window without a counter step still has a measured, if coarser, figure
([`mean_power_w`][kareus.profilers.EnergyMeter.mean_power_w]), which its users label as
such.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs

from kareus._logging import get_logger
from kareus.errors import ArgumentError
from kareus.exec.nvml_device import load_nvml, nvml_device_index

__all__ = ["EnergyMeter"]

_log = get_logger(__name__)


@attrs.frozen
class _Edge:
    t_s: float  # host time (perf_counter) at which the new value was first seen
    energy_mj: int
    # How long before t_s the old value was last read (the step happened in between): the
    # polling period, or much more when the thread was kept off the CPU.
    blur_s: float = 0.0
    # False for the first read after the thread starts: a value, not a step.
    step: bool = True


class EnergyMeter:
    """Step-edge reads of NVML's total-energy counter of some local GPUs.

    A background thread polls each GPU's counter every ``poll_interval_s`` and records
    the host time and value whenever the value changes.
    [`energy_between`][kareus.profilers.EnergyMeter.energy_between] then answers "energy and exact
    duration between the first and last counter step inside [t0, t1]" per GPU. The thread also
    samples SM clock and temperature.

    Args:
        device_indices: NVML indices of the GPUs to read; ``None`` = this process's
            current CUDA device, found in NVML by its UUID
            ([`nvml_device_index`][kareus.exec.nvml_device_index]: right under
            ``CUDA_VISIBLE_DEVICES``).
        nvml: The NVML module (``None``: ``pynvml``).
        poll_interval_s: Polling period; the edge times are known to about this much.
        history: Edges kept per GPU.
    """

    #: How the energy it gives is measured (the label runs and reports carry).
    energy_method = "nvml_counter"

    def __init__(self, *, device_indices: Sequence[int] | None = None, nvml: Any = None,
                 poll_interval_s: float | None = None, history: int = 20000) -> None:
        self.nvml = load_nvml(nvml)
        if device_indices is None:
            device_indices = [nvml_device_index(nvml=self.nvml)]
        self.device_indices = tuple(int(i) for i in device_indices)
        if not self.device_indices:
            raise ArgumentError("an EnergyMeter needs at least one GPU")
        self.poll_interval_s = 0.0005 if poll_interval_s is None else float(poll_interval_s)
        self._handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in self.device_indices]
        _log.info("energy meter on NVML GPU(s) %s, polled every %.2f ms",
                  ", ".join(map(str, self.device_indices)), 1e3 * self.poll_interval_s)
        self._history = int(history)
        self._edges: list[list[_Edge]] = [[] for _ in self._handles]
        # t, temps, clocks, powers (W; None when NVML gives no power reading)
        self._samples: list[tuple[float, list[float], list[float], list[float] | None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Failed counter reads so far, and the last failure.
        self.read_errors = 0
        self.last_error: str | None = None

    @property
    def alive(self) -> bool:
        """Whether the polling thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- raw reads ---------------------------------------------------------------------
    def read_energy_mj(self) -> list[int]:
        """Current counter values (mJ), one per GPU."""
        return [int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles]

    def temperatures_c(self) -> list[float]:
        """GPU temperatures (degrees C)."""
        return [float(self.nvml.nvmlDeviceGetTemperature(h, 0)) for h in self._handles]

    def powers_w(self) -> list[float]:
        """Current power readings (W) of NVML's ``nvmlDeviceGetPowerUsage`` (on recent
        GPUs an average over the last second or less, not an instant)."""
        return [float(self.nvml.nvmlDeviceGetPowerUsage(h)) / 1000.0 for h in self._handles]

    def sm_clocks_mhz(self) -> list[float]:
        """Current SM clocks (MHz)."""
        sm = getattr(self.nvml, "NVML_CLOCK_SM", 1)
        return [float(self.nvml.nvmlDeviceGetClockInfo(h, sm)) for h in self._handles]

    # -- background polling ---------------------------------------------------------
    def start(self) -> EnergyMeter:
        """Start the polling thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, name="kareus-energy-meter",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the polling thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._thread = None

    def __enter__(self) -> EnergyMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _poll(self) -> None:
        read_at = time.perf_counter()
        last = self.read_energy_mj()
        now = time.perf_counter()
        with self._lock:
            for k, v in enumerate(last):
                self._edges[k].append(_Edge(now, v, now - read_at, step=False))
        next_sample = now
        while not self._stop.is_set():
            before = read_at  # the old values were read no earlier than this
            read_at = time.perf_counter()
            try:
                vals = self.read_energy_mj()
            except Exception as exc:  # keep polling through NVML hiccups
                self.read_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                read_at = before
                self._stop.wait(self.poll_interval_s)
                continue
            now = time.perf_counter()
            changed = [k for k, v in enumerate(vals) if v != last[k]]
            if changed:
                with self._lock:
                    for k in changed:
                        edges = self._edges[k]
                        edges.append(_Edge(now, vals[k], now - before))
                        if len(edges) > self._history:
                            del edges[: len(edges) - self._history]
                last = vals
            if now >= next_sample:
                s: tuple[float, list[float], list[float], list[float] | None] | None
                try:
                    s = (now, self.temperatures_c(), self.sm_clocks_mhz(), None)
                except Exception:  # sampling is best effort
                    s = None
                if s is not None:
                    with contextlib.suppress(Exception):  # no power reading: counter only
                        s = (s[0], s[1], s[2], self.powers_w())
                if s is not None:
                    with self._lock:
                        self._samples.append(s)
                        if len(self._samples) > self._history:
                            del self._samples[: len(self._samples) - self._history]
                next_sample = now + 0.05
            self._stop.wait(self.poll_interval_s)

    # -- queries -----------------------------------------------------------------------
    def edges(self, device: int = 0) -> list[tuple[float, int]]:
        """(host time, mJ) of every recorded counter step of GPU ``device`` (position)."""
        with self._lock:
            return [(e.t_s, e.energy_mj) for e in self._edges[device]]

    def timed_edges(self, t0_s: float, t1_s: float, device: int = 0
                    ) -> list[tuple[float, int]]:
        """(host time, mJ) of the counter steps inside [t0_s, t1_s] whose host times are
        sharp enough to bound a span (``_window_ends``)."""
        with self._lock:
            inside = [e for e in self._edges[device] if t0_s <= e.t_s <= t1_s]
        if len(inside) < 2:
            return [(e.t_s, e.energy_mj) for e in inside]
        return [(e.t_s, e.energy_mj) for e in self._window_ends(inside)]

    def step_period_s(self, device: int = 0) -> float | None:
        """The time between counter steps seen so far (``None`` before two steps).

        The median gap between consecutive steps that were both seen sharply (each within
        [`sharp_edge_s`][kareus.profilers.EnergyMeter.sharp_edge_s] of the read before
        it); where no such pair exists yet (a polling thread kept off a busy CPU sees steps
        late), the mean gap over every step seen, in which a step seen late shortens the
        next gap by what it lengthened its own. The first read after the thread starts is
        a value, not a step, and takes no part.
        """
        with self._lock:
            steps = [e for e in self._edges[device] if e.step]
        if len(steps) < 2 or steps[-1].t_s <= steps[0].t_s:
            return None
        sharp = self.sharp_edge_s()
        gaps = [b.t_s - a.t_s for a, b in zip(steps[:-1], steps[1:])
                if b.t_s > a.t_s and a.blur_s <= sharp and b.blur_s <= sharp]
        if gaps:
            return statistics.median(gaps)
        return (steps[-1].t_s - steps[0].t_s) / (len(steps) - 1)

    def wait_edges(self, count: int, *, timeout_s: float = 5.0) -> None:
        """Block until every GPU's counter has stepped ``count`` more times."""
        start = [len(self.edges(k)) for k in range(len(self._handles))]
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if all(len(self.edges(k)) - start[k] >= count for k in range(len(self._handles))):
                return
            time.sleep(self.poll_interval_s)

    def sharp_edge_s(self) -> float:
        """Steps seen within this long of the previous read always count as timed
        sharply: four polling periods, at least 5 ms (the GIL's default switch interval;
        a late host time of 5 ms moves a span of ten 100-ms counter steps by 0.5%)."""
        return max(4 * self.poll_interval_s, 0.005)

    def _window_ends(self, inside: list[_Edge]) -> list[_Edge]:
        """The steps that may bound a span: those seen within twice the typical delay
        after the previous read (the median over ``inside``, or
        [`sharp_edge_s`][kareus.profilers.EnergyMeter.sharp_edge_s]), or all of them where fewer than two
        are."""
        limit = max(2 * statistics.median(e.blur_s for e in inside), self.sharp_edge_s())
        sharp = [e for e in inside if e.blur_s <= limit]
        return sharp if len(sharp) >= 2 else inside

    def energy_between(self, t0_s: float, t1_s: float, *, device: int = 0,
                       ) -> tuple[float, float, int]:
        """Energy (J), duration (s) and step count between the first and last counter
        steps of GPU ``device`` inside [t0_s, t1_s] (host ``perf_counter`` times).

        A step seen late, because the polling thread was kept off a busy CPU (or waited
        for the GIL far longer than usual), has a late host time: as an end it would
        shorten or stretch the span by that lateness while the energy between the steps
        stays exact. Such steps do not bound the span (``_window_ends``).

        Returns ``(0, 0, 0)`` when fewer than two steps fall inside.
        """
        with self._lock:
            inside = [e for e in self._edges[device] if t0_s <= e.t_s <= t1_s]
        if len(inside) < 2:
            return 0.0, 0.0, 0
        ends = self._window_ends(inside)
        a, b = ends[0], ends[-1]
        steps = sum(1 for e in inside if a.t_s < e.t_s <= b.t_s)
        return (b.energy_mj - a.energy_mj) / 1000.0, b.t_s - a.t_s, steps

    def split_powers_w(self, t0_s: float, t1_s: float, parts: int, *, device: int = 0
                       ) -> list[float]:
        """Average power (W) over ``parts`` consecutive edge-to-edge sub-windows that
        together span the steps inside [t0_s, t1_s] (fewer if there are too few steps)."""
        with self._lock:
            inside = [e for e in self._edges[device] if t0_s <= e.t_s <= t1_s]
        if len(inside) < 2:
            return []
        ends = self._window_ends(inside)  # sub-windows bounded by sharply timed steps
        n = len(ends) - 1
        parts = max(1, min(parts, n))
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        out = []
        for i, j in zip(bounds[:-1], bounds[1:]):
            a, b = ends[i], ends[j]
            if b.t_s > a.t_s:
                out.append((b.energy_mj - a.energy_mj) / 1000.0 / (b.t_s - a.t_s))
        return out

    def mean_sm_clock_mhz(self, t0_s: float, t1_s: float) -> float | None:
        """Mean sampled SM clock over [t0_s, t1_s] (all GPUs of this meter)."""
        with self._lock:
            vals = [c for t, _, cs, _p in self._samples if t0_s <= t <= t1_s for c in cs]
        return statistics.fmean(vals) if vals else None

    def mean_power_w(self, t0_s: float, t1_s: float, *, device: int = 0
                     ) -> tuple[float | None, int]:
        """Mean of the power readings sampled inside [t0_s, t1_s] of GPU ``device`` (W) and
        how many there were; ``(None, n)`` with fewer than two.

        A coarser figure than the counter's: the readings are 50 ms apart and NVML may
        average each over up to a second. For windows that hold no counter step."""
        with self._lock:
            vals = [p[device] for t, _, _c, p in self._samples
                    if t0_s <= t <= t1_s and p is not None]
        return (statistics.fmean(vals) if len(vals) >= 2 else None), len(vals)
