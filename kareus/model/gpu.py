"""GPU descriptions: what the emulator, the config spaces and the plans need to know.

A [`GPUSpec`][kareus.model.GPUSpec] is a frozen value object. The three presets carry the vendor
datasheets' figures (NVIDIA A100, H100 and H200: SM counts, clocks, BF16 and HBM peaks,
NVLink bandwidth, power limit), the A100 search grid and static power of the Kareus
paper's reference artifact, and, for the H200, figures measured on real machines (the
files under ``data/`` and ``bench/results/``, described in ``docs/emulator.md`` and
``docs/results.md``). Each field's unit is in its name.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import attrs

from kareus.errors import (
    InvalidSMCountError,
    UnknownPresetError,
    UnsupportedFrequencyError,
    short_repr,
)

__all__ = ["GPUSpec", "get_gpu", "gpu_names", "GPU_PRESETS"]


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
        name: Preset name, e.g. ``"h200-sxm"``.
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

    name: str
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
            raise ValueError(f"sm_count must be in 2..{_MAX['sm_count']:,}, got "
                             f"{short_repr(self.sm_count)}")
        if not self.clocks_mhz:
            raise ValueError("clocks_mhz must not be empty")
        if not 1 <= self.clocks_mhz[0] <= self.clocks_mhz[-1] <= _MAX["clock_mhz"]:
            raise ValueError(f"clocks_mhz must lie in 1..{_MAX['clock_mhz']:,} MHz")
        missing = [f for f in self.search_clocks_mhz if f not in self.clocks_mhz]
        if missing:
            raise ValueError(f"search_clocks_mhz {missing} are not in clocks_mhz")
        if not 1 <= self.default_comm_sms < self.sm_count:
            raise ValueError(f"default_comm_sms must be in 1..{self.sm_count - 1}")
        for field in ("bf16_peak_tflops", "hbm_bandwidth_gbps", "nvlink_bandwidth_gbps",
                      "power_limit_w", "static_power_w", "idle_power_w", "memory_gib"):
            value = getattr(self, field)
            if not 1e-3 <= value <= _MAX[field]:  # NaN fails too
                raise ValueError(f"{field} must be positive, in 0.001..{_MAX[field]:,g}, "
                                 f"got {short_repr(value)}")
        if not self.idle_power_w <= self.static_power_w <= self.power_limit_w:
            raise ValueError(f"powers must satisfy idle_power_w <= static_power_w <= "
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
                f"{freq_mhz} MHz is not a supported SM clock of {self.name} "
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
        from kareus.model.files import gpu_from_dict

        return gpu_from_dict(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> GPUSpec:
        """Read a ``.toml`` or ``.json`` GPU file (see [`kareus.model.files`][kareus.model.files])."""
        from kareus.model.files import load_gpu_file

        return load_gpu_file(path)


def _steps(lo: int, hi: int, step: int) -> list[int]:
    return list(range(lo, hi + 1, step))


def _desc(hi: int, step: int, count: int) -> tuple[int, ...]:
    return tuple(hi - i * step for i in range(count))


GPU_PRESETS: dict[str, GPUSpec] = {
    # A100 SXM 40GB: datasheet figures; clocks 210..1410 MHz in 15 MHz steps; the search grid
    # is the reference artifact's 1410 -> 900 MHz in 30 MHz steps (18 values); static power
    # 85 W as measured by the reference (a GPU blocked in a point-to-point receive). The idle
    # power (55 W) is an estimate, not a measurement; only the emulator uses it.
    "a100-40gb": GPUSpec(
        name="a100-40gb",
        sm_count=108,
        clocks_mhz=_steps(210, 1410, 15),
        search_clocks_mhz=_desc(1410, 30, 18),
        bf16_peak_tflops=312.0,
        hbm_bandwidth_gbps=1555.0,
        nvlink_bandwidth_gbps=600.0,
        power_limit_w=400.0,
        static_power_w=85.0,
        idle_power_w=55.0,
        default_comm_sms=32,
        memory_gib=40.0,
    ),
    # H100 SXM 80GB: datasheet figures; same GH100 clock table as the H200 (345..1980 MHz,
    # 15 MHz steps). Static and idle power taken equal to the H200's measured idle power.
    "h100-sxm": GPUSpec(
        name="h100-sxm",
        sm_count=132,
        clocks_mhz=_steps(345, 1980, 15),
        search_clocks_mhz=_desc(1980, 45, 18),
        bf16_peak_tflops=989.0,
        hbm_bandwidth_gbps=3350.0,
        nvlink_bandwidth_gbps=900.0,
        power_limit_w=700.0,
        static_power_w=78.0,
        idle_power_w=78.0,
        default_comm_sms=32,
        memory_gib=80.0,
    ),
    # H200 SXM 141GB: datasheet figures; 110 supported clocks 345..1980 MHz (measured);
    # idle power about 78 W per GPU at the 345 MHz idle clock (measured, 4x H200). Static
    # power: a GPU blocked in a receive drew 120 W at default clocks (measured, 2x H200,
    # docs/results.md), but that figure falls with the SM clock (the emulator puts it near
    # 106 W at 1500 MHz), so its clock-dependent part is dynamic power that a lower clock
    # saves. kareus charges as static the part no clock choice can save: the idle 78 W.
    "h200-sxm": GPUSpec(
        name="h200-sxm",
        sm_count=132,
        clocks_mhz=_steps(345, 1980, 15),
        search_clocks_mhz=_desc(1980, 45, 18),
        bf16_peak_tflops=989.0,
        hbm_bandwidth_gbps=4800.0,
        nvlink_bandwidth_gbps=900.0,
        power_limit_w=700.0,
        static_power_w=78.0,
        idle_power_w=78.0,
        default_comm_sms=32,
        memory_gib=141.0,
    ),
}


_REGISTERED_GPUS: dict[str, GPUSpec] = {}
"""GPUs registered at run time ([`kareus.model.files.register_gpu`][kareus.model.files.register_gpu]), by lower-case name."""


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
    key = str(name).lower()
    found = GPU_PRESETS.get(key) or _REGISTERED_GPUS.get(key)
    if found is None:
        raise UnknownPresetError("GPU", str(name), gpu_names())
    return found
