"""Plans: what a user runs, as versioned JSON with a digest.

A [`Plan`][kareus.compose.Plan] fixes, for one training iteration of a pipeline schedule, the GPU
frequency of every microbatch computation ``(stage, microbatch, fwd|bwd)`` and the
configuration (communication SMs, launch slot) of every partition type inside it.

A microbatch computation runs at one frequency, and every instance of a partition
type inside it shares one configuration. Different computations may run at different
frequencies, so the plan stores the distinct *microbatch choices* once
([`MicrobatchChoice`][kareus.compose.MicrobatchChoice]: a frequency, the number of nanobatches the
microbatch is split into, and one configuration per partition type of that split) and maps each
computation to one of them. A computation may run its microbatch unsplit (one nanobatch: the
partition types of ``workload.with_(nanobatches=1)``, sequential) while others split it
in the workload's nanobatches; a choice without a recorded count (a plan file written
before choices recorded one) runs the workload's count.

Files are JSON, never executable code. Every file carries ``version`` and a SHA-256
``digest`` of its canonical content; ranks compare digests before use, so that every
rank issues the same collectives with the same SM caps. A plan read from a file is data
to check, not to trust: loading requires the digest and checks every key, type and number
(finite, in range), the GPU's clocks and SM counts, the workload (a preset workload whose
pipeline matches the plan), the schedule's computations, and that every partition type of
the workload is chosen exactly once per microbatch computation at one of its launch
slots. Any problem raises [`PlanError`][kareus.errors.PlanError] in one line naming the file
and the field.

Energy scope: ``energy_j`` covers every GPU of the job for one iteration (dynamic energy
of every computation plus static power x iteration time x number of GPUs); ``time_s`` is
the iteration time seen by each rank.

Checking a plan read from a file is the concern of ``_plan_validation`` (every key, type,
range and cross-check, with the messages); [`Plan.from_dict`][kareus.compose.Plan.from_dict] and
[`MicrobatchChoice.from_dict`][kareus.compose.MicrobatchChoice.from_dict] call it. This module holds
the two value types and their JSON form.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kareus._io import read_json, write_text_atomic
from kareus.compose._plan_validation import _parse_choice, _parse_plan
from kareus.errors import ArgumentTypeError, PlanError
from kareus.model.config import ScheduleConfig
from kareus.model.pipeline import Computation

__all__ = ["PLAN_MAX_BYTES", "PLAN_VERSION", "MicrobatchChoice", "Plan"]

#: The plan file format this version of kareus reads and writes.
PLAN_VERSION = 1

#: Plan files larger than this are refused before parsing (a plan of 64 stages x 4,096
#: microbatches is about 10 MB).
PLAN_MAX_BYTES = 16 * 1024 * 1024


def _configs_converter(value: Mapping[str, ScheduleConfig] | Iterable[tuple[str, ScheduleConfig]]
                       ) -> tuple[tuple[str, ScheduleConfig], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), v) for k, v in items))


def _choices_tuple(value: Iterable[MicrobatchChoice]) -> tuple[MicrobatchChoice, ...]:
    return tuple(value)


def _assignment_dict(value: Mapping[str, int]) -> dict[str, int]:
    return dict(value)


@attrs.frozen(kw_only=True)
class MicrobatchChoice:
    """One way to run a microbatch computation: a frequency, a nanobatch count and a
    configuration per partition type.

    Attributes:
        freq_mhz: The SM clock of the whole computation.
        configs: ``(partition type, ScheduleConfig)`` pairs, sorted by type name; every
            config runs at ``freq_mhz``. Build from a dict; read with
            [`config`][kareus.compose.MicrobatchChoice.config]. The types are those of the workload
            split in ``nanobatches`` (the same type name may mean another partition under another
            count: ``fwd_mlp`` unsplit is the MLP with its own collective after it, nanobatched it
                overlaps the collective
            of the nanobatch before).
        predicted: Whether any part of it rests on a surrogate prediction, not a measurement.
        nanobatches: Parts the microbatch is split into (1: unsplit); ``None`` = the
            workload's count (what a plan file written before choices recorded it means).
    """

    freq_mhz: int = attrs.field(converter=int)
    configs: tuple[tuple[str, ScheduleConfig], ...] = attrs.field(converter=_configs_converter)
    predicted: bool = False
    nanobatches: int | None = None

    def __attrs_post_init__(self) -> None:
        n = self.nanobatches
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise PlanError(f"nanobatches must be a whole number >= 1 or None, got {n!r:.40}")
        for name, cfg in self.configs:
            if not isinstance(cfg, ScheduleConfig):
                raise ArgumentTypeError(f"config of {name!r} must be a ScheduleConfig, "
                                        f"got {type(cfg).__name__}")
            if cfg.freq_mhz != self.freq_mhz:
                raise PlanError(f"config of {name!r} runs at {cfg.freq_mhz} MHz but the "
                                f"microbatch runs at {self.freq_mhz} MHz")

    @classmethod
    def _trusted(cls, freq_mhz: int, configs: tuple[tuple[str, ScheduleConfig], ...],
                 predicted: bool, nanobatches: int | None = None) -> MicrobatchChoice:
        """Build without conversion or checks (``configs`` already sorted by type name, every
        config at ``freq_mhz``): the composer makes thousands of these."""
        obj = object.__new__(cls)
        object.__setattr__(obj, "freq_mhz", freq_mhz)
        object.__setattr__(obj, "configs", configs)
        object.__setattr__(obj, "predicted", predicted)
        object.__setattr__(obj, "nanobatches", nanobatches)
        return obj

    @property
    def types(self) -> list[str]:
        """The partition types this choice configures, in order."""
        return [name for name, _ in self.configs]

    def config(self, partition_type: str) -> ScheduleConfig:
        """The configuration of ``partition_type``; ``KeyError`` if it has none here."""
        for name, cfg in self.configs:
            if name == partition_type:
                return cfg
        raise KeyError(partition_type)

    def as_dict(self) -> dict[str, ScheduleConfig]:
        """Partition type -> its configuration."""
        return dict(self.configs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"freq_mhz", "nanobatches", "predicted", "configs"}``
        ([`from_dict`][kareus.compose.MicrobatchChoice.from_dict] reads it); ``nanobatches`` only
        when it is recorded, so a plan file written before choices recorded it keeps its digest."""
        return {"freq_mhz": self.freq_mhz,
                **({} if self.nanobatches is None else {"nanobatches": self.nanobatches}),
                "predicted": self.predicted,
                "configs": {name: {"comm_sms": c.comm_sms, "launch_slot": c.launch_slot,
                                   **({} if c.backend is None else {"backend": c.backend})}
                            for name, c in self.configs}}

    @classmethod
    def from_dict(cls, d: Any, *, field: str = "choice", gpu: Any = None) -> MicrobatchChoice:
        """Build and validate a choice from its dict form.

        Args:
            d: The dict (``{"freq_mhz", "predicted", "configs"}`` and, optionally,
                ``"nanobatches"``).
            field: Where it sits in the plan, for messages (``"choices[2]"``).
            gpu: A [`GPUSpec`][kareus.model.GPUSpec] to check the clock and SM counts
                against; ``None`` checks types and signs only.

        Raises:
            PlanError: naming the field, for a missing or unknown key, a wrong type, or a
                value out of range.
        """
        return _parse_choice(d, field, gpu, "plan", cls)

    def __str__(self) -> str:
        parts = ", ".join(f"{n}: {c.comm_sms} SMs @ {c.launch_slot or 'sequential'}"
                          + (f" on {c.backend}" if c.backend is not None else "")
                          for n, c in self.configs)
        split = "" if self.nanobatches is None else f", {_nanobatch_words(self.nanobatches)}"
        return (f"{self.freq_mhz} MHz{split} [{parts}]"
                f"{' (predicted)' if self.predicted else ''}")


