"""The multi-token decode step (docs/multi_token.md): decode_step_multi(_out) and
decode_step_varlen(_out).

The reference is the single-token reference applied token by token
(torch_ssd.reference_multi, float64). Also: bit-identity with K single-token steps of
the same backend on a float32 pool, with the varlen form, and across layouts; slot
semantics (num_accepted_tokens, per-token destinations, pads, duplicates); bad input;
opcheck; torch.compile; the schemas.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo.testing
import torch._inductor.compile_fx as compile_fx
import torch._inductor.config as inductor_config
from expecttest import assert_expected_inline

import torch_ssd
from conftest import (
    _seed,
    apply_layout,
    assert_lean_kernel_runs,
    assert_outside_view_unchanged,
    relative_error,
    y_tolerance,
)
from torch_ssd import reference_multi

H, P, N, G = 4, 3, 20, 2  # N = 20: one full chunk of 16 and a tail of 4
PAD = -1

MULTI_ARGS = (
    "ssm_pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus",
    "slot_idx", "dst_slot_idx", "pad_slot_id", "num_accepted_tokens", "write_state",
)
VARLEN_ARGS = MULTI_ARGS[:6] + ("cu_seqlens",) + MULTI_ARGS[6:]
OPS = ("decode_step_multi", "decode_step_multi_out", "decode_step_varlen", "decode_step_varlen_out")


def _has_kernel(device: str) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}[device]
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"ssd::{op}", key) for op in OPS)


@pytest.fixture
def mdevice(device):
    """The conftest devices that have the multi-token kernels (CUDA / MPS: once ported)."""
    if not _has_kernel(device):
        pytest.skip(f"no multi-token kernel for {device} yet")
    return device


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def token_operands(lead: tuple, S: int, *, N: int = N, H: int = H, P: int = P, pool_dtype=torch.float32,
                   dtype=torch.float32, per_head: bool = False, seed=0) -> dict:
    """Random operands; ``lead`` is x's leading shape: (T, K) or (L,).

    ``per_head``: dt, A, D, dt_bias hold one value per head (laid out in full), so
    apply_layout(..., "broadcast") can expand them with stride 0.
    """
    gen = torch.Generator().manual_seed(_seed(lead, S, N, seed))

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def head(full, per):
        return randn(*(per if per_head else full))

    dt = (head((*lead, H, P), (*lead, H, 1)) - 1.0).expand(*lead, H, P).contiguous()
    A = -torch.exp(head((H, P, N), (H, 1, 1)) * 0.5).expand(H, P, N).contiguous()
    D = head((H, P), (H, 1)).expand(H, P).contiguous()
    dt_bias = (head((H, P), (H, 1)) * 0.5).expand(H, P).contiguous()
    return {
        "ssm_pool": randn(S, H, P, N).to(pool_dtype),
        "x": randn(*lead, H, P).to(dtype),
        "dt": dt.to(dtype),
        "A": A.to(dtype),
        "B": randn(*lead, G, N).to(dtype),
        "C": randn(*lead, G, N).to(dtype),
        "D": D.to(dtype),
        "z": randn(*lead, H, P).to(dtype),
        "dt_bias": dt_bias.to(dtype),
        "dt_softplus": True,
        "slot_idx": None,
        "dst_slot_idx": None,
        "pad_slot_id": PAD,
        "num_accepted_tokens": None,
        "write_state": True,
    }


FIXED_PATTERNS = (
    "final_in_place",  # slot_idx (T,), no dst: the state after the last token goes back to the source
    "final_to_dst",    # slot_idx (T,), dst_slot_idx (T,)
    "per_token",       # slot_idx (T,), dst_slot_idx (T, K): one slot per token
    "spec_zero",       # vLLM: one (T, K) table for source and destinations, num_accepted_tokens = 0
    "spec_none",       # num_accepted_tokens = 1: no draft token was accepted
    "spec_all",        # num_accepted_tokens = K: all accepted
    "spec_mixed",      # a mix of 0..K, a pad row, pad destinations
    "no_write",        # spec_mixed with write_state=False
)


def set_slots(d: dict, pattern: str, T: int, K: int, *, idx_dtype=torch.int64, seed=0) -> dict:
    """Fill the slot arguments for ``pattern``; every row's slots are its own."""
    S = d["ssm_pool"].shape[0]
    gen = torch.Generator().manual_seed(_seed(pattern, T, K, seed))
    perm = torch.randperm(S, generator=gen)
    table = perm[: T * K].view(T, K).clone()
    if pattern == "final_in_place":
        d["slot_idx"] = perm[:T].clone()
    elif pattern == "final_to_dst":
        d["slot_idx"], d["dst_slot_idx"] = perm[:T].clone(), perm[T : 2 * T].clone()
    elif pattern == "per_token":
        d["slot_idx"] = perm[T * K : T * K + T].clone()
        d["dst_slot_idx"] = table
    else:
        n = {"spec_zero": 0, "spec_none": 1, "spec_all": K}.get(pattern)
        accepted = (torch.full((T,), n) if n is not None
                    else torch.randint(0, K + 1, (T,), generator=gen))
        if pattern in ("spec_mixed", "no_write"):
            accepted[0] = K
            if T > 1:
                accepted[1] = 0
            if T > 2:  # a pad row: its source column holds the pad id
                table[2, max(int(accepted[2]) - 1, 0)] = PAD
            if T > 3 and K > 1:  # a token that writes nothing
                table[3, K - 1] = PAD
        d["slot_idx"], d["num_accepted_tokens"] = table, accepted
        d["write_state"] = pattern != "no_write"
    for name in ("slot_idx", "dst_slot_idx", "num_accepted_tokens"):
        if d[name] is not None:
            d[name] = d[name].to(idx_dtype)
    return d


def to_device(d: dict, device: str) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def clone(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            c = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device)
            c.copy_(v)
            v = c
        out[k] = v
    return out


def multi_args(d: dict) -> tuple:
    return tuple(d[name] for name in MULTI_ARGS)


def varlen_args(d: dict) -> tuple:
    return tuple(d[name] for name in VARLEN_ARGS)


def cpu_args(d: dict, names) -> dict:
    return {k: (d[k].detach().cpu() if isinstance(d[k], torch.Tensor) else d[k]) for k in names}


# ---------------------------------------------------------------------------
# Checking against the reference
# ---------------------------------------------------------------------------


def expected_writes(S: int, pad: int, src: list[int], dst: list[list[int]]) -> dict[int, tuple[int, int]]:
    """slot -> (row, token) of the write that lands there: rows with an addressable
    source, addressable destinations, the last write in (row, token) order."""
    def ok(s):
        return s != pad and 0 <= s < S

    writes = {}
    for t, row in enumerate(dst):
        if not ok(src[t]):
            continue
        for k, slot in enumerate(row):
            if ok(slot):
                writes[slot] = (t, k)
    return writes


def assert_pool_matches(pool_after, pool_before, states64, writes, row_src):
    """Unwritten slots bit-for-bit as before; written slots within an ulp of the pool
    dtype of the float64 state, plus float32 rounding that grows with the token count."""
    pool_after, pool_before = pool_after.detach().cpu(), pool_before.detach().cpu()
    for slot in range(pool_after.shape[0]):
        if slot not in writes:
            assert torch.equal(pool_after[slot], pool_before[slot]), f"slot {slot} is not written but changed"
    fi = torch.finfo(pool_before.dtype)
    eps32 = torch.finfo(torch.float32).eps
    for slot, (t, k) in writes.items():
        s = states64[t][k].double()
        scale = max(float(pool_before[row_src[t]].double().abs().max()),
                    float(max(states64[t][j].abs().max() for j in range(len(states64[t])))))
        bound = fi.eps * s.abs() + fi.smallest_normal + 64 * (k + 1) * eps32 * scale
        err = (pool_after[slot].double() - s).abs()
        assert (err <= bound).all(), (
            f"slot {slot} (row {t}, token {k}): worst excess {float((err - bound).max()):.3g}")


