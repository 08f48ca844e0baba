#!/usr/bin/env python
"""What would a kernel with the lean multi-token kernel's footprint reach, doing only the
step's essential work? (issue #6's 90 % target)

    python tools/cuda_multi_store_model.py [--shapes ...] [--pool-dtypes bf16 fp32] [--K 2 4 8] [--T 16 64]
                                           [--forms copy:2:12 fp:2:12:0 ...] [--seconds 0.05] [--no-check]

The step runs 6-20 points below its access pattern's ceiling (BENCHMARKS.md, twenty-third
session); every arrangement of its writes tried since lands within a few percent of the
others. This tool separates what the kernel's structure costs from what its extra work
costs: a model kernel (tools/cuda_multi_store_model.cu, built here) with the widened kernel's
footprint -- one warp per block, 8 * rows head-dim rows per block, 4 lanes per row, 16-byte
chunks stored evict-first -- on bench_multi.py's inputs (the same slot tables, accepted
counts and input sets), with what happens between the state's load and its K stores set by
a form, `MODE:ROWS:WARPS[:EXTRA]`:

  MODE   copy   the loaded chunks stored to the K slots as they are (the pattern itself)
         fp     the step's essential work only: per element fmaf(s, dA, dtx * b) and
                fmaf(s, c, acc), the state rounded once per store, y's sum over a row's
                lanes and y written; B, C and the per-(row, token) scalars staged in shared
                memory before the first store (no global load in the token loop)
  ROWS   head-dim rows per thread (1 or 2; the kernel's default is 2)
  WARPS  resident warps per SM asked for (set by the dynamic shared memory a block takes;
         the registers may allow fewer: the legend prints what was resident); "max": as
         many as the registers allow
  EXTRA  fp only: more FMAs per state element per token that change no value (64 warp
         instructions per token each, with ROWS = 2): the real kernel's overhead, dialled in

Per (shape, pool dtype, K, T): the op (plain launches) and each form as % of the floor:
the op and fp forms against the op's byte count (bench_multi.multi_bytes), copy forms
against the state's one read and K writes (as the K-copy column of
cuda_multi_pattern_ceiling.py). Before timing, each form is checked against the op on the
first cell of each pool dtype: the states it writes to the K slots and (fp) y (a mismatch
is printed, the timings still run; --no-check: skipped). Needs a CUDA device and nvcc (exit 2 without a device).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_multi import MultiInputs, multi_bytes, multi_input_sets, state_bytes  # noqa: E402
from torch_ssd import bench  # noqa: E402

DEFAULT_FORMS = ["copy:2:8", "copy:2:12", "copy:2:16", "copy:1:max", "fp:2:8:0", "fp:2:12:0", "fp:2:max:0",
                 "fp:2:12:1", "fp:2:12:2", "fp:1:16:0", "fp:1:max:0"]
# Shared memory per SM and per block reserved by the runtime, sm_90 (bytes).
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED = 1024


class Form:
    def __init__(self, text: str):
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ("copy", "fp"):
            raise argparse.ArgumentTypeError(f"expected MODE:ROWS:WARPS[:EXTRA], got {text!r}")
        self.text = text
        self.compute = parts[0] == "fp"
        self.rows = int(parts[1])
        self.warps = None if parts[2] == "max" else int(parts[2])
        self.extra = int(parts[3]) if len(parts) == 4 else 0
        if self.rows not in (1, 2) or (self.extra and not self.compute):
            raise argparse.ArgumentTypeError(f"{text!r}: ROWS 1 or 2; EXTRA with fp only")

    def smem(self, ext, K: int) -> int:
        """Dynamic shared memory per block: what the form needs, or more, to hold the
        residency at `warps` blocks per SM."""
        need = ext.needed_smem(K, self.rows, self.compute)
        if self.warps is None:
            return need
        return max(need, SMEM_PER_SM // self.warps - SMEM_RESERVED)


def build():
    from torch.utils.cpp_extension import load
    return load(name="ssd_store_model", sources=[str(HERE / "cuda_multi_store_model.cu")],
                extra_cuda_cflags=["-O3"], verbose=False)


def model_args(inp: MultiInputs):
    """The model's operands from one input set (views of the op's own tensors)."""
    src_dt = inp.dt[..., 0]  # (T, K, H): dt is per head, expanded along P
    return (inp.table, inp.accepted, inp.x, src_dt, inp.z, inp.B, inp.C, inp.A[:, 0, 0], inp.D[:, 0],
            inp.dt_bias[:, 0], inp.out)


def check(ext, inp: MultiInputs, form: Form, smem: int):
    """The form's written slots (and, fp, y) against the op's on the same starting pool."""
    start = inp.pool.clone()
    inp.multi()
    want_pool, want_y = inp.pool.clone(), inp.out.clone()
    inp.pool.copy_(start)
    inp.out.zero_()
    ext.launch(inp.pool, *model_args(inp), form.rows, form.compute, form.extra, smem)
    torch.cuda.synchronize()
    written = inp.table.flatten()
    if form.compute:
        tol = dict(rtol=1e-5, atol=1e-5) if inp.pool.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(inp.pool[written], want_pool[written], **tol)
        torch.testing.assert_close(inp.out.float(), want_y.float(), rtol=2e-2, atol=2e-2)
    else:
        src = inp.first_src
        expect = start[src].unsqueeze(1).expand(-1, inp.K, *start.shape[1:]).flatten(0, 1)
        torch.testing.assert_close(inp.pool[written], expect, rtol=0, atol=0)
    inp.pool.copy_(start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["80,64,128,1", "128,64,128,8"], help="H,P,N,G (N = 128)")
    ap.add_argument("--pool-dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--K", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--T", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--forms", nargs="+", type=Form, default=[Form(f) for f in DEFAULT_FORMS])
    ap.add_argument("--seconds", type=float, default=0.05, help="seconds of samples per timing")
    ap.add_argument("--no-check", action="store_true", help="skip the check of each form against the op")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("cuda_multi_store_model: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ext = build()
    timer = bench.Timer(device, args.seconds, min_samples=5, max_samples=100)
    copy_Bps = bench.copy_bandwidth(device, bench.copy_ceiling_bytes(device), timer)
    print(f"copy {copy_Bps / 1e9:.1f} GB/s | {torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(f"{'shape':>16} {'pool':>5} {'K':>2} {'T':>4} {'op':>6} " + " ".join(f"{f.text:>10}" for f in args.forms)
          + "   (% of the floor)", flush=True)
    cache = 2 * bench.last_level_cache_bytes(device)
    legend = {}
    for text in args.shapes:
        shape = bench.Shape.parse(text)
        for name in args.pool_dtypes:
            pool_dtype = bench.DTYPES[name]
            checked = args.no_check
            for K in args.K:
                for T in args.T:
                    sets = multi_input_sets(shape, T, K, pool_dtype, torch.bfloat16, device, cache)
                    n = len(sets)
                    warm = max(2, min(n, 8))
                    margs = [model_args(s) for s in sets]
                    op_floor_s = multi_bytes(shape, T, K, pool_dtype, torch.bfloat16) / copy_Bps
                    pattern_floor_s = state_bytes(shape, T, K, pool_dtype) / copy_Bps
                    if not checked:
                        failed = []
                        for form in args.forms:
                            try:
                                check(ext, sets[0], form, form.smem(ext, K))
                            except AssertionError as e:  # reported; the timings still come
                                failed.append(form.text)
                                print(f"check FAILED: {form.text} ({name}, K={K}, T={T}): {e}", flush=True)
                        print(f"check: {len(args.forms) - len(failed)} of {len(args.forms)} forms match the op "
                              f"({name}, K={K}, T={T})", flush=True)
                        checked = True
                    op_s = timer.time(lambda i: sets[i % n].multi(), warm)
                    cells = []
                    for form in args.forms:
                        smem = form.smem(ext, K)
                        blocks, regs, local = ext.occupancy(pool_dtype == torch.bfloat16, form.rows, form.compute, smem)
                        legend[(form.text, name, K)] = (blocks, regs, local, smem)
                        secs = timer.time(lambda i: ext.launch(sets[i % n].pool, *margs[i % n], form.rows,
                                                               form.compute, form.extra, smem), warm)
                        cells.append(100 * (op_floor_s if form.compute else pattern_floor_s) / secs)
                    print(f"{str(shape):>16} {name:>5} {K:>2} {T:>4} {100 * op_floor_s / op_s:>6.1f} "
                          + " ".join(f"{c:>10.1f}" for c in cells), flush=True)
                    del sets
    print("resident warps per SM / registers / local bytes / dynamic shared memory per block:")
    for (form, name, K), (blocks, regs, local, smem) in legend.items():
        print(f"  {form:>10} {name:>5} K={K}: {blocks} warps, {regs} registers, {local} B local, {smem} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
