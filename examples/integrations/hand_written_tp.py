"""A hand-written tensor-parallel model trained with a kareus plan: the lines kareus adds.

The model below is the user's own: Llama-style blocks split over a TP group the way
Megatron-LM splits them (query/key/value and gate/up projections column-parallel, output and
down projections row-parallel, an all-reduce after each), with ``torch.nn`` modules, its
own AdamW and its own loop. kareus takes over each block's forward and backward schedule
(nanobatches, each collective at the plan's launch slot with the plan's SM count, the plan's
clock per microbatch computation); the weights, the optimizer, the data and everything
outside the blocks stay the user's. The blocks run as one ``PlannedStack``, so each block's
last collective overlaps the next block's first ops as the plan composes them (one
``PlannedLayer`` per block would run it exposed). The lines kareus adds are marked ``# kareus``.

Run it with one process per rank of the TP group, on the CPU (gloo) or on GPUs (NCCL)::

    torchrun --standalone --nproc_per_node 2 examples/integrations/hand_written_tp.py
    torchrun --standalone --nproc_per_node 2 examples/integrations/hand_written_tp.py --plan plan.json

Without ``--plan`` it makes one on the emulated H200 for this model's shapes (a few
seconds, CPU). It trains ``--steps`` iterations twice from the same weights, with the
model's own blocks and with kareus's, and prints both losses per step; they agree to
rounding (the same function, computed in another order).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run from a checkout without installing kareus
    sys.path.insert(0, str(_REPO))

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # never NVLink multicast (NVLS)

import kareus  # noqa: E402  # kareus
from kareus.exec.train import TorchParallelGroups  # noqa: E402  # kareus
from kareus.integrations import PlanApplier, linear, qkv_from_separate  # noqa: E402  # kareus

F = torch.nn.functional

# ------------------------------------------------------------------ the user's model


class _ToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (a column-parallel input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _FromTP(torch.autograd.Function):
    """All-reduce forward, identity backward (a row-parallel output)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _rope(x, base=500000.0):
    """Rotate halves of each head: x [batch, seq, heads, head_dim]."""
    s, d = x.shape[1], x.shape[3]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device).float() / d))
    ang = torch.outer(torch.arange(s, device=x.device).float(), inv)
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos()[None, :, None].to(x.dtype), ang.sin()[None, :, None].to(x.dtype)
    return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin


