"""The Python MPS path (torch_ssd/mps.py) against a recording stand-in for the
compiled Metal library, on any machine.

torch.mps.compile_shader binds kernel argument i to buffer i: a tensor as its memory
from its storage offset on (no strides, no sizes), ints and int lists as int64
bytes. The stand-in records every launch; each test then reads the launch the way
the Metal kernel will, using only facts read from the .metal source (buffer order,
the argument struct's fields, the instantiation's template arguments): it gathers
every operand from its bound buffer with the strides found in the argument block
and compares the values with the tensor the caller passed. So a wrong stride, a
wrong offset, a swapped argument, a wrong dtype code or a kernel whose layout path
does not fit the strides fails here. Grids, threadgroups, slot plans and
registration are checked too. tests/test_metal_cpu.py runs the same path with the
Metal source executed on the CPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import metal_parse
import test_multi_token as mt
from conftest import LAYOUTS, apply_layout, make_inputs, step_args
from torch_ssd import mps

# Out-of-range slots are pad rows unless a test turns checked mode on.
pytestmark = pytest.mark.usefixtures("unchecked_mode")

REPO = Path(__file__).resolve().parents[1]
SOURCE = mps.metal_source()
KERNELS = metal_parse.kernels(SOURCE)
METAL_DTYPES = {"float": torch.float32, "half": torch.float16, "bf16_t": torch.bfloat16}
CODES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass
class Launch:
    name: str
    function: str
    template: list[str]
    buffers: dict[str, object]  # Metal parameter name -> what was bound
    args: dict[str, object]     # the argument block, by struct field
    threads: list[int]
    group_size: list[int]


class RecordingKernel:
    def __init__(self, library: "RecordingLibrary", name: str):
        self.library, self.name = library, name
        self.max_threads_per_threadgroup = library.max_threads

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None):
        assert arg_casts is None
        function, template = metal_parse.instantiation(KERNELS[self.name])
        params = metal_parse.kernel_buffers(SOURCE, function)
        assert len(args) == len(params), f"{self.name}: {len(args)} arguments for buffers {params}"
        struct = metal_parse.kernel_args_struct(SOURCE, function)
        block = args[-1]
        assert isinstance(block, list) and all(type(v) is int for v in block), block
        assert all(-(2**63) <= v < 2**63 for v in block)
        for arg in args[:-1]:
            assert isinstance(arg, torch.Tensor), f"{self.name}: buffers take tensors, got {type(arg)}"
        self.library.launches.append(Launch(
            self.name, function, template, dict(zip(params[:-1], args[:-1])),
            metal_parse.unpack(metal_parse.struct_fields(SOURCE, struct), block),
            list(threads), list(group_size) if group_size is not None else None,
        ))


class RecordingLibrary:
    """Stands in for torch.mps.compile_shader(...): kernels are looked up by host name."""

    def __init__(self, max_threads: int = 1024):
        self.max_threads = max_threads
        self.launches: list[Launch] = []

    def __getattr__(self, name):
        if name.startswith("_") or name not in KERNELS:
            raise AttributeError(f"no kernel named {name!r} in the Metal library")
        return RecordingKernel(self, name)



# ---------------------------------------------------------------------------
# Reading a launch the way the kernel does
# ---------------------------------------------------------------------------


def bound_memory(t: torch.Tensor) -> torch.Tensor:
    """Buffer i as the kernel sees it: the storage from the tensor's storage offset on."""
    count = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (count,), (1,))


def gather(buffer: torch.Tensor, sizes, strides) -> torch.Tensor:
    """Elements base[sum(i_k * stride_k)] of a bound buffer."""
    return bound_memory(buffer).as_strided(tuple(sizes), tuple(strides))


def assert_operand(launch: Launch, name: str, expected: torch.Tensor, stride_field: str,
                   dtype: torch.dtype | None = None):
    """The kernel's reading of operand ``name`` equals ``expected`` (values, in float)."""
    buffer = launch.buffers[name]
    strides = launch.args[stride_field]
    got = gather(buffer, expected.shape, strides)
    if dtype is not None:
        assert buffer.dtype == dtype, f"{launch.name}: {name} bound as {buffer.dtype}, the kernel reads {dtype}"
    assert torch.equal(got.float(), expected.float()), f"{launch.name}: {name} read wrongly (strides {strides})"


def assert_grid(launch: Launch, threads, max_threads=1024):
    assert launch.threads == list(threads)
    group = launch.group_size
    assert group is not None and len(group) == len(threads)
    total = 1
    for g, n in zip(group, threads):
        assert 1 <= g <= n
        total *= g
    assert total <= min(max_threads, mps.THREADGROUP_TARGET)
    assert group[0] == min(threads[0], max_threads, mps.THREADGROUP_TARGET)


