"""selective_state_update (the mamba_ssm / vLLM / SGLang / FlashInfer call) and StatePool."""

from __future__ import annotations

import pytest
import torch

import torch_ssd
from torch_ssd import StatePool, reference, selective_state_update

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def per_head_inputs(S=6, T=4, H=4, P=8, N=16, G=2, seed=0, device="cpu"):
    """A model's decode-step operands: per-head A, dt, D, dt_bias, as engines hold them."""
    g = _gen(seed)
    t = dict(
        state=torch.randn(S, H, P, N, generator=g),
        x=torch.randn(T, H, P, generator=g),
        dt_head=torch.randn(T, H, generator=g) * 0.5,
        A_head=-torch.rand(H, generator=g) - 0.5,
        B=torch.randn(T, G, N, generator=g),
        C=torch.randn(T, G, N, generator=g),
        D_head=torch.randn(H, generator=g),
        bias_head=torch.rand(H, generator=g) - 2.0,
        z=torch.randn(T, H, P, generator=g),
    )
    return {k: v.to(device) for k, v in t.items()}


def expanded(inp):
    """The same values laid out as vLLM / SGLang pass them: per-(h,p) shapes with stride 0."""
    S, H, P, N = inp["state"].shape
    T = inp["x"].shape[0]
    return dict(
        dt=inp["dt_head"][:, :, None].expand(T, H, P),
        A=inp["A_head"][:, None, None].expand(H, P, N),
        D=inp["D_head"][:, None].expand(H, P),
        dt_bias=inp["bias_head"][:, None].expand(H, P),
    )


def reference_y_pool(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, src=None, dst=None,
                     pad=-1):
    y, pool, _ = reference.decode_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, src, dst, pad,
                                       compute_dtype=torch.float64)
    return y.to(x.dtype), pool


def assert_close_to_reference(y, pool_after, ref_y, ref_pool):
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool_after, ref_pool, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# selective_state_update
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_head", [False, True], ids=["expanded", "per_head"])
@pytest.mark.parametrize("with_out", [False, True], ids=["ret", "out"])
def test_heads_form_matches_reference_and_op(device, per_head, with_out):
    inp = per_head_inputs(device=device)
    ex = expanded(inp)
    src = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=device)
    dst = torch.tensor([1, 2, -1, 4], dtype=torch.int64, device=device)
    ref_y, ref_pool = reference_y_pool(inp["state"].cpu(), inp["x"].cpu(), ex["dt"].cpu(), ex["A"].cpu(),
                                       inp["B"].cpu(), inp["C"].cpu(), ex["D"].cpu(), inp["z"].cpu(),
                                       ex["dt_bias"].cpu(), True, src.cpu(), dst.cpu())
    if per_head:
        dt, A, D, bias = inp["dt_head"], inp["A_head"], inp["D_head"], inp["bias_head"]
    else:
        dt, A, D, bias = ex["dt"], ex["A"], ex["D"], ex["dt_bias"]
    state = inp["state"].clone()
    out = torch.full_like(inp["x"], float("nan")) if with_out else None
    y = selective_state_update(state, inp["x"], dt, A, inp["B"], inp["C"], D=D, z=inp["z"], dt_bias=bias,
                               dt_softplus=True, state_batch_indices=src, dst_state_batch_indices=dst,
                               pad_slot_id=-1, out=out)
    if with_out:
        assert y is out
    assert_close_to_reference(y.cpu(), state.cpu(), ref_y, ref_pool)
    assert torch.all(y[1] == 0)  # the pad row

    # It is a mapping onto the op: same bits as calling torch.ops.ssd directly.
    state_op = inp["state"].clone()
    y_op = torch.ops.ssd.decode_step(state_op, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], inp["z"],
                                     ex["dt_bias"], True, src, dst, -1)
    assert torch.equal(y, y_op)
    assert torch.equal(state, state_op)


