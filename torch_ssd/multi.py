"""The multi-token decode step (speculative decoding): fake implementations of
``torch.ops.ssd.decode_step_multi(_out)`` / ``decode_step_varlen(_out)`` and
wrappers that accept per-head operands. docs/multi_token.md is the contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.ssd.*)
from .ops import _prepare

__all__ = [
    "decode_step_multi",
    "decode_step_multi_out",
    "decode_step_varlen",
    "decode_step_varlen_out",
]

# ---------------------------------------------------------------------------
# Fake implementations: shapes, dtypes and strides only (y is contiguous, like
# the kernels' result).
# ---------------------------------------------------------------------------


@torch.library.register_fake("ssd::decode_step_multi")
def _decode_step_multi_fake(ssm_pool, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                            slot_idx=None, dst_slot_idx=None, pad_slot_id=-1, num_accepted_tokens=None,
                            write_state=True):
    return x.new_empty(x.shape)


@torch.library.register_fake("ssd::decode_step_multi_out")
def _decode_step_multi_out_fake(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
                                pad_slot_id, num_accepted_tokens, write_state, out):
    return None


@torch.library.register_fake("ssd::decode_step_varlen")
def _decode_step_varlen_fake(ssm_pool, x, dt, A, B, C, cu_seqlens, D=None, z=None, dt_bias=None,
                             dt_softplus=False, slot_idx=None, dst_slot_idx=None, pad_slot_id=-1,
                             num_accepted_tokens=None, write_state=True):
    return x.new_empty(x.shape)


@torch.library.register_fake("ssd::decode_step_varlen_out")
def _decode_step_varlen_out_fake(ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx,
                                 dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state, out):
    return None


# ---------------------------------------------------------------------------
# Wrappers: per-head operands are expanded with stride 0 (no copy), as in ops.py.
# ---------------------------------------------------------------------------


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
) -> Tensor:
    """K decode steps per row in one call (speculative decoding); returns y (T, K, H, P).

    Shapes (S slots, T rows, K tokens per row, H heads, P head dim, N state, G groups):
      ssm_pool (S, H, P, N), updated in place
      x, z (T, K, H, P); dt (T, K, H, P) or per-head (T, K, H)
      A (H, P, N), or per-head (H,) or (H, P); D, dt_bias (H, P) or per-head (H,)
      B, C (T, K, G, N)
      slot_idx: None (row t reads slot t), (T,) or (T, W); with a (T, W) table row t
        reads slot_idx[t, n - 1] where n = num_accepted_tokens[t] (column 0 when n = 0
        or num_accepted_tokens is None)
      dst_slot_idx (defaults to slot_idx): (T, W >= K) writes the state after token k
        to dst_slot_idx[t, k]; (T,) (or None with a 1-D / absent slot_idx) writes only
        the state after the last token, to dst_slot_idx[t] (slot_idx[t], slot t)
      pad_slot_id: a pad source makes the row a pad row (y = 0, nothing written); a
        pad destination skips that write
      write_state=False computes y and writes nothing.
    The state stays float32 across the K tokens; each written state is rounded once.
    """
    dt, A, D, dt_bias = _prepare(ssm_pool, x, dt, A, D, dt_bias)
    return torch.ops.ssd.decode_step_multi(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx,
                                           dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state)


def decode_step_multi_out(
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
    *,
    out: Tensor,
) -> Tensor:
    """:func:`decode_step_multi` writing y into ``out`` (T, K, H, P), x's dtype; returns ``out``."""
    dt, A, D, dt_bias = _prepare(ssm_pool, x, dt, A, D, dt_bias)
    torch.ops.ssd.decode_step_multi_out(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx,
                                        dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state, out)
    return out


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
) -> Tensor:
    """Rows of varying length over a flat token axis; returns y (L, H, P).

    x, z (L, H, P); dt (L, H, P) or per-head (L, H); B, C (L, G, N); cu_seqlens
    (T + 1,) int32/int64: row t owns tokens [cu_seqlens[t], cu_seqlens[t + 1]).
    Slots, num_accepted_tokens, pad_slot_id and write_state as in
    :func:`decode_step_multi`, with token k of row t using column k of a (T, W)
    destination table (no write for k >= W). Tokens no row owns get y = 0.
    """
    dt, A, D, dt_bias = _prepare(ssm_pool, x, dt, A, D, dt_bias)
    return torch.ops.ssd.decode_step_varlen(ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus,
                                            slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                                            write_state)


def decode_step_varlen_out(
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
    *,
    out: Tensor,
) -> Tensor:
    """:func:`decode_step_varlen` writing y into ``out`` (L, H, P), x's dtype; returns ``out``."""
    dt, A, D, dt_bias = _prepare(ssm_pool, x, dt, A, D, dt_bias)
    torch.ops.ssd.decode_step_varlen_out(ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus,
                                         slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                                         write_state, out)
    return out
