"""kareus.model.memory: the per-GPU memory estimate and the check that refuses what cannot fit."""

from __future__ import annotations

import pytest

from kareus.errors import WorkloadError
from kareus.model.gpu import get_gpu
from kareus.model.memory import check_memory, estimate_memory
from kareus.model.workload import Workload


def _wl(**kw: object) -> Workload:
    args: dict[str, object] = {"microbatch_size": 2, "num_microbatches": 4}
    args.update(kw)
    return Workload.preset("llama3.2-3b", **args)  # type: ignore[arg-type]


def test_weights_of_one_stage_one_shard_are_the_model():
    wl = _wl()
    est = estimate_memory(wl)
    assert est.stage == 0
    assert est.weights_bytes == pytest.approx(2 * wl.model.params)  # bf16
    assert est.grads_bytes == 2 * est.weights_bytes  # fp32 gradients of bf16 weights
    assert est.optimizer_bytes == pytest.approx(6 * est.weights_bytes)  # 12 B vs 2 B


def test_data_parallelism_shards_only_the_optimizer_state():
    one, four = estimate_memory(_wl(dp=1)), estimate_memory(_wl(dp=4))
    assert four.optimizer_bytes == pytest.approx(one.optimizer_bytes / 4)
    assert (four.weights_bytes, four.activations_bytes) == (one.weights_bytes,
                                                             one.activations_bytes)


def test_context_parallelism_shards_the_optimizer_state_with_dp():
    # The distributed optimizer shards over DP x CP (Megatron-Core's dp_cp group): the
    # shard the iteration's Adam step updates.
    from kareus.model.partition import ADAM_BYTES_PER_PARAM, iteration_work

    one = estimate_memory(_wl())
    for dp, cp in [(1, 2), (2, 2), (4, 1)]:
        wl = _wl(dp=dp, cp=cp)
        est = estimate_memory(wl)
        assert est.optimizer_bytes == pytest.approx(one.optimizer_bytes / (dp * cp))
        assert est.weights_bytes == one.weights_bytes
        stepped = iteration_work(wl).ops[0].bytes_moved / ADAM_BYTES_PER_PARAM
        assert est.optimizer_bytes == pytest.approx(12 * stepped)


def test_tensor_and_pipeline_parallelism_shrink_the_weights():
    base = estimate_memory(_wl()).weights_bytes
    assert estimate_memory(_wl(tp=2)).weights_bytes < 0.51 * base
    assert estimate_memory(_wl(pp=2)).weights_bytes < 0.6 * base
    assert estimate_memory(_wl(pp=2)).stage in (0, 1)


def test_activations_follow_the_schedule_and_recomputation():
    wl = _wl(pp=4, num_microbatches=8, seq_len=4096, recompute=False)
    one_f = estimate_memory(wl, schedule="1f1b").activations_bytes
    gpipe = estimate_memory(wl, schedule="gpipe").activations_bytes
    assert gpipe > one_f  # GPipe keeps every microbatch in flight
    assert estimate_memory(wl.with_(recompute=True)).activations_bytes < one_f
    longer = estimate_memory(wl.with_(seq_len=8192)).activations_bytes
    assert longer > 1.9 * one_f


def test_total_and_describe():
    est = estimate_memory(_wl())
    assert est.total_bytes == pytest.approx(est.weights_bytes + est.grads_bytes
                                            + est.optimizer_bytes + est.activations_bytes)
    assert est.describe().startswith(f"{est.total_bytes / 1024**3:,.1f} GiB per GPU on stage 0")


def test_check_memory_passes_what_fits_and_refuses_what_does_not():
    gpu = get_gpu("h200-sxm")
    fits = _wl(tp=2)
    assert check_memory(fits, gpu) == estimate_memory(fits)
    huge = Workload.preset("llama3.2-3b", microbatch_size=64, seq_len=32768, num_microbatches=4,
                           recompute=False)
    with pytest.raises(WorkloadError, match="does not fit on h200-sxm.*or recomputation"):
        check_memory(huge, gpu)
    with pytest.raises(WorkloadError) as info:
        check_memory(huge.with_(recompute=True, microbatch_size=512), gpu)
    assert "recomputation" not in str(info.value)


def test_recomputation_policies_keep_what_they_say():
    """none keeps every saved tensor; selective all but the attention core's output and
    statistics (plus one layer's while recomputed); full the layer inputs (plus one layer's
    everything while recomputed)."""
    wl = _wl(tp=2, seq_len=4096)
    m = wl.model
    act = {rc: estimate_memory(wl.with_(recompute=rc), schedule="gpipe").activations_bytes
           for rc in ("none", "selective", "full")}
    assert act["full"] < act["selective"] < act["none"]
    tokens = wl.microbatch_size * wl.seq_len
    layers = wl.num_microbatches * m.layers
    core = (2 * m.heads * m.head_dim + 4 * m.heads) / 2  # per token, one of TP=2 ranks
    # selective drops the core of every layer in flight, and holds one layer's again
    assert act["none"] - act["selective"] == pytest.approx((layers - 1) * core * tokens)
    logits = tokens * m.vocab / 2 * 4
    everything = (act["none"] - logits) / layers / tokens
    # full: each layer's input, replicated over TP without sequence parallelism
    assert act["full"] - logits == pytest.approx((layers * 2 * m.hidden + everything) * tokens)


def test_sequence_parallelism_shards_the_residual_stream():
    for rc in ("none", "selective", "full"):
        plain = _wl(tp=4, seq_len=4096, recompute=rc)
        sp = _wl(tp=4, seq_len=4096, recompute=rc, sp=True)
        a, b = estimate_memory(plain).activations_bytes, estimate_memory(sp).activations_bytes
        assert b < a, rc
    # full recomputation keeps only the layer inputs: 1/TP of them under SP
    plain = _wl(tp=4, seq_len=4096, num_microbatches=1)
    sp = _wl(tp=4, seq_len=4096, num_microbatches=1, sp=True)
    m = plain.model
    tokens = plain.microbatch_size * plain.seq_len
    diff = estimate_memory(plain).activations_bytes - estimate_memory(sp).activations_bytes
    kept = m.layers * 2 * m.hidden * tokens * (1 - 1 / 4)
    working = 2 * 2 * m.hidden * tokens * (1 - 1 / 4)  # the norms' inputs of one layer
    # less what sequence parallelism adds to it: with more than one sequence, the attention
    # output also in the gathered tokens' order (the output projection's input)
    working -= 2 * m.heads * m.head_dim / 4 * tokens
    assert diff == pytest.approx(kept + working)
    # at TP=1 sequence parallelism changes nothing
    assert estimate_memory(_wl(sp=True)) == estimate_memory(_wl())
