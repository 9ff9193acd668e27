"""Your own model architectures and GPUs, from TOML or JSON files.

The built-in presets (``kareus workloads``, ``kareus gpus``) cover a few public models and
GPUs. Any other decoder-only transformer (grouped-query attention, SwiGLU MLP) or GPU is a
small file whose keys are the fields of [`ModelArch`][kareus.model.ModelArch] or
[`GPUSpec`][kareus.model.GPUSpec]::

    # my-model.toml
    name = "my-8b"
    layers = 32
    hidden = 4096
    heads = 32
    kv_heads = 8
    head_dim = 128
    ffn = 14336
    vocab = 128256

    # my-gpu.toml: clocks as a list or as {min, max, step}; search clocks descending
    name = "my-gpu"
    sm_count = 108
    clocks_mhz = {min = 210, max = 1410, step = 15}
    search_clocks_mhz = {max = 1410, step = 30, count = 18}
    bf16_peak_tflops = 312.0
    ...

``load_model_file`` and ``load_gpu_file`` read and check a file;
[`register_model`][kareus.model.files.register_model] and
[`register_gpu`][kareus.model.files.register_gpu] make the result known by name to
[`get_model`][kareus.model.get_model] and [`get_gpu`][kareus.model.get_gpu] (so
``Workload.preset("my-8b", ...)``, ``EmulatedProfiler("my-gpu")`` and plans of that GPU work).
``kareus optimize --model-file F --gpu-file F`` does both.

A workload of a model that is not a preset stores its whole architecture in
``Workload.to_dict()`` (so in ``results.json`` and ``plan.json``), and
[Workload.from_dict][kareus.model.Workload.from_dict] reads it back;
``results.json`` likewise carries the whole GPU spec when the GPU is not a preset.

Every way a file can be bad (missing, not UTF-8, not TOML or JSON, not a table, a missing
field, an unknown key, a value of the wrong type or an impossible one) raises
``SpecFileError`` with one line naming the file and what to change. TOML needs
Python 3.11+ (``tomllib``) or the ``tomli`` package on Python 3.10; without either, a TOML
file raises a ``SpecFileError`` saying to install tomli or write JSON.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kareus.errors import KareusError
from kareus.model.gpu import GPU_PRESETS, GPUSpec
from kareus.model.workload import MODEL_PRESETS, ModelArch

__all__ = [
    "SpecFileError",
    "gpu_from_dict",
    "load_gpu_file",
    "load_model_file",
    "model_from_dict",
    "register_gpu",
    "register_model",
    "registered_gpus",
    "registered_models",
    "spec_to_dict",
    "unregister",
]

_MAX_BYTES = 1024 * 1024
"""Spec files are a few hundred bytes; anything over 1 MiB is not one."""


class SpecFileError(KareusError, ValueError):
    """A model or GPU description (file or dict) that kareus cannot use."""


_MODEL_FIELDS = ("name", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab")
_GPU_INT_FIELDS = ("sm_count", "default_comm_sms")
_GPU_FLOAT_FIELDS = ("bf16_peak_tflops", "hbm_bandwidth_gbps", "nvlink_bandwidth_gbps",
                     "power_limit_w", "static_power_w", "idle_power_w", "memory_gib")
_GPU_FIELDS = ("name", "sm_count", "clocks_mhz", "search_clocks_mhz", *_GPU_FLOAT_FIELDS,
               "default_comm_sms")


# ----------------------------------------------------------------------------- reading


def _toml_loads() -> Any:
    try:
        import tomllib  # Python 3.11+

        return tomllib.loads
    except ImportError:
        pass
    try:
        import tomli  # the same parser on Python 3.10

        return tomli.loads
    except ImportError:
        return None


def _read_table(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise SpecFileError(f"{what} file {p} is a folder: pass the path of a .toml or .json file")
    suffix = p.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise SpecFileError(f"{what} file {p} must end in .toml or .json (it says which format "
                            f"it is), got {p.suffix or 'no suffix'!r}")
    try:
        raw = p.read_bytes() if p.stat().st_size <= _MAX_BYTES else None
    except FileNotFoundError:
        raise SpecFileError(f"{what} file {p} does not exist: check the path") from None
    except OSError as exc:
        raise SpecFileError(f"cannot read {what} file {p}: {exc.strerror or exc}") from None
    if raw is None:
        raise SpecFileError(f"{what} file {p} is over {_MAX_BYTES:,} bytes: it is not a "
                            f"{what} description")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecFileError(f"{what} file {p} is not UTF-8 text (byte {exc.start}): save it "
                            "as UTF-8") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SpecFileError(f"{what} file {p} is not valid JSON ({exc})") from None
    else:
        loads = _toml_loads()
        if loads is None:
            raise SpecFileError(f"{what} file {p} is TOML, which needs Python 3.11+ or the tomli "
                                "package: pip install tomli, or write the file as JSON")
        try:
            data = loads(text)
        except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
            raise SpecFileError(f"{what} file {p} is not valid TOML ({exc})") from None
    if not isinstance(data, dict):
        raise SpecFileError(f"{what} file {p} holds a JSON {type(data).__name__}, not an "
                            f"object of {what} fields")
    return data


def _check_keys(d: Mapping[str, Any], fields: tuple[str, ...], where: str) -> None:
    unknown = [k for k in d if k not in fields]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), fields, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise SpecFileError(f"{where}: unknown key(s) {', '.join(hints)}; the fields are "
                            f"{', '.join(fields)}")
    missing = [f for f in fields if f not in d]
    if missing:
        raise SpecFileError(f"{where}: missing field(s) {', '.join(missing)}; every one of "
                            f"{', '.join(fields)} is needed")


def _int(value: Any, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise SpecFileError(f"{where}: {field} must be a whole number, got {value!r:.60}")
    return value


def _float(value: Any, field: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecFileError(f"{where}: {field} must be a number, got {value!r:.60}")
    try:
        x = float(value)
    except OverflowError:  # an integer beyond float range
        x = float("inf")
    if x != x or x in (float("inf"), float("-inf")):
        raise SpecFileError(f"{where}: {field} must be a finite number, got {value!r:.60}")
    return x


#: The longest model or GPU name a file may give (it appears in every message).
MAX_NAME = 200


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SpecFileError(f"{where}: name must be a non-empty string, got {value!r:.60}")
    if len(value.strip()) > MAX_NAME:
        raise SpecFileError(f"{where}: name is {len(value.strip()):,} characters long (at "
                            f"most {MAX_NAME})")
    return value.strip()


# ----------------------------------------------------------------------------- models


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


# ----------------------------------------------------------------------------- GPUs


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


# ----------------------------------------------------------------------------- registry


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
    from kareus.model import workload

    arch = model if isinstance(model, ModelArch) else load_model_file(model)
    if arch.name in MODEL_PRESETS:
        if MODEL_PRESETS[arch.name] == arch:
            return arch
        raise SpecFileError(f"model {arch.name!r} is a built-in preset with other sizes: give "
                            "your model another name")
    old = workload._REGISTERED_MODELS.get(arch.name)
    if old is not None and old != arch and not replace:
        raise SpecFileError(f"another model is already registered as {arch.name!r}: give this "
                            "one another name, or pass replace=True")
    workload._REGISTERED_MODELS[arch.name] = arch
    return arch


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
    from kareus.model import gpu as gpu_module

    spec = gpu if isinstance(gpu, GPUSpec) else load_gpu_file(gpu)
    key = spec.name.lower()
    if key in GPU_PRESETS:
        if GPU_PRESETS[key] == spec:
            return spec
        raise SpecFileError(f"GPU {spec.name!r} is a built-in preset with other figures: give "
                            "your GPU another name")
    old = gpu_module._REGISTERED_GPUS.get(key)
    if old is not None and old != spec and not replace:
        raise SpecFileError(f"another GPU is already registered as {spec.name!r}: give this "
                            "one another name, or pass replace=True")
    gpu_module._REGISTERED_GPUS[key] = spec
    return spec


def registered_models() -> dict[str, ModelArch]:
    """Models registered at run time (not the presets), by name."""
    from kareus.model import workload

    return dict(workload._REGISTERED_MODELS)


def registered_gpus() -> dict[str, GPUSpec]:
    """GPUs registered at run time (not the presets), by name."""
    from kareus.model import gpu as gpu_module

    return dict(gpu_module._REGISTERED_GPUS)


def unregister(name: str) -> None:
    """Forget a registered model or GPU of that name (presets stay)."""
    from kareus.model import gpu as gpu_module
    from kareus.model import workload

    workload._REGISTERED_MODELS.pop(name, None)
    gpu_module._REGISTERED_GPUS.pop(name.lower(), None)


def spec_to_dict(obj: ModelArch | GPUSpec) -> dict[str, Any]:
    """The JSON-ready fields of a model or GPU (what the loaders read back)."""
    d = attrs.asdict(obj)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