class Block(torch.nn.Module):
    """One Llama block, this rank's shard of it."""

    def __init__(self, dim, heads, kv_heads, ffn, tp, group):
        super().__init__()
        self.hd, self.group = dim // heads, group
        self.heads, self.kv_heads = heads // tp, kv_heads // tp
        self.attn_norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.wq = torch.nn.Linear(dim, self.heads * self.hd, bias=False)
        self.wk = torch.nn.Linear(dim, self.kv_heads * self.hd, bias=False)
        self.wv = torch.nn.Linear(dim, self.kv_heads * self.hd, bias=False)
        self.wo = torch.nn.Linear(self.heads * self.hd, dim, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.w1 = torch.nn.Linear(dim, ffn // tp, bias=False)
        self.w3 = torch.nn.Linear(dim, ffn // tp, bias=False)
        self.w2 = torch.nn.Linear(ffn // tp, dim, bias=False)

    def kareus_weights(self):  # kareus: this block's weights in kareus's layout (views)
        return {"w_attn_norm": self.attn_norm.weight,
                "Wqkv": qkv_from_separate(self.wq.weight, self.wk.weight, self.wv.weight,
                                          head_dim=self.hd),
                "Wo": linear(self.wo.weight), "w_mlp_norm": self.mlp_norm.weight,
                "Wg": linear(self.w1.weight), "Wu": linear(self.w3.weight),
                "Wd": linear(self.w2.weight)}

    def forward(self, x):
        b, s, _ = x.shape
        y = _ToTP.apply(self.attn_norm(x), self.group)
        q = _rope(self.wq(y).view(b, s, self.heads, self.hd))
        k = _rope(self.wk(y).view(b, s, self.kv_heads, self.hd))
        v = self.wv(y).view(b, s, self.kv_heads, self.hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, enable_gqa=True)
        x = x + _FromTP.apply(self.wo(o.transpose(1, 2).reshape(b, s, -1)), self.group)
        y = _ToTP.apply(self.mlp_norm(x), self.group)
        return x + _FromTP.apply(self.w2(F.silu(self.w1(y)) * self.w3(y)), self.group)


class Model(torch.nn.Module):
    """Embedding, blocks, final norm, LM head (embedding and head replicated)."""

    def __init__(self, *, vocab, dim, layers, heads, kv_heads, ffn, tp, group):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, kv_heads, ffn, tp, group)
                                          for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim, eps=1e-5)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.planned = None  # kareus: a PlannedStack, when kareus runs the blocks

    def forward(self, tokens):
        x = self.emb(tokens)
        if self.planned is not None:  # kareus: the blocks as one node, chained as planned
            x = self.planned(x, [blk.kareus_weights() for blk in self.blocks])  # kareus
        else:
            for blk in self.blocks:
                x = blk(x)
        return self.head(self.norm(x))


# ------------------------------------------------------------------ training


def train(model, batches, *, steps, applier=None):
    """``steps`` iterations of gradient accumulation over ``batches`` then AdamW; the
    losses. With ``applier``, each microbatch's forward and backward run inside its
    microbatch scope (the plan's configuration and clock of that computation)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scope = applier.microbatch if applier is not None else None  # kareus
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for mb, (tokens, labels) in enumerate(batches):
            with scope(mb, "fwd") if scope else nullcontext():  # kareus
                logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / len(batches)
            with scope(mb, "bwd") if scope else nullcontext():  # kareus
                loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", type=Path, help="a kareus plan for this model (default: make one "
                    "on the emulated H200)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tp, group = dist.get_world_size(), dist.new_group(list(range(dist.get_world_size())))
    dims = dict(vocab=1000, dim=256, layers=4, heads=8, kv_heads=4, ffn=512)
    mbs, seq, microbatches = 4, 128, 4

    # kareus: the workload the plan is made for (the model's dimensions and the batch)
    arch = kareus.ModelArch(name="my-llama", layers=dims["layers"], hidden=dims["dim"],
                            heads=dims["heads"], kv_heads=dims["kv_heads"],
                            head_dim=dims["dim"] // dims["heads"], ffn=dims["ffn"],
                            vocab=dims["vocab"])
    wl = kareus.Workload(model=arch, parallelism=kareus.Parallelism(tp=tp),
                         microbatch_size=mbs, seq_len=seq, num_microbatches=microbatches,
                         nanobatches=2)
    if args.plan is not None:
        plan = kareus.Plan.load(args.plan)
    else:  # every rank makes the same plan (deterministic search on the emulator)
        plan = kareus.optimize(wl, "h200-sxm", budget=8, seed=0, progress=False).select()

    torch.manual_seed(0)
    model = Model(tp=tp, group=group, **dims).to(device, dtype)
    for blk in model.blocks:  # each rank's shard from its own stream of random numbers
        g = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
        for p in (blk.wq, blk.wk, blk.wv, blk.wo, blk.w1, blk.w3, blk.w2):
            p.weight.data.copy_(torch.randn(p.weight.shape, generator=g) * 0.02)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator(device="cpu").manual_seed(7)
    batches = []
    for _ in range(microbatches):
        tok = torch.randint(0, dims["vocab"], (mbs, seq + 1), generator=g).to(device)
        batches.append((tok[:, :-1], tok[:, 1:]))

    own = train(model, batches, steps=args.steps)

    model.load_state_dict(initial)
    applier = PlanApplier(workload=wl, plan=plan,  # kareus
                          groups=TorchParallelGroups.from_groups(tp=group))  # kareus
    model.planned = applier.stack(len(model.blocks))  # kareus
    planned = train(model, batches, steps=args.steps, applier=applier)

    if dist.get_rank() == 0:
        print(f"TP={tp} on {'GPU, bf16' if cuda else 'CPU, fp32'}; plan {plan.digest[:12]} "
              f"({plan.time_s * 1e3:.2f} ms/iteration on {plan.gpu}, emulated unless measured)")
        print("step  own blocks   kareus blocks")
        for i, (a, b) in enumerate(zip(own, planned, strict=True)):
            print(f"{i:>4}  {a:10.6f}   {b:10.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
