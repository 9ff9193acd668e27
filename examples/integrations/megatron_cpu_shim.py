"""Megatron-Core on the CPU, for trying the Megatron example on a laptop (never for training).

Megatron-Core's training path calls CUDA unconditionally: its seeding
(``model_parallel_cuda_manual_seed``), the rotary embedding and the causal mask are made
on ``"cuda"``, DDP's gradient buffers and the schedule's loss tensors too, and its
optimizer checks for ``torch.cuda.*Tensor`` types. ``install()`` redirects those calls to
the CPU in this process (torch's tensor factories map ``device="cuda"`` to the CPU,
``torch.cuda.current_device`` names the CPU, CPU tensors report CUDA type names, and a
no-op RNG tracker replaces CUDA's, so dropout must be 0). It patches torch globally for
the process: use it only to run ``megatron_gpt.py --cpu`` (and kareus's CPU tests of the
Megatron adapter, which run the same code), with gloo, in fp32.
"""

from __future__ import annotations

import functools

import torch


def install() -> None:
    """Redirect Megatron-Core's CUDA-only calls to the CPU in this process (after
    ``parallel_state.initialize_model_parallel``, before building the model)."""
    from megatron.core import tensor_parallel

    def cpu(dev):
        if isinstance(dev, int) or (dev is not None and str(dev).startswith("cuda")):
            return torch.device("cpu")
        return dev

    def factory(fn):
        @functools.wraps(fn)
        def make(*a, **kw):
            if "device" in kw:
                kw["device"] = cpu(kw["device"])
            return fn(*a, **kw)
        return make

    for name in ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn",
                 "randint", "zeros_like", "ones_like", "empty_like", "full_like",
                 "as_tensor", "linspace"):
        setattr(torch, name, factory(getattr(torch, name)))
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    own_type = torch.Tensor.type

    def tensor_type(self, *a, **kw):  # Megatron's optimizer checks "torch.cuda.*Tensor"
        t = own_type(self, *a, **kw)
        if not a and not kw and self.device.type == "cpu" and not t.startswith("torch.cuda."):
            return "torch.cuda." + t[len("torch."):]
        return t

    torch.Tensor.type = tensor_type
    # The no-op RNG tracker (dropout is 0): CUDA's would call torch.cuda.get_rng_state().
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True,
                                                  force_reset=True)
