"""Pure-PyTorch reference of the decode step (DESIGN.md section 2).

This is the executable form of the contract: every kernel is tested against it.
It works on any device and in any floating dtype; the tests call it with
``compute_dtype=torch.float64``. It never mutates its inputs: it returns the new
pool instead, so the caller can compare the whole pool.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["slot_rows", "load_state", "load_bc", "store_state", "decode_step"]


def slot_rows(
    num_rows: int,
    num_slots: int,
    slot_idx: Tensor | None,
    pad_slot_id: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Return (slot, valid) for each row: slot as int64, valid = addressable slot.

    A row is not valid when its slot equals ``pad_slot_id`` or lies outside
    [0, num_slots): such a row never touches the pool (DESIGN.md section 3).
    """
    if slot_idx is None:
        slot = torch.arange(num_rows, device=device, dtype=torch.int64)
    else:
        slot = slot_idx.to(device=device, dtype=torch.int64)
    valid = (slot != pad_slot_id) & (slot >= 0) & (slot < num_slots)
    return slot, valid


def _overwritten_later(slot: Tensor, valid: Tensor) -> Tensor:
    """Rows whose slot a later valid row writes too: of rows sharing a destination
    slot, only the last one (highest row index) writes (DESIGN.md section 3)."""
    rows = torch.arange(slot.shape[0], device=slot.device)
    same = (slot.view(-1, 1) == slot.view(1, -1)) & valid.view(1, -1) & (rows.view(1, -1) > rows.view(-1, 1))
    return same.any(dim=1)


def load_state(
    ssm_pool: Tensor,
    slot_idx: Tensor | None = None,
    pad_slot_id: int = -1,
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Rows of the pool widened to ``compute_dtype``; pad rows are zero."""
    num_slots = ssm_pool.shape[0]
    num_rows = num_slots if slot_idx is None else slot_idx.shape[0]
    slot, valid = slot_rows(num_rows, num_slots, slot_idx, pad_slot_id, ssm_pool.device)
    safe = torch.where(valid, slot, torch.zeros_like(slot))
    rows = ssm_pool.index_select(0, safe).to(compute_dtype)
    return torch.where(valid.view(-1, 1, 1, 1), rows, torch.zeros_like(rows))


def load_bc(B: Tensor, C: Tensor, compute_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    return B.to(compute_dtype).contiguous(), C.to(compute_dtype).contiguous()


def store_state(
    state: Tensor,
    ssm_pool: Tensor,
    slot_idx: Tensor | None = None,
    pad_slot_id: int = -1,
) -> Tensor:
    """The pool after writing ``state`` rows to their slots (rounded once, RNE)."""
    new_pool = ssm_pool.clone()
    slot, valid = slot_rows(state.shape[0], ssm_pool.shape[0], slot_idx, pad_slot_id, ssm_pool.device)
    keep = valid & ~_overwritten_later(slot, valid)
    new_pool[slot[keep]] = state[keep].to(ssm_pool.dtype)
    return new_pool


def decode_step(
    ssm_pool: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    slot_idx: Tensor | None = None,
    dst_slot_idx: Tensor | None = None,
    pad_slot_id: int = -1,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """One decode step, out of place.

    Shapes: ssm_pool (S, H, P, N); x, dt, z (T, H, P); A (H, P, N); B, C (T, G, N);
    D, dt_bias (H, P); slot_idx, dst_slot_idx (T,).

    Returns ``(y, new_pool, state)``: y in ``compute_dtype`` (cast it to x's dtype to
    compare with a kernel), the pool after the write-back in the pool's dtype, and the
    unrounded new state (T, H, P, N) in ``compute_dtype``.
    """
    f = compute_dtype
    T, H, P = x.shape
    G = B.shape[1]
    num_slots = ssm_pool.shape[0]
    src, src_ok = slot_rows(T, num_slots, slot_idx, pad_slot_id, x.device)
    if dst_slot_idx is None:
        dst, dst_ok = src, src_ok
    else:
        dst, dst_ok = slot_rows(T, num_slots, dst_slot_idx, pad_slot_id, x.device)
    dst_ok = dst_ok & src_ok  # a pad row computes nothing, so it writes nothing

    dtv = dt.to(f)
    if dt_bias is not None:
        dtv = dtv + dt_bias.to(f)
    if dt_softplus:
        dtv = torch.where(dtv <= 20.0, torch.log1p(torch.exp(dtv)), dtv)
    dtv = dtv.unsqueeze(-1)  # (T, H, P, 1)

    heads_per_group = H // G
    Bh = B.to(f).repeat_interleave(heads_per_group, dim=1).unsqueeze(2)  # (T, H, 1, N)
    Ch = C.to(f).repeat_interleave(heads_per_group, dim=1).unsqueeze(2)
    xf = x.to(f).unsqueeze(-1)  # (T, H, P, 1)

    old = load_state(ssm_pool, src, pad_slot_id, compute_dtype=f)  # pad rows read as 0
    dA = torch.exp(A.to(f) * dtv)
    state = old * dA + dtv * Bh * xf
    y = (state * Ch).sum(-1)
    if D is not None:
        y = y + D.to(f) * x.to(f)
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(f))
    y = torch.where(src_ok.view(-1, 1, 1), y, torch.zeros_like(y))  # pad rows give 0

    new_pool = store_state(state, ssm_pool, torch.where(dst_ok, dst, torch.full_like(dst, pad_slot_id)), pad_slot_id)
    return y, new_pool, state
