"""Schedule configurations and the space of them for one partition type on one GPU.

A [`ScheduleConfig`][kareus.model.ScheduleConfig] is the three knobs kareus turns for a partition:
the SM clock, the number of SMs the communication kernel gets, and the launch slot (the
computation op the communication starts with; ``None`` = sequential, after all
computation, as Megatron-LM does). Where the profiler can run the collective through
several backends (kareus's own SM-capped kernels, NCCL with capped CTAs), the backend is
a fourth knob, so that each partition type's choice is measured rather than assumed; a
profiler with one way to communicate (the emulator, a replay) leaves it ``None`` and its
spaces, features and plans are exactly the three-knob ones. A
[`ConfigSpace`][kareus.model.ConfigSpace] enumerates the valid configurations, checks membership
with clear errors, and encodes configurations as *physical* numeric features for the surrogate
models: MHz, SM count, where the slot sits in the partition's work (estimated fraction of the
computation done before the launch), how compute-bound the slot's first op is (log10 of FLOPs per
byte), a sequential flag, and (only in a space of several backends) the backend's
position in the space's list.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs
import numpy as np

from kareus.errors import ArgumentTypeError, ConfigError, UnknownSlotError
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.partition import Partition

__all__ = ["ConfigSpace", "ScheduleConfig", "FEATURE_NAMES"]

FEATURE_NAMES = ("freq_mhz", "comm_sms", "slot_position", "slot_log_intensity", "sequential")


#: Above any GPU's clock (MHz) or SM count: a configuration beyond it is a typo.
_MAX_KNOB = 1_000_000


def _whole_named(name: str) -> Callable[[object], int]:
    def whole(value: object) -> int:
        """A whole number (an int, or a float with no fraction) in 0..``_MAX_KNOB``, else
        a ConfigError naming the field. Whether the GPU has that clock or SM count is the
        space's to say ([`ConfigSpace.validate`][kareus.model.ConfigSpace.validate])."""
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value) and value.is_integer():
            n = int(value)
        else:
            raise ConfigError(f"ScheduleConfig {name} must be a whole number, got "
                              f"{value!r:.40}")
        if not 0 <= n <= _MAX_KNOB:
            raise ConfigError(f"ScheduleConfig {name} must be in 0..{_MAX_KNOB:,}, got "
                              f"{value!r:.40}")
        return n
    return whole


_freq_mhz = _whole_named("freq_mhz")
_comm_sms = _whole_named("comm_sms")


def _whole_freq(value: object) -> int:
    return _freq_mhz(value)


def _whole_sms(value: object) -> int:
    return _comm_sms(value)


@functools.total_ordering
@attrs.frozen(order=False)
class ScheduleConfig:
    """One configuration of a partition.

    Configurations order by clock, then SM count, then launch slot, with sequential
    execution (no slot) before any slot, so a mix of both sorts.

    Attributes:
        freq_mhz: SM clock in MHz.
        comm_sms: SMs (thread blocks) the communication kernel runs on.
        launch_slot: Name of the computation op the communication is launched with, or
            ``None`` for sequential execution (communication after all computation).
        backend: The collective backend that runs the communication (a name of
            ``kareus.exec.collectives.BACKEND_NAMES``, e.g. ``"own"`` or
            ``"nccl_capped"``), or ``None``: the one backend of the job (every emulated
            and replayed configuration).
    """

    freq_mhz: int = attrs.field(converter=_whole_freq)
    comm_sms: int = attrs.field(converter=_whole_sms)
    launch_slot: str | None = None
    backend: str | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.launch_slot is not None and not isinstance(self.launch_slot, str):
            raise ConfigError(f"launch_slot must be an op name or None (sequential), got "
                              f"{self.launch_slot!r:.40}")
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ConfigError(f"backend must be a non-empty name or None, got {self.backend!r}")

    @property
    def sequential(self) -> bool:
        """Whether the communication runs after all the computation (no overlap)."""
        return self.launch_slot is None

    def _sort_key(self) -> tuple[int, int, bool, str, str]:
        return (self.freq_mhz, self.comm_sms, self.launch_slot is not None,
                self.launch_slot or "", self.backend or "")

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, ScheduleConfig):
            return NotImplemented
        return self._sort_key() < other._sort_key()

    def to_dict(self) -> dict[str, object]:
        """``{"freq_mhz", "comm_sms", "launch_slot"}`` and ``"backend"`` when it is set,
        JSON-ready."""
        d: dict[str, object] = {"freq_mhz": self.freq_mhz, "comm_sms": self.comm_sms,
                                "launch_slot": self.launch_slot}
        if self.backend is not None:
            d["backend"] = self.backend
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ScheduleConfig:
        """Rebuild from [`to_dict`][kareus.model.ScheduleConfig.to_dict] output."""
        return cls(freq_mhz=d["freq_mhz"],  # type: ignore[arg-type]
                   comm_sms=d["comm_sms"],  # type: ignore[arg-type]
                   launch_slot=d.get("launch_slot"),  # type: ignore[arg-type]
                   backend=d.get("backend"))  # type: ignore[arg-type]

    def __str__(self) -> str:
        slot = self.launch_slot if self.launch_slot is not None else "sequential"
        sms = "1 SM" if self.comm_sms == 1 else f"{self.comm_sms} SMs"
        on = "" if self.backend is None else f", {self.backend}"
        return f"{self.freq_mhz} MHz, {sms}, {slot}{on}"


