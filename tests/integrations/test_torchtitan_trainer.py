"""torchtitan 0.3's own Trainer with a kareus plan, against the same Trainer without one.

Two processes over gloo (kareus.testing.torchtitan_cpu: the Trainer on the CPU), torchtitan's
debug Llama 3 model (attention: torchtitan's causal SDPA, FlexAttention having no CPU
backward), TP = 2, fp32, torchtitan's defaults kept: sequence parallelism on, its per-op
selective activation checkpointing (kareus's layers run the plan's recomputation policy in
its place), the loader's packed documents (``positions`` restarting at each document: the
planned layers' RoPE at those positions; with torchtitan's stock FlexAttention, masked as
its block_causal masks them, under a plan made for them: ``document_tokens``), validation
on; two gradient-accumulation
microbatches per step. Each run is built from torchtitan's own command line; the run with a
plan gets one ``wrap_trainer(trainer, plan)`` call. Every microbatch loss, every gradient
norm and every validation loss equals torchtitan's own run to fp32 tolerance, with
``compile.enable`` too, under each of kareus's recomputation policies, and with the Trainer's
forward-backward wrapped as torchtitan wraps it for CUDA graphs on a GPU (a stand-in wrapper:
the plumbing; the capture itself is checked on a GPU by test_layer_graphs); and what is not
run as torchtitan runs it is refused by ``wrap_trainer``, before step 1, in one line naming
the setting.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from kareus.testing.torchtitan_cpu import trainer_runs_here

_WHY = trainer_runs_here()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"torchtitan's Trainer: {_WHY}")

#: The Trainer's command line of every run here (torchtitan's own flags).
BASE = ["--parallelism.tensor_parallel_degree", "2",
        "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--training.global_batch_size", "8", "--training.steps", "2",
        "--training.mixed_precision_param", "float32", "--debug.seed", "0",
        "--validator.enable", "--validator.freq", "1", "--validator.steps", "2",
        "--metrics.log_freq", "1"]

#: Activation checkpointing subcommands (tyro: last on the command line).
FULL_AC, NO_AC = "activation-checkpoint:full", "activation-checkpoint:none"

#: Refused by wrap_trainer, by the setting it names: (extra flags, sdpa override, words).
REFUSALS = {
    "selective_without_policy": ([], True, "selective_as"),
    "memory_budget_ac": (["--compile.enable", "activation-checkpoint:memory-budget"], True,
                         "activation_checkpoint is memory-budget"),
    "plan_for_flex_documents": ([FULL_AC], False, "document_tokens"),
    "cuda_graphs_plan_of_several_choices": ([], True, "training.disable_cuda_graphs"),
    "plan_for_chained_layers": ([], True, "wraps every block in FSDP (fully_shard"),
}


def _record(trainer) -> dict:
    """Wrap the Trainer's reporting: each microbatch's loss, each step's gradient norm and
    loss, each validation loss."""
    out: dict = {"mb_losses": [], "grad_norms": [], "losses": [], "val_losses": []}
    fb = trainer.forward_backward_step

    def forward_backward_step(**kw):
        loss = fb(**kw)
        out["mb_losses"].append(float(loss.detach()))
        return loss

    trainer.forward_backward_step = forward_backward_step
    mp = trainer.metrics_processor
    log, log_val = mp.log, mp.log_validation

    def record_log(step, loss, max_loss, grad_norm, **kw):
        out["losses"].append(float(loss))
        out["grad_norms"].append(float(grad_norm))
        return log(step, loss, max_loss, grad_norm, **kw)

    def record_val(loss, step):
        out["val_losses"].append(float(loss))
        return log_val(loss=loss, step=step)

    mp.log, mp.log_validation = record_log, record_val
    return out


class _StandInCapture:
    """What torchtitan's ``wrap_with_cuda_graph`` makes of the forward-backward on a GPU
    (on a CPU it returns the body itself): a wrapper, here calling through, recording the
    function it wraps."""

    wrapped: list = []

    def __init__(self, fn):
        self.fn = fn
        _StandInCapture.wrapped.append(fn)

    def __call__(self, *args):
        return self.fn(*args)


def _worker(out_dir: str, run: str, what: str) -> None:
    """One Trainer per process (torchtitan 0.3 builds one per process: a second one's
    fully_shard meets the first one's mesh). ``run``: ``torchtitan``, ``kareus`` or
    ``refuse``; ``what``: ``eager``, ``compile``, ``graphs`` (a stand-in step capture),
    ``eager-none`` / ``eager-full`` (torchtitan's AC none / full) or a key of REFUSALS."""
    import torch.distributed as dist
    import torchtitan.distributed.cudagraph as cudagraph

    from kareus.errors import KareusError
    from kareus.integrations.torchtitan import (
        workload_from_torchtitan_config,
        workload_from_trainer,
        wrap_trainer,
    )
    from kareus.testing import make_workload_plan
    from kareus.testing.torchtitan_cpu import cpu_trainer_config, use_cpu, write_cpu_assets

    use_cpu()
    torch.set_num_threads(1)
    out = Path(out_dir)
    assets = write_cpu_assets(out.parent / "assets")
    result: dict = {}
    if run == "refuse":
        flags, sdpa, _ = REFUSALS[what]
        trainer = cpu_trainer_config(assets, *BASE, *flags, sdpa=sdpa).build()
        plan = None
        if what == "plan_for_flex_documents":  # a plan costed for whole-sequence attention
            plan = make_workload_plan(workload_from_trainer(
                trainer, document_tokens=16).with_(document_tokens=None))
        if what == "plan_for_chained_layers":  # the Trainer's blocks never chain
            wl = workload_from_trainer(trainer, selective_as="selective")
            result["chained_layers"] = wl.chained_layers
            plan = make_workload_plan(wl.with_(chained_layers=True))
        if what == "cuda_graphs_plan_of_several_choices":
            trainer.fwd_bwd_fn = _StandInCapture(trainer._forward_backward_body)
            plan = make_workload_plan(workload_from_trainer(trainer, selective_as="selective"),
                                      freqs_mhz=(1980, 1410))
        try:
            wrap_trainer(trainer, plan, schedule=None if plan else "sequential")
            result["error"] = "accepted"
        except KareusError as e:
            result["error"] = str(e)
        result["step"] = trainer.step
        trainer.close()
    elif run == "documents":
        result = _documents(trainer_config=cpu_trainer_config(assets, *BASE, sdpa=False),
                            planned=what == "plan")
    else:
        ac = {"none": [NO_AC], "full": [FULL_AC]}.get(what.partition("-")[2], [])
        flags = (["--compile.enable"] if what == "compile" else []) + ac
        config = cpu_trainer_config(assets, *BASE, *flags)
        # what kareus optimize --torchtitan-args makes the plan for, from the config alone
        from_config = workload_from_torchtitan_config(config, world_size=2,
                                                      selective_as="selective")
        trainer = config.build()
        result = _record(trainer)
        graphs = what == "graphs"
        if graphs:  # the forward-backward wrapped as on a GPU with CUDA graphs on
            trainer.fwd_bwd_fn = _StandInCapture(trainer._forward_backward_body)
            cudagraph.wrap_with_cuda_graph = _StandInCapture
        applier = None
        if run == "kareus":
            wl = workload_from_trainer(trainer, selective_as="selective")
            # one choice per phase where one capture is replayed for every microbatch
            plan = (make_workload_plan(wl, pick=1, sms=8) if graphs else
                    make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410),
                                       unsplit_microbatches=(1,)))
            applier = wrap_trainer(trainer, plan, kernels="torch", record=True)
            result["workload"] = wl.to_dict()
            result["config_workload"] = from_config.to_dict()
            result["dtype_bytes"] = wl.dtype_bytes
            result["wrapped"] = [getattr(f, "__name__", "?") for f in _StandInCapture.wrapped]
        trainer.train()
        if applier is not None:
            result["partitions"] = [(ph, k) for ph, k, _ in applier.partitions_run]
        trainer.close()
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _documents(trainer_config, planned: bool = False) -> dict:
    """torchtitan's stock attention (FlexAttention, block_causal document masks): the
    model's forward on packed batches with and without kareus's layers (a baseline
    schedule), then training steps and validation under kareus (FlexAttention has no
    backward on a CPU: torchtitan alone cannot train here). ``planned``: the steps run
    under a plan made for the documents (``document_tokens``) instead of the baseline."""
    from kareus.integrations.torchtitan import workload_from_trainer, wrap_trainer
    from kareus.testing import make_workload_plan

    trainer = trainer_config.build()
    if planned:  # the Trainer's steps under a plan costed for 16-token documents
        wl = workload_from_trainer(trainer, selective_as="selective", document_tokens=16)
        result = _record(trainer)
        applier = wrap_trainer(trainer, make_workload_plan(wl, pick=1, sms=8),
                               kernels="torch", record=True)
        trainer.train()
        trainer.close()
        result["workload"] = wl.to_dict()
        result["partitions"] = [(ph, k) for ph, k, _ in applier.partitions_run]
        return result
    model = trainer.model_parts[0]
    it = iter(trainer.dataloader)
    batches = [next(it) for _ in range(2)]

    def logits() -> list:
        out = []
        for input_dict, labels in batches:
            inputs, _, extra = trainer.post_dataloading_process(dict(input_dict), labels)
            with torch.no_grad(), trainer.train_context():
                y = model(inputs, **extra)
            out.append((y.to_local() if hasattr(y, "to_local") else y).clone())
        return out

    want = logits()
    wrap_trainer(trainer, None, schedule="nanobatching", selective_as="selective",
                 kernels="torch")
    got = logits()
    result = _record(trainer)
    trainer.train()
    trainer.close()
    packed = [bool((b[0]["positions"][:, 1:] == 0).any()) for b in batches]
    result["packed"] = packed
    result["max_diff"] = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    result["scale"] = max(float(w.abs().max()) for w in want)
    return result