def assert_y_close(y, y64, rows_live, dtype):
    """y of live rows within y_tolerance (relative norm); y of other rows exactly 0."""
    y = y.detach().cpu()
    for t in range(y.shape[0]):
        if t not in rows_live:
            assert torch.equal(y[t], torch.zeros_like(y[t])), f"pad row {t}: y must be 0"
    if rows_live:
        err = relative_error(y[rows_live], y64[rows_live])
        assert err <= y_tolerance(dtype), f"y: relative error {err:.3g} (x {dtype})"


def check_fixed_against_reference(d: dict, y: torch.Tensor, pool_before: torch.Tensor):
    ref = cpu_args(dict(d, ssm_pool=pool_before), MULTI_ARGS)
    y64, _, states64 = reference_multi.decode_step_multi(**ref, compute_dtype=torch.float64)
    T, K = d["x"].shape[:2]
    S = pool_before.shape[0]
    src = reference_multi.source_slots(T, S, ref["slot_idx"], ref["num_accepted_tokens"], PAD)
    dst = reference_multi.dest_slots(T, [K] * T, ref["slot_idx"], ref["dst_slot_idx"], ref["write_state"])
    live = [t for t in range(T) if src[t] != PAD and 0 <= src[t] < S and K > 0]
    assert y.shape == d["x"].shape and y.dtype == d["x"].dtype
    assert_y_close(y, y64, live, d["x"].dtype)
    writes = expected_writes(S, PAD, src, dst)
    assert_pool_matches(d["ssm_pool"], pool_before, [states64[t] for t in range(T)], writes, src)
    return writes


# ---------------------------------------------------------------------------
# Fixed form against the reference
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16), ids=("f32", "bf16"))
@pytest.mark.parametrize("pattern", FIXED_PATTERNS)
@pytest.mark.parametrize("K", (1, 2, 4, 8))
def test_fixed_matches_reference(mdevice, K, pattern, pool_dtype):
    T = 4
    d = token_operands((T, K), T * K + T + 3, pool_dtype=pool_dtype, seed=K)
    d = to_device(set_slots(d, pattern, T, K), mdevice)
    before = d["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(d))
    writes = check_fixed_against_reference(d, y, before)
    if pattern == "no_write":
        assert not writes and torch.equal(d["ssm_pool"], before)
    elif pattern in ("spec_zero", "spec_none", "spec_all", "per_token"):
        assert len(writes) == T * K  # every token of every row writes its own slot
    elif pattern == "spec_mixed":
        assert len(writes) >= K  # row 0 is live and writes all its tokens


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "f16"))
def test_fixed_low_precision_inputs(mdevice, dtype):
    """x, B, C, ... in 16 bits, y in x's dtype, a float16 pool."""
    T, K = 3, 4
    d = token_operands((T, K), 20, pool_dtype=torch.float16, dtype=dtype)
    d = to_device(set_slots(d, "spec_mixed", T, K, idx_dtype=torch.int32), mdevice)
    before = d["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(d))
    check_fixed_against_reference(d, y, before)


def test_one_rounding_per_written_state(mdevice):
    """A bfloat16 pool: the state after token k is the float32 state rounded once, not
    the result of k rounded single steps (which the pool would hold after k steps)."""
    T, K = 4, 8
    d = to_device(set_slots(token_operands((T, K), 40, pool_dtype=torch.bfloat16), "per_token", T, K), mdevice)
    multi = clone(d)
    torch.ops.ssd.decode_step_multi(*multi_args(multi))
    # K single steps through the pool round the state K times.
    singles = clone(d)
    src = singles["slot_idx"]
    for k in range(K):
        dst = singles["dst_slot_idx"][:, k]
        torch.ops.ssd.decode_step(singles["ssm_pool"], singles["x"][:, k], singles["dt"][:, k], singles["A"],
                                  singles["B"][:, k], singles["C"][:, k], singles["D"], singles["z"][:, k],
                                  singles["dt_bias"], True, src, dst, PAD)
        src = dst
    last = d["dst_slot_idx"][:, -1]
    ref = cpu_args(d, MULTI_ARGS)
    _, _, states64 = reference_multi.decode_step_multi(**ref, compute_dtype=torch.float64)
    exact = states64[:, -1]
    err_multi = (multi["ssm_pool"][last].cpu().double() - exact).abs().mean()
    err_singles = (singles["ssm_pool"][last].cpu().double() - exact).abs().mean()
    assert err_multi < err_singles, (err_multi, err_singles)


# ---------------------------------------------------------------------------
# Bit-identity: K single steps (float32 pool), varlen vs fixed, layouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", (20, 130, 1100))
@pytest.mark.parametrize("per_head", (False, True), ids=("per_channel", "per_head"))
@pytest.mark.parametrize("pattern", ("per_token", "spec_mixed"))
def test_float32_pool_equals_single_steps_bitwise(mdevice, pattern, per_head, n):
    """On a float32 pool rounding is the identity, so K single-token steps of the same
    backend give the same bits: same per-element arithmetic, same reduction tree.
    (N = 130 and 1100: on CUDA several lanes per row with a tail, and a row longer than
    one batch of registers.)"""
    T, K = 4, 4
    d = token_operands((T, K), T * K + T + 3, N=n, per_head=per_head)
    d = to_device(set_slots(d, pattern, T, K), mdevice)
    multi = clone(d)
    y_multi = torch.ops.ssd.decode_step_multi(*multi_args(multi))

    S = d["ssm_pool"].shape[0]
    ref = cpu_args(d, MULTI_ARGS)
    src = torch.tensor(reference_multi.source_slots(T, S, ref["slot_idx"], ref["num_accepted_tokens"], PAD))
    dst = torch.tensor(reference_multi.dest_slots(T, [K] * T, ref["slot_idx"], ref["dst_slot_idx"], True))
    pool = d["ssm_pool"].clone()
    cur = src.to(mdevice)
    ys = []
    for k in range(K):
        # A pad destination writes nothing, so the next token must read the state from
        # a scratch slot instead: give such tokens an unused slot, restored below.
        dst_k = dst[:, k].clone()
        spare = [s for s in range(S) if s not in set(src.tolist()) | set(dst.flatten().tolist())]
        for t in range(T):
            if src[t] == PAD:
                dst_k[t] = PAD  # a pad row stays a pad row
            elif dst_k[t] == PAD:
                dst_k[t] = spare.pop()
        dst_k = dst_k.to(mdevice)
        ys.append(torch.ops.ssd.decode_step(pool, d["x"][:, k], d["dt"][:, k], d["A"], d["B"][:, k], d["C"][:, k],
                                            d["D"], d["z"][:, k], d["dt_bias"], True, cur, dst_k, PAD))
        cur = dst_k
    y_single = torch.stack(ys, 1)
    assert torch.equal(y_multi, y_single)
    for slot in set(dst.flatten().tolist()) - {PAD}:
        rows = [(t, k) for t in range(T) for k in range(K) if dst[t, k] == slot and src[t] != PAD]
        if rows:
            assert torch.equal(multi["ssm_pool"][slot], pool[slot]), f"slot {slot}"


def varlen_from_fixed(d: dict) -> dict:
    """The same rows as a varlen call: tokens flattened row-major, cu_seqlens = K * t."""
    T, K = d["x"].shape[:2]
    v = dict(d)
    for name in ("x", "dt", "B", "C", "z"):
        v[name] = d[name].reshape(T * K, *d[name].shape[2:])
    v["cu_seqlens"] = torch.arange(0, T * K + 1, K, device=d["x"].device)
    return v


@pytest.mark.parametrize("pattern", ("final_in_place", "per_token", "spec_mixed"))
def test_varlen_equals_fixed_bitwise(mdevice, pattern):
    T, K = 3, 4
    d = to_device(set_slots(token_operands((T, K), 20, pool_dtype=torch.bfloat16), pattern, T, K), mdevice)
    fixed = clone(d)
    y_fixed = torch.ops.ssd.decode_step_multi(*multi_args(fixed))
    varlen = clone(varlen_from_fixed(d))
    y_varlen = torch.ops.ssd.decode_step_varlen(*varlen_args(varlen))
    assert torch.equal(y_varlen, y_fixed.reshape(T * K, H, P))
    assert torch.equal(varlen["ssm_pool"], fixed["ssm_pool"])


LAYOUTS = ("transposed", "pool_n_stride", "pool_slice", "offset", "broadcast")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", (5, 16, 35))
def test_layout_never_changes_the_answer(mdevice, layout, n):
    """Bit-identical y and pool whatever the strides (N below, at and off the chunk)."""
    T, K = 3, 4
    base = set_slots(token_operands((T, K), 17, N=n, pool_dtype=torch.bfloat16, per_head=True), "spec_mixed", T, K)
    base["out"] = torch.zeros(T, K, H, P)
    want = to_device(apply_layout(base, "contiguous"), mdevice)
    y_want = torch.ops.ssd.decode_step_multi(*multi_args(want))
    got = apply_layout(to_device(base, mdevice), layout)
    pool_base_before = got["ssm_pool"]._base.clone() if got["ssm_pool"]._base is not None else None
    torch.ops.ssd.decode_step_multi_out(*multi_args(got), got["out"])
    assert torch.equal(got["out"], y_want), layout
    assert torch.equal(got["ssm_pool"], want["ssm_pool"]), layout
    if pool_base_before is not None:
        assert_outside_view_unchanged(got["ssm_pool"], pool_base_before)


@pytest.mark.parametrize("layout", ("transposed", "offset", "broadcast"))
def test_varlen_layout_never_changes_the_answer(mdevice, layout):
    L = 9
    base = token_operands((L,), 12, N=20, pool_dtype=torch.float32, per_head=True)
    base["cu_seqlens"] = torch.tensor([0, 3, 3, 7])
    base["slot_idx"] = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]])
    base["num_accepted_tokens"] = torch.tensor([2, 1, 4])
    want = to_device(apply_layout(base, "contiguous"), mdevice)
    y_want = torch.ops.ssd.decode_step_varlen(*varlen_args(want))
    got = apply_layout(to_device(base, mdevice), layout)
    y_got = torch.ops.ssd.decode_step_varlen(*varlen_args(got))
    assert torch.equal(y_got, y_want)
    assert torch.equal(got["ssm_pool"], want["ssm_pool"])


