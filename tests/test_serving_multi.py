"""selective_state_update's multi-token forms (docs/multi_token.md section 5).

vLLM's flat layouts (cu_seqlens, num_accepted_tokens, (batch, W) slot tables) and
FlashInfer's token axis (x (batch, T, nheads, dim)), each checked against an oracle
written from the libraries' rules: every row's state is read once from the pool as it
was before the call, advanced token by token with the single-token reference in
float64, and written where the library would write it. The oracle shares no code with
serving.py's mapping onto the ops, so a wrong column, a missed write or an extra one
shows up.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from torch_ssd import reference, selective_state_update

H, P, N, G = 4, 3, 8, 2
PAD = -1
OPS = ("decode_step_multi", "decode_step_multi_out", "decode_step_varlen", "decode_step_varlen_out")


def _has_multi_kernels(device: str) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS"}[device]
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"ssd::{op}", key) for op in OPS)


@pytest.fixture(params=DEVICES)
def mdevice(request):
    if not _has_multi_kernels(request.param):
        pytest.skip(f"no multi-token kernels for {request.param} yet")
    return request.param


def operands(L: int, S: int, *, seed: int = 0, pool_dtype=torch.float32, heads: bool = True) -> dict:
    """Per-token operands on a flat token axis of L tokens, per-head dt / A / D / dt_bias
    (as models hold them). ``heads=False``: the no-heads form, (L, dim) with dim = P."""
    g = torch.Generator().manual_seed(seed)
    h = H if heads else 1
    t = dict(
        state=torch.randn(S, h, P, N, generator=g),
        x=torch.randn(L, h, P, generator=g),
        dt=torch.randn(L, h, generator=g) * 0.5,
        A=-torch.rand(h, generator=g) - 0.5,
        B=torch.randn(L, G if heads else 1, N, generator=g),
        C=torch.randn(L, G if heads else 1, N, generator=g),
        D=torch.randn(h, generator=g),
        dt_bias=torch.rand(h, generator=g) - 1.0,
        z=torch.randn(L, h, P, generator=g),
    )
    t["state"] = t["state"].to(pool_dtype)
    return t


def oracle(op: dict, rows: list, pad: int = PAD):
    """The engines' semantics spelled out. ``rows``: (tokens, src, dsts) per row, with
    tokens the flat token indices of the row, src its source slot and dsts the slot
    each token's state is written to (None: no write). Returns (y (L, H, P), pool)."""
    f = torch.float64
    pool = op["state"]
    S, h = pool.shape[:2]
    A = op["A"].to(f).view(h, 1, 1).expand(h, P, N)
    D = op["D"].to(f).view(h, 1).expand(h, P)
    bias = op["dt_bias"].to(f).view(h, 1).expand(h, P)
    dt = op["dt"].to(f).unsqueeze(-1).expand(*op["dt"].shape, P)
    y = torch.zeros(op["x"].shape, dtype=f)
    writes = []
    for tokens, src, dsts in rows:
        if src == pad or not 0 <= src < S:
            continue  # a pad row: y = 0, nothing written
        state = pool[src : src + 1].to(f)  # read before any write
        for i, dst in zip(tokens, dsts):
            y_i, _, new = reference.decode_step(
                state, op["x"][i : i + 1], dt[i : i + 1], A, op["B"][i : i + 1], op["C"][i : i + 1], D,
                op["z"][i : i + 1], bias, True, compute_dtype=f)
            state = new
            y[i] = y_i[0]
            if dst is not None and dst != pad:
                writes.append((dst, new[0]))
    new_pool = pool.clone()
    for dst, s in writes:
        new_pool[dst] = s.to(pool.dtype)  # rounded once, from the unrounded state
    return y, new_pool


