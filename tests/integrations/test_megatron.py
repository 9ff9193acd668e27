"""kareus.integrations.megatron against Megatron-Core's own layers (CPU, gloo, TP=2), for a
Llama layer and for Qwen3's (``qk_layernorm=True``, ``layernorm_epsilon=1e-6``, tied
embeddings), each without recomputation (Megatron's default) and with Megatron's selective
recomputation (``core_attn``; kareus's layers then recompute their attention core), a
Llama layer under Megatron's full recomputation (kareus's layers chained: the stack
recomputes itself), and Qwen3's layer with ``sequence_parallel=True`` (the layers take and
return each rank's sequence shard ``[s / TP, b, h]``).

Megatron-Core's training path is CUDA-only (``device="cuda"`` factories, CUDA RNG
tracker, ``param.type()`` checks in the optimizer); the worker below installs a
process-local CPU shim (``_cpu_shim``: test harness only, never library code) and then:

* builds Megatron's own ``TransformerLayer``s (local spec) and kareus's layers
  (``kareus_layer_spec``) with the same weights, runs 2 layers x 2 microbatches under
  the schedules sequential, nanobatching and kareus (a plan from
  ``make_workload_plan(workload_from_megatron(config))``) and checks the outputs, the
  input gradients and every parameter's gradient against Megatron's (fp32, 1e-4);
* trains the example's GPTModel (``examples/integrations/megatron_gpt.py``: Megatron DDP,
  Megatron's optimizer, ``get_forward_backward_func``) with Megatron's layers and with
  kareus's under ``wrap_schedule``, and checks the losses, the DDP ``main_grad``s and the
  weights after two iterations, the (microbatch, phase) scopes the wrapper entered, and
  that it restored the schedule;

the parent checks that both ranks ran the same partitions.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "integrations"

SEQ, MBS, MICROBATCHES, TP = 16, 4, 2, 2
DIMS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=64)
#: The layer variants checked: a Llama layer, and Qwen3's (per-head query/key RMSNorm,
#: eps 1e-6, the output layer tied to the embedding), without recomputation (Megatron's
#: default: kareus's layers keep every activation); and both with Megatron's selective
#: recomputation of the attention core (kareus's re-runs its attention core in the backward).
_QWEN3 = {"qk_layernorm": True, "layernorm_epsilon": 1e-6}
_SELECTIVE = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
VARIANTS = {"llama": ({}, False),
            "qwen3": (_QWEN3, True),
            "llama-selective": (_SELECTIVE, False),
            "qwen3-selective": ({**_QWEN3, **_SELECTIVE}, True),
            # Megatron's full recomputation, every layer: kareus's layers chained
            "llama-full": ({"recompute_granularity": "full", "recompute_method": "uniform",
                            "recompute_num_layers": 1}, False),
            "qwen3-sp": ({**_QWEN3, "sequence_parallel": True}, True),
            # kareus's layers replayed from graphs of their own (the CPU stand-in graph of
            # test_layer_graphs, whose replays remake every tensor where the capture made
            # it): their outputs and gradients lent to autograd, Megatron DDP's hooks
            # adding them into main_grad; the example's training only. Under selective
            # recomputation: with "none" the stand-in's results differ from eager, before
            # lending as well (likely the CPU attention's kept autograd graph, which a
            # replay in place does not remake; see test_layer_graphs_lending)
            "llama-graphs": (_SELECTIVE, False)}


def _plan(wl, **kw):
    """The test plan (synthetic: every type at its second slot, 8 SMs)."""
    from kareus.testing import make_workload_plan

    return make_workload_plan(wl, pick=1, sms=8, freqs_mhz=(1980, 1410), **kw)


def _shard(t, config):
    """``t`` ``[SEQ, ...]`` as this rank's input: its sequence shard under
    ``sequence_parallel`` (TP rank ``r``: positions ``[r SEQ/TP, (r+1) SEQ/TP)``, as
    Megatron-Core scatters), ``t`` itself otherwise."""
    if not config.sequence_parallel:
        return t
    from megatron.core import parallel_state

    r, n = SEQ // TP, parallel_state.get_tensor_model_parallel_rank()
    return t[n * r:(n + 1) * r].contiguous()



@pytest.mark.megatron_line
def test_the_module_checks_megatron_s_version(monkeypatch):
    from kareus.integrations import megatron as km

    assert km.check_megatron_version() == km.MEGATRON_VERSION
    monkeypatch.delenv(km.UNTESTED_ENV, raising=False)
    # the two tested lines pass; the next one, the previous one and a non-version do not
    for tested in ("0.15.0", "0.15.3", "0.16.0", "0.16.1"):
        assert km.check_megatron_version(tested) == tested
    with pytest.raises(km.MegatronVersionError, match=r"megatron-core >=0\.15\.0,<0\.17\.0"):
        km.check_megatron_version("0.17.1")
    for untested in ("0.20.0", "0.14.0", "0.15.0rc7", "main"):
        with pytest.raises(km.MegatronVersionError):
            km.check_megatron_version(untested)
    with pytest.raises(ImportError):  # an ImportError too: the module does not import
        km.check_megatron_version("0.12.0")
    try:  # one line: a user reads it as it is
        km.check_megatron_version("0.17.1")
    except km.MegatronVersionError as exc:
        assert "\n" not in str(exc)
    monkeypatch.setenv(km.UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match="0.17.1"):
        assert km.check_megatron_version("0.17.1") == "0.17.1"


@pytest.mark.megatron_line
def test_the_spec_refuses_what_is_not_an_applier():
    from kareus.errors import ArgumentTypeError
    from kareus.integrations.megatron import KareusTransformerLayer, kareus_layer_spec

    spec = kareus_layer_spec(None)
    assert spec.module is KareusTransformerLayer and spec.params == {"applier": None}
    with pytest.raises(ArgumentTypeError, match="PlanApplier"):
        kareus_layer_spec(object())  # type: ignore[arg-type]


# ------------------------------------------------------------------ several processes, gloo


def _cpu_shim() -> None:
    """Megatron-Core's CUDA-only calls redirected to the CPU in this process
    (kareus.integrations.megatron_cpu, what the example's --cpu installs)."""
    from kareus.integrations import megatron_cpu

    megatron_cpu.install()


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=what)