def _op_time_estimate_s(flops: float, bytes_moved: float, gpu: GPUSpec) -> float:
    return max(flops / (gpu.bf16_peak_tflops * 1e12), bytes_moved / (gpu.hbm_bandwidth_gbps * 1e9))


class ConfigSpace:
    """The configurations searched for one partition type on one GPU.

    Args:
        partition: The partition type.
        gpu: GPU preset name or [`GPUSpec`][kareus.model.GPUSpec].
        freqs_mhz: Frequencies to search; ``None`` = the GPU's ``search_clocks_mhz``.
        comm_sms: SM counts to search; ``None`` = 1..32 (capped at the GPU's SMs - 1).
        slots: Launch slot names to search; ``None`` = every slot of the partition.
        include_sequential: Whether sequential execution is part of the space (it should be:
            sometimes overlap does not pay).
        backends: Collective backends to search (names, see
            [`ScheduleConfig`][kareus.model.ScheduleConfig]); ``None`` = the job's one backend
            (configurations carry ``backend=None``). With two or more, the features gain a
            ``backend`` column.

    Raises:
        UnsupportedFrequencyError, InvalidSMCountError, UnknownSlotError: for values the
            GPU or the partition cannot take.
    """

    def __init__(
        self,
        partition: Partition,
        gpu: str | GPUSpec,
        *,
        freqs_mhz: Sequence[int] | None = None,
        comm_sms: Sequence[int] | None = None,
        slots: Sequence[str] | None = None,
        include_sequential: bool = True,
        backends: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(partition, Partition):
            raise ArgumentTypeError(f"partition must be a kareus Partition, got {type(partition).__name__}")
        self.partition = partition
        self.gpu = get_gpu(gpu)
        self.freqs_mhz: tuple[int, ...] = tuple(
            int(f) for f in (self.gpu.search_clocks_mhz if freqs_mhz is None else freqs_mhz))
        self.comm_sms: tuple[int, ...] = tuple(
            int(s) for s in (range(1, min(32, self.gpu.sm_count - 1) + 1)
                             if comm_sms is None else comm_sms))
        all_slots = tuple(s.name for s in partition.slots)
        chosen = all_slots if slots is None else tuple(slots)
        self.slots: tuple[str | None, ...] = chosen + ((None,) if include_sequential else ())
        self.backends: tuple[str | None, ...] = (
            (None,) if backends is None else tuple(str(b) for b in backends))
        if not self.freqs_mhz or not self.comm_sms or not self.slots or not self.backends:
            raise ConfigError("a ConfigSpace needs at least one frequency, SM count, slot and "
                             "backend")
        if len(set(self.backends)) != len(self.backends) or any(
                b is not None and not b for b in self.backends):
            raise ConfigError(f"backends must be distinct non-empty names, got {backends!r}")
        for f in self.freqs_mhz:
            self._check_freq(f)
        for s in self.comm_sms:
            self._check_sms(s)
        for name in chosen:
            self._check_slot(name)
        # Physical slot features.
        ops = partition.compute_ops
        times = [_op_time_estimate_s(op.flops, op.bytes_moved, self.gpu) for op in ops]
        total = sum(times) or 1.0
        self._slot_features: dict[str | None, tuple[float, float, float]] = {None: (1.0, 0.0, 1.0)}
        for slot in partition.slots:
            pos = sum(times[: slot.index]) / total
            ai = slot.arithmetic_intensity
            lai = math.log10(ai) if 0 < ai < math.inf else 0.0
            self._slot_features[slot.name] = (pos, lai, 0.0)
        self._configs: list[ScheduleConfig] | None = None
        self._index: dict[ScheduleConfig, int] | None = None

    # -- validation ------------------------------------------------------------------
    def _check_freq(self, f: int) -> None:
        self.gpu.check_clock(f)

    def _check_sms(self, s: int) -> None:
        self.gpu.check_comm_sms(s)

    def _check_slot(self, name: str) -> None:
        names = [s.name for s in self.partition.slots]
        if name not in names:
            hint = (", ".join(names) if names else
                    "none: this partition is sequential only (nanobatches=1)")
            raise UnknownSlotError(
                f"partition {self.partition.name!r} has no launch slot {name!r}; its slots: {hint} "
                "(or launch_slot=None for sequential)")

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Names of the columns of [`encode`][kareus.model.ConfigSpace.encode]: ``FEATURE_NAMES``, plus
        ``"backend"`` in a space of several backends."""
        return FEATURE_NAMES + (("backend",) if len(self.backends) > 1 else ())

    def validate(self, config: ScheduleConfig) -> ScheduleConfig:
        """Check that ``config`` is valid for this partition and GPU (not that it is in the
        grid); return it. Raises the typed errors of [`kareus.errors`][kareus.errors]."""
        if not isinstance(config, ScheduleConfig):
            raise ArgumentTypeError(f"expected a ScheduleConfig, got {type(config).__name__}")
        if config.backend not in self.backends:
            raise ConfigError(f"backend {config.backend!r} is not one of this space's "
                             f"{list(self.backends)}")
        self._check_freq(config.freq_mhz)
        self._check_sms(config.comm_sms)
        if config.launch_slot is not None:
            self._check_slot(config.launch_slot)
        return config

    # -- enumeration -----------------------------------------------------------------
    @property
    def configs(self) -> list[ScheduleConfig]:
        """Every configuration, frequency-major, backend-minor (cached)."""
        if self._configs is None:
            self._configs = [ScheduleConfig(f, s, slot, backend=b) for f in self.freqs_mhz
                             for s in self.comm_sms for slot in self.slots
                             for b in self.backends]
        return self._configs

    def __len__(self) -> int:
        return len(self.freqs_mhz) * len(self.comm_sms) * len(self.slots) * len(self.backends)

    @property
    def size(self) -> int:
        """Number of configurations (frequencies x SM counts x slots x backends)."""
        return len(self)

    def __iter__(self) -> Iterator[ScheduleConfig]:
        return iter(self.configs)

    def __contains__(self, config: object) -> bool:
        return (isinstance(config, ScheduleConfig) and config.freq_mhz in self.freqs_mhz
                and config.comm_sms in self.comm_sms and config.launch_slot in self.slots
                and config.backend in self.backends)

    def index(self, config: ScheduleConfig) -> int:
        """Position of ``config`` in [`configs`][kareus.model.ConfigSpace.configs]; ``ValueError`` if not in the space."""
        if self._index is None:
            self._index = {c: i for i, c in enumerate(self.configs)}
        try:
            return self._index[config]
        except KeyError:
            self.validate(config)
            raise ConfigError(f"{config} is valid but not in this space's grid") from None

    def restrict(self, *, freqs_mhz: Sequence[int] | None = None,
                 comm_sms: Sequence[int] | None = None,
                 slots: Sequence[str | None] | None = None,
                 backends: Sequence[str] | None = None) -> ConfigSpace:
        """A sub-space (e.g. a baseline's): ``None`` keeps this space's values."""
        slot_vals = self.slots if slots is None else tuple(slots)
        named = [s for s in slot_vals if s is not None]
        kept = self.backends if backends is None else tuple(backends)
        return ConfigSpace(self.partition, self.gpu,
                           freqs_mhz=self.freqs_mhz if freqs_mhz is None else freqs_mhz,
                           comm_sms=self.comm_sms if comm_sms is None else comm_sms,
                           slots=named, include_sequential=None in slot_vals,
                           backends=None if kept == (None,) else kept)  # type: ignore[arg-type]

    # -- features --------------------------------------------------------------------
    def encode(self, configs: Iterable[ScheduleConfig]) -> np.ndarray:
        """Numeric features, one row per configuration, columns [`feature_names`][kareus.model.ConfigSpace.feature_names]
        (the backend column, in a space of several, is the backend's position in
        ``backends``)."""
        several = len(self.backends) > 1
        rows = []
        for c in configs:
            pos, lai, seq = self._slot_features[c.launch_slot]
            row: tuple[float, ...] = (float(c.freq_mhz), float(c.comm_sms), pos, lai, seq)
            if several:
                row += (float(self.backends.index(c.backend)),)
            rows.append(row)
        return np.asarray(rows, dtype=np.float64).reshape(-1, len(self.feature_names))

    def features(self) -> np.ndarray:
        """Features of every configuration of the space, in [`configs`][kareus.model.ConfigSpace.configs] order (cached)."""
        if not hasattr(self, "_features"):
            self._features = self.encode(self.configs)
        return self._features

    def __repr__(self) -> str:
        return (f"ConfigSpace({self.partition.name!r} on {self.gpu.name}: "
                f"{len(self.freqs_mhz)} freqs x {len(self.comm_sms)} SM counts x "
                f"{len(self.slots)} slots"
                + ("" if len(self.backends) == 1 else f" x {len(self.backends)} backends")
                + f" = {len(self)} configs)")
