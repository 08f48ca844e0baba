"""Results against the float64 reference (DESIGN.md section 2) and the loader verbs.

Grid: the full pool-dtype x input-dtype grid on a small shape with the optional
features off, mixed and all on; each optional feature on its own; every model shape
(plus N not a multiple of the vector width, and N = 1) with everything on.
T stays at 2-4 so the grid is quick on two cores.
"""

import pytest
import torch

import torch_ssd
from conftest import (
    DTYPE_IDS,
    FLOAT_DTYPES,
    assert_step_matches_reference,
    make_inputs,
    run_step,
    run_step_out,
)

# (H, P, N, G): the model shapes of the issue, then odd N (tail chunks) and N = 1.
MODEL_SHAPES = [
    (24, 64, 128, 1),
    (80, 64, 128, 1),
    (128, 64, 128, 8),
    (8, 64, 16, 1),
    (4, 32, 96, 2),
    (6, 16, 19, 3),
    (4, 8, 1, 2),
]
SMALL = (4, 32, 40, 2)  # N = 40: two 16-wide chunks and a tail

FEATURES_OFF = dict(with_D=False, with_z=False, with_dt_bias=False, dt_softplus=False, slots="identity")
FEATURES_ALL = dict(slots="dst", pad_rows=(1,), dst_pad_rows=(2,))
FEATURE_SETS = {
    "none": FEATURES_OFF,
    "D_z": dict(FEATURES_OFF, with_D=True, with_z=True),
    "bias_softplus_slots_pad": dict(with_D=False, with_z=False, slots="slot_idx", pad_rows=(0,)),
    "all": FEATURES_ALL,
}

# One optional feature at a time, the others off.
SINGLE_FEATURES = {
    "D": dict(FEATURES_OFF, with_D=True),
    "z": dict(FEATURES_OFF, with_z=True),
    "dt_bias": dict(FEATURES_OFF, with_dt_bias=True),
    "softplus": dict(FEATURES_OFF, dt_softplus=True),
    "slot_idx": dict(FEATURES_OFF, slots="slot_idx"),
    "slot_idx_int32": dict(FEATURES_OFF, slots="slot_idx", idx_dtype=torch.int32),
    "dst_slot_idx": dict(FEATURES_OFF, slots="dst"),
    "dst_only": dict(FEATURES_OFF, slots="dst_only"),
    "pad_rows": dict(FEATURES_OFF, slots="slot_idx", pad_rows=(0, 2)),
    "dst_pad_rows": dict(FEATURES_OFF, slots="dst", dst_pad_rows=(1,)),
    "pad_id_7": dict(FEATURES_OFF, slots="slot_idx", pad_rows=(1,), pad_slot_id=7),
}


def check_step(inputs, use_out=False):
    pool_before = inputs["ssm_pool"].clone()
    y = run_step_out(inputs) if use_out else run_step(inputs)
    assert_step_matches_reference(inputs, pool_before, y)