def _own_spec(config):
    """Megatron's own layer: the local spec; under ``sequence_parallel`` with norms that
    take it (the local spec's refuse it; Transformer Engine's ``TENorm`` would be the norm
    of a GPU job), kareus's ``SequenceParallelRMSNorm`` (torch's RMSNorm, the weight marked
    for Megatron's TP gradient sum)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from kareus.integrations.megatron import SequenceParallelRMSNorm

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    if not config.sequence_parallel:
        return spec
    sub, att = spec.submodules, spec.submodules.self_attention
    norm = SequenceParallelRMSNorm
    if config.qk_layernorm:
        att = ModuleSpec(module=att.module, params=att.params, submodules=dataclasses.replace(
            att.submodules, q_layernorm=norm, k_layernorm=norm))
    return ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(
        sub, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=att))


def _model_spec(config, layer_spec):
    """What GPTModel takes as its layers: the layer spec, or under ``sequence_parallel`` the
    block's submodules with a final norm that takes it."""
    if not config.sequence_parallel:
        return layer_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from kareus.integrations.megatron import SequenceParallelRMSNorm

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * config.num_layers,
                                      layer_norm=SequenceParallelRMSNorm)


def _batches():
    """The example's training batches (seed 7): ``MICROBATCHES`` of ``MBS`` sequences of
    ``SEQ`` tokens and their next tokens."""
    import megatron_gpt as ex

    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(MICROBATCHES):
        tok = torch.randint(0, ex.VOCAB, (MBS, SEQ + 1), generator=g)
        batches.append((tok[:, :-1], tok[:, 1:]))
    return batches


