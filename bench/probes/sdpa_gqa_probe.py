"""Cost of the runnable partitions' memory-heavy helpers on one GPU (no clocks touched).

Times, with CUDA events (mean of 20 calls after 3 warm-ups), at Llama 3.2 3B TP=2 shapes
(4 sequences of 4096 tokens, 12 query heads over 4 K/V heads, head dim 128; hidden 3072):
causal SDPA after copying K/V per query head (``repeat_interleave``) and with grouped K/V
(``enable_gqa``), their largest output difference; ``F.rms_norm`` against the
hand-written fp32 RMSNorm (the fallback for PyTorch without ``F.rms_norm``) and a plain
copy of the same tensor.

Usage::

    python bench/probes/sdpa_gqa_probe.py --json bench/probes/results/sdpa_gqa_probe_h200.json
"""

from __future__ import annotations

import argparse
import json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    dev = "cuda"
    torch.manual_seed(0)

    def timed(fn, n: int = 20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / n

    q = torch.randn(4, 12, 4096, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(4, 4, 4096, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(4, 4, 4096, 128, device=dev, dtype=torch.bfloat16)
    res: dict[str, object] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}

    def copied():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(3, dim=1),
                                              v.repeat_interleave(3, dim=1), is_causal=True)

    def grouped():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    res["sdpa_repeat_interleave_ms"] = timed(copied)
    res["sdpa_enable_gqa_ms"] = timed(grouped)
    res["gqa_max_abs_diff"] = float((copied().float() - grouped().float()).abs().max())
    x = torch.randn(16384, 3072, device=dev, dtype=torch.bfloat16)
    w = torch.ones(3072, device=dev, dtype=torch.bfloat16)

    def manual():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w

    res["rms_norm_ms"] = timed(lambda: F.rms_norm(x, (3072,), w, 1e-5))
    res["rms_norm_manual_ms"] = timed(manual)
    res["copy_ms"] = timed(lambda: x.clone())
    print("| what | ms |\n|---|---|")
    for key, val in res.items():
        if key.endswith("_ms"):
            print(f"| {key} | {val:.3f} |")
    print(f"gqa max abs diff {res['gqa_max_abs_diff']}")
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
