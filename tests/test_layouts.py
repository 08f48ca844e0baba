"""Layout never changes the answer (DESIGN.md section 2): for one backend and one set
of dtypes, every op gives bit-identical results whatever the strides of its inputs
(contiguous, permuted views, pool strided along N, pool slices, offset storage,
stride-0 per-head operands). Kernels also never touch storage outside the views."""

import pytest
import torch

import torch_ssd
from conftest import (
    LAYOUTS,
    apply_layout,
    assert_outside_view_unchanged,
    assert_step_matches_reference,
    make_inputs,
    run_step,
    run_step_out,
    storage_base,
)

STRIDED = [layout for layout in LAYOUTS if layout != "contiguous"]

# (pool dtype, input dtype, (H, P, N, G)): vector chunks with a tail, a tail only,
# and whole chunks; N = 1 is the degenerate row.
CASES = [
    (torch.float32, torch.float32, (4, 8, 40, 2)),
    (torch.bfloat16, torch.bfloat16, (4, 8, 19, 1)),
    (torch.float16, torch.float32, (6, 4, 32, 3)),
    (torch.bfloat16, torch.float16, (2, 3, 1, 1)),
]
CASE_IDS = ["f32-f32-N40", "bf16-bf16-N19", "f16-f32-N32", "bf16-f16-N1"]


def step_inputs(device, case, per_head=True, T=3):
    pool_dtype, dtype, (H, P, N, G) = case
    return make_inputs(None, T, H, P, N, G, device=device, pool_dtype=pool_dtype, dtype=dtype,
                       slots="dst", pad_rows=(1,), per_head=per_head)


def run_in_layout(inputs, layout, use_out=False):
    laid = apply_layout(inputs, layout)
    pool = laid["ssm_pool"]
    base_before = storage_base(pool).clone()
    if use_out:
        y = run_step_out(laid, out=laid["out"])
    else:
        y = run_step(laid)
    assert_outside_view_unchanged(pool, base_before)
    return y, pool


@pytest.mark.parametrize("layout", STRIDED)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_step_bit_identical_across_layouts(device, case, layout):
    inputs = step_inputs(device, case, per_head=True)
    y_ref, pool_ref = run_in_layout(inputs, "contiguous")
    y, pool = run_in_layout(inputs, layout)
    assert torch.equal(y, y_ref), f"y differs in layout {layout}"
    assert torch.equal(pool, pool_ref), f"pool differs in layout {layout}"


@pytest.mark.parametrize("layout", [layout for layout in STRIDED if layout != "broadcast"])
def test_decode_step_per_element_A_bit_identical_across_layouts(device, layout):
    """A that varies along N (the per-element path) under every non-broadcast layout."""
    inputs = step_inputs(device, CASES[0], per_head=False)
    y_ref, pool_ref = run_in_layout(inputs, "contiguous")
    y, pool = run_in_layout(inputs, layout)
    assert torch.equal(y, y_ref) and torch.equal(pool, pool_ref)


@pytest.mark.parametrize("layout", STRIDED)
def test_decode_step_out_bit_identical_across_layouts(device, layout):
    """decode_step_out, with the out buffer itself in the layout, equals decode_step."""
    inputs = step_inputs(device, CASES[1], per_head=True)
    y_ref, pool_ref = run_in_layout(inputs, "contiguous")
    with_out = dict(inputs, out=torch.zeros_like(inputs["x"]))
    y, pool = run_in_layout(with_out, layout, use_out=True)
    assert torch.equal(y, y_ref) and torch.equal(pool, pool_ref)


@pytest.mark.parametrize("layout", STRIDED)
def test_strided_layouts_match_reference(device, layout):
    """Not only equal to contiguous: also right (guards against a shared wrong answer)."""
    inputs = step_inputs(device, CASES[2], per_head=True)
    laid = apply_layout(inputs, layout)
    pool_before = laid["ssm_pool"].clone()
    y = run_step(laid)
    assert_step_matches_reference(laid, pool_before, y)


