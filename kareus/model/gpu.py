"""GPU descriptions: what the emulator, the config spaces and the plans need to know.

A [`GPUSpec`][kareus.model.GPUSpec] is a frozen value object. The three presets carry the vendor
datasheets' figures (NVIDIA A100, H100 and H200: SM counts, clocks, BF16 and HBM peaks,
NVLink bandwidth, power limit), the A100 search grid and static power of the Kareus
paper's reference artifact, and, for the H200, figures measured on real machines (the
files under ``data/`` and ``bench/results/``, described in ``docs/emulator.md`` and
``docs/results.md``). Each field's unit is in its name.

The presets are GPU files shipped in ``kareus/model/gpus/``, each saying where its figures come
from, read at import by [`load_gpu_file`][kareus.model.files.load_gpu_file] as any user's GPU
file is. This module owns the GPU registry: [`get_gpu`][kareus.model.get_gpu] looks up the
presets and the GPUs made known with [`register_gpu`][kareus.model.files.register_gpu].
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kareus.errors import (
    ArgumentError,
    ArgumentTypeError,
    InvalidSMCountError,
    KareusError,
    UnknownPresetError,
    UnsupportedFrequencyError,
    short_repr,
)
from kareus.model._spec_file import (
    SpecFileError,
    _check_keys,
    _float,
    _int,
    _name,
    _read_table,
    _register,
)

__all__ = ["GPU_PRESETS", "GPUSpec", "get_gpu", "gpu_from_dict", "gpu_names", "load_gpu_file",
           "register_gpu", "registered_gpus", "unregister_gpu"]


def _lower(name: object) -> object:
    """GPU names are case-insensitive and kept in lower case (what files and results
    record)."""
    return name.lower() if isinstance(name, str) else name


def _clock_tuple(values: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    return tuple(sorted({int(v) for v in values}))


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


#: Upper bounds of a GPU's figures: far above any GPU made, low enough that the
#: emulator's arithmetic stays finite. A value beyond one is a typo, not a GPU.
_MAX = {"sm_count": 65_536, "clock_mhz": 100_000, "bf16_peak_tflops": 1e6,
        "hbm_bandwidth_gbps": 1e7, "nvlink_bandwidth_gbps": 1e7, "power_limit_w": 1e6,
        "static_power_w": 1e6, "idle_power_w": 1e6, "memory_gib": 1e7}


@attrs.frozen(kw_only=True)
class GPUSpec:
    """One GPU model.

    Attributes:
        name: Preset name, e.g. ``"h200-sxm"`` (case-insensitive: kept in lower case).
        sm_count: Streaming multiprocessors on the chip.
        clocks_mhz: Supported SM (graphics) clocks, ascending.
        search_clocks_mhz: The default frequency grid searched by kareus,
            descending from the maximum clock (a subset of ``clocks_mhz``).
        bf16_peak_tflops: Dense bf16 tensor-core peak at the maximum clock on all SMs.
        hbm_bandwidth_gbps: Peak HBM bandwidth in GB/s (10^9 bytes per second).
        nvlink_bandwidth_gbps: NVLink bandwidth per GPU, both directions together, GB/s.
        power_limit_w: Board power limit; above it the GPU lowers its own clock.
        static_power_w: Power drawn while the GPU waits (blocked on communication),
            charged for every second of an iteration, per GPU.
        idle_power_w: Power at the idle clock with nothing running, per GPU.
        default_comm_sms: SMs (CTAs) that NCCL gives a collective when nobody caps it;
            used by the Megatron-LM and nanobatching baselines.
        memory_gib: Device memory.
    """

    name: str = attrs.field(converter=_lower)
    sm_count: int
    clocks_mhz: tuple[int, ...] = attrs.field(converter=_clock_tuple)
    search_clocks_mhz: tuple[int, ...] = attrs.field(converter=_int_tuple)
    bf16_peak_tflops: float
    hbm_bandwidth_gbps: float
    nvlink_bandwidth_gbps: float
    power_limit_w: float
    static_power_w: float
    idle_power_w: float
    default_comm_sms: int
    memory_gib: float

    def __attrs_post_init__(self) -> None:
        if not 2 <= self.sm_count <= _MAX["sm_count"]:
            raise ArgumentError(f"sm_count must be in 2..{_MAX['sm_count']:,}, got "
                                f"{short_repr(self.sm_count)}")
        if not self.clocks_mhz:
            raise ArgumentError("clocks_mhz must not be empty")
        if not 1 <= self.clocks_mhz[0] <= self.clocks_mhz[-1] <= _MAX["clock_mhz"]:
            raise ArgumentError(f"clocks_mhz must lie in 1..{_MAX['clock_mhz']:,} MHz")
        missing = [f for f in self.search_clocks_mhz if f not in self.clocks_mhz]
        if missing:
            raise ArgumentError(f"search_clocks_mhz {missing} are not in clocks_mhz")
        if not 1 <= self.default_comm_sms < self.sm_count:
            raise ArgumentError(f"default_comm_sms must be in 1..{self.sm_count - 1}")
        for field in ("bf16_peak_tflops", "hbm_bandwidth_gbps", "nvlink_bandwidth_gbps",
                      "power_limit_w", "static_power_w", "idle_power_w", "memory_gib"):
            value = getattr(self, field)
            if not 1e-3 <= value <= _MAX[field]:  # NaN fails too
                raise ArgumentError(f"{field} must be positive, in 0.001..{_MAX[field]:,g}, "
                                    f"got {short_repr(value)}")
        if not self.idle_power_w <= self.static_power_w <= self.power_limit_w:
            raise ArgumentError(f"powers must satisfy idle_power_w <= static_power_w <= "
                                f"power_limit_w, got {self.idle_power_w:g} W, "
                                f"{self.static_power_w:g} W, {self.power_limit_w:g} W")

    @property
    def max_clock_mhz(self) -> int:
        """The highest supported SM clock (the default clock under no power cap)."""
        return self.clocks_mhz[-1]

    @property
    def min_clock_mhz(self) -> int:
        """The lowest supported SM clock."""
        return self.clocks_mhz[0]

    def supports_clock(self, freq_mhz: int) -> bool:
        """Whether ``freq_mhz`` is one of the GPU's supported SM clocks."""
        return int(freq_mhz) in self.clocks_mhz

    def nearest_clock(self, freq_mhz: float) -> int:
        """The supported clock closest to ``freq_mhz`` (ties go to the lower one)."""
        return min(self.clocks_mhz, key=lambda c: (abs(c - freq_mhz), c))

    def check_clock(self, freq_mhz: int) -> int:
        """Return ``freq_mhz`` if supported; else raise [`UnsupportedFrequencyError`][kareus.errors.UnsupportedFrequencyError]
        naming the range and the nearest supported clock."""
        if not self.supports_clock(freq_mhz):
            raise UnsupportedFrequencyError(
                f"freq_mhz={freq_mhz}: {freq_mhz} MHz is not a supported SM clock of {self.name} "
                f"({self.min_clock_mhz}..{self.max_clock_mhz} MHz; nearest supported: "
                f"{self.nearest_clock(freq_mhz)} MHz)")
        return int(freq_mhz)

    def check_comm_sms(self, sms: int) -> int:
        """Return ``sms`` if a collective can run on that many SMs beside some computation
        (1..SMs-1); else raise [`InvalidSMCountError`][kareus.errors.InvalidSMCountError]."""
        if not 1 <= sms <= self.sm_count - 1:
            raise InvalidSMCountError(
                f"comm_sms={sms} is impossible on {self.name}: it must be in "
                f"1..{self.sm_count - 1} (the GPU has {self.sm_count} SMs and the "
                "computation needs at least one)")
        return int(sms)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of every field."""
        return attrs.asdict(self)

    @property
    def is_preset(self) -> bool:
        """Whether this is exactly one of the built-in presets."""
        return GPU_PRESETS.get(self.name) == self

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> GPUSpec:
        """Build and check from a dict of every field (raises ``SpecFileError``)."""
        return gpu_from_dict(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> GPUSpec:
        """Read a ``.toml`` or ``.json`` GPU file (see [`kareus.model.files`][kareus.model.files])."""
        return load_gpu_file(path)


# ----------------------------------------------------------------------------- files

_GPU_INT_FIELDS = ("sm_count", "default_comm_sms")
_GPU_FLOAT_FIELDS = ("bf16_peak_tflops", "hbm_bandwidth_gbps", "nvlink_bandwidth_gbps",
                     "power_limit_w", "static_power_w", "idle_power_w", "memory_gib")
_GPU_FIELDS = ("name", "sm_count", "clocks_mhz", "search_clocks_mhz", *_GPU_FLOAT_FIELDS,
               "default_comm_sms")


def _clocks(value: Any, field: str, where: str, *, descending: bool) -> list[int]:
    if isinstance(value, Mapping):
        allowed = ("min", "max", "step", "count")
        bad = [k for k in value if k not in allowed]
        if bad:
            raise SpecFileError(f"{where}: {field} has unknown key(s) {', '.join(map(repr, bad))};"
                                f" a clock range takes {', '.join(allowed)}")
        if "max" not in value or "step" not in value:
            raise SpecFileError(f"{where}: a {field} range needs max and step (and min or count)")
        hi = _int(value["max"], f"{field}.max", where)
        step = _int(value["step"], f"{field}.step", where)
        if step < 1:
            raise SpecFileError(f"{where}: {field}.step must be >= 1, got {step}")
        if "count" in value:
            n = _int(value["count"], f"{field}.count", where)
            if n < 1:
                raise SpecFileError(f"{where}: {field}.count must be >= 1, got {n}")
            lo = hi - (n - 1) * step
        elif "min" in value:
            lo = _int(value["min"], f"{field}.min", where)
        else:
            raise SpecFileError(f"{where}: a {field} range needs min or count")
        if lo > hi or lo < 1:
            raise SpecFileError(f"{where}: {field} range {lo}..{hi} MHz is impossible "
                                "(need 1 <= min <= max)")
        clocks = list(range(lo, hi + 1, step))
        if hi not in clocks:
            raise SpecFileError(f"{where}: {field} range: max {hi} is not min {lo} plus a "
                                f"multiple of step {step}")
    elif isinstance(value, list):
        clocks = [_int(v, field, where) for v in value]
    else:
        raise SpecFileError(f"{where}: {field} must be a list of MHz or a range "
                            f"{{min, max, step}}, got {value!r:.60}")
    if not clocks:
        raise SpecFileError(f"{where}: {field} is empty")
    if any(c < 1 for c in clocks):
        raise SpecFileError(f"{where}: {field} holds a clock below 1 MHz")
    return sorted(set(clocks), reverse=descending)


def gpu_from_dict(d: Mapping[str, Any], *, where: str = "GPU") -> GPUSpec:
    """A [`GPUSpec`][kareus.model.GPUSpec] from a dict of its fields, checked.

    ``clocks_mhz`` and ``search_clocks_mhz`` are lists of MHz or ranges
    (``{min, max, step}`` or ``{max, step, count}``); the search clocks are used from the
    highest down.

    Raises:
        SpecFileError: a missing field, an unknown key, a wrong type or an impossible value.
    """
    if not isinstance(d, Mapping):
        raise SpecFileError(f"{where}: expected a table of GPU fields, got {type(d).__name__}")
    _check_keys(d, _GPU_FIELDS, where)
    kwargs: dict[str, Any] = {"name": _name(d["name"], where).lower()}
    for f in _GPU_INT_FIELDS:
        kwargs[f] = _int(d[f], f, where)
    for f in _GPU_FLOAT_FIELDS:
        kwargs[f] = _float(d[f], f, where)
    kwargs["clocks_mhz"] = _clocks(d["clocks_mhz"], "clocks_mhz", where, descending=False)
    kwargs["search_clocks_mhz"] = _clocks(d["search_clocks_mhz"], "search_clocks_mhz", where,
                                          descending=True)
    try:
        return GPUSpec(**kwargs)
    except (KareusError, ValueError, TypeError) as exc:
        raise SpecFileError(f"{where}: {exc}") from None


def load_gpu_file(path: str | os.PathLike[str]) -> GPUSpec:
    """Read a GPU description from a ``.toml`` or ``.json`` file (see the module doc).

    Raises:
        SpecFileError: the file is missing, unreadable, not UTF-8, not TOML/JSON, or its
            content is not a valid GPU.
    """
    return gpu_from_dict(_read_table(path, "GPU"), where=f"GPU file {Path(path)}")


# ----------------------------------------------------------------------------- presets


def _preset_dir() -> Path:
    return Path(str(importlib.resources.files("kareus.model").joinpath("gpus")))


def _load_presets() -> dict[str, GPUSpec]:
    """The GPU files shipped in ``kareus/model/gpus/``, read by
    [`load_gpu_file`][kareus.model.files.load_gpu_file] as any user's GPU file is; each file
    says where its figures come from."""
    specs = [load_gpu_file(path) for path in sorted(_preset_dir().glob("*.toml"))]
    return {spec.name: spec for spec in specs}


GPU_PRESETS: dict[str, GPUSpec] = _load_presets()
"""The built-in GPUs by name: NVIDIA A100 40GB, H100 SXM and H200 SXM (see the module doc)."""


# ----------------------------------------------------------------------------- registry

_REGISTERED_GPUS: dict[str, GPUSpec] = {}
"""GPUs registered at run time ([`register_gpu`][kareus.model.files.register_gpu]), by lower-case
name; written only through ``register_gpu`` and ``unregister_gpu``."""


def gpu_names() -> list[str]:
    """Names of the GPU presets and of the GPUs registered at run time."""
    return sorted({*GPU_PRESETS, *_REGISTERED_GPUS})


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """Look up a GPU preset by name (a [`GPUSpec`][kareus.model.GPUSpec] passes through).

    Reads the presets and the GPUs registered in this process
    ([kareus.model.files.register_gpu][]); writes nothing.

    Args:
        name: A preset's or a registered GPU's name (any case), or a spec.

    Returns:
        The GPU's spec: SM count, clocks, peaks, power and memory.

    Raises:
        UnknownPresetError: ``name`` is not a preset; the message lists the known ones.

    Examples:
        >>> import kareus
        >>> gpu = kareus.get_gpu("h200-sxm")
        >>> gpu.sm_count, gpu.power_limit_w
        (132, 700.0)
        >>> kareus.get_gpu("H200-SXM") is gpu
        True
    """
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str):
        raise ArgumentTypeError(f"gpu must be a preset name or a GPUSpec, not "
                                f"{type(name).__name__}")
    key = name.lower()
    found = GPU_PRESETS.get(key) or _REGISTERED_GPUS.get(key)
    if found is None:
        raise UnknownPresetError("GPU", str(name), gpu_names())
    return found


def register_gpu(gpu: GPUSpec | str | os.PathLike[str], *, replace: bool = False) -> GPUSpec:
    """Make a GPU known by name to [`get_gpu`][kareus.model.get_gpu] (so profilers,
    plans and the CLI accept its name).

    Args:
        gpu: A [`GPUSpec`][kareus.model.GPUSpec], or the path of a GPU file.
        replace: Allow replacing a registered GPU of the same name with a different one.

    The registry lives in this process only: nothing is written (a process of its own,
    such as a worker of a process pool, registers the GPU again).

    Returns:
        The registered spec.

    Raises:
        SpecFileError: a bad file; the name is a preset's; or another GPU is registered
            under that name (and ``replace`` is false).

    Examples:
        An H200 capped at 600 W, under a name of its own:

        >>> import attrs
        >>> import kareus
        >>> capped = attrs.evolve(kareus.get_gpu("h200-sxm"), name="h200-600w",
        ...                       power_limit_w=600.0)
        >>> kareus.register_gpu(capped) is capped
        True
        >>> kareus.get_gpu("h200-600w").power_limit_w
        600.0
    """
    spec = gpu if isinstance(gpu, GPUSpec) else load_gpu_file(gpu)
    return _register(_REGISTERED_GPUS, GPU_PRESETS, spec.name.lower(), spec, name=spec.name,
                     kind="GPU", figures="figures", replace=replace)


def registered_gpus() -> dict[str, GPUSpec]:
    """GPUs registered at run time (not the presets), by name."""
    return dict(_REGISTERED_GPUS)


def unregister_gpu(name: str) -> None:
    """Forget the registered GPU of that name, in any case (presets stay)."""
    _REGISTERED_GPUS.pop(name.lower(), None)