def check_plan_launch(plan: Launch, T, S, src, dst, pad_slot_id, rows_read_state, max_threads=1024):
    assert plan.name == "ssd_row_plan"
    a = plan.args
    assert (a["T"], a["S"], a["pad_slot_id"], a["rows_read_state"]) == (T, S, pad_slot_id, int(rows_read_state))
    for which, idx in (("src", src), ("dst", dst)):
        assert a[f"has_{which}_idx"] == int(idx is not None)
        if idx is not None:
            buffer = plan.buffers[f"{which}_idx"]
            expected_dtype = torch.int64 if a[f"{which}_is_int64"] else torch.int32
            assert buffer.dtype == idx.dtype == expected_dtype
            assert torch.equal(gather(buffer, (T,), (a[f"{which}_stride"],)), idx)
    assert plan.buffers["plan"].dtype == torch.int64 and plan.buffers["plan"].numel() == 2 * T
    assert_grid(plan, [T], max_threads)


def check_step_launches(lib: RecordingLibrary, inputs: dict, y: torch.Tensor) -> Launch:
    """Everything a decode-step launch tells the kernel, against the caller's tensors."""
    pool, x, dt, A, B, C = (inputs[k] for k in ("ssm_pool", "x", "dt", "A", "B", "C"))
    S, H, P, N = pool.shape
    T, G = x.shape[0], B.shape[1]
    slot_idx, dst_slot_idx = inputs["slot_idx"], inputs["dst_slot_idx"]
    has_plan = slot_idx is not None or dst_slot_idx is not None
    assert len(lib.launches) == 1 + has_plan
    step = lib.launches[-1]
    assert step.function == "ssd_decode_step"
    a = step.args
    pool_t, row_t, unit, a_per_n = step.template
    pool_t, row_t, unit, a_per_n = METAL_DTYPES[pool_t], METAL_DTYPES[row_t], unit == "true", a_per_n == "true"

    assert (a["S"], a["T"], a["H"], a["P"], a["N"], a["heads_per_group"]) == (S, T, H, P, N, H // G)
    assert_grid(step, [P, H, T], lib.max_threads)

    # The pool: the caller's own memory, read and written in place.
    assert pool_t == pool.dtype
    assert_operand(step, "pool", pool, "pool_stride", pool.dtype)
    assert gather(step.buffers["pool"], pool.shape, a["pool_stride"]).data_ptr() == pool.data_ptr()
    # y: the returned tensor (or out) itself, with its strides.
    assert step.buffers["y"].dtype == x.dtype and CODES[a["y_dtype"]] == x.dtype
    view = gather(step.buffers["y"], y.shape, a["y_stride"])
    assert view.data_ptr() == y.data_ptr() and view.stride() == y.stride()

    # Per-channel operands: run-time dtype codes.
    for name in ("x", "dt", "D", "z", "dt_bias"):
        t = inputs[name]
        if name in ("D", "z", "dt_bias"):
            assert a[f"has_{name}"] == int(t is not None), name
            if t is None:
                continue
        assert CODES[a[f"{name}_dtype"]] == t.dtype, name
        assert_operand(step, name, t, f"{name}_stride", t.dtype)
    assert a["dt_softplus"] == int(inputs["dt_softplus"])

    # N-axis rows: one compile-time row type; mixed dtypes arrive widened to float32.
    rows = [B, C] + ([A] if a_per_n else [])
    assert row_t == (rows[0].dtype if len({t.dtype for t in rows}) == 1 else torch.float32)
    assert_operand(step, "B", B, "B_stride", row_t)
    assert_operand(step, "C", C, "C_stride", row_t)
    assert a_per_n == (N > 1 and A.stride(2) != 0)
    if a_per_n:
        assert_operand(step, "A", A, "A_stride", row_t)
    else:  # read once per channel at A[h, p, 0] with A's own dtype code
        assert CODES[a["A_dtype"]] == A.dtype
        assert_operand(step, "A", A[..., :1], "A_stride", A.dtype)
    # The vector path reads 4 consecutive elements: only where every N-axis row has unit stride.
    if unit and N > 1:
        for name in ("pool_stride", "B_stride", "C_stride") + (("A_stride",) if a_per_n else ()):
            assert a[name][-1] == 1, f"{step.name} takes the vector path but {name} is {a[name]}"
    if not unit:
        strided = ("pool_stride", "B_stride", "C_stride") + (("A_stride",) if a_per_n else ())
        assert N > 1 and any(a[name][-1] != 1 for name in strided), f"{step.name}: every row has unit stride"

    assert a["has_plan"] == int(has_plan)
    if has_plan:
        plan = lib.launches[0]
        check_plan_launch(plan, T, S, slot_idx, dst_slot_idx, inputs["pad_slot_id"], True, lib.max_threads)
        assert step.buffers["plan"].data_ptr() == plan.buffers["plan"].data_ptr()
    return step


# ---------------------------------------------------------------------------
# The Metal source and the Python side agree on the argument layouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "function,struct,fields,buffers",
    [
        ("ssd_row_plan", "PlanArgs", mps.PLAN_FIELDS, mps.PLAN_BUFFERS),
        ("ssd_decode_step", "StepArgs", mps.STEP_FIELDS, mps.STEP_BUFFERS),
        ("ssd_load_state", "LoadStateArgs", mps.LOAD_STATE_FIELDS, mps.LOAD_STATE_BUFFERS),
        ("ssd_widen_rows", "WidenRowsArgs", mps.WIDEN_ROWS_FIELDS, mps.WIDEN_ROWS_BUFFERS),
        ("ssd_store_state", "StoreStateArgs", mps.STORE_STATE_FIELDS, mps.STORE_STATE_BUFFERS),
        ("ssd_multi_plan", "MultiPlanArgs", mps.MULTI_PLAN_FIELDS, mps.MULTI_PLAN_BUFFERS),
        ("ssd_decode_step_multi", "MultiStepArgs", mps.MULTI_STEP_FIELDS, mps.MULTI_STEP_BUFFERS),
    ],
)
def test_argument_layouts_match_the_metal_source(function, struct, fields, buffers):
    assert metal_parse.kernel_args_struct(SOURCE, function) == struct
    assert metal_parse.struct_fields(SOURCE, struct) == list(fields)
    params = metal_parse.kernel_buffers(SOURCE, function)
    assert params[:-1] == list(buffers[:-1]) and buffers[-1] == "args"


