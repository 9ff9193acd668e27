"""Workloads: a model architecture, its parallelism and its batch.

The presets carry the models' public architecture configs (the ``config.json`` published
with the weights of meta-llama/Llama-3.2-3B, Qwen/Qwen3-1.7B and
meta-llama/Llama-3.3-70B-Instruct on Hugging Face). A [`Workload`][kareus.model.Workload] checks
that its parallelism divides the model (heads, KV heads, FFN width, vocabulary, layers) and that its
batch splits into nanobatches.

Nanobatching splits each microbatch along the batch dimension into
``nanobatches`` equal parts, so ``microbatch_size`` must be divisible by it;
``nanobatches=1`` means no split (communication cannot then overlap any
independent computation, and only sequential schedules exist).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kareus.errors import (
    ArgumentTypeError,
    KareusError,
    UnknownPresetError,
    WorkloadError,
    short_repr,
)
from kareus.model._spec_file import SpecFileError, _check_keys, _int, _name, _read_table, _register

__all__ = [
    "MODEL_PRESETS",
    "ModelArch",
    "Parallelism",
    "Workload",
    "get_model",
    "load_model_file",
    "model_from_dict",
    "model_names",
    "register_model",
    "registered_models",
    "unregister_model",
]


#: The largest size or count a workload may hold: a 32-bit index (the kernels index
#: tensors with it), and low enough that FLOP and byte counts stay finite floats.
MAX_COUNT = 2**31 - 1


def _check_whole(field: str, value: object) -> None:
    """A typed error, not a TypeError from a comparison, for a count of the wrong type."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{field} must be a whole number (int), got {value!r:.40} "
                            f"({type(value).__name__})")


def _check_count(field: str, value: object) -> None:
    """A whole number in 1..``MAX_COUNT``, else a typed one-line error."""
    _check_whole(field, value)
    assert isinstance(value, int)
    if not 1 <= value <= MAX_COUNT:
        raise WorkloadError(f"{field} must be in 1..{MAX_COUNT:,}, got {short_repr(value)}")


def _lower(name: object) -> object:
    """Names are case-insensitive and kept in lower case (what files and results record)."""
    return name.lower() if isinstance(name, str) else name


