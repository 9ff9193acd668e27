"""Megatron-Core on the CPU, for trying a Megatron script on a laptop and for CPU tests
(never for training).

Megatron-Core's training path calls CUDA unconditionally: its seeding
(``model_parallel_cuda_manual_seed``), the rotary embedding and the causal mask are made
on ``"cuda"``, DDP's gradient buffers and the schedule's loss tensors too, and its
optimizer checks for ``torch.cuda.*Tensor`` types, and its activation checkpoint (selective
and full recomputation) saves and restores the CUDA RNG state.
[`install`][kareus.integrations.megatron_cpu.install] redirects those calls to the CPU in
this process: torch's tensor factories map ``device="cuda"`` to the CPU,
``torch.cuda.current_device`` names the CPU, ``torch.cuda.current_stream`` is one whose
waits do nothing (the CPU runs in order), pinned memory is plain CPU memory (Megatron's
context-parallel RoPE slicing pins an index tensor), CPU tensors report CUDA type names, and a
no-op RNG tracker (and CUDA RNG state) replaces CUDA's, so dropout must be 0. It patches
torch globally for the
process, for good (there is no uninstall): run it only in a process of its own that runs
Megatron with gloo, in fp32 (``examples/integrations/megatron_gpt.py --cpu``, and kareus's
CPU tests of the Megatron adapter, which run the same code).

Mixture-of-experts layers (``MoELayer`` with the all-to-all token dispatcher) need three
more: the dispatcher makes one side stream (``torch.cuda.Stream``, a class attribute) for
its device-to-host copies of the token counts and records an event on it, so that stream
is an in-order stand-in whose events are done when recorded (``torch.cuda.stream`` of it
is a no-op on a CPU build); it moves those counts to the host only when they are on a GPU
(``maybe_move_tensor_to_cpu``), and hands them to ``all_to_all_single`` as split sizes, which
a CPU tensor is not, so on the CPU they become the numpy arrays a GPU run gets; and
Megatron-Core 0.16's router names Transformer Engine's ``te_general_gemm`` even when
Transformer Engine is not installed, so the name is set to ``None`` (its own fallback,
``torch.mm`` in the router dtype).

When to call it, in this order::

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    megatron_cpu.install()   # after the model-parallel groups, before building the model
    torch.manual_seed(1234)  # instead of tensor_parallel.model_parallel_cuda_manual_seed
    model = GPTModel(...)

After ``initialize_model_parallel`` because it replaces the RNG tracker that Megatron's
parallel state sets up; before the model, the DDP wrapper and the optimizer are built,
because those make their CUDA tensors as they are built.

Importing this module imports neither torch nor Megatron-Core; ``install`` does.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["install"]

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "linspace")


def install() -> None:
    """Redirect Megatron-Core's CUDA-only calls to the CPU in this process, for good.

    Call it after ``parallel_state.initialize_model_parallel`` and before building the
    model (see the module doc); seed with ``torch.manual_seed`` rather than Megatron's
    ``model_parallel_cuda_manual_seed``, and keep dropout at 0.
    """
    import torch
    from megatron.core import tensor_parallel  # type: ignore[import-untyped, import-not-found]

    def cpu(dev: Any) -> Any:
        if isinstance(dev, int) or (dev is not None and str(dev).startswith("cuda")):
            return torch.device("cpu")
        return dev

    def factory(fn: Any) -> Any:
        @functools.wraps(fn)
        def make(*a: Any, **kw: Any) -> Any:
            if "device" in kw:
                kw["device"] = cpu(kw["device"])
            kw.pop("pin_memory", None)  # no pinned-memory allocator without an accelerator
            return fn(*a, **kw)
        return make

    for name in _FACTORIES:
        setattr(torch, name, factory(getattr(torch, name)))
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # Megatron-Core's main branch waits, in DDP's gradient sync, on events of the current
    # stream (its CUDA-graph replays'): the CPU runs in order, so there is nothing to wait on
    torch.cuda.current_stream = lambda *a, **k: _InOrder()  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    own_type = torch.Tensor.type

    def tensor_type(self: Any, *a: Any, **kw: Any) -> Any:
        # Megatron's optimizer checks for "torch.cuda.*Tensor"
        t = own_type(self, *a, **kw)
        if not a and not kw and self.device.type == "cpu" and not t.startswith("torch.cuda."):
            return "torch.cuda." + t[len("torch."):]
        return t

    torch.Tensor.type = tensor_type  # type: ignore[method-assign, assignment]
    _install_moe()
    # The no-op RNG tracker (dropout is 0): CUDA's would call torch.cuda.get_rng_state().
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True,
                                                  force_reset=True)
    # Megatron's activation checkpoint (its selective and full recomputation) saves and
    # restores the CUDA RNG state around the recomputed forward: there is none (no dropout)
    tensor_parallel.random._get_cuda_rng_state = lambda *a, **k: None
    tensor_parallel.random._set_cuda_rng_state = lambda *a, **k: None


def _install_moe() -> None:
    """The three MoE redirections of the module doc (after the torch ones above)."""
    import torch
    from megatron.core.transformer.moe import (  # type: ignore[import-untyped, import-not-found]
        moe_utils,
        token_dispatcher,
    )

    # the dispatcher's one side stream (a class attribute, made on first use with
    # torch.cuda.Stream, which a CPU build refuses); torch.cuda.stream(it) is a no-op there
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _InOrder()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


class _Done:
    """A CPU "event": the work before it has run when it is recorded."""

    def record(self, *a: Any, **k: Any) -> None:
        """Nothing to record."""

    def wait(self, *a: Any, **k: Any) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always done."""
        return True


class _InOrder:
    """The CPU's "current stream": work runs in program order, so waiting is a no-op."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def record_event(self, event: Any = None) -> Any:
        """An event that is already done."""
        return event if event is not None else _Done()
