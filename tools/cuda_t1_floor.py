#!/usr/bin/env python
"""Where the time of a T = 1 decode step goes under CUDA-graph replay (issue #3's
2.5 us target), on the benchmark's shapes and inputs.

    python tools/cuda_t1_floor.py [--shapes 80,64,128,1 128,64,128,8] [--T 1]

Per (shape, pool dtype), microseconds per step, each captured as the benchmark
captures the op (several steps back to back in one graph, cycling over input sets
larger than L2):
  step        the decode step as benchmarked
  l2          the same step on one input set (its state rows stay in L2)
  pad         the same kernel with every slot the pad id: it reads the slot index,
              writes y = 0 and leaves (launch, the slot-index load, the y store)
  fill        a one-element fill_ kernel per step: the graph's per-kernel floor
The differences place the time: step - l2 ~ DRAM latency and bandwidth of the
state rows, l2 - pad ~ the step's own loads, arithmetic and stores from L2,
pad - fill ~ the slot-index chain and the kernel's launch shape.
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench.add_sweep_args(ap, T=[1], seconds=0.15)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("cuda_t1_floor: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    timer = bench.Timer(device, budget_s=args.seconds, min_samples=5, max_samples=100)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | us per step under graph replay")
    print(f"{'shape':>14} {'pool':>5} {'T':>4} {'step':>7} {'l2':>7} {'pad':>7} {'fill':>7}")
    gen = torch.Generator().manual_seed(0)
    tiny = torch.zeros(1, device=device)
    for shape, name, pool_dtype, T, sets in bench.input_set_sweep(args.shapes, args.pool_dtypes, args.T, device, gen):
        pads = [torch.full_like(s.slot_idx, bench.PAD_SLOT_ID) for s in sets]

        def step_pad(j, sets=sets, pads=pads):
            s = sets[j % len(sets)]
            args_ = list(s.op_args())
            args_[10] = pads[j % len(sets)]
            torch.ops.ssd.decode_step_out(*args_, s.out)

        times = [bench._graph_time(sets, timer, device), bench._graph_time(sets[:1], timer, device),
                 bench.graph_time(step_pad, len(sets), timer, device),
                 bench.graph_time(lambda j: tiny.fill_(j), 1, timer, device)]
        print(f"{str(shape):>14} {name:>5} {T:>4} " + " ".join(f"{t * 1e6:7.2f}" for t in times), flush=True)
        del sets, pads
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