def _own_training(config, spec, batches, steps, tied=False):
    """The example's GPTModel with ``spec``'s layers (Megatron's own; built at seed 0) trained
    ``steps`` iterations: the model, its state before training and the losses."""
    import megatron_gpt as ex

    torch.manual_seed(0)
    own_model = ex.build_model(config, spec, SEQ, "cpu", tied=tied)
    initial = {k: v.clone() if torch.is_tensor(v) else v  # _extra_state: None
               for k, v in own_model.state_dict().items()}
    return own_model, initial, ex.train(own_model, config, batches, steps=steps, seq_len=SEQ)


def _gpt_applier(config, wl, groups, plan, **kw):
    """The example's training's applier: the plan, the CPU kernels, the example's RoPE base
    and the config's norm epsilon (``kw``: the other arguments)."""
    import megatron_gpt as ex

    from kareus.integrations import PlanApplier

    return PlanApplier(workload=wl, groups=groups, plan=plan, kernels="torch",
                       rope_base=ex.ROTARY_BASE, eps=config.layernorm_epsilon, **kw)


def _kareus_model(config, applier, initial, tied=False):
    """The example's GPTModel with kareus's layers (``applier``'s), in ``initial`` state."""
    import megatron_gpt as ex

    from kareus.integrations.megatron import kareus_layer_spec

    model = ex.build_model(config, _model_spec(config, kareus_layer_spec(applier)), SEQ, "cpu",
                           tied=tied)
    model.load_state_dict(initial)
    return model


def _trained_alike(model, mine, own_model, own, what):
    """kareus's training (``model``, losses ``mine``) went as Megatron's own: the losses, and
    after it every parameter's DDP ``main_grad`` and weight (fp32, 1e-4)."""
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(own), rtol=1e-4, atol=1e-5)
    own_p, my_p = dict(own_model.named_parameters()), dict(model.named_parameters())
    for n, p in own_p.items():
        _close(my_p[n].main_grad, p.main_grad, f"{what}main_grad {n}")
        _close(my_p[n].detach(), p.detach(), f"{what}weight {n}")


def _layers_match(config, wl, groups, emb, out):
    """Megatron's layers and kareus's, same weights, every schedule."""
    from megatron.core.transformer.spec_utils import build_module

    from kareus.integrations import PlanApplier
    from kareus.integrations.megatron import kareus_layer_spec

    torch.manual_seed(1)  # every rank builds the same full weights and keeps its shard
    spec = _own_spec(config)
    own = [build_module(spec, config=config, layer_number=i + 1)
           for i in range(config.num_layers)]
    with torch.no_grad():
        for lay in own:  # norms away from 1, so that their gradients are checked
            norms = [lay.input_layernorm, lay.pre_mlp_layernorm]
            if config.qk_layernorm:
                norms += [lay.self_attention.q_layernorm, lay.self_attention.k_layernorm]
            for norm in norms:  # the same on every TP rank (replicated)
                norm.weight.add_(0.1 * torch.randn(norm.weight.shape))

    def run(layers, applier=None):
        outs = []
        for mb in range(MICROBATCHES):
            g = torch.Generator().manual_seed(100 + mb)
            x = _shard(torch.randn(SEQ, MBS, config.hidden_size, generator=g),
                       config).requires_grad_(True)
            c = _shard(torch.randn(SEQ, MBS, config.hidden_size, generator=g), config)
            with applier.microbatch(mb, "fwd") if applier else nullcontext():
                y = x
                for lay in layers:
                    y, ctx = lay(hidden_states=y, attention_mask=None, rotary_pos_emb=emb)
                    assert ctx is None and y.shape == x.shape
            with applier.microbatch(mb, "bwd") if applier else nullcontext():
                (y * c).sum().backward()
            outs.append((y.detach(), x.grad.clone()))
        return outs, [{n: p.grad.clone() for n, p in lay.named_parameters()} for lay in layers]

    want_outs, want_grads = run(own)
    plan = _plan(wl, unsplit_microbatches=(1,))
    for schedule in ("sequential", "nanobatching", "kareus"):
        applier = PlanApplier(workload=wl, groups=groups, schedule=schedule,
                              plan=plan if schedule == "kareus" else None, kernels="torch",
                              rope_base=500000, eps=config.layernorm_epsilon, record=True)
        mine = [build_module(kareus_layer_spec(applier), config=config, layer_number=i + 1)
                for i in range(config.num_layers)]
        for m, o in zip(mine, own, strict=True):
            m.load_state_dict(o.state_dict())
        assert [n for n, _ in mine[0].named_parameters()] == [
            n for n, _ in own[0].named_parameters()]
        assert ("self_attention.q_layernorm.weight" in dict(own[0].named_parameters())
                ) == config.qk_layernorm
        outs, grads = run(mine, applier if schedule == "kareus" else None)
        for (y, dx), (wy, wdx) in zip(outs, want_outs, strict=True):
            _close(y, wy, f"{schedule} output")
            _close(dx, wdx, f"{schedule} input gradient")
        for i, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
            assert set(g) == set(w)
            for n in w:
                _close(g[n], w[n], f"{schedule} layer {i} {n}")
        out[schedule] = [(ph, k) for ph, k, _ in applier.partitions_run]
    _layer_refusals(mine[0], emb, config)


