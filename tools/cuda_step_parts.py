#!/usr/bin/env python
"""Where the decode step's time goes beyond moving its rows (issue #3): the step rebuilt
in Triton one part at a time, each part timed on the benchmark's inputs.

    python tools/cuda_step_parts.py [--shapes 80,64,128,1 128,64,128,8] [--T 64 256]

One program per (head, row t, tile of ROWS head-dim rows), the lean CUDA kernel's grid and
footprint (one warp, 256 bytes of state per thread: 16 float32 or 32 bfloat16 rows of
N = 128), on the main job's inputs (slots drawn from a pool of 2T, sets cycled past L2).
Per (shape, pool dtype, T), % of a same-run device-to-device copy (all columns count the
step's byte count, bench.step_bytes, except rows, which counts the state's only):
  step        torch.ops.ssd.decode_step_out, as benchmarked
  rows        the tile's state rows read and written back unchanged
  +inputs     and the rows' x, dt, z read, y = x * z written
  +B/C        and B, C read, y = the state's dot with C
  full        the whole step in float32 (softplus, decay, update, y with D and the
              z gate), the state rounded once to the pool's type on the store
  full-4w     the full step in four-warp programs (64 bytes of state per thread)
  rows-ti, full-ti
              rows and full with a head's tiles side by side in the grid ((tiles, H, T)
              instead of (H, T, tiles)): consecutive programs on consecutive 8 KB of a slot
A column's drop against the one before it is what that part costs in this form. The full
Triton step is checked against the op on the first input set (close, not bit-equal: its
sums run in another order). Slots are never padded here. Needs a CUDA device and Triton
(exit 2 without them); TRITON_INTERPRET=1 runs the kernels on the CPU (--check-only).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from triton_bench import bench, start, tl, triton

PARTS = ("rows", "+inputs", "+B/C", "full")

if triton is not None:
    @triton.jit
    def step_part(pool, slots, x, dt, z, A, D, dt_bias, B, C, y,
                  H, P, heads_per_group,
                  sx_t, sx_h, sx_p, sdt_t, sdt_h, sdt_p, sz_t, sz_h, sz_p, sA_h, sD_h, sdb_h,
                  sB_t, sB_g, sC_t, sC_g, sy_t, sy_h, sy_p,
                  ROWS: tl.constexpr, N: tl.constexpr, PART: tl.constexpr, TILES_INNER: tl.constexpr):
        """PART 0: rows; 1: +inputs; 2: +B/C; 3: full (see the module docstring).
        TILES_INNER: grid (tiles, H, T) instead of (H, T, tiles)."""
        if TILES_INNER:
            h = tl.program_id(1)
            t = tl.program_id(2)
            tile = tl.program_id(0)
        else:
            h = tl.program_id(0)
            t = tl.program_id(1)
            tile = tl.program_id(2)
        rows = tile * ROWS + tl.arange(0, ROWS)
        ns = tl.arange(0, N)
        slot = tl.load(slots + t).to(tl.int64)
        offs = ((slot * H + h) * P + rows[:, None]) * N + ns[None, :]
        state = tl.load(pool + offs)
        if PART == 0:
            tl.store(pool + offs, state)
        else:
            xv = tl.load(x + t * sx_t + h * sx_h + rows * sx_p).to(tl.float32)
            dtv = tl.load(dt + t * sdt_t + h * sdt_h + rows * sdt_p).to(tl.float32)
            zv = tl.load(z + t * sz_t + h * sz_h + rows * sz_p).to(tl.float32)
            y_at = y + t * sy_t + h * sy_h + rows * sy_p
            if PART == 1:
                tl.store(pool + offs, state)
                tl.store(y_at, (xv * zv + dtv).to(y.dtype.element_ty))
            else:
                g = h // heads_per_group
                b = tl.load(B + t * sB_t + g * sB_g + ns).to(tl.float32)
                c = tl.load(C + t * sC_t + g * sC_g + ns).to(tl.float32)
                s = state.to(tl.float32)
                if PART == 2:
                    tl.store(pool + offs, state)
                    yv = tl.sum(s * c[None, :], axis=1) + xv * zv + dtv + tl.sum(b, axis=0)
                    tl.store(y_at, yv.to(y.dtype.element_ty))
                else:
                    dtv = dtv + tl.load(dt_bias + h * sdb_h)
                    dtv = tl.where(dtv <= 20.0, tl.log(1.0 + tl.exp(dtv)), dtv)  # softplus
                    dA = tl.exp(tl.load(A + h * sA_h) * dtv)
                    s = s * dA[:, None] + (dtv * xv)[:, None] * b[None, :]
                    yv = tl.sum(s * c[None, :], axis=1) + tl.load(D + h * sD_h) * xv
                    yv = yv * (zv / (1.0 + tl.exp(-zv)))  # the z gate, silu(z)
                    tl.store(pool + offs, s.to(pool.dtype.element_ty))
                    tl.store(y_at, yv.to(y.dtype.element_ty))


def launch(inp: bench.StepInputs, part: int, rows: int, warps: int, tiles_inner: bool = False) -> None:
    """One part of the step on one input set (the op's operands as the benchmark holds them)."""
    pool, x, dt, z, B, C, y = inp.pool, inp.x, inp.dt, inp.z, inp.B, inp.C, inp.out
    S, H, P, N = pool.shape
    G = B.shape[1]
    T = x.shape[0]
    grid = (P // rows, H, T) if tiles_inner else (H, T, P // rows)
    step_part[grid](pool, inp.slot_idx, x, dt, z, inp.A, inp.D, inp.dt_bias, B, C, y,
                    H, P, H // G,
                    x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), dt.stride(2),
                    z.stride(0), z.stride(1), z.stride(2), inp.A.stride(0), inp.D.stride(0), inp.dt_bias.stride(0),
                    B.stride(0), B.stride(1), C.stride(0), C.stride(1), y.stride(0), y.stride(1), y.stride(2),
                    ROWS=rows, N=N, PART=part, TILES_INNER=tiles_inner, num_warps=warps)


def rows_per_program(pool_dtype: torch.dtype, N: int, P: int) -> int:
    """Rows per program: 8 KB of state (256 bytes per thread in one warp, 64 in four)."""
    rows = max(1, 8192 // (N * pool_dtype.itemsize))
    if P % rows:
        raise SystemExit(f"cuda_step_parts: P = {P} is not a multiple of {rows} rows per program")
    return rows


def check(inp: bench.StepInputs, rows: int, warps: int, tiles_inner: bool = False) -> float:
    """The full Triton step against the op on one input set; returns the worst relative
    error of y and of the written state (raises when above 2 % of the values' scale)."""
    pool0 = inp.pool.clone()
    torch.ops.ssd.decode_step_out(*inp.op_args(), inp.out)
    want_y, want_pool = inp.out.clone(), inp.pool.clone()
    inp.pool.copy_(pool0)
    launch(inp, 3, rows, warps, tiles_inner)
    got_y, got_pool = inp.out.clone(), inp.pool.clone()
    inp.pool.copy_(pool0)
    worst = 0.0
    for what, got, want in (("y", got_y, want_y), ("state", got_pool, want_pool)):
        err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
        if not err <= 0.02:
            raise SystemExit(f"cuda_step_parts: the Triton step's {what} is off by {err:.3g} (relative)")
        worst = max(worst, err)
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_sweep_args(ap, T=[64, 256], seconds=0.15)
    ap.add_argument("--check-only", action="store_true", help="check the Triton step against the op, time nothing")
    args = ap.parse_args()
    if triton is None:
        print("cuda_step_parts: needs Triton", file=sys.stderr)
        return 2
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret and not args.check_only:
        print("cuda_step_parts: TRITON_INTERPRET=1 runs --check-only only (timings need a GPU)", file=sys.stderr)
        return 2
    if not interpret and not torch.cuda.is_available():
        print("cuda_step_parts: needs a CUDA device (or TRITON_INTERPRET=1 with --check-only)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if interpret else "cuda")
    gen = torch.Generator().manual_seed(0)
    if args.check_only:
        for text in args.shapes:
            shape = bench.Shape.parse(text)
            for name in args.pool_dtypes:
                pool_dtype = bench.DTYPES[name]
                for T in args.T:
                    inp = bench.make_inputs(shape, T, 2 * T, pool_dtype, torch.bfloat16, device, gen)
                    for warps, inner in ((1, False), (4, False), (1, True)):
                        err = check(inp, rows_per_program(pool_dtype, shape.N, shape.P), warps, inner)
                        print(f"{shape} {name} T={T} warps={warps} tiles_inner={inner}: "
                              f"worst relative error {err:.2g}")
        return 0
    timer, copy_Bps = start(device, args.seconds)
    columns = ("step",) + PARTS + ("full-4w", "rows-ti", "full-ti")
    print(f"{'shape':>14} {'pool':>5} {'T':>4} " + " ".join(f"{c:>8}" for c in columns) + "  check")
    for shape, name, pool_dtype, T, sets in bench.input_set_sweep(args.shapes, args.pool_dtypes, args.T, device, gen):
        k = len(sets)
        step_bytes = bench.step_bytes(shape, T, pool_dtype, torch.bfloat16)
        state_bytes = 2 * T * shape.H * shape.P * shape.N * pool_dtype.itemsize
        rows = rows_per_program(pool_dtype, shape.N, shape.P)
        err = max(check(sets[0], rows, 1), check(sets[0], rows, 1, True))
        cells = [step_bytes / bench.step_time(sets, timer, min(k, 8))]
        for part, warps, inner in [(p, 1, False) for p in range(len(PARTS))] + [(3, 4, False), (0, 1, True),
                                                                                (3, 1, True)]:
            secs = timer.time(lambda i: launch(sets[i % k], part, rows, warps, inner), warmup_calls=min(k, 8))
            cells.append((state_bytes if part == 0 else step_bytes) / secs)
        print(f"{str(shape):>14} {name:>5} {T:>4} " +
              " ".join(f"{100 * c / copy_Bps:7.1f}%" for c in cells) + f"  {err:.1g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
