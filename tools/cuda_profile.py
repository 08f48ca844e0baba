#!/usr/bin/env python
"""Launch the CUDA decode step a few times on the benchmark's inputs, for a profiler
(Nsight Compute) to catch one launch. A developer tool; see tools/device_run.sh's
`ncu` stage.

    ncu --kernel-name regex:decode_step --launch-skip 4 --launch-count 1 \\
        python tools/cuda_profile.py --shape 80,64,128,1 --pool fp32 --T 64 --config pipe

--config takes the same names as tools/cuda_tune.py (block, pipe, pipe-w8, ...).
--K K profiles the multi-token step instead (tools/bench_multi.py's inputs, K tokens per
row; kernel names match regex:multi_step); with --y-only, write_state=False (y only, no
state written: where the loop waits without the K writes).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

try:
    import torch_ssd  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_ssd  # noqa: F401
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_tune import parse_config  # noqa: E402
from torch_ssd import bench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="80,64,128,1")
    ap.add_argument("--pool", default="fp32", choices=sorted(bench.DTYPES))
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--config", default="pipe")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--K", type=int, default=0, help="tokens per row: profile the multi-token step")
    ap.add_argument("--y-only", action="store_true", help="with --K: write_state=False (no state written)")
    args = ap.parse_args()
    os.environ.update(parse_config(args.config))
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    shape = bench.Shape.parse(args.shape)
    if args.K > 0:
        from bench_multi import MultiInputs
        multi = [MultiInputs(shape, args.T, args.K, bench.DTYPES[args.pool], torch.bfloat16, device, gen)
                 for _ in range(2)]
        for i in range(args.calls):
            multi[i % 2].multi(write_state=not args.y_only)
        torch.cuda.synchronize()
        return 0
    sets = [bench.make_inputs(shape, args.T, 2 * args.T, bench.DTYPES[args.pool], torch.bfloat16, device, gen)
            for _ in range(2)]
    for i in range(args.calls):
        s = sets[i % 2]
        torch.ops.ssd.decode_step_out(*s.op_args(), s.out)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
