"""torchtitan's Llama 3 trained with a kareus plan: the lines kareus adds.

The model is torchtitan 0.3's own ``Llama3Model``, built from its config dataclasses and
tensor-parallelized with torchtitan's own sharding plan (``model.parallelize``); the loss
is torchtitan's vocab-parallel cross entropy, the optimizer plain AdamW. kareus takes over
each ``Llama3TransformerBlock``'s forward and backward schedule (nanobatches, each
collective at the plan's launch slot with the plan's SM count, the plan's clock per
microbatch computation); the weights stay torchtitan's parameters. ``apply_plan`` chains
the decoder's blocks into one stack by default, so each layer's last forward all-reduce
overlaps the next layer's first ops (``chain=False``: one planned layer per block). The
lines kareus adds are marked ``# kareus``.

With torchtitan's ``Trainer`` instead of this loop, all of it is one call after the
trainer is built (docs/integrations.md, "With torchtitan's Trainer: a recipe")::

    wl = workload_from_trainer(trainer)   # what the plan is made for
    wrap_trainer(trainer, "plan.json")    # checks it against wl, applies it

Run it with one process per TP rank, on GPUs (NCCL, bf16) or on the CPU (gloo, fp32)::

    torchrun --standalone --nproc_per_node 2 examples/integrations/torchtitan_llama3.py
    torchrun --standalone --nproc_per_node 2 examples/integrations/torchtitan_llama3.py --plan plan.json

Without ``--plan`` it makes one on the emulated H200 for this model's shapes (seconds, CPU).
It trains ``--steps`` iterations twice from the same weights, with torchtitan's blocks and
with kareus's, and prints both losses per step; they agree to rounding.

On the CPU: torchtitan 0.3 names its device ``"cuda"`` when it finds no accelerator
(``torchtitan.tools.utils.device_type``, read by ``ParallelDims.build_mesh``); the script
sets that documented module attribute to ``"cpu"`` before building the mesh, which is the
only change to torchtitan's state, and only without a GPU. Attention is SDPA (causal)
because torchtitan's default flex attention has no backward on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run from a checkout without installing kareus
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast (NVLS)

import kareus  # noqa: E402  # kareus
from kareus.integrations.torchtitan import apply_plan, workload_from_torchtitan  # noqa: E402  # kareus

DIM, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 4, 8, 4, 2048
MBS, SEQ, MICROBATCHES = 4, 128, 4


def model_config(tp: int, backend: str):
    """The user's torchtitan model config: a small Llama 3 with Llama 3.1's RoPE."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    layers = _build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=256),
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000.0,
                                scaling="llama"),
        attn_backend="flex")
    for lc in layers:  # causal SDPA (0.3 refuses the name "sdpa", not the module)
        lc.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB), layers=layers)
    parallelism = ParallelismConfig(tensor_parallel_degree=tp, enable_sequence_parallel=False,
                                    spmd_backend=backend)
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))  # the TP plan
    return cfg, parallelism


def train(model, batches, *, steps, context, applier=None):
    """``steps`` iterations of gradient accumulation over ``batches`` then AdamW."""
    from torchtitan.components.loss import cross_entropy_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for mb, (tokens, labels) in enumerate(batches):
            with context():
                with applier.microbatch(mb, "fwd") if applier else nullcontext():  # kareus
                    logits = model(tokens)
                loss = cross_entropy_loss(logits, labels, global_vocab_size=VOCAB)
                loss = loss / (labels.numel() * len(batches))
                with applier.microbatch(mb, "bwd") if applier else nullcontext():  # kareus
                    loss.backward()
            total += float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
        opt.step()
        losses.append(total)
    return losses



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, help="a kareus plan for this model (default: make one "
                    "on the emulated H200)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--spmd-backend", default="spmd_types",
                    choices=("spmd_types", "partial_dtensor"))
    ap.add_argument("--schedule", choices=("kareus", "sequential", "nanobatching"),
                    default=None, help="the blocks' schedule (default: kareus, the plan's; "
                    "on one GPU, TP=1, which has no collective to plan: nanobatching)")
    args = ap.parse_args(argv)

    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:  # torchtitan would name the device "cuda" (see the module docstring)
        import torchtitan.distributed.parallel_dims as tt_parallel_dims
        import torchtitan.tools.utils as tt_utils

        tt_parallel_dims.device_type = tt_utils.device_type = "cpu"
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"),
                                                                         torch.float32)
    tp = dist.get_world_size()
    dist_utils.set_spmd_backend(args.spmd_backend)
    cfg, parallelism = model_config(tp, args.spmd_backend)
    dims = ParallelDims.from_config(parallelism, world_size=tp)
    dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=dims)

    # kareus: the workload the plan is made for, read from the model's config
    wl = workload_from_torchtitan(cfg, tp=tp, microbatch_size=MBS, seq_len=SEQ,  # kareus
                                  num_microbatches=MICROBATCHES, name="tiny-llama3")  # kareus
    schedule = args.schedule or ("kareus" if tp > 1 else "nanobatching")
    plan = None
    if schedule == "kareus" and args.plan is not None:  # kareus
        plan = kareus.Plan.load(args.plan)  # kareus
    elif schedule == "kareus":  # kareus: every rank makes the same plan (deterministic search)
        plan = kareus.optimize(wl, "h200-sxm", budget=8, seed=0, progress=False).select()

    torch.manual_seed(0)
    with torch.device(device):
        base = cfg.build()
        base.init_states()
    for p in base.parameters():  # (not base.to(dtype): that casts the complex RoPE cache)
        p.data = p.data.to(dtype)
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(MICROBATCHES):
        tok = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g).to(device)
        batches.append((tok[:, :-1], tok[:, 1:]))

    results = {}
    for who in ("torchtitan", "kareus"):
        model = copy.deepcopy(base)
        with context():
            model.parallelize(dims)
        applier = None
        if who == "kareus":
            applier = apply_plan(model, workload=wl, mesh=dims, plan=plan,  # kareus
                                 schedule=schedule)  # kareus
        results[who] = train(model, batches, steps=args.steps, context=context,
                             applier=applier)

    if dist.get_rank() == 0:
        print(f"TP={tp} ({args.spmd_backend}) on {'GPU, bf16' if cuda else 'CPU, fp32'}; "
              f"kareus blocks under the {schedule} schedule" + (
                  "" if plan is None else f", plan {plan.digest[:12]} ({plan.time_s * 1e3:.2f} "
                  f"ms/iteration on {plan.gpu}, emulated unless measured)"))
        print("step  torchtitan   kareus")
        for i, (a, b) in enumerate(zip(results["torchtitan"], results["kareus"], strict=True)):
            print(f"{i:>4}  {a:10.6f}   {b:10.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
