"""SM counts, group sizes, dtypes, algorithm choice and message pieces of the collectives
(kareus.exec.collectives._validation): pure logic, no torch."""

from __future__ import annotations

import pytest

from kareus.errors import HardwareError, InvalidSMCountError, KareusError
from kareus.exec import collectives as C

MIB = 1 << 20


# ------------------------------------------------------------------ SM counts


@pytest.mark.parametrize("sms", [1, 2, 64, 131])
def test_valid_sm_counts_pass_through(sms: int) -> None:
    assert C.validate_comm_sms(sms, 132) == sms


@pytest.mark.parametrize("sms", [0, -1, 132, 500])
def test_sm_count_out_of_range_says_the_range(sms: int) -> None:
    with pytest.raises(C.CommSMCountError, match=r"comm_sms must be in 1\.\.131 for a GPU with 132 SMs"):
        C.validate_comm_sms(sms, 132)


@pytest.mark.parametrize("sms", [2.0, "4", True, None])
def test_sm_count_must_be_int(sms: object) -> None:
    with pytest.raises(C.CommSMCountError, match="must be an int"):
        C.validate_comm_sms(sms, 132)


def test_backend_limit_is_reported_with_backend_name() -> None:
    with pytest.raises(C.CommSMCountError, match=r"1\.\.64 for the nccl_capped backend"):
        C.validate_comm_sms(100, 132, backend_limit=64, backend="nccl_capped")


def test_sm_count_error_types() -> None:
    err = C.CommSMCountError("x")
    assert isinstance(err, ValueError)
    assert isinstance(err, InvalidSMCountError)
    assert isinstance(err, KareusError)
    assert isinstance(C.CollectiveUnavailableError("x"), RuntimeError)
    assert isinstance(C.CollectiveUnavailableError("x"), HardwareError)
    assert isinstance(C.CollectiveArgumentError("x"), ValueError)
    assert isinstance(C.ExtensionBuildError("x"), RuntimeError)


# --------------------------------------------------------------- other checks


@pytest.mark.parametrize("world", [2, 4, 8])
def test_supported_world_sizes(world: int) -> None:
    assert C.validate_world_size(world) == world


@pytest.mark.parametrize("world", [1, 3, 6, 16])
def test_unsupported_world_size_points_to_nccl(world: int) -> None:
    with pytest.raises(C.CollectiveArgumentError, match="NCCLCappedCollective"):
        C.validate_world_size(world)