def _layer_refusals(lay, emb, config):
    """What a kareus layer does not compute is refused, typed, in one line."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from kareus.errors import ArgumentError, WorkloadError
    from kareus.integrations import PlanApplier
    from kareus.integrations.megatron import workload_from_megatron

    applier = lay.kareus_applier
    x = _shard(torch.randn(SEQ, MBS, config.hidden_size), config)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad(), applier.microbatch(0, "fwd"):
        lay(hidden_states=x, attention_mask=causal, rotary_pos_emb=emb)  # the causal mask
        for kw, match in (({"packed_seq_params": object()}, "packed_seq_params"),
                          ({"inference_context": object()}, "inference_context"),
                          ({"attention_mask": ~causal}, "causal"),
                          ({"rotary_pos_emb": None}, "position_embedding_type='rope'")):
            args = {"hidden_states": x, "attention_mask": None, "rotary_pos_emb": emb, **kw}
            with pytest.raises(ArgumentError, match=match):
                lay(**args)
        other = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                                rotary_base=10000)(SEQ + 2)[2:]
        lay._rope_checked.clear()
        with pytest.raises(ArgumentError, match="rope_base"):
            lay(hidden_states=x, attention_mask=None, rotary_pos_emb=other)
        # A forward hook on a module whose weight kareus reads would not run (Megatron DDP's
        # overlap_param_gather gathers parameters there): refused
        handle = lay.mlp.linear_fc1.register_forward_pre_hook(lambda *a: None)
        with pytest.raises(ArgumentError, match="overlap_param_gather"):
            lay(hidden_states=x, attention_mask=None, rotary_pos_emb=emb)
        handle.remove()
    wl = workload_from_megatron(config, microbatch_size=MBS, seq_len=SEQ,
                                num_microbatches=MICROBATCHES, vocab_size=64)
    eps = config.layernorm_epsilon
    # The layer checks its own config against the workload's model, whatever made it
    for change, match in (({"ffn": 128}, "ffn_hidden_size=64, the workload's model ffn=128"),
                          ({"qk_norm": not config.qk_layernorm}, "qk_layernorm="),
                          ({"norm_eps": eps * 10}, "layernorm_epsilon=")):
        wrong = wl.with_(model=wl.model.__class__(**{**wl.model.to_dict(), **change}))
        with pytest.raises(WorkloadError, match=match) as err:
            lay.set_applier(PlanApplier(workload=wrong, groups=applier.groups, kernels="torch",
                                        eps=wrong.model.norm_eps))
        assert "\n" not in str(err.value)
    # ... and packed documents, which the Megatron-Core layer does not mask
    with pytest.raises(WorkloadError, match="document_tokens=") as err:
        # (refused by the workload itself where the cost model does not model them: CP > 1)
        docs = wl.with_(document_tokens=SEQ // 2)
        lay.set_applier(PlanApplier(workload=docs, groups=applier.groups, kernels="torch",
                                    eps=docs.model.norm_eps))
    assert "\n" not in str(err.value)
    # ... and its layout: sequence-sharded hidden states or whole ones
    other = wl.with_(parallelism=attrs.evolve(wl.parallelism, sp=not wl.parallelism.sp))
    want = f"sequence_parallel={config.sequence_parallel}"
    with pytest.raises(WorkloadError, match=want) as err:
        lay.set_applier(PlanApplier(workload=other, groups=applier.groups, kernels="torch",
                                    eps=other.model.norm_eps))
    assert "\n" not in str(err.value)
    lay.set_applier(None)  # Megatron's own forward
    with torch.no_grad():
        y, _ = lay(hidden_states=x, attention_mask=None, rotary_pos_emb=emb)
    lay.set_applier(applier)
    with torch.no_grad(), applier.microbatch(0, "fwd"):
        _close(lay(hidden_states=x, attention_mask=None, rotary_pos_emb=emb)[0], y, "own")


def _gpt_matches(config, wl, groups, out, tied):
    """The example's training (GPTModel, DDP, optimizer, get_forward_backward_func), with
    Megatron's layers and with kareus's under wrap_schedule."""
    import megatron_gpt as ex
    from megatron.core.pipeline_parallel import schedules

    from kareus.integrations.megatron import wrap_schedule

    batches = _batches()
    own_model, initial, own = _own_training(config, _model_spec(config, _own_spec(config)),
                                            batches, 2, tied)
    plan = _plan(wl)
    applier = _gpt_applier(config, wl, groups, plan, record=True)
    scopes = []
    enter = applier.microbatch

    def spy(mb, phase):
        scopes.append((mb, phase))
        return enter(mb, phase)

    applier.microbatch = spy  # type: ignore[method-assign]
    model = _kareus_model(config, applier, initial, tied)
    originals = (schedules.forward_step, schedules.backward_step,
                 schedules.forward_backward_no_pipelining)
    with wrap_schedule(applier):
        assert schedules.forward_step is not originals[0]
        mine = ex.train(model, config, batches, steps=2, seq_len=SEQ)
    assert (schedules.forward_step, schedules.backward_step,
            schedules.forward_backward_no_pipelining) == originals
    assert scopes == [(m, ph) for _ in range(2) for m in range(MICROBATCHES)
                      for ph in ("fwd", "bwd")], scopes
    assert set(dict(own_model.named_parameters())) == set(dict(model.named_parameters()))
    _trained_alike(model, mine, own_model, own, "")
    out["gpt"] = [(ph, k) for ph, k, _ in applier.partitions_run]
    out["losses"] = mine
    out["exposed"] = {"layers": _exposed_per_forward(applier)}
    _chained_gpt_matches(config, wl, groups, plan, initial, batches, own_model, own, out, tied)

    # An exception inside the wrapper still restores the schedule.
    with pytest.raises(RuntimeError, match="boom"), wrap_schedule(applier):
        raise RuntimeError("boom")
    assert schedules.forward_step is originals[0]


def _exposed(partitions):
    """The exposed forward collectives: forward partitions launched at no slot
    (``launch_slot=None``: the collective runs after the ops beside it, if any; the last
    one of a computation has none, keyed by its partner type under a plan,
    ``"<kind>:tail"`` otherwise)."""
    return sum(ph == "fwd" and cfg.launch_slot is None for ph, _, cfg in partitions)


def _exposed_per_forward(applier):
    return _exposed(applier.partitions_run) / (2 * MICROBATCHES)  # 2 iterations


def _chained_gpt_matches(config, wl, groups, plan, initial, batches, own_model, own, out,
                         tied):
    """chain_layers: the same training, the block's layers as one PlannedStack; then
    unchain_layers restores Megatron's block forward."""
    import megatron_gpt as ex
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_block import TransformerBlock

    from kareus.errors import ArgumentError
    from kareus.integrations.megatron import chain_layers, unchain_layers, wrap_schedule

    with pytest.raises(ArgumentError, match="kareus_layer_spec"):
        chain_layers(own_model)  # Megatron's own layers
    applier = _gpt_applier(config, wl, groups, plan, record=True)
    model = _kareus_model(config, applier, initial, tied)
    block = model.decoder
    assert chain_layers(model) is model and "forward" in vars(block)
    chain_layers(model)  # again: no change
    with wrap_schedule(applier):
        mine = ex.train(model, config, batches, steps=2, seq_len=SEQ)
    _trained_alike(model, mine, own_model, own, "chained ")
    out["exposed"]["chained"] = _exposed_per_forward(applier)
    out["chained"] = [(ph, k) for ph, k, _ in applier.partitions_run]

    tok, _ = batches[0]
    pos = torch.arange(SEQ).expand_as(tok)
    del applier.partitions_run[:]
    with torch.no_grad(), applier.microbatch(0, "fwd"):
        chained = model(tok, pos, None)
        # anything but the plain call runs Megatron's block, whose kareus layers refuse it
        with pytest.raises(ArgumentError, match="packed_seq_params"):
            block(hidden_states=_shard(torch.zeros(SEQ, MBS, config.hidden_size), config),
                  attention_mask=None, packed_seq_params=PackedSeqParams())
    assert _exposed(applier.partitions_run) == 1
    # a layer's forward hook: the stack would skip it, so the block runs layer by layer
    hook = block.layers[0].register_forward_pre_hook(lambda module, args: None)
    del applier.partitions_run[:]
    with (torch.no_grad(), applier.microbatch(0, "fwd"),
          pytest.warns(UserWarning, match="forward hooks")):
        _close(model(tok, pos, None), chained, "logits, a layer hooked")
    assert _exposed(applier.partitions_run) == config.num_layers
    hook.remove()
    assert unchain_layers(model) is model and "forward" not in vars(block)
    assert block.forward.__func__ is TransformerBlock.forward
    unchain_layers(model)  # again: no change
    del applier.partitions_run[:]
    with torch.no_grad(), applier.microbatch(0, "fwd"):
        _close(model(tok, pos, None), chained, "unchained logits")
    assert _exposed(applier.partitions_run) == config.num_layers



