"""torch.ops.ssd on MPS (Apple-silicon GPUs), through Metal kernels.

The kernels live in ``csrc/metal/*.metal`` (shipped inside the package as
``torch_ssd/metal/*.metal`` by setup.py). They are compiled on first use with
``torch.mps.compile_shader`` (torch >= 2.7) and registered for the MPS dispatch key
of ``torch.ops.ssd.{load_state, load_bc, store_state, decode_step, decode_step_out}``
and of the multi-token ops ``decode_step_multi(_out)`` / ``decode_step_varlen(_out)``.
``import torch_ssd`` imports this module only where MPS is available; elsewhere the
module can still be imported (the tests drive the marshalling below with a stand-in
for the compiled library, and run the Metal source on the CPU).

Marshalling. ``compile_shader``'s kernel call binds argument i to buffer i: a tensor
as its memory at its storage offset (no strides, no sizes), a Python int as int64
bytes, a list of ints as an int64 array. Each kernel therefore takes one int64
argument block (``constant ...Args&`` in ssd_kernels.metal) holding every size,
stride (in elements), dtype code and flag; ``*_FIELDS`` below mirror those structs
field by field, and ``*_BUFFERS`` the kernels' buffer order. Argument checks are the
shared C++ ones (``torch_ssd._C.check_*``), so errors read as on every backend.

Kernel choice, made once per call: the pool dtype, the dtype of the N-axis rows
(B, C and a per-element A), unit stride along N or not (``vec`` / ``strided``), and A
per element along N or broadcast (``an`` / ``a1``). When B, C and a per-element A do
not share one dtype they are widened to float32 first (exact, so no result changes).
Slot bookkeeping (pad rows, slots outside the pool, the last writer of a duplicated
destination) is one small ``ssd_row_plan`` launch over the T rows whenever slot
indices are given (or, without them, when the pad id is one of the rows' slots
0..T-1); the step kernel then reads two int64 per row. The multi-token ops
always start with ``ssd_multi_plan`` (one thread per row: its tokens, its source slot,
the slot each token writes), then run ``ssd_decode_step_multi_*``, named like the
single-step kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from . import _C

__all__ = [
    "METAL_FILES",
    "metal_dir",
    "metal_source",
    "library",
    "register",
    "decode_step",
    "decode_step_out",
    "load_state",
    "load_bc",
    "store_state",
    "decode_step_multi",
    "decode_step_multi_out",
    "decode_step_varlen",
    "decode_step_varlen_out",
]

METAL_FILES = ("dstate_io.metal", "ssd_kernels.metal")  # concatenated in this order

# Run-time dtype codes (enum SsdDtype in dstate_io.metal) and kernel-name tags.
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPE_TAG = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# The int64 argument blocks, as (field, count) in declaration order.
PLAN_FIELDS = (
    ("T", 1), ("S", 1), ("pad_slot_id", 1),
    ("has_src_idx", 1), ("src_is_int64", 1), ("src_stride", 1),
    ("has_dst_idx", 1), ("dst_is_int64", 1), ("dst_stride", 1),
    ("rows_read_state", 1),
)
STEP_FIELDS = (
    ("S", 1), ("T", 1), ("H", 1), ("P", 1), ("N", 1), ("heads_per_group", 1),
    ("pool_stride", 4), ("x_stride", 3), ("dt_stride", 3), ("A_stride", 3), ("B_stride", 3),
    ("C_stride", 3), ("D_stride", 2), ("z_stride", 3), ("dt_bias_stride", 2), ("y_stride", 3),
    ("x_dtype", 1), ("dt_dtype", 1), ("A_dtype", 1), ("D_dtype", 1), ("z_dtype", 1),
    ("dt_bias_dtype", 1), ("y_dtype", 1),
    ("has_D", 1), ("has_z", 1), ("has_dt_bias", 1), ("dt_softplus", 1), ("has_plan", 1),
)
LOAD_STATE_FIELDS = (
    ("S", 1), ("T", 1), ("H", 1), ("P", 1), ("N", 1), ("pool_stride", 4),
    ("pad_slot_id", 1), ("has_idx", 1), ("idx_is_int64", 1), ("idx_stride", 1),
)
WIDEN_ROWS_FIELDS = (("T", 1), ("G", 1), ("N", 1), ("src_stride", 3))
STORE_STATE_FIELDS = (
    ("S", 1), ("T", 1), ("H", 1), ("P", 1), ("N", 1), ("pool_stride", 4), ("state_stride", 4),
    ("has_plan", 1),
)
MULTI_PLAN_FIELDS = (
    ("T", 1), ("S", 1), ("pad_slot_id", 1), ("K", 1), ("L", 1),
    ("has_cu_seqlens", 1), ("cu_is_int64", 1), ("cu_stride", 1),
    ("has_src", 1), ("src_is_int64", 1), ("src_row_stride", 1), ("src_col_stride", 1), ("src_cols", 1),
    ("has_dst", 1), ("dst_is_int64", 1), ("dst_row_stride", 1), ("dst_col_stride", 1), ("dst_cols", 1),
    ("dst_per_token", 1),
    ("has_accepted", 1), ("accepted_is_int64", 1), ("accepted_stride", 1),
    ("write_state", 1), ("plan_dst_cols", 1),
)
MULTI_STEP_FIELDS = (
    ("S", 1), ("T", 1), ("H", 1), ("P", 1), ("N", 1), ("heads_per_group", 1),
    ("plan_dst_cols", 1), ("dst_per_token", 1),
    ("pool_stride", 4), ("x_stride", 3), ("dt_stride", 3), ("A_stride", 3), ("B_stride", 3),
    ("C_stride", 3), ("D_stride", 2), ("z_stride", 3), ("dt_bias_stride", 2), ("y_stride", 3),
    ("x_tok", 1), ("dt_tok", 1), ("B_tok", 1), ("C_tok", 1), ("z_tok", 1), ("y_tok", 1),
    ("x_dtype", 1), ("dt_dtype", 1), ("A_dtype", 1), ("D_dtype", 1), ("z_dtype", 1),
    ("dt_bias_dtype", 1), ("y_dtype", 1),
    ("has_D", 1), ("has_z", 1), ("has_dt_bias", 1), ("dt_softplus", 1),
)
# Int64 per row of the multi-token plan before its written slots: first token, count, source.
MULTI_PLAN_HEAD = 3

# Buffer order of each kernel family (buffer i = argument i of the kernel call).
PLAN_BUFFERS = ("src_idx", "dst_idx", "plan", "args")
STEP_BUFFERS = ("pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "plan", "y", "args")
LOAD_STATE_BUFFERS = ("pool", "slot_idx", "out", "args")
WIDEN_ROWS_BUFFERS = ("src", "out", "args")
STORE_STATE_BUFFERS = ("state", "pool", "plan", "args")
MULTI_PLAN_BUFFERS = ("cu_seqlens", "src_idx", "dst_idx", "accepted", "plan", "args")
MULTI_STEP_BUFFERS = STEP_BUFFERS

# Threads per threadgroup we aim for (capped by the pipeline's own limit).
THREADGROUP_TARGET = 256


# ---------------------------------------------------------------------------
# The Metal source and its compiled library.
# ---------------------------------------------------------------------------


def metal_dir() -> Path:
    """Where the .metal files are: inside the installed package, or csrc/metal of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "metal", here.parent / "csrc" / "metal"):
        if all((candidate / name).is_file() for name in METAL_FILES):
            return candidate
    raise RuntimeError(
        f"torch_ssd: the Metal kernel sources {METAL_FILES} are neither in {here / 'metal'} "
        f"(installed package) nor in {here.parent / 'csrc' / 'metal'} (source checkout)"
    )