def _run(tmp_path, run, what):
    import subprocess

    here = Path(__file__).resolve().parent
    out = tmp_path / f"{run}-{what}"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{here.parents[1]}{os.pathsep}{here}",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", __file__, str(out), run, what]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_equal(tmp_path, what):
    want_ranks = _run(tmp_path, "torchtitan", what)
    got_ranks = _run(tmp_path, "kareus", what)
    recompute = {"none": "none", "full": "full"}.get(what.partition("-")[2], "selective")
    for want, got in zip(want_ranks, got_ranks, strict=True):
        assert len(want["mb_losses"]) == 4 and len(want["val_losses"]) == 2
        assert got["mb_losses"] == pytest.approx(want["mb_losses"], rel=1e-5, abs=1e-7)
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-7)
        assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)
        assert got["val_losses"] == pytest.approx(want["val_losses"], rel=1e-5)
        wl = got["workload"]
        assert got["config_workload"] == wl  # the config's workload is the Trainer's
        assert (wl["tp"], wl["sp"], wl["microbatch_size"], wl["seq_len"],
                wl["num_microbatches"], wl["recompute"]) == (2, True, 4, 64, 2, recompute)
        assert got["dtype_bytes"] == 4
        # every block is wrapped in FSDP: the layers run one by one, the plan is for that
        assert wl["chained_layers"] is False
        # the plan ran: its forward and backward partitions, the same on both ranks
        assert any(ph == "bwd" for ph, _ in got["partitions"])
        # SP's partition types: all-gathers and reduce-scatters, no all-reduce
        kinds = {k.rsplit("_", 1)[-1] for _, k in got["partitions"]}
        assert {"ag", "rs"} <= kinds and "ar" not in kinds
        if what == "graphs":  # kareus's steps went into torchtitan's capture wrapper
            assert got["wrapped"][-1] == "fwd_bwd"
    assert got_ranks[0]["partitions"] == got_ranks[1]["partitions"]