def test_python_api_expands_per_head_operands(device):
    """torch_ssd.decode_step takes A (H,), dt (T, H), D (H,), dt_bias (H,) and gives the
    same bits as the op on the same values laid out in full."""
    pool_dtype, dtype, (H, P, N, G) = CASES[0]
    inputs = step_inputs(device, CASES[0], per_head=True)
    full = apply_layout(inputs, "contiguous")
    y_full = run_step(full)
    per_head = apply_layout(inputs, "contiguous")
    per_head["A"] = inputs["A"][:, 0, 0].clone()
    per_head["dt"] = inputs["dt"][:, :, 0].clone()
    per_head["D"] = inputs["D"][:, 0].clone()
    per_head["dt_bias"] = inputs["dt_bias"][:, 0].clone()
    y = torch_ssd.decode_step(**per_head)
    assert torch.equal(y, y_full) and torch.equal(per_head["ssm_pool"], full["ssm_pool"])
    # A per (head, p) is expanded along N.
    per_hp = apply_layout(inputs, "contiguous")
    per_hp["A"] = inputs["A"][:, :, 0].clone()
    y = torch_ssd.decode_step(**per_hp)
    assert torch.equal(y, y_full) and torch.equal(per_hp["ssm_pool"], full["ssm_pool"])


# ---------------------------------------------------------------------------
# Loader verbs
# ---------------------------------------------------------------------------

VERB_LAYOUTS = [layout for layout in STRIDED if layout != "broadcast"]


@pytest.mark.parametrize("layout", VERB_LAYOUTS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_load_state_across_layouts(device, pool_dtype, layout):
    inputs = {"ssm_pool": torch.randn(7, 3, 4, 19).to(pool_dtype).to(device),
              "slot_idx": torch.tensor([6, -1, 2, 0], device=device)}
    want = torch.ops.ssd.load_state(**apply_layout(inputs, "contiguous"))
    laid = apply_layout(inputs, layout)
    got = torch.ops.ssd.load_state(**laid)
    assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("layout", VERB_LAYOUTS + ["broadcast_BC"])
def test_load_bc_across_layouts(device, layout):
    inputs = {"B": torch.randn(3, 2, 19).to(torch.bfloat16).to(device),
              "C": torch.randn(3, 2, 19).to(device)}
    if layout == "broadcast_BC":  # B shared by every row, stride 0 over T
        inputs["B"] = inputs["B"][:1].expand(3, 2, 19).contiguous()
        laid = {"B": inputs["B"][:1].clone().expand(3, 2, 19), "C": inputs["C"].clone()}
    else:
        laid = apply_layout(inputs, layout)
    want = torch.ops.ssd.load_bc(**apply_layout(inputs, "contiguous"))
    got = torch.ops.ssd.load_bc(**laid)
    assert all(g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("layout", VERB_LAYOUTS)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_store_state_across_layouts(device, pool_dtype, layout):
    inputs = {"state": torch.randn(4, 3, 4, 19, device=device),
              "ssm_pool": torch.randn(7, 3, 4, 19).to(pool_dtype).to(device),
              "slot_idx": torch.tensor([6, -1, 2, 0], device=device)}
    want = apply_layout(inputs, "contiguous")
    torch.ops.ssd.store_state(**want)
    laid = apply_layout(inputs, layout)
    base_before = storage_base(laid["ssm_pool"]).clone()
    torch.ops.ssd.store_state(**laid)
    assert torch.equal(laid["ssm_pool"], want["ssm_pool"])
    assert_outside_view_unchanged(laid["ssm_pool"], base_before)


def test_store_state_broadcast_state(device):
    """A stride-0 state (one row written to several slots) is a valid input."""
    row = torch.randn(1, 2, 3, 19, device=device)
    pool = torch.zeros(5, 2, 3, 19, dtype=torch.bfloat16, device=device)
    torch.ops.ssd.store_state(row.expand(3, 2, 3, 19), pool, torch.tensor([4, 0, 2], device=device))
    for slot in (4, 0, 2):
        assert torch.equal(pool[slot], row[0].to(torch.bfloat16))
    assert not pool[1].any() and not pool[3].any()