def test_multi_plan_record_head_matches_the_metal_source():
    """The host sizes the plan buffer with MULTI_PLAN_HEAD; the kernels index it with kPlanHead."""
    assert int(re.search(r"kPlanHead = (\d+)", SOURCE)[1]) == mps.MULTI_PLAN_HEAD


def test_source_is_ascii():
    """compile_shader hands the source to Metal as an ASCII string."""
    SOURCE.encode("ascii")


def test_every_host_name_is_instantiated():
    names = {mps.step_kernel_name(p, r, u, a, m) for p in FLOATS for r in FLOATS for u in (True, False)
             for a in (True, False) for m in (False, True)}
    for dtype in FLOATS:
        for layout in ("vec", "strided"):
            names |= {f"ssd_{op}_{IDS[dtype]}_{layout}" for op in ("load_state", "widen_rows", "store_state")}
    names |= {"ssd_row_plan", "ssd_multi_plan"}
    assert names == set(KERNELS)
    # The host name says what the instantiation is.
    for name, fn in KERNELS.items():
        function, template = metal_parse.instantiation(fn)
        if function in ("ssd_decode_step", "ssd_decode_step_multi"):
            pool, row, unit, a_per_n = template
            expected = mps.step_kernel_name(METAL_DTYPES[pool], METAL_DTYPES[row], unit == "true", a_per_n == "true",
                                            function == "ssd_decode_step_multi")
            assert name == expected, (name, fn)
        elif template:
            elem, unit = template
            op = function[len("ssd_"):]
            assert name == f"ssd_{op}_{IDS[METAL_DTYPES[elem]]}_{'vec' if unit == 'true' else 'strided'}"


def test_pack_args_is_int64_in_field_order():
    fields = (("a", 1), ("b", 3), ("c", 1))
    assert mps.pack_args(fields, c=7, a=2**40 + 3, b=torch.Size([1, -2, 2**35])) == [2**40 + 3, 1, -2, 2**35, 7]
    with pytest.raises(AssertionError):
        mps.pack_args(fields, a=1, b=[1, 2], c=3)
    with pytest.raises(AssertionError):
        mps.pack_args(fields, a=1, b=[1, 2, 3])


# ---------------------------------------------------------------------------
# decode_step / decode_step_out
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pool_dtype,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16),
                                              (torch.float16, torch.bfloat16)], ids=["f32-f32", "bf16-f16", "f16-bf16"])
def test_decode_step_marshalling(layout, pool_dtype, dtype):
    inputs = make_inputs(None, 5, 4, 3, 10, 2, pool_dtype=pool_dtype, dtype=dtype, slots="dst", pad_rows=(1,),
                         per_head=True)
    inputs = apply_layout(inputs, layout)
    lib = RecordingLibrary()
    y = mps.decode_step(*step_args(inputs), lib=lib)
    assert y.shape == inputs["x"].shape and y.dtype == dtype and y.is_contiguous()
    step = check_step_launches(lib, inputs, y)
    expected_layout = "vec" if layout in ("contiguous", "offset", "broadcast", "pool_slice") else "strided"
    expected_a = "a1" if layout == "broadcast" else "an"
    assert step.name == f"ssd_decode_step_{IDS[pool_dtype]}_{IDS[dtype]}_{expected_layout}_{expected_a}"


