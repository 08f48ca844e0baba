"""NaN and infinity propagation through the decode step.

The kernels must propagate non-finite values exactly as the float64 reference
(torch_ssd.reference) does: NaN in the same places, the same infinities with the
same signs, finite values where the reference is finite; dt = +-inf and NaN with
dt_softplus behave as the reference's softplus (threshold 20); pool rows the call
does not address keep their bits, NaN or not. Finite inputs stay well inside
float32 range, so float32 overflow (which float64 would not hit) never decides
the outcome.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import torch_ssd  # noqa: F401  (registers torch.ops.ssd)
from torch_ssd import reference

INF, NAN = float("inf"), float("nan")
OPERANDS = ("ssm_pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")
SHAPES = dict(S=6, T=4, H=4, P=3, N=20, G=2)  # N = one 16-wide chunk plus a tail
SLOTS = [4, -1, 5, 2]  # row 1 is a pad row; slots 0, 1 and 3 are not addressed


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("ssd::decode_step", "CUDA"):
        devices.append("cuda")
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


DEVICES = _devices()


def _inputs(seed: int, softplus: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Finite inputs with no zeros (zeros are planted on purpose where wanted)."""
    S, T, H, P, N, G = (SHAPES[k] for k in "STHPNG")
    g = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        v = torch.rand(shape, generator=g) * (hi - lo) + lo
        return torch.where(v.abs() < 1e-3, torch.full_like(v, 0.5), v)

    return {
        "ssm_pool": uniform((S, H, P, N), -2, 2).to(dtype),
        "x": uniform((T, H, P), -2, 2).to(dtype),
        "dt": uniform((T, H, P), -3, 1.5).to(dtype) if softplus else uniform((T, H, P), 0.05, 1.5).to(dtype),
        "A": uniform((H, P, N), -3, -0.05).to(dtype),
        "B": uniform((T, G, N), -2, 2).to(dtype),
        "C": uniform((T, G, N), -2, 2).to(dtype),
        "D": uniform((H, P), -2, 2).to(dtype),
        "z": uniform((T, H, P), -4, 4).to(dtype),
        "dt_bias": uniform((H, P), -0.5, 0.5).to(dtype) if softplus else uniform((H, P), 0.0, 0.25).to(dtype),
    }


def _poison(t: torch.Tensor, value: float, count: int, gen: torch.Generator) -> None:
    flat = t.view(-1)
    for i in torch.randint(0, flat.numel(), (count,), generator=gen).tolist():
        flat[i] = value


