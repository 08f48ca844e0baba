#!/usr/bin/env python
"""A small set of CUDA calls for compute-sanitizer: every op (the multi-token ones
included), contiguous and strided layouts, pad and out-of-range slots, a tail along N,
all three pool dtypes.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tools/cuda_sanitize_cases.py
    compute-sanitizer --tool racecheck python tools/cuda_sanitize_cases.py
    compute-sanitizer --tool racecheck python tools/cuda_sanitize_cases.py --windowed-only

(Without caching, every tensor is its own allocation, so memcheck sees a read or
write past a tensor's end.) Each call's results are also checked against the CPU
kernels, so the script fails on its own (exit 1) if a CUDA result is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

try:
    import torch_ssd  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_ssd  # noqa: F401

GEN = torch.Generator().manual_seed(1234)
FAILS: list[str] = []


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Same values, other strides: 'contiguous', 'transposed' (every dim reversed in
    storage), 'strided' (every other element of a bigger buffer along the last dim),
    'offset' (storage offset 3, no 16-byte alignment)."""
    t = t.contiguous()
    if layout == "contiguous":
        return t.clone()
    if layout == "transposed":
        order = list(reversed(range(t.dim())))
        return t.permute(order).contiguous().permute(order)
    if layout == "strided":
        base = torch.full((*t.shape[:-1], 2 * t.shape[-1]), 9.0, dtype=t.dtype, device=t.device)
        view = base[..., 1::2]
        view.copy_(t)
        return view
    if layout == "offset":
        flat = torch.full((t.numel() + 8,), 9.0, dtype=t.dtype, device=t.device)
        view = flat[3 : 3 + t.numel()].view(t.shape)
        view.copy_(t)
        return view
    raise ValueError(layout)


def check(what: str, got, want, exact: bool = False):
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    ok = torch.equal(got, want) if exact else torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    if not ok:
        FAILS.append(what)
        print(f"FAIL {what}: max diff {(got - want).abs().max().item():.3g}")


