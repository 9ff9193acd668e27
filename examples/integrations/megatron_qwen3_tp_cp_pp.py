"""The paper's parallel layout (TP x CP x PP) of a Qwen3-style model, trained through
Megatron-Core with a kareus plan: a shrunk Qwen3 layer (per-head query/key RMSNorm, RMSNorm
eps 1e-6, grouped-query attention, SwiGLU, tied input/output embeddings) at tensor
parallelism 2, context parallelism 2 and two pipeline stages by default.

The script is ``megatron_gpt.py``'s (same config builder, Megatron DDP and Adam,
``get_forward_backward_func``) with what TP x CP x PP adds:

* ``initialize_model_parallel(tensor_model_parallel_size=..., context_parallel_size=...,
  pipeline_model_parallel_size=...)``; each stage builds its part of the ``GPTModel``
  (``pre_process`` on the first stage, ``post_process`` on the last; the tied output layer
  of the last stage is the first stage's embedding, as Megatron ties them);
* the data of each CP rank is cut by Megatron-Core's own ``get_batch_on_this_cp_rank``
  (each sequence in 2 x CP chunks, rank ``r`` holding chunks ``r`` and ``2 CP - 1 - r``):
  kareus's context-parallel layout is Megatron's;
* kareus (lines marked ``# kareus``): the workload read from the config (TP, CP, PP, the
  layer features), one plan made on the emulated H200 by the first rank and sent to the
  others, a ``PlanApplier`` per pipeline stage (``stage=``) on Megatron's TP and CP groups,
  the layer spec, ``chain_layers`` and the schedule wrapper around Megatron's 1F1B schedule.

Megatron-Core computes context-parallel attention only in Transformer Engine's attention,
which has no CPU path; so, to check the result, the script first trains the same model with
Megatron's own layers without context parallelism (the CP ranks become data-parallel
replicas fed the whole sequences: the same loss and gradients, CP being an exact split of
the sequence), then with kareus's layers at the requested layout, from the same weights, and
prints both losses per step (they agree to rounding).

On the CPU (gloo, fp32; ``--cpu`` installs ``kareus.integrations.megatron_cpu``, which
redirects Megatron's CUDA calls to the CPU in the process: never train with it)::

    torchrun --standalone --nproc_per_node 8 examples/integrations/megatron_qwen3_tp_cp_pp.py --cpu

On 8 GPUs (NCCL, bf16)::

    torchrun --standalone --nproc_per_node 8 examples/integrations/megatron_qwen3_tp_cp_pp.py

The world size must be ``tp x cp x pp`` (``--tp``, ``--cp``, ``--pp``; no data parallelism).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.utils import get_batch_on_this_cp_rank

_HERE = Path(__file__).resolve().parent
for _p in (_HERE, _HERE.parents[1]):  # megatron_gpt.py; kareus from a checkout
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import megatron_gpt as base  # noqa: E402  # the user's config builder and training loop

import kareus  # noqa: E402  # kareus
from kareus.exec.train import TorchParallelGroups  # noqa: E402  # kareus
from kareus.integrations import PlanApplier  # noqa: E402  # kareus
from kareus.integrations.megatron import (  # noqa: E402  # kareus
    chain_layers,
    kareus_layer_spec,
    workload_from_megatron,
    wrap_schedule,
)

#: The shrunk Qwen3 layer: Qwen3-1.7B's features at toy dimensions.
QWEN3 = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, ffn_hidden_size=128, qk_layernorm=True, layernorm_epsilon=1e-6)


def build_stage(config, layer_spec, seq_len, device):
    """This pipeline stage's part of the GPTModel, the output layer tied to the embedding."""
    return GPTModel(config, transformer_layer_spec=layer_spec, vocab_size=base.VOCAB,
                    max_sequence_length=seq_len, position_embedding_type="rope",
                    rotary_base=base.ROTARY_BASE, share_embeddings_and_output_weights=True,
                    parallel_output=True,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage()).to(device)


