"""Serving-engine face of torch_ssd.

``selective_state_update`` takes the argument names and shape conventions that
mamba_ssm, vLLM, SGLang and FlashInfer share, including the multi-token forms of
speculative decoding (``cu_seqlens``, ``num_accepted_tokens``, per-token slot
tables), so an engine can swap its decode kernel for ``torch.ops.ssd`` by changing
one import. ``StatePool`` owns the per-layer state pools of a continuous-batching
engine and hands out slots.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NoReturn

import torch
from torch import Tensor

from .ops import _expand_A, _per_channel

__all__ = ["selective_state_update", "StatePool"]


def _require_rank(name: str, t: Tensor | None, ranks: tuple[int, ...], form: str, shape_hint: str) -> None:
    if t is not None and t.dim() not in ranks:
        raise RuntimeError(
            f"selective_state_update: {name} must be {shape_hint} in the {form} form, "
            f"got a {t.dim()}-D tensor of shape {tuple(t.shape)}"
        )


def _require_table(name: str, idx: Tensor | None) -> None:
    """A slot table is (rows,) or (rows, W): W columns per row (one per token, or
    vLLM's per-token slots of the previous step)."""
    if idx is not None and (idx.dim() not in (1, 2) or (idx.dim() == 2 and idx.shape[1] == 0)):
        raise RuntimeError(
            f"selective_state_update: {name} must be (batch,) or (batch, W) with W >= 1, got a "
            f"{idx.dim()}-D tensor of shape {tuple(idx.shape)}"
        )


def _column0(idx: Tensor | None) -> Tensor | None:
    """Without num_accepted_tokens a row reads column 0 of a (batch, W) table and, on the
    flat layouts, writes its final state to column 0 (vLLM's rule)."""
    return idx[:, 0] if idx is not None and idx.dim() == 2 else idx


def _source_column(src: Tensor, num_accepted_tokens: Tensor | None) -> Tensor | None:
    """The slot each row starts from, src[t, max(n - 1, 0)], as a (T,) tensor; None when
    num_accepted_tokens does not fit src (the op then names the argument).

    Computed on the device (no synchronisation, capturable); an n outside [0, W] is
    clamped here, and the op makes such a row a pad row, which writes nothing.
    """
    T, W = src.shape
    if num_accepted_tokens is None:
        return src[:, 0]
    n = num_accepted_tokens
    if n.dim() != 1 or n.shape[0] != T or n.dtype not in (torch.int32, torch.int64) or n.device != src.device:
        return None
    col = (n.long() - 1).clamp(min=0, max=W - 1)
    return src.gather(1, col.view(T, 1)).view(T)


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: Tensor | None = None,
    dst_state_batch_indices: Tensor | None = None,
    pad_slot_id: int = -1,
    out: Tensor | None = None,
    num_accepted_tokens: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    *,
    disable_state_update: bool = False,
) -> Tensor:
    """Drop-in ``selective_state_update`` (vLLM / FlashInfer / SGLang / mamba_ssm) on ``torch.ops.ssd``.

    Two state forms, chosen by the rank of ``state``:

    with heads (Mamba-2)                      no heads (3-D form, Mamba-1 style)
      state (S, H, P, N)   updated in place     state (S, dim, N)
      x, z, out (batch, H, P)                   x, z, out (batch, dim)
      dt (batch, H, P) or per-head (batch, H)   dt (batch, dim)
      A (H, P, N) or per-head (H,) / (H, P)     A (dim, N)
      B, C (batch, G, N), H % G == 0            B, C (batch, N)
      D, dt_bias (H, P) or per-head (H,)        D, dt_bias (dim,)

    Tokens (docs/multi_token.md section 5 maps each case onto the ops):

    - one token per row (the shapes above): row i reads slot ``state_batch_indices[i]``
      (row i when None) and writes ``dst_state_batch_indices[i]`` (the source slot when
      None). A (batch, W) table is read at column 0, as vLLM and FlashInfer do.
    - ``cu_seqlens`` (T + 1,), vLLM's and FlashInfer's varlen layout: x, dt, z, out and B,
      C carry a flat token axis in place of batch, (num_tokens, ...); row t owns tokens
      [cu_seqlens[t], cu_seqlens[t + 1]). Without num_accepted_tokens the row starts
      from column 0 of ``state_batch_indices`` and writes its final state to column 0 of
      ``dst_state_batch_indices`` (vLLM).
    - a token axis, FlashInfer's multi-token layout (with-heads form only): x, z, out
      (batch, T, H, P); dt (batch, T, H, P) or (batch, T, H); B, C (batch, T, G, N).
      A (batch, T) ``dst_state_batch_indices`` takes the state after token k in column k;
      a (batch,) one, or none (then the row's source slot), takes the final state.
    - ``num_accepted_tokens`` (T,), speculative decoding (vLLM's rule): needs a (T, W)
      ``state_batch_indices``; row t starts from column n - 1 (column 0 for n = 0), n =
      num_accepted_tokens[t]. With the flat layouts the state after token k goes to
      column k of ``dst_state_batch_indices`` (``state_batch_indices`` when None).

    ``disable_state_update=True`` (FlashInfer) computes y and writes no state. A row whose
    source slot is ``pad_slot_id`` (or outside the pool) is skipped and gets y = 0; a
    destination equal to ``pad_slot_id`` skips that one write. Any strides are fine,
    including per-head values expanded with stride 0.

    Returns y in x's dtype and x's shape. With ``out`` the result is written into it (no
    allocation, what a CUDA graph captures) and ``out`` itself is returned.
    """
    # vLLM's decode call (one token per row, with heads, A / D / dt_bias / dt already
    # expanded by the caller, (batch,) slot tables) goes straight to the single-step op:
    # through the general path below it cost the host of an H200 machine 4.8-6.0 us more
    # than the bare op, this way 1.2-1.9 (BENCHMARKS.md, nineteenth session). Any other
    # call, or a rank off, takes the general path, which names what is wrong.
    if (disable_state_update is False and cu_seqlens is None and num_accepted_tokens is None
            and state.dim() == 4 and x.dim() == 3 and dt.dim() == 3 and A.dim() == 3 and B.dim() == 3
            and C.dim() == 3 and (z is None or z.dim() == 3) and (D is None or D.dim() == 2)
            and (dt_bias is None or dt_bias.dim() == 2) and (out is None or out.dim() == 3)
            and (state_batch_indices is None or state_batch_indices.dim() == 1)
            and (dst_state_batch_indices is None or dst_state_batch_indices.dim() == 1)):
        args = (state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), state_batch_indices,
                dst_state_batch_indices, int(pad_slot_id))
        try:
            if out is None:
                return torch.ops.ssd.decode_step(*args)
            torch.ops.ssd.decode_step_out(*args, out)
            return out
        except RuntimeError as err:
            _reraise_in_drop_in_names(err)
    if not isinstance(disable_state_update, bool):
        raise RuntimeError("selective_state_update: disable_state_update must be a bool, "
                           f"got {type(disable_state_update).__name__}")
    flat = "num_tokens" if cu_seqlens is not None else "batch"
    if state.dim() == 3:
        form = "no-heads"
        _require_rank("x", x, (2,), form, f"({flat}, dim) (the no-heads form has no token axis)")
        _require_rank("dt", dt, (2,), form, f"({flat}, dim)")
        _require_rank("z", z, (2,), form, f"({flat}, dim)")
        _require_rank("out", out, (2,), form, f"({flat}, dim)")
        _require_rank("A", A, (2,), form, "(dim, dstate)")
        _require_rank("B", B, (2,), form, f"({flat}, dstate)")
        _require_rank("C", C, (2,), form, f"({flat}, dstate)")
        _require_rank("D", D, (1,), form, "(dim,)")
        _require_rank("dt_bias", dt_bias, (1,), form, "(dim,)")
        # One head whose head dim is the channel dim (the *4 names are the views with a
        # head axis that the ops take); every view shares storage, so state and out are
        # written in place.
        pool = state.unsqueeze(1)
        x4, dt4, z4 = x.unsqueeze(1), dt.unsqueeze(1), None if z is None else z.unsqueeze(1)
        A4 = A.unsqueeze(0)
        B4, C4 = B.unsqueeze(1), C.unsqueeze(1)
        D4 = None if D is None else D.unsqueeze(0)
        bias4 = None if dt_bias is None else dt_bias.unsqueeze(0)
        out4 = None if out is None else out.unsqueeze(1)
    elif state.dim() == 4:
        form = "with-heads"
        if x.dim() == 4:
            lead = "batch, T"
        elif x.dim() == 3:
            lead = flat
        else:
            raise RuntimeError(
                f"selective_state_update: x must be ({flat}, nheads, dim) or, with a token axis, "
                f"(batch, T, nheads, dim) in the {form} form, got a {x.dim()}-D tensor of shape {tuple(x.shape)}"
            )
        r = x.dim()
        _require_rank("dt", dt, (r, r - 1), form, f"({lead}, nheads, dim) or per-head ({lead}, nheads)")
        _require_rank("z", z, (r,), form, f"({lead}, nheads, dim)")
        _require_rank("out", out, (r,), form, f"({lead}, nheads, dim)")
        _require_rank("A", A, (1, 2, 3), form, "(nheads, dim, dstate) or per-head (nheads,)")
        _require_rank("B", B, (r,), form, f"({lead}, ngroups, dstate)")
        _require_rank("C", C, (r,), form, f"({lead}, ngroups, dstate)")
        _require_rank("D", D, (1, 2), form, "(nheads, dim) or per-head (nheads,)")
        _require_rank("dt_bias", dt_bias, (1, 2), form, "(nheads, dim) or per-head (nheads,)")
        H, P, N = state.shape[1:]
        pool, x4, z4, B4, C4, out4 = state, x, z, B, C, out
        dt4 = dt.unsqueeze(-1).expand(*dt.shape, P) if dt.dim() == r - 1 else dt
        A4 = _expand_A(A, H, P, N)
        D4 = _per_channel("D", D, None, H, P)
        bias4 = _per_channel("dt_bias", dt_bias, None, H, P)
    else:
        raise RuntimeError(
            "selective_state_update: state must be (S, nheads, dim, dstate) or, in the no-heads form, "
            f"(S, dim, dstate); got a {state.dim()}-D tensor of shape {tuple(state.shape)}"
        )

    token_axis = x4.dim() == 4
    _require_table("state_batch_indices", state_batch_indices)
    _require_table("dst_state_batch_indices", dst_state_batch_indices)
    if cu_seqlens is not None and token_axis:
        raise RuntimeError(
            "selective_state_update: cu_seqlens marks rows on a flat token axis, x (num_tokens, nheads, dim), "
            f"but x has a token axis, shape {tuple(x.shape)} (batch, T, nheads, dim); flatten x, dt, z, B, C "
            "and out to (num_tokens, ...) or drop cu_seqlens"
        )
    if num_accepted_tokens is not None and (state_batch_indices is None or state_batch_indices.dim() != 2):
        got = "None" if state_batch_indices is None else f"shape {tuple(state_batch_indices.shape)}"
        raise RuntimeError(
            "selective_state_update: num_accepted_tokens picks each row's source slot from column n - 1 of "
            f"a (batch, W) state_batch_indices table, got state_batch_indices {got}"
        )

    write_state = not disable_state_update
    src, dst, pad = state_batch_indices, dst_state_batch_indices, int(pad_slot_id)
    try:
        if token_axis:
            # FlashInfer's rule: without dst_state_batch_indices the final state goes back
            # to the slot the row started from (for a 2-D table, the op's default would
            # be per-token writes into it instead).
            if dst is None and src is not None and src.dim() == 2:
                dst = _source_column(src, num_accepted_tokens)
            args = (pool, x4, dt4, A4, B4, C4, D4, z4, bias4, bool(dt_softplus), src, dst, pad,
                    num_accepted_tokens, write_state)
            y4 = _multi(args, out4)
        elif cu_seqlens is not None:
            if num_accepted_tokens is None:
                src, dst = _column0(src), _column0(dst)
            args = (pool, x4, dt4, A4, B4, C4, cu_seqlens, D4, z4, bias4, bool(dt_softplus), src, dst, pad,
                    num_accepted_tokens, write_state)
            if out4 is None:
                y4 = torch.ops.ssd.decode_step_varlen(*args)
            else:
                torch.ops.ssd.decode_step_varlen_out(*args, out4)
                y4 = out4
        elif num_accepted_tokens is not None or not write_state:
            # One token per row as a K = 1 multi-token step (views, no copies).
            if num_accepted_tokens is None:
                src, dst = _column0(src), _column0(dst)
            args = (pool, x4.unsqueeze(1), dt4.unsqueeze(1), A4, B4.unsqueeze(1), C4.unsqueeze(1), D4,
                    None if z4 is None else z4.unsqueeze(1), bias4, bool(dt_softplus), src, dst, pad,
                    num_accepted_tokens, write_state)
            y4 = _multi(args, None if out4 is None else out4.unsqueeze(1)).squeeze(1)
        else:
            src, dst = _column0(src), _column0(dst)
            args = (pool, x4, dt4, A4, B4, C4, D4, z4, bias4, bool(dt_softplus), src, dst, pad)
            if out4 is None:
                y4 = torch.ops.ssd.decode_step(*args)
            else:
                torch.ops.ssd.decode_step_out(*args, out4)
                y4 = out4
    except RuntimeError as err:
        _reraise_in_drop_in_names(err)
    if out is not None:
        return out
    return y4.squeeze(1) if state.dim() == 3 else y4


