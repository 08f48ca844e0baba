"""torch.library.opcheck (all default test utils: schema, autograd registration, fake
tensor, AOT dispatch with dynamic shapes) for every op, on contiguous inputs and on
every strided layout (DESIGN.md section 5)."""

import pytest
import torch

from conftest import LAYOUTS, STEP_ARGS, apply_layout, make_inputs

H, P, N, G = 4, 8, 19, 2
T, S = 3, 9


def step_inputs(device):
    return make_inputs(S, T, H, P, N, G, device=device, pool_dtype=torch.bfloat16, dtype=torch.float32,
                       slots="dst", pad_rows=(1,), per_head=True)


def verb_inputs(device):
    return {
        "ssm_pool": torch.randn(S, H, P, N).to(torch.float16).to(device),
        "slot_idx": torch.tensor([4, -1, 0], device=device),
        "state": torch.randn(T, H, P, N, device=device),
        "B": torch.randn(T, G, N).to(torch.bfloat16).to(device),
        "C": torch.randn(T, G, N, device=device),
        # Stride-0 stand-ins for the "broadcast" layout: a per-head state row, and
        # B / C shared by every row.
    }


def verb_layout(device, layout):
    d = verb_inputs(device)
    if layout == "broadcast":
        return {
            "ssm_pool": d["ssm_pool"],
            "slot_idx": d["slot_idx"],
            "state": d["state"][:, :, :1, :1].clone().expand(T, H, P, N),
            "B": d["B"][:1].clone().expand(T, G, N),
            "C": d["C"][:, :, :1].clone().expand(T, G, N),
        }
    return apply_layout(d, layout)


def check(op, args):
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_decode_step(device, layout):
    d = apply_layout(step_inputs(device), layout)
    check(torch.ops.ssd.decode_step.default, tuple(d[name] for name in STEP_ARGS))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_decode_step_out(device, layout):
    inputs = step_inputs(device)
    inputs["out"] = torch.zeros_like(inputs["x"])
    d = apply_layout(inputs, layout)
    check(torch.ops.ssd.decode_step_out.default, tuple(d[name] for name in STEP_ARGS) + (d["out"],))


def test_opcheck_decode_step_minimal(device):
    """Optional arguments left at their defaults (None / False / -1)."""
    d = make_inputs(S, T, H, P, N, G, device=device, with_D=False, with_z=False, with_dt_bias=False,
                    dt_softplus=False, slots="identity")
    check(torch.ops.ssd.decode_step.default, tuple(d[name] for name in STEP_ARGS[:6]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_load_state(device, layout):
    d = verb_layout(device, layout)
    check(torch.ops.ssd.load_state.default, (d["ssm_pool"], d["slot_idx"]))


def test_opcheck_load_state_all_slots(device):
    d = verb_inputs(device)
    check(torch.ops.ssd.load_state.default, (d["ssm_pool"],))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_load_bc(device, layout):
    d = verb_layout(device, layout)
    check(torch.ops.ssd.load_bc.default, (d["B"], d["C"]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_store_state(device, layout):
    d = verb_layout(device, layout)
    check(torch.ops.ssd.store_state.default, (d["state"], d["ssm_pool"], d["slot_idx"]))
