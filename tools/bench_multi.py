"""Benchmark of the multi-token decode step (speculative decoding), on any device.

    python tools/bench_multi.py [--device cuda] [--K 2 4 8] [--T 16 64] [--pool-dtype bf16 fp32]

For each shape (H, P, N, G), pool dtype, K and T, one verification step as vLLM runs it
(per-token slots: a (T, K) table drawn at random from a pool of 2*T*K slots,
num_accepted_tokens drawn from [1, K], bf16 x/z/dt/B/C, per-head float32 A/D/dt_bias
expanded with stride 0, dt_softplus) is timed as:

  multi     torch.ops.ssd.decode_step_multi_out: K tokens in one call
  graph     the same replayed in a CUDA graph (CUDA only)
  singles   K calls of torch.ops.ssd.decode_step_out, token k reading token k-1's slot
  reference torch_ssd.reference_multi eagerly and under torch.compile (float32)

The floor is the op's own byte count over the device copy bandwidth measured in the same
run: bytes = one state read + one state write per written slot (T*H*P*N*(1 + K) pool
elements) + x, z, dt, B, C, y, the slot table and the per-head operands.
Target (DESIGN.md / issue 6): multi >= 90% of the floor on the H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch_ssd  # noqa: E402,F401  (registers torch.ops.ssd)
from torch_ssd import reference_multi  # noqa: E402
from torch_ssd.bench import (  # noqa: E402
    DTYPES, SHORT_NAME, Shape, Timer, copy_bandwidth, graph_time, inplace_bandwidth, last_level_cache_bytes,
    rotating_sets, write_bandwidth)

PAD = -1


class MultiInputs:
    """One verification step's tensors (a pool of its own, so input sets do not share state)."""

    def __init__(self, shape: Shape, T: int, K: int, pool_dtype, input_dtype, device, gen: torch.Generator):
        H, P, N, G = shape.H, shape.P, shape.N, shape.G
        S = 2 * T * K

        def randn(*size, dtype=input_dtype, scale=1.0):
            return (torch.randn(*size, generator=gen) * scale).to(dtype).to(device)

        self.pool = randn(S, H, P, N, dtype=pool_dtype)
        self.x = randn(T, K, H, P)
        self.z = randn(T, K, H, P)
        self.dt = (randn(T, K, H, scale=0.5) - 1.0).unsqueeze(-1).expand(T, K, H, P)
        self.B = randn(T, K, G, N)
        self.C = randn(T, K, G, N)
        self.A = (-torch.rand(H, generator=gen) - 0.5).to(device).view(H, 1, 1).expand(H, P, N)
        self.D = randn(H, dtype=torch.float32).unsqueeze(-1).expand(H, P)
        self.dt_bias = randn(H, dtype=torch.float32, scale=0.5).unsqueeze(-1).expand(H, P)
        self.table = torch.randperm(S, generator=gen)[: T * K].view(T, K).to(device)
        self.accepted = torch.randint(1, K + 1, (T,), generator=gen).to(device)
        self.out = torch.empty(T, K, H, P, dtype=input_dtype, device=device)
        # For the K single steps: token 0 reads the accepted token's slot, token k > 0
        # reads token k-1's slot; token k writes column k.
        self.first_src = self.table.gather(1, (self.accepted - 1).view(T, 1)).view(T)
        self.T, self.K = T, K

    def multi(self, write_state: bool = True):
        torch.ops.ssd.decode_step_multi_out(self.pool, self.x, self.dt, self.A, self.B, self.C, self.D, self.z,
                                            self.dt_bias, True, self.table, None, PAD, self.accepted, write_state,
                                            self.out)

    def singles(self):
        src = self.first_src
        for k in range(self.K):
            dst = self.table[:, k]
            torch.ops.ssd.decode_step_out(self.pool, self.x[:, k], self.dt[:, k], self.A, self.B[:, k],
                                          self.C[:, k], self.D, self.z[:, k], self.dt_bias, True, src, dst, PAD,
                                          self.out[:, k])
            src = dst

    def reference(self, fn):
        return fn(self.pool, self.x, self.dt, self.A, self.B, self.C, self.D, self.z, self.dt_bias, True,
                  self.table, None, PAD, self.accepted, True, compute_dtype=torch.float32)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pool, self.x, self.z, self.B, self.C, self.out))


def state_bytes(shape: Shape, T: int, K: int, pool_dtype, writes: bool = True) -> int:
    """The pool bytes of one verification step: one state read per row and (writes) one
    state write per token -- the whole of the step's access pattern."""
    ps = torch.tensor([], dtype=pool_dtype).element_size()
    return T * shape.H * shape.P * shape.N * ps * (1 + (K if writes else 0))


