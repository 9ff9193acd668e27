"""kareus.integrations.megatron under Megatron-Core's 1F1B pipeline (CPU, gloo, PP=2 x TP=2).

Four processes (``initialize_model_parallel(tensor_model_parallel_size=2,
pipeline_model_parallel_size=2)``) with Megatron-Core redirected to the CPU
(``kareus.integrations.megatron_cpu``: for CPU runs and tests only, never for training);
each pipeline stage builds its part of a tiny GPTModel (``num_layers=4``: 2 layers per
stage, ``pre_process`` on the first stage, ``post_process`` on the last) and trains it
2 iterations of 4 microbatches with Megatron's DDP, Megatron's optimizer and
``get_forward_backward_func()`` (``forward_backward_pipelining_without_interleaving``):

* with Megatron's own layers (local spec);
* with kareus's layers (``kareus_layer_spec``) under ``wrap_schedule``, each stage's
  ``PlanApplier(stage=<pipeline rank>)`` applying a ``make_workload_plan`` plan of the PP=2
  workload (``workload_from_megatron(config)`` reads pp=2 from the config);
* the same with the block's layers chained (``chain_layers``: the stage's input tensor
  from the previous stage, the final norm on the last stage only);
* the unchained layers again with ``PlanApplier(start=False)``: ``wrap_schedule`` agrees on
  the plan when the schedule is entered (in the first microbatch scope, the first stage
  would wait in the digest exchange for a stage waiting for its output: a deadlock).

Each rank checks the losses (last stage), every parameter's DDP ``main_grad`` and weight
after the steps against Megatron's own layers (fp32), and that the (microbatch, phase)
scopes the wrapper entered, with the executor naming the stage, are Megatron's 1F1B order
of this stage (warm-up forwards, steady one-forward-one-backward, cool-down backwards),
which is also the order kareus's pipeline model plans (``get_schedule("1f1b")``). The
parent checks that the TP ranks of a stage ran the same partitions.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "integrations"

SEQ, MBS, MICROBATCHES, TP, PP, STEPS = 16, 2, 4, 2, 2, 2
DIMS = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=64)


def megatron_1f1b(stage: int, stages: int, microbatches: int) -> list[tuple[int, str]]:
    """Megatron-Core's non-interleaved 1F1B order of one stage
    (``forward_backward_pipelining_without_interleaving``): ``stages - stage - 1`` warm-up
    forwards, then forward ``i + warmup`` and backward ``i`` per steady step, then the
    remaining backwards."""
    warmup = min(stages - stage - 1, microbatches)
    order = [(i, "fwd") for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [(i + warmup, "fwd"), (i, "bwd")]
    return order + [(i, "bwd") for i in range(microbatches - warmup, microbatches)]


@pytest.mark.megatron_line
def test_megatron_s_1f1b_order_is_the_one_kareus_plans():
    from kareus.model.pipeline import get_schedule

    for stages, m in ((2, 4), (4, 4), (4, 2), (3, 5)):
        orders = get_schedule("1f1b", stages, m).stage_orders
        for s in range(stages):
            assert [(c.microbatch, c.phase) for c in orders[s]] == megatron_1f1b(s, stages, m)
    assert megatron_1f1b(0, 2, 4) == [(0, "fwd"), (1, "fwd"), (0, "bwd"), (2, "fwd"),
                                      (1, "bwd"), (3, "fwd"), (2, "bwd"), (3, "bwd")]


# ------------------------------------------------------------------ the worker (4 processes)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=what)


def _build(config, spec):
    """This stage's part of the example's GPTModel."""
    import megatron_gpt as ex
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config, transformer_layer_spec=spec, vocab_size=ex.VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope",
                    rotary_base=ex.ROTARY_BASE, share_embeddings_and_output_weights=False,
                    parallel_output=True,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def _train(model, config, batches):
    """The example's training loop (Megatron DDP and Adam, get_forward_backward_func) on a
    pipeline stage: the mean loss of each iteration on the last stage, ``None`` before."""
    import megatron_gpt as ex
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    forward_backward = get_forward_backward_func()
    assert forward_backward.__name__ == "forward_backward_pipelining_without_interleaving"
    assert forward_backward is schedules.forward_backward_pipelining_without_interleaving
    losses = ex.train(model, config, batches, steps=STEPS, seq_len=SEQ)
    last = parallel_state.is_pipeline_last_stage()
    assert all((loss is not None) == last for loss in losses)
    return losses


def _spy(applier, stage, scopes):
    """Log each (microbatch, phase) scope the wrapper enters, and check that inside it the
    executor names this stage's computation."""
    import contextlib

    enter = applier.microbatch

    @contextlib.contextmanager
    def spy(mb, phase):
        scopes.append((mb, phase))
        with enter(mb, phase):
            assert applier.executor.current == (stage, mb, phase), applier.executor.current
            yield

    applier.microbatch = spy  # type: ignore[method-assign]


