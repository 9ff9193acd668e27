"""examples/integrations/megatron_lm_pretrain.py (the GPU comparison of Megatron-LM's own
pretrain_gpt.py with Megatron's layers and with kareus's): its commands and its reading of
Megatron-LM's log (the GPU run itself needs CUDA and a Megatron-LM checkout)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "integrations" / "megatron_lm_pretrain.py"


def _load():
    spec = importlib.util.spec_from_file_location("megatron_lm_pretrain", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_it_reads_megatron_lm_s_iteration_lines():
    mod = _load()
    # the format of training_log in Megatron-LM core_v0.16.1 (megatron/training/training.py)
    line = (" [2026-12-04 16:00:00] iteration        3/      20 | consumed samples:           48 |"
            " elapsed time per iteration (ms): 177.4 | throughput per GPU (TFLOP/s/GPU): 80.1 |"
            " learning rate: 3.000000E-04 | global batch size:    16 | lm loss: 1.041234E+01 |"
            " loss scale: 1.0 | grad norm: 3.140 | number of skipped iterations:   0 |")
    assert mod.parse_log(line + "\n" + line.replace("   3/", "   4/")) == {
        3: (177.4, 10.41234), 4: (177.4, 10.41234)}


def test_the_kareus_cases_add_only_the_spec_and_the_environment(tmp_path, capsys):
    mod = _load()
    assert mod.main(["--megatron-lm", str(tmp_path), "--cases", "megatron,kareus,kareus-graphs",
                     "--print"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("# ")]
    own, mine, graphs = lines
    assert "--spec" not in own and "--transformer-impl local" in own
    assert mine.endswith("--spec kareus.integrations.megatron layer_spec")
    assert own.split("pretrain_gpt.py", 1)[1] in mine  # the same flags
    assert "KAREUS_GRAPHS=1" in graphs and "KAREUS_GRAPHS=0" in mine
    # the flags are a job kareus reads (the plan of --megatron-args)
    from kareus.integrations.megatron_args import parse_megatron_args

    ns = parse_megatron_args(mine.split("pretrain_gpt.py", 1)[1])
    assert (ns.num_layers, ns.hidden_size, ns.tensor_model_parallel_size) == (4, 1024, 1)


def test_the_qwen3_shape_is_qwen3_1_7b_s_layer_as_kareus_reads_its_flags(tmp_path, capsys):
    mod = _load()
    assert mod.main(["--megatron-lm", str(tmp_path), "--shape", "qwen3", "--cases",
                     "megatron,kareus", "--print"]) == 0
    own, mine = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("# ")]
    flags = own.split("pretrain_gpt.py", 1)[1]
    for flag in ("--qk-layernorm", "--norm-epsilon 1e-6", "--kv-channels 128",
                 "--rotary-base 1000000", "--num-query-groups 8", "--ffn-hidden-size 6144"):
        assert f"{flag} " in flags + " ", flag
    assert "--untie-embeddings-and-output-weights" not in flags  # Qwen3-1.7B ties them
    assert flags in mine
    from kareus.integrations.megatron_args import workload_from_megatron_args

    wl = workload_from_megatron_args(mine.split("pretrain_gpt.py", 1)[1])
    m = wl.model
    assert (m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab) == (
        2048, 16, 8, 128, 6144, 151936)
    assert m.qk_norm and m.norm_eps == 1e-6 and m.tied_embeddings
    # what kareus's layer does not compute, added to these flags, is refused in one line
    # naming the flag (or its TransformerConfig field)
    from kareus.errors import KareusError

    job = mine.split("pretrain_gpt.py", 1)[1]
    for extra, named in (("--add-qkv-bias", "add_qkv_bias"),
                         ("--hidden-dropout 0.1", "--hidden-dropout"),
                         ("--rotary-interleaved", "rotary_interleaved"),
                         ("--qk-l2-norm", "qk_l2_norm"), ("--num-experts 8", "moe_token_dispatcher_type"),
                         ("--apply-layernorm-1p", "layernorm_zero_centered_gamma")):
        with pytest.raises(KareusError, match=named) as err:
            workload_from_megatron_args(f"{job} {extra}")
        assert "\n" not in str(err.value)
    # the llama shape is unchanged: no query/key norm, Megatron-LM's eps
    llama = workload_from_megatron_args(" ".join(mod.job_flags(mod.parse_args(
        ["--megatron-lm", str(tmp_path)]))))
    assert not llama.model.qk_norm and llama.model.norm_eps == 1e-5


def _fake_line(folder: Path, version: str | None, loss: float) -> Path:
    """A Megatron-LM checkout whose ``pretrain_gpt.py`` prints Megatron-LM's iteration lines
    (the loss it is given); with ``version``, its own ``megatron/core`` (a wheel's compiled
    dataset helpers without the Makefile)."""
    folder.mkdir()
    if version is not None:
        core = folder / "megatron" / "core"
        (core / "datasets").mkdir(parents=True)
        (core / "__init__.py").write_text(f"__version__ = {version!r}\n")
        (core / "datasets" / "helpers_cpp.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    (folder / "pretrain_gpt.py").write_text(
        "import sys\n"
        "for i in (1, 2, 3):\n"
        "    print(f' [t] iteration {i:>8}/       3 | consumed samples: 16 | elapsed time per "
        "iteration (ms): {100 + i}.0 | lm loss: " + f"{loss}" + "E+00 | loss scale: 1.0 |')\n")
    return folder


def test_each_line_runs_with_its_own_megatron_core_and_is_written_apart(tmp_path):
    """Two release lines in one call: each line's runs import the megatron-core of its
    checkout (an unpacked wheel beside the trainer) before the installed one, and the JSON
    keeps each line's results under its version."""
    import json
    import shutil

    mod = _load()
    a = _fake_line(tmp_path / "a", "9.1.0", 2.5)
    b = _fake_line(tmp_path / "b", "9.0.3", 3.5)
    out = tmp_path / "r.json"
    assert mod.main(["--megatron-lm", str(a), "--megatron-lm", str(b), "--cases", "megatron",
                     "--iters", "3", "--warmup", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["lines"]) == {"9.1.0", "9.0.3"}
    first, second = res["lines"]["9.1.0"], res["lines"]["9.0.3"]
    assert first["megatron_lm"] == str(a) and first["megatron_core_path"] == str(
        a.resolve() / "megatron" / "core")
    assert first["results"]["megatron"]["loss"] == {"1": 2.5, "2": 2.5, "3": 2.5}
    assert second["results"]["megatron"]["loss"]["3"] == 3.5
    assert second["results"]["megatron"]["median_step_ms"] == 102.5
    assert "--num-layers 4" in res["flags"]
    # the wheel's compiled helpers without a Makefile: one whose target does nothing
    makefile = a / "megatron" / "core" / "datasets" / "Makefile"
    assert makefile.exists()
    if shutil.which("make"):
        import subprocess

        assert subprocess.run(["make", "-C", str(makefile.parent)], capture_output=True,
                              check=False).returncode == 0
    assert not mod.ensure_helpers_makefile(a / "megatron" / "core")  # not written twice


def test_a_line_whose_megatron_core_does_not_import_is_reported_not_run(tmp_path, capsys):
    import json

    mod = _load()
    bad = tmp_path / "bad"
    (bad / "megatron" / "core").mkdir(parents=True)
    (bad / "megatron" / "core" / "__init__.py").write_text("raise ImportError('broken')\n")
    out = tmp_path / "r.json"
    assert mod.main(["--megatron-lm", str(bad), "--cases", "megatron",
                     "--json", str(out)]) == 1
    assert "broken" in capsys.readouterr().err
    assert "broken" in json.loads(out.read_text())["lines"][str(bad)]["error"]


def test_the_installed_megatron_core_is_left_as_it_is(tmp_path, capsys):
    """A line without its own megatron/core runs the installed one, whose folder the script
    never writes into (it says when Megatron-LM's start-up will miss the Makefile)."""
    pytest.importorskip("megatron.core")
    import json

    import megatron.core

    mod = _load()
    datasets = Path(megatron.core.__file__).resolve().parent / "datasets"
    before = sorted(p.name for p in datasets.iterdir())
    out = tmp_path / "r.json"
    line = _fake_line(tmp_path / "plain", None, 1.5)
    assert mod.main(["--megatron-lm", str(line), "--cases", "megatron", "--iters", "3",
                     "--json", str(out)]) == 0
    assert sorted(p.name for p in datasets.iterdir()) == before
    res = json.loads(out.read_text())["lines"][megatron.core.__version__]
    assert res["megatron_core_path"] == str(datasets.parent)
    if mod.missing_helpers_makefile(datasets.parent):
        assert "will stop there" in capsys.readouterr().out


def test_the_memory_report_read_is_the_last_one():
    mod = _load()
    text = ("[Rank 0] (after 1 iterations) memory (MB) | allocated: 10.00 | max allocated: "
            "20.00 | reserved: 30.00 | max reserved: 40.00\n"
            "[Rank 0] (after 2 iterations) memory (MB) | allocated: 11.00 | max allocated: "
            "25.50 | reserved: 31.00 | max reserved: 45.00\n")
    assert mod.parse_memory(text) == {"max_allocated_mb": 25.5, "max_reserved_mb": 45.0}
    assert mod.parse_memory("no report") is None
