#!/usr/bin/env python
"""How fast can the decode step's access pattern go at all? (issue #3's T >= 64 target)

    python tools/cuda_pattern_ceiling.py [--shapes 80,64,128,1 128,64,128,8] [--T 64 256]

On the benchmark's shapes and inputs (slots drawn from a pool of 2T, input sets cycled
to defeat L2), per (shape, pool dtype, T), GB/s and % of a same-run device-to-device
copy for:
  step        the decode step as benchmarked (its bytes: bench.step_bytes)
  slot-copy   the simplest kernel of the step's pattern: each addressed slot read and
              written back in place, nothing else (a Triton kernel, one program per
              BLOCK contiguous elements of a slot; the best of a few BLOCK sizes); its
              bytes: the state's read and write only
  seq-copy    the same kernel on slots 0..T-1 in order (the pattern without random slots)
  1w-256B     slot-copy in one-warp programs of 256 bytes per thread (the lean kernel's
              footprint: one warp per block, 8-16 16-byte chunks per thread), and
  1w-64B      the same with 64 bytes per thread: whether the footprint alone costs
  gather      torch.index_select of the addressed slots into a buffer (random reads,
              contiguous writes)
Together they say how much of the gap to the copy is the pattern itself (random
whole-slot regions read and rewritten in place) and how much the step's own kernel.
Needs a CUDA device and Triton (exit 2 without them).
"""

from __future__ import annotations

import argparse
import sys

import torch

from triton_bench import bench, missing_requirement, start, tl, triton

if triton is not None:
    @triton.jit
    def slot_copy(pool, slots, slot_elems, BLOCK: tl.constexpr):
        """Slot slots[t]'s elements [pid * BLOCK, (pid + 1) * BLOCK) read and written back."""
        t = tl.program_id(1)
        slot = tl.load(slots + t).to(tl.int64)
        offs = slot * slot_elems + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(pool + offs, tl.load(pool + offs))

BLOCKS = (1024, 2048, 4096, 8192)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_sweep_args(ap, T=[64, 256], seconds=0.2)
    args = ap.parse_args()
    missing = missing_requirement("cuda_pattern_ceiling")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    device = torch.device("cuda")
    timer, copy_Bps = start(device, args.seconds)
    print(f"{'shape':>14} {'pool':>5} {'T':>4} {'step':>14} {'slot-copy':>20} {'seq-copy':>14} {'1w-256B':>14} "
          f"{'1w-64B':>14} {'gather':>14}")
    gen = torch.Generator().manual_seed(0)

    def cell(nbytes, secs):
        return f"{nbytes / secs / 1e9:6.0f} {100 * nbytes / secs / copy_Bps:5.1f}%"

    for shape, name, pool_dtype, T, sets in bench.input_set_sweep(args.shapes, args.pool_dtypes, args.T, device, gen):
        slot_elems = shape.H * shape.P * shape.N
        k = len(sets)
        step_s = bench.step_time(sets, timer, min(k, 8))
        state_bytes = 2 * T * slot_elems * pool_dtype.itemsize
        in_order = torch.arange(T, device=device, dtype=sets[0].slot_idx.dtype)

        def copy_s(slots_of, block, warps):
            grid = (slot_elems // block, T)
            return timer.time(lambda i: slot_copy[grid](sets[i % k].pool, slots_of(i % k), slot_elems, BLOCK=block,
                                                         num_warps=warps), warmup_calls=min(k, 8))

        def best_copy(slots_of):  # (seconds, BLOCK) of the fastest four-warp BLOCK
            return min((copy_s(slots_of, block, 4), block) for block in BLOCKS if slot_elems % block == 0)

        def one_warp_copy(bytes_per_thread):
            return copy_s(lambda j: sets[j].slot_idx, 32 * bytes_per_thread // pool_dtype.itemsize, 1)

        rand_s, rand_block = best_copy(lambda j: sets[j].slot_idx)
        warp256_s, warp64_s = one_warp_copy(256), one_warp_copy(64)
        seq_s, _ = best_copy(lambda j: in_order)
        gathered = torch.empty((T, shape.H, shape.P, shape.N), dtype=pool_dtype, device=device)
        gather_s = timer.time(lambda i: torch.index_select(sets[i % k].pool, 0, sets[i % k].slot_idx,
                                                           out=gathered), warmup_calls=min(k, 8))
        print(f"{str(shape):>14} {name:>5} {T:>4} "
              f"{cell(bench.step_bytes(shape, T, pool_dtype, torch.bfloat16), step_s):>14} "
              f"{cell(state_bytes, rand_s) + f' b{rand_block}':>20} {cell(state_bytes, seq_s):>14} "
              f"{cell(state_bytes, warp256_s):>14} {cell(state_bytes, warp64_s):>14} "
              f"{cell(state_bytes, gather_s):>14}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
