"""Assemble a ``GPUProfile`` from measured files: the bench output formats, read.

The profile itself (``kareus.model.gpu_profile``) is data of the model layer; the formats of the
files the benchmarks and ``kareus calibrate``'s neighbours write are the measuring side's, so
their readers live here, beside ``kareus.profilers.calibrate``.

Each reader takes one kind of file the project's benchmarks write and returns the
profile's records; ``build_gpu_profile`` combines them:

* **per-op table** (``bench/op_roofline.py --json``, e.g. ``data/h200_op_roofline.json``):
  ``rows`` with ``workload``, ``partition``, ``op``, ``kind``, ``measured_ms``,
  ``roofline_ms``, ``kernel``, ``power_w`` (optionally a clock per row or for the file),
  the GEMM peak and HBM bandwidth of the same run, and the machine, driver and torch
  versions -> ``OpProfile`` rows and the peaks (``read_op_table``);
* **collective benches** (``bench/collectives.py --json``,
  ``bench/results/collectives_*xh200_nvlink*.json``): ``rows`` with ``op``,
  ``size_bytes``, ``backend``, ``sms`` (``null`` = uncapped), ``time_us``,
  ``busbw_gbps`` and the group size in ``world_size`` -> ``CollectivePoint``
  (``read_collectives``);
* **power probe** (``bench/emulator_power_probe.py --json``,
  ``bench/results/emulator_power_probe_h200.json``): idle power at the idle clock, one
  spinning block, GEMM chains and copies at the clocks the power limit left them ->
  ``LoadPower`` rows and, when no per-op table gives them, the GEMM peak and HBM
  bandwidth (``read_power_probe``);
* **measured grids** (``bench/h200_study.py --json``, ``data/*_grid*.json``): the power
  of GPUs blocked in a receive (static power) summed over the group, divided here by the
  group's GPUs (``read_grid_static_power``).

Every reader reads through ``kareus._io.read_json`` and raises
``GPUProfileError`` naming the file and the field when a
file does not have the layout it expects.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kareus._io import read_json
from kareus.model.gpu import get_gpu
from kareus.model.gpu_profile import (
    CollectivePoint,
    GPUProfile,
    GPUProfileError,
    LoadPower,
    MachineInfo,
    OpProfile,
)

__all__ = [
    "OpTable",
    "PowerProbe",
    "build_gpu_profile",
    "read_collectives",
    "read_grid_static_power",
    "read_op_table",
    "read_power_probe",
]

PathLike = str | os.PathLike[str]


@attrs.frozen(kw_only=True)
class OpTable:
    """What a per-op measurement file holds.

    Attributes:
        ops: The per-op rows: the main kernel set's, then each candidate set's.
        kernel_set: The main kernel set's name (``""``: not in the file).
        gemm_peak_tflops: The GEMM peak measured in the same run (``None``: not in the file).
        hbm_bandwidth_gbps: The HBM bandwidth measured in the same run (``None``: not in it).
        idle_power_w: The file's idle reading (``None``: none).
        machine: Machine fields found in the file (``gpu_name``, ``driver``, ``torch``, ...).
        notes: What the reader had to decide (duplicates dropped, clocks not recorded).
    """

    ops: tuple[OpProfile, ...]
    kernel_set: str
    gemm_peak_tflops: float | None
    hbm_bandwidth_gbps: float | None
    idle_power_w: float | None
    machine: Mapping[str, str]
    notes: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class PowerProbe:
    """What the power probe holds.

    Attributes:
        loads: Power of one GPU under each load, at its median clock.
        idle: The idle reading (``None``: the probe has none).
        gemm_peak_tflops: Best GEMM throughput of its GEMM loads, and its clock.
        gemm_peak_freq_mhz: The clock of that best GEMM load.
        hbm_bandwidth_gbps: Best bandwidth of its copy and elementwise loads.
        machine: Machine fields found in the file.
    """

    loads: tuple[LoadPower, ...]
    idle: LoadPower | None
    gemm_peak_tflops: float | None
    gemm_peak_freq_mhz: int | None
    hbm_bandwidth_gbps: float | None
    machine: Mapping[str, str]


def _source(path: PathLike, root: PathLike | None) -> str:
    """A source file as the profile records it: its path and the start of its SHA-256, so
    that a profile names exactly the measurement it was built from."""
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
    except OSError:
        return _label(path, root)
    return f"{_label(path, root)} (sha256 {digest})"


def _label(path: PathLike, root: PathLike | None) -> str:
    p = Path(path)
    if root is not None:
        try:
            return p.resolve().relative_to(Path(root).resolve()).as_posix()
        except ValueError:
            pass
    return p.as_posix()


def _get(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise GPUProfileError(f"{where}: missing {key!r}")
    return obj[key]


def _num(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GPUProfileError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _opt_clock(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(round(value))
    return None


def _find_number(data: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, float] | None:
    """The first of ``keys`` holding a number, at the top level or one level down."""
    scopes: list[Mapping[str, Any]] = [data]
    scopes += [v for v in data.values() if isinstance(v, Mapping)]
    for scope in scopes:
        for k in keys:
            v = scope.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return k, float(v)
    return None


def _machine_fields(data: Mapping[str, Any]) -> dict[str, str]:
    """``gpu_name``, ``driver``, ``torch``, ``cuda``, ``nccl`` wherever a bench put them."""
    out: dict[str, str] = {}
    scopes: list[Mapping[str, Any]] = [data]
    scopes += [v for k, v in data.items() if isinstance(v, Mapping)
               and k in ("machine", "software", "env", "versions")]
    names = {"gpu_name": ("gpu_name", "gpu"), "driver": ("driver", "driver_version"),
             "torch": ("torch", "torch_version"), "cuda": ("cuda", "cuda_version"),
             "nccl": ("nccl", "nccl_version")}
    for field, keys in names.items():
        for scope in scopes:
            for k in keys:
                v = scope.get(k)
                if isinstance(v, str) and v and field not in out:
                    out[field] = v
    smi = data.get("machine", {}).get("nvidia_smi") if isinstance(data.get("machine"),
                                                                  Mapping) else None
    if "driver" not in out and isinstance(smi, list) and smi and isinstance(smi[0], str):
        out["driver"] = smi[0].split(",")[0].strip()  # "580.159.04, 1980 MHz, 700.00 W"
    if isinstance(data.get("machine"), str) and "gpu_name" not in out:
        out["gpu_name"] = data["machine"]
    return out


# ----------------------------------------------------------------------------- readers


def read_op_table(path: PathLike, *, root: PathLike | None = None) -> OpTable:  # noqa: C901 - one check per optional field of the measured file
    """Read a per-op measurement file (``bench/op_roofline.py --json`` layout).

    Each row of ``rows`` needs ``workload``, ``partition`` (or ``partitions``, a list: one
    record per partition), ``op``, ``kind`` and ``measured_ms``; ``roofline_ms``, ``kernel``, ``power_w``, ``power_busy_frac`` and a
    clock (``sm_clock_mhz`` or ``freq_mhz``, per row or for the whole file) are taken when
    present. The same op measured once and listed under several partitions gives one
    record per partition; a repeated (workload, partition, op) keeps its first row.
    ``kernels`` names the main kernel set. Rows of ``candidates`` (other kernel sets, e.g.
    ``"reference"``: the eager formulas) that name an ``op`` are added under their
    ``kernels`` for every partition the main rows list that op in. The GEMM peak is
    looked up as ``gemm_peak_tflops`` (or ``gemm_tflops``), the HBM bandwidth as
    ``hbm_bandwidth_gbps`` / ``hbm_gbps`` (GB/s) or ``hbm_tb_s`` / ``hbm_tbps`` (TB/s),
    at the top level or one level down (e.g. in ``ceilings``).

    Args:
        path: The file.
        root: Paths in notes are written relative to it (the repository), when given.

    Raises:
        GPUProfileError: the file is unreadable or a row lacks a required field.
    """
    data = read_json(path, error=GPUProfileError, what="per-op measurement file")
    label = _label(path, root)
    rows = _get(data, "rows", f"per-op file {path}")
    if not isinstance(rows, list) or not rows:
        raise GPUProfileError(f"per-op file {path}: 'rows' must be a non-empty list")
    main_set = data.get("kernels") if isinstance(data.get("kernels"), str) else ""
    file_clock = _find_number(data, ("sm_clock_mhz", "freq_mhz"))
    notes: list[str] = []
    ops: dict[tuple[str, str, str, str], OpProfile] = {}
    partitions_of: dict[tuple[str, str], list[str]] = {}
    dropped = 0
    for i, r in enumerate(rows):
        where = f"per-op file {path}, rows[{i}]"
        if not isinstance(r, Mapping):
            raise GPUProfileError(f"{where}: expected an object")
        names = r.get("partitions")
        if names is None:
            expanded = [r]
        elif isinstance(names, list) and names and all(isinstance(n, str) for n in names):
            expanded = [{**r, "partition": n} for n in names]
        else:
            raise GPUProfileError(f"{where}: 'partitions' must be a non-empty list of names")
        for rr in expanded:
            op = _op_record(rr, where, kernels=main_set,
                            clock=None if file_clock is None else file_clock[1])
            partitions_of.setdefault((op.workload, op.op), [])
            if op.partition not in partitions_of[(op.workload, op.op)]:
                partitions_of[(op.workload, op.op)].append(op.partition)
            if op.key in ops:
                dropped += 1
                continue
            ops[op.key] = op
    if dropped:
        notes.append(f"ops: {dropped} repeated (workload, partition, op) row(s) of {label} "
                     "dropped (first kept)")
    cand = data.get("candidates")
    skipped = 0
    for i, r in enumerate(cand if isinstance(cand, list) else []):
        if not isinstance(r, Mapping) or "op" not in r or not isinstance(r.get("kernels"), str):
            continue  # a per-partition candidate row, or not a row
        where = f"per-op file {path}, candidates[{i}]"
        parts = partitions_of.get((str(r.get("workload")), str(r["op"])), [])
        if not parts:
            skipped += 1
        for part in parts:
            op = _op_record({**r, "partition": part}, where, kernels=r["kernels"],
                            clock=None if file_clock is None else file_clock[1])
            ops.setdefault(op.key, op)
    if skipped:
        notes.append(f"ops: {skipped} candidate row(s) of {label} name an op the main rows do "
                     "not have; left out")
    shapes = {k: data[k] for k in ("workloads", "batch") if isinstance(data.get(k), Mapping)}
    if shapes:
        notes.append(f"ops: workload shapes of {label}: "
                     + "; ".join(f"{k} {json.dumps(v, sort_keys=True)}" for k, v in shapes.items()))
    if file_clock is None and not any(o.freq_mhz for o in ops.values()):
        m = data.get("machine") if isinstance(data.get("machine"), Mapping) else {}
        seen = {k: m[k] for k in ("sm_clock_mhz_at_start", "sm_clock_mhz_at_end",
                                  "max_sm_clock_mhz") if isinstance(m.get(k), (int, float))}
        notes.append("ops: SM clock during each op not recorded (default clocks, nothing "
                     "locked)" + (f"; the file's readings: {seen}" if seen else ""))
    gemm = _find_number(data, ("gemm_peak_tflops", "gemm_tflops"))
    hbm = _find_number(data, ("hbm_bandwidth_gbps", "hbm_gbps"))
    if hbm is None:
        tb = _find_number(data, ("hbm_tb_s", "hbm_tbps", "hbm_tb_per_s", "hbm_bandwidth_tbps"))
        hbm = None if tb is None else (tb[0], tb[1] * 1e3)
    idle = data.get("idle_power_w")
    return OpTable(ops=tuple(ops.values()), kernel_set=main_set,
                   gemm_peak_tflops=None if gemm is None else gemm[1],
                   hbm_bandwidth_gbps=None if hbm is None else hbm[1],
                   idle_power_w=float(idle) if isinstance(idle, (int, float))
                   and not isinstance(idle, bool) and idle > 0 else None,
                   machine=_machine_fields(data), notes=tuple(notes))


def _op_record(r: object, where: str, *, kernels: str, clock: float | None) -> OpProfile:
    if not isinstance(r, Mapping):
        raise GPUProfileError(f"{where}: expected an object")
    c = r.get("sm_clock_mhz", r.get("freq_mhz"))
    if c is None:
        c = clock
    roof = r.get("roofline_ms")
    power = r.get("power_w")
    busy = r.get("power_busy_frac")
    try:
        return OpProfile(
            workload=str(_get(r, "workload", where)),
            partition=str(_get(r, "partition", where)),
            op=str(_get(r, "op", where)), kind=_get(r, "kind", where),
            time_s=_num(_get(r, "measured_ms", where), where) / 1e3,
            power_w=None if power is None else _num(power, where),
            freq_mhz=_opt_clock(c),
            roofline_s=None if roof is None else _num(roof, where) / 1e3,
            kernel=str(r.get("kernel") or ""), kernels=kernels,
            power_busy_fraction=None if busy is None else _num(busy, where))
    except GPUProfileError as exc:
        raise GPUProfileError(f"{where}: {exc}") from None


def read_collectives(path: PathLike, *, root: PathLike | None = None
                     ) -> tuple[CollectivePoint, ...]:
    """Read a collective bench file (``bench/collectives.py --json`` layout).

    Args:
        path: The file.
        root: Paths are recorded relative to it (the repository), when given.

    Raises:
        GPUProfileError: the file is unreadable or a row lacks a field.
    """
    data = read_json(path, error=GPUProfileError, what="collective bench file")
    where0 = f"collective bench file {path}"
    group = _get(data, "world_size", where0)
    rows = _get(data, "rows", where0)
    if not isinstance(rows, list):
        raise GPUProfileError(f"{where0}: 'rows' must be a list")
    src = _label(path, root)
    out = []
    for i, r in enumerate(rows):
        where = f"{where0}, rows[{i}]"
        if not isinstance(r, Mapping):
            raise GPUProfileError(f"{where}: expected an object")
        try:
            out.append(CollectivePoint(
                backend=str(_get(r, "backend", where)), collective=_get(r, "op", where),
                group_size=group, size_bytes=_get(r, "size_bytes", where),
                comm_sms=_get(r, "sms", where),
                time_s=_num(_get(r, "time_us", where), where) / 1e6,
                bus_gbps=_num(_get(r, "busbw_gbps", where), where),
                algorithm=str(r.get("algorithm") or ""), source=src))
        except GPUProfileError as exc:
            raise GPUProfileError(f"{where}: {exc}") from None
    return tuple(out)


_PROBE_LOADS = {
    "idle": "idle",
    "spin": "one spinning block",
    "copy": "device-to-device copy",
    "elementwise": "in-place elementwise multiply",
}


def read_power_probe(path: PathLike, *, root: PathLike | None = None) -> PowerProbe:
    """Read the power probe (``bench/emulator_power_probe.py --json`` layout): ``loads``
    mapping a load name to ``avg_w`` and ``sm_clock_median_mhz`` (GEMM loads also
    ``tflops`` or ``tflops_of_gemm_part``; copies ``tb_per_s``).

    Raises:
        GPUProfileError: the file is unreadable or has no ``loads``.
    """
    data = read_json(path, error=GPUProfileError, what="power probe")
    loads = _get(data, "loads", f"power probe {path}")
    if not isinstance(loads, Mapping):
        raise GPUProfileError(f"power probe {path}: 'loads' must be an object")
    src = _label(path, root)
    out: list[LoadPower] = []
    idle = None
    best_gemm: tuple[float, int | None] | None = None
    best_bw: float | None = None
    for name, v in loads.items():
        where = f"power probe {path}, loads.{name}"
        if not isinstance(v, Mapping):
            raise GPUProfileError(f"{where}: expected an object")
        power = _num(_get(v, "avg_w", where), where)
        clock = _opt_clock(v.get("sm_clock_median_mhz"))
        if name.startswith("gemm_d"):
            label = f"bf16 GEMM chain, duty {name[len('gemm_d'):]}"
        else:
            label = _PROBE_LOADS.get(name) or str(name)
        lp = LoadPower(load=label, power_w=power, freq_mhz=clock, source=src)
        out.append(lp)
        if name == "idle":
            idle = lp
        tf = v.get("tflops_of_gemm_part", v.get("tflops"))
        if isinstance(tf, (int, float)) and (best_gemm is None or tf > best_gemm[0]):
            best_gemm = (float(tf), clock)
        tb = v.get("tb_per_s")
        if isinstance(tb, (int, float)) and (best_bw is None or tb * 1e3 > best_bw):
            best_bw = float(tb) * 1e3
    return PowerProbe(loads=tuple(out), idle=idle,
                      gemm_peak_tflops=None if best_gemm is None else best_gemm[0],
                      gemm_peak_freq_mhz=None if best_gemm is None else best_gemm[1],
                      hbm_bandwidth_gbps=best_bw, machine=_machine_fields(data))


def read_grid_static_power(path: PathLike, *, root: PathLike | None = None
                           ) -> tuple[LoadPower, ...]:
    """Static power per GPU from a measured grid (``bench/h200_study.py --json``): its
    ``blocked_power_w`` (GPUs blocked in a receive, summed over the group) divided by the
    group's GPUs (``workload.tp x workload.cp``); also the short idle reading taken just
    before (``idle_power_w``, clocks not yet at idle), labelled as such.

    Raises:
        GPUProfileError: the file is unreadable or lacks the fields.
    """
    data = read_json(path, error=GPUProfileError, what="measured grid")
    where = f"measured grid {path}"
    w = _get(data, "workload", where)
    if not isinstance(w, Mapping):
        raise GPUProfileError(f"{where}: 'workload' must be an object")
    gpus = int(_get(w, "tp", where)) * int(w.get("cp", 1))
    src = _label(path, root)
    out = [LoadPower(load="blocked in a receive (static)",
                     power_w=_num(_get(data, "blocked_power_w", where), where) / gpus,
                     freq_mhz=None, source=src)]
    if isinstance(data.get("idle_power_w"), (int, float)):
        out.append(LoadPower(load="idle for under a second after load (clock not settled)",
                             power_w=float(data["idle_power_w"]) / gpus, freq_mhz=None,
                             source=src))
    return tuple(out)


# ----------------------------------------------------------------------------- builder


def build_gpu_profile(  # noqa: C901 - assembles each optional measured source in turn
    *,
    gpu: str,
    power_probe: PathLike,
    grids: Iterable[PathLike] = (),
    collectives: Iterable[PathLike] = (),
    op_table: PathLike | Sequence[PathLike] | None = None,
    root: PathLike | None = None,
    notes: Iterable[str] = (),
) -> GPUProfile:
    """Assemble a profile of ``gpu`` from measured files.

    Args:
        gpu: The GPU preset the measurements refine (``"h200-sxm"``).
        power_probe: The power probe: idle power and clock, loads at their clocks, and
            the GEMM peak and HBM bandwidth when ``op_table`` does not give them.
        grids: Measured grids: static power (blocked in a receive), per GPU. With none,
            the static power is the power probe's "one spinning block" reading.
        collectives: Collective bench files. Where two files hold the same point
            (backend, collective, group, size, SMs), the first file's is kept.
        op_table: The per-op measurement file, if measured (else the profile has no ops
            and says so in its notes), or several: the first gives the main kernel set,
            the peaks and the machine; the others only add records whose (workload,
            partition, op, kernel set) the profile does not have yet (e.g. the raw bench
            file's candidate kernel sets beside a trimmed table in ``data/``).
        root: Source paths are recorded relative to it (the repository).
        notes: Extra notes to record.

    Raises:
        GPUProfileError: a file is unreadable or lacks what the profile needs.
    """
    spec = get_gpu(gpu)
    probe = read_power_probe(power_probe, root=root)
    if probe.idle is None:
        raise GPUProfileError(f"power probe {power_probe} has no 'idle' load: the profile "
                              "needs the idle power")
    sources = [_source(power_probe, root)]
    notes_out = list(notes)
    loads = list(probe.loads)
    static_readings = []
    for g in grids:
        got = read_grid_static_power(g, root=root)
        loads.extend(got)
        static_readings.append(got[0].power_w)
        sources.append(_source(g, root))
    if static_readings:
        static_w = statistics.median(static_readings)
        notes_out.append(f"static_power_w: median over {len(static_readings)} grid(s) of the "
                         "power of a GPU blocked in a receive, per GPU")
    else:
        spin = [lp for lp in probe.loads if lp.load == "one spinning block"]
        if not spin:
            raise GPUProfileError("no measured grid and no 'spin' load in the power probe: "
                                  "nothing measures the static power")
        static_w = spin[0].power_w
        notes_out.append("static_power_w: one spinning block (no grid measured blocked power)")
    points: dict[tuple[Any, ...], CollectivePoint] = {}
    machine: dict[str, str] = {}
    for c in collectives:
        sources.append(_source(c, root))
        for pt in read_collectives(c, root=root):
            points.setdefault(pt.key, pt)
    ops: tuple[OpProfile, ...] = ()
    kernel_set = ""
    gemm, gemm_clock, hbm = probe.gemm_peak_tflops, probe.gemm_peak_freq_mhz, \
        probe.hbm_bandwidth_gbps
    gemm_src = "the power probe's best GEMM chain"
    hbm_src = "the power probe's best copy"
    tables = ([] if op_table is None else
              [op_table] if isinstance(op_table, (str, os.PathLike)) else list(op_table))
    if tables:
        table = read_op_table(tables[0], root=root)
        sources.insert(0, _source(tables[0], root))
        merged = {o.key: o for o in table.ops}
        kernel_set = table.kernel_set
        machine.update(table.machine)
        notes_out.extend(table.notes)
        for extra in tables[1:]:
            more = read_op_table(extra, root=root)
            added = [o for o in more.ops if o.key not in merged]
            filled = 0
            for o in more.ops:  # the same measurement: take a busy fraction it lacks
                have = merged.get(o.key)
                if (have is not None and have.power_busy_fraction is None
                        and o.power_busy_fraction is not None
                        and (have.time_s, have.power_w) == (o.time_s, o.power_w)):
                    merged[o.key] = attrs.evolve(have, power_busy_fraction=o.power_busy_fraction)
                    filled += 1
            merged.update((o.key, o) for o in added)
            sources.insert(1, _source(extra, root))
            sets = sorted({o.kernels for o in added})
            notes_out.append(f"ops: {len(added)} record(s) added from {_label(extra, root)}"
                             + (f" (kernel sets {', '.join(sets)})" if sets else "")
                             + (f"; power busy fraction of {filled} identical record(s) taken "
                                "from it" if filled else ""))
        ops = tuple(merged.values())
        if table.idle_power_w is not None:
            loads.append(LoadPower(load="idle for 1 s right after the GEMM and copy "
                                        "ceilings (clock not settled)",
                                   power_w=table.idle_power_w, freq_mhz=None,
                                   source=_label(tables[0], root)))
        if table.gemm_peak_tflops is not None:
            gemm, gemm_clock = table.gemm_peak_tflops, None
            gemm_src = "the per-op run"
        if table.hbm_bandwidth_gbps is not None:
            hbm = table.hbm_bandwidth_gbps
            hbm_src = "the per-op run"
    else:
        notes_out.append("ops: none (no per-op measurement given); the emulator's op model "
                         "stays the roofline of the preset")
    if gemm is None or hbm is None:
        raise GPUProfileError("neither the per-op file nor the power probe gives the GEMM "
                              "peak and the HBM bandwidth")
    notes_out.append(f"gemm_peak_tflops: {gemm_src}; hbm_bandwidth_gbps: {hbm_src}")
    for k, v in probe.machine.items():
        machine.setdefault(k, v)
    coll_machine: dict[str, str] = {}
    for c in collectives:
        data = read_json(c, error=GPUProfileError, what="collective bench file")
        for k, v in _machine_fields(data).items():
            coll_machine.setdefault(k, v)
    for k, v in coll_machine.items():
        if k in machine and machine[k] != v and k != "gpu_name":
            notes_out.append(f"machine.{k}: {machine[k]} (ops / power) but {v} (collectives)")
        machine.setdefault(k, v)
    info = MachineInfo(gpu_name=machine.get("gpu_name", spec.name),
                       driver=machine.get("driver", ""), torch=machine.get("torch", ""),
                       cuda=machine.get("cuda", ""), nccl=machine.get("nccl", ""))
    return GPUProfile(
        gpu=spec.name, sm_count=spec.sm_count, machine=info, kernel_set=kernel_set,
        gemm_peak_tflops=gemm, gemm_peak_freq_mhz=gemm_clock, hbm_bandwidth_gbps=hbm,
        idle_power_w=probe.idle.power_w, idle_freq_mhz=probe.idle.freq_mhz,
        static_power_w=static_w, load_powers=tuple(loads), ops=ops,
        collectives=tuple(points.values()), sources=tuple(dict.fromkeys(sources)),
        notes=tuple(notes_out))
