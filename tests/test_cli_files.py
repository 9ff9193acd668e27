"""`kareus optimize --model-file F --gpu-file F`: your own model and GPU from files, through
results.json and plan.json and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import lab_gpu_toml

from kareus.cli import main
from kareus.compose.plan import Plan
from kareus.model import files
from kareus.model.gpu import GPUSpec
from kareus.model.workload import ModelArch, Workload

MODEL = {"name": "lab-3b", "layers": 4, "hidden": 2048, "heads": 16, "kv_heads": 8,
         "head_dim": 128, "ffn": 5632, "vocab": 32000}
GPU_TOML = lab_gpu_toml("lab-gpu", search_count=6)


#: the models and GPUs a test registers: unregistered after it (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("clean_spec_registry")


@pytest.fixture()
def spec_files(tmp_path: Path) -> tuple[Path, Path]:
    m = tmp_path / "lab-3b.json"
    m.write_text(json.dumps(MODEL))
    g = tmp_path / "lab-gpu.toml"
    g.write_text(GPU_TOML)
    return m, g


def test_optimize_with_own_model_and_gpu_round_trips(spec_files: tuple[Path, Path],
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    m, g = spec_files
    out = tmp_path / "out"
    rc = main(["optimize", "--model-file", str(m), "--gpu-file", str(g), "--tp", "2", "--pp",
               "2", "--microbatches", "4", "--microbatch-size", "4", "--budget", "6", "--quiet",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert res["workload"]["model"] == MODEL and res["gpu"] == "lab-gpu"
    wl = Workload.from_dict(res["workload"])
    assert wl.model == ModelArch(**MODEL) and wl.parallelism.tp == 2
    assert GPUSpec.from_dict(res["gpu_spec"]) == GPUSpec.from_file(g)
    # plan.json: its workload carries the architecture; its GPU needs the GPU file.
    files.unregister("lab-gpu")
    files.unregister("lab-3b")
    rc = main(["show", str(out / "plan.json")])
    err = capsys.readouterr().err.splitlines()[-1]
    # the loader's hint is Python's, and the command adds its own
    assert rc == 2 and "unknown GPU 'lab-gpu'" in err and "show PLAN --gpu-file FILE" in err
    rc = main(["show", str(out / "plan.json"), "--gpu-file", str(g)])
    shown = capsys.readouterr().out
    assert rc == 0 and "lab-gpu" in shown
    # the model by its name, its shape on a line of its own, not a raw dict
    assert "model=lab-3b," in shown and "{" not in shown
    assert "  model       layers=4, hidden=2048, heads=16" in shown
    plan = Plan.load(out / "plan.json")
    assert Workload.from_dict(plan.workload) == wl  # no model registration needed


@pytest.mark.parametrize(("argv", "needle"), [
    (["--workload", "qwen3-1.7b", "--model-file", "M"], "either --workload PRESET or --model"),
    ([], "either --workload PRESET or --model-file"),
    (["--model-file", "nope.toml"], "does not exist"),
    (["--workload", "qwen3-1.7b", "--gpu-file", "BAD"], "unknown key(s) 'sm_cnt'"),
])
def test_bad_inputs_exit_2_with_one_line(argv: list[str], needle: str, tmp_path: Path,
                                         spec_files: tuple[Path, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    m, g = spec_files
    bad = tmp_path / "bad.toml"
    bad.write_text(GPU_TOML.replace("sm_count", "sm_cnt"))
    argv = [str(m) if a == "M" else str(bad) if a == "BAD" else a for a in argv]
    rc = main(["optimize", *argv, "--budget", "2", "--quiet", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_a_model_named_in_cjk_script_draws_its_figure_without_glyph_warnings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        recwarn: pytest.WarningsRecorder) -> None:
    pytest.importorskip("matplotlib")
    m = tmp_path / "cjk.json"
    m.write_text(json.dumps({**MODEL, "name": "模型-3b"}), encoding="utf-8")
    out = tmp_path / "out"
    try:
        rc = main(["optimize", "--model-file", str(m), "--gpu", "h200-sxm", "--tp", "2",
                   "--pp", "2", "--microbatches", "4", "--microbatch-size", "2", "--seq-len",
                   "1024", "--budget", "4", "--quiet", "--out", str(out)])
    finally:
        files.unregister("模型-3b")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert (out / "frontier.png").is_file()
    assert not [w for w in recwarn if "Glyph" in str(w.message)]  # not even to pytest
    assert err == ""  # no glyph warning on stderr either (and --quiet: no start line)


TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 64, "intermediate_size": 2816, "vocab_size": 32000,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_act": "silu",
              "use_sliding_window": False, "sliding_window": None, "rope_scaling": None}


def test_optimize_takes_a_hugging_face_config(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tiny-qwen3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_QWEN3))
    out = tmp_path / "out"
    rc = main(["optimize", "--model-file", str(folder / "config.json"), "--gpu", "h200-sxm",
               "--tp", "2", "--pp", "2", "--microbatches", "4", "--microbatch-size", "2",
               "--seq-len", "1024", "--budget", "4", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    model = json.loads((out / "results.json").read_text())["workload"]["model"]
    assert model["name"] == "tiny-qwen3" and model["qk_norm"] is True
    assert model["tied_embeddings"] is True and model["norm_eps"] == 1e-6
    plan = Plan.load(out / "plan.json")
    assert Workload.from_dict(plan.workload).model == ModelArch.from_hf_config(
        folder / "config.json")
    # A config asking for what kareus does not compute: exit 2, one line naming the key.
    (folder / "config.json").write_text(json.dumps({**TINY_QWEN3, "use_sliding_window": True}))
    rc = main(["optimize", "--model-file", str(folder / "config.json"), "--budget", "2",
               "--quiet", "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert rc == 2 and "use_sliding_window true is not computed" in err
    assert len(err.strip().splitlines()) == 1
