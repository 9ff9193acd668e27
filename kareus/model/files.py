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
    # the layer features, each optional (these are the defaults: a plain Llama layer)
    qk_norm = false          # RMSNorm of queries and keys per head, before RoPE (Qwen3)
    norm_eps = 1e-5          # every RMSNorm's epsilon
    qkv_bias = false         # a bias on the QKV projection (Qwen2)
    tied_embeddings = false  # the LM head uses the embedding's matrix

    # my-gpu.toml: clocks as a list or as {min, max, step}; search clocks descending
    name = "my-gpu"
    sm_count = 108
    clocks_mhz = {min = 210, max = 1410, step = 15}
    search_clocks_mhz = {max = 1410, step = 30, count = 18}
    bf16_peak_tflops = 312.0
    ...

A Hugging Face ``config.json`` of the Llama, Qwen2 or Qwen3 family is a model file too:
``load_model_file`` recognises it by its content (an ``architectures`` or ``model_type``
key) and reads it as [`model_from_hf_config`][kareus.model.files.model_from_hf_config] does
(the model named by the config's ``_name_or_path``, else its folder), so
``kareus optimize --model-file Qwen3-1.7B/config.json`` works; a config that asks for what
kareus does not compute (a sliding window, experts, another activation, other biases) is
refused in one line naming its key. Nothing is downloaded: the file must be local.

A Megatron-Core / Megatron-LM configuration is a model file too (``.json`` or ``.yaml``:
Megatron-LM's ``--yaml-cfg`` file, its arguments as a flat mapping, or a saved
``TransformerConfig`` with the model's ``vocab_size``), recognised by its content and read as
[`model_from_megatron_config`][kareus.model.files.model_from_megatron_config] does: Megatron's
names (``num_layers``, ``num_query_groups``, ``kv_channels``, ``ffn_hidden_size``,
``layernorm_epsilon`` or ``norm_epsilon``, ``qk_layernorm``, ...) with Megatron's defaults and
its vocabulary padding; what kareus's layer does not compute (dropout, whose Megatron default
is 0.1, linear biases, LayerNorm, experts, ...) is refused in one line naming the field.
Reading YAML needs PyYAML.

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
field, an unknown key, a value of the wrong type, such as ``qk_norm = 1``, or an impossible
one, such as ``norm_eps = 0``) raises
``SpecFileError`` with one line naming the file and what to change. TOML needs
Python 3.11+ (``tomllib``) or the ``tomli`` package on Python 3.10; without either, a TOML
file raises a ``SpecFileError`` saying to install tomli or write JSON.
"""

from __future__ import annotations

from typing import Any

import attrs

from kareus.model._spec_file import MAX_NAME as MAX_NAME
from kareus.model._spec_file import SpecFileError
from kareus.model.gpu import (
    GPUSpec,
    gpu_from_dict,
    load_gpu_file,
    register_gpu,
    registered_gpus,
    unregister_gpu,
)
from kareus.model.workload import (
    ModelArch,
    load_model_file,
    model_from_dict,
    model_from_hf_config,
    model_from_megatron_config,
    register_model,
    registered_models,
    unregister_model,
)

__all__ = [
    "SpecFileError",
    "gpu_from_dict",
    "load_gpu_file",
    "load_model_file",
    "model_from_dict",
    "model_from_hf_config",
    "model_from_megatron_config",
    "register_gpu",
    "register_model",
    "registered_gpus",
    "registered_models",
    "spec_to_dict",
    "unregister",
]


def unregister(name: str) -> None:
    """Forget a registered model or GPU of that name (presets stay)."""
    unregister_model(name)
    unregister_gpu(name)


def spec_to_dict(obj: ModelArch | GPUSpec) -> dict[str, Any]:
    """The JSON-ready fields of a model or GPU (what the loaders read back)."""
    d = attrs.asdict(obj)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
