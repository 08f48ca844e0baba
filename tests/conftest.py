"""Shared fixtures and helpers for the torch_ssd test suite.

Everything here is device-generic: inputs are drawn on the CPU from a seeded
generator and then moved, so the same values reach every backend, and the float64
reference always runs on the CPU (MPS has no float64).

Helpers other test files may import:
  DEVICES, FLOAT_DTYPES, STEP_ARGS, LAYOUTS
  make_inputs(S, T, H, P, N, G, ...)        random decode-step inputs (a dict in schema order)
  step_args(inputs)                          the positional argument tuple of ssd.decode_step
  clone_inputs(inputs)                       fresh copies, same values and strides
  apply_layout(inputs, layout)               same values, different strides / storage
  reference_step(inputs)                     float64 reference (y, pool, state) on the CPU
  writing_rows(inputs)                       [(row, dst slot)] of rows that write state
  assert_step_matches_reference(inputs, pool_before, y)
  relative_error(out, ref), y_tolerance(dtype), assert_pool_rows_close(...)
  assert_outside_view_unchanged(view, base_before)
  checked_mode fixture                       torch_ssd.set_checks(True), restored afterwards
  assert_lean_kernel_runs(call, family, lean, monkeypatch)
                                             the profiler sees the lean kernel by default, not with
                                             TORCH_SSD_CUDA_KERNEL=block (CUDA only)
"""

from __future__ import annotations

import zlib

import pytest
import torch

import torch_ssd
from torch_ssd import reference

# ---------------------------------------------------------------------------
# Devices and dtypes
# ---------------------------------------------------------------------------


def _present_devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


DEVICES = _present_devices()
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# Argument names of ssd.decode_step, in schema order.
STEP_ARGS = (
    "ssm_pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus",
    "slot_idx", "dst_slot_idx", "pad_slot_id",
)


def dtype_id(dtype: torch.dtype) -> str:
    return DTYPE_IDS.get(dtype, str(dtype))


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def checked_mode():
    """Checked mode on for one test, then back to whatever it was."""
    before = torch_ssd.checks_enabled()
    torch_ssd.set_checks(True)
    try:
        yield
    finally:
        torch_ssd.set_checks(before)