@pytest.mark.parametrize("with_out", [False, True], ids=["ret", "out"])
def test_vllm_decode_call_goes_straight_to_the_op(monkeypatch, with_out):
    """The common decode call (operands already expanded, (batch,) tables) skips the general
    path's preparation (host time per eager call); the per-head form still takes it."""
    import torch_ssd.serving as serving

    def general_path(*args):
        raise AssertionError("general path")

    monkeypatch.setattr(serving, "_expand_A", general_path)
    inp = per_head_inputs()
    ex = expanded(inp)
    src = torch.tensor([3, -1, 0, 5], dtype=torch.int32)
    out = torch.empty_like(inp["x"]) if with_out else None
    state = inp["state"].clone()
    y = selective_state_update(state, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], inp["z"],
                               ex["dt_bias"], True, state_batch_indices=src, out=out)
    state_op = inp["state"].clone()
    y_op = torch.ops.ssd.decode_step(state_op, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], inp["z"],
                                     ex["dt_bias"], True, src, None, -1)
    assert torch.equal(y, y_op) and torch.equal(state, state_op)
    assert (y is out) == with_out
    with pytest.raises(AssertionError, match="general path"):
        selective_state_update(state, inp["x"], inp["dt_head"], inp["A_head"], inp["B"], inp["C"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_out", [False, True], ids=["ret", "out"])
def test_no_heads_form(device, with_out):
    """The 3-D form: state (S, dim, dstate), x (batch, dim), A (dim, dstate), B (batch, dstate), D (dim,)."""
    g = _gen(1)
    S, T, dim, N = 5, 3, 12, 8
    state = torch.randn(S, dim, N, generator=g).to(device)
    x, dt, z = (torch.randn(T, dim, generator=g).to(device) for _ in range(3))
    A = (-torch.rand(dim, N, generator=g) - 0.1).to(device)
    B, C = (torch.randn(T, N, generator=g).to(device) for _ in range(2))
    D, bias = (torch.randn(dim, generator=g).to(device) for _ in range(2))
    idx = torch.tensor([4, 0, 2], device=device)
    ref_y, ref_pool = reference_y_pool(state.cpu()[:, None], x.cpu()[:, None], dt.cpu()[:, None], A.cpu()[None],
                                       B.cpu()[:, None], C.cpu()[:, None], D.cpu()[None], z.cpu()[:, None],
                                       bias.cpu()[None], True, idx.cpu())
    out = torch.empty_like(x) if with_out else None
    y = selective_state_update(state, x, dt, A, B, C, D, z, bias, True, state_batch_indices=idx, out=out)
    assert y.shape == (T, dim)
    if with_out:
        assert y is out
    assert_close_to_reference(y.cpu()[:, None], state.cpu()[:, None], ref_y, ref_pool)


def test_without_D_dt_bias_z_and_indices():
    """mamba_ssm's plainest call: batch row i updates state row i, no D, no dt_bias, no gate."""
    inp = per_head_inputs(S=4, T=4)
    ex = expanded(inp)
    state = inp["state"].clone()
    ref_y, ref_pool = reference_y_pool(inp["state"], inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"])
    y = selective_state_update(state, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"])
    assert_close_to_reference(y, state, ref_y, ref_pool)
    # The ablation is real: with D the answer differs.
    y_d = selective_state_update(inp["state"].clone(), inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], D=ex["D"])
    assert not torch.allclose(y, y_d)


def test_positional_call_in_mamba_ssm_order():
    inp = per_head_inputs()
    ex = expanded(inp)
    idx = torch.tensor([0, 2, 4, 1])
    a, b = inp["state"].clone(), inp["state"].clone()
    y_pos = selective_state_update(a, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], inp["z"],
                                   ex["dt_bias"], True, idx)
    y_kw = selective_state_update(b, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], D=ex["D"], z=inp["z"],
                                  dt_bias=ex["dt_bias"], dt_softplus=True, state_batch_indices=idx)
    assert torch.equal(y_pos, y_kw) and torch.equal(a, b)


def test_index_column_form_and_custom_pad_id():
    """vLLM may hand indices as (batch, 1); a pool with a reserved pad row uses its index as pad id."""
    inp = per_head_inputs(S=6, T=4)
    ex = expanded(inp)
    pad = 5
    col = torch.tensor([[2], [pad], [0], [4]], dtype=torch.int32)
    state = inp["state"].clone()
    y = selective_state_update(state, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], None, ex["dt_bias"],
                               True, state_batch_indices=col, pad_slot_id=pad)
    ref_y, ref_pool = reference_y_pool(inp["state"], inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], None,
                                       ex["dt_bias"], True, col[:, 0], None, pad)
    assert_close_to_reference(y, state, ref_y, ref_pool)
    assert torch.equal(state[pad], inp["state"][pad])  # the pad row's slot is never touched
    assert torch.all(y[1] == 0)