def multi_bytes(shape: Shape, T: int, K: int, pool_dtype, input_dtype, writes: bool = True) -> int:
    """Bytes the multi-token step must move: one state read per row, one state write per
    token (every token writes its own slot here; none with writes=False), the per-token
    inputs and y, the slot table and accepted counts, and the per-head operands."""
    H, P, N, G = shape.H, shape.P, shape.N, shape.G
    es = torch.tensor([], dtype=input_dtype).element_size()
    state = state_bytes(shape, T, K, pool_dtype, writes)
    per_token = T * K * (3 * H * P + H + 2 * G * N) * es  # x, z, y; dt per head; B, C
    indices = (T * K + T) * 8
    per_head = 3 * H * 4
    return state + per_token + indices + per_head


def multi_input_sets(shape: Shape, T: int, K: int, pool_dtype, input_dtype, device, cache_bytes: int,
                     seed: int | None = None) -> list[MultiInputs]:
    """Input sets of one (shape, T, K, pool dtype) cell that together span cache_bytes
    (rotating_sets, at most 32), drawn from the cell's seed (T * 131 + K unless given)."""
    gen = torch.Generator().manual_seed(T * 131 + K if seed is None else seed)
    return rotating_sets(lambda: MultiInputs(shape, T, K, pool_dtype, input_dtype, device, gen), cache_bytes,
                         max_sets=32)


def _graph_time(sets, timer: Timer, device) -> float:
    """Seconds per multi-token step, several steps (cycling over the input sets) in one graph."""
    return graph_time(lambda j: sets[j % len(sets)].multi(), len(sets), timer, device, min_steps=4, warmup=2)