@pytest.fixture
def unchecked_mode():
    """Checked mode off for one test (TORCH_SSD_CHECKS=1 may have turned it on)."""
    before = torch_ssd.checks_enabled()
    torch_ssd.set_checks(False)
    try:
        yield
    finally:
        torch_ssd.set_checks(before)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make_inputs(
    S: int | None,
    T: int,
    H: int,
    P: int,
    N: int,
    G: int,
    *,
    device: str = "cpu",
    pool_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype = torch.float32,
    dtypes: dict[str, torch.dtype] | None = None,
    with_D: bool = True,
    with_z: bool = True,
    with_dt_bias: bool = True,
    dt_softplus: bool = True,
    slots: str = "slot_idx",
    pad_rows: tuple[int, ...] = (),
    dst_pad_rows: tuple[int, ...] = (),
    pad_slot_id: int = -1,
    idx_dtype: torch.dtype = torch.int64,
    per_head: bool = False,
    seed: int = 0,
) -> dict:
    """Random decode-step inputs, a dict keyed by the op's argument names (schema order).

    ``slots``: "identity" (no slot_idx: row t uses slot t), "slot_idx" (random
    distinct slots, written in place), "dst" (slot_idx and a distinct dst_slot_idx),
    "dst_only" (dst_slot_idx without slot_idx). Source and destination slots never
    overlap across rows, so the answer does not depend on the order rows run in.
    ``pad_rows`` get ``pad_slot_id`` as source, ``dst_pad_rows`` as destination.
    ``per_head``: A, dt, D and dt_bias hold one value per head (per row for dt), laid
    out in full; ``apply_layout(..., "broadcast")`` can then expand them with stride 0.
    ``dtypes`` overrides ``dtype`` per argument name.
    S defaults to 2T + 3 so some slots are never addressed.
    """
    if S is None:
        S = 2 * T + 3
    assert H % G == 0
    gen = torch.Generator().manual_seed(_seed(S, T, H, P, N, G, seed))
    types = {name: dtype for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")}
    types.update(dtypes or {})

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def rand(*shape):
        return torch.rand(*shape, generator=gen)

    def per_channel(full_shape, head_shape):
        """A (T, H, P) / (H, P) / (H, P, N) value, constant over P and N when per_head."""
        return full_shape if not per_head else head_shape

    pool = randn(S, H, P, N)
    x = randn(T, H, P)
    z = randn(T, H, P)
    B = randn(T, G, N)
    C = randn(T, G, N)

    if dt_softplus:
        dt = randn(*per_channel((T, H, P), (T, H, 1))) * 1.5 - 1.0
        if T > 0:
            # Both sides of the softplus threshold (20) with large values.
            dt.view(T, -1)[0, 0] = 25.0
            if dt.view(T, -1).shape[1] > 1:
                dt.view(T, -1)[0, 1] = 19.5
        dt_bias = randn(*per_channel((H, P), (H, 1))) * 0.5 - 0.5
    else:
        dt = rand(*per_channel((T, H, P), (T, H, 1))) * 0.5 + 0.01
        dt_bias = rand(*per_channel((H, P), (H, 1))) * 0.1
    A = -torch.exp(rand(*per_channel((H, P, N), (H, 1, 1))) * 2.0 - 1.0)
    D = randn(*per_channel((H, P), (H, 1)))
    dt = dt.expand(T, H, P).contiguous()
    dt_bias = dt_bias.expand(H, P).contiguous()
    A = A.expand(H, P, N).contiguous()
    D = D.expand(H, P).contiguous()

    slot_idx = dst_slot_idx = None
    perm = torch.randperm(S, generator=gen)
    if slots == "identity":
        assert not pad_rows and not dst_pad_rows, "pad rows need slot_idx"
        assert T <= S
    elif slots == "slot_idx":
        assert T <= S
        slot_idx = perm[:T].clone()
    elif slots == "dst":
        assert 2 * T <= S
        slot_idx = perm[:T].clone()
        dst_slot_idx = perm[T : 2 * T].clone()
    elif slots == "dst_only":
        assert 2 * T <= S
        # Sources are 0..T-1; destinations avoid them.
        dst_slot_idx = (T + torch.randperm(S - T, generator=gen)[:T]).clone()
    else:
        raise ValueError(slots)
    for t in pad_rows:
        assert slot_idx is not None
        slot_idx[t] = pad_slot_id
    for t in dst_pad_rows:
        assert dst_slot_idx is not None
        dst_slot_idx[t] = pad_slot_id

    def dev(t, dt_):
        return None if t is None else t.to(dtype=dt_).to(device)

    return {
        "ssm_pool": dev(pool, pool_dtype),
        "x": dev(x, types["x"]),
        "dt": dev(dt, types["dt"]),
        "A": dev(A, types["A"]),
        "B": dev(B, types["B"]),
        "C": dev(C, types["C"]),
        "D": dev(D, types["D"]) if with_D else None,
        "z": dev(z, types["z"]) if with_z else None,
        "dt_bias": dev(dt_bias, types["dt_bias"]) if with_dt_bias else None,
        "dt_softplus": dt_softplus,
        "slot_idx": dev(slot_idx, idx_dtype),
        "dst_slot_idx": dev(dst_slot_idx, idx_dtype),
        "pad_slot_id": pad_slot_id,
    }


def step_args(inputs: dict) -> tuple:
    """Positional arguments of ssd.decode_step (schema order)."""
    return tuple(inputs[name] for name in STEP_ARGS)


def _clone_same_strides(v: torch.Tensor) -> torch.Tensor:
    # A stride-0 expansion (layout "broadcast") cannot be copied into: its one
    # element along those dimensions is copied, then expanded again.
    if any(st == 0 and sz > 1 for sz, st in zip(v.size(), v.stride())):
        one = v[tuple(slice(0, 1) if st == 0 else slice(None) for st in v.stride())]
        return _clone_same_strides(one).expand(v.size())
    c = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device)
    c.copy_(v)
    return c


