"""Megatron-LM's own trainer: ``pretrain_gpt.py --spec kareus.integrations.megatron
layer_spec`` under a fake Megatron-LM initialisation (CPU, gloo, TP=2), and the Transformer
Engine parameter layout.

Megatron-LM's trainer package (``megatron.training``) is not in the ``megatron-core`` wheel,
so the worker stands in for it as ``pretrain_gpt.py`` would run: it imports the spec the way
Megatron-LM does (``spec_utils.import_module``) before any process group exists, installs a
``megatron.training`` module whose ``get_args()`` returns the arguments Megatron-LM parses
from the job's flags (written out here by hand, with Megatron's derived values: the padded
vocabulary, DP), initialises the real ``parallel_state`` over gloo, and builds a ``GPTModel``
with ``layer_spec`` (which builds the applier with the first layer and enters the schedule
wrapper), then trains it with Megatron's DDP, optimizer and ``get_forward_backward_func``,
fetched after the model is built, as Megatron-LM's ``train()`` does. The losses, DDP's
``main_grad``s and the weights after two iterations must equal those of Megatron's own layers
(local spec) from the same weights: under the plan made from the same flags
(``KAREUS_PLAN``), without a plan (the sequential baseline), and in the TE layout from a
TE-named state dict.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "integrations"

SEQ, MBS, TP = 16, 4, 2
#: The flags of the job (what ``pretrain_gpt.py`` is started with; data, optimizer and
#: logging flags included, which kareus ignores).
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 4 --global-batch-size 8 --tensor-model-parallel-size 2 --swiglu "
         "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
         "--rotary-base 500000 --hidden-dropout 0.0 --attention-dropout 0.0 "
         "--tokenizer-type NullTokenizer --vocab-size 1000 --mock-data --lr 1e-3 "
         "--train-iters 2 --transformer-impl local --spec kareus.integrations.megatron layer_spec")
QWEN3 = " --qk-layernorm --norm-epsilon 1e-6"


def megatron_lm_args(qwen3: bool) -> argparse.Namespace:
    """The arguments Megatron-LM's ``parse_args`` / ``validate_args`` / tokenizer make of
    ``FLAGS`` on 2 GPUs (by hand: NullTokenizer's 1001 tokens padded to 128 x TP = 256)."""
    return argparse.Namespace(
        num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, ffn_hidden_size=64, kv_channels=8, seq_length=SEQ,
        max_position_embeddings=SEQ, micro_batch_size=MBS, global_batch_size=8,
        rampup_batch_size=None, tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
        context_parallel_size=1, expert_model_parallel_size=1, sequence_parallel=False,
        virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
        recompute_granularity=None, hidden_dropout=0.0, attention_dropout=0.0, bf16=False,
        fp16=False, layernorm_epsilon=1e-6 if qwen3 else 1e-5, normalization="RMSNorm",
        qk_layernorm=qwen3, untie_embeddings_and_output_weights=False, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
        rotary_base=500000, rotary_percent=1.0, use_rope_scaling=False,
        rotary_seq_len_interpolation_factor=None, vocab_size=1000,
        tokenizer_type="NullTokenizer", make_vocab_size_divisible_by=128,
        padded_vocab_size=1024, data_parallel_size=1, world_size=TP, rank=0,
        transformer_impl="local", overlap_param_gather=False, num_experts=None,
        spec=["kareus.integrations.megatron", "layer_spec"])


@pytest.mark.megatron_line
def test_the_spec_is_a_module_level_modulespec_before_any_process_group():
    """``--spec MODULE NAME``: Megatron imports MODULE and takes NAME as it is."""
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    from kareus.integrations.megatron import KareusTransformerLayer

    assert not dist.is_initialized()
    spec = import_module(("kareus.integrations.megatron", "layer_spec"))
    assert isinstance(spec, ModuleSpec) and spec.module is KareusTransformerLayer
    assert spec.submodules is None  # chosen per layer from its config


@pytest.mark.megatron_line
def test_the_spec_refuses_megatron_lm_s_persisted_layernorm():
    from megatron.core.transformer.spec_utils import build_module

    from kareus.errors import ArgumentError
    from kareus.integrations.megatron import layer_spec

    with pytest.raises(ArgumentError, match="--no-persist-layer-norm"):
        build_module(layer_spec, config=types.SimpleNamespace(persist_layer_norm=True),
                     layer_number=1)


@pytest.mark.megatron_line
def test_without_megatron_lm_the_spec_refuses_in_one_line(monkeypatch):
    from kareus.errors import ArgumentError
    from kareus.integrations.megatron import megatron_lm_applier

    monkeypatch.setitem(sys.modules, "megatron.training", None)  # not importable
    with pytest.raises(ArgumentError, match="kareus_layer_spec\\(applier\\)"):
        megatron_lm_applier(types.SimpleNamespace(layernorm_epsilon=1e-5))


@pytest.mark.parametrize(("value", "graphs"), [(None, None), ("1", True), ("0", False)])
def test_the_graphs_variable_picks_the_fast_path_unless_told_otherwise(monkeypatch, value,
                                                                       graphs):
    """Unset: the applier's default (graphs on a CUDA device); ``1``/``0``: as asked."""
    from kareus.integrations import megatron

    if value is None:
        monkeypatch.delenv(megatron.GRAPHS_ENV, raising=False)
    else:
        monkeypatch.setenv(megatron.GRAPHS_ENV, value)
    assert megatron._graphs_from_env() is graphs


def test_a_block_of_unchained_layers_runs_them_one_by_one():
    # An applier whose workload's layers are unchained (KAREUS_CHAIN=0's, or
    # Workload.chained_layers=False): the chained block runs Megatron's own forward, layer
    # by layer, which is what its plan costs; without a warning (it is what was asked).
    from kareus.integrations import megatron
    from kareus.model import Workload

    wl = Workload.preset("qwen3-1.7b", tp=2)
    for chained, why in ((True, None), (False, "unchained")):
        applier = types.SimpleNamespace(workload=wl.with_(chained_layers=chained))
        block = types.SimpleNamespace(
            layers=[types.SimpleNamespace(kareus_applier=applier, _forward_pre_hooks={},
                                          _forward_hooks={}) for _ in range(2)],
            config=types.SimpleNamespace(fp8=None, fp4=None, cpu_offloading=False))
        got = megatron._why_not_chained(block, {})
        if why is None:
            assert got is None
        else:
            assert why in got[0] and got[1] is False


@pytest.mark.parametrize(("value", "chained"), [(None, True), ("1", True), ("0", False)])
def test_kareus_chain_0_makes_the_entry_s_workload_one_of_unchained_layers(monkeypatch, value,
                                                                           chained):
    """``KAREUS_CHAIN=0`` leaves the layers unchained: the entry's workload says so, so a plan
    made for chained layers is refused (check_plan_workload) and one made with ``kareus
    optimize --megatron-args ... --unchained-layers`` is taken."""
    from kareus.integrations import megatron
    from kareus.integrations.megatron_args import workload_from_megatron_args

    if value is None:
        monkeypatch.delenv(megatron.CHAIN_ENV, raising=False)
    else:
        monkeypatch.setenv(megatron.CHAIN_ENV, value)
    args = megatron_lm_args(qwen3=False)
    wl = megatron._entry_workload(args, None)
    assert wl.chained_layers is chained
    assert wl.with_(chained_layers=True) == workload_from_megatron_args(args)


def test_a_bad_graphs_variable_is_refused_naming_it(monkeypatch):
    from kareus.errors import ArgumentError
    from kareus.integrations import megatron

    monkeypatch.setenv(megatron.GRAPHS_ENV, "yes")
    with pytest.raises(ArgumentError, match="KAREUS_GRAPHS='yes'"):
        megatron._graphs_from_env()


class _TEStandIn:
    """The methods of Megatron-Core's ``TESpecProvider`` that its TE spec calls, returning
    stand-in classes named as Transformer Engine's (not installed here)."""

    made: dict[str, type] = {}

    def _te(self, name):
        return self.made.setdefault(name, type(name, (), {}))

    def linear(self):
        return self._te("TELinear")

    def column_parallel_linear(self):
        return self._te("TEColumnParallelLinear")

    def row_parallel_linear(self):
        return self._te("TERowParallelLinear")

    def fuse_layernorm_and_linear(self):
        return True

    def column_parallel_layer_norm_linear(self):
        return self._te("TELayerNormColumnParallelLinear")

    def layer_norm(self, rms_norm=False, for_qk=False):
        return self._te("TENorm")

    def core_attention(self):
        return self._te("TEDotProductAttention")

    def activation_func(self):
        return None


_SUBMODULES = ("input_layernorm", "pre_mlp_layernorm", "self_attention", "mlp", "linear_qkv",
               "core_attention", "linear_proj", "q_layernorm", "k_layernorm", "linear_fc1",
               "linear_fc2")


def _leaf_pairs(theirs, mine, path=""):
    """``(where, their module, mine)`` of every leaf submodule of two layer specs."""
    for field in _SUBMODULES:
        if not hasattr(theirs, field):
            continue
        a, b = getattr(theirs, field), getattr(mine, field)
        if getattr(a, "submodules", None) is not None:
            assert a.module is b.module
            yield from _leaf_pairs(a.submodules, b.submodules, f"{path}{field}.")
        else:
            yield f"{path}{field}", a, b


@pytest.mark.megatron_line
def test_the_te_layout_is_megatron_s_te_spec(monkeypatch):
    """Megatron-Core's own ``get_gpt_layer_with_transformer_engine_spec``, read with a
    stand-in for Transformer Engine's classes (not installed): kareus's TE layout has an
    ``IdentityOp`` where it has one and, where it has a TE module, a module with that
    module's parameter names."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.transformer.identity_op import IdentityOp

    from kareus.integrations import megatron as km

    monkeypatch.setattr(specs, "TESpecProvider", _TEStandIn, raising=False)
    theirs = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True).submodules
    mine = km.kareus_layer_spec(None, qk_layernorm=True, layout="te").submodules
    kareus_for = {"TELayerNormColumnParallelLinear": km._NormedColumnParallelLinear,
                  "TERowParallelLinear": km._TEStateRowParallelLinear,
                  "TEDotProductAttention": km._TEStateDotProductAttention,
                  "TENorm": km._TEStateNorm}
    seen = list(_leaf_pairs(theirs, mine))
    assert len(seen) == 9
    for where, a, b in seen:
        assert b is (IdentityOp if a is IdentityOp else kareus_for[a.__name__]), where
    assert theirs.sharded_state_dict_keys_map["mlp.0.weight"] == (
        "mlp.linear_fc1.layer_norm_weight")


# ------------------------------------------------------------------ several processes, gloo


def _install_fake_megatron_lm(args):
    """``megatron.training`` as Megatron-LM's ``initialize_megatron`` leaves it: its
    ``get_args()`` returns the parsed arguments."""
    mod = types.ModuleType("megatron.training")
    mod.get_args = lambda: args
    sys.modules["megatron.training"] = mod


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=what)


def _te_named(state, extra):
    """A TE-spec checkpoint of the same weights: Megatron-Core's own map of the local
    spec's norm names to TE's (``sharded_state_dict_keys_map``), and an ``_extra_state`` of
    each TE module (``extra``: its bytes)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    rename = get_gpt_layer_local_spec(normalization="RMSNorm").submodules \
        .sharded_state_dict_keys_map
    out = {}
    for k, v in state.items():
        for old, new in rename.items():
            if f".{old}" in k:
                k = k.replace(f".{old}", f".{new}")
        if k.endswith("_extra_state") and ".layers." in k:
            continue
        out[k] = v
    for k in list(out):
        for mod in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "q_layernorm",
                    "k_layernorm"):
            if f".{mod}." in k and k.endswith((".weight", "layer_norm_weight")):
                key = k[:k.index(f".{mod}.") + len(mod) + 2] + "_extra_state"
                out.setdefault(key, torch.frombuffer(bytearray(pickle.dumps(extra + key)),
                                                     dtype=torch.uint8))
        if ".linear_qkv.weight" in k:
            key = k.replace("linear_qkv.weight", "core_attention._extra_state")
            out[key] = torch.empty(0, dtype=torch.uint8)
    return out


