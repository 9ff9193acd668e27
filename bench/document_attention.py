"""Packed documents' block-causal attention: the block-sparse FlexAttention path against the
dense-mask SDPA path, as the planned layers run them (``KernelSet.attention_fwd`` /
``attention_bwd`` with a ``kareus.exec.kernels.DocumentMask``).

Per sequence length: a batch of sequences packing documents of about ``--document-tokens``
tokens (lengths drawn uniformly from half to one and a half times it, seeded; the last one
cut by the sequence's end), grouped-query attention (``--heads`` over ``--kv-heads``). Rows:

* ``flex``: the mask built from the positions (``DocumentMask`` and its ``BlockMask``: the
  ``mask_ms`` column) and compiled FlexAttention forward and backward;
* ``mask``: SDPA with the dense boolean ``[batch, 1, seq, seq]`` mask (built likewise);
* ``causal``: SDPA's causal attention over the whole sequence (flash or cuDNN, no
  documents): the kernel whose work the documents' attention replaces.

Columns: the mask build, forward, backward (forward and backward on a GPU; on a CPU the
forward only: FlexAttention has no CPU backward in torch 2.13), the peak memory of a
forward-backward above the inputs (GPU), the cost model's score pairs of these documents
as a share of causal attention's (``document_pairs`` at ``document_tokens_of`` of the
batch: what a plan costs), and the largest difference of the flex output from the mask
path's. Times are CUDA-event means over ``--repeats`` calls after warm-ups (the first
compiles), no clocks changed.

Usage (1x H200)::

    python bench/document_attention.py --json bench/results/document_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time


def positions(batch: int, seq: int, document_tokens: int, seed: int) -> list[list[int]]:
    """Positions of ``batch`` sequences packing documents of about ``document_tokens``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < seq:
            row += range(rng.randint(document_tokens // 2, 3 * document_tokens // 2))
        rows.append(row[:seq])
    return rows


def timed(fn, n: int, gpu: bool) -> float:
    """Mean milliseconds of ``fn()`` over ``n`` calls after two warm-ups (CUDA events on a
    GPU, the host clock on a CPU)."""
    import torch

    for _ in range(2):
        fn()
    if not gpu:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n


def measure(name: str, ks, pos, q, k, v, do, repeats: int) -> tuple[dict, object]:
    """One row: path ``name`` (``flex``, ``mask`` or ``causal``) on these inputs, and its
    output."""
    import torch

    from kareus.exec.kernels import DocumentMask

    gpu = q.device.type == "cuda"

    def build():
        docs = DocumentMask(pos)
        if name == "flex":
            docs.block_mask()
        elif name == "mask":
            docs.dense()
        return docs

    row: dict[str, object] = {}
    mask = None
    if name != "causal":
        row["mask_ms"] = timed(build, repeats, gpu)
        mask = build()
    if not gpu:  # forward only: FlexAttention has no CPU backward
        with torch.no_grad():
            row["fwd_ms"] = timed(lambda: ks.attention(q, k, v, mask), repeats, gpu)
            return row, ks.attention(q, k, v, mask)
    row["fwd_ms"] = timed(lambda: ks.attention_fwd(q, k, v, mask), repeats, gpu)
    saved = ks.attention_fwd(q, k, v, mask)
    out = saved.output
    row["bwd_ms"] = timed(lambda s=saved: ks.attention_bwd(do, s), repeats, gpu)
    del saved
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    s = ks.attention_fwd(q, k, v, None if name == "causal" else build())
    ks.attention_bwd(do, s)
    del s
    torch.cuda.synchronize()
    row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    return row, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--document-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()

    import torch

    from kareus.exec.kernels import TorchKernels
    from kareus.model import document_pairs, document_tokens_of

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    kernels = {"flex": TorchKernels(), "mask": TorchKernels()}
    kernels["causal"] = kernels["flex"]
    kernels["flex"].documents_backend, kernels["mask"].documents_backend = "flex", "mask"
    b, h, kvh, hd = args.batch, args.heads, args.kv_heads, args.head_dim
    rows: list[dict[str, object]] = []
    for seq in args.seq:
        pos_list = positions(b, seq, args.document_tokens, seed=seq)
        pos = torch.tensor(pos_list, device=dev)
        q = torch.randn(b, h, seq, hd, device=dev, dtype=dtype)
        k = torch.randn(b, kvh, seq, hd, device=dev, dtype=dtype)
        v = torch.randn(b, kvh, seq, hd, device=dev, dtype=dtype)
        do = torch.randn(b, h, seq, hd, device=dev, dtype=dtype)
        eff = document_tokens_of(pos_list)
        share = document_pairs(seq, round(eff)) / document_pairs(seq, None)
        outputs = {}
        for name, ks in kernels.items():
            reps = args.repeats if gpu or name != "mask" else max(2, args.repeats // 4)
            row, outputs[name] = measure(name, ks, pos, q, k, v, do, reps)
            rows.append({"seq": seq, "path": name, "batch": b, "heads": h, "kv_heads": kvh,
                         "head_dim": hd, "document_tokens_of_batch": round(eff, 1), **row,
                         **({} if name == "causal" else
                            {"cost_model_pair_share": round(share, 4)})})
        diff = float((outputs["flex"].float() - outputs["mask"].float()).abs().max())
        for row in rows[-3:]:
            row["flex_vs_mask_max_abs_diff"] = diff
    report(rows, args.seq)
    if args.json:
        opts = " ".join(f"--{key.replace('_', '-')} "
                        f"{' '.join(map(str, val)) if isinstance(val, list) else val}"
                        for key, val in vars(args).items()
                        if val is not None and key != "json")
        out = {"command": f"python bench/document_attention.py {opts}",
               "machine": (torch.cuda.get_device_name() if gpu
                           else f"CPU ({platform.processor() or platform.machine()})"),
               "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
               "forward_only": not gpu, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def report(rows: list[dict[str, object]], seqs: list[int]) -> None:
    """The table, and per sequence length the paths' totals side by side."""
    cols = ["seq", "path", "mask_ms", "fwd_ms", "bwd_ms", "peak_extra_mib",
            "cost_model_pair_share"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{row[c]:.3f}" if c.endswith("_ms") and c in row else str(row.get(c, ""))
                 for c in cols]
        print("| " + " | ".join(cells) + " |")
    for seq in seqs:
        r = {str(row["path"]): row for row in rows if row["seq"] == seq}
        tot = {p: float(r[p]["fwd_ms"]) + float(r[p].get("bwd_ms", 0.0))  # type: ignore[arg-type]
               for p in r}
        print(f"seq {seq}: flex {tot['flex']:.3f} ms vs mask {tot['mask']:.3f} ms "
              f"({tot['mask'] / tot['flex']:.2f}x), causal {tot['causal']:.3f} ms; flex vs "
              f"mask max abs diff {r['flex']['flex_vs_mask_max_abs_diff']:.3g}")


if __name__ == "__main__":
    raise SystemExit(main())