@pytest.mark.parametrize("features", FEATURE_SETS, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("pool_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_dtype_grid(device, pool_dtype, dtype, features):
    H, P, N, G = SMALL
    inputs = make_inputs(None, 3, H, P, N, G, device=device, pool_dtype=pool_dtype, dtype=dtype,
                         **FEATURE_SETS[features])
    check_step(inputs)


@pytest.mark.parametrize("feature", SINGLE_FEATURES, ids=str)
def test_single_feature(device, feature):
    H, P, N, G = SMALL
    inputs = make_inputs(None, 4, H, P, N, G, device=device, pool_dtype=torch.bfloat16,
                         dtype=torch.float32, **SINGLE_FEATURES[feature])
    check_step(inputs)


@pytest.mark.parametrize(
    "pool_dtype,dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
    ids=["f32-f32", "bf16-bf16", "f16-f32"],
)
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_model_shapes(device, shape, pool_dtype, dtype):
    H, P, N, G = shape
    inputs = make_inputs(None, 3, H, P, N, G, device=device, pool_dtype=pool_dtype, dtype=dtype, **FEATURES_ALL)
    check_step(inputs)


@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_model_shapes_without_options(device, shape):
    """The bare step (no D, z, dt_bias, softplus or slot indices) on every shape."""
    H, P, N, G = shape
    inputs = make_inputs(None, 2, H, P, N, G, device=device, pool_dtype=torch.bfloat16, dtype=torch.float32,
                         **FEATURES_OFF)
    check_step(inputs)


@pytest.mark.parametrize("shape", [(4, 32, 96, 2), (6, 16, 19, 3)], ids=lambda s: "x".join(map(str, s)))
def test_mixed_operand_dtypes(device, shape):
    """Every operand may have its own dtype."""
    H, P, N, G = shape
    mixed = {"x": torch.float16, "dt": torch.bfloat16, "A": torch.float32, "B": torch.bfloat16,
             "C": torch.float16, "D": torch.bfloat16, "z": torch.float32, "dt_bias": torch.float16}
    inputs = make_inputs(None, 3, H, P, N, G, device=device, pool_dtype=torch.bfloat16, dtypes=mixed,
                         **FEATURES_ALL)
    check_step(inputs)


@pytest.mark.parametrize("pool_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_decode_step_out_matches_reference_and_decode_step(device, pool_dtype):
    def fresh():
        return make_inputs(None, 4, 6, 16, 19, 3, device=device, pool_dtype=pool_dtype, dtype=torch.bfloat16,
                           **FEATURES_ALL)

    check_step(fresh(), use_out=True)
    a, b = fresh(), fresh()
    y = run_step(a)
    y_out = run_step_out(b)
    assert torch.equal(y_out, y)
    assert torch.equal(b["ssm_pool"], a["ssm_pool"])


def test_python_api_matches_op(device):
    """torch_ssd.decode_step / decode_step_out call the same op with the same answer."""
    H, P, N, G = (4, 32, 40, 2)
    a = make_inputs(None, 3, H, P, N, G, device=device, pool_dtype=torch.bfloat16, dtype=torch.float16,
                    **FEATURES_ALL)
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    c = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    y_op = run_step(a)
    y_api = torch_ssd.decode_step(**b)
    out = torch.empty_like(c["x"])
    returned = torch_ssd.decode_step_out(**c, out=out)
    assert returned is out
    assert torch.equal(y_api, y_op) and torch.equal(out, y_op)
    assert torch.equal(b["ssm_pool"], a["ssm_pool"]) and torch.equal(c["ssm_pool"], a["ssm_pool"])


def test_several_steps_follow_reference(device):
    """Three steps in a row keep tracking the reference (state carried in the pool)."""
    H, P, N, G = (4, 16, 19, 2)
    pool = None
    for step in range(3):
        inputs = make_inputs(9, 3, H, P, N, G, device=device, pool_dtype=torch.float32, dtype=torch.float32,
                             slots="slot_idx", seed=step)
        if pool is not None:
            inputs["ssm_pool"] = pool
        check_step(inputs)
        pool = inputs["ssm_pool"]


# ---------------------------------------------------------------------------
# Loader verbs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("N", [16, 19, 1])
def test_load_state_is_exact(device, pool_dtype, N):
    pool = torch.randn(7, 3, 5, N).to(pool_dtype).to(device)
    before = pool.clone()
    slot_idx = torch.tensor([4, -1, 0, 6, -1], device=device)
    got = torch.ops.ssd.load_state(pool, slot_idx)
    assert got.dtype == torch.float32 and got.shape == (5, 3, 5, N) and got.is_contiguous()
    for t, slot in enumerate(slot_idx.tolist()):
        want = torch.zeros(3, 5, N, device=device) if slot == -1 else pool[slot].to(torch.float32)
        assert torch.equal(got[t], want), f"row {t} (slot {slot})"
    assert torch.equal(pool, before)
    # Without slot_idx: every slot, in order.
    assert torch.equal(torch.ops.ssd.load_state(pool), pool.to(torch.float32))
    assert torch.equal(torch_ssd.load_state(pool, slot_idx), got)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_load_bc_is_exact(device, dtype):
    B = torch.randn(4, 2, 19).to(dtype).to(device)
    C = torch.randn(4, 2, 19).to(torch.float16).to(device)  # B and C need not share a dtype
    Bf, Cf = torch.ops.ssd.load_bc(B, C)
    for got, src in ((Bf, B), (Cf, C)):
        assert got.dtype == torch.float32 and got.shape == src.shape and got.is_contiguous()
        assert torch.equal(got, src.to(torch.float32))
    Bs, Cs = torch.ops.ssd.load_bc(B.transpose(0, 2).contiguous().transpose(0, 2), C[:, :, :])
    assert torch.equal(Bs, Bf) and torch.equal(Cs, Cf)


def rounding_cases(device) -> torch.Tensor:
    """float32 values that exercise round-to-nearest-even into bf16 and fp16: exact
    ties (odd and even neighbours), just above and below ties, subnormals, overflow."""
    bits = []
    for hi in (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x4049, 0x0001, 0x7F7F):
        for lo in (0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF):
            bits.append((hi << 16) | lo)
    bf16_ties = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    # fp16 ties: 1 + (2k + 1) * 2^-11 lies halfway between two fp16 values.
    k = torch.arange(8, dtype=torch.float32)
    fp16_ties = torch.cat([1 + (2 * k + 1) * 2.0**-11, -(2 + (2 * k + 1) * 2.0**-10),
                           (2 * k + 1) * 2.0**-25,  # halfway between fp16 subnormals
                           torch.tensor([65519.0, 65520.0, 70000.0, -1e-9, 3e-8])])
    rand = torch.randn(64) * torch.logspace(-6, 4, 64)
    return torch.cat([bf16_ties, fp16_ties, rand]).to(device)


@pytest.mark.parametrize("pool_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_store_state_rounds_to_nearest_even(device, pool_dtype):
    values = rounding_cases(device)
    N = values.numel()
    state = values.view(1, 1, 1, N).repeat(3, 2, 1, 1).contiguous()  # (T=3, H=2, P=1, N)
    state[1] = -state[1]
    pool = torch.randn(5, 2, 1, N).to(pool_dtype).to(device)
    before = pool.clone()
    slot_idx = torch.tensor([3, -1, 0], device=device)
    torch.ops.ssd.store_state(state, pool, slot_idx)
    assert torch.equal(pool[3], state[0].to(pool_dtype))
    assert torch.equal(pool[0], state[2].to(pool_dtype))
    for slot in (1, 2, 4):  # the pad row and unaddressed slots
        assert torch.equal(pool[slot], before[slot])


@pytest.mark.parametrize("pool_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_store_state_without_slot_idx(device, pool_dtype):
    state = torch.randn(3, 2, 4, 19, device=device)
    pool = torch.randn(5, 2, 4, 19).to(pool_dtype).to(device)
    before = pool.clone()
    torch_ssd.store_state(state, pool)
    assert torch.equal(pool[:3], state.to(pool_dtype))
    assert torch.equal(pool[3:], before[3:])


@pytest.mark.parametrize("pool_dtype", FLOAT_DTYPES, ids=DTYPE_IDS.get)
def test_load_then_store_is_identity(device, pool_dtype):
    """load_state is exact and store_state rounds once: a round trip changes no bit."""
    pool = torch.randn(6, 3, 4, 19).to(pool_dtype).to(device)
    before = pool.clone()
    idx = torch.tensor([5, 2, 0], device=device)
    torch.ops.ssd.store_state(torch.ops.ssd.load_state(pool, idx), pool, idx)
    assert torch.equal(pool, before)


def test_verbs_compose_to_the_step(device):
    """load_state + load_bc + the float32 recurrence + store_state gives the fused
    step's pool exactly for a float32 pool with unit-stride A (the same float32 math)."""
    H, P, N, G = (4, 8, 19, 2)
    inputs = make_inputs(None, 3, H, P, N, G, device=device, pool_dtype=torch.float32, dtype=torch.float32,
                         with_D=False, with_z=False, with_dt_bias=False, dt_softplus=False, slots="slot_idx")
    pool = inputs["ssm_pool"]
    idx = inputs["slot_idx"]
    state = torch.ops.ssd.load_state(pool, idx)
    Bf, Cf = torch.ops.ssd.load_bc(inputs["B"], inputs["C"])
    assert torch.equal(state, pool[idx].float())
    assert torch.equal(Bf, inputs["B"].float()) and torch.equal(Cf, inputs["C"].float())
    fused = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    run_step(fused)
    dtv = inputs["dt"].float().unsqueeze(-1)
    Bh = Bf.repeat_interleave(H // G, dim=1).unsqueeze(2)
    xf = inputs["x"].float().unsqueeze(-1)
    new_state = state * torch.exp(inputs["A"].float() * dtv) + (dtv * xf) * Bh
    torch.ops.ssd.store_state(new_state, pool, idx)
    # Both round float32 once; allow the last float32 bit for exp/fma differences.
    torch.testing.assert_close(pool, fused["ssm_pool"], rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)
