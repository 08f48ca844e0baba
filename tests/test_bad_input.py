"""Bad input (DESIGN.md section 4): a RuntimeError whose message names the argument,
what was expected and what was given; nothing in the pool changes. Autograd is not
supported: an input that requires grad is refused by name (with grad mode on)."""

import re

import pytest
import torch

import torch_ssd
from conftest import DEVICES, STEP_ARGS, make_inputs, run_step

S, T, H, P, N, G = 8, 3, 4, 8, 19, 2


def base_inputs(device):
    inputs = make_inputs(S, T, H, P, N, G, device=device, pool_dtype=torch.bfloat16, dtype=torch.float32,
                         slots="dst")
    inputs["out"] = torch.zeros(T, H, P, device=device)
    return inputs


def wrong_float(t):
    """A floating dtype the ops do not take: float64 (MPS has none: float32 for an
    index tensor, int16 for the others, also refused)."""
    if t.device.type != "mps":
        return t.double()
    return t.float() if not t.is_floating_point() else t.to(torch.int16)


WRONG_FLOAT = r"Double|Float|Short"


def named(name):
    """The argument named the way the checks name it: argument 'x'."""
    return re.escape(f"'{name}'")


# (id, argument named in the message, edit of the inputs dict, text of what was given)
STEP_CASES = [
    ("pool_rank", "ssm_pool", lambda d: d.update(ssm_pool=d["ssm_pool"][0]), r"3-D"),
    ("pool_float64", "ssm_pool", lambda d: d.update(ssm_pool=wrong_float(d["ssm_pool"])), WRONG_FLOAT),
    ("pool_int", "ssm_pool", lambda d: d.update(ssm_pool=d["ssm_pool"].to(torch.int32)), r"Int"),
    ("x_rank", "x", lambda d: d.update(x=d["x"][0]), r"2-D"),
    ("x_heads", "x", lambda d: d.update(x=d["x"][:, :3]), r"\(3, 3, 8\)"),
    ("x_head_dim", "x", lambda d: d.update(x=d["x"][:, :, :5]), r"\(3, 4, 5\)"),
    ("x_float64", "x", lambda d: d.update(x=wrong_float(d["x"])), WRONG_FLOAT),
    ("x_int", "x", lambda d: d.update(x=d["x"].to(torch.int64)), r"Long"),
    ("dt_shape", "dt", lambda d: d.update(dt=d["dt"][:, :, :5]), r"\(3, 4, 5\)"),
    ("dt_rows", "dt", lambda d: d.update(dt=d["dt"][:2]), r"\(2, 4, 8\)"),
    ("dt_per_head", "dt", lambda d: d.update(dt=d["dt"][:, :, 0]), r"2-D"),
    ("dt_float64", "dt", lambda d: d.update(dt=wrong_float(d["dt"])), WRONG_FLOAT),
    ("A_shape", "A", lambda d: d.update(A=d["A"][:, :, :18]), r"\(4, 8, 18\)"),
    ("A_per_head", "A", lambda d: d.update(A=d["A"][:, 0, 0]), r"1-D"),
    ("A_int", "A", lambda d: d.update(A=d["A"].to(torch.int32)), r"Int"),
    ("B_rank", "B", lambda d: d.update(B=d["B"][0]), r"2-D"),
    ("B_state_size", "B", lambda d: d.update(B=d["B"][:, :, :16]), r"\(3, 2, 16\)"),
    ("B_rows", "B", lambda d: d.update(B=d["B"][:2]), r"\(2, 2, 19\)"),
    ("B_float64", "B", lambda d: d.update(B=wrong_float(d["B"])), WRONG_FLOAT),
    ("G_not_dividing_H", "B", lambda d: d.update(B=torch.cat([d["B"], d["B"][:, :1]], 1),
                                                 C=torch.cat([d["C"], d["C"][:, :1]], 1)), r"G = 3"),
    ("C_state_size", "C", lambda d: d.update(C=d["C"][:, :, :16]), r"\(3, 2, 16\)"),
    ("C_groups", "C", lambda d: d.update(C=d["C"][:, :1]), r"\(3, 1, 19\)"),
    ("C_int", "C", lambda d: d.update(C=d["C"].to(torch.int16)), r"Short"),
    ("D_shape", "D", lambda d: d.update(D=d["D"][:, :5]), r"\(4, 5\)"),
    ("D_per_head", "D", lambda d: d.update(D=d["D"][:, 0]), r"1-D"),
    ("D_float64", "D", lambda d: d.update(D=wrong_float(d["D"])), WRONG_FLOAT),
    ("z_shape", "z", lambda d: d.update(z=d["z"][:2]), r"\(2, 4, 8\)"),
    ("z_float64", "z", lambda d: d.update(z=wrong_float(d["z"])), WRONG_FLOAT),
    ("dt_bias_shape", "dt_bias", lambda d: d.update(dt_bias=d["dt_bias"][:3]), r"\(3, 8\)"),
    ("dt_bias_per_head", "dt_bias", lambda d: d.update(dt_bias=d["dt_bias"][:, 0]), r"1-D"),
    ("dt_bias_int", "dt_bias", lambda d: d.update(dt_bias=d["dt_bias"].to(torch.int32)), r"Int"),
    ("slot_idx_float", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"].float()), r"Float"),
    ("slot_idx_int16", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"].to(torch.int16)), r"Short"),
    ("slot_idx_rank", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"].view(1, T)), r"2-D"),
    ("slot_idx_length", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"][:2]), r"\(2,\)"),
    ("dst_slot_idx_float", "dst_slot_idx", lambda d: d.update(dst_slot_idx=wrong_float(d["dst_slot_idx"])),
     WRONG_FLOAT),
    ("dst_slot_idx_length", "dst_slot_idx",
     lambda d: d.update(dst_slot_idx=torch.cat([d["dst_slot_idx"], d["dst_slot_idx"][:1]])), r"\(4,\)"),
    ("dst_slot_idx_rank", "dst_slot_idx", lambda d: d.update(dst_slot_idx=d["dst_slot_idx"].view(T, 1)),
     r"2-D"),
]


def fewer_slots_than_rows(d):
    d.update(ssm_pool=d["ssm_pool"][:2], slot_idx=None, dst_slot_idx=None)


OUT_CASES = [
    ("out_shape", "out", lambda d: d.update(out=d["out"][:, :, :5]), r"\(3, 4, 5\)"),
    ("out_rank", "out", lambda d: d.update(out=d["out"][0]), r"2-D"),
    ("out_dtype", "out", lambda d: d.update(out=d["out"].to(torch.bfloat16)), r"BFloat16"),
]


def call_step(d, use_out):
    args = [d[name] for name in STEP_ARGS]
    if use_out:
        torch.ops.ssd.decode_step_out(*args, d["out"])
    else:
        torch.ops.ssd.decode_step(*args)


def expect_refusal(d, call, name_pattern, given):
    pools = [d["ssm_pool"]]
    before = [p.clone() for p in pools]
    out_before = d["out"].clone() if "out" in d else None
    with pytest.raises(RuntimeError, match=name_pattern) as info:
        call()
    msg = str(info.value)
    assert re.search(given, msg), f"the message should say what was given ({given}): {msg}"
    for p, b in zip(pools, before):
        assert torch.equal(p, b), "a refused call changed the pool"
    if out_before is not None:
        assert torch.equal(d["out"], out_before), "a refused call wrote into out"
    return msg


@pytest.mark.parametrize("use_out", [False, True], ids=["decode_step", "decode_step_out"])
@pytest.mark.parametrize("case", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_decode_step_bad_input(device, case, use_out):
    _, name, edit, given = case
    d = base_inputs(device)
    edit(d)
    expect_refusal(d, lambda: call_step(d, use_out), named(name), given)


@pytest.mark.parametrize("use_out", [False, True], ids=["decode_step", "decode_step_out"])
def test_fewer_slots_than_rows(device, use_out):
    d = base_inputs(device)
    fewer_slots_than_rows(d)
    msg = expect_refusal(d, lambda: call_step(d, use_out), r"ssm_pool", r"S = 2")
    assert "T = 3" in msg


@pytest.mark.parametrize("case", OUT_CASES, ids=[c[0] for c in OUT_CASES])
def test_decode_step_out_bad_out(device, case):
    _, name, edit, given = case
    d = base_inputs(device)
    edit(d)
    expect_refusal(d, lambda: call_step(d, True), named(name), given)


def test_python_api_checks_too(device):
    d = base_inputs(device)
    del d["out"]
    d["x"] = d["x"][:, :3]
    pool = d["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=named("x")):
        torch_ssd.decode_step(**d)
    assert torch.equal(d["ssm_pool"], pool)


# ---------------------------------------------------------------------------
# Loader verbs
# ---------------------------------------------------------------------------


def verb_inputs(device):
    return {
        "ssm_pool": torch.randn(S, H, P, N, device=device).to(torch.float16),
        "slot_idx": torch.tensor([3, -1, 0], device=device),
        "state": torch.randn(T, H, P, N, device=device),
        "B": torch.randn(T, G, N, device=device),
        "C": torch.randn(T, G, N, device=device).to(torch.bfloat16),
    }


LOAD_STATE_CASES = [
    ("pool_rank", "ssm_pool", lambda d: d.update(ssm_pool=d["ssm_pool"][0]), r"3-D"),
    ("pool_float64", "ssm_pool", lambda d: d.update(ssm_pool=wrong_float(d["ssm_pool"])), WRONG_FLOAT),
    ("slot_idx_float", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"].float()), r"Float"),
    ("slot_idx_rank", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"].view(T, 1)), r"2-D"),
]
LOAD_BC_CASES = [
    ("B_rank", "B", lambda d: d.update(B=d["B"][0]), r"2-D"),
    ("B_float64", "B", lambda d: d.update(B=wrong_float(d["B"])), WRONG_FLOAT),
    ("C_shape", "C", lambda d: d.update(C=d["C"][:, :, :7]), r"\(3, 2, 7\)"),
    ("C_rows", "C", lambda d: d.update(C=d["C"][:1]), r"\(1, 2, 19\)"),
    ("C_rank", "C", lambda d: d.update(C=d["C"][0]), r"2-D"),
    ("C_int", "C", lambda d: d.update(C=d["C"].to(torch.int32)), r"Int"),
]
STORE_STATE_CASES = [
    ("state_bf16", "state", lambda d: d.update(state=d["state"].to(torch.bfloat16)), r"BFloat16"),
    ("state_shape", "state", lambda d: d.update(state=d["state"][:, :, :, :7]), r"\(3, 4, 8, 7\)"),
    ("state_rank", "state", lambda d: d.update(state=d["state"][0]), r"3-D"),
    ("pool_rank", "ssm_pool", lambda d: d.update(ssm_pool=d["ssm_pool"][0]), r"3-D"),
    ("pool_int", "ssm_pool", lambda d: d.update(ssm_pool=d["ssm_pool"].to(torch.int16)), r"Short"),
    ("slot_idx_length", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"][:1]), r"\(1,\)"),
    ("slot_idx_float", "slot_idx", lambda d: d.update(slot_idx=d["slot_idx"].half()), r"Half"),
    ("fewer_slots_than_rows", "ssm_pool", lambda d: d.update(ssm_pool=d["ssm_pool"][:2], slot_idx=None),
     r"S = 2"),
]


@pytest.mark.parametrize("case", LOAD_STATE_CASES, ids=[c[0] for c in LOAD_STATE_CASES])
def test_load_state_bad_input(device, case):
    _, name, edit, given = case
    d = verb_inputs(device)
    edit(d)
    expect_refusal(d, lambda: torch.ops.ssd.load_state(d["ssm_pool"], d["slot_idx"]), named(name), given)


@pytest.mark.parametrize("case", LOAD_BC_CASES, ids=[c[0] for c in LOAD_BC_CASES])
def test_load_bc_bad_input(device, case):
    _, name, edit, given = case
    d = verb_inputs(device)
    edit(d)
    expect_refusal(d, lambda: torch.ops.ssd.load_bc(d["B"], d["C"]), named(name), given)


@pytest.mark.parametrize("case", STORE_STATE_CASES, ids=[c[0] for c in STORE_STATE_CASES])
def test_store_state_bad_input(device, case):
    _, name, edit, given = case
    d = verb_inputs(device)
    edit(d)
    pattern = r"ssm_pool" if case[0] == "fewer_slots_than_rows" else named(name)
    expect_refusal(d, lambda: torch.ops.ssd.store_state(d["state"], d["ssm_pool"], d["slot_idx"]),
                   pattern, given)


# ---------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------

DEVICE_ARGS = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "slot_idx", "dst_slot_idx", "out"]
OTHER_DEVICES = [d for d in DEVICES if d != "cpu"]


@pytest.mark.skipif(not OTHER_DEVICES, reason="needs a second device (CUDA or MPS)")
@pytest.mark.parametrize("direction", ["pool_on_accelerator", "pool_on_cpu"])
@pytest.mark.parametrize("name", DEVICE_ARGS)
def test_tensor_on_another_device(name, direction):
    accel = OTHER_DEVICES[0]
    home, away = (accel, "cpu") if direction == "pool_on_accelerator" else ("cpu", accel)
    d = base_inputs(home)
    d[name] = d[name].to(away)
    expect_refusal(d, lambda: call_step(d, name == "out"), named(name), re.escape(away))


@pytest.mark.skipif(not OTHER_DEVICES, reason="needs a second device (CUDA or MPS)")
def test_loader_verbs_on_another_device():
    accel = OTHER_DEVICES[0]
    d = verb_inputs(accel)
    d["slot_idx"] = d["slot_idx"].cpu()
    expect_refusal(d, lambda: torch.ops.ssd.load_state(d["ssm_pool"], d["slot_idx"]), named("slot_idx"), "cpu")
    d = verb_inputs(accel)
    d["state"] = d["state"].cpu()
    expect_refusal(d, lambda: torch.ops.ssd.store_state(d["state"], d["ssm_pool"], d["slot_idx"]),
                   named("state"), "cpu")
    d = verb_inputs(accel)
    d["C"] = d["C"].cpu()
    expect_refusal(d, lambda: torch.ops.ssd.load_bc(d["B"], d["C"]), named("C"), "cpu")


@pytest.mark.parametrize("name", DEVICE_ARGS)
def test_shared_device_check_names_the_argument(name):
    """The shared argument checks every backend runs, on any machine: a 'meta' tensor
    stands in for a tensor on another device."""
    d = base_inputs("cpu")
    d[name] = d[name].to("meta")
    args = [d[n] for n in STEP_ARGS if n not in ("dt_softplus",)]
    with pytest.raises(RuntimeError, match=named(name) + ".*meta"):
        torch_ssd._C.check_decode_step("decode_step", *args, d["out"])


# ---------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------

GRAD_CASES = [
    ("decode_step", "x"), ("decode_step", "A"), ("decode_step", "D"), ("decode_step", "ssm_pool"),
    ("decode_step_out", "dt"), ("load_state", "ssm_pool"), ("load_bc", "C"), ("store_state", "state"),
]


def call_op(op, d):
    if op == "decode_step":
        return call_step(d, False)
    if op == "decode_step_out":
        return call_step(d, True)
    if op == "load_state":
        return torch.ops.ssd.load_state(d["ssm_pool"], d["slot_idx"])
    if op == "load_bc":
        return torch.ops.ssd.load_bc(d["B"], d["C"])
    return torch.ops.ssd.store_state(d["state"], d["ssm_pool"], d["slot_idx"])


def grad_inputs(device):
    d = base_inputs(device)
    d["state"] = torch.randn(T, H, P, N, device=device)
    return d


@pytest.mark.parametrize("case", GRAD_CASES, ids=["-".join(c) for c in GRAD_CASES])
def test_requires_grad_is_refused(device, case):
    op, name = case
    d = grad_inputs(device)
    d[name] = d[name].detach().requires_grad_()
    pool_before = d["ssm_pool"].detach().clone()
    with torch.enable_grad():
        with pytest.raises(RuntimeError, match=named(name) + r" requires grad.*no autograd support"):
            call_op(op, d)
    assert torch.equal(d["ssm_pool"].detach(), pool_before)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_requires_grad_works_without_grad_mode(device, mode):
    plain = grad_inputs(device)
    y_plain = run_step(plain)
    d = grad_inputs(device)
    for name in ("x", "A", "D"):
        d[name] = d[name].detach().requires_grad_()
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        y = run_step(d)
        st = torch.ops.ssd.load_state(d["ssm_pool"], d["slot_idx"])
    assert not y.requires_grad and not st.requires_grad
    assert torch.equal(y, y_plain) and torch.equal(d["ssm_pool"], plain["ssm_pool"])


def test_mutation_bumps_the_version_counter(device):
    """In-place updates are visible to autograd's bookkeeping like any in-place op."""
    d = base_inputs(device)
    v0 = d["ssm_pool"]._version
    run_step(d)
    v1 = d["ssm_pool"]._version
    assert v1 > v0
    out_v = d["out"]._version
    call_step(d, True)
    assert d["ssm_pool"]._version > v1 and d["out"]._version > out_v
    torch.ops.ssd.store_state(torch.randn(T, H, P, N, device=device), d["ssm_pool"], d["slot_idx"])
    assert d["ssm_pool"]._version > v1 + 1


def test_overlapping_written_tensors_are_refused(device):
    # A pool or out whose elements share memory would be written by several rows at once.
    d = base_inputs(device)
    S, H, P, N = d["ssm_pool"].shape
    shared_pool = torch.randn(1, H, P, N, device=device).expand(S, H, P, N)
    with pytest.raises(RuntimeError, match=r"'ssm_pool' is written in place but some of its elements share memory"):
        torch.ops.ssd.store_state(torch.zeros(1, H, P, N, device=device), shared_pool, None, -1)
    d["ssm_pool"] = shared_pool
    with pytest.raises(RuntimeError, match=r"'ssm_pool' is written in place"):
        call_step(d, False)
    d = base_inputs(device)
    T = d["x"].shape[0]
    d["out"] = torch.empty(1, 1, 1, dtype=d["x"].dtype, device=device).expand(T, H, P)
    before = d["ssm_pool"].clone()
    with pytest.raises(RuntimeError, match=r"'out' is written in place"):
        call_step(d, True)
    assert torch.equal(d["ssm_pool"], before)