@pytest.mark.parametrize(
    "options",
    [
        dict(with_D=False, with_z=False, with_dt_bias=False, dt_softplus=False, slots="identity"),
        dict(idx_dtype=torch.int32, slots="slot_idx"),
        dict(slots="dst_only", pad_slot_id=-7),
        dict(dtypes={"x": torch.float16, "dt": torch.bfloat16, "D": torch.float32, "z": torch.bfloat16,
                     "dt_bias": torch.float16}),
        dict(dtypes={"B": torch.bfloat16, "C": torch.float16, "A": torch.float32}),
    ],
    ids=["bare-identity", "int32", "dst_only", "mixed-scalars", "mixed-rows"],
)
def test_decode_step_marshalling_options(options):
    kwargs = dict(pool_dtype=torch.float32, dtype=torch.float32, slots="dst")
    kwargs.update(options)
    inputs = make_inputs(None, 3, 2, 4, 9, 1, **kwargs)
    lib = RecordingLibrary()
    y = mps.decode_step(*step_args(inputs), lib=lib)
    check_step_launches(lib, inputs, y)


def test_decode_step_out_binds_out_with_its_strides():
    inputs = make_inputs(None, 3, 4, 5, 8, 2, pool_dtype=torch.bfloat16, dtype=torch.float16, slots="slot_idx")
    out = torch.empty(6, 4, 3, dtype=torch.float16)[1:].permute(2, 1, 0)  # (T, H, P), offset and permuted
    lib = RecordingLibrary()
    assert mps.decode_step_out(*step_args(inputs), out, lib=lib) is None
    check_step_launches(lib, inputs, out)


def test_unit_decision_looks_at_every_row_operand():
    for name in ("ssm_pool", "B", "C", "A"):
        inputs = make_inputs(None, 3, 2, 4, 9, 1, slots="slot_idx")
        inputs[name] = apply_layout({name: inputs[name]}, "transposed")[name]
        lib = RecordingLibrary()
        y = mps.decode_step(*step_args(inputs), lib=lib)
        step = check_step_launches(lib, inputs, y)
        assert step.name.endswith("_strided_an"), (name, step.name)


def test_n_equal_one_and_huge_strides():
    # N = 1: one element, no vector chunk: the vec kernel with a broadcast-style A read.
    inputs = make_inputs(None, 2, 2, 3, 1, 1, slots="slot_idx")
    lib = RecordingLibrary()
    y = mps.decode_step(*step_args(inputs), lib=lib)
    assert check_step_launches(lib, inputs, y).name.endswith("_vec_a1")

    # Pool strides beyond 2^31 elements go to the kernel as 64-bit values (meta tensors: no memory).
    S, T, H, P, N, G = 2, 2, 1, 2, 4, 1
    big = 2**33 + 4
    pool = torch.empty_strided((S, H, P, N), (big, P * N, N, 1), device="meta")
    meta = dict(make_inputs(S, T, H, P, N, G, slots="identity", device="meta"), ssm_pool=pool)
    lib = RecordingLibrary()
    mps.decode_step(*step_args(meta), lib=lib)
    assert lib.launches[-1].args["pool_stride"] == [big, P * N, N, 1]


def test_threadgroups_respect_the_pipeline_limit():
    inputs = make_inputs(None, 3, 6, 40, 8, 2, slots="slot_idx")
    for limit in (1024, 64, 24, 1):
        lib = RecordingLibrary(max_threads=limit)
        y = mps.decode_step(*step_args(inputs), lib=lib)
        check_step_launches(lib, inputs, y)


def test_errors_come_from_the_shared_checks():
    inputs = make_inputs(None, 3, 2, 4, 9, 1, slots="slot_idx")
    for name, bad in (("B", inputs["B"][:, :, :4]), ("out", torch.empty(3, 2, 4, dtype=torch.float16)),
                      ("slot_idx", inputs["slot_idx"].float())):
        args = dict(inputs)
        out = None
        if name == "out":
            out = bad
        else:
            args[name] = bad
        lib = RecordingLibrary()
        with pytest.raises(RuntimeError) as mps_error:
            if out is None:
                mps.decode_step(*step_args(args), lib=lib)
            else:
                mps.decode_step_out(*step_args(args), out, lib=lib)
        with pytest.raises(RuntimeError) as cpu_error:
            if out is None:
                torch.ops.ssd.decode_step(*step_args(args))
            else:
                torch.ops.ssd.decode_step_out(*step_args(args), out)
        assert str(mps_error.value) == str(cpu_error.value) and f"'{name}'" in str(mps_error.value)
        assert not lib.launches


def test_empty_batch_launches_nothing():
    inputs = make_inputs(4, 0, 2, 3, 5, 1, slots="slot_idx")
    lib = RecordingLibrary()
    assert mps.decode_step(*step_args(inputs), lib=lib).shape == (0, 2, 3)
    assert not lib.launches


