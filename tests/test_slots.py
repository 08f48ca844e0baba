"""Slots, padding and bounds (DESIGN.md section 3).

Pad rows and slots outside [0, S) never touch the pool and give y = 0; a pad
destination computes y but writes nothing; checked mode turns a bad slot into an
error naming the row and the slot; duplicate destinations: the last row wins,
checked mode rejects them (and a row writing a slot another row reads); T == 0 is
a no-op."""

import re

import pytest
import torch

import torch_ssd
from conftest import (
    apply_layout,
    assert_outside_view_unchanged,
    assert_step_matches_reference,
    storage_base,
    make_inputs,
    run_step,
    run_step_out,
)

H, P, N, G = 4, 8, 19, 2


def inputs_with(device, src, dst=None, S=8, pool_dtype=torch.bfloat16, pad_slot_id=-1, idx_dtype=torch.int64):
    T = len(src)
    inputs = make_inputs(S, T, H, P, N, G, device=device, pool_dtype=pool_dtype, dtype=torch.float32,
                         slots="identity" if T <= S else "slot_idx", pad_slot_id=pad_slot_id)
    inputs["slot_idx"] = torch.tensor(src, dtype=idx_dtype, device=device)
    inputs["dst_slot_idx"] = None if dst is None else torch.tensor(dst, dtype=idx_dtype, device=device)
    return inputs


