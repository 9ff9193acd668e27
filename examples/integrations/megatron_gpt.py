"""A Megatron-Core GPT training script with a kareus plan: the lines kareus adds.

The script is the user's: a ``TransformerConfig``, a ``GPTModel``, Megatron's
``DistributedDataParallel`` and optimizer, and ``get_forward_backward_func`` running the
microbatches of each iteration. kareus takes over each decoder layer's forward and backward
schedule (nanobatches, each collective at the plan's launch slot with the plan's SM count,
the plan's clock per microbatch computation); the data, the optimizer, DDP, the pipeline
schedule and the checkpoints stay Megatron's. The lines kareus adds are marked ``# kareus``:
a workload read from the config, a ``PlanApplier`` on Megatron's TP group, the layer spec,
``chain_layers`` (the decoder block's layers as one planned stack, so that each layer's last
forward collective overlaps the next layer) and the schedule wrapper around the training
loop.

Run it on GPUs (NCCL, bf16), one process per TP rank::

    torchrun --standalone --nproc_per_node 2 examples/integrations/megatron_gpt.py
    torchrun --standalone --nproc_per_node 2 examples/integrations/megatron_gpt.py --plan plan.json

or, to try it on a laptop, on the CPU (gloo, fp32) with ``--cpu``: Megatron-Core's training
path is CUDA-only, so ``--cpu`` first installs ``kareus.integrations.megatron_cpu``, which
redirects Megatron's CUDA calls to the CPU in the process (it patches torch; never train
with it)::

    torchrun --standalone --nproc_per_node 2 examples/integrations/megatron_gpt.py --cpu

Without ``--plan`` it makes one on the emulated H200 for this model's shapes (a few seconds,
CPU). It trains ``--steps`` iterations twice from the same weights, with Megatron's own
layers and with kareus's, and prints both losses per step; they agree to rounding.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run from a checkout without installing kareus
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast (NVLS)

import kareus  # noqa: E402  # kareus
from kareus.exec.train import TorchParallelGroups  # noqa: E402  # kareus
from kareus.integrations import PlanApplier  # noqa: E402  # kareus
from kareus.integrations.megatron import (  # noqa: E402  # kareus
    chain_layers,
    kareus_layer_spec,
    workload_from_megatron,
    wrap_schedule,
)

F = torch.nn.functional
ROTARY_BASE = 500000
VOCAB = 1024


def make_config(tp, dtype=torch.bfloat16, **fields):
    """The user's model: a small Llama-style GPT (RMSNorm, GQA, RoPE, SwiGLU, no biases);
    ``fields`` change any ``TransformerConfig`` field (a Qwen3-style layer:
    ``qk_layernorm=True, layernorm_epsilon=1e-6``)."""
    d = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
             ffn_hidden_size=512, normalization="RMSNorm", layernorm_epsilon=1e-5,
             gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
             add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
             bf16=dtype == torch.bfloat16, params_dtype=dtype, tensor_model_parallel_size=tp,
             sequence_parallel=False, use_cpu_initialization=True,
             gradient_accumulation_fusion=False, bias_activation_fusion=False,
             masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
             persist_layer_norm=False)
    d.update(fields)
    return TransformerConfig(**d)


def build_model(config, layer_spec, seq_len, device, *, tied=False):
    """A GPTModel with ``layer_spec``'s layers (``tied``: the output layer reuses the input
    embedding, ``share_embeddings_and_output_weights``)."""
    return GPTModel(config, transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                    max_sequence_length=seq_len, position_embedding_type="rope",
                    rotary_base=ROTARY_BASE, share_embeddings_and_output_weights=tied,
                    parallel_output=True).to(device)


def forward_step(data_iterator, model):
    """Megatron's forward step: the model's per-token loss and the function reducing it."""
    tokens, labels = next(data_iterator)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    loss = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        # The sum and the token count: Megatron divides one by the other (and by the
        # microbatches), and DDP averages the gradients over the data- and context-parallel
        # ranks, so each CP rank's mean over its chunks makes the whole sequences' mean. The
        # reported loss is that mean, over every CP rank's tokens.
        loss = output.float().sum()
        tokens = torch.tensor(output.numel(), device=output.device)
        report = torch.stack((loss.detach(), tokens.float()))
        if parallel_state.get_context_parallel_world_size() > 1:
            dist.all_reduce(report, group=parallel_state.get_context_parallel_group())
        return loss, tokens, {"loss": report[0] / report[1]}

    return loss, loss_func


def train(model, config, batches, *, steps, seq_len, applier=None):
    """``steps`` iterations (Megatron DDP, Megatron's Adam, its forward-backward schedule
    over ``batches``); the mean loss of each."""
    ddp = DistributedDataParallel(
        config=config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 overlap_grad_reduce=False,
                                                 use_distributed_optimizer=False))
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=config.bf16,
                        params_dtype=config.params_dtype, clip_grad=1.0,
                        use_distributed_optimizer=False), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    config.no_sync_func = ddp.no_sync
    forward_backward = get_forward_backward_func()
    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(batches),
                               model=[ddp], num_microbatches=len(batches), seq_length=seq_len,
                               micro_batch_size=batches[0][0].shape[0], forward_only=False)
        opt.step()
        # only the last pipeline stage sees the loss
        losses.append(sum(float(o["loss"]) for o in out) / len(out) if out else None)
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, help="a kareus plan for this model (default: make one "
                    "on the emulated H200)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cpu", action="store_true",
                    help="run on the CPU (gloo, fp32) through kareus.integrations.megatron_cpu")
    ap.add_argument("--schedule", choices=("kareus", "sequential", "nanobatching"),
                    default=None, help="the layers' schedule (default: kareus, the plan's; "
                    "on one GPU, TP=1, which has no collective to plan: nanobatching)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="replay the kareus layers from CUDA graphs (default: on a GPU; "
                    "--no-graphs: eager)")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo" if args.cpu else "nccl")
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    if args.cpu:
        from kareus.integrations import megatron_cpu

        megatron_cpu.install()  # after the model-parallel groups, before the model
        torch.manual_seed(1234)
        device, dtype = "cpu", torch.float32
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        device, dtype = "cuda", torch.bfloat16
    mbs, seq, microbatches = 4, 128, 4
    config = make_config(tp, dtype)

    # kareus: the workload the plan is made for, read from the config, and the plan
    wl = workload_from_megatron(config, microbatch_size=mbs, seq_len=seq,  # kareus
                                num_microbatches=microbatches, vocab_size=VOCAB)  # kareus
    schedule = args.schedule or ("kareus" if tp > 1 else "nanobatching")
    plan = None
    if schedule == "kareus" and args.plan is not None:  # kareus
        plan = kareus.Plan.load(args.plan)  # kareus
    elif schedule == "kareus":  # kareus: every rank makes the same plan (deterministic search)
        plan = kareus.optimize(wl, "h200-sxm", budget=8, seed=0, progress=False).select()
    applier = PlanApplier(  # kareus
        workload=wl, plan=plan, schedule=schedule, rope_base=ROTARY_BASE,  # kareus
        eps=config.layernorm_epsilon,  # kareus: the model's RMSNorm epsilon
        graphs=args.graphs,  # kareus: CUDA graphs around the layers (None: on a GPU)
        groups=TorchParallelGroups.from_groups(  # kareus
            tp=parallel_state.get_tensor_model_parallel_group()))  # kareus

    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(microbatches):
        tok = torch.randint(0, VOCAB, (mbs, seq + 1), generator=g).to(device)
        batches.append((tok[:, :-1], tok[:, 1:]))

    torch.manual_seed(0)
    own_model = build_model(config, get_gpt_layer_local_spec(normalization="RMSNorm"), seq,
                            device)
    initial = {k: v.clone() if torch.is_tensor(v) else v  # _extra_state: None
               for k, v in own_model.state_dict().items()}
    own = train(own_model, config, batches, steps=args.steps, seq_len=seq)

    model = build_model(config, kareus_layer_spec(applier), seq, device)  # kareus
    chain_layers(model)  # kareus: the block's layers as one stack (boundaries overlapped)
    model.load_state_dict(initial)
    with wrap_schedule(applier):  # kareus
        planned = train(model, config, batches, steps=args.steps, seq_len=seq)

    if dist.get_rank() == 0:
        print(f"TP={tp}, {'CPU, fp32' if args.cpu else 'GPU, bf16'}; kareus layers under the "
              f"{schedule} schedule{', graphed' if applier.graphs else ''}" + (
            "" if plan is None else f", plan {plan.digest[:12]} ({plan.time_s * 1e3:.2f} "
            f"ms/iteration on {plan.gpu}, emulated unless measured)"))
        print("step  Megatron layers   kareus layers")
        for i, (a, b) in enumerate(zip(own, planned, strict=True)):
            print(f"{i:>4}  {a:15.6f}   {b:13.6f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
