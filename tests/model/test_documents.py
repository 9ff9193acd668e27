"""Packed documents in the cost model: ``Workload.document_tokens``, the attention pairs of
documents (``document_pairs``), the length a batch's positions do the work of
(``document_tokens_of``), the partitions costed with them, the plan file recording them and
a plan of one setting refused for a job of another."""

from __future__ import annotations

import pytest

from kareus.errors import ArgumentError, WorkloadError
from kareus.model import (
    Parallelism,
    Workload,
    build_partitions,
    document_pairs,
    document_tokens_of,
)


def test_document_pairs_are_the_causal_halves_of_the_documents():
    assert document_pairs(4096, None) == 0.5 * 4096**2
    assert document_pairs(4096, 1024) == 4 * 0.5 * 1024**2
    assert document_pairs(4096, 1000) == 0.5 * (4 * 1000**2 + 96**2)  # the rest last
    assert document_pairs(4096, 4096) == document_pairs(4096, 8192) == 0.5 * 4096**2
    assert document_pairs(5, 1) == 2.5
    with pytest.raises(ArgumentError, match="document_tokens"):
        document_pairs(4096, 0)


def test_the_length_of_a_batch_is_its_token_weighted_mean():
    # documents of 1 and 3 tokens: mean 2, but the work of (1 + 9) / 4 = 2.5 per token
    assert document_tokens_of([[0, 0, 1, 2]]) == 2.5
    assert document_tokens_of([[0, 1, 2, 3], [0, 1, 0, 1]]) == (16 + 4 + 4) / 8
    # a sequence starting mid-document: its first tokens are a document too
    assert document_tokens_of([[5, 6, 0, 1, 2]]) == (4 + 9) / 5
    # the cost model's pairs of that length match the batch's, for equal documents
    assert document_pairs(12, int(document_tokens_of([[*range(4)] * 3]))) == 3 * 8
    with pytest.raises(ArgumentError, match="at least one token"):
        document_tokens_of([[]])


def test_the_workload_records_and_checks_document_tokens():
    wl = Workload.preset("llama3.2-3b", tp=4, document_tokens=1024)
    assert wl.to_dict()["document_tokens"] == 1024
    assert Workload.from_dict(wl.to_dict()) == wl
    assert "document_tokens" not in wl.with_(document_tokens=None).to_dict()
    assert "documents=1024" in wl.describe()
    for bad, words in ((dict(document_tokens=0), "document_tokens"),
                       (dict(document_tokens=1024, parallelism=Parallelism(tp=2, cp=2)),
                        "CP=1 only"),
                       (dict(document_tokens=1024, microbatch_size=1, nanobatches=2),
                        "along the sequence")):
        with pytest.raises(WorkloadError, match=words) as err:
            wl.with_(**bad)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("recompute", ["full", "selective", "none"])
def test_partitions_cost_the_attention_within_documents(recompute):
    wl = Workload.preset("llama3.2-3b", tp=4, recompute=recompute)
    causal = build_partitions(wl)
    docs = build_partitions(wl.with_(document_tokens=1024))
    assert set(causal.types) == set(docs.types)  # the same partitions, the same slots
    ratio = document_pairs(wl.seq_len, 1024) / document_pairs(wl.seq_len, None)
    assert ratio == 0.25
    attention_ops = 0
    for name, p in causal.types.items():
        q = docs.types[name]
        assert [s.name for s in p.slots] == [s.name for s in q.slots]
        for a, b in zip(p.compute_ops, q.compute_ops, strict=True):
            assert (a.name, a.kind, a.bytes_moved) == (b.name, b.kind, b.bytes_moved)
            if a.kind.value == "attention":
                attention_ops += 1
                assert b.flops == pytest.approx(ratio * a.flops, rel=1e-12), (name, a.name)
            else:
                assert b.flops == a.flops, (name, a.name)
    # forward, backward, and selective recomputation's re-run in the backward (full
    # recomputation re-runs the forward's partition types)
    assert attention_ops == (3 if recompute == "selective" else 2)
    # a document as long as the sequence is the causal attention over it
    same = build_partitions(wl.with_(document_tokens=wl.seq_len))
    assert {n: p.flops for n, p in same.types.items()} == {
        n: p.flops for n, p in causal.types.items()}


def test_the_emulated_gpu_costs_the_shorter_attention():
    from kareus.model.config import ScheduleConfig
    from kareus.profilers import EmulatedProfiler

    wl = Workload.preset("llama3.2-3b", tp=4, seq_len=8192)
    prof = EmulatedProfiler("h200-sxm", noise=0.0)
    times = {}
    for docs in (None, 1024):
        part = build_partitions(wl.with_(document_tokens=docs)).types["fwd_attn"]
        times[docs] = prof.measure(part, ScheduleConfig(1980, 16, None)).time_s
    assert times[1024] < times[None]