def test_out_is_a_strided_view_written_in_place():
    inp = per_head_inputs()
    ex = expanded(inp)
    T, H, P = inp["x"].shape
    buffer = torch.full((T, H, 2 * P), 7.0)
    out = buffer[:, :, ::2]  # non-contiguous view into a larger buffer
    ret = selective_state_update(inp["state"].clone(), inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"],
                                 out=out)
    assert ret is out
    y = selective_state_update(inp["state"].clone(), inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"])
    assert torch.equal(buffer[:, :, ::2], y)
    assert torch.all(buffer[:, :, 1::2] == 7.0)  # the gaps are untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_state(dtype):
    inp = per_head_inputs()
    ex = expanded(inp)
    state = inp["state"].to(dtype)
    x = inp["x"].to(dtype)
    before = state.clone()
    y = selective_state_update(state, x, ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], dt_bias=ex["dt_bias"],
                               dt_softplus=True)
    ref_y, ref_pool = reference_y_pool(before, x, ex["dt"], ex["A"], inp["B"], inp["C"], ex["D"], None,
                                       ex["dt_bias"], True)
    assert y.dtype == dtype
    torch.testing.assert_close(y, ref_y, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(state, ref_pool, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(state=torch.zeros(2, 3)), "state"),
        (dict(x=torch.zeros(4, 32)), "x"),  # 2-D x with a 4-D state
        (dict(B=torch.zeros(4, 16)), "B"),
        (dict(state_batch_indices=torch.zeros(4, 1, 1, dtype=torch.long)), "state_batch_indices"),
        (dict(dst_state_batch_indices=torch.zeros(1, 4, dtype=torch.long)), "dst_state_batch_indices"),
        (dict(out=torch.zeros(4, 4, 8, dtype=torch.float64)), "out"),
        (dict(D=torch.zeros(3)), "D"),
        (dict(state_batch_indices=torch.zeros(4)), "'state_batch_indices' must be int32 or int64"),
        (dict(state_batch_indices=torch.zeros(3, dtype=torch.long)), "state_batch_indices"),
        (dict(state=torch.zeros(6, 4, 8, 16, dtype=torch.float64)), "'state'"),
    ],
)
def test_bad_input_names_the_argument_and_leaves_state(change, name):
    inp = per_head_inputs()
    ex = expanded(inp)
    args = dict(state=inp["state"].clone(), x=inp["x"], dt=ex["dt"], A=ex["A"], B=inp["B"], C=inp["C"], D=ex["D"])
    args.update(change)
    before = args["state"].clone()
    with pytest.raises(RuntimeError, match=name):
        selective_state_update(**args)
    assert torch.equal(args["state"], before)


def test_checked_mode_names_the_drop_in_argument():
    inp = per_head_inputs(S=6, T=4)
    ex = expanded(inp)
    state = inp["state"].clone()
    was = torch_ssd.checks_enabled()
    torch_ssd.set_checks(True)
    try:
        with pytest.raises(RuntimeError, match=r"dst_state_batch_indices\[2\] = 9"):
            selective_state_update(state, inp["x"], ex["dt"], ex["A"], inp["B"], inp["C"],
                                   state_batch_indices=torch.tensor([0, 1, 2, 3]),
                                   dst_state_batch_indices=torch.tensor([0, 1, 9, 3]))
    finally:
        torch_ssd.set_checks(was)
    assert torch.equal(state, inp["state"])