def call(op: dict, device: str, *, x_shape=None, out=False, **kw):
    """selective_state_update on a copy of the pool, operands viewed as x_shape's lead dims."""
    def to(t):
        return None if t is None else t.to(device)

    lead = x_shape or op["x"].shape[:1]
    state = op["state"].clone().to(device)
    args = dict(
        x=op["x"].reshape(*lead, *op["x"].shape[1:]), dt=op["dt"].reshape(*lead, *op["dt"].shape[1:]),
        A=op["A"], B=op["B"].reshape(*lead, *op["B"].shape[1:]), C=op["C"].reshape(*lead, *op["C"].shape[1:]),
        D=op["D"], z=op["z"].reshape(*lead, *op["z"].shape[1:]), dt_bias=op["dt_bias"],
    )
    args = {k: to(v) for k, v in args.items()}
    kw = {k: to(v) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    buf = torch.full_like(args["x"], float("nan")) if out else None
    y = selective_state_update(state, dt_softplus=True, out=buf, **args, **kw)
    if out:
        assert y is buf
    return y.cpu().reshape(op["x"].shape), state.cpu()


def assert_matches(got, want, tol=1e-5):
    y, pool = got
    ref_y, ref_pool = want
    torch.testing.assert_close(y.double(), ref_y, rtol=tol, atol=tol)
    torch.testing.assert_close(pool.double(), ref_pool.double(), rtol=tol, atol=tol)


def distinct_slots(S: int, shape: tuple, seed: int, exclude=()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    free = [s for s in torch.randperm(S, generator=g).tolist() if s not in set(exclude)]
    n = 1
    for d in shape:
        n *= d
    return torch.tensor(free[:n], dtype=torch.int32).view(shape)


ACCEPTED = {"none": lambda T, W: [0] * T, "all": lambda T, W: [W] * T,
            "mixed": lambda T, W: [(t * 3 + 1) % (W + 1) for t in range(T)]}


# ---------------------------------------------------------------------------
# vLLM: flat token axis with cu_seqlens
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("accepted", list(ACCEPTED))
@pytest.mark.parametrize("dst_table", ["dst", "none"], ids=["dst", "dst_defaults_to_src"])
@pytest.mark.parametrize("with_out", [False, True], ids=["ret", "out"])
def test_vllm_spec_varlen(mdevice, accepted, dst_table, with_out):
    """cu_seqlens + num_accepted_tokens + (batch, W) tables: row t starts from
    src[t, max(n - 1, 0)] and writes the state after token k to dst[t, k]."""
    W, lens, L = 4, [3, 1, 0, 4, 2], 12  # an empty row, and two tokens at the end no row owns
    T, S = len(lens), 48
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    op = operands(L, S, seed=1)
    src = distinct_slots(S, (T, W), seed=2)
    dst = distinct_slots(S, (T, W), seed=3, exclude=src.flatten().tolist()) if dst_table == "dst" else None
    nat = torch.tensor(ACCEPTED[accepted](T, W), dtype=torch.int64)
    table = src if dst is None else dst  # where token k of row t writes: column k
    table[3, 2] = PAD  # skips that one write (never a source column of these patterns)
    rows = []
    for t in range(T):
        n = int(nat[t])
        toks = list(range(int(cu[t]), int(cu[t + 1])))
        rows.append((toks, int(src[t, max(n - 1, 0)]), [int(table[t, k]) for k in range(len(toks))]))
    got = call(op, mdevice, out=with_out, state_batch_indices=src, dst_state_batch_indices=dst,
               pad_slot_id=PAD, num_accepted_tokens=nat, cu_seqlens=cu)
    assert_matches(got, oracle(op, rows))
    assert torch.all(got[0][cu[-1]:] == 0)  # tokens no row owns


def test_vllm_varlen_pad_row_and_custom_pad_id(mdevice):
    """A row whose source entry is the pad slot is skipped whole: y = 0, nothing written."""
    W, lens = 3, [2, 3, 1]
    T, L, S = 3, 6, 20
    pad = S - 1  # a reserved row of the pool, as StatePool does
    cu = torch.tensor([0, 2, 5, 6])
    op = operands(L, S, seed=4)
    src = distinct_slots(S - 1, (T, W), seed=5)
    dst = distinct_slots(S - 1, (T, W), seed=6, exclude=src.flatten().tolist())
    nat = torch.tensor([2, 1, 3])
    src[1, 0] = pad
    rows = [(list(range(int(cu[t]), int(cu[t + 1]))), int(src[t, int(nat[t]) - 1]), dst[t].tolist()) for t in range(T)]
    got = call(op, mdevice, state_batch_indices=src, dst_state_batch_indices=dst, pad_slot_id=pad,
               num_accepted_tokens=nat, cu_seqlens=cu)
    assert_matches(got, oracle(op, rows, pad))
    assert torch.all(got[0][2:5] == 0)
    assert torch.equal(got[1][pad], op["state"][pad])
    assert torch.equal(got[1][dst[1]], op["state"][dst[1]])  # the pad row wrote nothing


@pytest.mark.parametrize("tables", ["none", "1d", "2d", "2d_dst"])
def test_vllm_varlen_without_accepted_tokens(mdevice, tables):
    """cu_seqlens alone (chunked decode): column 0 is the source and the final state goes
    to column 0 of the destination table (the source slot without one)."""
    lens, W = [2, 0, 3, 1], 3
    T, L, S = 4, 7, 30
    cu = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int64)
    op = operands(L, S, seed=7)
    src2 = distinct_slots(S, (T, W), seed=8)
    dst2 = distinct_slots(S, (T, W), seed=9, exclude=src2.flatten().tolist())
    kw = {"none": {}, "1d": dict(state_batch_indices=src2[:, 0]), "2d": dict(state_batch_indices=src2),
          "2d_dst": dict(state_batch_indices=src2, dst_state_batch_indices=dst2)}[tables]
    rows = []
    for t in range(T):
        toks = list(range(int(cu[t]), int(cu[t + 1])))
        s = t if tables == "none" else int(src2[t, 0])
        d = int(dst2[t, 0]) if tables == "2d_dst" else s
        rows.append((toks, s, [None] * (len(toks) - 1) + [d]))
    got = call(op, mdevice, cu_seqlens=cu, **kw)
    assert_matches(got, oracle(op, rows))


@pytest.mark.parametrize("accepted", list(ACCEPTED))
@pytest.mark.parametrize("with_out", [False, True], ids=["ret", "out"])
def test_vllm_spec_one_token_per_row(mdevice, accepted, with_out):
    """num_accepted_tokens without cu_seqlens: one token per row, read from column n - 1,
    written to column 0 of the destination table."""
    T, W, S = 5, 3, 40
    op = operands(T, S, seed=10)
    src = distinct_slots(S, (T, W), seed=11)
    dst = distinct_slots(S, (T, W), seed=12, exclude=src.flatten().tolist())
    nat = torch.tensor(ACCEPTED[accepted](T, W), dtype=torch.int32)
    rows = [([t], int(src[t, max(int(nat[t]) - 1, 0)]), [int(dst[t, 0])]) for t in range(T)]
    got = call(op, mdevice, out=with_out, state_batch_indices=src, dst_state_batch_indices=dst,
               num_accepted_tokens=nat)
    assert got[0].shape == (T, H, P)
    assert_matches(got, oracle(op, rows))
    # Without dst_state_batch_indices vLLM writes to column 0 of state_batch_indices.
    rows = [([t], int(src[t, max(int(nat[t]) - 1, 0)]), [int(src[t, 0])]) for t in range(T)]
    assert_matches(call(op, mdevice, state_batch_indices=src, num_accepted_tokens=nat), oracle(op, rows))


def test_one_token_wide_tables_read_column_0(mdevice):
    """(batch, W) tables with one token per row and no num_accepted_tokens: column 0,
    as in vLLM and FlashInfer, bit for bit the 1-D call."""
    T, W, S = 4, 3, 30
    op = operands(T, S, seed=13)
    src = distinct_slots(S, (T, W), seed=14)
    dst = distinct_slots(S, (T, W), seed=15, exclude=src.flatten().tolist())
    wide = call(op, mdevice, state_batch_indices=src, dst_state_batch_indices=dst)
    narrow = call(op, mdevice, state_batch_indices=src[:, 0], dst_state_batch_indices=dst[:, 0])
    assert torch.equal(wide[0], narrow[0]) and torch.equal(wide[1], narrow[1])
    assert_matches(wide, oracle(op, [([t], int(src[t, 0]), [int(dst[t, 0])]) for t in range(T)]))


# ---------------------------------------------------------------------------
# FlashInfer: a token axis, x (batch, T, nheads, dim)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("case", ["src1d", "src_none", "src1d_dst1d", "src2d_dst2d", "src2d_no_dst"])
@pytest.mark.parametrize("with_out", [False, True], ids=["ret", "out"])
def test_flashinfer_token_axis(mdevice, K, case, with_out):
    T, W, S = 3, 4, 40
    op = operands(T * K, S, seed=16 + K)
    src2 = distinct_slots(S, (T, W), seed=17)
    dst2 = distinct_slots(S, (T, W), seed=18, exclude=src2.flatten().tolist())
    nat = torch.tensor([0, W, 2])
    kw, rows = {}, []
    for t in range(T):
        toks = [t * K + k for k in range(K)]
        final = [None] * (K - 1)
        if case == "src1d":
            kw = dict(state_batch_indices=src2[:, 0])
            rows.append((toks, int(src2[t, 0]), final + [int(src2[t, 0])]))
        elif case == "src_none":
            rows.append((toks, t, final + [t]))
        elif case == "src1d_dst1d":
            kw = dict(state_batch_indices=src2[:, 0], dst_state_batch_indices=dst2[:, 0])
            rows.append((toks, int(src2[t, 0]), final + [int(dst2[t, 0])]))
        elif case == "src2d_dst2d":
            kw = dict(state_batch_indices=src2, dst_state_batch_indices=dst2[:, :K], num_accepted_tokens=nat)
            rows.append((toks, int(src2[t, max(int(nat[t]) - 1, 0)]), [int(dst2[t, k]) for k in range(K)]))
        else:  # FlashInfer's rule: no dst table, so the final state goes back to the source slot
            kw = dict(state_batch_indices=src2, num_accepted_tokens=nat)
            s = int(src2[t, max(int(nat[t]) - 1, 0)])
            rows.append((toks, s, final + [s]))
    got = call(op, mdevice, x_shape=(T, K), out=with_out, **kw)
    assert_matches(got, oracle(op, rows))


def test_token_axis_and_varlen_agree(mdevice):
    """The same rows in FlashInfer's token-axis layout and vLLM's flat layout, with explicit
    per-token destinations, give the same bits."""
    T, K, W, S = 3, 3, 3, 40
    op = operands(T * K, S, seed=19)
    src = distinct_slots(S, (T, W), seed=20)
    dst = distinct_slots(S, (T, K), seed=21, exclude=src.flatten().tolist())
    nat = torch.tensor([1, 0, 3])
    kw = dict(state_batch_indices=src, dst_state_batch_indices=dst, num_accepted_tokens=nat)
    axis = call(op, mdevice, x_shape=(T, K), **kw)
    flat = call(op, mdevice, cu_seqlens=torch.arange(0, T * K + 1, K), **kw)
    assert torch.equal(axis[0], flat[0]) and torch.equal(axis[1], flat[1])


def test_low_precision_pool_rounds_each_written_state_once(mdevice):
    T, K, W, S = 2, 4, 4, 20
    op = operands(T * K, S, seed=22, pool_dtype=torch.bfloat16)
    src = distinct_slots(S, (T, W), seed=23)
    dst = distinct_slots(S, (T, K), seed=24, exclude=src.flatten().tolist())
    nat = torch.tensor([3, 1])
    rows = [([t * K + k for k in range(K)], int(src[t, int(nat[t]) - 1]), dst[t].tolist()) for t in range(T)]
    got = call(op, mdevice, x_shape=(T, K), state_batch_indices=src, dst_state_batch_indices=dst,
               num_accepted_tokens=nat)
    assert got[1].dtype == torch.bfloat16
    assert_matches(got, oracle(op, rows), tol=2e-2)


# ---------------------------------------------------------------------------
# The no-heads form, disable_state_update
# ---------------------------------------------------------------------------


def test_no_heads_form_varlen_spec(mdevice):
    """state (S, dim, N), x (num_tokens, dim), B (num_tokens, N), A (dim, N), D (dim,)."""
    W, T, L, S = 3, 3, 6, 30
    cu = torch.tensor([0, 3, 4, 6])
    op = operands(L, S, seed=25, heads=False)
    src = distinct_slots(S, (T, W), seed=26)
    nat = torch.tensor([3, 0, 2])
    rows = [(list(range(int(cu[t]), int(cu[t + 1]))), int(src[t, max(int(nat[t]) - 1, 0)]),
             src[t].tolist()) for t in range(T)]
    want = oracle(op, rows)
    state = op["state"][:, 0].clone().to(mdevice)
    A = op["A"].view(1, 1).expand(P, N)
    args = [t.to(mdevice) for t in (op["x"][:, 0], op["dt"].expand(L, P), A, op["B"][:, 0], op["C"][:, 0],
                                    op["D"].expand(P), op["z"][:, 0], op["dt_bias"].expand(P))]
    y = selective_state_update(state, *args, True, src.to(mdevice), None, PAD, None, nat.to(mdevice), cu.to(mdevice))
    assert y.shape == (L, P)
    assert_matches((y.cpu()[:, None], state.cpu()[:, None]), want)


@pytest.mark.parametrize("form", ["single", "spec_one_token", "varlen", "token_axis"])
def test_disable_state_update_writes_nothing(mdevice, form):
    T, K, W, S = 3, 2, 2, 20
    L = T * K
    op = operands(L, S, seed=27)
    src = distinct_slots(S, (T, W), seed=28)
    nat = torch.tensor([1, 2, 0])
    kw = {"single": dict(state_batch_indices=src[:, 0]),
          "spec_one_token": dict(state_batch_indices=src, num_accepted_tokens=nat),
          "varlen": dict(state_batch_indices=src, num_accepted_tokens=nat, cu_seqlens=torch.arange(0, L + 1, K)),
          "token_axis": dict(state_batch_indices=src, num_accepted_tokens=nat, x_shape=(T, K))}[form]
    if form in ("single", "spec_one_token"):
        op = operands(T, S, seed=27)
    y_on, pool_on = call(op, mdevice, **kw)
    y_off, pool_off = call(op, mdevice, disable_state_update=True, **kw)
    assert torch.equal(pool_off, op["state"])
    assert not torch.equal(pool_on, op["state"])  # the same call with writes does write
    assert torch.equal(y_off, y_on)


# ---------------------------------------------------------------------------
# Bad input: an error that names the argument, and the pool unchanged
# ---------------------------------------------------------------------------


def _bad_calls():
    T, K, W, S, L = 3, 2, 2, 12, 6
    src = torch.tensor([[0, 1], [2, 3], [4, 5]])
    cu = torch.tensor([0, 2, 4, 6])
    nat = torch.tensor([1, 2, 0])
    return [
        ("cu_seqlens with a token axis", dict(x_shape=(T, K), cu_seqlens=cu), "cu_seqlens marks rows on a flat"),
        ("accepted without a table", dict(num_accepted_tokens=nat), "num_accepted_tokens picks"),
        ("accepted with a 1-D table", dict(state_batch_indices=src[:, 0], num_accepted_tokens=nat, cu_seqlens=cu),
         r"num_accepted_tokens picks .* got state_batch_indices shape \(3,\)"),
        ("3-D table", dict(state_batch_indices=src[:, :, None], cu_seqlens=cu), "state_batch_indices must be"),
        ("empty columns", dict(dst_state_batch_indices=torch.zeros(T, 0, dtype=torch.long), cu_seqlens=cu),
         "dst_state_batch_indices must be"),
        ("accepted of the wrong length", dict(state_batch_indices=src, num_accepted_tokens=nat[:2], cu_seqlens=cu),
         "num_accepted_tokens"),
        ("table rows", dict(state_batch_indices=src[:2], num_accepted_tokens=nat[:2], cu_seqlens=cu),
         "state_batch_indices"),
        ("dst narrower than the tokens", dict(x_shape=(T, K), state_batch_indices=src[:, 0],
                                              dst_state_batch_indices=src[:, :1]), "dst_state_batch_indices"),
        ("float cu_seqlens", dict(cu_seqlens=cu.float()), "cu_seqlens"),
        ("disable_state_update not a bool", dict(cu_seqlens=cu, disable_state_update=1), "disable_state_update"),
    ], S, L


@pytest.mark.parametrize("case", range(len(_bad_calls()[0])), ids=[c[0] for c in _bad_calls()[0]])
def test_bad_input_names_the_argument(case):
    calls, S, L = _bad_calls()
    _, kw, pattern = calls[case]
    op = operands(L, S, seed=29)
    before = op["state"].clone()
    with pytest.raises(RuntimeError, match=pattern):
        call(op, "cpu", **kw)
    assert torch.equal(op["state"], before)


def test_token_axis_shapes_must_agree():
    op = operands(6, 12, seed=30)
    state = op["state"].clone()
    x = op["x"].view(3, 2, H, P)
    with pytest.raises(RuntimeError, match="B must be"):
        selective_state_update(state, x, op["dt"].view(3, 2, H), op["A"], op["B"], op["C"])
    with pytest.raises(RuntimeError, match="x must be"):  # the no-heads form has no token axis
        selective_state_update(state[:, 0], op["x"][:, 0].view(3, 2, P), op["dt"], op["A"], op["B"], op["C"])
    assert torch.equal(state, op["state"])


def test_checked_mode_names_the_drop_in_entry(checked_mode):
    T, W, L, S = 2, 2, 4, 12
    op = operands(L, S, seed=31)
    src = torch.tensor([[0, 1], [2, 3]])
    dst = torch.tensor([[4, 5], [6, 5]])  # slot 5 written twice
    cu = torch.tensor([0, 2, 4])
    with pytest.raises(RuntimeError, match=r"num_accepted_tokens\[1\] = 3"):
        call(op, "cpu", state_batch_indices=src, num_accepted_tokens=torch.tensor([1, 3]), cu_seqlens=cu)
    with pytest.raises(RuntimeError, match="dst_state_batch_indices has a duplicate"):
        call(op, "cpu", state_batch_indices=src, dst_state_batch_indices=dst,
             num_accepted_tokens=torch.tensor([1, 2]), cu_seqlens=cu)


def test_compiles_fullgraph():
    """The token-axis default (a gather of the source column) and the varlen form trace
    without graph breaks and give the eager bits."""
    T, K, W, S = 2, 3, 3, 16
    op = operands(T * K, S, seed=32)
    src = distinct_slots(S, (T, W), seed=33)
    nat = torch.tensor([2, 0])

    def step(state, x, dt, A, B, C, src, nat, cu):
        y1 = selective_state_update(state, x.view(T, K, H, P), dt.view(T, K, H), A, B.view(T, K, G, N),
                                    C.view(T, K, G, N), dt_softplus=True, state_batch_indices=src,
                                    num_accepted_tokens=nat)
        y2 = selective_state_update(state, x, dt, A, B, C, dt_softplus=True, state_batch_indices=src,
                                    num_accepted_tokens=nat, cu_seqlens=cu, disable_state_update=True)
        return y1, y2

    args = (op["x"], op["dt"], op["A"], op["B"], op["C"], src, nat, torch.arange(0, T * K + 1, K))
    eager_state = op["state"].clone()
    want = step(eager_state, *args)
    state = op["state"].clone()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(state, *args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(state, eager_state)