def _full_recompute_matches(config, wl, groups, out):
    """Megatron's full recomputation (every layer, uniform units of one): its own model
    against kareus's layers chained (the kareus stack re-runs each layer itself, in place
    of Megatron's block checkpoint), two training steps: losses, main_grads and weights;
    unchained, a kareus layer refuses Megatron's block checkpoint."""
    import megatron_gpt as ex
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from kareus.errors import ArgumentError
    from kareus.integrations.megatron import chain_layers, unchain_layers, wrap_schedule

    assert wl.recompute == "full" and not config.sequence_parallel
    batches = _batches()
    own_model, initial, own = _own_training(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), batches, 2)
    applier = _gpt_applier(config, wl, groups, _plan(wl), record=True)
    model = _kareus_model(config, applier, initial)
    chain_layers(model)
    with wrap_schedule(applier):
        mine = ex.train(model, config, batches, steps=2, seq_len=SEQ)
    _trained_alike(model, mine, own_model, own, "full ")
    out["gpt"] = out["chained"] = [(ph, k) for ph, k, _ in applier.partitions_run]
    out["losses"] = mine
    unchain_layers(model)
    with pytest.raises(ArgumentError, match="chain_layers"), wrap_schedule(applier):
        ex.train(model, config, batches, steps=1, seq_len=SEQ)