@pytest.mark.parametrize(
    ("given", "canonical"),
    [("bfloat16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("bf16", "bfloat16"),
     ("torch.float16", "float16"), ("half", "float16"), ("fp32", "float32"), ("float", "float32")],
)
def test_dtype_names(given: str, canonical: str) -> None:
    assert C.validate_dtype(given) == canonical


@pytest.mark.parametrize("bad", ["int8", "torch.float64", "float8_e4m3fn"])
def test_unsupported_dtype(bad: str) -> None:
    with pytest.raises(C.CollectiveArgumentError, match="cast the tensor"):
        C.validate_dtype(bad)


def test_all_reduce_algorithm_choice() -> None:
    assert C.choose_all_reduce_algorithm(4096, 4) == "one_shot"
    assert C.choose_all_reduce_algorithm(C.ONE_SHOT_MAX_BYTES, 4) == "one_shot"
    assert C.choose_all_reduce_algorithm(C.ONE_SHOT_MAX_BYTES + 1, 4) == "two_shot"
    assert C.choose_all_reduce_algorithm(256 * MIB, 2) == "one_shot"
    assert C.choose_all_reduce_algorithm(4096, 8, "two_shot") == "two_shot"
    with pytest.raises(C.CollectiveArgumentError, match="one_shot"):
        C.choose_all_reduce_algorithm(4096, 4, "ring")


def test_bus_bandwidth_factors_follow_nccl_tests() -> None:
    assert C.bus_bandwidth_factor("all_reduce", 4) == pytest.approx(1.5)
    assert C.bus_bandwidth_factor("all_reduce", 2) == pytest.approx(1.0)
    assert C.bus_bandwidth_factor("all_gather", 4) == pytest.approx(0.75)
    assert C.bus_bandwidth_factor("reduce_scatter", 8) == pytest.approx(0.875)
    with pytest.raises(C.CollectiveArgumentError):
        C.bus_bandwidth_factor("broadcast", 4)


# ------------------------------------------------------------- piece planning


def test_staging_need_matches_kernel_layout() -> None:
    # two-shot: 2 * world * chunk, chunk = ceil(numel/world) rounded up to 8 bf16 elements
    assert C.staging_bytes_needed("all_reduce", 1000, 2, 4, "two_shot") == 2 * 4 * 256 * 2
    assert C.staging_bytes_needed("all_reduce", 1001, 2, 4, "two_shot") == 2 * 4 * 256 * 2
    assert C.staging_bytes_needed("all_reduce", 1, 4, 4, "two_shot") == 2 * 4 * 4 * 4
    # one-shot and the others: world slots of the (rounded) message / shard
    assert C.staging_bytes_needed("all_reduce", 1001, 2, 4, "one_shot") == 4 * 1008 * 2
    assert C.staging_bytes_needed("all_gather", 7, 4, 8) == 8 * 8 * 4


@pytest.mark.parametrize("op", C.COLLECTIVE_OPS)
@pytest.mark.parametrize("numel", [1, 7, 4096, 3 * MIB + 5, 128 * MIB + 3])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_pieces_cover_the_message_and_fit(op: str, numel: int, world: int) -> None:
    staging = 64 * MIB
    algo = "two_shot" if op == "all_reduce" else "one_shot"
    pieces = C.plan_pieces(op, numel, 2, world, staging, algo)
    assert pieces[0][0] == 0
    assert sum(count for _, count in pieces) == numel
    for (s0, c0), (s1, _) in zip(pieces, pieces[1:]):
        assert s0 + c0 == s1
    for start, count in pieces:
        assert count > 0
        assert (start * 2) % 16 == 0  # pieces keep 16-byte alignment
        assert C.staging_bytes_needed(op, count, 2, world, algo) <= staging
    sizes = [count for _, count in pieces]
    assert max(sizes) - min(sizes) <= 128 * len(pieces)  # balanced: no sliver at the end


def test_pieces_of_empty_message() -> None:
    assert C.plan_pieces("all_reduce", 0, 2, 4, MIB) == []


def test_pieces_need_some_staging() -> None:
    with pytest.raises(C.CollectiveArgumentError, match="too small"):
        C.plan_pieces("all_gather", 10**6, 4, 8, 64)


def test_registered_all_reduce_algorithms() -> None:
    assert C.choose_registered_all_reduce_algorithm(64 * MIB, 4, "two_phase") == "two_phase"
    assert C.choose_registered_all_reduce_algorithm(64 * MIB, 4) in ("one_phase", "two_phase")
    with pytest.raises(C.CollectiveArgumentError, match="registered_algorithm"):
        C.choose_registered_all_reduce_algorithm(64 * MIB, 4, "two_shot")


def test_registered_staging_needs() -> None:
    # one-phase stores straight into the peers' tensors: no staging; two-phase: world chunks
    assert C.staging_bytes_needed("all_reduce", 10**6, 2, 4, "one_phase") == 0
    assert C.plan_pieces("all_reduce", 10**9, 2, 4, MIB, "one_phase") == [(0, 10**9)]
    assert C.staging_bytes_needed("all_reduce", 1000, 2, 4, "two_phase") == 4 * 256 * 2
    pieces = C.plan_pieces("all_reduce", 10**6, 2, 4, MIB, "two_phase")
    assert len(pieces) == 2 and sum(c for _, c in pieces) == 10**6