def metal_source() -> str:
    """The exact text handed to torch.mps.compile_shader (and, in the tests, to g++)."""
    directory = metal_dir()
    return "".join((directory / name).read_text() for name in METAL_FILES)


_compiled = None


def library():
    """The compiled Metal library, compiled on first use."""
    global _compiled
    if _compiled is None:
        if not hasattr(torch.mps, "compile_shader"):
            raise RuntimeError(
                f"torch_ssd's MPS kernels need torch.mps.compile_shader (torch >= 2.7); "
                f"this is torch {torch.__version__}"
            )
        _compiled = torch.mps.compile_shader(metal_source())
    return _compiled


# ---------------------------------------------------------------------------
# Marshalling helpers.
# ---------------------------------------------------------------------------


def pack_args(fields: Sequence[tuple[str, int]], **values) -> list[int]:
    """The int64 argument block: ``values`` laid out in the order of ``fields``."""
    missing = [name for name, _ in fields if name not in values]
    extra = sorted(set(values) - {name for name, _ in fields})
    if missing or extra:
        raise AssertionError(f"torch_ssd.mps: argument block fields missing {missing}, unknown {extra}")
    packed: list[int] = []
    for name, count in fields:
        value = values[name]
        items = list(value) if isinstance(value, (list, tuple, torch.Size)) else [value]
        if len(items) != count:
            raise AssertionError(f"torch_ssd.mps: field {name} takes {count} values, got {items}")
        packed.extend(int(v) for v in items)
    return packed


