"""kareus.integrations.megatron_args: the workload of a Megatron-LM job from its flags (no
torch, no Megatron), and ``kareus optimize --megatron-args`` making a plan that the
``layer_spec`` entry accepts from Megatron-LM's own parsed arguments."""

from __future__ import annotations

import argparse

import pytest

from kareus.errors import WorkloadError
from kareus.integrations.megatron_args import (
    MegatronArgsError,
    padded_vocab_size,
    parse_megatron_args,
    workload_from_megatron_args,
)

#: A Llama-style job as pretrain_gpt.py is started with (mock data, NullTokenizer).
JOB = ("pretrain_gpt.py --num-layers 4 --hidden-size 1024 --num-attention-heads 16 "
       "--group-query-attention --num-query-groups 8 --seq-length 1024 "
       "--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 64 "
       "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --swiglu "
       "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
       "--hidden-dropout 0 --attention-dropout 0 --bf16 --tokenizer-type NullTokenizer "
       "--vocab-size 32000 --mock-data --lr 3e-4 --min-lr 3e-5 --train-iters 20 "
       "--data-path 1 a.bin 2 b.bin --log-interval 1 --use-distributed-optimizer "
       "--transformer-impl local --spec kareus.integrations.megatron layer_spec")


def test_the_job_s_flags_make_megatron_s_workload():
    wl = workload_from_megatron_args(JOB, dp=2)
    m, p = wl.model, wl.parallelism
    # NullTokenizer: 32000 + 1 (its end-of-document token) padded to 128 x TP = 256
    assert m.vocab == 32256
    # --swiglu without --ffn-hidden-size: the multiple of 64 below 8/3 x hidden
    assert (m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn) == (1024, 16, 8, 64, 2688)
    assert (m.layers, m.tied_embeddings, m.qk_norm, m.norm_eps) == (4, True, False, 1e-5)
    assert (p.tp, p.pp, p.cp, p.dp) == (2, 2, 1, 2)
    # 64 sequences per iteration / (4 per microbatch x DP 2)
    assert (wl.microbatch_size, wl.seq_len, wl.num_microbatches) == (4, 1024, 8)
    assert wl.dtype_bytes == 2
    qwen3 = workload_from_megatron_args(JOB + " --qk-layernorm --norm-epsilon 1e-6 "
                                        "--untie-embeddings-and-output-weights", dp=2).model
    assert (qwen3.qk_norm, qwen3.norm_eps, qwen3.tied_embeddings) == (True, 1e-6, False)
    # the case: --vocab-size 32000 at TP=1 is 32128
    one = parse_megatron_args(JOB.replace("--tensor-model-parallel-size 2", ""))
    assert padded_vocab_size(one) == 32128
    assert padded_vocab_size(argparse.Namespace(padded_vocab_size=50304)) == 50304


def test_the_rank_layout_follows_the_mapping_flag():
    # Megatron-LM lays ranks out tp-cp-ep-dp-pp unless --use-tp-pp-dp-mapping is given.
    assert workload_from_megatron_args(JOB, dp=2).parallelism.rank_order == "tp-cp-ep-dp-pp"
    mapped = workload_from_megatron_args(JOB + " --use-tp-pp-dp-mapping", dp=2)
    assert mapped.parallelism.rank_order == "tp-cp-ep-pp-dp"
    assert mapped.parallelism.global_rank(pp=1) == 2  # the next stage of one replica


def test_the_docs_command_line_is_a_job_kareus_reads():
    """docs/integrations.md's pretrain_gpt.py flags: the workload its plan is made for."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    block = doc.split("<!-- megatron-lm-flags")[1]
    flags = re.search(r'FLAGS="(.*?)"', block, re.S).group(1)
    wl = workload_from_megatron_args(flags, dp=1)  # --gpus 2 at TP=2
    assert (wl.parallelism.tp, wl.num_microbatches, wl.model.vocab) == (2, 8, 32256)
    assert "--spec kareus.integrations.megatron layer_spec" in block


def test_flags_in_a_file_and_as_a_list(tmp_path):
    f = tmp_path / "job.sh"
    f.write_text("# the job\n" + JOB.replace(" --", " \\\n    --"), encoding="utf-8")
    assert workload_from_megatron_args(f"@{f}", dp=2) == workload_from_megatron_args(
        JOB.split(), dp=2)


@pytest.mark.parametrize(("drop", "add", "says"), [
    ("--hidden-dropout 0 --attention-dropout 0", "", "--hidden-dropout 0 --attention-dropout 0"),
    ("--swiglu", "", "--swiglu"),
    ("--disable-bias-linear", "", "--disable-bias-linear"),
    ("--normalization RMSNorm", "", "--normalization RMSNorm"),
    ("--position-embedding-type rope", "", "--position-embedding-type rope"),
    ("", "--use-rope-scaling", "--use-rope-scaling"),
    ("", "--overlap-param-gather", "--overlap-param-gather"),
    ("", "--num-layers-per-virtual-pipeline-stage 1", "virtual-pipeline"),
    ("", "--rampup-batch-size 16 16 1000", "--rampup-batch-size"),
    ("", "--some-new-flag 3", "does not read --some-new-flag"),
    ("--tokenizer-type NullTokenizer", "", "--padded-vocab-size"),
    ("--micro-batch-size 4", "", "--micro-batch-size"),
])
def test_what_kareus_does_not_compute_is_refused_by_its_flag(drop, add, says):
    flags = JOB.replace(drop, "") + " " + add
    with pytest.raises(MegatronArgsError, match=says.replace("-", "\\-")) as err:
        workload_from_megatron_args(flags, dp=2)
    assert "\n" not in str(err.value)


def test_a_layer_kareus_does_not_compute_is_refused_by_its_field():
    # experts with Megatron-LM's default all-gather dispatcher: named by its field
    with pytest.raises(WorkloadError, match="moe_token_dispatcher_type='alltoall'"):
        workload_from_megatron_args(JOB + " --num-experts 8", dp=2)
    with pytest.raises(MegatronArgsError, match="global-batch-size 64 is not a multiple"):
        workload_from_megatron_args(JOB, dp=3)


def test_the_same_job_as_a_model_file_is_the_same_model(tmp_path):
    """Megatron-LM's arguments as a --model-file give the architecture the flags give."""
    import json

    from kareus.model.files import load_model_file

    ns = parse_megatron_args(JOB)
    f = tmp_path / "args.json"
    f.write_text(json.dumps({k: v for k, v in vars(ns).items()}), encoding="utf-8")
    from_file = load_model_file(f)
    from_flags = workload_from_megatron_args(ns, dp=2).model
    assert from_file.to_dict() | {"name": "x"} == from_flags.to_dict() | {"name": "x"}