@pytest.mark.parametrize("layout", ["contiguous", "pool_slice", "pool_n_stride"])
@pytest.mark.parametrize("use_out", [False, True], ids=["decode_step", "decode_step_out"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_pad_and_out_of_range_rows(device, unchecked_mode, idx_dtype, use_out, layout):
    """Rows 1 (pad), 3 (slot S) and 4 (slot -5) touch nothing and give y = 0; the
    other rows are right; the slots nobody addresses keep every bit, and so does the
    storage around a strided pool view (where slot S or -5 would land)."""
    S = 8
    src = [2, -1, 5, S, -5, 0]
    inputs = apply_layout(inputs_with(device, src, S=S, idx_dtype=idx_dtype), layout)
    before = inputs["ssm_pool"].clone()
    base_before = storage_base(inputs["ssm_pool"]).clone()
    y = run_step_out(inputs) if use_out else run_step(inputs)
    for t in (1, 3, 4):
        assert not y[t].any(), f"row {t} is a pad row: y must be 0"
    for slot in (1, 3, 4, 6, 7):
        assert torch.equal(inputs["ssm_pool"][slot], before[slot])
    assert_outside_view_unchanged(inputs["ssm_pool"], base_before)
    assert_step_matches_reference(inputs, before, y)


def test_out_of_range_destinations_write_nothing(device, unchecked_mode):
    """A dst slot that is pad or outside the pool: y is computed, no state is written."""
    S = 8
    src = [0, 1, 2, 3]
    dst = [4, -1, S + 100, -2]
    inputs = inputs_with(device, src, dst, S=S)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert y[1].any() and y[2].any() and y[3].any(), "rows with a pad destination still compute y"
    changed = [s for s in range(S) if not torch.equal(inputs["ssm_pool"][s], before[s])]
    assert changed == [4]
    assert_step_matches_reference(inputs, before, y)


def test_pad_source_with_valid_destination_writes_nothing(device):
    inputs = inputs_with(device, [-1, 1], [5, 6])
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert not y[0].any()
    assert torch.equal(inputs["ssm_pool"][5], before[5])
    assert_step_matches_reference(inputs, before, y)


def test_non_default_pad_slot_id(device):
    """pad_slot_id may be a slot number: that slot is then never read or written."""
    inputs = inputs_with(device, [3, 1, 3, 6], [2, 3, 0, 3], pad_slot_id=3)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert not y[0].any() and not y[2].any()
    assert torch.equal(inputs["ssm_pool"][3], before[3])
    assert torch.equal(inputs["ssm_pool"][2], before[2])  # row 0 reads the pad: writes nothing
    assert_step_matches_reference(inputs, before, y)


def test_loader_verbs_treat_bad_slots_as_pad(device, unchecked_mode):
    S = 6
    pool = torch.randn(S, H, P, N, device=device).to(torch.float16)
    before = pool.clone()
    idx = torch.tensor([1, -1, S, -7, 4], device=device)
    state = torch.ops.ssd.load_state(pool, idx)
    for t in (1, 2, 3):
        assert not state[t].any(), f"row {t}: pad/out-of-range rows load as 0"
    assert torch.equal(state[0], pool[1].float()) and torch.equal(state[4], pool[4].float())
    new = torch.randn(5, H, P, N, device=device)
    torch.ops.ssd.store_state(new, pool, idx)
    for slot in (0, 2, 3, 5):
        assert torch.equal(pool[slot], before[slot])
    assert torch.equal(pool[1], new[0].half()) and torch.equal(pool[4], new[4].half())


# ---------------------------------------------------------------------------
# Checked mode
# ---------------------------------------------------------------------------


def test_set_checks_round_trip():
    before = torch_ssd.checks_enabled()
    try:
        torch_ssd.set_checks(True)
        assert torch_ssd.checks_enabled() is True
        torch_ssd.set_checks(False)
        assert torch_ssd.checks_enabled() is False
    finally:
        torch_ssd.set_checks(before)


def row_and_slot(row, slot):
    """The error must name the row and the bad slot."""
    return re.compile(rf"row {row}\b.*(?<![\w-]){re.escape(str(slot))}(?!\d)", re.S)


@pytest.mark.parametrize("bad", [8, -5, 1 << 40], ids=["S", "negative", "huge"])
@pytest.mark.parametrize("which", ["slot_idx", "dst_slot_idx"])
@pytest.mark.parametrize("use_out", [False, True], ids=["decode_step", "decode_step_out"])
def test_checked_mode_rejects_bad_slot(device, checked_mode, which, bad, use_out):
    src = [2, 0, 5]
    dst = [1, 3, 4]
    (src if which == "slot_idx" else dst)[2] = bad
    inputs = inputs_with(device, src, dst, S=8)
    before = inputs["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=row_and_slot(2, bad)) as info:
        run_step_out(inputs) if use_out else run_step(inputs)
    assert re.search(rf"(?<!\w){which}\b", str(info.value)), f"the message must name {which}"
    assert torch.equal(inputs["ssm_pool"], before)


def test_checked_mode_accepts_pad_rows(device, checked_mode):
    inputs = inputs_with(device, [2, -1, 5], [1, 3, -1], S=8)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert_step_matches_reference(inputs, before, y)


def test_checked_mode_loader_verbs(device, checked_mode):
    pool = torch.randn(4, H, P, N, device=device)
    before = pool.clone()
    idx = torch.tensor([0, -1, 4], device=device)
    with pytest.raises(RuntimeError, match=row_and_slot(2, 4)):
        torch.ops.ssd.load_state(pool, idx)
    with pytest.raises(RuntimeError, match=row_and_slot(2, 4)):
        torch.ops.ssd.store_state(torch.randn(3, H, P, N, device=device), pool, idx)
    assert torch.equal(pool, before)


def test_checks_are_off_after_the_fixture():
    """The checked_mode fixture restores the previous setting (other tests rely on it)."""
    import os

    if os.environ.get("TORCH_SSD_CHECKS", "0") in ("", "0"):
        assert not torch_ssd.checks_enabled()


# ---------------------------------------------------------------------------
# Duplicate destination slots
# ---------------------------------------------------------------------------


def test_duplicate_destinations_last_row_wins(device, unchecked_mode):
    inputs = inputs_with(device, [0, 1, 2, 3], [5, 6, 5, 5], S=8)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert_step_matches_reference(inputs, before, y)  # slot 5 holds row 3's state
    # Every row still computes its y.
    solo = inputs_with(device, [0, 1, 2, 3], [4, 6, 7, -1], S=8)
    assert torch.equal(run_step(solo), y)


def test_duplicate_in_place_slots_last_row_wins(device, unchecked_mode):
    """Without dst_slot_idx the source slots are the destinations."""
    inputs = inputs_with(device, [4, 1, 4], S=8)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    # Both rows read slot 4 before anything is written; row 2 wins the write.
    assert_step_matches_reference(inputs, before, y)


def test_later_pad_row_does_not_win(device, unchecked_mode):
    """A later row with the same destination but a pad source writes nothing, so the
    earlier row's state stays."""
    inputs = inputs_with(device, [0, -1], [5, 5], S=8)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert not torch.equal(inputs["ssm_pool"][5], before[5])
    assert_step_matches_reference(inputs, before, y)


def test_store_state_duplicates_last_row_wins(device, unchecked_mode):
    pool = torch.zeros(4, H, P, N, device=device)
    state = torch.randn(3, H, P, N, device=device)
    torch.ops.ssd.store_state(state, pool, torch.tensor([2, 2, 2], device=device))
    assert torch.equal(pool[2], state[2])
    assert not pool[0].any() and not pool[1].any() and not pool[3].any()


def test_checked_mode_rejects_duplicates(device, checked_mode):
    inputs = inputs_with(device, [0, 1, 2], [5, 6, 5], S=8)
    before = inputs["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=r"rows 0 and 2 .*slot 5.*dst_slot_idx"):
        run_step(inputs)
    in_place = inputs_with(device, [3, 1, 3], S=8)
    with pytest.raises(RuntimeError, match=r"rows 0 and 2 .*slot 3.*slot_idx"):
        run_step(in_place)
    assert torch.equal(inputs["ssm_pool"], before)
    pool = torch.zeros(4, H, P, N, device=device)
    with pytest.raises(RuntimeError, match=r"rows 1 and 2 .*slot 0.*slot_idx"):
        torch.ops.ssd.store_state(torch.randn(3, H, P, N, device=device), pool,
                                  torch.tensor([3, 0, 0], device=device))
    assert not pool.any()


def test_checked_mode_ignores_duplicates_from_pad_rows(device, checked_mode):
    # Row 0 reads the pad slot, so it writes nothing: its destination is no duplicate.
    inputs = inputs_with(device, [-1, 1], [5, 5], S=8)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert_step_matches_reference(inputs, before, y)


def test_checked_mode_rejects_read_write_hazard(device, checked_mode):
    # Row 0 writes slot 1, which row 1 reads: the answer would depend on row order.
    inputs = inputs_with(device, [0, 1], [1, 2], S=8)
    before = inputs["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=r"row 0 writes slot 1 .*another row reads"):
        run_step(inputs)
    assert torch.equal(inputs["ssm_pool"], before)
    # Writing back into one's own source slot is no hazard.
    own = inputs_with(device, [0, 1], [0, 1], S=8)
    before = own["ssm_pool"].clone()
    assert_step_matches_reference(own, before, run_step(own))


def test_checked_mode_allows_repeated_pad_destinations(device, checked_mode):
    inputs = inputs_with(device, [0, 1, 2], [-1, 6, -1], S=8)
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert_step_matches_reference(inputs, before, y)


# ---------------------------------------------------------------------------
# T == 0
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_slots", [False, True], ids=["no_slot_idx", "slot_idx"])
def test_zero_rows(device, with_slots):
    inputs = make_inputs(5, 0, H, P, N, G, device=device, pool_dtype=torch.bfloat16, dtype=torch.float16,
                         slots="dst" if with_slots else "identity")
    before = inputs["ssm_pool"].clone()
    y = run_step(inputs)
    assert y.shape == (0, H, P) and y.dtype == torch.float16 and y.device == inputs["x"].device
    out = torch.empty(0, H, P, dtype=torch.float16, device=device)
    run_step_out(inputs, out=out)
    assert torch.equal(inputs["ssm_pool"], before)

    idx = inputs["slot_idx"] if with_slots else torch.empty(0, dtype=torch.int64, device=device)
    state = torch.ops.ssd.load_state(inputs["ssm_pool"], idx)
    assert state.shape == (0, H, P, N) and state.dtype == torch.float32
    Bf, Cf = torch.ops.ssd.load_bc(inputs["B"], inputs["C"])
    assert Bf.shape == (0, G, N) and Cf.shape == (0, G, N)
    torch.ops.ssd.store_state(torch.empty(0, H, P, N, device=device), inputs["ssm_pool"],
                              inputs["slot_idx"])
    assert torch.equal(inputs["ssm_pool"], before)
    y_api = torch_ssd.decode_step(**inputs)
    assert y_api.shape == (0, H, P)
