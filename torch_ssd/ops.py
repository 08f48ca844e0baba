"""The Python face of torch.ops.ssd: fake (meta) implementations for torch.compile,
and thin wrappers that accept the per-head shapes models actually hold.

The schemas live in C++ (csrc/ssd.cpp); importing this module loads them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.ssd.*)

__all__ = [
    "load_state",
    "load_bc",
    "store_state",
    "decode_step",
    "decode_step_out",
    "set_checks",
    "checks_enabled",
]

# ---------------------------------------------------------------------------
# Fake implementations: shapes, dtypes and strides only, never data.
# ---------------------------------------------------------------------------


@torch.library.register_fake("ssd::load_state")
def _load_state_fake(ssm_pool, slot_idx=None, pad_slot_id=-1):
    rows = ssm_pool.shape[0] if slot_idx is None else slot_idx.shape[0]
    return ssm_pool.new_empty((rows, *ssm_pool.shape[1:]), dtype=torch.float32)


@torch.library.register_fake("ssd::load_bc")
def _load_bc_fake(B, C):
    return B.new_empty(B.shape, dtype=torch.float32), C.new_empty(C.shape, dtype=torch.float32)


@torch.library.register_fake("ssd::store_state")
def _store_state_fake(state, ssm_pool, slot_idx=None, pad_slot_id=-1):
    return None


@torch.library.register_fake("ssd::decode_step")
def _decode_step_fake(ssm_pool, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                      slot_idx=None, dst_slot_idx=None, pad_slot_id=-1):
    return x.new_empty(x.shape)


@torch.library.register_fake("ssd::decode_step_out")
def _decode_step_out_fake(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx,
                          dst_slot_idx, pad_slot_id, out):
    return None


# ---------------------------------------------------------------------------
# Checked mode (DESIGN.md section 3).
# ---------------------------------------------------------------------------


def set_checks(enabled: bool) -> None:
    """Validate slot indices on every call (may synchronise the device).

    With checks on, a slot that is neither ``pad_slot_id`` nor in [0, S) raises a
    RuntimeError naming the row and the slot; with checks off (the default, unless
    ``TORCH_SSD_CHECKS=1`` is set) such a row is treated as a pad row.
    """
    _C.set_checks(bool(enabled))


def checks_enabled() -> bool:
    return _C.checks_enabled()


# ---------------------------------------------------------------------------
# Wrappers for people: per-head operands are expanded with stride 0 (no copy).
# ---------------------------------------------------------------------------


def _per_channel(name: str, t: Tensor | None, T: int | None, H: int, P: int) -> Tensor | None:
    """Expand (H,) / (T, H) to (H, P) / (T, H, P) with stride 0 over P."""
    if t is None:
        return None
    full_rank = 2 if T is None else 3
    if t.dim() == full_rank - 1:
        return t.unsqueeze(-1).expand(*t.shape, P)
    return t


def _expand_A(A: Tensor, H: int, P: int, N: int) -> Tensor:
    """Expand A (H,) or (H, P) to (H, P, N) with stride 0."""
    if A.dim() == 1:
        return A.view(H, 1, 1).expand(H, P, N) if A.shape[0] == H else A
    if A.dim() == 2:
        return A.unsqueeze(-1).expand(*A.shape, N)
    return A


def _prepare(ssm_pool, x, dt, A, D, dt_bias):
    """Per-head operands expanded with stride 0: dt (x's leading dims, H) -> x's shape
    (single- and multi-token forms alike); A (H,) / (H, P) -> (H, P, N); D, dt_bias
    (H,) -> (H, P)."""
    H, P, N = ssm_pool.shape[1:]
    if dt.dim() == x.dim() - 1:
        dt = dt.unsqueeze(-1).expand(*dt.shape, P)
    D = _per_channel("D", D, None, H, P)
    dt_bias = _per_channel("dt_bias", dt_bias, None, H, P)
    return dt, _expand_A(A, H, P, N), D, dt_bias


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
) -> Tensor:
    """One Mamba-2 decode step; updates ``ssm_pool`` in place and returns y.

    Shapes (S slots, T rows, H heads, P head dim, N state size, G groups):
      ssm_pool (S, H, P, N) float32/bfloat16/float16, updated in place
      x, z (T, H, P); dt (T, H, P) or per-head (T, H)
      A (H, P, N), or per-head (H,) or (H, P); D, dt_bias (H, P) or per-head (H,)
      B, C (T, G, N) with H % G == 0
      slot_idx, dst_slot_idx (T,) int32/int64; row t reads slot_idx[t] (t when None)
      and writes dst_slot_idx[t] (slot_idx[t] when None); ``pad_slot_id`` rows are
      skipped (y = 0).
    Returns y (T, H, P) in x's dtype. Per-head operands are expanded with stride 0.
    """
    dt, A, D, dt_bias = _prepare(ssm_pool, x, dt, A, D, dt_bias)
    return torch.ops.ssd.decode_step(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx,
                                     dst_slot_idx, pad_slot_id)


def decode_step_out(
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
    *,
    out: Tensor,
) -> Tensor:
    """:func:`decode_step` writing y into ``out`` (T, H, P), x's dtype; returns ``out``.

    Allocates nothing: the form a CUDA-graph serving loop captures.
    """
    dt, A, D, dt_bias = _prepare(ssm_pool, x, dt, A, D, dt_bias)
    torch.ops.ssd.decode_step_out(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx,
                                  dst_slot_idx, pad_slot_id, out)
    return out


def load_state(ssm_pool: Tensor, slot_idx: Tensor | None = None, pad_slot_id: int = -1) -> Tensor:
    """Rows of the pool widened to float32: (T, H, P, N) contiguous; pad rows are 0.

    ``ssm_pool`` (S, H, P, N); ``slot_idx`` (T,) picks the slots (all S when None).
    """
    return torch.ops.ssd.load_state(ssm_pool, slot_idx, pad_slot_id)


def load_bc(B: Tensor, C: Tensor) -> tuple[Tensor, Tensor]:
    """B and C (T, G, N) widened to float32, contiguous."""
    return torch.ops.ssd.load_bc(B, C)


def store_state(state: Tensor, ssm_pool: Tensor, slot_idx: Tensor | None = None,
                pad_slot_id: int = -1) -> None:
    """Round float32 ``state`` (T, H, P, N) to the pool dtype (nearest even), once,
    into ``ssm_pool[slot_idx[t]]`` (slot t when None); pad rows are skipped."""
    torch.ops.ssd.store_state(state, ssm_pool, slot_idx, pad_slot_id)