def _strides(t: Tensor | None, count: int) -> list[int]:
    return list(t.stride()) if t is not None else [0] * count


def _code(t: Tensor | None) -> int:
    return DTYPE_CODE[t.dtype] if t is not None else 0


def _layout_tag(unit: bool) -> str:
    return "vec" if unit else "strided"


def threadgroup(kernel, threads: Sequence[int]) -> list[int]:
    """Threads per threadgroup for a grid: fill x first, then y, then z."""
    limit = min(THREADGROUP_TARGET, int(getattr(kernel, "max_threads_per_threadgroup", THREADGROUP_TARGET)))
    group = []
    for n in threads:
        g = max(1, min(int(n), limit))
        group.append(g)
        limit = max(1, limit // g)
    return group


def _launch(lib, name: str, buffers: Sequence, threads: Sequence[int]) -> None:
    """One kernel launch: buffers in buffer order, a grid of ``threads``."""
    if any(int(n) == 0 for n in threads):
        return
    kernel = getattr(lib, name)
    threads = [int(n) for n in threads]
    kernel(*buffers, threads=threads, group_size=threadgroup(kernel, threads))


def _bindable(t: Tensor | None, fallback: Tensor) -> Tensor:
    """A tensor for a buffer slot: absent or empty operands bind a placeholder the
    kernel never reads (every buffer of a Metal kernel gets an argument)."""
    return fallback if t is None or t.numel() == 0 else t


def _slot_plan(lib, S: int, T: int, src_idx: Tensor | None, dst_idx: Tensor | None, pad_slot_id: int,
               rows_read_state: bool, device) -> Tensor | None:
    """(T, 2) int64 on the device: [source slot or -1, written slot or -1] per row.
    None when there are no slot indices and every row t reads and writes slot t."""
    # Without slot indices row t's slot is t, and the row whose t is the pad id is
    # still a pad row (DESIGN.md section 3): only the plan can say so to the kernels.
    if src_idx is None and dst_idx is None and not 0 <= pad_slot_id < T:
        return None
    plan = torch.empty(2 * T, dtype=torch.int64, device=device)
    args = pack_args(
        PLAN_FIELDS, T=T, S=S, pad_slot_id=pad_slot_id,
        has_src_idx=src_idx is not None,
        src_is_int64=src_idx is not None and src_idx.dtype == torch.int64,
        src_stride=src_idx.stride(0) if src_idx is not None else 0,
        has_dst_idx=dst_idx is not None,
        dst_is_int64=dst_idx is not None and dst_idx.dtype == torch.int64,
        dst_stride=dst_idx.stride(0) if dst_idx is not None else 0,
        rows_read_state=rows_read_state,
    )
    _launch(lib, "ssd_row_plan", [_bindable(src_idx, plan), _bindable(dst_idx, plan), plan, args], [T])
    return plan


def step_kernel_name(pool_dtype: torch.dtype, row_dtype: torch.dtype, unit: bool, a_per_n: bool,
                     multi: bool = False) -> str:
    """ssd_decode_step[_multi]_<pool>_<row>_<vec|strided>_<an|a1>."""
    return (f"ssd_decode_step{'_multi' if multi else ''}_{DTYPE_TAG[pool_dtype]}_{DTYPE_TAG[row_dtype]}_"
            f"{_layout_tag(unit)}_{'an' if a_per_n else 'a1'}")


def _row_operands(ssm_pool: Tensor, A: Tensor, B: Tensor, C: Tensor, N: int):
    """The N-axis rows for one kernel: (A, B, C, unit, a_per_n). B, C and a per-element
    A share one compile-time row type, so mixed dtypes are widened (exactly) to float32;
    ``unit`` when every N-axis row has unit stride."""
    a_per_n = N > 1 and A.stride(-1) != 0
    rows = [B, C] + ([A] if a_per_n else [])
    if len({t.dtype for t in rows}) > 1:
        B, C = B.float(), C.float()
        if a_per_n:
            A = A.float()
    unit = N <= 1 or (ssm_pool.stride(3) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
                      and (not a_per_n or A.stride(-1) == 1))
    return A, B, C, unit, a_per_n


# ---------------------------------------------------------------------------
# The ops. ``lib`` is the compiled library (default: compile on first use).
# ---------------------------------------------------------------------------


def _step_into(lib, dims, ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
               pad_slot_id, y) -> None:
    S, T, H, P, N, G = (int(v) for v in dims)
    if T == 0 or H == 0 or P == 0:
        return
    A, B, C, unit, a_per_n = _row_operands(ssm_pool, A, B, C, N)
    plan = _slot_plan(lib, S, T, slot_idx, dst_slot_idx, pad_slot_id, True, ssm_pool.device)
    args = pack_args(
        STEP_FIELDS, S=S, T=T, H=H, P=P, N=N, heads_per_group=H // G,
        pool_stride=ssm_pool.stride(), x_stride=x.stride(), dt_stride=dt.stride(), A_stride=A.stride(),
        B_stride=B.stride(), C_stride=C.stride(), D_stride=_strides(D, 2), z_stride=_strides(z, 3),
        dt_bias_stride=_strides(dt_bias, 2), y_stride=y.stride(),
        x_dtype=_code(x), dt_dtype=_code(dt), A_dtype=_code(A), D_dtype=_code(D), z_dtype=_code(z),
        dt_bias_dtype=_code(dt_bias), y_dtype=_code(y),
        has_D=D is not None, has_z=z is not None, has_dt_bias=dt_bias is not None,
        dt_softplus=bool(dt_softplus), has_plan=plan is not None,
    )
    buffers = [
        _bindable(ssm_pool, y), x, dt, _bindable(A, y), _bindable(B, y), _bindable(C, y),
        _bindable(D, y), _bindable(z, y), _bindable(dt_bias, y), _bindable(plan, y), y, args,
    ]
    name = step_kernel_name(ssm_pool.dtype, B.dtype, unit, a_per_n)
    _launch(lib, name, buffers, [P, H, T])


def decode_step(ssm_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                dt_softplus: bool = False, slot_idx: Tensor | None = None,
                dst_slot_idx: Tensor | None = None, pad_slot_id: int = -1, *, lib=None) -> Tensor:
    """ssd.decode_step through the Metal kernels (the MPS implementation)."""
    dims = _C.check_decode_step("decode_step", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                dst_slot_idx, pad_slot_id, None)
    y = torch.empty((dims[1], dims[2], dims[3]), dtype=x.dtype, device=ssm_pool.device)
    _step_into(lib if lib is not None else library(), dims, ssm_pool, x, dt, A, B, C, D, z, dt_bias,
               dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, y)
    return y


def decode_step_out(ssm_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                    D: Tensor | None, z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
                    slot_idx: Tensor | None, dst_slot_idx: Tensor | None, pad_slot_id: int, out: Tensor,
                    *, lib=None) -> None:
    """ssd.decode_step_out through the Metal kernels: y into ``out`` (any strides)."""
    dims = _C.check_decode_step("decode_step_out", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx,
                                dst_slot_idx, pad_slot_id, out)
    _step_into(lib if lib is not None else library(), dims, ssm_pool, x, dt, A, B, C, D, z, dt_bias,
               dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, out)


def load_state(ssm_pool: Tensor, slot_idx: Tensor | None = None, pad_slot_id: int = -1, *, lib=None) -> Tensor:
    """ssd.load_state: pool rows widened to a contiguous float32 (T, H, P, N)."""
    S, T, H, P, N = (int(v) for v in _C.check_load_state(ssm_pool, slot_idx, pad_slot_id))
    out = torch.empty((T, H, P, N), dtype=torch.float32, device=ssm_pool.device)
    if out.numel() == 0:
        return out
    lib = lib if lib is not None else library()
    unit = N <= 1 or ssm_pool.stride(3) == 1
    args = pack_args(
        LOAD_STATE_FIELDS, S=S, T=T, H=H, P=P, N=N, pool_stride=ssm_pool.stride(), pad_slot_id=pad_slot_id,
        has_idx=slot_idx is not None,
        idx_is_int64=slot_idx is not None and slot_idx.dtype == torch.int64,
        idx_stride=slot_idx.stride(0) if slot_idx is not None else 0,
    )
    name = f"ssd_load_state_{DTYPE_TAG[ssm_pool.dtype]}_{_layout_tag(unit)}"
    _launch(lib, name, [_bindable(ssm_pool, out), _bindable(slot_idx, out), out, args], [P, H, T])
    return out


def load_bc(B: Tensor, C: Tensor, *, lib=None) -> tuple[Tensor, Tensor]:
    """ssd.load_bc: B and C widened to contiguous float32 (T, G, N)."""
    T, G, N = (int(v) for v in _C.check_load_bc(B, C))
    outs = []
    for operand in (B, C):
        out = torch.empty((T, G, N), dtype=torch.float32, device=operand.device)
        if out.numel() > 0:
            unit = N <= 1 or operand.stride(2) == 1
            args = pack_args(WIDEN_ROWS_FIELDS, T=T, G=G, N=N, src_stride=operand.stride())
            name = f"ssd_widen_rows_{DTYPE_TAG[operand.dtype]}_{_layout_tag(unit)}"
            lib = lib if lib is not None else library()
            _launch(lib, name, [operand, out, args], [G, T])
        outs.append(out)
    return outs[0], outs[1]


def store_state(state: Tensor, ssm_pool: Tensor, slot_idx: Tensor | None = None, pad_slot_id: int = -1,
                *, lib=None) -> None:
    """ssd.store_state: float32 rows rounded once (nearest even) into their pool slots."""
    S, T, H, P, N = (int(v) for v in _C.check_store_state(state, ssm_pool, slot_idx, pad_slot_id))
    if T * H * P * N == 0:
        return
    lib = lib if lib is not None else library()
    unit = N <= 1 or (ssm_pool.stride(3) == 1 and state.stride(3) == 1)
    plan = _slot_plan(lib, S, T, None, slot_idx, pad_slot_id, False, ssm_pool.device)
    args = pack_args(
        STORE_STATE_FIELDS, S=S, T=T, H=H, P=P, N=N, pool_stride=ssm_pool.stride(),
        state_stride=state.stride(), has_plan=plan is not None,
    )
    name = f"ssd_store_state_{DTYPE_TAG[ssm_pool.dtype]}_{_layout_tag(unit)}"
    _launch(lib, name, [state, ssm_pool, _bindable(plan, state), args], [P, H, T])


# ---------------------------------------------------------------------------
# The multi-token ops (docs/multi_token.md).
# ---------------------------------------------------------------------------


def _table_fields(prefix: str, table: Tensor | None) -> dict:
    """A slot table, (T,) or (T, W), int32 or int64, any strides, for MULTI_PLAN_FIELDS."""
    two_d = table is not None and table.dim() == 2
    return {
        f"has_{prefix}": table is not None,
        f"{prefix}_is_int64": table is not None and table.dtype == torch.int64,
        f"{prefix}_row_stride": table.stride(0) if table is not None else 0,
        f"{prefix}_col_stride": table.stride(1) if two_d else 0,
        f"{prefix}_cols": table.shape[1] if two_d else 1,
    }


def _multi_plan(lib, S: int, T: int, K: int, L: int, cu_seqlens: Tensor | None, slot_idx: Tensor | None,
                dst_slot_idx: Tensor | None, num_accepted_tokens: Tensor | None, pad_slot_id: int,
                write_state: bool, device) -> tuple[Tensor, int, bool]:
    """(plan, plan_dst_cols, per_token): T records of MULTI_PLAN_HEAD + plan_dst_cols int64 on
    the device (csrc/step.h's slot rules evaluated once per row by ssd_multi_plan)."""
    dst_table = dst_slot_idx if dst_slot_idx is not None else slot_idx
    per_token = dst_table is not None and dst_table.dim() == 2
    plan_dst_cols = dst_table.shape[1] if per_token else 1
    plan = torch.empty(T * (MULTI_PLAN_HEAD + plan_dst_cols), dtype=torch.int64, device=device)
    args = pack_args(
        MULTI_PLAN_FIELDS, T=T, S=S, pad_slot_id=pad_slot_id, K=K, L=L,
        has_cu_seqlens=cu_seqlens is not None,
        cu_is_int64=cu_seqlens is not None and cu_seqlens.dtype == torch.int64,
        cu_stride=cu_seqlens.stride(0) if cu_seqlens is not None else 0,
        **_table_fields("src", slot_idx), **_table_fields("dst", dst_table),
        dst_per_token=per_token,
        has_accepted=num_accepted_tokens is not None,
        accepted_is_int64=num_accepted_tokens is not None and num_accepted_tokens.dtype == torch.int64,
        accepted_stride=num_accepted_tokens.stride(0) if num_accepted_tokens is not None else 0,
        write_state=bool(write_state), plan_dst_cols=plan_dst_cols,
    )
    buffers = [_bindable(cu_seqlens, plan), _bindable(slot_idx, plan), _bindable(dst_table, plan),
               _bindable(num_accepted_tokens, plan), plan, args]
    _launch(lib, "ssd_multi_plan", buffers, [T])
    return plan, plan_dst_cols, per_token


def _token_strides(t: Tensor | None, varlen: bool) -> tuple[list[int], int]:
    """A token-indexed operand as the kernel reads it: strides at a row's token 0 --
    (T, K, a, b) without its K dim, or (L, a, b) as is -- and the stride between tokens."""
    if t is None:
        return [0, 0, 0], 0
    st = list(t.stride())
    return (st, st[0]) if varlen else ([st[0], st[2], st[3]], st[1])


def _multi_into(lib, S, T, K, L, H, P, N, G, ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus,
                slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state, y) -> None:
    """Both forms: cu_seqlens None is the fixed form (x (T, K, H, P)), else varlen (x (L, H, P))."""
    varlen = cu_seqlens is not None
    if T == 0 or H == 0 or P == 0 or (K if not varlen else L) == 0:
        return
    A, B, C, unit, a_per_n = _row_operands(ssm_pool, A, B, C, N)
    plan, plan_dst_cols, per_token = _multi_plan(lib, S, T, K, L, cu_seqlens, slot_idx, dst_slot_idx,
                                                 num_accepted_tokens, pad_slot_id, write_state, ssm_pool.device)
    strides = {name: _token_strides(t, varlen) for name, t in
               (("x", x), ("dt", dt), ("B", B), ("C", C), ("z", z), ("y", y))}
    args = pack_args(
        MULTI_STEP_FIELDS, S=S, T=T, H=H, P=P, N=N, heads_per_group=H // G,
        plan_dst_cols=plan_dst_cols, dst_per_token=per_token,
        pool_stride=ssm_pool.stride(), A_stride=A.stride(), D_stride=_strides(D, 2),
        dt_bias_stride=_strides(dt_bias, 2),
        **{f"{name}_stride": st for name, (st, _) in strides.items()},
        **{f"{name}_tok": tok for name, (_, tok) in strides.items()},
        x_dtype=_code(x), dt_dtype=_code(dt), A_dtype=_code(A), D_dtype=_code(D), z_dtype=_code(z),
        dt_bias_dtype=_code(dt_bias), y_dtype=_code(y),
        has_D=D is not None, has_z=z is not None, has_dt_bias=dt_bias is not None,
        dt_softplus=bool(dt_softplus),
    )
    buffers = [
        _bindable(ssm_pool, y), x, dt, _bindable(A, y), _bindable(B, y), _bindable(C, y),
        _bindable(D, y), _bindable(z, y), _bindable(dt_bias, y), plan, y, args,
    ]
    _launch(lib, step_kernel_name(ssm_pool.dtype, B.dtype, unit, a_per_n, multi=True), buffers, [P, H, T])


def decode_step_multi(ssm_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                      D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                      dt_softplus: bool = False, slot_idx: Tensor | None = None,
                      dst_slot_idx: Tensor | None = None, pad_slot_id: int = -1,
                      num_accepted_tokens: Tensor | None = None, write_state: bool = True, *, lib=None) -> Tensor:
    """ssd.decode_step_multi through the Metal kernels: y (T, K, H, P)."""
    S, T, K, H, P, N, G = (int(v) for v in _C.check_decode_step_multi(
        "decode_step_multi", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx, dst_slot_idx, pad_slot_id,
        num_accepted_tokens, write_state, None))
    y = torch.empty((T, K, H, P), dtype=x.dtype, device=ssm_pool.device)  # every token is written
    _multi_into(lib if lib is not None else library(), S, T, K, 0, H, P, N, G, ssm_pool, x, dt, A, B, C, None,
                D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                write_state, y)
    return y


def decode_step_multi_out(ssm_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                          D: Tensor | None, z: Tensor | None, dt_bias: Tensor | None, dt_softplus: bool,
                          slot_idx: Tensor | None, dst_slot_idx: Tensor | None, pad_slot_id: int,
                          num_accepted_tokens: Tensor | None, write_state: bool, out: Tensor, *, lib=None) -> None:
    """ssd.decode_step_multi_out through the Metal kernels: y into ``out`` (any strides)."""
    S, T, K, H, P, N, G = (int(v) for v in _C.check_decode_step_multi(
        "decode_step_multi_out", ssm_pool, x, dt, A, B, C, D, z, dt_bias, slot_idx, dst_slot_idx, pad_slot_id,
        num_accepted_tokens, write_state, out))
    _multi_into(lib if lib is not None else library(), S, T, K, 0, H, P, N, G, ssm_pool, x, dt, A, B, C, None,
                D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                write_state, out)


def decode_step_varlen(ssm_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                       cu_seqlens: Tensor, D: Tensor | None = None, z: Tensor | None = None,
                       dt_bias: Tensor | None = None, dt_softplus: bool = False, slot_idx: Tensor | None = None,
                       dst_slot_idx: Tensor | None = None, pad_slot_id: int = -1,
                       num_accepted_tokens: Tensor | None = None, write_state: bool = True, *, lib=None) -> Tensor:
    """ssd.decode_step_varlen through the Metal kernels: y (L, H, P); tokens no row owns get 0."""
    S, T, L, H, P, N, G = (int(v) for v in _C.check_decode_step_varlen(
        "decode_step_varlen", ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, slot_idx, dst_slot_idx,
        pad_slot_id, num_accepted_tokens, write_state, None))
    y = torch.zeros((L, H, P), dtype=x.dtype, device=ssm_pool.device)
    _multi_into(lib if lib is not None else library(), S, T, 0, L, H, P, N, G, ssm_pool, x, dt, A, B, C,
                cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                write_state, y)
    return y


def decode_step_varlen_out(ssm_pool: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           cu_seqlens: Tensor, D: Tensor | None, z: Tensor | None, dt_bias: Tensor | None,
                           dt_softplus: bool, slot_idx: Tensor | None, dst_slot_idx: Tensor | None,
                           pad_slot_id: int, num_accepted_tokens: Tensor | None, write_state: bool, out: Tensor,
                           *, lib=None) -> None:
    """ssd.decode_step_varlen_out through the Metal kernels: y into ``out`` (cleared first)."""
    S, T, L, H, P, N, G = (int(v) for v in _C.check_decode_step_varlen(
        "decode_step_varlen_out", ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, slot_idx, dst_slot_idx,
        pad_slot_id, num_accepted_tokens, write_state, out))
    out.zero_()  # tokens that no row owns (a padded tail of the flat axis) get y = 0
    _multi_into(lib if lib is not None else library(), S, T, 0, L, H, P, N, G, ssm_pool, x, dt, A, B, C,
                cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx, pad_slot_id, num_accepted_tokens,
                write_state, out)


# ---------------------------------------------------------------------------
# Registration for the MPS dispatch key.
# ---------------------------------------------------------------------------

_registration = None


def register() -> None:
    """Register the Metal kernels for MPS, all nine ops (idempotent). Done on import where MPS is available."""
    global _registration
    if _registration is not None:
        return
    impl = torch.library.Library("ssd", "IMPL")  # kept alive in _registration

    def mps_load_state(ssm_pool, slot_idx=None, pad_slot_id=-1):
        return load_state(ssm_pool, slot_idx, pad_slot_id)

    def mps_load_bc(B, C):
        return load_bc(B, C)

    def mps_store_state(state, ssm_pool, slot_idx=None, pad_slot_id=-1):
        store_state(state, ssm_pool, slot_idx, pad_slot_id)

    def mps_decode_step(ssm_pool, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                        slot_idx=None, dst_slot_idx=None, pad_slot_id=-1):
        return decode_step(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
                           pad_slot_id)

    def mps_decode_step_out(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
                            pad_slot_id, out):
        decode_step_out(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
                        pad_slot_id, out)

    def mps_decode_step_multi(ssm_pool, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                              slot_idx=None, dst_slot_idx=None, pad_slot_id=-1, num_accepted_tokens=None,
                              write_state=True):
        return decode_step_multi(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
                                 pad_slot_id, num_accepted_tokens, write_state)

    def mps_decode_step_multi_out(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
                                  pad_slot_id, num_accepted_tokens, write_state, out):
        decode_step_multi_out(ssm_pool, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slot_idx, dst_slot_idx,
                              pad_slot_id, num_accepted_tokens, write_state, out)

    def mps_decode_step_varlen(ssm_pool, x, dt, A, B, C, cu_seqlens, D=None, z=None, dt_bias=None,
                               dt_softplus=False, slot_idx=None, dst_slot_idx=None, pad_slot_id=-1,
                               num_accepted_tokens=None, write_state=True):
        return decode_step_varlen(ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx,
                                  dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state)

    def mps_decode_step_varlen_out(ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx,
                                   dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state, out):
        decode_step_varlen_out(ssm_pool, x, dt, A, B, C, cu_seqlens, D, z, dt_bias, dt_softplus, slot_idx,
                               dst_slot_idx, pad_slot_id, num_accepted_tokens, write_state, out)

    impl.impl("load_state", mps_load_state, "MPS")
    impl.impl("load_bc", mps_load_bc, "MPS")
    impl.impl("store_state", mps_store_state, "MPS")
    impl.impl("decode_step", mps_decode_step, "MPS")
    impl.impl("decode_step_out", mps_decode_step_out, "MPS")
    impl.impl("decode_step_multi", mps_decode_step_multi, "MPS")
    impl.impl("decode_step_multi_out", mps_decode_step_multi_out, "MPS")
    impl.impl("decode_step_varlen", mps_decode_step_varlen, "MPS")
    impl.impl("decode_step_varlen_out", mps_decode_step_varlen_out, "MPS")
    _registration = impl


if torch.backends.mps.is_available():
    register()
