#!/usr/bin/env python
"""The host's time per call of the decode-step ops with plain launches (no CUDA graph):
how long Python, the dispatcher, the argument checks and the launch keep the CPU busy
per call, against stock PyTorch ops on the same device.

    python tools/cuda_host_cost.py [--calls 300] [--rounds 9] [--shape 80,64,128,1]

Each case is called `calls` times back to back without a synchronisation in between
(fewer than the launch queue holds, so the CPU never waits for the GPU); the CPU time of
the loop over `calls` is the host's cost per call (median and least of `rounds`, taken
round-robin over the cases). `stream` is the same loop's time up to the GPU's end: where
it exceeds `host`, the GPU is the limit. (tools/cuda_launch_cost.cu: the CUDA runtime's
own cost per launch.)
Cases:
  empty        torch.empty of y's shape (the allocator; no launch)
  add.out      torch.ops.aten.add.out on y-sized tensors (a stock op, one launch)
  step T=0     decode_step_out with no rows: Python, dispatcher and the argument
               checks, no launch
  step T=n     decode_step_out as the benchmark calls it (its inputs), pool dtype given
  multi T=n    decode_step_multi_out, K tokens, fixed form, bfloat16 pool (T=0: no rows,
               no launch)
  drop-in      torch_ssd.selective_state_update as vLLM's Mamba-2 mixer calls it at decode
               (per-head A, dt, D, dt_bias expanded by the caller, a slot table, out)
The last part runs torch.profiler over the largest step and multi cases and prints their
CPU events (the op and the CUDA runtime's calls), which place the host time inside the op.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import torch_ssd  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_ssd  # noqa: F401
from torch_ssd import bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_multi import EnvSetting, MultiInputs  # noqa: E402


def host_costs(cases, calls: int, rounds: int, sync) -> list[tuple[float, float, float]]:
    """Per case (name, EnvSetting or None, callable): (host us per call: median and least,
    stream us per call: median) over
    `rounds` loops of `calls`. The rounds go round-robin over the cases, so that a slow
    spell of the host (its time is noisy) falls on all of them; the least is the steadier
    figure."""
    for _, knob, fn in cases:
        with knob or contextlib.nullcontext():
            for _ in range(20):
                fn()
    sync()
    host = [[] for _ in cases]
    stream = [[] for _ in cases]
    for _ in range(rounds):
        for i, (_, knob, fn) in enumerate(cases):
            with knob or contextlib.nullcontext():
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                sync()
                t2 = time.perf_counter()
            host[i].append((t1 - t0) / calls * 1e6)
            stream[i].append((t2 - t0) / calls * 1e6)
    return [(statistics.median(h), min(h), statistics.median(s)) for h, s in zip(host, stream)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=bench.Shape.parse, default=bench.Shape.parse("80,64,128,1"))
    ap.add_argument("--T", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--K", type=int, default=2, help="tokens of the multi-token case")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--knob", nargs="*", default=[], type=EnvSetting,
                    help="NAME=VALUE[,NAME=VALUE...]: the bfloat16 T = max(--T) step again with these set")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu: the same cases on the CPU kernels")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("cuda_host_cost.py: no CUDA device (--device cpu runs the CPU kernels)", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    sh = args.shape
    cases = []

    y = torch.empty(max(args.T), sh.H, sh.P, dtype=torch.bfloat16, device=dev)
    a, b = torch.ones_like(y), torch.ones_like(y)
    cases.append(("empty", None, lambda: torch.empty(y.shape, dtype=y.dtype, device=dev)))
    cases.append(("add.out", None, lambda: torch.ops.aten.add.out(a, b, out=y)))
    for pool_name, pool_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for T in [0] + list(args.T):
            inp = bench.make_inputs(sh, max(T, 1), 2 * max(T, 1), pool_dtype, torch.bfloat16, dev, gen)
            if T == 0:  # no rows: every operand sliced to T = 0
                for name in ("x", "dt", "B", "C", "z", "slot_idx", "out"):
                    setattr(inp, name, getattr(inp, name)[:0])
            call = (lambda i: lambda: torch.ops.ssd.decode_step_out(*i.op_args(), i.out))(inp)
            cases.append((f"step {pool_name} T={T}", None, call))
            if pool_name == "bf16" and T == max(args.T):
                profiled = [(f"step {pool_name} T={T}", call)]
                for knob in args.knob:
                    cases.append((f"step {pool_name} T={T} {knob.text}", knob, call))
    for T in [0] + list(args.T):
        m = MultiInputs(sh, max(T, 1), args.K, torch.bfloat16, torch.bfloat16, dev, gen)
        if T == 0:
            for name in ("x", "z", "dt", "B", "C", "table", "accepted", "out"):
                setattr(m, name, getattr(m, name)[:0])
        cases.append((f"multi bf16 K={args.K} T={T}", None, m.multi))
        if T == max(args.T):
            profiled.append((f"multi bf16 K={args.K} T={T}", m.multi))
    # The drop-in as vLLM's Mamba-2 mixer calls it at decode: per-head A, dt, D, dt_bias
    # expanded (stride 0) by the caller, a (batch,) slot table, y into `out`.
    inp = bench.make_inputs(sh, max(args.T), 2 * max(args.T), torch.bfloat16, torch.bfloat16, dev, gen)
    cases.append((f"drop-in bf16 T={max(args.T)}", None, lambda: torch_ssd.selective_state_update(
        inp.pool, inp.x, inp.dt, inp.A, inp.B, inp.C, inp.D, inp.z, inp.dt_bias, True,
        state_batch_indices=inp.slot_idx, pad_slot_id=bench.PAD_SLOT_ID, out=inp.out)))

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, shape {sh}, "
          f"{args.calls} calls x {args.rounds} rounds (us per call)")
    print(f"{'case':<44} {'host':>8} {'least':>8} {'stream':>8}")
    for (name, _, _), (host, least, stream) in zip(cases, host_costs(cases, args.calls, args.rounds, sync)):
        print(f"{name:<44} {host:8.2f} {least:8.2f} {stream:8.2f}")

    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile
        for name, fn in profiled:
            for _ in range(20):
                fn()
            sync()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(200):
                    fn()
                sync()
            print(f"\ntorch.profiler, CPU events of 200 calls of {name} (times inflated by the profiler's own cost):")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
