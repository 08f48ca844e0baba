#!/usr/bin/env python
"""Which part of the decode step's memory traffic costs bandwidth? A developer probe
for issue #3, on one shape: the op (current defaults) with its slots drawn at random
(the benchmark's case), sorted, consecutive, and without slot indices; against three
ceilings of the same byte count: a device-to-device copy (the benchmark's ceiling),
an in-place read-modify-write of the same pool rows (`pool[:T].mul_`), and the same
in-place update on randomly chosen rows (`index_copy_` of a gathered block).

    python tools/cuda_probe_access.py [--shape 80,64,128,1] [--T 64 256] [--pool-dtypes fp32 bf16]

Prints GB/s (bytes read + written) per case; the op's bytes are bench.step_bytes.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--shape", default="80,64,128,1")
    ap.add_argument("--T", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--pool-dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--device", default="cuda", help="cuda (the point); cpu only to try the script")
    args = ap.parse_args()
    device = torch.device(args.device)
    timer = bench.Timer(device, budget_s=args.seconds, min_samples=5, max_samples=200)
    shape = bench.Shape.parse(args.shape)
    gen = torch.Generator().manual_seed(0)
    print(f"{device} | torch {torch.__version__} | shape {shape}")
    for name in args.pool_dtypes:
        pool_dtype = bench.DTYPES[name]
        for T in args.T:
            inp = bench.make_inputs(shape, T, 2 * T, pool_dtype, torch.bfloat16, device, gen)
            nbytes = bench.step_bytes(shape, T, pool_dtype, torch.bfloat16)
            row_bytes = inp.pool[0].nbytes
            rows = {
                "random slots": inp.slot_idx,
                "sorted slots": inp.slot_idx.sort().values,
                "slots 0..T-1": torch.arange(T, device=device, dtype=torch.int32),
            }
            results = []
            for label, slots in rows.items():
                inp.slot_idx = slots
                secs = timer.time(lambda i: torch.ops.ssd.decode_step_out(*inp.op_args(), inp.out), warmup_calls=3)
                results.append((f"op, {label}", nbytes / secs))
            head = inp.pool[:T]
            inp.slot_idx = None
            secs = timer.time(lambda i: torch.ops.ssd.decode_step_out(*inp.op_args(), inp.out), warmup_calls=3)
            results.append(("op, no slot indices", nbytes / secs))
            src = torch.empty_like(head)
            secs = timer.time(lambda i: src.copy_(head), warmup_calls=3)
            results.append(("copy of T rows", 2 * T * row_bytes / secs))
            secs = timer.time(lambda i: head.mul_(1.0), warmup_calls=3)
            results.append(("in place, rows 0..T-1", 2 * T * row_bytes / secs))
            idx = torch.randperm(2 * T, generator=gen)[:T].to(device)
            block = torch.empty_like(head)
            secs = timer.time(lambda i: torch.index_select(inp.pool, 0, idx, out=block), warmup_calls=3)
            results.append(("gather of T random rows", 2 * T * row_bytes / secs))
            for label, bps in results:
                print(f"{name:>5} T={T:<4} {label:<26} {bps / 1e9:8.1f} GB/s", flush=True)
            del inp, src, block
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
