"""Pure-PyTorch reference of the multi-token decode step (docs/multi_token.md).

The executable form of the multi-token contract, built from the single-token
reference: each row's state is loaded once, advanced token by token with
``reference.decode_step`` in ``compute_dtype`` (never rounded between tokens), and
each state a token writes is rounded once to the pool's dtype. Like
``reference.decode_step`` it never mutates its inputs and returns the new pool.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference

__all__ = ["source_slots", "dest_slots", "decode_step_multi", "decode_step_varlen"]

_NO_SLOT = -1  # never a slot of the pool (negative), whatever pad_slot_id is


def _addressable(slot: int, num_slots: int, pad_slot_id: int) -> bool:
    return slot != pad_slot_id and 0 <= slot < num_slots


def source_slots(
    num_rows: int,
    num_slots: int,
    slot_idx: Tensor | None,
    num_accepted_tokens: Tensor | None,
    pad_slot_id: int,
) -> list[int]:
    """The slot each row starts from (``_NO_SLOT`` or a non-addressable slot for a pad row).

    slot_idx None: row t -> slot t. (T,): slot_idx[t]. (T, W): column n - 1 where n is
    num_accepted_tokens[t] (column 0 when n is 0 or num_accepted_tokens is None); an n
    outside [0, W] makes the row a pad row.
    """
    if slot_idx is None:
        return list(range(num_rows))
    table = slot_idx.cpu().long()
    if table.dim() == 1:
        return table.tolist()
    accepted = None if num_accepted_tokens is None else num_accepted_tokens.cpu().long().tolist()
    out = []
    for t in range(num_rows):
        col = 0
        if accepted is not None:
            n = accepted[t]
            if n < 0 or n > table.shape[1]:
                out.append(_NO_SLOT)
                continue
            col = max(n - 1, 0)
        out.append(int(table[t, col]))
    return out


def dest_slots(
    num_rows: int,
    counts: list[int],
    slot_idx: Tensor | None,
    dst_slot_idx: Tensor | None,
    write_state: bool,
) -> list[list[int]]:
    """For each row and each of its tokens, the slot that token's state is written to.

    The destination table is dst_slot_idx, or slot_idx when it is None. A (T, W) table
    gives token k column k (no write for k >= W); a (T,) table -- or none, meaning
    slot t -- takes the state after the row's last token only.
    """
    table = dst_slot_idx if dst_slot_idx is not None else slot_idx
    table = None if table is None else table.cpu().long()
    out = []
    for t in range(num_rows):
        row = [_NO_SLOT] * counts[t]
        if write_state and counts[t] > 0:
            if table is not None and table.dim() == 2:
                for k in range(min(counts[t], table.shape[1])):
                    row[k] = int(table[t, k])
            else:
                row[-1] = t if table is None else int(table[t])
        out.append(row)
    return out


def _run_rows(
    ssm_pool: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    counts: list[int],
    src: list[int],
    dst: list[list[int]],
    pad_slot_id: int,
    compute_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """The rows' tokens laid out (T, K, ...) with row t using its first counts[t] tokens.

    Returns (y (T, K, H, P), new_pool, states (T, K, H, P, N)); y and states are zero
    for tokens a row does not have and for pad rows.
    """
    f = compute_dtype
    T, K, H, P = x.shape
    N = ssm_pool.shape[-1]
    num_slots = ssm_pool.shape[0]
    device = x.device
    row_ok = torch.tensor([_addressable(s, num_slots, pad_slot_id) and c > 0 for s, c in zip(src, counts)],
                          dtype=torch.bool, device=device)
    src_t = torch.tensor(src, dtype=torch.int64, device=device)
    # Each row's starting state, widened once; pad rows read nothing (zeros).
    state = reference.load_state(ssm_pool, torch.where(row_ok, src_t, _NO_SLOT), _NO_SLOT, compute_dtype=f)
    rows = torch.arange(T, device=device)
    ys = torch.zeros(T, K, H, P, dtype=f, device=device)
    states = torch.zeros(T, K, H, P, N, dtype=f, device=device)
    for k in range(K):
        active = row_ok & torch.tensor([k < c for c in counts], dtype=torch.bool, device=device)
        # One single-token step over the per-row states (a float pool of T slots, row
        # t in slot t); inactive rows are pads of that step.
        y_k, _, new_state = reference.decode_step(
            state, x[:, k], dt[:, k], A, B[:, k], C[:, k], D,
            None if z is None else z[:, k], dt_bias, dt_softplus,
            slot_idx=torch.where(active, rows, _NO_SLOT), pad_slot_id=_NO_SLOT, compute_dtype=f)
        state = torch.where(active.view(-1, 1, 1, 1), new_state, state)
        ys[:, k] = y_k
        states[:, k] = torch.where(active.view(-1, 1, 1, 1), new_state, torch.zeros_like(new_state))
    # Writes in (row, token) order, each rounded once from the unrounded state; of
    # writes that share a slot the last one wins (store_state's rule).
    flat_slots = torch.full((T * K,), _NO_SLOT, dtype=torch.int64, device=device)
    for t in range(T):
        if not bool(row_ok[t]):
            continue
        for k, slot in enumerate(dst[t]):
            flat_slots[t * K + k] = slot
    new_pool = reference.store_state(states.reshape(T * K, H, P, N), ssm_pool, flat_slots, pad_slot_id)
    return ys, new_pool, states


def decode_step_multi(
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
    num_accepted_tokens: Tensor | None = None,
    write_state: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """The fixed form, out of place: x, dt, z (T, K, H, P); B, C (T, K, G, N).

    Returns ``(y, new_pool, states)``: y (T, K, H, P) in ``compute_dtype`` (zero for pad
    rows), the pool after the writes, and the unrounded state after each token
    (T, K, H, P, N).
    """
    T, K = x.shape[:2]
    num_slots = ssm_pool.shape[0]
    counts = [K] * T
    src = source_slots(T, num_slots, slot_idx, num_accepted_tokens, pad_slot_id)
    dst = dest_slots(T, counts, slot_idx, dst_slot_idx, write_state)
    return _run_rows(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, counts, src, dst, pad_slot_id,
                     compute_dtype)


def decode_step_varlen(
    ssm_pool: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    cu_seqlens: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    slot_idx: Tensor | None = None,
    dst_slot_idx: Tensor | None = None,
    pad_slot_id: int = -1,
    num_accepted_tokens: Tensor | None = None,
    write_state: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """The varlen form, out of place: x, dt, z (L, H, P); B, C (L, G, N); row t owns
    tokens [cu_seqlens[t], cu_seqlens[t + 1]) (none when not 0 <= bos <= eos <= L).

    Returns ``(y, new_pool, states)``: y (L, H, P) in ``compute_dtype`` (zero for tokens
    of pad rows and tokens no row owns), the pool after the writes, and the unrounded
    state after each token (L, H, P, N), zero where y is.
    """
    L, H, P = x.shape
    N = ssm_pool.shape[-1]
    num_slots = ssm_pool.shape[0]
    cu = cu_seqlens.cpu().long().tolist()
    T = len(cu) - 1
    bounds = [(cu[t], cu[t + 1]) if 0 <= cu[t] <= cu[t + 1] <= L else (0, 0) for t in range(T)]
    counts = [e - b for b, e in bounds]
    K = max(counts, default=0)
    src = source_slots(T, num_slots, slot_idx, num_accepted_tokens, pad_slot_id)
    dst = dest_slots(T, counts, slot_idx, dst_slot_idx, write_state)
    # Gather the rows' tokens into (T, K, ...); positions past a row's count repeat
    # token 0 and are never used.
    index = torch.zeros(T, K, dtype=torch.int64, device=x.device)
    for t, (b, e) in enumerate(bounds):
        index[t, : e - b] = torch.arange(b, e)

    def rows_of(v: Tensor | None) -> Tensor | None:
        return None if v is None else v[index.view(-1)].view(T, K, *v.shape[1:])

    f = compute_dtype
    y = torch.zeros(L, H, P, dtype=f, device=x.device)
    states = torch.zeros(L, H, P, N, dtype=f, device=x.device)
    if T == 0 or K == 0:
        return y, ssm_pool.clone(), states
    ys, new_pool, row_states = _run_rows(
        ssm_pool, rows_of(x), rows_of(dt), A, rows_of(B), rows_of(C), D, rows_of(z), dt_bias, dt_softplus,
        counts, src, dst, pad_slot_id, f)
    for t, (b, e) in enumerate(bounds):
        y[b:e] = ys[t, : e - b]
        states[b:e] = row_states[t, : e - b]
    return y, new_pool, states
