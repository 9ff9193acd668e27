"""Validation of plans read from files: data to check, not to trust.

A plan file may come from anywhere (another version, a hand edit, a truncated copy, a
hostile input), so [Plan.from_dict][kareus.compose.Plan.from_dict] builds a
plan only through ``_parse_plan``, which checks, in order: the version; every key present
and none unknown, each of its JSON type; every number finite and in range (with size
limits on labels, names and the number of computations); the GPU known, every clock one
it supports and every SM count one it has; the workload a valid preset workload (or a
model architecture) whose pipeline matches the plan's stages and microbatches; the energy
the sum of its parts; the computations exactly those of the schedule; every choice used;
every partition type of the workload (split in the choice's nanobatches, where it records
them) chosen exactly once per microbatch computation, at one of its launch slots; and last
the digest against the content. Any problem raises a
[`PlanError`][kareus.errors.PlanError] in one line naming the source and the field
(``_err``).

The module builds no plan class of its own: ``kareus.compose.plan`` imports it and passes
``Plan`` and ``MicrobatchChoice`` in, so the dependency runs one way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kareus.errors import KareusError, PlanError, UnknownPresetError, short_repr
from kareus.model.config import ScheduleConfig
from kareus.model.gpu import get_gpu
from kareus.model.pipeline import Computation, get_schedule

__all__: list[str] = []

#: Keys every plan file holds (besides ``workload`` and ``digest``, also required).
_REQUIRED_KEYS = ("version", "gpu", "schedule", "num_stages", "num_microbatches", "choices",
                  "assignment", "time_s", "energy_j", "dynamic_energy_j", "static_power_w")
# Limits on what a plan file may hold (a plan kareus wrote is far inside them).
_MAX_LABEL = 200
#: The launch slots a qk-norm model's attention-input types had before its query/key norms
#: ran fused with RoPE (``kareus.model.decoder.QK_NORM_OPS``).
_UNFUSED_QK_SLOTS = frozenset({"q_norm", "k_norm", "rope", "q_norm_bwd", "k_norm_bwd",
                               "rope_bwd"})
_MAX_NAME = 100
_MAX_COMPUTATIONS = 1_000_000
_MAX_TIME_S = 1e6
_TOP_KEYS = frozenset(_REQUIRED_KEYS) | {"label", "workload", "digest"}
_WORKLOAD_INTS = ("tp", "cp", "pp", "dp", "microbatch_size", "seq_len", "num_microbatches",
                  "nanobatches")
_WORKLOAD_KEYS = frozenset(("model", "recompute", *_WORKLOAD_INTS))
#: The optional workload keys of a mixture-of-experts model's plan (``Workload.to_dict``).
_MOE_WORKLOAD_KEYS = ("ep", "routing_imbalance")


def _err(source: str, field: str, msg: str) -> PlanError:
    return PlanError(f"{source}: {field}: {msg}")


def _obj(value: Any, source: str, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _err(source, field, f"must be a JSON object, got {type(value).__name__} "
                                  f"{short_repr(value)}")
    return value


def _keys(d: Mapping[str, Any], required: Iterable[str], allowed: frozenset[str], source: str,
          field: str) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise _err(source, field, f"lacks the key(s) {', '.join(missing)}")
    extra = sorted(str(k) for k in d if k not in allowed)
    if extra:
        raise _err(source, field, f"has unknown key(s) {short_repr(', '.join(extra))}")


def _int(value: Any, source: str, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(source, field, f"{short_repr(value)} is not a whole number")
    if not lo <= value <= hi:
        raise _err(source, field, f"{short_repr(value)} is out of range ({lo}..{hi})")
    return value


def _num(value: Any, source: str, field: str, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(source, field, f"{short_repr(value)} is not a number")
    try:
        x = float(value)
    except OverflowError:  # an integer beyond float range
        x = math.inf
    if not math.isfinite(x):
        raise _err(source, field, f"{short_repr(value)} is not finite")
    if (positive and not x > 0) or x < 0:
        raise _err(source, field, f"{short_repr(value)} must be {'> 0' if positive else '>= 0'}")
    return x


def _str(value: Any, source: str, field: str, max_len: int) -> str:
    if not isinstance(value, str):
        raise _err(source, field, f"{short_repr(value)} is not a string")
    if len(value) > max_len:
        raise _err(source, field, f"is {len(value):,} characters long (at most {max_len})")
    return value


def _parse_choice(d: Any, field: str, gpu: Any, source: str,
                  choice_type: Callable[..., Any]) -> Any:
    """The checked choice, built by ``choice_type`` (``MicrobatchChoice``)."""
    d = _obj(d, source, field)
    _keys(d, ("freq_mhz", "predicted", "configs"),
          frozenset(("freq_mhz", "nanobatches", "predicted", "configs")), source, field)
    freq = _int(d["freq_mhz"], source, f"{field}.freq_mhz", 1, 100_000)
    # Absent in plan files written before choices recorded it: the workload's count.
    nanobatches = (None if "nanobatches" not in d else
                   _int(d["nanobatches"], source, f"{field}.nanobatches", 1, 100_000_000))
    if gpu is not None and not gpu.supports_clock(freq):
        raise _err(source, f"{field}.freq_mhz", f"{freq} MHz is not a supported SM clock of "
                   f"{gpu.name} ({gpu.min_clock_mhz}..{gpu.max_clock_mhz} MHz)")
    predicted = d["predicted"]
    if not isinstance(predicted, bool):
        raise _err(source, f"{field}.predicted", f"{short_repr(predicted)} is not true or false")
    configs = _obj(d["configs"], source, f"{field}.configs")
    if not configs:
        raise _err(source, f"{field}.configs", "is empty")
    max_sms = gpu.sm_count - 1 if gpu is not None else 100_000
    out: dict[str, ScheduleConfig] = {}
    for name, c in configs.items():
        where = f"{field}.configs.{short_repr(name)[1:-1]}"
        _str(name, source, where, _MAX_NAME)
        c = _obj(c, source, where)
        _keys(c, ("comm_sms", "launch_slot"), frozenset(("comm_sms", "launch_slot", "backend")),
              source, where)
        sms = _int(c["comm_sms"], source, f"{where}.comm_sms", 1, max_sms)
        slot = c["launch_slot"]
        if slot is not None:
            _str(slot, source, f"{where}.launch_slot", _MAX_NAME)
        backend = c.get("backend")
        if backend is not None:
            _str(backend, source, f"{where}.backend", _MAX_NAME)
        try:
            out[name] = ScheduleConfig(freq_mhz=freq, comm_sms=sms, launch_slot=slot,
                                       backend=backend)
        except (KareusError, ValueError, TypeError) as exc:
            raise _err(source, where, str(exc)) from None
    return choice_type(freq_mhz=freq, configs=out, predicted=predicted, nanobatches=nanobatches)


def _parse_workload(w: Any, source: str) -> Any:
    from kareus.model.workload import RANK_ORDERS, RECOMPUTE_POLICIES, Workload  # light module

    w = _obj(w, source, "workload")
    _keys(w, sorted(_WORKLOAD_KEYS),
          _WORKLOAD_KEYS | {"sp", "document_tokens", "chained_layers", "rank_order",
                            *_MOE_WORKLOAD_KEYS},
          source,
          "workload")
    if isinstance(w["model"], dict):  # the architecture of a model that is not a preset
        from kareus.model.workload import ModelArch

        try:
            model: Any = ModelArch.from_dict(w["model"])
        except (KareusError, ValueError) as exc:
            raise _err(source, "workload.model", str(exc)) from None
    else:
        model = _str(w["model"], source, "workload.model", _MAX_NAME)
    ints = {k: _int(w[k], source, f"workload.{k}", 1, 100_000_000) for k in _WORKLOAD_INTS}
    if not isinstance(w["recompute"], bool) and w["recompute"] not in RECOMPUTE_POLICIES:
        raise _err(source, "workload.recompute", f"{short_repr(w['recompute'])} is not one of "
                   f"{', '.join(RECOMPUTE_POLICIES)}")
    sp = w.get("sp", False)
    if not isinstance(sp, bool):
        raise _err(source, "workload.sp", f"{short_repr(sp)} is not true or false")
    # a mixture of experts' (absent in a dense model's plan: the defaults)
    ep = _int(w.get("ep", 1), source, "workload.ep", 1, 100_000_000)
    moe = ({} if "routing_imbalance" not in w else {"routing_imbalance": _num(
        w["routing_imbalance"], source, "workload.routing_imbalance", positive=True)})
    docs = (None if w.get("document_tokens") is None else
            _int(w["document_tokens"], source, "workload.document_tokens", 1, 100_000_000))
    # absent: chained layers (every plan written before the setting was made for them)
    chained = w.get("chained_layers", True)
    if not isinstance(chained, bool):
        raise _err(source, "workload.chained_layers",
                   f"{short_repr(chained)} is not true or false")
    # absent: Megatron-LM's default order
    order = w.get("rank_order", RANK_ORDERS[0])
    if order not in RANK_ORDERS:
        raise _err(source, "workload.rank_order",
                   f"{short_repr(order)} is not one of {', '.join(RANK_ORDERS)}")
    try:
        return Workload.preset(model, tp=ints["tp"], cp=ints["cp"], pp=ints["pp"],
                               dp=ints["dp"], sp=sp, ep=ep, rank_order=order,
                               microbatch_size=ints["microbatch_size"],
                               seq_len=ints["seq_len"],
                               num_microbatches=ints["num_microbatches"],
                               recompute=w["recompute"], nanobatches=ints["nanobatches"],
                               document_tokens=docs, chained_layers=chained, **moe)
    except (KareusError, ValueError, TypeError) as exc:
        raise _err(source, "workload", str(exc)) from None


@functools.lru_cache(maxsize=8)
def _expected_types(workload: Any) -> tuple[dict[str, frozenset[str]], dict[str, Any]]:
    """Per phase, the partition types one microbatch computation runs; per type, its slots
    (``None`` when the type runs sequentially only)."""
    from kareus.model.partition import build_partitions

    pset = build_partitions(workload)
    per_phase = {phase: frozenset(c) for phase, c in pset.counts.items()}
    slots = {name: (frozenset(s.name for s in p.slots) if p.overlappable else None)
             for name, p in pset.types.items()}
    return per_phase, slots


def _parse_plan(cls: Callable[..., Any], d: Any, source: str, *, version: int,  # noqa: C901 - validates the plan file key by key, one check per key
                choice_type: Callable[..., Any]) -> Any:
    """The checked plan, built by ``cls`` (``Plan``) of choices built by ``choice_type``;
    ``version``: the plan format this kareus reads."""
    if not isinstance(source, str):
        source = str(source)
    if not isinstance(d, Mapping):
        raise PlanError(f"{source}: a plan must be a JSON object, got {type(d).__name__}")
    if "version" not in d:
        raise PlanError(f"{source}: not a kareus plan: the key 'version' is missing")
    if type(d["version"]) is not int or d["version"] != version:
        raise _err(source, "version", f"plan format version {short_repr(d['version'])} is not "
                   f"supported; this kareus reads version {version} (make the plan again)")
    _keys(d, (*_REQUIRED_KEYS, "workload", "digest"), _TOP_KEYS, source, "plan")
    digest = _str(d["digest"], source, "digest", 64)
    if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
        raise _err(source, "digest", f"{short_repr(digest)} is not a SHA-256 hex digest")
    gpu_name = _str(d["gpu"], source, "gpu", _MAX_NAME)
    try:
        gpu = get_gpu(gpu_name)
    except KareusError as exc:
        hint = ("; a plan made for your own GPU needs its GPU file: call "
                "kareus.register_gpu(FILE) before loading the plan"
                if isinstance(exc, UnknownPresetError) else "")
        raise _err(source, "gpu", f"{exc}{hint}") from None
    schedule = _str(d["schedule"], source, "schedule", _MAX_NAME)
    stages = _int(d["num_stages"], source, "num_stages", 1, 4096)
    micro = _int(d["num_microbatches"], source, "num_microbatches", 1, _MAX_COMPUTATIONS)
    if 2 * stages * micro > _MAX_COMPUTATIONS:
        raise _err(source, "num_microbatches", f"{stages} stages x {micro} microbatches is over "
                   f"the limit of {_MAX_COMPUTATIONS:,} computations")
    label = _str(d.get("label", ""), source, "label", _MAX_LABEL)
    workload = _parse_workload(d["workload"], source)
    par = workload.parallelism
    if par.pp != stages:
        raise _err(source, "num_stages", f"{stages} stages, but the workload has PP={par.pp}")
    if workload.num_microbatches != micro:
        raise _err(source, "num_microbatches", f"{micro}, but the workload has "
                   f"{workload.num_microbatches} microbatches")
    time_s = _num(d["time_s"], source, "time_s", positive=True)
    energy_j = _num(d["energy_j"], source, "energy_j", positive=True)
    dynamic_j = _num(d["dynamic_energy_j"], source, "dynamic_energy_j", positive=False)
    static_w = _num(d["static_power_w"], source, "static_power_w", positive=True)
    if time_s > _MAX_TIME_S:
        raise _err(source, "time_s", f"{time_s} s is over {_MAX_TIME_S:.0e} s: not an iteration")
    if static_w > par.world_size * gpu.power_limit_w:
        raise _err(source, "static_power_w", f"{static_w} W is above the power limit of the "
                   f"job's {par.world_size} {gpu.name} GPUs together "
                   f"({par.world_size * gpu.power_limit_w:.0f} W)")
    expected_j = dynamic_j + static_w * time_s
    if not math.isfinite(expected_j) or abs(energy_j - expected_j) > 1e-6 * energy_j:
        raise _err(source, "energy_j", f"{energy_j} is not dynamic_energy_j + static_power_w x "
                   f"time_s = {expected_j}")
    try:
        sched = get_schedule(schedule, stages, micro)
    except KareusError as exc:
        raise _err(source, "schedule", str(exc)) from None
    keys = {c.key() for c in sched.nodes}
    raw_choices = d["choices"]
    if not isinstance(raw_choices, list) or not raw_choices:
        raise _err(source, "choices", f"must be a non-empty list, got {short_repr(raw_choices)}")
    if len(raw_choices) > len(keys):
        raise _err(source, "choices", f"{len(raw_choices)} choices for {len(keys)} computations")
    choices = [_parse_choice(c, f"choices[{i}]", gpu, source, choice_type) for i, c in enumerate(raw_choices)]
    raw_assign = _obj(d["assignment"], source, "assignment")
    assignment: dict[str, int] = {}
    for k, v in raw_assign.items():
        if k not in keys:
            raise _err(source, f"assignment.{short_repr(k)[1:-1]}", f"is not a computation of a "
                       f"{schedule} schedule of {stages} stages x {micro} microbatches")
        assignment[k] = _int(v, source, f"assignment.{k}", 0, len(choices) - 1)
    if len(assignment) != len(keys):
        lack = sorted(keys - set(assignment), key=Computation.from_key)[:3]
        raise _err(source, "assignment", f"lacks computation(s) {', '.join(lack)} "
                   f"({len(keys) - len(assignment)} in all)")
    unused = sorted(set(range(len(choices))) - set(assignment.values()))
    if unused:
        raise _err(source, f"choices[{unused[0]}]", "is used by no computation")
    # Each choice names the partition types of the workload split in its nanobatches.
    expected = []
    for i, ch in enumerate(choices):
        split = workload
        if ch.nanobatches is not None and ch.nanobatches != workload.nanobatches:
            try:
                split = workload.with_(nanobatches=ch.nanobatches)
            except (KareusError, ValueError) as exc:
                raise _err(source, f"choices[{i}].nanobatches", str(exc)) from None
        expected.append(_expected_types(split))
    for k in sorted(assignment, key=Computation.from_key):
        i = assignment[k]
        phase = k.rsplit(".", 1)[1]
        have = set(choices[i].types)
        want = expected[i][0].get(phase, frozenset())
        if have != want:
            lack, extra = sorted(want - have), sorted(have - want)
            split_words = ("" if choices[i].nanobatches is None else
                           f" split in {choices[i].nanobatches} nanobatch(es)")
            raise _err(source, f"choices[{i}].configs", f"computation {k} needs exactly the "
                       f"partition types {sorted(want)} of the workload{split_words}"
                       + (f"; missing {lack}" if lack else "")
                       + (f"; unknown here {extra}" if extra else ""))
    for i, ch in enumerate(choices):
        slots = expected[i][1]
        for name, cfg in ch.configs:
            allowed = slots[name]
            if cfg.launch_slot is None:
                continue
            if allowed is None or cfg.launch_slot not in allowed:
                fused = {"qk_norm_rope", "qk_norm_rope_bwd"} & set(allowed or ())
                why = ("; the plan was made before the query/key norms ran fused with RoPE "
                       "(qk_norm_rope): make it again" if fused and cfg.launch_slot in
                       _UNFUSED_QK_SLOTS else "")
                raise _err(source, f"choices[{i}].configs.{name}.launch_slot",
                           f"{cfg.launch_slot!r} is not a launch slot of {name} (slots: "
                           f"{sorted(allowed or ())} or null for sequential){why}")
    try:
        plan = cls(gpu=gpu.name, schedule=schedule, num_stages=stages, num_microbatches=micro,
                   choices=choices, assignment=assignment, time_s=time_s, energy_j=energy_j,
                   dynamic_energy_j=dynamic_j, static_power_w=static_w, label=label,
                   workload=dict(d["workload"]))
    except (KareusError, ValueError, TypeError) as exc:
        raise _err(source, "plan", str(exc)) from None
    if digest != plan.digest:
        raise _err(source, "digest", "does not match the content: the file was changed or "
                   "corrupted after it was written (make the plan again)")
    return plan