def _run(inputs, softplus, slot_idx, dst_slot_idx=None, device="cpu", use_out=False):
    """Kernel and float64 reference on the same inputs:
    (y, new_pool, y64, pool64, y_scale) where y_scale is the size of the terms
    summed into y (what a finite y's rounding error is relative to)."""
    on = {k: None if v is None else v.to(device) for k, v in inputs.items()}
    pool = on["ssm_pool"].clone()
    slots = None if slot_idx is None else torch.tensor(slot_idx, device=device)
    dsts = None if dst_slot_idx is None else torch.tensor(dst_slot_idx, device=device)
    args = (pool, on["x"], on["dt"], on["A"], on["B"], on["C"], on["D"], on["z"], on["dt_bias"], softplus,
            slots, dsts, -1)
    if use_out:
        y = torch.full_like(on["x"], 7.0)
        torch.ops.ssd.decode_step_out(*args, y)
    else:
        y = torch.ops.ssd.decode_step(*args)
    cpu_slots = None if slot_idx is None else torch.tensor(slot_idx)
    cpu_dsts = None if dst_slot_idx is None else torch.tensor(dst_slot_idx)
    y64, _, state64 = reference.decode_step(
        inputs["ssm_pool"], inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], inputs["D"],
        inputs["z"], inputs["dt_bias"], softplus, cpu_slots, cpu_dsts, -1, compute_dtype=torch.float64)
    # the expected pool in float64: written slots hold the unrounded float64 state
    pool64 = inputs["ssm_pool"].to(torch.float64)
    T, S = inputs["x"].shape[0], pool64.shape[0]
    src = list(range(T)) if slot_idx is None else slot_idx
    dst = src if dst_slot_idx is None else dst_slot_idx
    for t in range(T):  # in row order: the last row naming a slot wins
        if 0 <= src[t] < S and 0 <= dst[t] < S:
            pool64[dst[t]] = state64[t]
    H, G = inputs["x"].shape[1], inputs["B"].shape[1]
    Ch = inputs["C"].to(torch.float64).repeat_interleave(H // G, dim=1).unsqueeze(2)
    y_scale = (state64 * Ch).abs().sum(-1)
    if inputs["D"] is not None:
        y_scale = y_scale + (inputs["D"].to(torch.float64) * inputs["x"].to(torch.float64)).abs()
    if inputs["z"] is not None:
        y_scale = y_scale * torch.nn.functional.silu(inputs["z"].to(torch.float64)).abs()
    # a pad row's state is computed and dropped; its y is exactly 0 whatever that state is
    y_scale = torch.where(torch.isfinite(y_scale), y_scale, torch.zeros_like(y_scale))
    return y.cpu(), pool.cpu(), y64, pool64, y_scale


def _assert_same_nonfinite(what: str, got: torch.Tensor, expected64: torch.Tensor, scale=None) -> None:
    """NaN where the reference has NaN, equal infinities, finite values close
    (within the output's rounding plus 1e-4 of `scale`, default |expected|)."""
    a, e = got.to(torch.float64), expected64
    assert torch.equal(torch.isnan(a), torch.isnan(e)), (
        f"{what}: NaN at {torch.isnan(a).nonzero().tolist()}, reference NaN at {torch.isnan(e).nonzero().tolist()}")
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e), (
        f"{what}: inf at {inf_a.nonzero().tolist()}, reference inf at {inf_e.nonzero().tolist()}")
    assert torch.equal(a[inf_a], e[inf_e]), f"{what}: infinities differ in sign"
    finite = torch.isfinite(e)
    # finite values only need to be right, not tight: the fuzz tests bound the error
    eps = torch.finfo(got.dtype).eps
    scale = e.abs() if scale is None else scale
    tol = 2 * eps * e[finite].abs() + 1e-4 * (1 + scale[finite])
    err = (a[finite] - e[finite]).abs()
    assert bool((err <= tol).all()), f"{what}: finite values off by up to {err.max().item():.3g}"


def _assert_unaddressed_unchanged(before: torch.Tensor, after: torch.Tensor, written: set[int]) -> None:
    width = torch.int32 if before.element_size() == 4 else torch.int16
    for k in range(before.shape[0]):
        if k not in written:
            assert torch.equal(before[k].view(width), after[k].view(width)), f"unaddressed slot {k} changed"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softplus", [False, True])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("operand", OPERANDS)
def test_one_poisoned_operand_propagates_like_reference(device, operand, value, softplus):
    seed = OPERANDS.index(operand) * 10 + int(softplus)
    dtype = (torch.float32, torch.bfloat16, torch.float16)[seed % 3]
    inputs = _inputs(seed, softplus, dtype)
    _poison(inputs[operand], value, count=3, gen=torch.Generator().manual_seed(seed))
    if operand == "ssm_pool":  # also poison rows the call must not read: slots 0, 1, 3
        inputs["ssm_pool"][[0, 1, 3]] = value
    y, new_pool, y64, pool64, y_scale = _run(inputs, softplus, SLOTS, device=device)
    _assert_same_nonfinite("y", y, y64, y_scale)
    _assert_same_nonfinite("pool", new_pool, pool64)
    _assert_unaddressed_unchanged(inputs["ssm_pool"], new_pool, written={4, 5, 2})
    assert not y[1].any(), "a pad row's y must be 0 even when its slot holds NaN/inf"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softplus", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_mixed_nonfinite_and_zeros_propagate_like_reference(device, seed, softplus):
    """Several operands poisoned at once, with exact zeros planted too, so that
    inf * 0, inf - inf and NaN * 0 all occur."""
    gen = torch.Generator().manual_seed(100 + seed)
    dtype = (torch.float32, torch.bfloat16, torch.float16)[seed % 3]
    inputs = _inputs(100 + seed, softplus, dtype)
    for name in OPERANDS:
        for value in (NAN, INF, -INF, 0.0):
            if torch.rand((), generator=gen) < 0.4:
                _poison(inputs[name], value, count=2, gen=gen)
    y, new_pool, y64, pool64, y_scale = _run(inputs, softplus, [4, 0, 5, 2], dst_slot_idx=[1, 3, 5, -1], device=device,
                                    use_out=bool(seed % 2))
    _assert_same_nonfinite("y", y, y64, y_scale)
    _assert_same_nonfinite("pool", new_pool, pool64)
    _assert_unaddressed_unchanged(inputs["ssm_pool"], new_pool, written={1, 3, 5})


