#!/usr/bin/env python
"""How fast can the multi-token step's access pattern go at all? (issue #6's 90 % target)

    python tools/cuda_multi_pattern_ceiling.py [--shapes ...] [--pool-dtypes bf16 fp32] [--K 2 4 8] [--T 16 64]

On bench_multi.py's inputs (vLLM's verification step: a (T, K) slot table drawn from a
pool of 2*T*K slots, the row's source the accepted token's slot; input sets cycled to
defeat L2), per (shape, pool dtype, K, T), % of the floor (bytes over a same-run
device-to-device copy, as bench_multi.py counts it) for:
  multi       the op, plain launches (its bytes: bench_multi.multi_bytes)
  graph       the op under CUDA-graph replay
  K-copy      the simplest kernel of the step's pattern: each row's source slot read
              once and written to the row's K slots, nothing else (Triton, one program
              per BLOCK contiguous elements of a slot and row, four warps; the best of a
              few BLOCK sizes); its bytes: the state's one read and K writes only
  K-copy-1w   the same in one-warp programs of 256 bytes per thread (the lean multi-token
              kernel's footprint: one warp per block, two rows of 8 16-byte chunks)
and, once per run, a plain write-only fill's bandwidth over the copy's (the writes' own ceiling).
If K-copy stays near or above 90 %, the pattern allows the target and the gap is the
kernel's; if not, the target is above what the pattern allows. Needs a CUDA device and
Triton (exit 2 without them).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_multi import _graph_time, multi_bytes, multi_input_sets, state_bytes
from triton_bench import bench, missing_requirement, start, tl, triton

if triton is not None:
    @triton.jit
    def multi_slot_copy(pool, src, table, slot_elems, K: tl.constexpr, BLOCK: tl.constexpr):
        """Row t's source slot src[t], elements [pid * BLOCK, (pid + 1) * BLOCK), read once and
        written to its K slots table[t, :] (the read precedes every write: the source may be
        one of them)."""
        t = tl.program_id(1)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        state = tl.load(pool + tl.load(src + t).to(tl.int64) * slot_elems + offs)
        for k in tl.static_range(K):
            tl.store(pool + tl.load(table + t * K + k).to(tl.int64) * slot_elems + offs, state)

BLOCKS = (1024, 2048, 4096, 8192)


def pct(floor_s: float, secs: float) -> str:
    """A time as % of its floor."""
    return f"{100 * floor_s / secs:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_sweep_args(ap, T=[16, 64], seconds=0.1)
    ap.add_argument("--K", nargs="+", type=int, default=[2, 4, 8])
    args = ap.parse_args()
    missing = missing_requirement("cuda_multi_pattern_ceiling")
    if missing:
        print(missing, file=sys.stderr)
        return 2
    device = torch.device("cuda")
    timer, copy_Bps = start(device, args.seconds)
    fill_Bps = bench.write_bandwidth(device, bench.copy_ceiling_bytes(device), timer)
    print(f"fill {fill_Bps / 1e9:.1f} GB/s = {100 * fill_Bps / copy_Bps:.1f} % of the copy")
    print(f"{'shape':>16} {'pool':>5} {'K':>2} {'T':>4} {'multi':>7} {'graph':>7} {'K-copy':>13} {'K-copy-1w':>10}"
          "   (% of the floor)")
    cache = 2 * bench.last_level_cache_bytes(device)
    for text in args.shapes:
        shape = bench.Shape.parse(text)
        slot_elems = shape.H * shape.P * shape.N
        for name in args.pool_dtypes:
            pool_dtype = bench.DTYPES[name]
            for K in args.K:
                for T in args.T:
                    sets = multi_input_sets(shape, T, K, pool_dtype, torch.bfloat16, device, cache)
                    n = len(sets)
                    warm = max(2, min(n, 8))
                    op_floor_s = multi_bytes(shape, T, K, pool_dtype, torch.bfloat16) / copy_Bps
                    pattern_floor_s = state_bytes(shape, T, K, pool_dtype) / copy_Bps
                    multi_s = timer.time(lambda i: sets[i % n].multi(), warm)
                    graph_s = _graph_time(sets, timer, device)

                    def copy_s(block, warps):
                        grid = (slot_elems // block, T)
                        return timer.time(lambda i: multi_slot_copy[grid](
                            sets[i % n].pool, sets[i % n].first_src, sets[i % n].table, slot_elems, K=K,
                            BLOCK=block, num_warps=warps), warm)

                    best_s, best_block = min((copy_s(b, 4), b) for b in BLOCKS if slot_elems % b == 0)
                    one_warp_s = copy_s(32 * 256 // pool_dtype.itemsize, 1)

                    print(f"{str(shape):>16} {name:>5} {K:>2} {T:>4} {pct(op_floor_s, multi_s):>7} "
                          f"{pct(op_floor_s, graph_s):>7} {pct(pattern_floor_s, best_s) + f' b{best_block}':>13} "
                          f"{pct(pattern_floor_s, one_warp_s):>10}", flush=True)
                    del sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