@pytest.mark.slow
def test_kareus_optimize_megatron_args_makes_the_plan_the_spec_accepts(tmp_path, capsys):
    """``kareus optimize --megatron-args`` (a small search), then the check the spec's
    applier runs, on the workload of Megatron-LM's own parsed arguments (what
    ``megatron.training.get_args()`` holds on 8 GPUs: DP 2, the padded vocabulary)."""
    from kareus.cli import main
    from kareus.compose.plan import Plan
    from kareus.exec.train import check_plan_workload

    small = JOB.replace("--seq-length 1024", "--seq-length 512")
    assert main(["optimize", "--megatron-args", small, "--gpus", "8", "--gpu", "h200-sxm",
                 "--budget", "6", "--out", str(tmp_path / "out"), "--quiet"]) == 0
    plan = Plan.load(tmp_path / "out" / "plan.json")
    megatron_lm = parse_megatron_args(small)
    megatron_lm.padded_vocab_size, megatron_lm.data_parallel_size = 32256, 2
    check_plan_workload(plan, workload_from_megatron_args(megatron_lm), one_stage=False)
    assert plan.workload["model"]["vocab"] == 32256
    # given beside --megatron-args, an option it replaces is refused, not ignored
    assert main(["optimize", "--megatron-args", small, "--tp", "4",
                 "--out", str(tmp_path / "o2")]) != 0
    assert "drop --tp" in capsys.readouterr().err


@pytest.mark.megatron_line
@pytest.mark.parametrize("extra", ["", " --qk-layernorm --norm-epsilon 1e-6 "
                                   "--untie-embeddings-and-output-weights --recompute-activations",
                                   # a mixture of experts, EP folded over TP (sequence parallel)
                                   " --sequence-parallel --num-experts 8 --moe-router-topk 2 "
                                   "--moe-ffn-hidden-size 512 --expert-model-parallel-size 2 "
                                   "--expert-tensor-parallel-size 1 --moe-router-dtype fp32 "
                                   "--moe-token-dispatcher-type alltoall --moe-permute-fusion "
                                   "--moe-layer-freq 1"])
def test_the_parser_agrees_with_megatron_lm_s_own(monkeypatch, extra):
    """kareus's parser against Megatron-LM's ``parse_args`` + ``validate_args`` (run when
    ``megatron.training`` is importable: a Megatron-LM checkout at ``core_v0.16.1`` or
    ``core_v0.15.x`` on ``PYTHONPATH``, with ``six`` and ``regex``): every attribute both have
    is equal, and the workloads of both namespaces are equal (``--norm-epsilon 1e-6`` read
    from either line's namespace)."""
    import contextlib
    import io
    import shlex
    import sys

    training_args = pytest.importorskip("megatron.training.arguments")
    import megatron.training.utils as training_utils

    for mod in (training_args, training_utils):  # validate_args asks the GPU's architecture
        monkeypatch.setattr(mod, "get_device_arch_version", lambda: 9, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    job = JOB.replace("--data-path 1 a.bin 2 b.bin", "") + extra  # one data source
    monkeypatch.setattr(sys, "argv", shlex.split(job))
    with contextlib.redirect_stdout(io.StringIO()):
        theirs = training_args.validate_args(training_args.parse_args(), {})
    mine = parse_megatron_args(job)
    # Megatron-LM core_v0.15.x stores two of the flags under other names (0.16 stores them
    # under the TransformerConfig field's): the same values, read by either name
    for new, old in (("layernorm_epsilon", "norm_epsilon"),
                     ("layernorm_zero_centered_gamma", "apply_layernorm_1p")):
        if not hasattr(theirs, new):
            assert getattr(theirs, old) == getattr(mine, new), old
    differ = {k: (getattr(theirs, k), v) for k, v in vars(mine).items()
              if hasattr(theirs, k) and getattr(theirs, k) != v}
    assert not differ
    renamed = {"layernorm_epsilon", "layernorm_zero_centered_gamma"} - set(vars(theirs))
    # validate_args deletes recompute_activations
    assert set(vars(mine)) - set(vars(theirs)) <= {"recompute_activations"} | renamed
    theirs.padded_vocab_size = 32256  # the tokenizer's build sets it: NullTokenizer 32001
    assert workload_from_megatron_args(theirs) == workload_from_megatron_args(
        job, dp=theirs.data_parallel_size)