# ---------------------------------------------------------------------------
# The loader verbs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", FLOATS, ids=IDS.get)
@pytest.mark.parametrize("layout", ["contiguous", "pool_n_stride", "pool_slice", "offset", "transposed"])
@pytest.mark.parametrize("with_idx", [False, True], ids=["all_slots", "slot_idx"])
def test_load_state_marshalling(pool_dtype, layout, with_idx):
    S, H, P, N = 5, 3, 2, 6
    pool = apply_layout({"ssm_pool": torch.randn(S, H, P, N).to(pool_dtype)}, layout)["ssm_pool"]
    slot_idx = apply_layout({"i": torch.tensor([3, -1, 0, 9], dtype=torch.int32)}, layout)["i"] if with_idx else None
    lib = RecordingLibrary()
    out = mps.load_state(pool, slot_idx, -1, lib=lib)
    T = S if slot_idx is None else 4
    assert out.shape == (T, H, P, N) and out.dtype == torch.float32 and out.is_contiguous()
    (launch,) = lib.launches
    a = launch.args
    elem, unit = launch.template
    assert METAL_DTYPES[elem] == pool_dtype and (unit == "true") == (pool.stride(3) == 1)
    assert (a["S"], a["T"], a["H"], a["P"], a["N"], a["pad_slot_id"]) == (S, T, H, P, N, -1)
    assert_operand(launch, "pool", pool, "pool_stride", pool_dtype)
    assert launch.buffers["out"].data_ptr() == out.data_ptr()
    assert a["has_idx"] == int(with_idx)
    if with_idx:
        assert a["idx_is_int64"] == 0 and launch.buffers["slot_idx"].dtype == torch.int32
        assert torch.equal(gather(launch.buffers["slot_idx"], (T,), (a["idx_stride"],)), slot_idx)
    assert_grid(launch, [P, H, T])


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset"])
def test_load_bc_marshalling(layout):
    T, G, N = 3, 2, 7
    laid = apply_layout({"B": torch.randn(T, G, N).to(torch.bfloat16), "C": torch.randn(T, G, N)}, layout)
    B, C = laid["B"], laid["C"]
    lib = RecordingLibrary()
    Bf, Cf = mps.load_bc(B, C, lib=lib)
    assert len(lib.launches) == 2
    for launch, operand, out in zip(lib.launches, (B, C), (Bf, Cf)):
        elem, unit = launch.template
        assert METAL_DTYPES[elem] == operand.dtype and (unit == "true") == (operand.stride(2) == 1)
        assert (launch.args["T"], launch.args["G"], launch.args["N"]) == (T, G, N)
        assert_operand(launch, "src", operand, "src_stride", operand.dtype)
        assert launch.buffers["out"].data_ptr() == out.data_ptr() and out.is_contiguous()
        assert_grid(launch, [G, T])


@pytest.mark.parametrize("pool_dtype", FLOATS, ids=IDS.get)
@pytest.mark.parametrize("layout", ["contiguous", "pool_n_stride", "transposed", "offset"])
@pytest.mark.parametrize("with_idx", [False, True], ids=["row_t", "slot_idx"])
def test_store_state_marshalling(pool_dtype, layout, with_idx):
    S, T, H, P, N = 7, 4, 2, 3, 5
    laid = apply_layout({"ssm_pool": torch.randn(S, H, P, N).to(pool_dtype), "state": torch.randn(T, H, P, N),
                         "slot_idx": torch.tensor([6, -1, 2, 6])}, layout)
    pool, state = laid["ssm_pool"], laid["state"]
    slot_idx = laid["slot_idx"] if with_idx else None
    lib = RecordingLibrary()
    mps.store_state(state, pool, slot_idx, -1, lib=lib)
    assert len(lib.launches) == 1 + with_idx
    store = lib.launches[-1]
    a = store.args
    elem, unit = store.template
    assert METAL_DTYPES[elem] == pool_dtype
    assert (unit == "true") == (pool.stride(3) == 1 and state.stride(3) == 1)
    assert (a["S"], a["T"], a["H"], a["P"], a["N"]) == (S, T, H, P, N)
    assert_operand(store, "pool", pool, "pool_stride", pool_dtype)
    assert gather(store.buffers["pool"], pool.shape, a["pool_stride"]).data_ptr() == pool.data_ptr()
    assert_operand(store, "state", state, "state_stride", torch.float32)
    assert a["has_plan"] == int(with_idx)
    if with_idx:
        # store_state rows have no source: only destinations, and no source requirement.
        check_plan_launch(lib.launches[0], T, S, None, slot_idx, -1, False)
        assert store.buffers["plan"].data_ptr() == lib.launches[0].buffers["plan"].data_ptr()
    assert_grid(store, [P, H, T])


# ---------------------------------------------------------------------------
# The multi-token ops
# ---------------------------------------------------------------------------