class EnvSetting:
    """NAME=VALUE[,NAME=VALUE...]: environment variables set for one timing (a kernel knob
    the extension reads on every call), then restored."""

    def __init__(self, text: str):
        self.text = text
        self.pairs = []
        for item in text.split(","):
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise argparse.ArgumentTypeError(f"expected NAME=VALUE[,NAME=VALUE...], got {text!r}")
            self.pairs.append((name, value))

    def __enter__(self):
        self.saved = [(name, os.environ.get(name)) for name, _ in self.pairs]
        os.environ.update(dict(self.pairs))

    def __exit__(self, *exc):
        for name, value in self.saved:
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def bench_one(shape, T, K, pool_dtype, input_dtype, device, timer, cache_bytes, with_reference, with_compile,
              seed, ab=(), y_only=False):
    sets = multi_input_sets(shape, T, K, pool_dtype, input_dtype, device, cache_bytes, seed)
    n = len(sets)
    warm = max(2, min(n, 8))
    row = {"shape": str(shape), "T": T, "K": K, "pool": SHORT_NAME[pool_dtype], "inputs": SHORT_NAME[input_dtype],
           "bytes": multi_bytes(shape, T, K, pool_dtype, input_dtype), "input_sets": n}
    row["multi_s"] = timer.time(lambda i: sets[i % n].multi(), warm)
    if ab:
        # The default and each setting in turn, twice, on the same inputs: an A/B within one process.
        times = {"default": [row["multi_s"]]}
        for _ in range(2):
            for setting in ab:
                with setting:
                    times.setdefault(setting.text, []).append(timer.time(lambda i: sets[i % n].multi(), warm))
            times["default"].append(timer.time(lambda i: sets[i % n].multi(), warm))
        row["ab_s"] = {name: min(ts) for name, ts in times.items()}
    if y_only:
        row["y_only_s"] = timer.time(lambda i: sets[i % n].multi(write_state=False), warm)
        row["y_only_bytes"] = multi_bytes(shape, T, K, pool_dtype, input_dtype, writes=False)
    row["singles_s"] = timer.time(lambda i: sets[i % n].singles(), warm)
    if device.type == "cuda":
        row["graph_s"] = _graph_time(sets, timer, device)
    if with_reference:
        row["ref_s"] = timer.time(lambda i: sets[i % n].reference(reference_multi.decode_step_multi), 1,
                                  budget_s=min(timer.budget_s, 0.5), min_samples=3)
        if with_compile:
            try:
                torch._dynamo.reset()
                compiled = torch.compile(reference_multi.decode_step_multi, dynamic=False)
                sets[0].reference(compiled)
                row["compiled_s"] = timer.time(lambda i: sets[i % n].reference(compiled), 1,
                                               budget_s=min(timer.budget_s, 0.5), min_samples=3)
            except Exception as e:  # reported, not fatal
                row["compile_error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
    return row


def print_header(copy_Bps, inplace_Bps, out=None):
    out = sys.stdout if out is None else out  # the stdout of the call, not of the import
    print(f"copy bandwidth (same run): {copy_Bps / 1e9:.1f} GB/s", file=out)
    print(f"in-place bandwidth (same run): {inplace_Bps / 1e9:.1f} GB/s (%floor is against the copy; on a CPU "
          f"the copy also reads its destination, so the in-place figure is the stricter floor)", file=out)
    print(f"{'shape':>16} {'pool':>5} {'K':>2} {'T':>4} {'multi us':>10} {'GB/s':>7} {'%floor':>7} "
          f"{'graph us':>9} {'%floor':>7} {'K singles us':>13} {'speedup':>8} {'ref ms':>8} {'comp ms':>8} "
          f"{'ref/multi':>9}", file=out, flush=True)


def print_row(r, copy_Bps, out=None):
    """One row of the table, as soon as it is measured (a run cut short keeps its rows)."""
    out = sys.stdout if out is None else out
    floor_s = r["bytes"] / copy_Bps

    def us(key):
        return f"{r[key] * 1e6:.1f}" if key in r else "-"

    def pct(key):
        return f"{100 * floor_s / r[key]:.1f}" if key in r else "-"

    def ms(key):
        return f"{r[key] * 1e3:.2f}" if key in r else "-"

    ratio = f"{r['ref_s'] / r['multi_s']:.0f}x" if "ref_s" in r else "-"
    print(f"{r['shape']:>16} {r['pool']:>5} {r['K']:>2} {r['T']:>4} {us('multi_s'):>10} "
          f"{r['bytes'] / r['multi_s'] / 1e9:>7.1f} {pct('multi_s'):>7} {us('graph_s'):>9} {pct('graph_s'):>7} "
          f"{us('singles_s'):>13} {r['singles_s'] / r['multi_s']:>7.2f}x {ms('ref_s'):>8} {ms('compiled_s'):>8} "
          f"{ratio:>9}", file=out, flush=True)
    if "y_only_s" in r:
        t = r["y_only_s"]
        print(f"    y only (write_state=False): {t * 1e6:.1f} us, {100 * r['y_only_bytes'] / copy_Bps / t:.1f} % of "
              f"its floor (one state read, no writes), {100 * t / r['multi_s']:.0f} % of the multi time", file=out,
              flush=True)
    for name, t in r.get("ab_s", {}).items():
        print(f"    {name}: {t * 1e6:.1f} us, {100 * floor_s / t:.1f} % floor ({100 * (t / r['ab_s']['default'] - 1):+.1f} % "
              f"time against the default)", file=out, flush=True)
    if "compile_error" in r:
        print(f"    torch.compile(reference) failed: {r['compile_error']}", file=out, flush=True)


def main(argv=None) -> int:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=default_device)
    p.add_argument("--shapes", nargs="+", type=Shape.parse, default=None,
                   help="H,P,N,G (default: 80,64,128,1 and 128,64,128,8; on CPU 80,64,128,1)")
    p.add_argument("--K", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--T", nargs="+", type=int, default=None, help="default: 16 64 (CPU: 4 16)")
    p.add_argument("--pool-dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--input-dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--budget", type=float, default=1.0, help="seconds of samples per timing")
    p.add_argument("--no-reference", action="store_true", help="skip timing the reference")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--ab", nargs="+", type=EnvSetting, default=[], metavar="NAME=VALUE[,...]",
                   help="also time the multi-token op with each of these environment settings (the CUDA kernels' "
                        "tuning knobs, e.g. TORCH_SSD_CUDA_MULTI_ORDER=1), alternating with the default on the same "
                        "inputs; each row then lists the best of each")
    p.add_argument("--y-only", action="store_true",
                   help="also time the op with write_state=False (y only: the state read, none written) and "
                        "measure the device's write-only (fill) bandwidth: how much of the step its K writes cost")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    shapes = args.shapes or [Shape.parse("80,64,128,1")] + ([] if on_cpu else [Shape.parse("128,64,128,8")])
    Ts = args.T or ([4, 16] if on_cpu else [16, 64])
    timer = Timer(device, args.budget, min_samples=5, max_samples=200)
    ceiling_bytes = (256 << 20) if on_cpu else (1 << 30)  # the same bytes as earlier sessions' tables
    copy_Bps = copy_bandwidth(device, ceiling_bytes, timer)
    inplace_Bps = inplace_bandwidth(device, ceiling_bytes, timer)
    if args.y_only:
        fill_Bps = write_bandwidth(device, ceiling_bytes, timer)
        print(f"write-only (fill) bandwidth (same run): {fill_Bps / 1e9:.1f} GB/s", flush=True)
    cache = 2 * last_level_cache_bytes(device)
    rows = []
    print_header(copy_Bps, inplace_Bps)
    for shape in shapes:
        for pool_name in args.pool_dtype:
            for K in args.K:
                for T in Ts:
                    rows.append(bench_one(shape, T, K, DTYPES[pool_name], DTYPES[args.input_dtype], device, timer,
                                          cache, not args.no_reference, not args.no_compile, seed=T * 131 + K,
                                          ab=args.ab, y_only=args.y_only))
                    print_row(rows[-1], copy_Bps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "copy_Bps": copy_Bps, "inplace_Bps": inplace_Bps, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