def test_no_heads_form_rejects_heads_shaped_operands():
    state = torch.zeros(3, 8, 4)
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="A must be"):
        selective_state_update(state, x, x, torch.zeros(1, 8, 4), torch.zeros(2, 4), torch.zeros(2, 4))


def test_compiles_fullgraph_and_updates_state_in_place():
    inp = per_head_inputs()
    idx = torch.tensor([5, 1, -1, 3])

    def step(state, x, dt, A, B, C, D, bias, idx):
        return selective_state_update(state, x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True,
                                      state_batch_indices=idx)

    args = (inp["x"], inp["dt_head"], inp["A_head"], inp["B"], inp["C"], inp["D_head"], inp["bias_head"], idx)
    eager_state = inp["state"].clone()
    y_eager = step(eager_state, *args)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    state = inp["state"].clone()
    y = compiled(state, *args)
    assert torch.equal(y, y_eager)
    assert torch.equal(state, eager_state)


# ---------------------------------------------------------------------------
# StatePool
# ---------------------------------------------------------------------------


def small_pool(**kw):
    args = dict(num_layers=3, max_slots=4, num_heads=2, head_dim=4, state_size=8, conv_dim=6, conv_width=4)
    args.update(kw)
    return StatePool(**args)


def test_pool_layout_and_pad_slot():
    pool = small_pool(dtype=torch.bfloat16)
    assert len(pool.ssm_pools) == 3 and len(pool.conv_pools) == 3
    assert pool.pad_slot_id == 4
    for t in pool.ssm_pools:
        assert t.shape == (5, 2, 4, 8) and t.dtype == torch.bfloat16
    for t in pool.conv_pools:
        assert t.shape == (5, 6, 4)
    assert "pad slot 4" in repr(pool)


def test_allocate_zeroes_free_reuses_and_full_raises():
    pool = small_pool()
    for t in pool.ssm_pools + pool.conv_pools:
        t.fill_(3.0)  # leftovers of earlier sequences
    slots = [pool.allocate() for _ in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert pool.pad_slot_id not in slots
    for t in pool.ssm_pools + pool.conv_pools:
        assert torch.all(t[:4] == 0)
        assert torch.all(t[4] == 3.0)  # the pad row is never handed out, so never zeroed
    with pytest.raises(RuntimeError, match="full"):
        pool.allocate()
    assert pool.num_free == 0 and pool.num_in_use == 4

    pool.ssm_pools[1][2].fill_(9.0)
    pool.free(2)
    assert not pool.in_use(2)
    assert pool.allocate() == 2  # reused, and zeroed again
    assert torch.all(pool.ssm_pools[1][2] == 0)


def test_free_errors():
    pool = small_pool()
    with pytest.raises(RuntimeError, match="slot 1 is not in use"):
        pool.free(1)
    s = pool.allocate()
    pool.free(s)
    with pytest.raises(RuntimeError, match="not in use"):
        pool.free(s)
    with pytest.raises(RuntimeError, match="not in use"):
        pool.free(pool.pad_slot_id)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_slots=0), "max_slots"),
        (dict(num_layers=-1), "num_layers"),
        (dict(dtype=torch.float64), "dtype"),
        (dict(conv_width=None), "conv_dim and conv_width"),
        (dict(conv_dim=0), "conv_dim"),
        (dict(index_dtype=torch.int16), "index_dtype"),
    ],
)
def test_pool_bad_arguments(kw, name):
    with pytest.raises(RuntimeError, match=name):
        small_pool(**kw)