@pytest.mark.slow
def test_a_plan_in_torchtitan_s_trainer_with_its_defaults(tmp_path):
    _check_equal(tmp_path, "eager")


@pytest.mark.slow
def test_a_plan_in_torchtitan_s_compiled_trainer(tmp_path):
    _check_equal(tmp_path, "compile")


@pytest.mark.slow
def test_a_plan_in_torchtitan_s_step_capture(tmp_path):
    _check_equal(tmp_path, "graphs")


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "full"])
def test_a_plan_under_torchtitan_s_other_checkpointing(tmp_path, ac):
    _check_equal(tmp_path, f"eager-{ac}")


@pytest.mark.slow
def test_torchtitan_s_document_masks_in_planned_layers(tmp_path):
    # stock attention (FlexAttention, block_causal): the forward equals torchtitan's on
    # packed batches to fp32 tolerance, and the Trainer trains and validates under kareus
    for r in _run(tmp_path, "documents", "flex"):
        assert any(r["packed"])  # some batch packs documents
        assert r["max_diff"] <= 1e-5 * r["scale"], r
        assert len(r["mb_losses"]) == 4 and len(r["val_losses"]) == 2
        assert all(0 < v < 20 for v in r["mb_losses"] + r["val_losses"])


@pytest.mark.slow
def test_a_plan_for_torchtitan_s_document_masks(tmp_path):
    # a plan made for the stock attention's packed documents (document_tokens) trains as
    # the baseline schedule does: the same microbatch, step and validation losses
    base = _run(tmp_path, "documents", "flex")
    planned = _run(tmp_path, "documents", "plan")
    for want, got in zip(base, planned, strict=True):
        assert got["workload"]["document_tokens"] == 16
        assert any(ph == "bwd" for ph, _ in got["partitions"])
        assert got["mb_losses"] == pytest.approx(want["mb_losses"], rel=1e-5, abs=1e-7)
        assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=1e-4)
        assert got["val_losses"] == pytest.approx(want["val_losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_what_kareus_does_not_run_is_refused_before_step_1(tmp_path, name):
    for r in _run(tmp_path, "refuse", name):
        assert REFUSALS[name][2] in r["error"], r["error"]
        assert "\n" not in r["error"] and r["step"] == 0
        if name == "plan_for_chained_layers":
            assert r["chained_layers"] is False


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