def token_view(launch: Launch, name: str, shape, varlen: bool) -> torch.Tensor:
    """A token-indexed operand as the multi-token kernel reads it: strides at a row's
    token 0 plus the stride from one token to the next."""
    st, tok = launch.args[f"{name}_stride"], launch.args[f"{name}_tok"]
    if varlen:
        assert tok == st[0], f"{name}: on the flat axis a token is a row, got tok {tok} and strides {st}"
        return gather(launch.buffers[name], shape, st)
    return gather(launch.buffers[name], shape, (st[0], tok, st[1], st[2]))


def check_multi_launches(lib: RecordingLibrary, d: dict, y: torch.Tensor) -> Launch:
    """Everything the plan and step launches of a multi-token call tell the kernels."""
    varlen = "cu_seqlens" in d
    pool, x, A, B, C = (d[k] for k in ("ssm_pool", "x", "A", "B", "C"))
    S, H, P, N = pool.shape
    T = d["cu_seqlens"].shape[0] - 1 if varlen else x.shape[0]
    G = B.shape[-2]
    assert [launch.name for launch in lib.launches[:1]] == ["ssd_multi_plan"] and len(lib.launches) == 2
    plan, step = lib.launches

    # The plan: one thread per row, reading the index tensors with their own strides.
    a = plan.args
    assert (a["T"], a["S"], a["pad_slot_id"], a["write_state"]) == (T, S, d["pad_slot_id"], int(d["write_state"]))
    assert a["has_cu_seqlens"] == int(varlen)
    if varlen:
        cu = d["cu_seqlens"]
        assert a["L"] == x.shape[0] and plan.buffers["cu_seqlens"].dtype == cu.dtype
        assert a["cu_is_int64"] == int(cu.dtype == torch.int64)
        assert torch.equal(gather(plan.buffers["cu_seqlens"], cu.shape, (a["cu_stride"],)), cu)
    else:
        assert a["K"] == x.shape[1]
    dst_table = d["dst_slot_idx"] if d["dst_slot_idx"] is not None else d["slot_idx"]
    for which, table in (("src", d["slot_idx"]), ("dst", dst_table)):
        assert a[f"has_{which}"] == int(table is not None), which
        if table is None:
            continue
        buffer = plan.buffers[f"{which}_idx"]
        assert buffer.dtype == table.dtype == (torch.int64 if a[f"{which}_is_int64"] else torch.int32)
        as_2d = table if table.dim() == 2 else table[:, None]
        assert a[f"{which}_cols"] == as_2d.shape[1]
        read = gather(buffer, as_2d.shape, (a[f"{which}_row_stride"], a[f"{which}_col_stride"]))
        assert torch.equal(read, as_2d), which
    per_token = dst_table is not None and dst_table.dim() == 2
    assert a["dst_per_token"] == int(per_token)
    assert a["plan_dst_cols"] == (dst_table.shape[1] if per_token else 1)
    accepted = d["num_accepted_tokens"]
    assert a["has_accepted"] == int(accepted is not None)
    if accepted is not None:
        assert plan.buffers["accepted"].dtype == accepted.dtype
        assert a["accepted_is_int64"] == int(accepted.dtype == torch.int64)
        assert torch.equal(gather(plan.buffers["accepted"], accepted.shape, (a["accepted_stride"],)), accepted)
    records = plan.buffers["plan"]
    assert records.dtype == torch.int64 and records.numel() == T * (mps.MULTI_PLAN_HEAD + a["plan_dst_cols"])
    assert_grid(plan, [T])

    # The step: the plan it reads, the pool, every operand through its strides.
    assert step.function == "ssd_decode_step_multi"
    s = step.args
    pool_t, row_t, unit, a_per_n = step.template
    pool_t, row_t, unit, a_per_n = METAL_DTYPES[pool_t], METAL_DTYPES[row_t], unit == "true", a_per_n == "true"
    assert (s["S"], s["T"], s["H"], s["P"], s["N"], s["heads_per_group"]) == (S, T, H, P, N, H // G)
    assert (s["plan_dst_cols"], s["dst_per_token"]) == (a["plan_dst_cols"], a["dst_per_token"])
    assert step.buffers["plan"].data_ptr() == records.data_ptr()
    assert_grid(step, [P, H, T])
    assert pool_t == pool.dtype
    assert_operand(step, "pool", pool, "pool_stride", pool.dtype)
    assert gather(step.buffers["pool"], pool.shape, s["pool_stride"]).data_ptr() == pool.data_ptr()
    view = token_view(step, "y", y.shape, varlen)
    assert view.data_ptr() == y.data_ptr() and view.stride() == y.stride()
    assert step.buffers["y"].dtype == x.dtype and CODES[s["y_dtype"]] == x.dtype

    for name in ("x", "dt", "z"):
        t = d[name]
        if name == "z":
            assert s["has_z"] == int(t is not None)
            if t is None:
                continue
        assert CODES[s[f"{name}_dtype"]] == t.dtype and step.buffers[name].dtype == t.dtype, name
        assert torch.equal(token_view(step, name, t.shape, varlen).float(), t.float()), name
    for name in ("D", "dt_bias"):
        t = d[name]
        assert s[f"has_{name}"] == int(t is not None)
        if t is not None:
            assert CODES[s[f"{name}_dtype"]] == t.dtype
            assert_operand(step, name, t, f"{name}_stride", t.dtype)
    assert s["dt_softplus"] == int(d["dt_softplus"])

    rows = [B, C] + ([A] if a_per_n else [])
    assert row_t == (rows[0].dtype if len({t.dtype for t in rows}) == 1 else torch.float32)
    for name, t in (("B", B), ("C", C)):
        assert step.buffers[name].dtype == row_t
        assert torch.equal(token_view(step, name, t.shape, varlen).float(), t.float()), name
    assert a_per_n == (N > 1 and A.stride(2) != 0)
    if a_per_n:
        assert_operand(step, "A", A, "A_stride", row_t)
    else:
        assert CODES[s["A_dtype"]] == A.dtype
        assert_operand(step, "A", A[..., :1], "A_stride", A.dtype)
    row_strides = [s["pool_stride"][-1], s["B_stride"][-1], s["C_stride"][-1]]
    row_strides += [s["A_stride"][-1]] if a_per_n else []
    assert unit == (N <= 1 or all(v == 1 for v in row_strides)), (step.name, row_strides)
    return step


def multi_case(form: str, pattern: str = "spec_mixed", per_head: bool = False, T: int = 4, K: int = 3, **kw):
    d = mt.set_slots(mt.token_operands((T, K), T * K + T + 3, per_head=per_head, **kw), pattern, T, K)
    return mt.varlen_from_fixed(d) if form == "varlen" else d


def run_multi(d: dict, lib, out: torch.Tensor | None = None):
    if "cu_seqlens" in d:
        if out is None:
            return mps.decode_step_varlen(*mt.varlen_args(d), lib=lib)
        return mps.decode_step_varlen_out(*mt.varlen_args(d), out, lib=lib)
    if out is None:
        return mps.decode_step_multi(*mt.multi_args(d), lib=lib)
    return mps.decode_step_multi_out(*mt.multi_args(d), out, lib=lib)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ("fixed", "varlen"))