def _train_with_layer_spec(ex, config, args, batches, initial, plan_path, layout=None):
    """What ``pretrain_gpt.py --spec kareus.integrations.megatron layer_spec`` does: build
    the model from the spec, then ``train()`` fetching ``get_forward_backward_func()``."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.spec_utils import import_module

    from kareus.integrations import megatron as km

    for env, value in ((km.PLAN_ENV, plan_path), (km.LAYOUT_ENV, layout)):
        if value is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = str(value)
    own_fwd = schedules.forward_step
    spec = import_module(("kareus.integrations.megatron", "layer_spec"))
    model = ex.build_model(config, spec, SEQ, "cpu", tied=not args.untie_embeddings_and_output_weights)
    applier = km._Entry.applier
    assert applier is not None and schedules.forward_step is not own_fwd  # entered
    layers = km.kareus_layers(model)
    assert len(layers) == 2 and all(lay.kareus_applier is applier for lay in layers)
    model.load_state_dict(initial)
    losses = ex.train(model, config, batches, steps=2, seq_len=SEQ)
    chained = "forward" in vars(model.decoder)
    return model, applier, losses, chained


def _worker(out_dir: str, variant: str) -> None:
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import import_module

    # Megatron-LM imports the spec before initialising anything (its main branch)
    spec = import_module(("kareus.integrations.megatron", "layer_spec"))
    assert spec.params["applier"] is not None and not dist.is_initialized()

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import schedules

    sys.path.insert(0, str(EXAMPLE))
    import megatron_gpt as ex

    import kareus
    from kareus.integrations import megatron as km
    from kareus.integrations.megatron_args import workload_from_megatron_args

    qwen3 = variant == "qwen3"
    args = megatron_lm_args(qwen3)
    _install_fake_megatron_lm(args)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    from kareus.integrations import megatron_cpu

    megatron_cpu.install()
    fields = {"qk_layernorm": True, "layernorm_epsilon": 1e-6} if qwen3 else {}
    config = ex.make_config(TP, torch.float32, num_layers=2, hidden_size=32,
                            num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                            **fields)

    # The plan is made from the flags the job is started with, as kareus optimize
    # --megatron-args makes it (a small search on the emulated H200)
    flags = FLAGS + (QWEN3 if qwen3 else "")
    wl = workload_from_megatron_args(flags)
    plan_path = Path(out_dir) / "plan.json"
    if dist.get_rank() == 0:
        kareus.optimize(wl, "h200-sxm", budget=8, seed=0, progress=False).select().save(
            plan_path)
    dist.barrier()

    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):  # global batch 8 / (micro batch 4 x DP 1)
        tok = torch.randint(0, ex.VOCAB, (MBS, SEQ + 1), generator=g)
        batches.append((tok[:, :-1], tok[:, 1:]))
    torch.manual_seed(0)
    own_model = ex.build_model(config, get_gpt_layer_local_spec(
        normalization="RMSNorm", qk_layernorm=qwen3), SEQ, "cpu", tied=True)
    initial = {k: v.clone() if torch.is_tensor(v) else v
               for k, v in own_model.state_dict().items()}
    own_fwd = schedules.forward_step
    own = ex.train(own_model, config, batches, steps=2, seq_len=SEQ)
    own_p = dict(own_model.named_parameters())

    out: dict = {"own": own}
    for case, plan_file, layout in (("plan", plan_path, None), ("baseline", None, None),
                                    ("te", plan_path, "te")):
        start = initial
        if layout == "te":
            start = _te_named(initial, extra=f"rank{dist.get_rank()}")
        model, applier, losses, chained = _train_with_layer_spec(
            ex, config, args, batches, start, plan_file, layout)
        assert applier.workload == wl, (applier.workload, wl)  # the plan's, field by field
        assert applier.schedule == ("kareus" if plan_file else "sequential")
        assert chained, "layer_spec chains the decoder's layers"
        assert all(lay.layout == (layout or "local") for lay in km.kareus_layers(model))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(own), rtol=1e-4,
                                   atol=1e-5)
        my_p = dict(model.named_parameters())
        if layout == "te":
            rename = get_gpt_layer_local_spec(normalization="RMSNorm").submodules \
                .sharded_state_dict_keys_map
            for n in list(my_p):
                for old, new in rename.items():
                    n_own = n.replace(f".{new}", f".{old}")
                    if n_own != n:
                        my_p[n_own] = my_p.pop(n)
        assert set(my_p) == set(own_p)
        for n, p in own_p.items():
            _close(my_p[n].main_grad, p.main_grad, f"{case} main_grad {n}")
            _close(my_p[n].detach(), p.detach(), f"{case} weight {n}")
        if layout == "te":  # a TE checkpoint loads and saves back byte for byte
            te_state = _te_named(initial, extra=f"rank{dist.get_rank()}")
            model.load_state_dict(te_state)
            back = model.state_dict()
            assert list(back) == list(te_state) or set(back) == set(te_state), (
                sorted(set(back) ^ set(te_state)))
            for k, v in te_state.items():
                w = back[k]
                if torch.is_tensor(v):
                    assert w.dtype == v.dtype and w.shape == v.shape, k
                    assert w.detach().contiguous().view(torch.uint8).numpy().tobytes() == (
                        v.detach().contiguous().view(torch.uint8).numpy().tobytes()), k
                else:
                    assert w is v, k
            out["te_keys"] = sorted(k for k in back if ".layers.0." in k)
        out[case] = losses
        km.release_layer_spec()
        assert schedules.forward_step is own_fwd  # restored
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


#: A Megatron-LM checkout (``core_v0.16.1`` or ``core_v0.15.x``, matching the installed
#: megatron-core: ``pretrain_gpt.py``, ``gpt_builders.py``,
#: ``model_provider.py``, ``megatron/training``, ...) for the test with Megatron-LM's own code.
MEGATRON_LM_ENV = "KAREUS_TEST_MEGATRON_LM"
REAL_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
              "--num-query-groups 2 --ffn-hidden-size 128 --seq-length 32 "
              "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --swiglu "
              "--disable-bias-linear --normalization RMSNorm --position-embedding-type rope "
              "--rotary-base 500000 --hidden-dropout 0 --attention-dropout 0 "
              "--tokenizer-type NullTokenizer --vocab-size 1000 --mock-data --lr 1e-3 "
              "--train-iters 2 --transformer-impl local --no-persist-layer-norm "
              "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion "
              "--use-cpu-initialization")


def _example_qwen3_flags() -> str:
    """The flags of ``examples/integrations/megatron_lm_pretrain.py --shape qwen3`` (the GPU
    run's), shrunk for the CPU: fp32 (no ``--bf16``), CPU initialisation, 2 layers of hidden
    64, 4 heads of 32 channels (heads x channels is not hidden, as in the larger Qwen3s)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "megatron_lm_pretrain", EXAMPLE / "megatron_lm_pretrain.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    args = ex.parse_args(["--megatron-lm", ".", "--shape", "qwen3", "--layers", "2",
                          "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                          "--kv-channels", "32", "--ffn", "128", "--seq", "32", "--mbs", "2",
                          "--gbs", "4", "--iters", "2", "--vocab", "999"])
    flags = [f for f in ex.job_flags(args) if f != "--bf16"]
    return " ".join([*flags, "--use-cpu-initialization"])