def step_case(pool_dtype, layout, N, broadcast, idx_dtype, P=8, tag_extra=""):
    S, T, H, G = 12, 6, 4, 2
    pool = randn(S, H, P, N, dtype=pool_dtype)
    x, z = randn(T, H, P, dtype=torch.bfloat16), randn(T, H, P, dtype=torch.bfloat16)
    B, C = randn(T, G, N, dtype=torch.bfloat16), randn(T, G, N, dtype=torch.bfloat16)
    if broadcast:  # the lean kernel's case: dt in x's type, per-head values expanded (on the device, below)
        dt = (randn(T, H, 1) * 0.3).to(torch.bfloat16)
        A = -torch.rand(H, 1, 1, generator=GEN) - 0.2
        D, dt_bias = randn(H, 1), randn(H, 1) * 0.1
    else:
        dt, A = randn(T, H, P) * 0.3, -torch.rand(H, P, N, generator=GEN) - 0.2
        D, dt_bias = randn(H, P), randn(H, P) * 0.1
    # Row 1: pad source; row 2: source past the end; row 3: negative source;
    # row 4: pad destination; row 5: destination past the end.
    slot_idx = torch.tensor([0, -1, S, -7, 3, 5], dtype=idx_dtype)
    dst_slot_idx = torch.tensor([6, 7, 8, 9, -1, S + 100], dtype=idx_dtype)
    cpu = dict(pool=pool, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    args = []
    for dev in ("cpu", "cuda"):
        a = {}
        for k, v in cpu.items():
            v = v.to(dev)
            if broadcast and k in ("dt", "A", "D", "dt_bias"):
                v = v.expand({"dt": (T, H, P), "A": (H, P, N)}.get(k, (H, P)))  # stride 0
            else:
                v = relayout(v, layout)
            a[k] = v
        args.append(a)
    outs = []
    for a, dev in zip(args, ("cpu", "cuda")):
        y = torch.ops.ssd.decode_step(a["pool"], a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"],
                                      a["dt_bias"], True, slot_idx.to(dev), dst_slot_idx.to(dev), -1)
        out = torch.empty_like(a["x"])
        torch.ops.ssd.decode_step_out(a["pool"], a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"],
                                      a["dt_bias"], False, dst_slot_idx.to(dev), None, -1, out)
        outs.append((y, out, a["pool"]))
    tag = f"step {pool_dtype} {layout} N={N} P={P} broadcast={broadcast} {idx_dtype}{tag_extra}"
    check(tag + " y", outs[1][0], outs[0][0])
    check(tag + " out", outs[1][1], outs[0][1])
    check(tag + " pool", outs[1][2], outs[0][2])


# Every lean-kernel form the launch may pick (rows per thread, warps per block; four
# rows in a one-warp block take B / C through shared memory; the grid's block order;
# the rows loaded from the slot index read before the wait (1), or from a wrong guess
# on purpose (2) so that they are loaded again), forced in turn.
LEAN_CHOICES = [{"TORCH_SSD_CUDA_LEAN_ROWS": r, "TORCH_SSD_CUDA_WARPS": w, "TORCH_SSD_CUDA_LEAN_ORDER": o,
                 "TORCH_SSD_CUDA_SPECULATE": g}
                for r, w, o, g in (("1", "1", "0", "1"), ("2", "1", "0", "2"), ("2", "2", "0", "1"),
                                   ("4", "1", "0", "2"), ("4", "2", "0", "1"), ("2", "2", "1", "2"),
                                   ("4", "1", "1", "1"))]


def lean_choice_cases(pool_dtype):
    """The lean kernel's forms on rows that fill several row groups (P = 40: a
    partial last tile) at N = 64 and 128, with the pad and out-of-range slots."""
    for env in LEAN_CHOICES:
        os.environ.update(env)
        for N in (64, 128):
            step_case(pool_dtype, "contiguous", N, broadcast=True, idx_dtype=torch.int64, P=40,
                      tag_extra=f" rows={env['TORCH_SSD_CUDA_LEAN_ROWS']} warps={env['TORCH_SSD_CUDA_WARPS']}"
                                f" order={env['TORCH_SSD_CUDA_LEAN_ORDER']}"
                                f" speculate={env['TORCH_SSD_CUDA_SPECULATE']}")
        for key in env:
            del os.environ[key]


def verb_cases(pool_dtype, layout, N):
    S, T, H, P, G = 10, 5, 3, 4, 2
    pool_cpu = randn(S, H, P, N, dtype=pool_dtype)
    slots = torch.tensor([2, -1, S, 4, 2**33], dtype=torch.int64)
    state = randn(T, H, P, N)
    B, C = randn(T, G, N, dtype=pool_dtype), randn(T, G, N, dtype=torch.float16)
    tag = f"verbs {pool_dtype} {layout} N={N}"
    res = []
    for dev in ("cpu", "cuda"):
        pool = relayout(pool_cpu.to(dev), layout)
        loaded = torch.ops.ssd.load_state(pool, slots.to(dev), -1)
        loaded_all = torch.ops.ssd.load_state(pool)
        Bf, Cf = torch.ops.ssd.load_bc(relayout(B.to(dev), layout), relayout(C.to(dev), layout))
        torch.ops.ssd.store_state(relayout(state.to(dev), layout), pool, slots.to(dev), -1)
        res.append((loaded, loaded_all, Bf, Cf, pool))
    for name, g, w in zip(("load_state", "load_state(all)", "load_bc B", "load_bc C", "store_state"),
                          res[1], res[0]):
        check(f"{tag} {name}", g, w, exact=True)


def multi_cases(pool_dtype, layout, N):
    """The multi-token ops: fixed and varlen forms, the vLLM (T, W) table with
    num_accepted_tokens (a pad column, n > W), a per-token destination table (a pad,
    an out-of-range slot, a duplicate across rows), write_state=False, a varlen row
    without tokens and a tail of tokens no row owns."""
    S, T, K, H, P, G = 28, 4, 3, 4, 8, 2
    pool = randn(S, H, P, N, dtype=pool_dtype)
    broadcast = layout == "contiguous"  # with dt in x's type: the lean kernel's case (N = 64)
    fixed = dict(x=randn(T, K, H, P, dtype=torch.bfloat16), z=randn(T, K, H, P, dtype=torch.bfloat16),
                 dt=randn(T, K, H, P, dtype=torch.bfloat16 if broadcast else torch.float32) * 0.3,
                 B=randn(T, K, G, N, dtype=torch.bfloat16), C=randn(T, K, G, N, dtype=torch.bfloat16))
    flat = {k: v.reshape(T * K, *v.shape[2:]) for k, v in fixed.items()}
    flat = {k: torch.cat([v, v[:2]]) for k, v in flat.items()}  # L = T * K + 2
    if broadcast:
        A = (-torch.rand(H, 1, 1, generator=GEN) - 0.2).expand(H, P, N)
    else:
        A = -torch.rand(H, P, N, generator=GEN) - 0.2
    D, dt_bias = randn(H, P), randn(H, P) * 0.1
    # vLLM table: row 0 reads column 1, row 1 a pad column, row 2 n = 4 > W (a pad row),
    # row 3 column 0 and writes a pad and an out-of-range slot.
    table = torch.tensor([[0, 1, 2], [3, -1, 5], [6, 7, 8], [9, -1, S + 5]])
    accepted = torch.tensor([2, 2, 4, 1])
    src = torch.tensor([10, 11, -1, S + 3])
    dst = torch.arange(12, 12 + T * K).view(T, K)
    dst[1, 2] = dst[0, 0]  # the later write (row 1) wins
    dst[3, 1] = -1
    cu = torch.tensor([0, 3, 3, 6, 12])  # row 1 has no tokens; tokens 12, 13 no row owns
    tag = f"multi {pool_dtype} {layout} N={N}"
    res = []
    for dev in ("cpu", "cuda"):
        a = {k: relayout(v.to(dev), layout) for k, v in fixed.items()}
        f = {k: relayout(v.to(dev), layout) for k, v in flat.items()}
        pl = relayout(pool.to(dev), layout)
        # (.to() would densify an expanded A: expand on the device)
        Ad = A[:, :1, :1].to(dev).expand(H, P, N) if broadcast else relayout(A.to(dev), layout)
        Dd, bd = relayout(D.to(dev), layout), relayout(dt_bias.to(dev), layout)
        tb, ac, sr, ds, c = (v.to(dev) for v in (table, accepted, src, dst, cu))
        y1 = torch.ops.ssd.decode_step_multi(pl, a["x"], a["dt"], Ad, a["B"], a["C"], Dd, a["z"], bd, True, tb, None,
                                             -1, ac, True)
        y2 = torch.full_like(a["x"], float("nan"))
        torch.ops.ssd.decode_step_multi_out(pl, a["x"], a["dt"], Ad, a["B"], a["C"], Dd, a["z"], bd, True, sr, ds,
                                            -1, None, True, y2)
        y3 = torch.ops.ssd.decode_step_varlen(pl, f["x"], f["dt"], Ad, f["B"], f["C"], c.int(), Dd, f["z"], bd, True,
                                              tb.int(), None, -1, ac.int(), True)
        y4 = torch.full_like(f["x"], float("nan"))
        torch.ops.ssd.decode_step_varlen_out(pl, f["x"], f["dt"], Ad, f["B"], f["C"], c, Dd, f["z"], bd, False,
                                             sr, None, -1, None, False, y4)
        res.append((y1, y2, y3, y4, pl))
    for name, g, w in zip(("multi y", "multi_out y", "varlen y", "varlen_out y", "pool"), res[1], res[0]):
        check(f"{tag} {name}", g, w)


def long_rows_case(pool_dtype, bc_path, order="0", bulk="0", next_rows="", K=20, kept_bc="", N=64):
    """A long row through the lean multi-token kernel's B / C path `bc_path` (K = 20:
    widened, both float32 buffers in turn ten times, and each warp walks two tiles of
    rows; staged, three stages of 8 tokens with a 16-bit pool at N = 64; windowed, which
    takes only N = 128: three windows, or with K <= 8 one window whose B / C the second
    tile reuses), each token
    writing its own slot, against the CPU; `order` the grid's block order
    (TORCH_SSD_CUDA_MULTI_ORDER), `bulk` whether the widened path writes its states by
    bulk copies from shared memory (TORCH_SSD_CUDA_MULTI_BULK), `next_rows` whether a warp's
    next tile's rows are copied into shared memory during this one
    (TORCH_SSD_CUDA_MULTI_NEXT_ROWS; "": the default rule, on for the widened path without
    bulk stores here), `kept_bc` whether a row's widened B / C are kept for the second
    tile (TORCH_SSD_CUDA_MULTI_KEPT_BC; "": the default rule, on for rows of up to 16
    tokens here)."""
    os.environ["TORCH_SSD_CUDA_MULTI_BC"] = bc_path
    os.environ["TORCH_SSD_CUDA_MULTI_TILES"] = "2"
    os.environ["TORCH_SSD_CUDA_MULTI_ORDER"] = order
    os.environ["TORCH_SSD_CUDA_MULTI_BULK"] = bulk
    os.environ["TORCH_SSD_CUDA_MULTI_NEXT_ROWS"] = next_rows
    os.environ["TORCH_SSD_CUDA_MULTI_KEPT_BC"] = kept_bc
    S, T, H, P, G = 2 * K + 8, 2, 2, 40, 1
    pool = randn(S, H, P, N, dtype=pool_dtype)
    ops = {k: randn(T, K, H, P, dtype=torch.bfloat16) for k in ("x", "z")}
    ops["dt"] = randn(T, K, H, P, dtype=torch.bfloat16) * 0.3
    ops.update({k: randn(T, K, G, N, dtype=torch.bfloat16) for k in ("B", "C")})
    A = -torch.rand(H, 1, 1, generator=GEN) - 0.2
    D, dt_bias = randn(H, P), randn(H, P) * 0.1
    src = torch.tensor([3, 5])
    dst = torch.arange(8, 8 + T * K).view(T, K)
    res = []
    for dev in ("cpu", "cuda"):
        a = {k: v.to(dev) for k, v in ops.items()}
        pl = pool.to(dev)
        y = torch.ops.ssd.decode_step_multi(pl, a["x"], a["dt"], A.to(dev).expand(H, P, N), a["B"], a["C"],
                                            D.to(dev), a["z"], dt_bias.to(dev), True, src.to(dev), dst.to(dev),
                                            -1, None, True)
        res.append((y, pl))
    for name, g, w in zip(("y", "pool"), res[1], res[0]):
        check(f"long rows {pool_dtype} {bc_path} K={K} N={N} {name}", g, w)
    for key in ("TORCH_SSD_CUDA_MULTI_BC", "TORCH_SSD_CUDA_MULTI_TILES", "TORCH_SSD_CUDA_MULTI_ORDER",
                "TORCH_SSD_CUDA_MULTI_BULK", "TORCH_SSD_CUDA_MULTI_NEXT_ROWS", "TORCH_SSD_CUDA_MULTI_KEPT_BC"):
        del os.environ[key]


def windowed_cases(pool_dtype):
    """multi_step_windowed (N = 128 only): three windows, and one window whose B / C the
    warp's second tile reuses."""
    long_rows_case(pool_dtype, "windowed", N=128)
    long_rows_case(pool_dtype, "windowed", K=8, N=128)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windowed-only", action="store_true",
                        help="only the windowed multi-token kernel's long-row cases (a quick check of that "
                             "kernel alone, e.g. under racecheck)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    for pool_dtype in (torch.float32, torch.bfloat16, torch.float16):
        windowed_cases(pool_dtype)
        if args.windowed_only:
            continue
        for layout in ("contiguous", "transposed", "strided", "offset"):
            for N in (64, 20):
                step_case(pool_dtype, layout, N, broadcast=layout == "contiguous",
                          idx_dtype=torch.int32 if layout == "offset" else torch.int64)
                verb_cases(pool_dtype, layout, N)
                multi_cases(pool_dtype, layout, N)
        for bc_path in ("widened", "staged", "registers"):
            long_rows_case(pool_dtype, bc_path)
        long_rows_case(pool_dtype, "widened", bulk="1")
        long_rows_case(pool_dtype, "widened", order="1", bulk="1")
        long_rows_case(pool_dtype, "widened", next_rows="0")
        long_rows_case(pool_dtype, "widened", bulk="1", next_rows="1")
        long_rows_case(pool_dtype, "widened", K=16)  # every token's B / C kept for the second tile
        long_rows_case(pool_dtype, "widened", K=16, bulk="1", kept_bc="1")
        lean_choice_cases(pool_dtype)
    torch.cuda.synchronize()
    print(f"cuda_sanitize_cases: {'FAILED ' + str(len(FAILS)) if FAILS else 'all'} "
          f"{'' if FAILS else 'cases passed'}")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