# ---------------------------------------------------------------------------
# Varlen form against the reference
# ---------------------------------------------------------------------------


VARLEN_CASES = {
    # lengths (0, 1, K and a tail of tokens no row owns), per-token table, accepted counts
    "per_token": dict(lengths=(3, 0, 1, 4), tail=2, table=True, accepted=(2, 0, 1, 4)),
    "all_accepted": dict(lengths=(4, 4), tail=0, table=True, accepted=(4, 4)),
    "none_accepted": dict(lengths=(2, 3, 1), tail=1, table=True, accepted=(1, 1, 1)),
    "no_accepted_arg": dict(lengths=(2, 3), tail=0, table=True, accepted=None),
    "final_only": dict(lengths=(3, 1, 2), tail=3, table=False, accepted=None),
    "pad_rows": dict(lengths=(2, 2, 2), tail=0, table=True, accepted=(5, 1, 2)),  # n > W: a pad row
    "no_write": dict(lengths=(2, 3), tail=1, table=True, accepted=(2, 3), write_state=False),
}


def varlen_inputs(case: dict, *, pool_dtype=torch.float32, dtype=torch.float32, idx_dtype=torch.int64):
    lengths = case["lengths"]
    T, W = len(lengths), 4
    L = sum(lengths) + case["tail"]
    S = T * W + 5
    d = token_operands((L,), S, pool_dtype=pool_dtype, dtype=dtype, seed=lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    d["cu_seqlens"] = torch.tensor(cu, dtype=idx_dtype)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(7))
    if case["table"]:
        table = perm[: T * W].view(T, W).clone()
        if T > 2:
            table[2, 0] = PAD  # row 2's first token writes nothing (or, when read, a pad row)
        d["slot_idx"] = table.to(idx_dtype)
    else:
        d["slot_idx"] = perm[:T].to(idx_dtype)
        d["dst_slot_idx"] = perm[T : 2 * T].to(idx_dtype)
    if case["accepted"] is not None:
        d["num_accepted_tokens"] = torch.tensor(case["accepted"], dtype=idx_dtype)
    d["write_state"] = case.get("write_state", True)
    return d


@pytest.mark.parametrize("use_out", (False, True), ids=("functional", "out"))
@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16), ids=("f32", "bf16"))
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_matches_reference(mdevice, unchecked_mode, case, pool_dtype, use_out):
    d = to_device(varlen_inputs(VARLEN_CASES[case], pool_dtype=pool_dtype), mdevice)
    before = d["ssm_pool"].clone()
    if use_out:
        y = torch.full_like(d["x"], float("nan"))  # every token is written, the tail with 0
        torch.ops.ssd.decode_step_varlen_out(*varlen_args(d), y)
    else:
        y = torch.ops.ssd.decode_step_varlen(*varlen_args(d))
    ref = cpu_args(dict(d, ssm_pool=before), VARLEN_ARGS)
    y64, _, states64 = reference_multi.decode_step_varlen(**ref, compute_dtype=torch.float64)
    cu = ref["cu_seqlens"].tolist()
    T, S = len(cu) - 1, before.shape[0]
    counts = [cu[t + 1] - cu[t] for t in range(T)]
    src = reference_multi.source_slots(T, S, ref["slot_idx"], ref["num_accepted_tokens"], PAD)
    dst = reference_multi.dest_slots(T, counts, ref["slot_idx"], ref["dst_slot_idx"], ref["write_state"])
    live_tokens = [i for t in range(T) if src[t] != PAD and 0 <= src[t] < S for i in range(cu[t], cu[t + 1])]
    assert_y_close(y, y64, live_tokens, d["x"].dtype)
    writes = expected_writes(S, PAD, src, dst)
    row_states = [[states64[cu[t] + k] for k in range(counts[t])] for t in range(T)]
    assert_pool_matches(d["ssm_pool"], before, row_states, writes, src)
    if not d["write_state"]:
        assert not writes
    else:
        assert writes


