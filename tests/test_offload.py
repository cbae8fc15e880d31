"""offload/onboard argument checks and the record of offloaded slots (kvgen.runtime.offload), on the
CPU: strategies by ABI version, refused strategies, cold storage and staging tensors that cannot be
used, slot ids out of range, onboarding a slot never offloaded. Exact messages (no tolerance)."""

from __future__ import annotations

import pytest
import torch

from kvgen.runtime.offload import (
    OffloadedSlots,
    check_host_cold,
    check_slots,
    check_staging_tensor,
    check_strategy,
    default_strategy,
)


def test_default_strategy_is_staged_where_the_library_has_it() -> None:
    assert default_strategy(2)[0] == "staged"
    strategy, reason = default_strategy(1)
    assert strategy == "zero-copy" and "ABI version 1" in reason


def test_strategy_names_and_abi_are_checked() -> None:
    assert check_strategy("zero-copy", 1) == "zero-copy"
    with pytest.raises(ValueError, match="expected one of staged, zero-copy, got 'device'"):
        check_strategy("device", 2)
    with pytest.raises(ValueError, match="needs a library of C ABI version 2, this one has 1"):
        check_strategy("staged", 1)


def test_cold_storage_must_be_pinned_host_whole_pages() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="pinned host memory"):
        check_host_cold(torch.zeros(64, dtype=torch.uint8), 16, cpu)
    with pytest.raises(ValueError, match="contiguous uint8"):
        check_host_cold(torch.zeros(64, dtype=torch.int8), 16, cpu)


def test_staging_tensor_must_be_contiguous_uint8_on_the_gpu() -> None:
    with pytest.raises(ValueError, match="contiguous uint8 tensor, got torch.float32"):
        check_staging_tensor(torch.zeros(4))
    with pytest.raises(ValueError, match="not contiguous"):
        check_staging_tensor(torch.zeros(4, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="must be GPU memory"):
        check_staging_tensor(torch.zeros(64, dtype=torch.uint8))


def test_slots_out_of_range_are_named() -> None:
    check_slots(torch.tensor([0, 3], dtype=torch.int32), 4)
    check_slots(torch.tensor([], dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"cold slot 4 outside \[0, 4\)"):
        check_slots(torch.tensor([1, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"cold slot -1 outside"):
        check_slots(torch.tensor([-1], dtype=torch.int32), 4)


def test_onboarding_a_slot_never_offloaded_is_refused() -> None:
    cold, other = torch.zeros(4 * 16, dtype=torch.uint8), torch.zeros(4 * 16, dtype=torch.uint8)
    record = OffloadedSlots()
    with pytest.raises(ValueError, match="cold slot 0 of lifecycle 0 was never offloaded"):
        record.require(cold, 0, torch.tensor([0], dtype=torch.int32))
    record.mark(cold, 0, torch.tensor([0, 2], dtype=torch.int32), 4)
    record.require(cold, 0, torch.tensor([2, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="cold slot 1 of lifecycle 0"):
        record.require(cold, 0, torch.tensor([2, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="lifecycle 1"):     # another lifecycle has its own slots
        record.require(cold, 1, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="cold slot 0"):     # another cold storage too
        record.require(other, 0, torch.tensor([0], dtype=torch.int32))
