"""What a composer needs besides the frontiers: one frozen context object per level.

A composer of either level is called as ``compose(frontiers, context)``
([`FrontierComposer`][kareus.compose.FrontierComposer]): the lower level's frontiers, and one
value that holds everything else the level needs.

* [`MicrobatchContext`][kareus.compose.MicrobatchContext]: the partition set (its types, their
  counts per microbatch and the work outside partitions), the measured outside work per
  ``(stage, phase)`` and frequency, and the energy scale.
* [`IterationContext`][kareus.compose.IterationContext]: the static power of the job, the GPU, the
  pipeline schedule, the per-iteration tail (optimizer step and data-parallel gradient reduction),
  the label and the workload recorded in plans.

Why objects and not keyword arguments: a composer that wraps or delegates to another passes the
context on whole (``super().compose(frontiers, context)``), so it cannot drop a field it does not
know about; a composer that reads a field names it (``context.tail``), and a field that does not
exist is an ``AttributeError``, a context without a required field a ``TypeError`` where it is
built. Before, keyword contexts were forwarded with ``**context`` and filtered by signature
inspection, and an iteration composer whose ``compose`` took ``**context`` silently lost the
per-iteration tail: its plans came out 5.5% too fast on the README's job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from kareus.errors import ArgumentError, ArgumentTypeError
from kareus.model.measurement import Measurement
from kareus.model.partition import PartitionSet
from kareus.model.pipeline import PipelineSchedule

__all__ = ["IterationContext", "MicrobatchContext", "OutsideTable"]

#: ``outside[(stage, phase)][freq_mhz]`` = measurement of the work outside partitions.
OutsideTable = Mapping[tuple[int, str], Mapping[int, Measurement]]


def _instance(kind: type, what: str) -> Any:
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, kind):
            raise ArgumentTypeError(f"{type(instance).__name__}.{attribute.name} must be {what}, "
                                    f"got {type(value).__name__}")
    return check


@attrs.frozen(kw_only=True)
class MicrobatchContext:
    """What a microbatch composer needs besides the partition frontiers.

    Attributes:
        partitions: The partition set composed: its types, their instance counts per
            microbatch (``counts[phase][type]``), its workload (whose nanobatch count every
            choice records) and the work outside partitions per ``(stage, phase)``.
        outside: Measurements of that outside work per ``(stage, phase)`` and frequency
            (``outside[(stage, phase)][freq_mhz]``, over one stage's TP x CP group);
            ``None`` = no outside work is counted.
        energy_scale: Multiplier from a partition measurement's scope (one TP x CP group) to
            the microbatch's (every GPU of the stage in the job); ``None`` = the workload's
            DP degree.

    Raises:
        TypeError: ``partitions`` is not a PartitionSet.
        ValueError: ``energy_scale`` is not a positive finite number.
    """

    partitions: PartitionSet = attrs.field(validator=_instance(PartitionSet, "a PartitionSet"))
    outside: OutsideTable | None = None
    energy_scale: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.energy_scale is not None and not (
                isinstance(self.energy_scale, (int, float)) and math.isfinite(self.energy_scale)
                and self.energy_scale > 0):
            raise ArgumentError(f"energy_scale must be a positive number, got "
                                f"{self.energy_scale!r}")

    @property
    def scale(self) -> float:
        """The energy scale in effect: ``energy_scale``, or the workload's DP degree."""
        return (float(self.partitions.workload.parallelism.dp) if self.energy_scale is None
                else float(self.energy_scale))


@attrs.frozen(kw_only=True)
class IterationContext:
    """What an iteration composer needs besides the microbatch frontiers.

    Attributes:
        static_power_w: Static power of every GPU of the job together.
        gpu: GPU preset name (recorded in plans).
        schedule: The pipeline DAG (``kareus.model.pipeline``: 1F1B, GPipe, ...).
        tail: Work once per iteration after the pipeline flush (the optimizer step and the
            data-parallel gradient reduction), measured over every GPU of the job: its time is
            added to every plan's iteration time and its dynamic energy to every plan's
            energy (static power then covers it too). ``None``: none.
        label: Recorded in the frontier and its plans (e.g. ``"kareus"``).
        workload: Workload description recorded in plans (``Workload.to_dict()``).

    Raises:
        TypeError: ``schedule`` is not a PipelineSchedule or ``tail`` not a Measurement.
        ValueError: a negative or non-finite static power.
    """

    static_power_w: float
    gpu: str
    schedule: PipelineSchedule = attrs.field(
        validator=_instance(PipelineSchedule, "a PipelineSchedule"))
    tail: Measurement | None = attrs.field(
        default=None, validator=attrs.validators.optional(_instance(Measurement, "a Measurement")))
    label: str = ""
    workload: dict[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        w = self.static_power_w
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ArgumentError(f"static_power_w must be a finite number, got {w!r}")
        if w < 0:
            raise ArgumentError(f"static_power_w must be >= 0, got {w}")


def _from_keywords(kind: type, context: Any, fields: dict[str, Any], who: str) -> Any:
    """The context a default composer was given: ``context`` itself, or (deprecated) one
    built from the keyword arguments of earlier releases."""
    if context is not None:
        if fields:
            raise ArgumentTypeError(f"{who}.compose takes a {kind.__name__} or keyword arguments, "
                                    f"not both (got {', '.join(sorted(fields))} besides the "
                                    "context)")
        if not isinstance(context, kind):
            raise ArgumentTypeError(f"{who}.compose: the context must be a {kind.__name__}, got "
                                    f"{type(context).__name__}")
        return context
    import warnings

    warnings.warn(f"{who}.compose(frontiers, **keywords) is deprecated: pass "
                  f"{who}.compose(frontiers, {kind.__name__}(...))", DeprecationWarning,
                  stacklevel=3)
    return kind(**fields)