def clone_inputs(inputs: dict) -> dict:
    """Independent copies of every tensor, same values and strides."""
    return {k: _clone_same_strides(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def run_step(inputs: dict) -> torch.Tensor:
    return torch.ops.ssd.decode_step(*step_args(inputs))


def run_step_out(inputs: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.full(inputs["x"].shape, 123.0, dtype=inputs["x"].dtype, device=inputs["x"].device)
    torch.ops.ssd.decode_step_out(*step_args(inputs), out)
    return out


# ---------------------------------------------------------------------------
# Layouts: the same values under different strides and storage
# ---------------------------------------------------------------------------

LAYOUTS = ("contiguous", "transposed", "pool_n_stride", "pool_slice", "offset", "broadcast")

# Elements of storage in front of an "offset" view: 3 breaks every 16-byte alignment.
_OFFSET = 3


def _garbage_like(shape, dtype, device, count=None):
    """Storage filled with finite values, so a stray read or write shows up."""
    numel = count if count is not None else int(torch.Size(shape).numel())
    if dtype.is_floating_point:
        return (torch.randn(numel) * 3 + 5).to(dtype).to(device)
    return torch.full((numel,), 7, dtype=dtype).to(device)


def _reversed_storage(t: torch.Tensor) -> torch.Tensor:
    """The same values stored in reversed dimension order (every stride changes)."""
    if t.dim() <= 1:
        base = _garbage_like((2 * t.numel(),), t.dtype, t.device)
        view = base[::2]
        view.copy_(t)
        return view
    order = list(reversed(range(t.dim())))
    return t.permute(order).contiguous().permute(order)


def _offset_storage(t: torch.Tensor) -> torch.Tensor:
    flat = _garbage_like(None, t.dtype, t.device, count=t.numel() + _OFFSET + 5)
    view = flat[_OFFSET : _OFFSET + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _pool_n_stride(pool: torch.Tensor) -> torch.Tensor:
    S, H, P, N = pool.shape
    base = _garbage_like((S, H, P, 3 * N), pool.dtype, pool.device).view(S, H, P, 3 * N)
    view = base[..., 1::3]
    view.copy_(pool)
    return view


def _pool_slice(pool: torch.Tensor) -> torch.Tensor:
    S, H, P, N = pool.shape
    base = _garbage_like((2 * S, H, P, N), pool.dtype, pool.device).view(2 * S, H, P, N)
    view = base[1::2]
    view.copy_(pool)
    return view


def _broadcast(name: str, t: torch.Tensor) -> torch.Tensor:
    """A stride-0 view of a per-head operand (values must be per-head)."""
    if name == "A":
        view = t[:, :1, :1].clone().expand(t.shape)
    else:  # dt (T, H, P), D and dt_bias (H, P): constant over P
        view = t[..., :1].clone().expand(t.shape)
    assert torch.equal(view, t), f"{name} is not per-head: make the inputs with per_head=True"
    return view


POOL_NAMES = ("ssm_pool",)
BROADCAST_NAMES = ("A", "dt", "D", "dt_bias")


def apply_layout(inputs: dict, layout: str) -> dict:
    """Fresh tensors holding the same values as ``inputs`` under ``layout``.

    contiguous     plain contiguous copies
    transposed     every tensor stored in reversed dimension order (pool stride along N
                   is not 1; x, B, C, ... are permuted views); 1-D tensors get stride 2
    pool_n_stride  the pool is a view with stride 3 along N (and offset 1)
    pool_slice     the pool is pool_base[1::2] of a pool with 2S slots
    offset         every tensor is a view at storage offset 3 of a larger buffer
    broadcast      A, dt, D and dt_bias are stride-0 expansions (inputs must be per_head)

    Keys other than the decode-step arguments (e.g. "state", "out") are relaid too.
    For views, ``tensor._base`` is the storage-holding tensor (see
    assert_outside_view_unchanged).
    """
    out = {}
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor):
            out[name] = t
            continue
        t = t.contiguous().clone()
        if layout == "contiguous":
            pass
        elif layout == "transposed":
            t = _reversed_storage(t)
        elif layout == "pool_n_stride":
            t = _pool_n_stride(t) if name in POOL_NAMES else t
        elif layout == "pool_slice":
            t = _pool_slice(t) if name in POOL_NAMES else t
        elif layout == "offset":
            t = _offset_storage(t)
        elif layout == "broadcast":
            t = _broadcast(name, t) if name in BROADCAST_NAMES else t
        else:
            raise ValueError(layout)
        out[name] = t
    return out


def storage_base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def assert_outside_view_unchanged(view: torch.Tensor, base_before: torch.Tensor) -> None:
    """Everything in the view's storage tensor outside the view is bit-for-bit as before."""
    base = storage_base(view)
    expected = base_before.clone()
    assert expected.is_contiguous() and base.is_contiguous()
    expected.as_strided(view.size(), view.stride(), view.storage_offset() - base.storage_offset()).copy_(view)
    assert torch.equal(base, expected), "a kernel wrote outside the pool view"


# ---------------------------------------------------------------------------
# Reference and tolerances
# ---------------------------------------------------------------------------


def _cpu(t):
    return None if t is None else t.detach().cpu()


def reference_step(inputs: dict):
    """(y, new_pool, state) of the float64 reference, on the CPU."""
    args = {k: (_cpu(v) if isinstance(v, torch.Tensor) or v is None else v) for k, v in inputs.items()}
    args = {k: args[k] for k in STEP_ARGS}
    return reference.decode_step(**args, compute_dtype=torch.float64)


def _slots_list(idx, T):
    return list(range(T)) if idx is None else [int(v) for v in idx.cpu().tolist()]


def writing_rows(inputs: dict) -> list[tuple[int, int]]:
    """(row, dst slot) of every row that writes state: src and dst addressable, and
    no later such row writes the same slot (DESIGN.md section 3)."""
    T = inputs["x"].shape[0]
    S = inputs["ssm_pool"].shape[0]
    pad = inputs["pad_slot_id"]
    src = _slots_list(inputs["slot_idx"], T)
    dst = src if inputs["dst_slot_idx"] is None else _slots_list(inputs["dst_slot_idx"], T)

    def ok(s):
        return s != pad and 0 <= s < S

    rows = {}
    for t in range(T):
        if ok(src[t]) and ok(dst[t]):
            rows[dst[t]] = t  # a later row overrides
    return sorted((t, slot) for slot, t in rows.items())


def reading_rows(inputs: dict) -> list[int]:
    """Rows whose source slot is addressable (the others are pad rows, y = 0)."""
    T = inputs["x"].shape[0]
    S = inputs["ssm_pool"].shape[0]
    pad = inputs["pad_slot_id"]
    src = _slots_list(inputs["slot_idx"], T)
    return [t for t in range(T) if src[t] != pad and 0 <= src[t] < S]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (absolute error when ref is 0)."""
    out = out.detach().cpu().double()
    ref = ref.detach().cpu().double()
    diff = (out - ref).norm().item()
    scale = ref.norm().item()
    return diff / scale if scale > 0 else diff


def y_tolerance(dtype: torch.dtype) -> float:
    """Relative-norm tolerance for y stored in ``dtype`` against float64: each element
    is rounded once to ``dtype`` (at most half an ulp, <= eps/2 relative), and the
    float32 arithmetic before it adds ~1e-6."""
    return 0.5 * torch.finfo(dtype).eps + 2e-5


_F32_EPS = torch.finfo(torch.float32).eps
_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at |values| (float64), subnormals included."""
    v = values.double().abs()
    _, exponent = torch.frexp(v)  # v = m * 2**exponent, 0.5 <= m < 1
    bits = _MANTISSA_BITS[dtype]
    tiny = torch.finfo(dtype).smallest_normal * 2.0**-bits  # smallest subnormal
    spacing = torch.ldexp(torch.ones_like(v), (exponent - 1 - bits).to(torch.int64))
    return torch.where(v == 0, torch.full_like(v, tiny), spacing.clamp_min(tiny))


# Float32 rounding of the recurrence, in ulps of |old| and |s|: the kernels measure
# about 3 on CPU; 6 leaves room for another backend's expf.
_F32_ULPS = 6


def assert_pool_rows_close(got: torch.Tensor, state64: torch.Tensor, old: torch.Tensor, pool_dtype) -> None:
    """A written pool row against the float64 state, element by element.

    The kernel rounds a float32 state once, to nearest, into the pool dtype: within
    half an ulp of the pool dtype, plus the float32 rounding of the recurrence, a few
    float32 ulps of its terms (|old * dA| + |dt * B * x| <= 4|old| + |s| here). For
    bf16 and fp16 pools the first term dominates: one ulp off fails.
    """
    got = got.detach().cpu().double()
    s = state64.double()
    old = old.detach().cpu().double()
    bound = 0.5 * ulp(s, pool_dtype) + _F32_ULPS * _F32_EPS * (4 * old.abs() + s.abs())
    err = (got - s).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} pool elements off by more than half an ulp of {pool_dtype} "
        f"(+ float32 rounding): worst err {float((err - bound).max()):.3g} above bound; "
        f"at {tuple(int(i) for i in (bad.nonzero()[0]))}: got {float(got[bad][0])}, want {float(s[bad][0])}"
    )


def assert_step_matches_reference(inputs: dict, pool_before: torch.Tensor, y: torch.Tensor) -> None:
    """y and the whole pool after one decode step, against the float64 reference.

    ``inputs`` holds the pool after the call; ``pool_before`` a copy from before.
    """
    before = dict(inputs, ssm_pool=pool_before)
    ref_y, _, ref_state = reference_step(before)
    pool_after = inputs["ssm_pool"].detach().cpu()
    pool_before = pool_before.cpu()
    x = inputs["x"]
    T = x.shape[0]
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device

    y_cpu = y.detach().cpu()
    live = reading_rows(before)
    for t in range(T):
        if t not in live:
            assert torch.equal(y_cpu[t], torch.zeros_like(y_cpu[t])), f"pad row {t}: y must be 0"
    if live:
        err = relative_error(y_cpu[live], ref_y[live])
        tol = y_tolerance(x.dtype)
        assert err <= tol, f"y: ||y - ref|| / ||ref|| = {err:.3g} > {tol:.3g} (x {x.dtype})"

    written = writing_rows(before)
    written_slots = {slot for _, slot in written}
    for slot in range(pool_after.shape[0]):
        if slot not in written_slots:
            assert torch.equal(pool_after[slot], pool_before[slot]), f"slot {slot} is not addressed but changed"
    src = _slots_list(before["slot_idx"], T)
    for t, slot in written:
        assert_pool_rows_close(pool_after[slot], ref_state[t], pool_before[src[t]], pool_before.dtype)


def assert_lean_kernel_runs(call, family: str, lean: str, monkeypatch) -> None:
    """The CUDA kernels ``call()`` launches whose names contain ``family``, as the
    profiler sees them: all of them the lean kernel (name containing ``lean``) by
    default, none of them with TORCH_SSD_CUDA_KERNEL=block -- so that a test comparing
    the two settings compares two different kernels."""

    def kernels() -> list[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if family in e.name]

    monkeypatch.delenv("TORCH_SSD_CUDA_KERNEL", raising=False)
    names = kernels()
    assert names and all(lean in name for name in names), names
    monkeypatch.setenv("TORCH_SSD_CUDA_KERNEL", "block")
    names = kernels()
    assert names and not any(lean in name for name in names), names