@attrs.frozen(kw_only=True)
class ModelArch:
    """A decoder-only transformer with grouped-query attention and a SwiGLU MLP.

    Its ``name`` is case-insensitive: it is kept in lower case.
    """

    name: str = attrs.field(converter=_lower)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    def __attrs_post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            _check_count(f"{self.name}: {field}", getattr(self, field))
        if self.heads % self.kv_heads:
            raise WorkloadError(f"{self.name}: heads ({self.heads}) must be a multiple of "
                                f"kv_heads ({self.kv_heads})")

    @property
    def params(self) -> int:
        """Parameter count (untied embedding and LM head counted once each)."""
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        attn += self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.ffn
        norms = 2 * self.hidden
        return self.layers * (attn + mlp + norms) + 2 * self.vocab * self.hidden + self.hidden

    @property
    def is_preset(self) -> bool:
        """Whether this is exactly one of the built-in presets."""
        return MODEL_PRESETS.get(self.name) == self

    def to_dict(self) -> dict[str, object]:
        """Every field, JSON-ready (what [`from_dict`][kareus.model.ModelArch.from_dict] and model files take)."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ModelArch:
        """Build and check from a dict of every field (raises ``SpecFileError``)."""
        return model_from_dict(d)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ModelArch:
        """Read a ``.toml`` or ``.json`` model file (see [`kareus.model.files`][kareus.model.files])."""
        return load_model_file(path)


_MODEL_FIELDS = ("name", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")


def model_from_dict(d: Mapping[str, Any], *, where: str = "model") -> ModelArch:
    """A [`ModelArch`][kareus.model.ModelArch] from a dict of its fields, checked.

    Args:
        d: ``name``, ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``ffn``,
            ``vocab``; nothing else.
        where: What ``d`` is, for messages (a file name).

    Raises:
        SpecFileError: a missing field, an unknown key, a wrong type or an impossible value.
    """
    if not isinstance(d, Mapping):
        raise SpecFileError(f"{where}: expected a table of model fields, got "
                            f"{type(d).__name__}")
    _check_keys(d, _MODEL_FIELDS, where)
    kwargs: dict[str, Any] = {"name": _name(d["name"], where)}
    for f in _MODEL_FIELDS[1:]:
        kwargs[f] = _int(d[f], f, where)
    try:
        return ModelArch(**kwargs)
    except (KareusError, ValueError) as exc:
        raise SpecFileError(f"{where}: {exc}") from None


def load_model_file(path: str | os.PathLike[str]) -> ModelArch:
    """Read a model architecture from a ``.toml`` or ``.json`` file (see the module doc).

    Raises:
        SpecFileError: the file is missing, unreadable, not UTF-8, not TOML/JSON, or its
            content is not a valid architecture.
    """
    return model_from_dict(_read_table(path, "model"), where=f"model file {Path(path)}")


MODEL_PRESETS: dict[str, ModelArch] = {
    "llama3.2-3b": ModelArch(name="llama3.2-3b", layers=28, hidden=3072, heads=24, kv_heads=8,
                             head_dim=128, ffn=8192, vocab=128256),
    "qwen3-1.7b": ModelArch(name="qwen3-1.7b", layers=28, hidden=2048, heads=16, kv_heads=8,
                            head_dim=128, ffn=6144, vocab=151936),
    "llama3.3-70b": ModelArch(name="llama3.3-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                              head_dim=128, ffn=28672, vocab=128256),
}


_REGISTERED_MODELS: dict[str, ModelArch] = {}
"""Models registered at run time ([`register_model`][kareus.model.files.register_model]); written
only through ``register_model`` and ``unregister_model``."""


def registered_models() -> dict[str, ModelArch]:
    """Models registered at run time (not the presets), by name."""
    return dict(_REGISTERED_MODELS)


def unregister_model(name: str) -> None:
    """Forget the registered model of that name, in any case (presets stay)."""
    _REGISTERED_MODELS.pop(name.lower(), None)


def register_model(model: ModelArch | str | os.PathLike[str], *,
                   replace: bool = False) -> ModelArch:
    """Make a model known by name to [`get_model`][kareus.model.get_model] (and so to
    ``Workload.preset``).

    Args:
        model: A [`ModelArch`][kareus.model.ModelArch], or the path of a model file.
        replace: Allow replacing a registered model of the same name with a different one.

    The registry lives in this process only: nothing is written (a process of its own,
    such as a worker of a process pool, registers the model again).

    Returns:
        The registered architecture.

    Raises:
        SpecFileError: a bad file; the name is a preset's; or another model is registered
            under that name (and ``replace`` is false).

    Examples:
        A preset with fewer layers, under a name of its own:

        >>> import attrs
        >>> import kareus
        >>> from kareus.model import get_model
        >>> mine = attrs.evolve(get_model("qwen3-1.7b"), name="my-1.7b", layers=20)
        >>> kareus.register_model(mine) is mine
        True
        >>> kareus.Workload.preset("my-1.7b", tp=2).model.layers
        20
    """
    arch = model if isinstance(model, ModelArch) else load_model_file(model)
    return _register(_REGISTERED_MODELS, MODEL_PRESETS, arch.name, arch, name=arch.name,
                     kind="model", figures="sizes", replace=replace)


def model_names() -> list[str]:
    """Names of the model presets and of the models registered at run time."""
    return sorted({*MODEL_PRESETS, *_REGISTERED_MODELS})


def get_model(name: str | ModelArch) -> ModelArch:
    """Look up a model preset or registered model by name, in any case (a
    [`ModelArch`][kareus.model.ModelArch] passes through).

    Raises:
        UnknownPresetError: ``name`` is not a preset or a registered model; the message
            lists the known ones.
    """
    if isinstance(name, ModelArch):
        return name
    if not isinstance(name, str):
        raise ArgumentTypeError(f"model must be a preset name or a ModelArch, not "
                                f"{type(name).__name__}")
    key = name.lower()
    found = MODEL_PRESETS.get(key) or _REGISTERED_MODELS.get(key)
    if found is None:
        raise UnknownPresetError("workload", name, model_names())
    return found


@attrs.frozen(kw_only=True)
class Parallelism:
    """Tensor, context, pipeline and data parallel degrees."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __attrs_post_init__(self) -> None:
        for field in ("tp", "cp", "pp", "dp"):
            _check_count(f"parallelism {field}", getattr(self, field))

    @property
    def world_size(self) -> int:
        """GPUs in the job."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def gpus_per_stage(self) -> int:
        """GPUs that run one pipeline stage of one data-parallel replica (TP x CP)."""
        return self.tp * self.cp


@attrs.frozen(kw_only=True)
class Workload:
    """A training job: model, parallelism, and the batch of one iteration.

    Attributes:
        model: The architecture.
        parallelism: TP, CP, PP, DP degrees.
        microbatch_size: Sequences per microbatch (per data-parallel replica).
        seq_len: Tokens per sequence.
        num_microbatches: Microbatches per iteration and replica.
        recompute: Full activation recomputation (the backward pass re-runs each layer's forward).
        nanobatches: Parts each microbatch is split into for overlap (>= 1).
        dtype_bytes: Bytes per activation element (2 for bf16).
    """

    model: ModelArch = attrs.field(converter=get_model)
    parallelism: Parallelism = attrs.field(factory=Parallelism)
    microbatch_size: int = 8
    seq_len: int = 4096
    num_microbatches: int = 8
    recompute: bool = True
    nanobatches: int = 2
    dtype_bytes: int = 2

    def __attrs_post_init__(self) -> None:
        m, p = self.model, self.parallelism
        for field in ("microbatch_size", "seq_len", "num_microbatches", "nanobatches",
                      "dtype_bytes"):
            _check_count(field, getattr(self, field))
        if not isinstance(self.recompute, bool):
            raise WorkloadError(f"recompute must be True or False, got {self.recompute!r:.40}")
        checks = [
            (m.heads % p.tp == 0, f"TP={p.tp} does not divide the {m.heads} attention heads"),
            (m.kv_heads % p.tp == 0,
             f"TP={p.tp} does not divide the {m.kv_heads} KV heads (use TP <= {m.kv_heads})"),
            (m.ffn % p.tp == 0, f"TP={p.tp} does not divide the FFN width {m.ffn}"),
            (m.layers % p.pp == 0,
             f"PP={p.pp} does not divide the {m.layers} layers; choose a divisor of {m.layers}"),
            (self.seq_len % (2 * p.cp) == 0 or p.cp == 1,
             f"CP={p.cp} needs seq_len divisible by 2*CP={2 * p.cp} (load-balanced causal split)"),
            (self.microbatch_size % self.nanobatches == 0,
             f"microbatch_size={self.microbatch_size} does not split into "
             f"{self.nanobatches} nanobatches; use a divisor of the microbatch size"),
            (self.num_microbatches >= 1, "num_microbatches must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise WorkloadError(f"{m.name}: {msg}")

    @classmethod
    def preset(
        cls,
        name: str,
        *,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        dp: int = 1,
        **kwargs: object,
    ) -> Workload:
        """A workload of a preset model, e.g. ``Workload.preset("llama3.2-3b", tp=4)``.

        The parallel degrees default to 1 (one GPU), which has no collective for kareus to
        schedule: ``kareus optimize --workload NAME`` runs ``Workload.preset(NAME, tp=4,
        pp=2)``, the other fields at their defaults (8 microbatches of 8 x 4096 tokens,
        2 nanobatches, recomputation).
        """
        return cls(model=get_model(name), parallelism=Parallelism(tp=tp, cp=cp, pp=pp, dp=dp),
                   **kwargs)  # type: ignore[arg-type]

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers on each pipeline stage."""
        return self.model.layers // self.parallelism.pp

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one microbatch held by one rank (CP splits the sequence)."""
        return self.microbatch_size * self.seq_len // self.parallelism.cp

    @property
    def tokens_per_nanobatch(self) -> int:
        """Tokens of one nanobatch held by one rank."""
        return self.tokens_per_rank // self.nanobatches

    def with_(self, **changes: object) -> Workload:
        """A copy with some fields changed (validated again)."""
        return attrs.evolve(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line: model, parallelism and batch."""
        p = self.parallelism
        return (f"{self.model.name} TP={p.tp} CP={p.cp} PP={p.pp} DP={p.dp} "
                f"mbs={self.microbatch_size} seq={self.seq_len} "
                f"microbatches={self.num_microbatches} nanobatches={self.nanobatches}"
                f"{' recompute' if self.recompute else ''}")

    def to_dict(self) -> dict[str, object]:
        """JSON-ready description: ``model`` is the preset's name, or every field of an
        architecture that is not a preset (so [`from_dict`][kareus.model.Workload.from_dict] can
        rebuild it)."""
        p = self.parallelism
        model: object = self.model.name if self.model.is_preset else self.model.to_dict()
        return {"model": model, "tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp,
                "microbatch_size": self.microbatch_size, "seq_len": self.seq_len,
                "num_microbatches": self.num_microbatches, "recompute": self.recompute,
                "nanobatches": self.nanobatches}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Workload:
        """Rebuild a workload from [`to_dict`][kareus.model.Workload.to_dict] (``results.json``, a plan's ``workload``).

        Raises:
            WorkloadError: a key is missing or the workload is invalid.
            UnknownPresetError: ``model`` names no preset or registered model.
            SpecFileError: ``model`` is an architecture with bad fields.
        """
        if not isinstance(d, dict) or "model" not in d:
            raise WorkloadError("a workload description needs at least the key 'model'")
        model = d["model"]
        arch = ModelArch.from_dict(model) if isinstance(model, dict) else get_model(str(model))
        par = {k: int(d.get(k, 1)) for k in ("tp", "cp", "pp", "dp")}  # type: ignore[call-overload]
        rest = {k: d[k] for k in ("microbatch_size", "seq_len", "num_microbatches",
                                  "recompute", "nanobatches", "dtype_bytes") if k in d}
        return cls(model=arch, parallelism=Parallelism(**par), **rest)  # type: ignore[arg-type]