def _gpt_graphs_match(config, wl, groups, out, tied):
    """The example's training (Megatron DDP with its main_grad hooks, the optimizer,
    get_forward_backward_func) with kareus's layers on graphs of their own: losses,
    main_grads and weights as with Megatron's layers."""
    import megatron_gpt as ex
    from test_layer_graphs import RerunExecutor

    from kareus.exec.collectives import ProcessGroupCollective
    from kareus.exec.train import GroupedCollective
    from kareus.integrations.megatron import wrap_schedule

    batches = _batches()
    own_model, initial, own = _own_training(config, _model_spec(config, _own_spec(config)),
                                            batches, 3, tied)
    plan = _plan(wl)
    gloo = GroupedCollective(tp=ProcessGroupCollective(group=groups.group("tp")), cp=None)
    applier = _gpt_applier(
        config, wl, groups, plan, graphs=True,
        executor=RerunExecutor(collective=gloo, default_collective=gloo, plan=plan),
        baseline=RerunExecutor(collective=gloo, default_collective=gloo))
    model = _kareus_model(config, applier, initial, tied)
    with wrap_schedule(applier):
        mine = ex.train(model, config, batches, steps=3, seq_len=SEQ)
    runner = applier._runner
    assert runner is not None and runner.captures > 0
    assert any(cap.lends for cap in runner._graphs.values())
    _trained_alike(model, mine, own_model, own, "graphed ")
    out["losses"] = mine
    out["graphs"] = applier.graph_memory().graphs