# Finite dt values stop where float32 and float64 part ways (exp(A * dt) overflowing
# or a softplus underflowing to a subnormal): that is range, not propagation.
DT_VALUES = (INF, -INF, NAN, -20.0, -5.0, 0.0, 19.99, 20.0, 20.01, 50.0, 100.0)
A_VALUES = (-2.0, -0.5, 0.0, 0.5, -INF, INF, NAN)
BIAS_VALUES = (0.0, -INF, INF, 0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softplus", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dt_infinities_with_and_without_softplus(device, softplus, with_bias):
    """Every dt in DT_VALUES against every A in A_VALUES (and dt_bias values),
    including dt = +-inf / NaN through softplus and the threshold at 20."""
    P = len(DT_VALUES) * (len(BIAS_VALUES) if with_bias else 1)
    N = len(A_VALUES)
    H, T, G, S = 1, 2, 1, 2
    pairs = list(itertools.product(DT_VALUES, BIAS_VALUES if with_bias else (0.0,)))
    dt = torch.tensor([d for d, _ in pairs]).expand(T, H, P).contiguous()
    bias = torch.tensor([b for _, b in pairs]).view(H, P)
    A = torch.tensor(A_VALUES).expand(H, P, N).contiguous()
    g = torch.Generator().manual_seed(5)
    inputs = {
        "ssm_pool": torch.rand(S, H, P, N, generator=g) + 0.5,
        "x": torch.rand(T, H, P, generator=g) + 0.5,
        "dt": dt,
        "A": A,
        "B": torch.rand(T, G, N, generator=g) * 2 - 1,
        "C": torch.rand(T, G, N, generator=g) + 0.5,
        "D": torch.rand(H, P, generator=g),
        "z": torch.rand(T, H, P, generator=g) + 0.5,
        "dt_bias": bias if with_bias else None,
    }
    y, new_pool, y64, pool64, y_scale = _run(inputs, softplus, None, device=device)
    _assert_same_nonfinite("y", y, y64, y_scale)
    _assert_same_nonfinite("pool", new_pool, pool64)


@pytest.mark.parametrize("device", DEVICES)
def test_softplus_of_infinite_dt_is_the_reference_softplus(device):
    """dt = +inf through softplus is +inf (exp(A * inf) = 0 for A < 0, so the old
    state is forgotten and the new one is inf * B * x); dt = -inf gives dt = 0
    (the old state kept, nothing added)."""
    T, H, P, N, G = 2, 1, 1, 4, 1
    pool = torch.tensor([1.0, -2.0, 3.0, 0.5]).view(1, 1, 1, N).repeat(T, H, P, 1)
    inputs = {
        "ssm_pool": pool, "x": torch.ones(T, H, P), "dt": torch.tensor([INF, -INF]).view(T, H, P),
        "A": torch.full((H, P, N), -1.0), "B": torch.tensor([1.0, -1.0, 2.0, 0.0]).repeat(T, G, 1),
        "C": torch.ones(T, G, N), "D": None, "z": None, "dt_bias": None,
    }
    y, new_pool, y64, pool64, y_scale = _run(inputs, True, None, device=device)
    _assert_same_nonfinite("y", y, y64, y_scale)
    _assert_same_nonfinite("pool", new_pool, pool64)
    # the values behind the reference's answer, spelled out
    assert new_pool[0, 0, 0].tolist()[:3] == [INF, -INF, INF] and torch.isnan(new_pool[0, 0, 0, 3])
    assert torch.equal(new_pool[1], pool[1])