def shared_plan(wl, plan_path):
    """One plan for every rank: loaded, or made on the emulated H200 by rank 0 and sent."""
    if plan_path is not None:
        return kareus.Plan.load(plan_path)  # kareus
    box = [kareus.optimize(wl, "h200-sxm", budget=8, seed=0,  # kareus
                           progress=False).select().to_json()
           if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return kareus.Plan.from_json(box[0])  # kareus


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--plan", type=Path, help="a kareus plan for this model (default: make one "
                    "on the emulated H200)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu", action="store_true",
                    help="run on the CPU (gloo, fp32) through kareus.integrations.megatron_cpu")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo" if args.cpu else "nccl", timeout=timedelta(minutes=5))
    tp, cp, pp = args.tp, args.cp, args.pp
    if dist.get_world_size() != tp * cp * pp:
        raise SystemExit(f"run {tp * cp * pp} processes (tp x cp x pp), not "
                         f"{dist.get_world_size()}")
    if args.cpu:
        torch.set_num_threads(1)
        device, dtype = "cpu", torch.float32
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device, dtype = "cuda", torch.bfloat16
    mbs, seq, microbatches = 2, 32, 4
    fields = dict(QWEN3, pipeline_model_parallel_size=pp, pipeline_dtype=dtype)

    g = torch.Generator().manual_seed(7)  # every rank: the same whole sequences
    whole = []
    for _ in range(microbatches):
        tok = torch.randint(0, base.VOCAB, (mbs, seq + 1), generator=g).to(device)
        whole.append((tok[:, :-1], tok[:, 1:]))

    # The reference: Megatron's own layers without CP (the CP ranks are data-parallel
    # replicas on the whole sequences).
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    if args.cpu:
        from kareus.integrations import megatron_cpu

        megatron_cpu.install()  # after the model-parallel groups, before the model
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(0)
    own_config = base.make_config(tp, dtype, **fields)
    own_model = build_stage(own_config, get_gpt_layer_local_spec(
        normalization="RMSNorm", qk_layernorm=True), seq, device)
    initial = {k: v.clone() if torch.is_tensor(v) else v  # _extra_state: None
               for k, v in own_model.state_dict().items()}
    own = base.train(own_model, own_config, whole, steps=args.steps, seq_len=seq)
    parallel_state.destroy_model_parallel()

    # The job: TP x CP x PP, kareus's layers under a plan.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             context_parallel_size=cp,
                                             pipeline_model_parallel_size=pp)
    config = base.make_config(tp, dtype, **fields, context_parallel_size=cp)
    wl = workload_from_megatron(  # kareus: TP, CP, PP and the layer features from the config
        config, microbatch_size=mbs, seq_len=seq, num_microbatches=microbatches,  # kareus
        vocab_size=base.VOCAB, share_embeddings_and_output_weights=True)  # kareus
    plan = shared_plan(wl, args.plan)  # kareus
    applier = PlanApplier(  # kareus
        workload=wl, plan=plan, rope_base=base.ROTARY_BASE,  # kareus
        eps=config.layernorm_epsilon,  # kareus
        stage=parallel_state.get_pipeline_model_parallel_rank(),  # kareus: this stage's plan
        groups=TorchParallelGroups.from_groups(  # kareus: Megatron's own TP and CP groups
            tp=parallel_state.get_tensor_model_parallel_group(),  # kareus
            cp=parallel_state.get_context_parallel_group()))  # kareus
    batches = []  # this CP rank's chunks, cut by Megatron-Core
    for tok, lab in whole:
        part = get_batch_on_this_cp_rank({"tokens": tok.clone(), "labels": lab.clone()})
        batches.append((part["tokens"], part["labels"]))
    model = build_stage(config, kareus_layer_spec(applier), seq, device)  # kareus
    model.load_state_dict(initial)
    chain_layers(model)  # kareus: the stage's layers as one planned stack
    with wrap_schedule(applier):  # kareus: the plan's configuration per microbatch
        planned = base.train(model, config, batches, steps=args.steps, seq_len=seq)

    first_of_last_stage = (parallel_state.is_pipeline_last_stage()
                           and parallel_state.get_tensor_model_parallel_rank() == 0
                           and parallel_state.get_context_parallel_rank() == 0)
    if first_of_last_stage:
        print(f"TP={tp} x CP={cp} x PP={pp}, {'CPU, fp32' if args.cpu else 'GPU, bf16'}; "
              f"Qwen3-style layers; plan {plan.digest[:12]} ({plan.time_s * 1e3:.2f} "
              f"ms/iteration on {plan.gpu}, emulated unless measured)", flush=True)
        print("step  Megatron layers   kareus layers", flush=True)
        for i, (a, b) in enumerate(zip(own, planned, strict=True)):
            print(f"{i:>4}  {a:15.6f}   {b:13.6f}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
