#!/usr/bin/env python
"""Sweep the CUDA decode step's launch choices on the benchmark's shapes and inputs,
against a same-run device-to-device copy, and check that every choice gives the
same bits. A developer tool for choosing the defaults; the benchmark proper is
`python -m torch_ssd`.

    python tools/cuda_tune.py [--T 1 16 64 256] [--configs block pipe pipe-w8 block-s0-w4]

A config names the kernel and its knobs, joined by '-':
  block        the one-tile-per-block kernel (TORCH_SSD_CUDA_KERNEL=block)
    sS         staging through shared memory on/off (TORCH_SSD_CUDA_STAGE)
    wW         warps per block (TORCH_SSD_CUDA_WARPS)
    cC         C chunks of 16 bytes per lane and row (TORCH_SSD_CUDA_CHUNKS; changes the
               mapping along N and so the bits: expect "DIFFERS" against other mappings)
  lean         the lean kernel where it applies (the default; TORCH_SSD_CUDA_KERNEL unset)
    rR         rows per thread, 1, 2 or 4 (4: streamed, one row in flight ahead of the one
               computed) (TORCH_SSD_CUDA_LEAN_ROWS)
    wW         warps per block (TORCH_SSD_CUDA_WARPS)
    pP         programmatic dependent launch on (1) / off (0) (TORCH_SSD_CUDA_PDL)
    fF         warm L2 with the state rows before waiting on the previous kernel: 0 off,
               1 on (default: on where the whole grid is resident at once)
               (TORCH_SSD_CUDA_PREFETCH)
    oO         block order: 0 (H, T, tiles), 1 (tiles, H, T): a head's tiles side by side
               (TORCH_SSD_CUDA_LEAN_ORDER)
    tT         read the kernel's parameter block first: 0 off, 1 one indexed load, 2 as
               operands, 3 both (default: 2 where the whole grid is resident at once)
               (TORCH_SSD_CUDA_TOUCH_PARAMS)
    sS         load the first rows from the slot index read before the wait: 0 off, 1 on
               (default: on where the whole grid is resident at once) (TORCH_SSD_CUDA_SPECULATE)
    lL         a row's lanes fixed at compile time where N = 128: 1 (default) or read at run
               time: 0 (TORCH_SSD_CUDA_LEAN_FIXED_LANES)
    cC         as for block
  pipe         the pipelined kernel (TORCH_SSD_CUDA_KERNEL=pipe)
    wW         warps per block (TORCH_SSD_CUDA_PIPE_WARPS)
    bB         at most B resident blocks per multiprocessor (TORCH_SSD_CUDA_BPSM)
    nS         S stages of rows in shared memory, 2 or 3 (TORCH_SSD_CUDA_PIPE_STAGES)
    cC         as for block
Unset knobs take the defaults.

Prints, per (shape, pool dtype, T), microseconds per step and % of copy bandwidth
for plain launches, and for T <= 16 also per step under CUDA-graph replay; then
whether y and the pool matched the first config bit for bit.
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
from torch_ssd import bench


KNOBS = ("TORCH_SSD_CUDA_KERNEL", "TORCH_SSD_CUDA_STAGE", "TORCH_SSD_CUDA_WARPS", "TORCH_SSD_CUDA_PIPE_WARPS",
         "TORCH_SSD_CUDA_BPSM", "TORCH_SSD_CUDA_PIPE_STAGES", "TORCH_SSD_CUDA_CHUNKS", "TORCH_SSD_CUDA_LEAN_ROWS",
         "TORCH_SSD_CUDA_PDL", "TORCH_SSD_CUDA_PREFETCH", "TORCH_SSD_CUDA_LEAN_ORDER",
         "TORCH_SSD_CUDA_TOUCH_PARAMS", "TORCH_SSD_CUDA_SPECULATE", "TORCH_SSD_CUDA_LEAN_FIXED_LANES")


def parse_config(text: str) -> dict[str, str]:
    """'pipe-w8-b2' -> the environment variables it stands for (see the module docstring)."""
    kernel, *knobs = text.split("-")
    if kernel not in ("block", "pipe", "lean"):
        raise SystemExit(f"cuda_tune: unknown kernel in config {text!r}")
    env = {} if kernel == "lean" else {"TORCH_SSD_CUDA_KERNEL": kernel}
    names = {("block", "c"): "TORCH_SSD_CUDA_CHUNKS", ("pipe", "c"): "TORCH_SSD_CUDA_CHUNKS",
             ("lean", "c"): "TORCH_SSD_CUDA_CHUNKS", ("lean", "r"): "TORCH_SSD_CUDA_LEAN_ROWS",
             ("lean", "w"): "TORCH_SSD_CUDA_WARPS", ("lean", "p"): "TORCH_SSD_CUDA_PDL",
             ("lean", "f"): "TORCH_SSD_CUDA_PREFETCH", ("lean", "o"): "TORCH_SSD_CUDA_LEAN_ORDER",
             ("lean", "t"): "TORCH_SSD_CUDA_TOUCH_PARAMS", ("lean", "s"): "TORCH_SSD_CUDA_SPECULATE",
             ("lean", "l"): "TORCH_SSD_CUDA_LEAN_FIXED_LANES",
             ("block", "s"): "TORCH_SSD_CUDA_STAGE", ("block", "w"): "TORCH_SSD_CUDA_WARPS",
             ("pipe", "w"): "TORCH_SSD_CUDA_PIPE_WARPS", ("pipe", "b"): "TORCH_SSD_CUDA_BPSM",
             ("pipe", "n"): "TORCH_SSD_CUDA_PIPE_STAGES"}
    for knob in knobs:
        key = names.get((kernel, knob[:1]))
        if key is None or not knob[1:].isdigit():
            raise SystemExit(f"cuda_tune: unknown knob {knob!r} in config {text!r}")
        env[key] = knob[1:]
    return env


def main() -> int:
    ap = argparse.ArgumentParser()
    bench.add_sweep_args(ap, T=[1, 16, 64, 256], seconds=0.15)
    ap.add_argument("--configs", nargs="+", default=["lean", "block", "pipe"])
    args = ap.parse_args()
    device = torch.device("cuda")
    timer = bench.Timer(device, budget_s=args.seconds, min_samples=5, max_samples=100)
    copy_Bps = bench.copy_bandwidth(device, bench.copy_ceiling_bytes(device), timer)
    print(f"copy {copy_Bps / 1e9:.1f} GB/s | {torch.cuda.get_device_name()} | torch {torch.__version__}")
    configs = [parse_config(c) for c in args.configs]
    print(f"{'shape':>14} {'pool':>5} {'T':>4} " + " ".join(f"{c:>22}" for c in args.configs))
    gen = torch.Generator().manual_seed(0)
    for shape, name, pool_dtype, T, sets in bench.input_set_sweep(args.shapes, args.pool_dtypes, args.T, device, gen):
        probe = sets[0]
        nbytes = bench.step_bytes(shape, T, pool_dtype, torch.bfloat16)
        k = len(sets)
        cells = []
        reference = None
        mismatch = []
        pool0 = probe.pool.clone()  # the timing runs below advance probe.pool: restore it per check
        for text_cfg, env in zip(args.configs, configs):
            for key in KNOBS:
                os.environ.pop(key, None)
            os.environ.update(env)
            # Same inputs for every config: y and the written pool must match bit for bit.
            probe.pool.copy_(pool0)
            torch.ops.ssd.decode_step_out(*probe.op_args(), probe.out)
            got = (probe.out.clone(), probe.pool.clone())
            probe.pool.copy_(pool0)
            if reference is None:
                reference = got
            elif not (torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])):
                mismatch.append(text_cfg)
            secs = bench.step_time(sets, timer, min(k, 8))
            cell = f"{secs * 1e6:7.2f}us {100 * nbytes / secs / copy_Bps:5.1f}%"
            if T <= 16:
                g = bench._graph_time(sets, timer, device)
                cell += f" g{g * 1e6:.2f}"
            cells.append(cell)
        for key in KNOBS:
            os.environ.pop(key, None)
        cells.append("same bits" if not mismatch else "DIFFERS: " + " ".join(mismatch))
        print(f"{str(shape):>14} {name:>5} {T:>4} " + " ".join(f"{c:>22}" for c in cells), flush=True)
        del sets, probe
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
