"""What planned layers keep for their backward, in bytes, per recomputation policy, on the
CPU: counted as autograd sees it (every tensor the layer's node saves, through
``torch.autograd.graph.saved_tensors_hooks``, each storage once, the weights left out)
and compared with the memory model's figure for the workload
([`kept_activation_bytes`][kareus.model.memory.kept_activation_bytes]): none keeps more
than selective (the attention core's output and statistics), selective far more than full
(the layers' inputs); and autograd frees what a node kept once its backward has run,
even while the node itself lives on (a framework keeps the layer's output).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kareus.exec.train import LoopbackGroups
from kareus.integrations import PlanApplier
from kareus.model.memory import kept_activation_bytes
from kareus.model.workload import ModelArch, Parallelism, Workload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _reference import full_weights, planned_weights, shard

POLICIES = ("none", "selective", "full")


def _workload(policy: str, *, tp: int = 1, cp: int = 1, sp: bool = False,
              qk: bool = False) -> Workload:
    arch = ModelArch(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                     ffn=128, vocab=50, qk_norm=qk, norm_eps=1e-6 if qk else 1e-5)
    return Workload(model=arch, parallelism=Parallelism(tp=tp, cp=cp, sp=sp),
                    microbatch_size=2, seq_len=32, num_microbatches=1, nanobatches=1,
                    recompute=policy)


def _forward(wl: Workload, how: str, *, hook: bool = True):
    """Two layers (one stack, or two layer nodes) of rank 0's shard, bf16 on the CPU, under
    a hook that records every tensor saved for the backward. Returns ``(output, saved
    storages {pointer: bytes} without the weights', weak references to the saved tensors,
    input)``."""
    arch, p = wl.model, wl.parallelism
    applier = PlanApplier(workload=wl, groups=LoopbackGroups(tp=p.tp, cp=p.cp),
                          schedule="sequential", kernels="torch", eps=arch.norm_eps)
    params = [{k: v.to(torch.bfloat16) for k, v in
               shard(full_weights(arch, seed), arch, p.tp, 0).items()} for seed in (1, 2)]
    ws = [planned_weights(q, arch) for q in params]
    tokens = wl.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
    x = torch.randn(wl.microbatch_size, tokens, arch.hidden,
                    generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x.requires_grad_(True)
    storages: dict[int, int] = {}
    refs = []

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        refs.append(weakref.ref(t))
        return t

    hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hook
             else contextlib.nullcontext())
    with hooks:
        if how == "stack":
            y = applier.stack(2)(x, ws)
        else:
            y = x
            for w in ws:
                y = applier.layer()(y, w)
    weights = {w.untyped_storage().data_ptr() for lw in ws for w in lw.values()}
    return y, {k: b for k, b in storages.items() if k not in weights}, refs, x


LAYOUTS = [pytest.param({}, id="tp1"), pytest.param({"qk": True}, id="qk-norm"),
           pytest.param({"tp": 2}, id="tp2"), pytest.param({"tp": 2, "sp": True}, id="tp2-sp"),
           pytest.param({"cp": 2}, id="cp2"),
           pytest.param({"tp": 2, "cp": 2, "sp": True, "qk": True}, id="tp2-cp2-sp-qk")]


@pytest.mark.parametrize("how", ["stack", "layers"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_planned_layers_keep_is_what_the_memory_model_counts(layout, how):
    kept = {}
    for policy in POLICIES:
        wl = _workload(policy, **layout).with_(dtype_bytes=2)
        y, storages, _, x = _forward(wl, how)
        kept[policy] = sum(storages.values())
        want = kept_activation_bytes(wl, layers=2)
        if policy == "none" and wl.parallelism.cp > 1:
            # On the CPU a CP piece whose causal mask is not aligned to the upper left runs
            # SDPA's math backend through autograd, which keeps its probabilities and the
            # repeated keys and values beside what the flash op keeps on a GPU
            assert kept[policy] > want
        else:
            assert kept[policy] == want, (policy, kept[policy], want)
        y.float().square().mean().backward()  # and it runs
        assert x.grad is not None
    assert kept["none"] > kept["selective"] > kept["full"], kept
    wl = _workload("full", **layout)
    # full keeps the layers' inputs only (the first one the caller's own)
    tokens = wl.microbatch_size * wl.seq_len // wl.parallelism.cp
    shard_of = wl.parallelism.tp if wl.parallelism.sequence_parallel else 1
    assert kept["full"] == 2 * tokens * wl.model.hidden // shard_of * 2


@pytest.mark.parametrize("policy", POLICIES)
def test_selective_keeps_none_s_activations_less_the_attention_core_s(policy):
    """Per layer and token (TP = CP = 1): none - selective = the attention output and its
    log-sum-exp (fp32 per head); selective - full = everything else a layer keeps."""
    wl = _workload(policy)
    m = wl.model
    _, storages, _, _ = _forward(wl, "stack")
    tokens = wl.microbatch_size * wl.seq_len
    per_token_layer = sum(storages.values()) / tokens / 2
    hq, hkv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    selective = 2 * (4 * m.hidden + (hq + 2 * hkv) + (hq + hkv) + 3 * m.ffn)
    want = {"full": 2 * m.hidden, "selective": selective,
            "none": selective + 2 * hq + 4 * m.heads}[policy]
    assert per_token_layer == want


def _planned_nodes(y):
    """The planned layers' autograd nodes behind ``y``."""
    nodes, todo = [], [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        if hasattr(node, "kept_layout"):
            nodes.append(node)
        todo += [f for f, _ in node.next_functions]
    return nodes


@pytest.mark.parametrize("how", ["stack", "layers"])
@pytest.mark.parametrize("policy", POLICIES)
def test_what_a_node_kept_is_freed_by_its_backward_while_the_node_lives(policy, how):
    """A framework keeps a layer's output (and so its autograd node) past the backward
    (Megatron-Core's schedules keep a microbatch's output tensors until its backward is
    done; a user keeps the loss): what the node kept is freed by the backward, not when
    the node goes. (Without a saved-tensors hook here: a hook that returns the tensor
    itself ties an output saved by its own node into a cycle that nothing frees.)"""
    wl = _workload(policy)
    y, _, _, x = _forward(wl, how, hook=False)
    nodes = _planned_nodes(y)
    assert len(nodes) == (1 if how == "stack" else 2)
    refs = []
    for node in nodes:
        kept = node.saved_tensors[1 + node.weights:]  # after the input and the weights
        assert kept or policy == "full" and how == "layers"
        refs += [weakref.ref(t) for t in kept]
        del kept
    assert all(r() is not None for r in refs)
    y.float().square().mean().backward()
    gc.collect()
    assert not [r for r in refs if r() is not None]
    assert y.grad_fn is not None  # the node lives on
    # freed (retain_graph=True keeps them: tests/integrations/test_layer_graphs.py)
    with pytest.raises(RuntimeError, match="saved tensors"):
        _ = nodes[0].saved_tensors