def _worker(out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import schedules

    sys.path.insert(0, str(EXAMPLE))
    import megatron_gpt as ex

    from kareus.exec.executor import TorchExecutor
    from kareus.exec.train import TorchParallelGroups
    from kareus.integrations import PlanApplier, megatron_cpu
    from kareus.integrations.megatron import (
        chain_layers,
        kareus_layer_spec,
        workload_from_megatron,
        wrap_schedule,
    )
    from kareus.testing import make_workload_plan

    # a hang (a collective one stage calls and the other does not) fails in 3 minutes
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP,
                                             pipeline_model_parallel_size=PP)
    megatron_cpu.install()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    config = ex.make_config(TP, torch.float32, **DIMS, pipeline_model_parallel_size=PP,
                            pipeline_dtype=torch.float32)
    wl = workload_from_megatron(config, microbatch_size=MBS, seq_len=SEQ,
                                num_microbatches=MICROBATCHES, vocab_size=ex.VOCAB)
    assert (wl.parallelism.pp, wl.parallelism.tp, wl.model.layers) == (PP, TP, 4)
    plan = make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410))
    assert plan.num_stages == PP
    groups = TorchParallelGroups.from_groups(tp=parallel_state.get_tensor_model_parallel_group())

    g = torch.Generator().manual_seed(7)  # every rank: the same batches
    batches = []
    for _ in range(MICROBATCHES):
        tok = torch.randint(0, ex.VOCAB, (MBS, SEQ + 1), generator=g)
        batches.append((tok[:, :-1], tok[:, 1:]))

    torch.manual_seed(0)
    own_model = _build(config, get_gpt_layer_local_spec(normalization="RMSNorm"))
    assert len(own_model.decoder.layers) == DIMS["num_layers"] // PP
    initial = {k: v.clone() if torch.is_tensor(v) else v  # _extra_state: None
               for k, v in own_model.state_dict().items()}
    own = _train(own_model, config, batches)
    own_p = dict(own_model.named_parameters())

    out: dict = {"stage": stage, "own": own}
    want = megatron_1f1b(stage, PP, MICROBATCHES) * STEPS
    for variant in ("layers", "chained", "unstarted"):
        # unstarted: the applier agrees on the plan when the schedule is entered (every
        # rank enters it before any pipeline communication; in the first microbatch scope
        # a later stage would only reach it after receiving the first stage's output)
        applier = PlanApplier(workload=wl, groups=groups, plan=plan, kernels="torch",
                              rope_base=ex.ROTARY_BASE, record=True, stage=stage,
                              start=variant != "unstarted")
        assert isinstance(applier.executor, TorchExecutor)
        scopes: list = []
        _spy(applier, stage, scopes)
        model = _build(config, kareus_layer_spec(applier))
        model.load_state_dict(initial)
        if variant == "chained":
            chain_layers(model)
        original = schedules.forward_backward_pipelining_without_interleaving
        with wrap_schedule(applier):
            mine = _train(model, config, batches)
        assert schedules.forward_backward_pipelining_without_interleaving is original
        assert scopes == want, (variant, stage, scopes)
        if parallel_state.is_pipeline_last_stage():
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(own), rtol=1e-4,
                                       atol=1e-5)
        else:
            assert mine == own == [None] * STEPS
        my_p = dict(model.named_parameters())
        assert set(my_p) == set(own_p)
        for n, p in own_p.items():
            _close(my_p[n].main_grad, p.main_grad, f"{variant} stage {stage} main_grad {n}")
            _close(my_p[n].detach(), p.detach(), f"{variant} stage {stage} weight {n}")
        out[variant] = [(ph, k) for ph, k, _ in applier.partitions_run]
        out[variant + "_losses"] = mine
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.megatron_line
def test_kareus_layers_under_megatron_s_1f1b_pipeline_over_gloo(tmp_path):
    world = TP * PP
    from _ranks import run_ranks  # tests/integrations, on sys.path under pytest

    res = run_ranks(__file__, tmp_path, world)
    by_stage: dict = {}
    for r in res:
        by_stage.setdefault(r["stage"], []).append(r)
    assert sorted(by_stage) == list(range(PP)) and all(len(v) == TP for v in by_stage.values())
    for stage, ranks in by_stage.items():
        for key in ("layers", "chained", "unstarted"):
            # each layer's forward ran its planned partitions, the same on both TP ranks
            assert any(k.startswith("fwd_mlp") for _, k in ranks[0][key]), (stage, key)
            assert all(r[key] == ranks[0][key] for r in ranks), f"stage {stage} {key}"
    last = by_stage[PP - 1]
    assert all(r["own"] == last[0]["own"] and None not in r["own"] for r in last)


if __name__ == "__main__":
    _worker(sys.argv[1])
