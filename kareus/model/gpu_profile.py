"""A measured GPU profile: what the emulated GPU needs to know about one real GPU model.

The emulator's presets carry datasheet figures and a handful of constants fitted to
probes. A ``GPUProfile`` carries what was *measured* on a real GPU of that model, so
that the emulator can take its inputs from measurements instead:

* per-op time and average power of the runnable partitions' ops, at the clock they ran
  at where it was recorded (``OpProfile``, keyed by workload, partition, op name and
  kernel set: the production kernels and, e.g., the eager reference formulas), and the
  host time of one eager launch of each (``host_s``; how it was measured:
  ``GPUProfile.host_method``), which decides whether eager execution keeps the GPU
  fed;
* the GEMM peak (TFLOP/s) and the HBM bandwidth (GB/s) measured on the same GPU;
* idle power and static power (a GPU blocked waiting on communication), and power under
  other named loads at the clock observed (``LoadPower``): the power-capped loads sit
  at several clocks, which is what can be learned about frequency without changing it;
* collective curves: time and bus bandwidth per SM count (CTA cap), message size and
  group size, for each backend (``CollectivePoint``; ``comm_sms`` ``None`` = the
  backend picks its own CTA count);
* the machine, driver and software versions it was measured with (``MachineInfo``),
  and the files it was assembled from.

Every field is validated on construction. The file format is versioned JSON::

    {"format": "kareus.gpu_profile", "version": 1, "digest": "<sha256>", "profile": {...}}

``digest`` is the SHA-256 of the canonical JSON of ``profile`` (sorted keys, no spaces);
``GPUProfile.load`` recomputes it, so a file edited by hand is refused rather than
silently used. Files are read through ``kareus._io.read_json``, so every way a file
can be bad raises one ``GPUProfileError`` naming the file.

Profiles measured by the project ship as package data (``kareus/model/profiles/``):
``GPUProfile.preset`` loads one by GPU preset name, ``shipped_profiles`` lists
them. The profile is data, not a model: the emulator decides how to use it.
``kareus.profilers.profile_build`` (the measuring side) assembles a profile from the project's
measured files (bench results and data files).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kareus._io import read_json, write_json_atomic
from kareus.errors import KareusError
from kareus.model.ops import CommKind

__all__ = [
    "OP_KINDS",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "CollectivePoint",
    "GPUProfile",
    "GPUProfileError",
    "LoadPower",
    "MAX_HOST_S",
    "MachineInfo",
    "OpProfile",
    "profile_digest",
    "shipped_profiles",
]

PROFILE_FORMAT = "kareus.gpu_profile"
PROFILE_VERSION = 1
OP_KINDS = ("gemm", "attention", "elementwise")
"""Op kinds of ``OpProfile`` (those of the per-op measurement)."""
MAX_HOST_S = 1.0
"""Upper bound (exclusive) of ``OpProfile.host_s``, seconds."""
#: Fields added after version 1 was first written (``OpProfile.host_s``,
#: ``OpProfile.power_execution``, ``GPUProfile.host_method``), left out of the stored profile
#: (and of its digest) while at their defaults, so that the files written before them load
#: and keep their digests.
_OMIT_AT_DEFAULT = frozenset({"host_s", "power_execution", "host_method"})
#: Values of :attr:`OpProfile.power_execution`.
POWER_EXECUTIONS = ("graphed", "eager")


def _keep_field(attribute: attrs.Attribute, value: object) -> bool:
    """The ``attrs.asdict`` filter of ``GPUProfile.profile_dict``."""
    return not (attribute.name in _OMIT_AT_DEFAULT and value == attribute.default)


class GPUProfileError(KareusError, ValueError):
    """A GPU profile (file or value) that is corrupt, of another version, or invalid."""

    exit_code = 2


# ----------------------------------------------------------------------------- validators


def _name(cls: str):  # attrs validator factory
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str) or not value.strip():
            raise GPUProfileError(f"{cls}.{attribute.name} must be a non-empty string, "
                                  f"got {value!r}")
    return check


def _text(cls: str):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str):
            raise GPUProfileError(f"{cls}.{attribute.name} must be a string, got {value!r}")
    return check


def _positive(cls: str, *, optional: bool = False):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value is None and optional:
            return
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise GPUProfileError(f"{cls}.{attribute.name} must be a finite number > 0"
                                  f"{' or null' if optional else ''}, got {value!r}")
    return check


def _count(cls: str, *, minimum: int, optional: bool = False):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise GPUProfileError(f"{cls}.{attribute.name} must be an integer >= {minimum}"
                                  f"{' or null' if optional else ''}, got {value!r}")
    return check


def _clock(cls: str):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000:
            raise GPUProfileError(f"{cls}.{attribute.name} must be a clock in MHz "
                                  f"(1..10000) or null (not recorded), got {value!r}")
    return check


def _int_or_none(value: object) -> object:
    # JSON has one number type: accept 1980.0 for an integer field, leave the rest to
    # the validator.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _float_or_same(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _tuple_of(cls: type, label: str):
    def convert(value: object) -> tuple[Any, ...]:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise GPUProfileError(f"GPUProfile.{label} must be a list, got "
                                  f"{type(value).__name__}")
        items = tuple(value)
        for i, item in enumerate(items):
            if not isinstance(item, cls):
                raise GPUProfileError(f"GPUProfile.{label}[{i}] must be a {cls.__name__}, "
                                      f"got {type(item).__name__}")
        return items
    return convert


def _str_tuple(label: str):
    def convert(value: object) -> tuple[str, ...]:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise GPUProfileError(f"GPUProfile.{label} must be a list of strings, got "
                                  f"{type(value).__name__}")
        items = tuple(value)
        if not all(isinstance(s, str) and s for s in items):
            raise GPUProfileError(f"GPUProfile.{label} must hold non-empty strings")
        return items
    return convert


# ----------------------------------------------------------------------------- records


@attrs.frozen(kw_only=True)
class OpProfile:
    """One computation op measured alone on one GPU.

    Attributes:
        workload: The workload it belongs to (as the measurement names it, e.g. a preset
            name with its parallelism).
        partition: The partition type (``"fwd_attn"``, ...).
        op: The op's name within the partition (``"qkv"``, ``"rope"``, ...).
        kind: ``"gemm"``, ``"attention"`` or ``"elementwise"``.
        time_s: Measured time of one run of the op, seconds.
        power_w: Average power of one GPU over a loop of the op alone, watts (``None``: not
            measured).
        freq_mhz: SM clock it ran at (``None``: not recorded).
        roofline_s: The op's roofline time (FLOPs over the measured GEMM peak, bytes over
            the measured bandwidth), seconds (``None``: not given).
        kernel: The kernel or implementation that ran (``""``: not recorded).
        kernels: The kernel set the op belongs to, e.g. ``"fused"`` (production kernels) or
            ``"reference"`` (the eager formulas); ``""``: not recorded. The same op may be
            measured with several sets.
        power_busy_fraction: Fraction of the power window in which the op was running
            (``None``: not recorded); below 1 the window held launch gaps and ``power_w``
            understates the power while the op runs.
        host_s: Host seconds of one eager call of the op (``None``: not measured; older
            profiles have none): how long the host takes to launch it, measured as
            ``GPUProfile.host_method`` says. Below ``MAX_HOST_S``.
        power_execution: How the power loop launched the op: ``"graphed"`` (replays of a
            CUDA graph of repeated runs) or ``"eager"`` (one launch per run, for ops that
            do not capture); ``None``: not recorded (older profiles, or no power loop).
    """

    workload: str = attrs.field(validator=_name("OpProfile"))
    partition: str = attrs.field(validator=_name("OpProfile"))
    op: str = attrs.field(validator=_name("OpProfile"))
    kind: str = attrs.field()
    time_s: float = attrs.field(converter=_float_or_same, validator=_positive("OpProfile"))
    power_w: float | None = attrs.field(default=None, converter=_float_or_same,
                                        validator=_positive("OpProfile", optional=True))
    freq_mhz: int | None = attrs.field(default=None, converter=_int_or_none,
                                       validator=_clock("OpProfile"))
    roofline_s: float | None = attrs.field(default=None, converter=_float_or_same,
                                           validator=_positive("OpProfile", optional=True))
    kernel: str = attrs.field(default="", validator=_text("OpProfile"))
    kernels: str = attrs.field(default="", validator=_text("OpProfile"))
    power_busy_fraction: float | None = attrs.field(default=None, converter=_float_or_same)
    host_s: float | None = attrs.field(default=None, converter=_float_or_same)
    power_execution: str | None = attrs.field(default=None)

    @power_execution.validator
    def _check_execution(self, attribute: attrs.Attribute, value: object) -> None:
        if value is not None and value not in POWER_EXECUTIONS:
            raise GPUProfileError(f"OpProfile.power_execution must be one of "
                                  f"{POWER_EXECUTIONS} or null, got {value!r} (op {self.op!r})")

    @host_s.validator
    def _check_host(self, attribute: attrs.Attribute, value: object) -> None:
        if value is None:
            return
        if (isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value)
                or not 0 < value < MAX_HOST_S):
            raise GPUProfileError(f"OpProfile.host_s must be in (0, {MAX_HOST_S}) seconds or "
                                  f"null, got {value!r} (op {self.op!r}): a launch of a "
                                  "second or more was blocked, not launching")

    @power_busy_fraction.validator
    def _check_busy(self, attribute: attrs.Attribute, value: object) -> None:
        if value is None:
            return
        if (isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value)
                or not 0 < value <= 1):
            raise GPUProfileError(f"OpProfile.power_busy_fraction must be in (0, 1] or null, "
                                  f"got {value!r}")

    @kind.validator
    def _check_kind(self, attribute: attrs.Attribute, value: object) -> None:
        if value not in OP_KINDS:
            raise GPUProfileError(f"OpProfile.kind must be one of {', '.join(OP_KINDS)}, "
                                  f"got {value!r} (op {self.op!r})")

    @property
    def key(self) -> tuple[str, str, str, str]:
        """``(workload, partition, op, kernels)``: unique within a profile."""
        return (self.workload, self.partition, self.op, self.kernels)

    @property
    def energy_j(self) -> float | None:
        """Energy of one run of the op on one GPU (``power_w x time_s``), if power was measured."""
        return None if self.power_w is None else self.power_w * self.time_s


@attrs.frozen(kw_only=True)
class CollectivePoint:
    """One measured collective: a backend, a kind, a group, a message size and an SM cap.

    Attributes:
        backend: Whose kernels ran, e.g. ``"own"`` (kareus's SM-capped kernels, staged),
            ``"own_reg"`` (the same on registered buffers), ``"nccl_capped"`` (NCCL with
            ``min_ctas = max_ctas``), ``"nccl_uncapped"`` (NCCL's own choice).
        collective: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"`` or
            ``"all_to_all"`` (a [`CommKind`][kareus.model.CommKind] value).
        group_size: GPUs in the collective's group (>= 2).
        size_bytes: Message size in bytes (the nccl-tests convention of the benchmark).
        comm_sms: SMs (CTAs) the collective ran on; ``None`` = the backend chose.
        time_s: Time per call, seconds.
        bus_gbps: Bus bandwidth, GB/s (nccl-tests convention).
        algorithm: The algorithm variant, if the benchmark named one (``""`` otherwise).
        source: The file it was read from (``""``: not recorded).
    """

    backend: str = attrs.field(validator=_name("CollectivePoint"))
    collective: str = attrs.field()
    group_size: int = attrs.field(converter=_int_or_none,
                                  validator=_count("CollectivePoint", minimum=2))
    size_bytes: int = attrs.field(converter=_int_or_none,
                                  validator=_count("CollectivePoint", minimum=1))
    comm_sms: int | None = attrs.field(converter=_int_or_none,
                                       validator=_count("CollectivePoint", minimum=1,
                                                        optional=True))
    time_s: float = attrs.field(converter=_float_or_same, validator=_positive("CollectivePoint"))
    bus_gbps: float = attrs.field(converter=_float_or_same,
                                  validator=_positive("CollectivePoint"))
    algorithm: str = attrs.field(default="", validator=_text("CollectivePoint"))
    source: str = attrs.field(default="", validator=_text("CollectivePoint"))

    @collective.validator
    def _check_collective(self, attribute: attrs.Attribute, value: object) -> None:
        kinds = [k.value for k in CommKind]
        if value not in kinds:
            raise GPUProfileError(f"CollectivePoint.collective must be one of "
                                  f"{', '.join(kinds)}, got {value!r}")

    @property
    def key(self) -> tuple[str, str, int, int, int | None]:
        """``(backend, collective, group_size, size_bytes, comm_sms)``: unique in a profile."""
        return (self.backend, self.collective, self.group_size, self.size_bytes, self.comm_sms)


@attrs.frozen(kw_only=True)
class LoadPower:
    """Average power of one GPU under a named load, at the SM clock observed.

    Attributes:
        load: What ran (``"idle"``, ``"one spinning block"``, ``"blocked in a receive"``,
            ``"bf16 GEMM chain"``, ...).
        power_w: Average power of one GPU, watts.
        freq_mhz: Median SM clock observed during the load (``None``: not recorded).
        source: The file it was read from.
    """

    load: str = attrs.field(validator=_name("LoadPower"))
    power_w: float = attrs.field(converter=_float_or_same, validator=_positive("LoadPower"))
    freq_mhz: int | None = attrs.field(default=None, converter=_int_or_none,
                                       validator=_clock("LoadPower"))
    source: str = attrs.field(default="", validator=_text("LoadPower"))


@attrs.frozen(kw_only=True)
class MachineInfo:
    """Where a profile was measured. Empty strings mean "not recorded".

    Attributes:
        gpu_name: The GPU as the driver names it (``"NVIDIA H200"``).
        driver: NVIDIA driver version.
        torch: PyTorch version.
        cuda: CUDA runtime version.
        nccl: NCCL version.
    """

    gpu_name: str = attrs.field(validator=_name("MachineInfo"))
    driver: str = attrs.field(default="", validator=_text("MachineInfo"))
    torch: str = attrs.field(default="", validator=_text("MachineInfo"))
    cuda: str = attrs.field(default="", validator=_text("MachineInfo"))
    nccl: str = attrs.field(default="", validator=_text("MachineInfo"))


# ----------------------------------------------------------------------------- the profile


def _load_powers(value: object) -> tuple[LoadPower, ...]:
    return _tuple_of(LoadPower, "load_powers")(value)


def _ops(value: object) -> tuple[OpProfile, ...]:
    return _tuple_of(OpProfile, "ops")(value)


def _collectives(value: object) -> tuple[CollectivePoint, ...]:
    return _tuple_of(CollectivePoint, "collectives")(value)


def _sources(value: object) -> tuple[str, ...]:
    return _str_tuple("sources")(value)


def _notes(value: object) -> tuple[str, ...]:
    return _str_tuple("notes")(value)


@attrs.frozen(kw_only=True)
class GPUProfile:
    """What was measured on one GPU model, for the emulator (see the module docstring).

    Power figures are per GPU.

    Attributes:
        gpu: The GPU preset this profile refines (``"h200-sxm"``).
        sm_count: SMs of the measured GPU.
        machine: Machine, driver and software versions.
        kernel_set: The kernel set of the main per-op measurements (what
            ``op_profile`` returns by default; ``""``: not recorded).
        gemm_peak_tflops: Best bf16 GEMM throughput measured, TFLOP/s.
        gemm_peak_freq_mhz: The SM clock it was measured at (``None``: not recorded).
        hbm_bandwidth_gbps: Best HBM bandwidth measured (bytes read + written), GB/s.
        idle_power_w: Power with nothing running, at the idle clock, watts.
        idle_freq_mhz: The idle clock observed (``None``: not recorded).
        static_power_w: Power of a GPU blocked waiting on communication (the paper's
            static power), watts.
        load_powers: Power under named loads at the clocks observed (idle and static
            readings included, with their sources).
        ops: Per-op measurements.
        collectives: Collective measurements.
        sources: Files the profile was assembled from, relative to the repository.
        notes: Anything a reader must know (missing pieces, what stands in for what).
        host_method: How the ops' ``host_s`` were measured (``""``: no op has one); a
            profile with host costs must say.
    """

    gpu: str = attrs.field(validator=_name("GPUProfile"))
    sm_count: int = attrs.field(converter=_int_or_none, validator=_count("GPUProfile", minimum=2))
    machine: MachineInfo = attrs.field()
    kernel_set: str = attrs.field(validator=_text("GPUProfile"))
    gemm_peak_tflops: float = attrs.field(converter=_float_or_same,
                                          validator=_positive("GPUProfile"))
    gemm_peak_freq_mhz: int | None = attrs.field(converter=_int_or_none,
                                                 validator=_clock("GPUProfile"))
    hbm_bandwidth_gbps: float = attrs.field(converter=_float_or_same,
                                            validator=_positive("GPUProfile"))
    idle_power_w: float = attrs.field(converter=_float_or_same, validator=_positive("GPUProfile"))
    idle_freq_mhz: int | None = attrs.field(converter=_int_or_none,
                                            validator=_clock("GPUProfile"))
    static_power_w: float = attrs.field(converter=_float_or_same,
                                        validator=_positive("GPUProfile"))
    load_powers: tuple[LoadPower, ...] = attrs.field(default=(), converter=_load_powers)
    ops: tuple[OpProfile, ...] = attrs.field(default=(), converter=_ops)
    collectives: tuple[CollectivePoint, ...] = attrs.field(default=(), converter=_collectives)
    sources: tuple[str, ...] = attrs.field(default=(), converter=_sources)
    notes: tuple[str, ...] = attrs.field(default=(), converter=_notes)
    host_method: str = attrs.field(default="", validator=_text("GPUProfile"))

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.machine, MachineInfo):
            raise GPUProfileError(f"GPUProfile.machine must be a MachineInfo, got "
                                  f"{type(self.machine).__name__}")
        if self.static_power_w < self.idle_power_w:
            raise GPUProfileError(
                f"GPUProfile.static_power_w ({self.static_power_w} W) is below idle_power_w "
                f"({self.idle_power_w} W): a GPU waiting on communication draws at least its "
                "idle power; check the measurements")
        if not self.host_method.strip() and any(o.host_s is not None for o in self.ops):
            raise GPUProfileError("GPUProfile: ops have host_s but host_method does not say "
                                  "how they were measured")
        for label, items in (("ops", self.ops), ("collectives", self.collectives)):
            seen: set[object] = set()
            for item in items:
                if item.key in seen:
                    raise GPUProfileError(f"GPUProfile.{label} has two entries for {item.key}: "
                                          "keep one measurement per key")
                seen.add(item.key)

    # ------------------------------------------------------------------ queries
    @property
    def clocks_observed_mhz(self) -> tuple[int, ...]:
        """Every SM clock recorded anywhere in the profile, ascending."""
        clocks = {self.gemm_peak_freq_mhz, self.idle_freq_mhz}
        clocks.update(o.freq_mhz for o in self.ops)
        clocks.update(lp.freq_mhz for lp in self.load_powers)
        return tuple(sorted(c for c in clocks if c is not None))

    @property
    def backends(self) -> tuple[str, ...]:
        """Collective backends measured, sorted."""
        return tuple(sorted({c.backend for c in self.collectives}))

    @property
    def kernel_sets(self) -> tuple[str, ...]:
        """Kernel sets with per-op measurements, sorted."""
        return tuple(sorted({o.kernels for o in self.ops}))

    def op_profile(self, workload: str, partition: str, op: str, *,
                   kernels: str | None = None) -> OpProfile:
        """The measurement of one op with one kernel set (default: ``kernel_set``).

        Raises:
            GPUProfileError: the profile has no such op; the message lists what it has.
        """
        ks = self.kernel_set if kernels is None else kernels
        for o in self.ops:
            if o.key == (workload, partition, op, ks):
                return o
        have = sorted({(o.workload, o.partition) for o in self.ops if o.kernels == ks})
        raise GPUProfileError(f"GPU profile of {self.gpu} has no op {op!r} of partition "
                              f"{partition!r} in workload {workload!r} with kernel set "
                              f"{ks!r}; with that set it has {len(have)} (workload, partition) "
                              f"pairs: {', '.join(f'{w}/{p}' for w, p in have[:8]) or 'none'}"
                              f" (kernel sets: {', '.join(map(repr, self.kernel_sets))})")

    def ops_of(self, workload: str, partition: str, *, kernels: str | None = None
               ) -> tuple[OpProfile, ...]:
        """The measured ops of one partition with one kernel set (default:
        ``kernel_set``), in the order stored."""
        ks = self.kernel_set if kernels is None else kernels
        return tuple(o for o in self.ops
                     if (o.workload, o.partition, o.kernels) == (workload, partition, ks))

    def collective_curve(self, backend: str, collective: str | CommKind, group_size: int,
                         size_bytes: int) -> tuple[CollectivePoint, ...]:
        """The SM-capped points of one backend, collective, group and size, by SM count.

        Returns an empty tuple when nothing matches (the uncapped point, if measured, is
        ``uncapped_point``).
        """
        kind = CommKind(collective).value
        pts = [c for c in self.collectives
               if (c.backend, c.collective, c.group_size, c.size_bytes)
               == (backend, kind, group_size, size_bytes) and c.comm_sms is not None]
        return tuple(sorted(pts, key=lambda c: c.comm_sms or 0))

    def uncapped_point(self, backend: str, collective: str | CommKind, group_size: int,
                       size_bytes: int) -> CollectivePoint | None:
        """The point where ``backend`` chose its own CTA count, if measured."""
        kind = CommKind(collective).value
        for c in self.collectives:
            if ((c.backend, c.collective, c.group_size, c.size_bytes, c.comm_sms)
                    == (backend, kind, group_size, size_bytes, None)):
                return c
        return None

    # ------------------------------------------------------------------ JSON
    def profile_dict(self) -> dict[str, Any]:
        """The profile's fields as JSON-ready data (what the digest covers)."""
        # Through JSON once: tuples become lists, exactly as a loaded file has them. Fields
        # added since version 1 are left out at their defaults (older files match).
        body = attrs.asdict(self, filter=_keep_field)
        return json.loads(json.dumps(body, allow_nan=False))

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON of ``profile_dict``."""
        return profile_digest(self.profile_dict())

    def to_dict(self) -> dict[str, Any]:
        """The versioned file content: format, version, digest and profile."""
        body = self.profile_dict()
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION,
                "digest": profile_digest(body), "profile": body}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the profile as versioned JSON, atomically; returns the path."""
        return write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "GPU profile") -> GPUProfile:
        """Rebuild a profile from ``to_dict``'s output, checking format, version,
        digest and every field.

        Raises:
            GPUProfileError: anything is missing, unknown, of the wrong type or version, or
                the digest does not match the content.
        """
        if not isinstance(data, Mapping):
            raise GPUProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != PROFILE_FORMAT:
            raise GPUProfileError(f"{source}: format is {data.get('format')!r}, not "
                                  f"{PROFILE_FORMAT!r}: it is not a kareus GPU profile")
        if data.get("version") != PROFILE_VERSION:
            raise GPUProfileError(f"{source}: version {data.get('version')!r}; this kareus "
                                  f"reads version {PROFILE_VERSION}: rebuild the profile with "
                                  "this kareus")
        _exact_keys(data, {"format", "version", "digest", "profile"}, source)
        body = data["profile"]
        if not isinstance(body, Mapping):
            raise GPUProfileError(f"{source}: 'profile' must be an object")
        if data["digest"] != profile_digest(body):
            raise GPUProfileError(f"{source}: digest does not match the content (edited by "
                                  "hand or truncated): rebuild the profile from its "
                                  "measurements")
        try:
            return _profile_from_body(body, source)
        except GPUProfileError:
            raise
        except (TypeError, ValueError) as exc:
            raise GPUProfileError(f"{source}: {exc}") from None

    @classmethod
    def preset(cls, gpu: str) -> GPUProfile:
        """The measured profile shipped with kareus for ``gpu`` (see ``shipped_profiles``).

        Raises:
            GPUProfileError: kareus ships no profile for ``gpu``; the message lists those
                it ships.
        """
        path = _shipped_path(gpu)
        if path is None:
            raise GPUProfileError(f"kareus ships no measured profile for {gpu!r}; it ships "
                                  f"{', '.join(shipped_profiles()) or 'none'}: build one with "
                                  "kareus.profilers.profile_build.build_gpu_profile")
        return cls.load(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> GPUProfile:
        """Read and validate a profile file.

        Raises:
            GPUProfileError: the file is missing, unreadable, not JSON, or not a valid
                profile of this version.
        """
        data = read_json(path, error=GPUProfileError, what="GPU profile")
        return cls.from_dict(data, source=f"GPU profile {path}")


def _profiles_dir() -> Path:
    return Path(str(importlib.resources.files("kareus.model").joinpath("profiles")))


def shipped_profiles() -> tuple[str, ...]:
    """GPU presets for which kareus ships a measured profile (package data)."""
    folder = _profiles_dir()
    if not folder.is_dir():
        return ()
    return tuple(sorted(p.stem.replace("_", "-") for p in folder.glob("*.json")))


def _shipped_path(gpu: str) -> Path | None:
    path = _profiles_dir() / f"{str(gpu).lower().replace('-', '_')}.json"
    return path if path.is_file() else None


def profile_digest(body: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of a profile body (sorted keys, no spaces).

    Raises:
        GPUProfileError: ``body`` is not plain JSON data (or holds NaN or infinities).
    """
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GPUProfileError(f"GPU profile content is not plain JSON data: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _exact_keys(obj: Mapping[str, Any], keys: set[str], where: str,
                optional: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    missing = sorted(keys - set(obj) - set(optional))
    unknown = sorted(set(obj) - keys)
    if missing:
        raise GPUProfileError(f"{where}: missing {', '.join(missing)}")
    if unknown:
        raise GPUProfileError(f"{where}: unknown field(s) {', '.join(unknown)}: not written "
                              "by this kareus version")


def _fields(cls: type) -> tuple[set[str], set[str]]:
    """(all fields, fields with a default) of an attrs class."""
    fs = attrs.fields(cls)
    return ({f.name for f in fs}, {f.name for f in fs if f.default is not attrs.NOTHING})


def _record(cls: type, obj: object, where: str) -> Any:
    if not isinstance(obj, Mapping):
        raise GPUProfileError(f"{where}: expected an object, got {type(obj).__name__}")
    names, optional = _fields(cls)
    _exact_keys(obj, names, where, optional)
    return cls(**obj)


def _records(cls: type, items: object, where: str) -> list[Any]:
    if not isinstance(items, list):
        raise GPUProfileError(f"{where}: expected a list, got {type(items).__name__}")
    return [_record(cls, x, f"{where}[{i}]") for i, x in enumerate(items)]


def _profile_from_body(body: Mapping[str, Any], source: str) -> GPUProfile:
    names, optional = _fields(GPUProfile)
    _exact_keys(body, names, f"{source}: profile", optional)
    kwargs = dict(body)
    kwargs["machine"] = _record(MachineInfo, body["machine"], f"{source}: machine")
    for key, cls in (("load_powers", LoadPower), ("ops", OpProfile),
                     ("collectives", CollectivePoint)):
        if key in body:
            kwargs[key] = _records(cls, body[key], f"{source}: {key}")
    return GPUProfile(**kwargs)