def _multi(args: tuple, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.ops.ssd.decode_step_multi(*args)
    torch.ops.ssd.decode_step_multi_out(*args, out)
    return out


# The op's argument names, as a caller of selective_state_update knows them.
_DROP_IN_NAMES = (
    (re.compile(r"\bdst_slot_idx\b"), "dst_state_batch_indices"),
    (re.compile(r"\bslot_idx\b"), "state_batch_indices"),
    (re.compile(r"\bssm_pool\b"), "state"),
)


def _in_drop_in_names(message: str) -> str:
    for op_name, name in _DROP_IN_NAMES:
        message = op_name.sub(name, message)
    return "selective_state_update: " + message


def _reraise_in_drop_in_names(err: RuntimeError) -> NoReturn:
    """An op's error in the names a caller of selective_state_update knows."""
    if type(err) is not RuntimeError:  # keep NotImplementedError, OutOfMemoryError, ... as they are
        raise err
    raise RuntimeError(_in_drop_in_names(str(err))) from None


_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StatePool:
    """Per-layer decode state for a continuous-batching engine, one slot per live sequence.

    ``ssm_pools[layer]`` is a (max_slots + 1, H, P, N) tensor and, when ``conv_dim``
    is given, ``conv_pools[layer]`` a (max_slots + 1, conv_dim, conv_width) tensor
    (the rolling window of the causal convolution). Slot ``pad_slot_id`` (the last
    row) is never handed out: it is where idle batch entries point. The SSM ops skip
    it outright, and plain index ops on the conv pools (gather, ``index_copy_``) touch
    only that scratch row, so a fixed-size batch needs no branch for idle rows.

    Tensors are allocated once and never reallocated, so a CUDA graph captured over
    them stays valid; ``indices(..., out=static)`` refreshes a graph's index input in
    place. ``allocate`` zeroes the new slot in every layer (a new sequence starts
    from the zero state), ``free`` returns it, and a full pool raises.
    """

    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        conv_dim: int | None = None,
        conv_width: int | None = None,
        conv_dtype: torch.dtype | None = None,
        index_dtype: torch.dtype = torch.int32,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("max_slots", max_slots), ("num_heads", num_heads),
                            ("head_dim", head_dim), ("state_size", state_size)):
            if not isinstance(value, int) or value < 1:
                raise RuntimeError(f"StatePool: {name} must be a positive int, got {value!r}")
        if dtype not in _POOL_DTYPES:
            raise RuntimeError(f"StatePool: dtype must be float32, bfloat16 or float16, got {dtype}")
        if index_dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"StatePool: index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
        if (conv_dim is None) != (conv_width is None):
            raise RuntimeError("StatePool: conv_dim and conv_width go together; give both or neither, "
                               f"got conv_dim={conv_dim!r}, conv_width={conv_width!r}")
        if conv_dim is not None:
            for name, value in (("conv_dim", conv_dim), ("conv_width", conv_width)):
                if not isinstance(value, int) or value < 1:
                    raise RuntimeError(f"StatePool: {name} must be a positive int, got {value!r}")

        self.num_layers = num_layers
        self.max_slots = max_slots
        self.pad_slot_id = max_slots  # the reserved scratch row
        self.index_dtype = index_dtype
        rows = max_slots + 1
        self.ssm_pools: list[Tensor] = [
            torch.zeros(rows, num_heads, head_dim, state_size, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.conv_pools: list[Tensor] = []
        if conv_dim is not None:
            self.conv_pools = [
                torch.zeros(rows, conv_dim, conv_width, dtype=conv_dtype or dtype, device=device)
                for _ in range(num_layers)
            ]
        self.device = self.ssm_pools[0].device
        # Lowest slot first, so a freshly reset pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(max_slots - 1, -1, -1))
        self._in_use: set[int] = set()

    # -- bookkeeping ---------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def in_use(self, slot: int) -> bool:
        return slot in self._in_use

    def allocate(self) -> int:
        """Hand out a free slot, zeroed in every layer. RuntimeError when the pool is full."""
        if not self._free:
            raise RuntimeError(
                f"StatePool is full: all {self.max_slots} slots are in use; free the slot of a finished "
                "sequence first, or build the pool with a larger max_slots"
            )
        slot = self._free.pop()
        for pool in self.ssm_pools:
            pool[slot].zero_()
        for pool in self.conv_pools:
            pool[slot].zero_()
        self._in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return a slot to the pool; its contents are left as they are until reused."""
        slot = int(slot)
        if slot not in self._in_use:
            raise RuntimeError(f"StatePool.free: slot {slot} is not in use (in use: {sorted(self._in_use)})")
        self._in_use.remove(slot)
        self._free.append(slot)

    def reset(self) -> None:
        """Free every slot (contents are zeroed again on their next allocation)."""
        self._in_use.clear()
        self._free = list(range(self.max_slots - 1, -1, -1))

    # -- batches -------------------------------------------------------------

    def indices(self, slots: Sequence[int | None], batch_size: int | None = None,
                out: Tensor | None = None) -> Tensor:
        """Index tensor for one fixed-size batch: ``slots[i]`` for live rows, the pad slot
        for ``None`` entries and for rows past ``len(slots)``.

        ``batch_size`` defaults to ``len(slots)`` (or ``out``'s length). With ``out`` (a
        CUDA graph's static index input) the indices are copied into it in place.
        """
        if out is not None:
            if out.dim() != 1 or out.dtype not in (torch.int32, torch.int64):
                raise RuntimeError(f"StatePool.indices: out must be a 1-D int32/int64 tensor, "
                                   f"got shape {tuple(out.shape)} and dtype {out.dtype}")
            if batch_size is not None and batch_size != out.shape[0]:
                raise RuntimeError(f"StatePool.indices: batch_size {batch_size} differs from out's length "
                                   f"{out.shape[0]}")
            batch_size = out.shape[0]
        if batch_size is None:
            batch_size = len(slots)
        if len(slots) > batch_size:
            raise RuntimeError(f"StatePool.indices: {len(slots)} slots do not fit a batch of {batch_size}")
        host = [self.pad_slot_id] * batch_size
        for row, slot in enumerate(slots):
            if slot is None:
                continue
            if int(slot) not in self._in_use:
                raise RuntimeError(f"StatePool.indices: row {row} names slot {int(slot)}, which is not in use")
            host[row] = int(slot)
        idx = torch.tensor(host, dtype=self.index_dtype if out is None else out.dtype)
        if out is None:
            return idx.to(self.device)
        out.copy_(idx, non_blocking=False)
        return out

    def __repr__(self) -> str:
        pool = self.ssm_pools[0]
        conv = f", conv {tuple(self.conv_pools[0].shape[1:])}" if self.conv_pools else ""
        return (f"StatePool({self.num_layers} layers, {self.max_slots} slots + pad slot {self.pad_slot_id}, "
                f"state {tuple(pool.shape[1:])} {pool.dtype}{conv}, {self.num_in_use} in use, on {self.device})")
