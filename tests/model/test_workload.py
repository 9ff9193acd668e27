import pytest

from kareus.errors import UnknownPresetError, WorkloadError
from kareus.model import Parallelism, Workload, get_model


def test_presets_have_facts_architectures():
    m = get_model("llama3.2-3b")
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn, m.vocab) == (
        28, 3072, 24, 8, 128, 8192, 128256)
    q = get_model("qwen3-1.7b")
    assert (q.hidden, q.ffn, q.vocab) == (2048, 6144, 151936)
    big = get_model("llama3.3-70b")
    assert (big.layers, big.hidden, big.ffn) == (80, 8192, 28672)
    assert 69e9 < big.params < 72e9


def test_unknown_workload():
    with pytest.raises(UnknownPresetError, match="known workloads: llama3.2-3b"):
        get_model("gpt5")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"tp": 12}, "KV heads"),
        ({"tp": 5}, "attention heads"),
        ({"pp": 3}, "PP=3 does not divide the 28 layers"),
        ({"cp": 3, "seq_len": 4096}, "CP=3 needs seq_len"),
        ({"microbatch_size": 3, "nanobatches": 2}, "does not split into 2 nanobatches"),
        ({"nanobatches": 0}, "nanobatches must be in 1.."),
        ({"tp": 0}, "tp must be in 1.."),
        ({"seq_len": 2**40}, "seq_len must be in 1..2,147,483,647, got 1099511627776"),
        ({"microbatch_size": 10**400}, r"microbatch_size must be in 1\.\.2,147,483,647, got 1000"),
    ],
)
def test_invalid_workloads_raise(kwargs, pattern):
    with pytest.raises(WorkloadError, match=pattern):
        Workload.preset("llama3.2-3b", **kwargs)


def test_derived_sizes():
    wl = Workload.preset("qwen3-1.7b", tp=4, cp=2, pp=2, microbatch_size=16, seq_len=4096,
                         num_microbatches=8)
    assert wl.parallelism.world_size == 16
    assert wl.layers_per_stage == 14
    assert wl.tokens_per_rank == 16 * 4096 // 2
    assert wl.tokens_per_nanobatch == 16 * 4096 // 4
    assert "CP=2" in wl.describe()
    assert wl.with_(nanobatches=4).nanobatches == 4
    assert Parallelism(tp=2, dp=3).gpus_per_stage == 2