@attrs.frozen(kw_only=True)
class Plan:
    """A frequency for each microbatch computation and a configuration for each partition type.

    Attributes:
        gpu: GPU preset name the plan was made for.
        schedule: Pipeline schedule name (``"1f1b"``).
        num_stages: Pipeline stages.
        num_microbatches: Microbatches per iteration.
        choices: The distinct microbatch choices.
        assignment: Computation key (``"s0.m3.fwd"``) -> index into ``choices``.
        time_s: Iteration time (per rank) the plan was composed to take.
        energy_j: Iteration energy over every GPU of the job, static included.
        dynamic_energy_j: The dynamic part of ``energy_j``.
        static_power_w: Static power of every GPU of the job together.
        label: Free text, e.g. the baseline's name (``"kareus"``, ``"perseus"``).
        workload: The workload's description (``Workload.to_dict()``), if known.
    """

    gpu: str
    schedule: str = "1f1b"
    num_stages: int
    num_microbatches: int
    choices: tuple[MicrobatchChoice, ...] = attrs.field(converter=_choices_tuple)
    assignment: dict[str, int] = attrs.field(converter=_assignment_dict)
    time_s: float = attrs.field(converter=float)
    energy_j: float = attrs.field(converter=float)
    dynamic_energy_j: float = attrs.field(converter=float)
    static_power_w: float = attrs.field(converter=float)
    label: str = ""
    workload: dict[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        for key, idx in self.assignment.items():
            if not 0 <= idx < len(self.choices):
                raise PlanError(f"computation {key} refers to choice {idx}, but the plan has "
                                f"{len(self.choices)} choices")

    # -- access ----------------------------------------------------------------------
    def choice(self, computation: Computation | str) -> MicrobatchChoice:
        """The microbatch choice of a computation (a [`Computation`][kareus.model.Computation] or its key)."""
        key = computation.key() if isinstance(computation, Computation) else computation
        try:
            return self.choices[self.assignment[key]]
        except KeyError:
            raise PlanError(f"the plan has no computation {key}") from None

    def freq_mhz(self, computation: Computation | str) -> int:
        """The SM clock of a computation."""
        return self.choice(computation).freq_mhz

    def config(self, computation: Computation | str, partition_type: str) -> ScheduleConfig:
        """The configuration of ``partition_type`` inside ``computation``."""
        return self.choice(computation).config(partition_type)

    def nanobatches(self, computation: Computation | str) -> int:
        """The nanobatches a computation splits its microbatch into (1: unsplit).

        A choice that records no count (a plan file written before choices recorded it)
        runs the workload's count.

        Raises:
            PlanError: the plan has no such computation, or neither the choice nor the
                plan's workload gives a count.
        """
        choice = self.choice(computation)
        n = self._count_of(choice)
        if n is None:
            key = computation.key() if isinstance(computation, Computation) else computation
            raise PlanError(f"the plan records no nanobatch count for computation {key} and "
                            "no workload to take it from: make the plan again with kareus.optimize")
        return n

    def _count_of(self, choice: MicrobatchChoice) -> int | None:
        """A choice's nanobatch count: its own, else the workload's, else ``None``."""
        if choice.nanobatches is not None:
            return choice.nanobatches
        n = (self.workload or {}).get("nanobatches")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None

    @property
    def nanobatch_counts(self) -> tuple[int, ...]:
        """The distinct nanobatch counts the computations run, largest first (a count
        the plan does not give is left out)."""
        counts = {self._count_of(self.choices[i]) for i in set(self.assignment.values())}
        return tuple(sorted((n for n in counts if n is not None), reverse=True))

    def partition_configs(self, *, nanobatches: int | None = None
                          ) -> dict[str, tuple[ScheduleConfig, ...]]:
        """Every partition type's distinct configurations (one per frequency it runs at).

        Args:
            nanobatches: Only the computations that split their microbatch in this many
                nanobatches (their partition types are those of that split); ``None`` =
                every computation (a type name that two splits share then gathers the
                configurations of both).
        """
        used = sorted(set(self.assignment.values()))
        out: dict[str, set[ScheduleConfig]] = {}
        for i in used:
            if nanobatches is not None and self._count_of(self.choices[i]) != nanobatches:
                continue
            for name, cfg in self.choices[i].configs:
                out.setdefault(name, set()).add(cfg)
        return {name: tuple(sorted(cfgs, reverse=True)) for name, cfgs in sorted(out.items())}

    @property
    def frequencies_mhz(self) -> dict[str, int]:
        """Computation key -> SM clock."""
        return {k: self.choices[i].freq_mhz for k, i in self.assignment.items()}

    @property
    def predicted(self) -> bool:
        """Whether any used choice rests on a surrogate prediction."""
        return any(self.choices[i].predicted for i in set(self.assignment.values()))

    @property
    def static_energy_j(self) -> float:
        """Static energy of the iteration in joules: static power x time, every GPU of the job."""
        return self.static_power_w * self.time_s

    # -- serialisation ---------------------------------------------------------------
    def _content(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "gpu": self.gpu,
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "label": self.label,
            "workload": self.workload,
            "time_s": self.time_s,
            "energy_j": self.energy_j,
            "dynamic_energy_j": self.dynamic_energy_j,
            "static_power_w": self.static_power_w,
            "choices": [c.to_dict() for c in self.choices],
            "assignment": dict(sorted(self.assignment.items(),
                                      key=lambda kv: Computation.from_key(kv[0]))),
        }

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON content (ranks compare it before use)."""
        return _digest(self._content())

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON form, with its digest ([`from_dict`][kareus.compose.Plan.from_dict] reads it)."""
        d = self._content()
        d["digest"] = _digest(d)
        return d

    def to_json(self, *, indent: int | None = 1) -> str:
        """[`to_dict`][kareus.compose.Plan.to_dict] as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON to ``path``, atomically (a reader sees the old file or the
        new one, never a torn one)."""
        write_text_atomic(path, self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> Plan:
        """Build and validate a plan from its dict form.

        Everything is checked as data before it is trusted: the version; the digest (required);
        every key present, none unknown, each of its JSON type; every number finite and in
        range; the GPU known, every clock one it supports and every SM count one it has; the
        workload a valid preset workload whose pipeline matches the plan's stages and
        microbatches; the computations exactly those of the schedule; every choice used; and
        every partition type of the workload chosen exactly once per microbatch computation,
        at one of its launch slots.

        Args:
            d: The dict (``to_dict()`` output, or parsed JSON).
            source: What the dict came from (a file name), for messages.

        Raises:
            PlanError: one line naming ``source`` and the field, for any problem.
        """
        return _parse_plan(cls, d, source, version=PLAN_VERSION, choice_type=MicrobatchChoice)

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan") -> Plan:
        """Parse and validate a plan from JSON text (raises [`PlanError`][kareus.errors.PlanError])."""
        if not isinstance(text, str):
            raise PlanError(f"{source}: plan text must be a str, got {type(text).__name__}")
        if len(text) > PLAN_MAX_BYTES:
            raise PlanError(f"{source}: {len(text):,} characters, over the plan size limit of "
                            f"{PLAN_MAX_BYTES:,}: not a plan kareus wrote")
        try:
            d = json.loads(text, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as exc:
            raise PlanError(f"{source}: plan is not valid JSON ({exc})") from None
        return cls.from_dict(d, source=source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate a plan file.

        Raises:
            PlanError: naming the file (and the field), if it is missing, a folder, unreadable,
                over the size limit, not UTF-8, not JSON, or not a valid plan.
        """
        try:
            d = read_json(path, error=PlanError, what="plan", max_bytes=PLAN_MAX_BYTES)
        except RecursionError:
            raise PlanError(f"plan {os.fspath(path)}: nested too deeply to be a plan") from None
        return cls.from_dict(d, source=os.fspath(path))

    # -- display ---------------------------------------------------------------------
    def summary(self) -> str:
        """A readable text summary (what ``kareus show PLAN`` prints)."""
        lines = [
            f"kareus plan v{PLAN_VERSION}"  # the label, unless it says "kareus" again
            + (f" ({self.label})" if self.label and self.label != "kareus" else ""),
            f"  digest      {self.digest[:16]}",
            f"  gpu         {self.gpu}",
            f"  schedule    {self.schedule}, {self.num_stages} stages x "
            f"{self.num_microbatches} microbatches",
        ]
        if self.workload:
            w = dict(self.workload)
            model = w.get("model")
            if isinstance(model, dict):  # your own architecture: its name, then its shape
                w["model"] = str(model.get("name", "?"))
            lines.append("  workload    " + ", ".join(f"{k}={v}" for k, v in w.items()))
            if isinstance(model, dict):
                lines.append("  model       " + ", ".join(f"{k}={v}" for k, v in model.items()
                                                          if k != "name"))
        lines += [
            f"  iteration   {self.time_s:.4f} s, {self.energy_j:.1f} J over all GPUs "
            f"(dynamic {self.dynamic_energy_j:.1f} J, static {self.static_energy_j:.1f} J)",
        ]
        if self.predicted:
            lines.append("  note        some choices rest on surrogate predictions")
        lines.append("  frequencies per stage (MHz: computations)")
        for s in range(self.num_stages):
            for phase in ("fwd", "bwd"):
                cnt = Counter(self.choices[i].freq_mhz for k, i in self.assignment.items()
                              if k.startswith(f"s{s}.") and k.endswith(phase))
                txt = ", ".join(f"{f}: {n}" for f, n in sorted(cnt.items(), reverse=True))
                lines.append(f"    stage {s} {phase}  {txt}")
        counts = self.nanobatch_counts
        if counts:
            lines.append("  nanobatches per stage (nanobatches: computations; 1 = unsplit)")
            for s in range(self.num_stages):
                for phase in ("fwd", "bwd"):
                    splits = Counter(self._count_of(self.choices[i])
                                     for k, i in self.assignment.items()
                                     if k.startswith(f"s{s}.") and k.endswith(phase))
                    txt = ", ".join(f"{'?' if n is None else n}: {c}" for n, c in
                                    sorted(splits.items(), key=lambda nc: -(nc[0] or 0)))
                    lines.append(f"    stage {s} {phase}  {txt}")
        groups: tuple[int | None, ...] = counts if len(counts) > 1 else (None,)
        for n in groups:
            split = "" if n is None else f", {_nanobatch_words(n)}"
            lines.append(f"  partition configurations{split} (MHz, comm SMs, launch slot)")
            for name, cfgs in self.partition_configs(nanobatches=n).items():
                lines.append(f"    {name}: " + "; ".join(str(c) for c in cfgs))
        return "\n".join(lines)

    def __repr__(self) -> str:
        freqs = sorted({self.choices[i].freq_mhz for i in set(self.assignment.values())})
        rng = f"{freqs[0]}-{freqs[-1]} MHz" if len(freqs) > 1 else f"{freqs[0]} MHz"
        return (f"Plan({self.label + ': ' if self.label else ''}{self.gpu}, {self.schedule} "
                f"{self.num_stages}x{self.num_microbatches}, {self.time_s:.4f} s, "
                f"{self.energy_j:.1f} J, {rng}, digest {self.digest[:12]})")


def _nanobatch_words(n: int) -> str:
    """``"unsplit"`` for one nanobatch, else ``"n nanobatches"``."""
    return "unsplit" if n == 1 else f"{n} nanobatches"


def _digest(content: Mapping[str, Any]) -> str:
    blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a plan holds")