def _real_megatron_lm_worker(out_dir: str, shape: str = "llama") -> None:
    """Megatron-LM's own argument parsing and ``gpt_builder`` (what ``pretrain_gpt.py``
    runs to build the model), with ``--spec kareus.integrations.megatron layer_spec`` and
    without it (Megatron's local layers), on one CPU process: ``REAL_FLAGS`` (a Llama
    layer) or the example's ``--shape qwen3`` flags (query/key RMSNorm, eps 1e-6, tied
    embeddings, RoPE base 1e6)."""
    import contextlib
    import importlib.util
    import io
    import shlex

    stubs = Path(out_dir) / "stubs"  # megatron.training's tokenizers import six and regex
    for name in ("six", "regex"):  # at import; the NullTokenizer uses neither
        if importlib.util.find_spec(name) is None:
            (stubs / name).mkdir(parents=True, exist_ok=True)
            (stubs / name / "__init__.py").write_text("")
    sys.path[:0] = [os.environ[MEGATRON_LM_ENV], str(stubs)]
    import megatron.training.arguments as margs
    import megatron.training.utils as mutils

    for mod in (margs, mutils):  # validate_args asks the GPU's architecture
        mod.get_device_arch_version = lambda: 9
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    import gpt_builders
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.training import global_vars
    from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding

    from kareus.integrations import megatron as km
    from kareus.integrations import megatron_cpu
    from kareus.integrations.megatron_args import workload_from_megatron_args

    def parsed(flags):
        sys.argv = ["pretrain_gpt.py", *shlex.split(flags)]
        with contextlib.redirect_stdout(io.StringIO()):
            args = margs.validate_args(margs.parse_args(), {})
            # the NullTokenizer's vocabulary: --vocab-size and its end-of-document token
            args.padded_vocab_size = _vocab_size_with_padding(args.vocab_size + 1, args)
        global_vars.set_args(args)
        return args

    flags = REAL_FLAGS if shape == "llama" else _example_qwen3_flags()

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    megatron_cpu.install()
    own_schedule = schedules.forward_backward_no_pipelining
    torch.manual_seed(0)
    own = gpt_builders.gpt_builder(parsed(flags), True, True)
    spec_flags = flags + " --spec kareus.integrations.megatron layer_spec"
    mine = gpt_builders.gpt_builder(parsed(spec_flags), True, True)
    assert [type(lay) for lay in mine.decoder.layers] == [km.KareusTransformerLayer] * 2
    workload = km._Entry.applier.workload
    assert workload == workload_from_megatron_args(spec_flags)
    qwen3 = shape == "qwen3"
    assert (workload.model.qk_norm, workload.model.norm_eps) == (qwen3, 1e-6 if qwen3 else 1e-5)
    assert workload.model.tied_embeddings and own.share_embeddings_and_output_weights
    if qwen3:
        assert mine.decoder.layers[0].self_attention.q_layernorm.eps == 1e-6
        assert workload.model.head_dim == 32 and km._Entry.applier.rope_base == 1e6
    assert get_forward_backward_func() is not own_schedule  # wrapped before train() asks
    mine.load_state_dict(own.state_dict())
    tok = torch.randint(0, 999, (2, 33), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(32).expand(2, 32)
    mask = torch.ones(32, 32, dtype=torch.bool).triu(1)[None, None]  # the dataloader's
    losses = []
    for model in (own, mine):
        loss = model(tok[:, :-1], pos, mask, labels=tok[:, 1:]).float().mean()
        loss.backward()
        losses.append(float(loss))
    _close(torch.tensor(losses[1]), torch.tensor(losses[0]), "loss")
    for (n, p), q in zip(own.named_parameters(), mine.parameters(), strict=True):
        _close(q.grad, p.grad, f"grad {n}")
    km.release_layer_spec()
    torch.save({"losses": losses}, os.path.join(out_dir, "rank0.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(MEGATRON_LM_ENV),
                    reason=f"{MEGATRON_LM_ENV}=<a Megatron-LM checkout at core_v0.16.1 or "
                           "core_v0.15.x> not set")
@pytest.mark.megatron_line
@pytest.mark.parametrize("shape", ["llama", "qwen3"])
def test_megatron_lm_s_own_builder_builds_kareus_layers_from_the_spec(tmp_path, shape):
    from _ranks import run_ranks

    res = run_ranks(__file__, tmp_path, 1, f"megatron-lm-{shape}")
    assert res[0]["losses"][0] == pytest.approx(res[0]["losses"][1], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [
    "llama", pytest.param("qwen3", marks=pytest.mark.megatron_line)])
def test_pretrain_gpt_s_spec_trains_kareus_layers_as_megatron_s_own(tmp_path, variant):
    from _ranks import run_ranks  # tests/integrations, on sys.path under pytest

    res = run_ranks(__file__, tmp_path, TP, variant)
    for r in res:
        for case in ("plan", "baseline", "te"):
            assert r[case] == pytest.approx(r["own"], rel=1e-4), case
    keys = res[0]["te_keys"]
    prefix = "decoder.layers.0."
    assert prefix + "self_attention.linear_qkv.layer_norm_weight" in keys
    assert prefix + "mlp.linear_fc1.layer_norm_weight" in keys
    assert prefix + "self_attention.core_attention._extra_state" in keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    assert (prefix + "self_attention.q_layernorm._extra_state" in keys) == (variant == "qwen3")


if __name__ == "__main__":
    if sys.argv[2].startswith("megatron-lm-"):
        _real_megatron_lm_worker(sys.argv[1], sys.argv[2].removeprefix("megatron-lm-"))
    else:
        _worker(sys.argv[1], sys.argv[2])