def test_indices_pad_idle_rows_and_fill_in_place():
    pool = small_pool()
    a, b = pool.allocate(), pool.allocate()
    idx = pool.indices([None, b, a], batch_size=5)
    assert idx.dtype == torch.int32
    assert idx.tolist() == [4, b, a, 4, 4]
    static = torch.zeros(4, dtype=torch.int64)
    ptr = static.data_ptr()
    ret = pool.indices([a], out=static)
    assert ret is static and static.data_ptr() == ptr
    assert static.tolist() == [a, 4, 4, 4]
    with pytest.raises(RuntimeError, match="not in use"):
        pool.indices([a, 3])
    with pytest.raises(RuntimeError, match="do not fit"):
        pool.indices([a, b], batch_size=1)


def test_pool_step_with_idle_rows_touches_only_live_slots():
    """A fixed batch of 4 rows serving 2 live sequences: pad rows change nothing."""
    H, P, N, G = 2, 4, 8, 1
    pool = small_pool(num_layers=2)
    live = [pool.allocate() for _ in range(3)]
    pool.free(live[1])  # a finished sequence: its slot holds stale state
    g = _gen(5)
    for t in pool.ssm_pools:
        t.copy_(torch.randn(t.shape, generator=g))
    before = [t.clone() for t in pool.ssm_pools]
    rows = [live[2], None, live[0], None]
    idx = pool.indices(rows)
    x = torch.randn(4, H, P, generator=g)
    dt = torch.rand(4, H, generator=g)
    A = -torch.rand(H, generator=g)
    B, C = torch.randn(4, G, N, generator=g), torch.randn(4, G, N, generator=g)
    for layer, state in enumerate(pool.ssm_pools):
        y = selective_state_update(state, x, dt, A, B, C, state_batch_indices=idx, pad_slot_id=pool.pad_slot_id)
        assert torch.all(y[[1, 3]] == 0)
        changed = (state != before[layer]).flatten(1).any(1)
        assert changed.tolist() == [True, False, True, False, False]  # slots 0 and 2 only; pad row 4 untouched
        ex = dict(dt=dt[:, :, None].expand(4, H, P), A=A[:, None, None].expand(H, P, N))
        _, ref_pool = reference_y_pool(before[layer], x, ex["dt"], ex["A"], B, C, src=idx, pad=pool.pad_slot_id)
        torch.testing.assert_close(state, ref_pool, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_pool_under_cuda_graph():
    """Capture one decode step over the pool's tensors, then replay it while sequences come and go."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("ssd::decode_step", "CUDA"):
        pytest.skip("torch_ssd was built without CUDA kernels")
    H, P, N, G, batch = 4, 16, 32, 2, 4
    pool = StatePool(2, 6, H, P, N, device="cuda")
    g = _gen(7)
    static = dict(
        x=torch.randn(batch, H, P, generator=g).cuda(), dt=torch.rand(batch, H, generator=g).cuda(),
        B=torch.randn(batch, G, N, generator=g).cuda(), C=torch.randn(batch, G, N, generator=g).cuda(),
        idx=torch.full((batch,), pool.pad_slot_id, dtype=torch.int32, device="cuda"),
        out=torch.empty(batch, H, P, device="cuda"),
    )
    A = -torch.rand(H, generator=g).cuda()

    def step():
        for state in pool.ssm_pools:
            selective_state_update(state, static["x"], static["dt"], A, static["B"], static["C"],
                                   state_batch_indices=static["idx"], pad_slot_id=pool.pad_slot_id,
                                   out=static["out"])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the graph, on pad rows only
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    a, b = pool.allocate(), pool.allocate()
    for rows in ([a, None, b, None], [None, b, None, None], [b, a, None, None]):
        pool.indices(rows, out=static["idx"])
        static["x"].copy_(torch.randn(batch, H, P, generator=g))
        expected_pools = [t.clone() for t in pool.ssm_pools]
        for state in expected_pools:
            expected_y = selective_state_update(state, static["x"], static["dt"], A, static["B"], static["C"],
                                                state_batch_indices=static["idx"], pad_slot_id=pool.pad_slot_id)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(pool.ssm_pools, expected_pools):
            assert torch.equal(got, want)
        assert torch.equal(static["out"], expected_y)
    pool.free(a)
    c = pool.allocate()
    assert c == a and torch.all(pool.ssm_pools[0][c] == 0)
