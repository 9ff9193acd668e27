"""Model architectures and GPU specs from TOML/JSON files, the run-time registry, and the
round trip of a non-preset architecture through Workload.to_dict / from_dict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _helpers import lab_gpu_toml

from kareus.errors import KareusError, UnknownPresetError
from kareus.model.files import (
    SpecFileError,
    gpu_from_dict,
    load_gpu_file,
    load_model_file,
    model_from_dict,
    register_gpu,
    register_model,
    spec_to_dict,
)
from kareus.model.gpu import GPU_PRESETS, GPUSpec, get_gpu, gpu_names
from kareus.model.workload import MODEL_PRESETS, ModelArch, Workload, get_model, model_names

MODEL_TOML = """\
name = "tiny-gqa"
layers = 4
hidden = 1024
heads = 16
kv_heads = 4
head_dim = 64
ffn = 2816
vocab = 32000
"""

GPU_TOML = lab_gpu_toml("Lab-GPU", search_count=10)


#: the models and GPUs a test registers: unregistered after it (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("clean_spec_registry")


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    return p


def test_model_from_toml_and_json_agree(tmp_path: Path) -> None:
    a = load_model_file(_write(tmp_path, "m.toml", MODEL_TOML))
    fields = {"name": "tiny-gqa", "layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 4,
              "head_dim": 64, "ffn": 2816, "vocab": 32000}
    b = ModelArch.from_file(_write(tmp_path, "m.json", json.dumps(fields)))
    assert a == b == ModelArch(**fields)
    assert not a.is_preset and MODEL_PRESETS["qwen3-1.7b"].is_preset


def test_gpu_ranges_expand_and_match_a_list(tmp_path: Path) -> None:
    g = load_gpu_file(_write(tmp_path, "g.toml", GPU_TOML))
    assert g.name == "lab-gpu"  # names are case-insensitive, stored lower-case like presets
    assert g.clocks_mhz[0] == 300 and g.clocks_mhz[-1] == 1500 and len(g.clocks_mhz) == 81
    assert g.search_clocks_mhz == tuple(range(1500, 1500 - 10 * 60, -60))
    again = gpu_from_dict(json.loads(json.dumps(spec_to_dict(g))))
    assert again == g
    assert GPUSpec.from_dict(spec_to_dict(GPU_PRESETS["h200-sxm"])) == GPU_PRESETS["h200-sxm"]


@pytest.mark.parametrize(("text", "needle"), [
    (MODEL_TOML.replace("vocab = 32000\n", ""), "missing field(s) vocab"),
    (MODEL_TOML + "hiden = 3\n", "unknown key(s) 'hiden' (did you mean 'hidden'?)"),
    (MODEL_TOML.replace("kv_heads = 4", "kv_heads = 5"), "multiple of kv_heads"),
    (MODEL_TOML.replace("layers = 4", "layers = 0"), "layers must be in 1.."),
    (MODEL_TOML.replace("layers = 4", "layers = " + "9" * 40), "layers must be in 1..2,147,48"),
    (MODEL_TOML.replace("layers = 4", 'layers = "four"'), "layers must be a whole number"),
    (MODEL_TOML.replace("layers = 4", "layers = true"), "layers must be a whole number"),
    (MODEL_TOML.replace('name = "tiny-gqa"', 'name = ""'), "name must be a non-empty"),
    (MODEL_TOML.replace('name = "tiny-gqa"', f'name = "{"x" * 300}"'),
     "name is 300 characters long (at most 200)"),
    ("name = \n", "not valid TOML"),
])
def test_bad_model_files_raise_one_line(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, "bad.toml", text)
    with pytest.raises(SpecFileError) as err:
        load_model_file(path)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg and str(path) in msg
    assert isinstance(err.value, KareusError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(("change", "needle"), [
    ({"sm_count": 1}, "sm_count must be in 2..65,536"),
    ({"sm_count": 10**30}, "sm_count must be in 2..65,536, got 1000000000000000000000000000000"),
    ({"default_comm_sms": 100}, "default_comm_sms must be in 1..99"),
    ({"power_limit_w": -1}, "power_limit_w must be positive"),
    ({"bf16_peak_tflops": 10**400}, "bf16_peak_tflops must be a finite number"),
    ({"hbm_bandwidth_gbps": 1e300}, "hbm_bandwidth_gbps must be positive, in 0.001.."),
    ({"static_power_w": 900.0}, "idle_power_w <= static_power_w <= power_limit_w"),
    ({"nvlink_bandwidth_gbps": 1e-300}, "nvlink_bandwidth_gbps must be positive, in 0.001"),
    ({"sm_count": "9" * 5000}, "sm_count must be a whole number, got '9999"),
    ({"search_clocks_mhz": [1510]}, "are not in clocks_mhz"),
    ({"clocks_mhz": {"min": 300, "max": 1501, "step": 15}}, "not min 300 plus a multiple"),
    ({"clocks_mhz": {"min": 900, "max": 300, "step": 15}}, "is impossible"),
    ({"clocks_mhz": {"max": 1500, "step": 15, "stop": 3}}, "unknown key(s) 'stop'"),
    ({"clocks_mhz": []}, "clocks_mhz is empty"),
    ({"clocks_mhz": "fast"}, "must be a list of MHz or a range"),
    ({"memory_gib": float("nan")}, "must be a finite number"),
    ({"hbm_bandwith_gbps": 1.0}, "did you mean 'hbm_bandwidth_gbps'"),
])
def test_bad_gpu_values_raise_typed_errors(tmp_path: Path, change: dict, needle: str) -> None:
    good = spec_to_dict(load_gpu_file(_write(tmp_path, "g.toml", GPU_TOML)))
    with pytest.raises(SpecFileError, match="GPU") as err:
        gpu_from_dict({**good, **change})
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert len(str(err.value)) < 300  # a long bad value is shown cut short


def test_file_level_errors(tmp_path: Path) -> None:
    cases = [
        (tmp_path / "none.toml", "does not exist"),
        (_write(tmp_path, "m.txt", MODEL_TOML), "must end in .toml or .json"),
        # YAML is read for Megatron configurations; kareus's own fields there are not one
        (_write(tmp_path, "m.yaml", MODEL_TOML), "must hold a mapping|Megatron configuration"),
        (_write(tmp_path, "latin.toml", "name = 'caf\xe9'\n".encode("latin-1")), "not UTF-8"),
        (_write(tmp_path, "m.json", "{not json"), "not valid JSON"),
        (_write(tmp_path, "list.json", "[1, 2]"), "holds a JSON list"),
        (tmp_path, "is a folder"),
    ]
    for path, needle in cases:
        with pytest.raises(SpecFileError, match=needle):
            load_model_file(path)


def test_toml_without_a_parser_says_what_to_do(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Python 3.10 without tomli: both imports fail.
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(SpecFileError, match="pip install tomli, or write the file as JSON"):
        load_model_file(_write(tmp_path, "m.toml", MODEL_TOML))
    # JSON still works.
    d = {"name": "x", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
         "ffn": 128, "vocab": 100}
    assert load_model_file(_write(tmp_path, "m.json", json.dumps(d))).name == "x"


def test_register_makes_names_resolvable(tmp_path: Path) -> None:
    with pytest.raises(UnknownPresetError):
        get_model("tiny-gqa")
    arch = register_model(_write(tmp_path, "m.toml", MODEL_TOML))
    assert get_model("tiny-gqa") is arch and "tiny-gqa" in model_names()
    wl = Workload.preset("tiny-gqa", tp=4, pp=2, microbatch_size=4)
    assert wl.model == arch
    spec = register_gpu(_write(tmp_path, "g.toml", GPU_TOML))
    assert get_gpu("LAB-GPU") is spec and "lab-gpu" in gpu_names()
    assert register_model(arch) is arch  # the same again is fine
    other = ModelArch(**{**arch.to_dict(), "layers": 8})
    with pytest.raises(SpecFileError, match="already registered"):
        register_model(other)
    assert register_model(other, replace=True) == get_model("tiny-gqa") == other


def test_presets_cannot_be_shadowed() -> None:
    preset = MODEL_PRESETS["qwen3-1.7b"]
    assert register_model(preset) is preset
    with pytest.raises(SpecFileError, match="built-in preset"):
        register_model(ModelArch(**{**preset.to_dict(), "layers": 4}))
    h200 = GPU_PRESETS["h200-sxm"]
    with pytest.raises(SpecFileError, match="built-in preset"):
        register_gpu(GPUSpec.from_dict({**spec_to_dict(h200), "sm_count": 100}))


def test_workload_round_trip_stores_a_custom_architecture(tmp_path: Path) -> None:
    arch = load_model_file(_write(tmp_path, "m.toml", MODEL_TOML))
    wl = Workload(model=arch, microbatch_size=4, seq_len=2048, num_microbatches=4)
    d = json.loads(json.dumps(wl.to_dict()))
    assert d["model"] == arch.to_dict()  # the whole architecture, not just a name
    assert Workload.from_dict(d) == wl  # read back without registering anything
    # A preset keeps the short form (plan digests of preset workloads do not change).
    pre = Workload.preset("qwen3-1.7b", tp=4, cp=2, pp=2, microbatch_size=16)
    assert pre.to_dict()["model"] == pre.model.to_dict()  # a preset too: its architecture
    assert Workload.from_dict(pre.to_dict()) == pre
    with pytest.raises(SpecFileError, match="missing field"):
        Workload.from_dict({**d, "model": {"name": "broken", "layers": 2}})


def test_model_from_dict_rejects_non_tables() -> None:
    with pytest.raises(SpecFileError, match="expected a table"):
        model_from_dict(["layers", 2])  # type: ignore[arg-type]


FEATURES_TOML = MODEL_TOML + """\
qk_norm = true
norm_eps = 1e-6
qkv_bias = true
tied_embeddings = true
"""


def test_layer_features_in_model_files(tmp_path: Path) -> None:
    arch = load_model_file(_write(tmp_path, "m.toml", FEATURES_TOML))
    assert (arch.qk_norm, arch.norm_eps, arch.qkv_bias, arch.tied_embeddings) == (
        True, 1e-6, True, True)
    again = load_model_file(_write(tmp_path, "m.json", json.dumps(spec_to_dict(arch))))
    assert again == arch == model_from_dict(arch.to_dict())
    # Absent features are the defaults (files written before they existed still load).
    plain = load_model_file(_write(tmp_path, "p.toml", MODEL_TOML))
    assert (plain.qk_norm, plain.norm_eps, plain.qkv_bias, plain.tied_embeddings) == (
        False, 1e-5, False, False)
    # A workload of it carries them through to_dict / from_dict (results.json, plan.json).
    wl = Workload(model=arch)
    assert Workload.from_dict(wl.to_dict()).model == arch


@pytest.mark.parametrize(("line", "needle"), [
    ("qk_norm = 1", "qk_norm must be true or false, got 1"),
    ('qkv_bias = "yes"', "qkv_bias must be true or false"),
    ("tied_embeddings = 0", "tied_embeddings must be true or false"),
    ("norm_eps = 0", "norm_eps must be a number in (0, 1)"),
    ("norm_eps = -1e-5", "norm_eps must be a number in (0, 1)"),
    ("norm_eps = 2.0", "norm_eps must be a number in (0, 1)"),
    ('norm_eps = "1e-5"', "norm_eps must be a number"),
    ("norm_eps = true", "norm_eps must be a number"),
    ("norm_eps = nan", "norm_eps must be a finite number"),
    ("qk_nrom = true", "did you mean 'qk_norm'"),
    ("tie_word_embeddings = true", "did you mean 'tied_embeddings'"),
])
def test_bad_layer_features_raise_one_line(tmp_path: Path, line: str, needle: str) -> None:
    path = _write(tmp_path, "bad.toml", MODEL_TOML + line + "\n")
    with pytest.raises(SpecFileError) as err:
        load_model_file(path)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg and str(path) in msg