@pytest.mark.parametrize("n", (130, 1100))
@pytest.mark.parametrize("pattern", ("per_token", "spec_mixed"))
def test_large_state_matches_reference(mdevice, pattern, n):
    """N beyond one chunk per lane (CUDA: several lanes per row, a tail) and beyond a
    batch of registers (N = 1100), on a bfloat16 pool."""
    T, K = 3, 4
    d = token_operands((T, K), T * K + T + 3, N=n, pool_dtype=torch.bfloat16, seed=n)
    d = to_device(set_slots(d, pattern, T, K), mdevice)
    before = d["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(d))
    check_fixed_against_reference(d, y, before)


@pytest.mark.parametrize("cu", ([2, 4, 4, 6], [1, 3, 2, 9], [5, 7, 3, 4]),
                         ids=("gaps_at_both_ends", "decreasing_and_past_L", "decreasing"))
def test_varlen_tokens_no_row_owns_are_zero(mdevice, unchecked_mode, cu):
    """Unchecked bounds: a row out of bounds or decreasing owns nothing; y is 0 for every
    token no row owns, whatever was in out before."""
    L = 8
    d = token_operands((L,), 16, seed=len(cu))
    d["cu_seqlens"] = torch.tensor(cu)
    d["slot_idx"] = torch.tensor([[0, 1], [2, 3], [4, 5]])
    d["dst_slot_idx"] = torch.tensor([6, 7, 8])
    d = to_device(d, mdevice)
    before = d["ssm_pool"].clone()
    y = torch.full_like(d["x"], float("nan"))
    torch.ops.ssd.decode_step_varlen_out(*varlen_args(d), y)
    y64, pool64, _ = reference_multi.decode_step_varlen(**cpu_args(dict(d, ssm_pool=before), VARLEN_ARGS),
                                                        compute_dtype=torch.float64)
    owned = [i for t in range(3) if 0 <= cu[t] <= cu[t + 1] <= L for i in range(cu[t], cu[t + 1])]
    unowned = [i for i in range(L) if i not in owned]
    assert unowned and owned
    assert torch.equal(y[unowned].cpu(), torch.zeros(len(unowned), H, P))
    assert relative_error(y[owned], y64[owned]) <= y_tolerance(torch.float32)
    torch.testing.assert_close(d["ssm_pool"].cpu().double(), pool64.double(), rtol=1e-5, atol=1e-5)


def test_int32_indices_give_the_same_bits(mdevice):
    wide = to_device(varlen_inputs(VARLEN_CASES["per_token"]), mdevice)
    narrow = to_device(varlen_inputs(VARLEN_CASES["per_token"], idx_dtype=torch.int32), mdevice)
    assert narrow["cu_seqlens"].dtype == narrow["slot_idx"].dtype == torch.int32
    y_wide = torch.ops.ssd.decode_step_varlen(*varlen_args(wide))
    y_narrow = torch.ops.ssd.decode_step_varlen(*varlen_args(narrow))
    assert torch.equal(y_narrow, y_wide) and torch.equal(narrow["ssm_pool"], wide["ssm_pool"])


def test_varlen_empty(mdevice):
    """T = 0 rows, and rows without tokens: nothing read or written, y = 0."""
    d = to_device(token_operands((3,), 5), mdevice)
    before = d["ssm_pool"].clone()
    for cu in ([0], [0, 0, 0]):
        d["cu_seqlens"] = torch.tensor(cu, device=mdevice)
        y = torch.ops.ssd.decode_step_varlen(*varlen_args(d))
        assert torch.equal(y, torch.zeros_like(y))
        assert torch.equal(d["ssm_pool"], before)


def test_fixed_empty(mdevice):
    for T, K in ((0, 3), (2, 0)):
        d = to_device(token_operands((T, K), 5), mdevice)
        before = d["ssm_pool"].clone()
        y = torch.ops.ssd.decode_step_multi(*multi_args(d))
        assert y.shape == (T, K, H, P)
        assert torch.equal(d["ssm_pool"], before)


@pytest.mark.parametrize("dim", ("N", "P", "H"))
def test_empty_dimensions(mdevice, dim):
    """N, P or H = 0: nothing to read (A and the pool rows are empty); y as the reference."""
    sizes = {"N": N, "P": P, "H": H, dim: 0}
    T, K = 3, 2
    d = to_device(set_slots(token_operands((T, K), 10, **sizes), "spec_mixed", T, K), mdevice)
    before = d["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(d))
    y64, _, _ = reference_multi.decode_step_multi(**cpu_args(dict(d, ssm_pool=before), MULTI_ARGS),
                                                  compute_dtype=torch.float64)
    torch.testing.assert_close(y.cpu().double(), y64, rtol=1e-5, atol=1e-5)
    assert torch.equal(d["ssm_pool"], before)  # an empty pool row: nothing to write
    v = to_device(varlen_from_fixed(clone(d)), mdevice)
    assert torch.equal(torch.ops.ssd.decode_step_varlen(*varlen_args(v)), y.reshape(T * K, *y.shape[2:]))


# ---------------------------------------------------------------------------
# Slot semantics
# ---------------------------------------------------------------------------


def test_write_state_false_computes_the_same_y(mdevice):
    T, K = 3, 4
    d = to_device(set_slots(token_operands((T, K), 20), "spec_mixed", T, K), mdevice)
    writing = clone(d)
    y_writing = torch.ops.ssd.decode_step_multi(*multi_args(writing))
    reading = clone(d)
    reading["write_state"] = False
    y_reading = torch.ops.ssd.decode_step_multi(*multi_args(reading))
    assert torch.equal(y_reading, y_writing)
    assert torch.equal(reading["ssm_pool"], d["ssm_pool"])
    assert not torch.equal(writing["ssm_pool"], d["ssm_pool"])


def test_next_step_resumes_from_the_accepted_token(mdevice):
    """Two verification steps on one (T, K) table: after accepting n tokens, the next
    step starting from column n - 1 equals a run over the accepted tokens followed
    by the next step's tokens."""
    T, K = 2, 4
    d = to_device(set_slots(token_operands((T, 2 * K), 20), "spec_all", T, 2 * K), mdevice)
    table = d["slot_idx"][:, :K].contiguous()
    first = {n: d[n][:, :K] for n in ("x", "dt", "B", "C", "z")}
    second = {n: d[n][:, K:] for n in ("x", "dt", "B", "C", "z")}
    accepted = torch.tensor([3, 1], device=mdevice)

    step = clone(d)
    torch.ops.ssd.decode_step_multi(step["ssm_pool"], first["x"], first["dt"], d["A"], first["B"], first["C"],
                                    d["D"], first["z"], d["dt_bias"], True, table[:, 0], table, PAD, None, True)
    y2 = torch.ops.ssd.decode_step_multi(step["ssm_pool"], second["x"], second["dt"], d["A"], second["B"],
                                         second["C"], d["D"], second["z"], d["dt_bias"], True, table, None, PAD,
                                         accepted, True)
    for t in range(T):
        n = int(accepted[t])
        idx = list(range(n)) + list(range(K, 2 * K))
        row = {name: d[name][t : t + 1, idx] for name in ("x", "dt", "B", "C", "z")}
        straight = d["ssm_pool"].clone()
        y_straight = torch.ops.ssd.decode_step_multi(
            straight, row["x"], row["dt"], d["A"], row["B"], row["C"], d["D"], row["z"], d["dt_bias"], True,
            table[t : t + 1, 0], None, PAD, None, False)
        assert torch.equal(y2[t], y_straight[0, n:]), f"row {t}"


def test_duplicate_destinations_last_write_wins(mdevice, unchecked_mode):
    T, K = 3, 2
    d = token_operands((T, K), 10)
    d["slot_idx"] = torch.tensor([0, 1, 2])
    d["dst_slot_idx"] = torch.tensor([[5, 5], [6, 7], [8, 6]])  # (0,0)<(0,1) share 5; (1,0)<(2,1) share 6
    d = to_device(d, mdevice)
    before = d["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(d))
    writes = check_fixed_against_reference(d, y, before)
    assert writes[5] == (0, 1) and writes[6] == (2, 1)


def test_out_of_range_and_bad_accepted_are_pad_rows(mdevice, unchecked_mode):
    T, K = 4, 2
    d = token_operands((T, K), 12)
    d["slot_idx"] = torch.tensor([[0, 1], [2, 1000], [4, 5], [6, 7]])
    d["dst_slot_idx"] = torch.tensor([[8, 9], [10, 11], [-7, 3], [11, 10]])
    d["num_accepted_tokens"] = torch.tensor([1, 2, 3, -1])  # row 1 reads slot 1000; rows 2, 3: n outside [0, 2]
    d = to_device(d, mdevice)
    before = d["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(d))
    assert torch.equal(y[1:], torch.zeros_like(y[1:]))
    changed = [s for s in range(12) if not torch.equal(d["ssm_pool"][s], before[s])]
    assert changed == [8, 9]
    check_fixed_against_reference(d, y, before)


def test_non_default_pad_slot_id(mdevice):
    T, K = 2, 2
    d = token_operands((T, K), 8)
    d["pad_slot_id"] = 7
    d["slot_idx"] = torch.tensor([[0, 1], [7, 3]])
    d["dst_slot_idx"] = torch.tensor([[4, 7], [5, 6]])
    d = to_device(d, mdevice)
    before = d["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(d))
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    changed = [s for s in range(8) if not torch.equal(d["ssm_pool"][s], before[s])]
    assert changed == [4]


# ---------------------------------------------------------------------------
# Checked mode
# ---------------------------------------------------------------------------


def _spec_case():
    T, K = 3, 2
    d = token_operands((T, K), 12)
    d["slot_idx"] = torch.tensor([[0, 1], [2, 3], [4, 5]])
    d["num_accepted_tokens"] = torch.tensor([1, 2, 0])
    return d


CHECKED_CASES = [
    # id, edit, op form, text of the message
    ("bad_source", lambda d: d["slot_idx"].__setitem__((1, 1), 99), "fixed", r"slot_idx\[1, 1\] = 99"),
    ("bad_destination", lambda d: d["slot_idx"].__setitem__((2, 1), 12), "fixed", r"slot_idx\[2, 1\] = 12"),
    ("accepted_above_W", lambda d: d["num_accepted_tokens"].__setitem__(0, 3), "fixed",
     r"num_accepted_tokens\[0\] = 3"),
    ("accepted_negative", lambda d: d["num_accepted_tokens"].__setitem__(2, -1), "fixed",
     r"num_accepted_tokens\[2\] = -1"),
    ("duplicate", lambda d: d["slot_idx"].__setitem__((2, 1), 0), "fixed", r"both write slot 0"),
    ("reads_what_another_writes", lambda d: d.update(dst_slot_idx=torch.tensor([[6, 7], [8, 0], [9, 10]])),
     "fixed", r"row 1 writes slot 0, which row 0 reads"),
    ("cu_decreasing", lambda d: d.update(cu_seqlens=torch.tensor([0, 3, 2, 6])), "varlen",
     r"cu_seqlens must be non-decreasing"),
    ("cu_past_L", lambda d: d.update(cu_seqlens=torch.tensor([0, 2, 4, 7])), "varlen", r"cu_seqlens\[3\] = 7"),
    ("row_longer_than_table", lambda d: d.update(cu_seqlens=torch.tensor([0, 3, 4, 6])), "varlen",
     r"row 0 has 3 tokens but slot_idx has only W = 2"),
]


def _run_form(d, form):
    if form == "fixed":
        return torch.ops.ssd.decode_step_multi(*multi_args(d))
    v = varlen_from_fixed(d)
    if "cu_seqlens" in d:  # the case's own bounds
        v["cu_seqlens"] = d["cu_seqlens"]
    return torch.ops.ssd.decode_step_varlen(*varlen_args(v))


@pytest.mark.parametrize("case", CHECKED_CASES, ids=[c[0] for c in CHECKED_CASES])
def test_checked_mode_rejects(mdevice, checked_mode, case):
    _, edit, form, text = case
    d = _spec_case()
    edit(d)
    d = to_device(d, mdevice)
    before = d["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=text):
        _run_form(d, form)
    assert torch.equal(d["ssm_pool"], before)
    # Unchecked, the same call runs (bad slots are pads, bad rows empty) and stays in bounds.
    torch_ssd.set_checks(False)
    _run_form(d, form)


def test_checked_mode_accepts_valid_spec_calls(mdevice, checked_mode):
    for pattern in ("spec_mixed", "per_token", "final_in_place"):
        d = to_device(set_slots(token_operands((4, 3), 20), pattern, 4, 3), mdevice)
        torch.ops.ssd.decode_step_multi(*multi_args(d))
    d = to_device(varlen_inputs(VARLEN_CASES["per_token"]), mdevice)
    torch.ops.ssd.decode_step_varlen(*varlen_args(d))


# ---------------------------------------------------------------------------
# Bad input: a RuntimeError naming the argument; the pool unchanged
# ---------------------------------------------------------------------------


def _bad_base():
    T, K = 3, 2
    d = token_operands((T, K), 10)
    d["slot_idx"] = torch.tensor([[0, 1], [2, 3], [4, 5]])
    d["num_accepted_tokens"] = torch.tensor([1, 2, 0])
    d["out"] = torch.zeros(T, K, H, P)
    return d


BAD_FIXED = [
    ("pool_rank", "ssm_pool", lambda d: d.update(ssm_pool=d["ssm_pool"][0])),
    ("x_rank", "x", lambda d: d.update(x=d["x"][:, 0])),
    ("x_heads", "x", lambda d: d.update(x=d["x"][:, :, :3])),
    ("x_int", "x", lambda d: d.update(x=d["x"].to(torch.int32))),
    ("dt_tokens", "dt", lambda d: d.update(dt=d["dt"][:, :1])),
    ("dt_float64", "dt", lambda d: d.update(dt=d["dt"].double())),
    ("A_shape", "A", lambda d: d.update(A=d["A"][:, :, :5])),
    ("B_tokens", "B", lambda d: d.update(B=d["B"][:, :1])),
    ("G_not_dividing_H", "B", lambda d: d.update(B=d["B"][:, :, :1].expand(3, 2, 3, N),
                                                 C=d["C"][:, :, :1].expand(3, 2, 3, N))),
    ("C_state", "C", lambda d: d.update(C=d["C"][..., :7])),
    ("D_shape", "D", lambda d: d.update(D=d["D"][:2])),
    ("z_tokens", "z", lambda d: d.update(z=d["z"][:, :1])),
    ("dt_bias_shape", "dt_bias", lambda d: d.update(dt_bias=d["dt_bias"][:, :1])),
    ("slot_float", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"].float())),
    ("slot_rows", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"][:2])),
    ("slot_3d", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"][..., None])),
    ("slot_narrow_as_dst", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"][:, :1])),
    ("dst_too_few_columns", "dst_slot_idx", lambda d: d.update(dst_slot_idx=torch.tensor([[6], [7], [8]]))),
    ("dst_rows", "dst_slot_idx", lambda d: d.update(dst_slot_idx=torch.tensor([6, 7]))),
    ("accepted_with_1d_slots", "num_accepted_tokens", lambda d: d.update(slot_idx=torch.tensor([0, 1, 2]))),
    ("accepted_without_slots", "num_accepted_tokens", lambda d: d.update(slot_idx=None)),
    ("accepted_shape", "num_accepted_tokens", lambda d: d.update(num_accepted_tokens=torch.tensor([1, 1]))),
    ("accepted_float", "num_accepted_tokens", lambda d: d.update(num_accepted_tokens=torch.ones(3))),
    ("out_dtype", "out", lambda d: d.update(out=d["out"].double())),
    ("out_shape", "out", lambda d: d.update(out=d["out"][:, :1])),
]


@pytest.mark.parametrize("use_out", (False, True), ids=("functional", "out"))
@pytest.mark.parametrize("case", BAD_FIXED, ids=[c[0] for c in BAD_FIXED])
def test_bad_input_fixed(mdevice, case, use_out):
    _, name, edit = case
    if name == "out" and not use_out:
        pytest.skip("out only")
    d = _bad_base()
    edit(d)
    d = to_device(d, mdevice)
    before = d["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=re.escape(f"argument '{name}'")):
        if use_out:
            torch.ops.ssd.decode_step_multi_out(*multi_args(d), d["out"])
        else:
            torch.ops.ssd.decode_step_multi(*multi_args(d))
    assert torch.equal(d["ssm_pool"], before)


def test_bad_input_rows_exceed_slots(mdevice):
    d = to_device(token_operands((6, 2), 4), mdevice)
    before = d["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match="ssm_pool has S = 4 slots, fewer than the T = 6 rows"):
        torch.ops.ssd.decode_step_multi(*multi_args(d))
    assert torch.equal(d["ssm_pool"], before)


BAD_VARLEN = [
    ("cu_float", "cu_seqlens", lambda d: d.update(cu_seqlens=d["cu_seqlens"].float())),
    ("cu_2d", "cu_seqlens", lambda d: d.update(cu_seqlens=d["cu_seqlens"][None])),
    ("cu_empty", "cu_seqlens", lambda d: d.update(cu_seqlens=d["cu_seqlens"][:0])),
    ("x_fixed_rank", "x", lambda d: d.update(x=d["x"][None])),
    ("B_tokens", "B", lambda d: d.update(B=d["B"][:2])),
    ("z_tokens", "z", lambda d: d.update(z=d["z"][:2])),
    ("slot_rows", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"][:2])),
    ("dst_rows", "dst_slot_idx", lambda d: d.update(dst_slot_idx=torch.tensor([1, 2]))),
    ("accepted_with_1d_slots", "num_accepted_tokens", lambda d: d.update(slot_idx=d["slot_idx"][:, 0])),
    ("out_shape", "out", lambda d: d.update(out=d["out"][:3])),
]


@pytest.mark.parametrize("case", BAD_VARLEN, ids=[c[0] for c in BAD_VARLEN])
def test_bad_input_varlen(mdevice, case):
    _, name, edit = case
    d = varlen_inputs(VARLEN_CASES["per_token"])
    d["out"] = torch.zeros_like(d["x"])
    edit(d)
    d = to_device(d, mdevice)
    before = d["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=re.escape(f"argument '{name}'")):
        torch.ops.ssd.decode_step_varlen_out(*varlen_args(d), d["out"])
    assert torch.equal(d["ssm_pool"], before)


def test_device_mismatch_is_named():
    if not torch.cuda.is_available() or not _has_kernel("cuda"):
        pytest.skip("needs a second device with the multi-token kernels")
    d = to_device(_bad_base(), "cuda")
    d["x"] = d["x"].cpu()
    with pytest.raises(RuntimeError, match="argument 'x'"):
        torch.ops.ssd.decode_step_multi(*multi_args(d))


@pytest.mark.parametrize("op", ("multi", "varlen"))
def test_autograd_is_refused(mdevice, op):
    if op == "multi":
        d = to_device(_bad_base(), mdevice)
        d["x"] = d["x"].clone().requires_grad_()
        call = lambda: torch.ops.ssd.decode_step_multi(*multi_args(d))  # noqa: E731
    else:
        d = to_device(varlen_inputs(VARLEN_CASES["per_token"]), mdevice)
        d["x"] = d["x"].clone().requires_grad_()
        call = lambda: torch.ops.ssd.decode_step_varlen(*varlen_args(d))  # noqa: E731
    before = d["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match="argument 'x' requires grad"):
        call()
    assert torch.equal(d["ssm_pool"], before)
    with torch.no_grad():
        call()


# ---------------------------------------------------------------------------
# Python API: per-head operands expanded with stride 0
# ---------------------------------------------------------------------------


def test_python_api_per_head(mdevice):
    T, K = 3, 4
    d = to_device(set_slots(token_operands((T, K), 20, per_head=True), "spec_mixed", T, K), mdevice)
    full = clone(d)
    y_full = torch.ops.ssd.decode_step_multi(*multi_args(full))
    api = clone(d)
    kwargs = {k: api[k] for k in MULTI_ARGS}
    kwargs.update(A=api["A"][:, 0, 0], dt=api["dt"][..., 0], D=api["D"][:, 0], dt_bias=api["dt_bias"][:, 0])
    y_api = torch_ssd.decode_step_multi(**kwargs)
    assert torch.equal(y_api, y_full) and torch.equal(api["ssm_pool"], full["ssm_pool"])
    out = torch.empty_like(y_full)
    api2 = clone(d)
    kwargs["ssm_pool"] = api2["ssm_pool"]
    assert torch_ssd.decode_step_multi_out(**kwargs, out=out) is out
    assert torch.equal(out, y_full)

    v = clone(varlen_from_fixed(d))
    vk = {k: v[k] for k in VARLEN_ARGS}
    vk.update(A=v["A"][:, 0, 0], dt=v["dt"][..., 0], D=v["D"][:, 0], dt_bias=v["dt_bias"][:, 0])
    assert torch.equal(torch_ssd.decode_step_varlen(**vk), y_full.reshape(T * K, H, P))
    v2 = clone(varlen_from_fixed(d))
    vk["ssm_pool"] = v2["ssm_pool"]
    out = torch.empty(T * K, H, P, device=mdevice)
    torch_ssd.decode_step_varlen_out(**vk, out=out)
    assert torch.equal(out, y_full.reshape(T * K, H, P))


# ---------------------------------------------------------------------------
# CUDA: graph capture, no host sync, no allocation but y
# ---------------------------------------------------------------------------

needs_cuda_kernels = pytest.mark.skipif(not torch.cuda.is_available() or not _has_kernel("cuda"),
                                        reason="needs a CUDA device and the multi-token CUDA kernels")


def _cuda_case(form: str) -> dict:
    """A vLLM verification step (spec_mixed: pads, per-token writes) on CUDA; the
    varlen form with a padded tail of 2 tokens that no row owns."""
    T, K = 4, 3
    d = set_slots(token_operands((T, K), 30, pool_dtype=torch.bfloat16), "spec_mixed", T, K)
    if form == "varlen":
        d = varlen_from_fixed(d)
        for name in ("x", "dt", "B", "C", "z"):
            d[name] = torch.cat([d[name], d[name][:2]])
    d = to_device(d, "cuda")
    d["out"] = torch.full_like(d["x"], float("nan"))
    return d


def _run_out(d: dict, form: str) -> None:
    if form == "fixed":
        torch.ops.ssd.decode_step_multi_out(*multi_args(d), d["out"])
    else:
        torch.ops.ssd.decode_step_varlen_out(*varlen_args(d), d["out"])


@needs_cuda_kernels
@pytest.mark.parametrize("form", ("fixed", "varlen"))
def test_cuda_graph_replay_equals_eager(form, unchecked_mode):
    eager = _cuda_case(form)
    _run_out(eager, form)
    warm, captured = _cuda_case(form), _cuda_case(form)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run_out(warm, form)  # first calls may set things up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run_out(captured, form)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured["out"], eager["out"])
    assert torch.equal(captured["ssm_pool"], eager["ssm_pool"])


@needs_cuda_kernels
def test_cuda_no_host_sync_and_no_allocation_but_y(unchecked_mode):
    fixed, varlen = _cuda_case("fixed"), _cuda_case("varlen")
    _run_out(fixed, "fixed")  # warm-up
    _run_out(varlen, "varlen")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        _run_out(fixed, "fixed")
        _run_out(varlen, "varlen")
        assert torch.cuda.memory_allocated() == before, "an _out op allocated"
        y = torch.ops.ssd.decode_step_varlen(*varlen_args(varlen))
        y_block = -(-y.numel() * y.element_size() // 512) * 512  # the allocator's rounding
        assert torch.cuda.memory_allocated() - before == y_block, "decode_step_varlen allocated more than y"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.isnan(y).any() and torch.equal(y[-2:], torch.zeros_like(y[-2:]))


# The lean multi-token kernel (CUDA's default for serving-style inputs: per-head A,
# dt, D, dt_bias broadcast, rows that split evenly over lanes, x / B / C of one
# type) against the block kernel: the same bits, and the block kernel is checked
# against the reference above.
LEAN_MULTI_CHOICES = (
    {},
    {"TORCH_SSD_CUDA_KERNEL": "block"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "1", "TORCH_SSD_CUDA_PDL": "0", "TORCH_SSD_CUDA_MULTI_BC": "staged"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_BC": "registers"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_BC": "widened"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_ORDER": "1"},
    {"TORCH_SSD_CUDA_MULTI_ORDER": "1", "TORCH_SSD_CUDA_MULTI_BC": "staged"},
    {"TORCH_SSD_CUDA_MULTI_BULK": "1"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_BULK": "1", "TORCH_SSD_CUDA_MULTI_ORDER": "1",
     "TORCH_SSD_CUDA_MULTI_BC": "widened"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_NEXT_ROWS": "0"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_NEXT_ROWS": "1", "TORCH_SSD_CUDA_MULTI_BULK": "1"},
    {"TORCH_SSD_CUDA_MULTI_FIXED_LANES": "0"},
    {"TORCH_SSD_CUDA_MULTI_FIXED_LANES": "0", "TORCH_SSD_CUDA_MULTI_BULK": "1"},
    # Two tiles per warp keep a row's widened B / C by default (up to what fits); off, and
    # forced on beside the bulk stores' buffers.
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_KEPT_BC": "0"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_KEPT_BC": "1", "TORCH_SSD_CUDA_MULTI_BULK": "1"},
    {"TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_MULTI_KEPT_BC": "1", "TORCH_SSD_CUDA_MULTI_FIXED_LANES": "0"},
    # The windowed kernel (N = 128; the widened kernel at other N): one tile per warp, two
    # (a row of up to 8 tokens reuses its B / C), tiles side by side in the grid.
    {"TORCH_SSD_CUDA_MULTI_BC": "windowed", "TORCH_SSD_CUDA_MULTI_TILES": "1"},
    {"TORCH_SSD_CUDA_MULTI_BC": "windowed", "TORCH_SSD_CUDA_MULTI_TILES": "2", "TORCH_SSD_CUDA_PDL": "0"},
    {"TORCH_SSD_CUDA_MULTI_BC": "windowed", "TORCH_SSD_CUDA_MULTI_ORDER": "1"},
)
LEAN_MULTI_KNOBS = sorted({key for env in LEAN_MULTI_CHOICES for key in env})


def _lean_case(form: str, K: int, n: int, pool_dtype, dtype) -> dict:
    """On CUDA: T = 5 rows, P = 24 (not a multiple of every tile), per-token destinations with
    a pad, a shared destination within a row (across override windows when K > 8)
    and one across rows, a pad row; varlen: rows of K, 0, K - 1, K and 1 tokens
    with tokens that no row owns before and after them."""
    T = 5
    lens = [K] * T if form == "fixed" else [K, 0, max(K - 1, 1), K, 1]
    lead = (T, K) if form == "fixed" else (sum(lens) + 2,)
    S = 2 * T * K + T + 4
    d = token_operands(lead, S, N=n, P=24, pool_dtype=pool_dtype, dtype=dtype, per_head=True, seed=K + n)
    gen = torch.Generator().manual_seed(_seed(form, K, n))
    perm = torch.randperm(S, generator=gen)
    d["slot_idx"] = perm[:T].clone()
    d["slot_idx"][2] = PAD  # a pad row
    dst = perm[T : T + T * K].view(T, K).clone()
    if K > 1:
        dst[1, 1] = PAD  # a token that writes nothing
        dst[0, K - 1] = dst[0, K // 2 - 1 if K < 9 else 1]  # the later token of row 0 wins
    dst[T - 1, 0] = dst[0, 0]  # row T - 1 wins over row 0
    d["dst_slot_idx"] = dst
    if form == "varlen":
        cu = [1]
        for length in lens:
            cu.append(cu[-1] + length)
        d["cu_seqlens"] = torch.tensor(cu)
    # A, dt, D, dt_bias broadcast with stride 0 (on the device: .to() would densify them).
    return apply_layout(to_device(d, "cuda"), "broadcast")


@needs_cuda_kernels
@pytest.mark.parametrize("form", ("fixed", "varlen"))
@pytest.mark.parametrize("K", (1, 3, 8, 11))
@pytest.mark.parametrize("n", (32, 128, 256))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "f32"))
@pytest.mark.parametrize("pool_dtype", (torch.float32, torch.bfloat16, torch.float16), ids=("f32", "bf16", "f16"))
def test_lean_multi_kernel_gives_the_block_kernels_bits(pool_dtype, dtype, n, K, form, monkeypatch):
    base = _lean_case(form, K, n, pool_dtype, dtype)
    pool0 = base["ssm_pool"].clone()
    op = torch.ops.ssd.decode_step_multi if form == "fixed" else torch.ops.ssd.decode_step_varlen
    args = multi_args if form == "fixed" else varlen_args
    first = None
    for env in LEAN_MULTI_CHOICES:
        for key in LEAN_MULTI_KNOBS:
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        base["ssm_pool"].copy_(pool0)
        y = op(*args(base))
        got = (y, base["ssm_pool"].clone())
        if first is None:
            if form == "fixed":
                check_fixed_against_reference(base, y, pool0)
            else:  # the tokens no row owns: the first and the last
                assert not y[0].any() and not y[-1].any()
            first = got
        else:
            assert torch.equal(got[0], first[0]), f"y differs with {env}"
            assert torch.equal(got[1], first[1]), f"pool differs with {env}"


@needs_cuda_kernels
@pytest.mark.parametrize("per_token", (True, False), ids=("per_token", "per_row"))
@pytest.mark.parametrize("K", (3, 11))
def test_lean_multi_kernel_reads_int32_and_int64_tables_alike(K, per_token):
    """The lean kernel's override scan (it skips a write that a later write to the same slot
    overrides) reads the slot tables as they are stored: int64 and int32 tables, per-token (T, K) and
    per-row (T,) destinations, each with a slot two rows share, give the reference's result
    and the same bits."""
    base = _lean_case("fixed", K, 128, torch.bfloat16, torch.bfloat16)
    if not per_token:  # (T,): the rows' last tokens write; row T - 1 still shares row 0's slot
        base["dst_slot_idx"] = base["dst_slot_idx"][:, 0].contiguous()
    pool0 = base["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step_multi(*multi_args(base))
    writes = check_fixed_against_reference(base, y, pool0)
    T = base["x"].shape[0]
    shared = int(base["dst_slot_idx"][T - 1].reshape(-1)[0])  # row 0 writes it too, first
    assert writes[shared][0] == T - 1
    narrow = dict(base, ssm_pool=pool0.clone())
    for name in ("slot_idx", "dst_slot_idx"):
        narrow[name] = base[name].to(torch.int32)
    y32 = torch.ops.ssd.decode_step_multi(*multi_args(narrow))
    assert torch.equal(y32, y) and torch.equal(narrow["ssm_pool"], base["ssm_pool"])


@needs_cuda_kernels
@pytest.mark.parametrize("form", ("fixed", "varlen"))
def test_serving_inputs_take_the_lean_multi_kernel(form, monkeypatch):
    """The kernel names the profiler sees: the lean kernel by default, the block
    kernel with TORCH_SSD_CUDA_KERNEL=block (so the test above compares two kernels)."""
    base = _lean_case(form, 4, 128, torch.bfloat16, torch.bfloat16)
    op = torch.ops.ssd.decode_step_multi if form == "fixed" else torch.ops.ssd.decode_step_varlen
    args = multi_args if form == "fixed" else varlen_args
    assert_lean_kernel_runs(lambda: op(*args(base)), "multi_step", "multi_step_lean", monkeypatch)


@needs_cuda_kernels
@pytest.mark.parametrize("n, kernel", ((128, "multi_step_windowed"), (64, "multi_step_lean")))
def test_lean_windowed_knob_takes_multi_step_windowed_at_n_128(n, kernel, monkeypatch):
    """TORCH_SSD_CUDA_MULTI_BC=windowed runs multi_step_windowed where it applies (N = 128)
    and the widened lean kernel elsewhere, so the bit comparison above covers it."""
    base = _lean_case("fixed", 4, n, torch.bfloat16, torch.bfloat16)
    monkeypatch.setenv("TORCH_SSD_CUDA_MULTI_BC", "windowed")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.ops.ssd.decode_step_multi(*multi_args(base))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "multi_step" in e.name]
    assert names and all(kernel in name for name in names), names


# ---------------------------------------------------------------------------
# opcheck, torch.compile, schemas
# ---------------------------------------------------------------------------


def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("layout", ("contiguous", "transposed", "broadcast"))
def test_opcheck(mdevice, layout):
    T, K = 3, 2
    d = set_slots(token_operands((T, K), 12, N=19, pool_dtype=torch.bfloat16, per_head=True), "spec_mixed", T, K)
    d["out"] = torch.zeros(T, K, H, P)
    d = to_device(apply_layout(d, layout), mdevice)
    _opcheck(torch.ops.ssd.decode_step_multi.default, multi_args(d))
    _opcheck(torch.ops.ssd.decode_step_multi_out.default, multi_args(d) + (d["out"],))
    v = varlen_inputs(VARLEN_CASES["per_token"], pool_dtype=torch.bfloat16)
    v["out"] = torch.zeros_like(v["x"])
    v = to_device(apply_layout(v, layout if layout != "broadcast" else "contiguous"), mdevice)
    _opcheck(torch.ops.ssd.decode_step_varlen.default, varlen_args(v))
    _opcheck(torch.ops.ssd.decode_step_varlen_out.default, varlen_args(v) + (v["out"],))


def test_opcheck_defaults(mdevice):
    """Optional arguments left at their defaults."""
    d = to_device(token_operands((2, 3), 4), mdevice)
    _opcheck(torch.ops.ssd.decode_step_multi.default, multi_args(d)[:6])
    v = to_device(token_operands((5,), 4), mdevice)
    v["cu_seqlens"] = torch.tensor([0, 2, 5], device=mdevice)
    _opcheck(torch.ops.ssd.decode_step_varlen.default, varlen_args(v)[:7])


def spec_loop(pool, table, accepted, x, dt, A_per_head, B, C, D, z, dt_bias, cu, xv, dtv, Bv, Cv, out):
    """A verification step on per-token slots, then a varlen step that resumes from the
    accepted tokens' slots and writes the final state back to column 0."""
    A = A_per_head.view(-1, 1, 1).expand(-1, pool.shape[2], pool.shape[3])
    y = torch.ops.ssd.decode_step_multi(pool, x, dt, A, B, C, D, z, dt_bias, True, table, None, -1, accepted)
    torch.ops.ssd.decode_step_varlen_out(pool, xv, dtv, A, Bv, Cv, cu, D, None, dt_bias, True, table,
                                         table[:, 0], -1, accepted, True, out)
    return y * 2


class PostGradGraphs:
    """Every graph after Inductor's post-grad passes (re-inplacing included)."""

    def __init__(self, original):
        self.graphs, self._original = [], original

    def __call__(self, gm, is_inference=False):
        self._original(gm, is_inference)
        self.graphs.append(gm)


def test_compile_fullgraph_dynamic_in_place(mdevice, monkeypatch):
    """Fake impls under torch.compile(fullgraph=True, dynamic=True): no graph break, one
    compile for two values of T, eager's results, and the post-grad graph calls the
    kernels on the pool itself (no functional copy of it)."""
    torch._dynamo.reset()
    capture = PostGradGraphs(compile_fx._recursive_post_grad_passes)
    monkeypatch.setattr(compile_fx, "_recursive_post_grad_passes", capture)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(spec_loop, backend=counter, fullgraph=True, dynamic=True)
    K = 3
    try:
        with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(
                enable_autograd_cache=False):
            for T in (5, 7):
                d = set_slots(token_operands((T, K), T * K + 4, pool_dtype=torch.bfloat16, per_head=True,
                                             seed=T), "spec_mixed", T, K)
                lengths = [1 + t % K for t in range(T)]
                v = token_operands((sum(lengths) + 1,), 1, seed=T + 1)
                cu = torch.tensor([0] + [sum(lengths[: t + 1]) for t in range(T)])
                args = [d["ssm_pool"], d["slot_idx"], d["num_accepted_tokens"], d["x"], d["dt"],
                        d["A"][:, 0, 0].contiguous(), d["B"], d["C"], d["D"], d["z"], d["dt_bias"], cu,
                        v["x"], v["dt"], v["B"], v["C"], torch.zeros_like(v["x"])]
                args = [a.to(mdevice) for a in args]
                eager = [a.clone() for a in args]
                want = spec_loop(*eager)
                got = compiled(*args)
                assert torch.equal(got, want), f"T={T}"
                assert torch.equal(args[0], eager[0]), f"T={T}: pool"
                assert torch.equal(args[-1], eager[-1]), f"T={T}: out"
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1, f"{counter.frame_count} compiles"
    assert not torch._dynamo.utils.counters["graph_break"]
    (gm,) = capture.graphs
    ssd_nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "ssd." in str(n.target)]
    assert [str(n.target) for n in ssd_nodes] == ["ssd.decode_step_multi.default",
                                                  "ssd.decode_step_varlen_out.default"], gm.graph
    for n in ssd_nodes:
        assert n.args[0].op == "placeholder", f"the pool reaching {n.target} is {n.args[0].format_node()}"
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        assert "auto_functionalized" not in str(n.target), f"not re-inplaced: {n.format_node()}"
        assert n.target not in (torch.ops.aten.clone.default, torch.ops.aten.copy.default), n.format_node()
        if n.target is torch.ops.aten.copy_.default:
            assert n.args[0] is n.args[1], f"a copy into an input: {n.format_node()}"


def schema(name: str) -> str:
    return str(getattr(torch.ops.ssd, name).default._schema)


def test_schema_decode_step_multi():
    assert_expected_inline(
        schema("decode_step_multi"),
        """ssd::decode_step_multi(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, Tensor? slot_idx=None, Tensor? dst_slot_idx=None, int pad_slot_id=-1, Tensor? num_accepted_tokens=None, bool write_state=True) -> Tensor""",  # noqa: E501
    )


def test_schema_decode_step_multi_out():
    assert_expected_inline(
        schema("decode_step_multi_out"),
        """ssd::decode_step_multi_out(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? slot_idx, Tensor? dst_slot_idx, int pad_slot_id, Tensor? num_accepted_tokens, bool write_state, Tensor(b!) out) -> ()""",  # noqa: E501
    )


def test_schema_decode_step_varlen():
    assert_expected_inline(
        schema("decode_step_varlen"),
        """ssd::decode_step_varlen(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor cu_seqlens, Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, Tensor? slot_idx=None, Tensor? dst_slot_idx=None, int pad_slot_id=-1, Tensor? num_accepted_tokens=None, bool write_state=True) -> Tensor""",  # noqa: E501
    )


def test_schema_decode_step_varlen_out():
    assert_expected_inline(
        schema("decode_step_varlen_out"),
        """ssd::decode_step_varlen_out(Tensor(a!) ssm_pool, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor cu_seqlens, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus, Tensor? slot_idx, Tensor? dst_slot_idx, int pad_slot_id, Tensor? num_accepted_tokens, bool write_state, Tensor(b!) out) -> ()""",  # noqa: E501
    )


def test_multi_ops_mutate_only_the_pool_and_out():
    for name in OPS:
        s = getattr(torch.ops.ssd, name).default._schema
        mutated = [a.name for a in s.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated == (["ssm_pool", "out"] if name.endswith("_out") else ["ssm_pool"]), name
        assert all(r.alias_info is None for r in s.returns), name
