"""examples/integrations/megatron_lm_pretrain.py (the GPU comparison of Megatron-LM's own
pretrain_gpt.py with Megatron's layers and with kareus's): its commands and its reading of
Megatron-LM's log (the GPU run itself needs CUDA and a Megatron-LM checkout)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