def test_multi_marshalling(form, layout):
    """A (T, K) table with num_accepted_tokens, pad rows and pad destinations, in every
    layout (cu_seqlens and the tables included)."""
    d = apply_layout(multi_case(form, per_head=True, pool_dtype=torch.bfloat16, dtype=torch.float16), layout)
    lib = RecordingLibrary()
    y = run_multi(d, lib)
    assert y.shape == d["x"].shape and y.dtype == d["x"].dtype and y.is_contiguous()
    step = check_multi_launches(lib, d, y)
    expected_layout = "strided" if layout in ("transposed", "pool_n_stride") else "vec"
    expected_a = "a1" if layout == "broadcast" else "an"
    assert step.name == f"ssd_decode_step_multi_bf16_f16_{expected_layout}_{expected_a}"


@pytest.mark.parametrize("form", ("fixed", "varlen"))
@pytest.mark.parametrize(
    "case",
    [
        dict(pattern="final_in_place", idx_dtype=torch.int32),
        dict(pattern="final_to_dst"),
        dict(pattern="per_token", idx_dtype=torch.int32),
        dict(pattern="spec_zero"),
        dict(pattern="no_write"),
        dict(pattern=None),
        dict(options=dict(D=None, z=None, dt_bias=None, dt_softplus=False)),
        dict(options=dict(pad_slot_id=5)),
        dict(dtypes={"x": torch.float16, "dt": torch.bfloat16, "z": torch.bfloat16, "D": torch.float32,
                     "dt_bias": torch.float16}),
        dict(dtypes={"B": torch.bfloat16, "C": torch.float16}),
    ],
    ids=["final_in_place-int32", "final_to_dst", "per_token-int32", "spec_zero", "no_write", "no_slots",
         "bare", "pad_id_5", "mixed_scalars", "mixed_rows"],
)
def test_multi_marshalling_options(form, case):
    pattern = case.get("pattern", "spec_mixed")
    d = mt.token_operands((4, 3), 20)
    if pattern is not None:
        d = mt.set_slots(d, pattern, 4, 3, idx_dtype=case.get("idx_dtype", torch.int64))
    if form == "varlen":
        d = mt.varlen_from_fixed(d)
    d.update(case.get("options", {}))
    for name, dtype in case.get("dtypes", {}).items():
        d[name] = d[name].to(dtype)
    lib = RecordingLibrary()
    y = run_multi(d, lib)
    check_multi_launches(lib, d, y)


