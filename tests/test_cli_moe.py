"""``kareus optimize`` of a mixture-of-experts preset with expert parallelism (``--ep``):
the same five-row table as a dense model, emulated, and the one-line refusals."""

from __future__ import annotations

import json

import pytest

from kareus.cli import main

SYSTEMS = ("megatron", "nanobatching", "perseus", "nanobatching+perseus", "kareus")


def _moe(tmp_path, *extra):
    return ["optimize", "--workload", "qwen3-30b-a3b", "--gpu", "h200-sxm", "--tp", "1",
            "--pp", "1", "--dp", "8", "--ep", "8", "--microbatches", "2",
            "--microbatch-size", "2", "--seq-len", "1024", "--budget", "8",
            "--out", str(tmp_path / "out"), *extra]


def test_optimize_moe_preset_at_ep8_prints_the_five_systems(tmp_path, capsys):
    assert main(_moe(tmp_path, "--routing-imbalance", "1.25")) == 0
    out = capsys.readouterr().out
    # the table's rows: a system and its five figures
    rows = [line.split()[0] for line in out.splitlines()
            if len(line.split()) == 6 and line.split()[0] in SYSTEMS]
    assert rows == list(SYSTEMS)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    wl = results["workload"]
    assert wl["ep"] == 8 and wl["routing_imbalance"] == 1.25
    assert wl["model"]["moe"] == {"experts": 128, "experts_per_token": 8, "expert_ffn": 768}
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["workload"]["ep"] == 8
    planned = {t for choice in plan["choices"] for t in choice["configs"]}
    assert planned <= {"fwd_attn_moe_route", "fwd_moe_experts", "bwd_attn_moe_unpermute",
                       "bwd_moe_experts"}


@pytest.mark.parametrize("extra, needle", [
    (["--tp", "2"], "needs sequence parallelism (sp=True, --sp)"),
    (["--ep", "3"], "ep=3 must divide tp x cp x dp"),
    (["--routing-imbalance", "9"], "routing_imbalance must be a number in [1, ep] = [1, 8]"),
])
def test_moe_options_are_checked_in_one_line(tmp_path, capsys, extra, needle):
    argv = _moe(tmp_path)
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_ep_on_a_dense_model_is_refused(tmp_path, capsys):
    assert main(["optimize", "--workload", "qwen3-1.7b", "--tp", "2", "--dp", "2", "--ep", "2",
                 "--out", str(tmp_path / "out")]) == 2
    assert "ep=2 needs a mixture-of-experts model" in capsys.readouterr().err


def test_ep_beside_framework_flags_is_refused(tmp_path, capsys):
    assert main(["optimize", "--megatron-args", "--num-layers 2", "--ep", "2",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--megatron-args describes the model" in err and "--ep" in err


def test_workloads_lists_the_moe_presets_with_their_experts(capsys):
    assert main(["workloads"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("qwen3-30b-a3b"))
    assert "768 x128" in line and "MoE: 128 experts, top-8" in line and "30.53" in line
    assert "MoE" not in next(x for x in out.splitlines() if x.startswith("qwen3-1.7b"))


def test_optimize_plans_an_moe_job_from_megatron_lm_flags(tmp_path, capsys):
    # the workload of Megatron-LM's MoE flags is the preset's: planned and emulated the same
    flags = ("--num-layers 48 --hidden-size 2048 --num-attention-heads 32 "
             "--group-query-attention --num-query-groups 4 --kv-channels 128 "
             "--ffn-hidden-size 6144 --swiglu --disable-bias-linear --normalization RMSNorm "
             "--norm-epsilon 1e-6 --qk-layernorm --position-embedding-type rope "
             "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
             "--bf16 --seq-length 1024 --micro-batch-size 2 --global-batch-size 32 "
             "--padded-vocab-size 151936 --num-experts 128 --moe-router-topk 8 "
             "--moe-ffn-hidden-size 768 --expert-model-parallel-size 8 "
             "--moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-grouped-gemm")
    assert main(["optimize", "--megatron-args", flags, "--gpu", "h200-sxm", "--gpus", "8",
                 "--routing-imbalance", "1.25", "--budget", "8",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()
            if len(line.split()) == 6 and line.split()[0] in SYSTEMS]
    assert rows == list(SYSTEMS)
    wl = json.loads((tmp_path / "out" / "results.json").read_text())["workload"]
    assert wl["ep"] == 8 and wl["routing_imbalance"] == 1.25
    assert wl["model"]["moe"] == {"experts": 128, "experts_per_token": 8, "expert_ffn": 768}
