#!/usr/bin/env python
"""Sweep the CUDA decode step's launch choices -- staging through shared memory
(TORCH_SSD_CUDA_STAGE) and the block size (TORCH_SSD_CUDA_WARPS) -- on the
benchmark's shapes and inputs, against a same-run device-to-device copy. A developer
tool for choosing the defaults; the benchmark proper is `python -m torch_ssd`.

    python tools/cuda_tune.py [--T 1 16 64 256] [--configs s1w0 s1w4 s0w0]
    (sSwW: staging on/off, W warps per block, 0 = the heuristic)

Prints, per (shape, pool dtype, T), microseconds per step and % of copy bandwidth
for plain launches, and for T <= 16 also per step under CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

try:
    import torch_ssd  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_ssd  # noqa: F401
from torch_ssd import bench


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=bench.MODEL_SHAPES)
    ap.add_argument("--pool-dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--T", nargs="+", type=int, default=[1, 16, 64, 256])
    ap.add_argument("--configs", nargs="+", default=["s1w0", "s1w4", "s1w8", "s0w0"])
    ap.add_argument("--seconds", type=float, default=0.15)
    args = ap.parse_args()
    device = torch.device("cuda")
    timer = bench.Timer(device, budget_s=args.seconds, min_samples=5, max_samples=100)
    cache = bench.last_level_cache_bytes(device)
    copy_Bps = bench.copy_bandwidth(device, max(1 << 30, 16 * cache), timer)
    print(f"copy {copy_Bps / 1e9:.1f} GB/s | {torch.cuda.get_device_name()} | torch {torch.__version__}")
    configs = [(c[1] != "0", int(c.split("w")[1])) for c in args.configs]
    print(f"{'shape':>14} {'pool':>5} {'T':>4} " + " ".join(f"{c:>22}" for c in args.configs))
    gen = torch.Generator().manual_seed(0)
    for text in args.shapes:
        shape = bench.Shape.parse(text)
        for name in args.pool_dtypes:
            pool_dtype = bench.DTYPES[name]
            for T in args.T:
                probe = bench.make_inputs(shape, T, 2 * T, pool_dtype, torch.bfloat16, device, gen)
                n_sets = max(1, min(64, math.ceil(4 * cache / probe.nbytes())))
                sets = [probe] + [bench.make_inputs(shape, T, 2 * T, pool_dtype, torch.bfloat16, device, gen)
                                  for _ in range(n_sets - 1)]
                nbytes = bench.step_bytes(shape, T, pool_dtype, torch.bfloat16)
                k = len(sets)
                cells = []
                for stage, w in configs:
                    os.environ["TORCH_SSD_CUDA_STAGE"] = "1" if stage else "0"
                    if w:
                        os.environ["TORCH_SSD_CUDA_WARPS"] = str(w)
                    else:
                        os.environ.pop("TORCH_SSD_CUDA_WARPS", None)
                    secs = timer.time(lambda i: torch.ops.ssd.decode_step_out(*sets[i % k].op_args(), sets[i % k].out),
                                      warmup_calls=min(k, 8))
                    cell = f"{secs * 1e6:7.2f}us {100 * nbytes / secs / copy_Bps:5.1f}%"
                    if T <= 16:
                        g = bench._graph_time(sets, timer, device)
                        cell += f" g{g * 1e6:.2f}"
                    cells.append(cell)
                os.environ.pop("TORCH_SSD_CUDA_WARPS", None)
                os.environ.pop("TORCH_SSD_CUDA_STAGE", None)
                print(f"{str(shape):>14} {name:>5} {T:>4} " + " ".join(f"{c:>22}" for c in cells), flush=True)
                del sets, probe
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