def _worker(out_dir: str, variant: str) -> None:
    import megatron.core
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    sys.path.insert(0, str(EXAMPLE))
    import megatron_gpt as ex

    from kareus.exec.train import TorchParallelGroups
    from kareus.integrations.megatron import workload_from_megatron

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    _cpu_shim()
    fields, tied = VARIANTS[variant]
    config = ex.make_config(TP, torch.float32, **DIMS, **fields)
    wl = workload_from_megatron(config, microbatch_size=MBS, seq_len=SEQ,
                                num_microbatches=MICROBATCHES, vocab_size=ex.VOCAB,
                                share_embeddings_and_output_weights=tied)
    m = wl.model
    assert (m.qk_norm, m.norm_eps, m.tied_embeddings) == (
        config.qk_layernorm, config.layernorm_epsilon, tied)
    assert wl.recompute == (config.recompute_granularity or "none")
    assert wl.parallelism.sequence_parallel == config.sequence_parallel
    groups = TorchParallelGroups.from_groups(tp=parallel_state.get_tensor_model_parallel_group())
    emb = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                          rotary_base=ex.ROTARY_BASE)(SEQ)
    # the Megatron-Core the workers ran (the test compares it with its own)
    out: dict = {"megatron_core": megatron.core.__version__}
    if variant.endswith("-full"):
        _full_recompute_matches(config, wl, groups, out)
    elif variant.endswith("-graphs"):
        _gpt_graphs_match(config, wl, groups, out, tied)
    else:
        _layers_match(config, wl, groups, emb, out)
        _gpt_matches(config, wl, groups, out, tied)
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


#: The variants run on every tested Megatron-Core line (``megatron_line``): query/key norm
#: under sequence parallelism, and the chained block under full recomputation.
LINE_VARIANTS = ("qwen3-sp", "llama-full")


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=pytest.mark.megatron_line) if v in LINE_VARIANTS else v
    for v in sorted(VARIANTS)])
def test_kareus_layers_are_megatron_s_layers_over_gloo(tmp_path, variant):
    import megatron.core
    from _ranks import run_ranks  # tests/integrations, on sys.path under pytest

    res = run_ranks(__file__, tmp_path, TP, variant)
    # the workers ran this process's Megatron-Core (a source tree first on PYTHONPATH too)
    assert [r["megatron_core"] for r in res] == [megatron.core.__version__] * TP
    if variant.endswith("-graphs"):  # trained from graphs of their own (see the worker)
        assert res[0]["graphs"] > 0 and res[0]["losses"] == res[1]["losses"]
        return
    if variant.endswith("-full"):  # chained training only (see _full_recompute_matches)
        assert res[0]["gpt"] and res[1]["gpt"] == res[0]["gpt"]
        assert any(k.startswith("bwd_") for _, k in res[0]["gpt"])
        assert res[0]["losses"] == res[1]["losses"]
        return
    for key in ("sequential", "nanobatching", "kareus", "gpt", "chained"):
        assert res[0][key] and res[1][key] == res[0][key], f"ranks ran different {key}"
    # the last forward collective of every layer runs exposed; chained, only the block's
    assert res[0]["exposed"] == {"layers": DIMS["num_layers"], "chained": 1}, res[0]["exposed"]
    assert any(k.startswith("fwd_mlp") for _, k in res[0]["kareus"])
    assert res[0]["losses"] == res[1]["losses"]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