@pytest.mark.parametrize("form", ("fixed", "varlen"))
def test_multi_out_binds_out_with_its_strides(form):
    d = multi_case(form, pool_dtype=torch.float16, dtype=torch.bfloat16)
    shape = tuple(d["x"].shape)
    # Reversed storage order, stride 2 along the last dim, storage offset 1; NaN shows
    # what is not written.
    out = torch.full((*shape[::-1], 2), float("nan"), dtype=torch.bfloat16)[..., 1]
    out = out.permute(*reversed(range(len(shape))))
    assert out.shape == shape and out.storage_offset() == 1
    lib = RecordingLibrary()
    assert run_multi(d, lib, out) is None
    check_multi_launches(lib, d, out)
    if form == "varlen":  # cleared first: tokens that no row owns get y = 0
        assert torch.equal(out, torch.zeros_like(out))


def test_multi_functional_varlen_y_starts_at_zero():
    d = multi_case("varlen")
    d["cu_seqlens"] = torch.tensor([0, 2, 2, 5, 7])  # tokens 7.. belong to no row
    lib = RecordingLibrary()
    y = run_multi(d, lib)  # the recording stand-in writes nothing
    assert torch.equal(y, torch.zeros_like(y))
    check_multi_launches(lib, d, y)


def test_multi_empty_launches_nothing():
    no_tokens = dict(mt.token_operands((0,), 5), cu_seqlens=torch.tensor([0, 0, 0]))  # L = 0
    for d in (multi_case("fixed", "final_in_place", T=0), multi_case("fixed", "final_in_place", K=0), no_tokens):
        lib = RecordingLibrary()
        y = run_multi(d, lib)
        assert y.shape == d["x"].shape and not lib.launches


def test_multi_threadgroups_respect_the_pipeline_limit():
    d = multi_case("fixed", T=5, P=40)
    for limit in (1024, 64, 24, 1):
        lib = RecordingLibrary(max_threads=limit)
        y = run_multi(d, lib)
        plan, step = lib.launches
        assert_grid(plan, [5], limit)
        assert_grid(step, [40, mt.H, 5], limit)
        assert step.buffers["y"].data_ptr() == y.data_ptr()


def test_multi_errors_come_from_the_shared_checks():
    for form, op in (("fixed", "decode_step_multi"), ("varlen", "decode_step_varlen")):
        d = multi_case(form)
        for name, bad in (("B", d["B"][..., :4]), ("num_accepted_tokens", d["num_accepted_tokens"][:2])):
            args = dict(d, **{name: bad})
            lib = RecordingLibrary()
            with pytest.raises(RuntimeError) as mps_error:
                run_multi(args, lib)
            with pytest.raises(RuntimeError) as cpu_error:
                getattr(torch.ops.ssd, op)(*(mt.varlen_args(args) if form == "varlen" else mt.multi_args(args)))
            assert str(mps_error.value) == str(cpu_error.value) and f"'{name}'" in str(mps_error.value)
            assert not lib.launches


# ---------------------------------------------------------------------------
# Finding the source, and registration
# ---------------------------------------------------------------------------


def test_metal_source_found_in_checkout_and_in_built_package(tmp_path, monkeypatch):
    assert mps.metal_dir() == REPO / "csrc" / "metal"
    assert SOURCE.startswith((REPO / "csrc" / "metal" / mps.METAL_FILES[0]).read_text())
    # setup.py's build_py ships the .metal files inside the package.
    build = tmp_path / "build"
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(build)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    package = build / "torch_ssd"
    for name in mps.METAL_FILES:
        assert (package / "metal" / name).read_text() == (REPO / "csrc" / "metal" / name).read_text()
    monkeypatch.setattr(mps, "__file__", str(package / "mps.py"))
    assert mps.metal_dir() == package / "metal"
    assert mps.metal_source() == SOURCE


def test_registration_only_where_mps_exists():
    """On this machine import torch_ssd registers nothing for MPS; register() adds all nine."""
    code = (
        "import torch, torch_ssd\n"
        "from torch_ssd import mps\n"
        "ops = ['load_state', 'load_bc', 'store_state', 'decode_step', 'decode_step_out', 'decode_step_multi',\n"
        "       'decode_step_multi_out', 'decode_step_varlen', 'decode_step_varlen_out']\n"
        "has = lambda: [torch._C._dispatch_has_kernel_for_dispatch_key('ssd::' + o, 'MPS') for o in ops]\n"
        "print(torch.backends.mps.is_available(), has())\n"
        "mps.register(); mps.register()\n"
        "print(has())\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.strip().splitlines()
    if first.startswith("False"):
        assert first == "False " + str([False] * 9)
    assert second == str([True] * 9)


def test_library_needs_compile_shader(monkeypatch):
    monkeypatch.setattr(mps, "_compiled", None)
    monkeypatch.delattr(torch.mps, "compile_shader", raising=False)
    with pytest.raises(RuntimeError, match="compile_shader"):
        mps.library()
