"""Schedule configurations and the space of them for one partition type on one GPU.

A :class:`ScheduleConfig` is the three knobs kareus turns for a partition: the SM
clock, the number of SMs the communication kernel gets, and the launch slot (the
computation op the communication starts with; ``None`` = sequential, after all
computation, as Megatron-LM does). A :class:`ConfigSpace` enumerates the valid
configurations, checks membership with clear errors, and encodes configurations
as *physical* numeric features for the surrogate models: MHz, SM count, where the
slot sits in the partition's work (estimated fraction of the computation done
before the launch), how compute-bound the slot's first op is (log10 of FLOPs per
byte), and a sequential flag.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Sequence

import attrs
import numpy as np

from kareus.errors import UnknownSlotError
from kareus.model.gpu import GPUSpec, get_gpu
from kareus.model.partition import Partition

__all__ = ["ConfigSpace", "ScheduleConfig", "FEATURE_NAMES"]

FEATURE_NAMES = ("freq_mhz", "comm_sms", "slot_position", "slot_log_intensity", "sequential")


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
    """

    freq_mhz: int = attrs.field(converter=int)
    comm_sms: int = attrs.field(converter=int)
    launch_slot: str | None = None

    @property
    def sequential(self) -> bool:
        """Whether the communication runs after all the computation (no overlap)."""
        return self.launch_slot is None

    def _sort_key(self) -> tuple[int, int, bool, str]:
        return (self.freq_mhz, self.comm_sms, self.launch_slot is not None,
                self.launch_slot or "")

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, ScheduleConfig):
            return NotImplemented
        return self._sort_key() < other._sort_key()

    def to_dict(self) -> dict[str, object]:
        """``{"freq_mhz", "comm_sms", "launch_slot"}``, JSON-ready."""
        return {"freq_mhz": self.freq_mhz, "comm_sms": self.comm_sms,
                "launch_slot": self.launch_slot}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ScheduleConfig:
        """Rebuild from :meth:`to_dict` output."""
        return cls(freq_mhz=int(d["freq_mhz"]),  # type: ignore[call-overload]
                   comm_sms=int(d["comm_sms"]),  # type: ignore[call-overload]
                   launch_slot=d.get("launch_slot"))  # type: ignore[arg-type]

    def __str__(self) -> str:
        slot = self.launch_slot if self.launch_slot is not None else "sequential"
        sms = "1 SM" if self.comm_sms == 1 else f"{self.comm_sms} SMs"
        return f"{self.freq_mhz} MHz, {sms}, {slot}"


def _op_time_estimate_s(flops: float, bytes_moved: float, gpu: GPUSpec) -> float:
    return max(flops / (gpu.bf16_peak_tflops * 1e12), bytes_moved / (gpu.hbm_bandwidth_gbps * 1e9))


class ConfigSpace:
    """The configurations searched for one partition type on one GPU.

    Args:
        partition: The partition type.
        gpu: GPU preset name or :class:`GPUSpec`.
        freqs_mhz: Frequencies to search; ``None`` = the GPU's ``search_clocks_mhz``.
        comm_sms: SM counts to search; ``None`` = 1..32 (capped at the GPU's SMs - 1).
        slots: Launch slot names to search; ``None`` = every slot of the partition.
        include_sequential: Whether sequential execution is part of the space (it should be:
            sometimes overlap does not pay).

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
    ) -> None:
        if not isinstance(partition, Partition):
            raise TypeError(f"partition must be a kareus Partition, got {type(partition).__name__}")
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
        if not self.freqs_mhz or not self.comm_sms or not self.slots:
            raise ValueError("a ConfigSpace needs at least one frequency, SM count and slot")
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

    def validate(self, config: ScheduleConfig) -> ScheduleConfig:
        """Check that ``config`` is valid for this partition and GPU (not that it is in the
        grid); return it. Raises the typed errors of :mod:`kareus.errors`."""
        if not isinstance(config, ScheduleConfig):
            raise TypeError(f"expected a ScheduleConfig, got {type(config).__name__}")
        self._check_freq(config.freq_mhz)
        self._check_sms(config.comm_sms)
        if config.launch_slot is not None:
            self._check_slot(config.launch_slot)
        return config

    # -- enumeration -----------------------------------------------------------------
    @property
    def configs(self) -> list[ScheduleConfig]:
        """Every configuration, frequency-major (cached)."""
        if self._configs is None:
            self._configs = [ScheduleConfig(f, s, slot) for f in self.freqs_mhz
                             for s in self.comm_sms for slot in self.slots]
        return self._configs

    def __len__(self) -> int:
        return len(self.freqs_mhz) * len(self.comm_sms) * len(self.slots)

    @property
    def size(self) -> int:
        """Number of configurations (frequencies x SM counts x slots)."""
        return len(self)

    def __iter__(self) -> Iterator[ScheduleConfig]:
        return iter(self.configs)

    def __contains__(self, config: object) -> bool:
        return (isinstance(config, ScheduleConfig) and config.freq_mhz in self.freqs_mhz
                and config.comm_sms in self.comm_sms and config.launch_slot in self.slots)

    def index(self, config: ScheduleConfig) -> int:
        """Position of ``config`` in :attr:`configs`; ``ValueError`` if not in the space."""
        if self._index is None:
            self._index = {c: i for i, c in enumerate(self.configs)}
        try:
            return self._index[config]
        except KeyError:
            self.validate(config)
            raise ValueError(f"{config} is valid but not in this space's grid") from None

    def restrict(self, *, freqs_mhz: Sequence[int] | None = None,
                 comm_sms: Sequence[int] | None = None,
                 slots: Sequence[str | None] | None = None) -> ConfigSpace:
        """A sub-space (e.g. a baseline's): ``None`` keeps this space's values."""
        slot_vals = self.slots if slots is None else tuple(slots)
        named = [s for s in slot_vals if s is not None]
        return ConfigSpace(self.partition, self.gpu,
                           freqs_mhz=self.freqs_mhz if freqs_mhz is None else freqs_mhz,
                           comm_sms=self.comm_sms if comm_sms is None else comm_sms,
                           slots=named, include_sequential=None in slot_vals)

    # -- features --------------------------------------------------------------------
    def encode(self, configs: Iterable[ScheduleConfig]) -> np.ndarray:
        """Numeric features, one row per configuration, columns :data:`FEATURE_NAMES`."""
        rows = []
        for c in configs:
            pos, lai, seq = self._slot_features[c.launch_slot]
            rows.append((float(c.freq_mhz), float(c.comm_sms), pos, lai, seq))
        return np.asarray(rows, dtype=np.float64).reshape(-1, len(FEATURE_NAMES))

    def features(self) -> np.ndarray:
        """Features of every configuration of the space, in :attr:`configs` order (cached)."""
        if not hasattr(self, "_features"):
            self._features = self.encode(self.configs)
        return self._features

    def __repr__(self) -> str:
        return (f"ConfigSpace({self.partition.name!r} on {self.gpu.name}: "
                f"{len(self.freqs_mhz)} freqs x {len(self.comm_sms)} SM counts x "
                f"{len(self.slots)} slots = {len(self)} configs)")
