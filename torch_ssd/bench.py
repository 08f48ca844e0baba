"""The main job: check torch.ops.ssd against the reference, then time the decode step.

    python -m torch_ssd [bench] [options]      (python -m torch_ssd --help)

1. Check: on the chosen device, at every benchmark shape and pool dtype, the five ops
   are compared with the float64 reference (torch_ssd.reference). A wrong op ends the
   run with exit status 1 before anything is timed.
2. Benchmark: for each shape, pool dtype and T, one decode step of a Mamba-2 layer as a
   serving engine runs it (bf16 x/z/dt/B/C, per-head float32 A/D/dt_bias expanded with
   stride 0, dt_softplus, in-place update of T slots drawn at random from a pool of 2T)
   is timed as: the op (plain calls), the op replayed in a CUDA graph (CUDA only), the
   eager reference and torch.compile(reference); the ceiling is a large copy on the same
   device measured in the same run (memcpy on CPU, device-to-device copy on a GPU), and
   an in-place update of the same size is printed beside it (on CPUs it runs well above
   the copy, whose destination is read before it is written).

Bytes per step = 2*T*H*P*N*sizeof(pool) + x, z, dt, B, C, y, the slot indices and the
per-head A, D, dt_bias. Timings rotate over enough independent input sets (each with its
own pool and slot draw) that the data touched exceeds the last-level cache several times,
so the numbers are DRAM numbers, not cache numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import torch_ssd
from torch_ssd import reference

PAD_SLOT_ID = -1

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
SHORT_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

MODEL_SHAPES = ["80,64,128,1", "128,64,128,8"]  # (H, P, N, G) of Mamba-2 2.7B-like / 8-group models
DEFAULT_T = {"cuda": [1, 16, 64, 256], "mps": [1, 16, 64, 256], "cpu": [1, 8, 32]}
QUICK_T = {"cuda": [1, 64], "mps": [1, 64], "cpu": [1, 8]}
CHECK_T = 6


# ---------------------------------------------------------------------------
# Shapes, inputs and byte counts
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    H: int
    P: int
    N: int
    G: int

    @staticmethod
    def parse(text: str) -> "Shape":
        parts = text.replace("x", ",").replace("(", "").replace(")", "").split(",")
        try:
            H, P, N, G = (int(p) for p in parts if p.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"a shape is H,P,N,G (four integers), got {text!r}")
        if min(H, P, N, G) <= 0 or H % G != 0:
            raise argparse.ArgumentTypeError(f"shape {text!r}: sizes must be positive and G must divide H")
        return Shape(H, P, N, G)

    def __str__(self) -> str:
        return f"({self.H},{self.P},{self.N},{self.G})"


def step_bytes(shape: Shape, T: int, pool_dtype: torch.dtype, input_dtype: torch.dtype,
               head_dtype: torch.dtype = torch.float32, index_dtype: torch.dtype = torch.int32) -> int:
    """DRAM bytes one decode step must move at the least."""
    H, P, N, G = shape.H, shape.P, shape.N, shape.G
    isz = input_dtype.itemsize
    state = 2 * T * H * P * N * pool_dtype.itemsize  # read and write each addressed slot
    tokens = 3 * T * H * P * isz  # x, z in; y out
    dt = T * H * isz
    bc = 2 * T * G * N * isz
    heads = 3 * H * head_dtype.itemsize  # A, D, dt_bias: stride 0 over P (and N)
    index = T * index_dtype.itemsize
    return state + tokens + dt + bc + heads + index


@dataclass
class StepInputs:
    """One decode step's operands, in the expanded (stride-0) form the op takes."""

    pool: torch.Tensor
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    z: torch.Tensor
    dt_bias: torch.Tensor
    slot_idx: torch.Tensor
    out: torch.Tensor

    def op_args(self):
        return (self.pool, self.x, self.dt, self.A, self.B, self.C, self.D, self.z, self.dt_bias, True,
                self.slot_idx, None, PAD_SLOT_ID)

    def nbytes(self) -> int:
        own = [self.pool, self.x, self.B, self.C, self.z, self.slot_idx, self.out]
        return sum(t.numel() * t.element_size() for t in own)


def make_inputs(shape: Shape, T: int, num_slots: int, pool_dtype: torch.dtype, input_dtype: torch.dtype,
                device: torch.device, gen: torch.Generator) -> StepInputs:
    """Random operands with Mamba-2-like ranges; slots: T distinct ones out of num_slots."""
    H, P, N, G = shape.H, shape.P, shape.N, shape.G

    def randn(*size, dtype=torch.float32, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    pool = randn(num_slots, H, P, N, dtype=pool_dtype, scale=0.5)
    A_head = -torch.empty(H).uniform_(1.0, 16.0, generator=gen)  # A = -exp(A_log), A_log ~ log U[1, 16]
    dt_target = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
    dt_bias_head = dt_target + torch.log(-torch.expm1(-dt_target))  # inverse softplus
    D_head = torch.ones(H) + 0.1 * torch.randn(H, generator=gen)
    slot_idx = torch.randperm(num_slots, generator=gen)[:T].to(device=device, dtype=torch.int32)
    x = randn(T, H, P, dtype=input_dtype)
    return StepInputs(
        pool=pool,
        x=x,
        dt=randn(T, H, dtype=input_dtype, scale=0.5).unsqueeze(-1).expand(T, H, P),
        A=A_head.to(device).view(H, 1, 1).expand(H, P, N),
        B=randn(T, G, N, dtype=input_dtype),
        C=randn(T, G, N, dtype=input_dtype),
        D=D_head.to(device).view(H, 1).expand(H, P),
        z=randn(T, H, P, dtype=input_dtype),
        dt_bias=dt_bias_head.to(device).view(H, 1).expand(H, P),
        slot_idx=slot_idx,
        out=torch.empty_like(x),
    )


# ---------------------------------------------------------------------------
# Check against the float64 reference
# ---------------------------------------------------------------------------

# Relative size of one unit in the last place at 1.0 (the rounding step of a dtype).
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float64: 2.0**-52}


class CheckFailed(Exception):
    pass


def _assert_close(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """got (rounded to `dtype`, computed in float32) against the float64 value `want`.

    Allowed: one rounding step of `dtype` plus the float32 arithmetic of the contract
    (a sum over N of products), relative to the largest magnitude present.
    """
    got64, want64 = got.double().cpu(), want.double().cpu()
    if got64.shape != want64.shape:
        raise CheckFailed(f"{what}: shape {tuple(got64.shape)}, expected {tuple(want64.shape)}")
    if not torch.isfinite(got64).all():
        raise CheckFailed(f"{what}: non-finite values")
    if want64.numel() == 0:
        return 0.0
    scale = want64.abs().max().item()
    tol = (ULP[dtype] + 1e-5) * want64.abs() + 1e-4 * scale + 1e-30
    err = (got64 - want64).abs()
    bad = err > tol
    if bad.any():
        idx = tuple(int(i) for i in (bad.nonzero()[0]))
        raise CheckFailed(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first at {idx}: got "
            f"{got64[idx].item():.6g}, expected {want64[idx].item():.6g} (tolerance {tol[idx].item():.3g})"
        )
    return (err / (want64.abs() + 1e-4 * scale + 1e-30)).max().item()


def _assert_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise CheckFailed(f"{what}: {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}")
    same = (got == want) | (torch.isnan(got) & torch.isnan(want)) if got.is_floating_point() else got == want
    if not same.all():
        idx = tuple(int(i) for i in (~same).nonzero()[0])
        raise CheckFailed(f"{what}: not bit-identical; first difference at {idx}: got {got[idx].item()!r}, "
                          f"expected {want[idx].item()!r}")


def check_shape_dtype(shape: Shape, pool_dtype: torch.dtype, input_dtype: torch.dtype, device: torch.device,
                      seed: int) -> float:
    """Check all five ops at one shape and pool dtype; returns the worst relative error seen."""
    gen = torch.Generator().manual_seed(seed)
    T = CHECK_T
    num_slots = 2 * T + 2
    inp = make_inputs(shape, T, num_slots, pool_dtype, input_dtype, device, gen)
    # Row 1 is a pad row; with checks off, row 3 names a slot past the pool (also a pad row).
    slots = inp.slot_idx.clone()
    slots[1] = PAD_SLOT_ID
    if not torch_ssd.checks_enabled():
        slots[3] = num_slots + 5
    pool0 = inp.pool.clone()
    tag = f"{shape} pool {SHORT_NAME[pool_dtype]}"
    worst = 0.0

    # decode_step, in place, with every optional operand.
    args = dict(D=inp.D, z=inp.z, dt_bias=inp.dt_bias, dt_softplus=True, slot_idx=slots,
                pad_slot_id=PAD_SLOT_ID)
    y_ref, pool_ref, state_ref = reference.decode_step(pool0, inp.x, inp.dt, inp.A, inp.B, inp.C,
                                                       compute_dtype=torch.float64, **args)
    pool = pool0.clone()
    y = torch.ops.ssd.decode_step(pool, inp.x, inp.dt, inp.A, inp.B, inp.C, inp.D, inp.z, inp.dt_bias, True,
                                  slots, None, PAD_SLOT_ID)
    worst = max(worst, _assert_close(f"decode_step y {tag}", y, y_ref, y.dtype))
    if y.dtype != inp.x.dtype:
        raise CheckFailed(f"decode_step y {tag}: dtype {y.dtype}, expected x's {inp.x.dtype}")
    _check_pool(f"decode_step pool {tag}", pool, pool_ref, slots)
    worst = max(worst, _check_written(f"decode_step state {tag}", pool, state_ref, slots, slots, pool_dtype))

    # decode_step_out, reading one set of slots and writing a disjoint one (rows run in
    # no fixed order: no row may write a slot another row reads), with a
    # positive dt given directly: no D / z / dt_bias / softplus.
    perm = torch.randperm(num_slots, generator=gen).to(device=device, dtype=torch.int32)
    src, dst = perm[:T], perm[T:2 * T]
    dt = torch.nn.functional.softplus(inp.dt.float() + inp.dt_bias.float()).to(inp.dt.dtype)
    y_ref, pool_ref, state_ref = reference.decode_step(pool0, inp.x, dt, inp.A, inp.B, inp.C,
                                                       slot_idx=src, dst_slot_idx=dst, pad_slot_id=PAD_SLOT_ID,
                                                       compute_dtype=torch.float64)
    pool = pool0.clone()
    out = torch.full_like(inp.x, float("nan"))
    torch.ops.ssd.decode_step_out(pool, inp.x, dt, inp.A, inp.B, inp.C, None, None, None, False, src, dst,
                                  PAD_SLOT_ID, out)
    worst = max(worst, _assert_close(f"decode_step_out y {tag}", out, y_ref, out.dtype))
    _check_pool(f"decode_step_out pool {tag}", pool, pool_ref, dst)
    worst = max(worst, _check_written(f"decode_step_out state {tag}", pool, state_ref, src, dst, pool_dtype))

    # Loader verbs: exact by contract.
    _assert_equal(f"load_state {tag}", torch.ops.ssd.load_state(pool0, slots, PAD_SLOT_ID),
                  reference.load_state(pool0, slots, PAD_SLOT_ID))
    for name, got, want in zip(("B", "C"), torch.ops.ssd.load_bc(inp.B, inp.C), reference.load_bc(inp.B, inp.C)):
        _assert_equal(f"load_bc {name} {tag}", got, want)
    state = torch.randn(T, shape.H, shape.P, shape.N, generator=gen).to(device)
    pool = pool0.clone()
    torch.ops.ssd.store_state(state, pool, slots, PAD_SLOT_ID)
    _assert_equal(f"store_state {tag}", pool, reference.store_state(state, pool0, slots, PAD_SLOT_ID))
    return worst


def _check_pool(what, pool, pool_ref, dst_slots):
    """Slots no row writes must be bit-for-bit what they were."""
    written = torch.zeros(pool.shape[0], dtype=torch.bool)
    d = dst_slots.cpu().long()
    ok = (d >= 0) & (d < pool.shape[0])
    written[d[ok]] = True
    _assert_equal(f"{what} (unwritten slots)", pool.cpu()[~written], pool_ref.cpu()[~written])


def _check_written(what, pool, state_ref, src_slots, dst_slots, pool_dtype) -> float:
    """Each written slot holds its row's state rounded once to the pool dtype
    (of rows sharing a destination, the last one writes)."""
    S = pool.shape[0]
    src, d = src_slots.cpu().tolist(), dst_slots.cpu().tolist()
    rows = [t for t in range(len(d)) if 0 <= src[t] < S and 0 <= d[t] < S and d[t] not in d[t + 1:]]
    if not rows:
        return 0.0
    got = pool.cpu()[torch.tensor([d[t] for t in rows])]
    want = state_ref.cpu()[rows]
    return _assert_close(what, got, want, pool_dtype)


def run_checks(shapes, pool_dtypes, input_dtype, device, progress) -> None:
    results = []
    for i, shape in enumerate(shapes):
        for j, pool_dtype in enumerate(pool_dtypes):
            progress.update(f"checking {shape} pool {SHORT_NAME[pool_dtype]} against the float64 reference")
            try:
                worst = check_shape_dtype(shape, pool_dtype, input_dtype, device, seed=1000 + 10 * i + j)
            except CheckFailed as e:
                progress.clear()
                raise CheckFailed(f"{e}") from None
            except (RuntimeError, NotImplementedError) as e:
                progress.clear()
                hint = ""
                if "backend" in str(e) and device.type != "cpu":
                    hint = (f" (this build of torch_ssd has no {device.type} kernels; "
                            f"`--device cpu` runs the CPU ones)")
                raise CheckFailed(f"{shape} pool {SHORT_NAME[pool_dtype]}: the op raised "
                                  f"{type(e).__name__}: {str(e).splitlines()[0]}{hint}") from None
            results.append(worst)
    progress.clear()
    print(f"check: all five ops match the float64 reference on {device} at {len(shapes)} shape(s) x "
          f"{len(pool_dtypes)} pool dtype(s) (worst relative error {max(results):.2g})")


# ---------------------------------------------------------------------------
# Timers
# ---------------------------------------------------------------------------


class Timer:
    """Median time per call of `fn(i)` (i cycles over input sets), on one device.

    Calls are timed in samples of `group` calls, with `group` chosen so that a sample
    lasts long enough for the clock; warm-up first; median over samples.
    """

    def __init__(self, device: torch.device, budget_s: float, min_samples: int, max_samples: int):
        self.device = device
        self.budget_s = budget_s
        self.min_samples = min_samples
        self.max_samples = max_samples
        self.sample_s = 2e-3 if device.type == "cpu" else 1e-3

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def _sample(self, fn, start: int, group: int) -> float:
        if self.device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            begin.record()
            for i in range(start, start + group):
                fn(i)
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) * 1e-3
        self.sync()
        t0 = time.perf_counter()
        for i in range(start, start + group):
            fn(i)
        self.sync()
        return time.perf_counter() - t0

    def time(self, fn, warmup_calls: int, budget_s: float | None = None, min_samples: int | None = None) -> float:
        budget = self.budget_s if budget_s is None else budget_s
        min_samples = self.min_samples if min_samples is None else min_samples
        t0 = time.perf_counter()
        for i in range(warmup_calls):
            fn(i)
        self.sync()
        warm_each = (time.perf_counter() - t0) / max(1, warmup_calls)
        # Estimate one call from a short sample, then size the groups.
        first = self._sample(fn, warmup_calls, 1)
        each = min(first, warm_each) if warmup_calls else first
        group = max(1, min(10_000, int(self.sample_s / max(each, 1e-9))))
        samples = []
        n = warmup_calls + 1
        started = time.perf_counter()
        while len(samples) < self.max_samples and (
            len(samples) < min_samples or time.perf_counter() - started < budget
        ):
            samples.append(self._sample(fn, n, group) / group)
            n += group
        return statistics.median(samples)


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer, budget_s: float = 1.0) -> float:
    """Bytes/s of a large same-device copy (read + write counted), median of repeats."""
    numel = nbytes // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    secs = timer.time(lambda i: dst.copy_(src), warmup_calls=2, budget_s=budget_s, min_samples=5)
    return 2 * nbytes / secs


def inplace_bandwidth(device: torch.device, nbytes: int, timer: Timer, budget_s: float = 1.0) -> float:
    """Bytes/s of a large in-place update (x.mul_(1.0): each byte read and written once, the
    decode step's own pattern when a row writes back to its slot), median of repeats. On
    CPUs it is well above copy_bandwidth: a copy's destination lines are read before they
    are written (write-allocate), an in-place update's are already there."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    secs = timer.time(lambda i: buf.mul_(1.0), warmup_calls=2, budget_s=budget_s, min_samples=5)
    return 2 * nbytes / secs


def write_bandwidth(device: torch.device, nbytes: int, timer: Timer, budget_s: float = 1.0) -> float:
    """Bytes/s of a large fill (x.fill_: each byte written once, none read), median of
    repeats: the ceiling of a step that mostly writes (the multi-token step's K states)."""
    buf = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    secs = timer.time(lambda i: buf.fill_(1.0), warmup_calls=2, budget_s=budget_s, min_samples=5)
    return nbytes / secs


def last_level_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
    if device.type == "cpu":
        best = 0
        base = "/sys/devices/system/cpu/cpu0/cache"
        try:
            for entry in os.listdir(base):
                if not entry.startswith("index"):
                    continue
                with open(os.path.join(base, entry, "size")) as f:
                    text = f.read().strip()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
                best = max(best, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            pass
        return best or (32 << 20)
    return 32 << 20


# ---------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------


@dataclass
class Row:
    shape: str
    T: int
    pool_dtype: str
    input_dtype: str
    bytes_per_step: int
    input_sets: int
    op_s: float | None = None
    graph_s: float | None = None
    ref_s: float | None = None
    compiled_s: float | None = None
    compile_error: str | None = None

    def gbps(self, secs):
        return None if secs is None else self.bytes_per_step / secs / 1e9


class Progress:
    """One status line on stderr: rewritten in place on a terminal, plain lines otherwise."""

    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.width = 0
        self.started = time.perf_counter()

    def update(self, msg: str):
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        line = f"[{self.done}/{self.total} {elapsed:5.0f}s] {msg}"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def step(self):
        self.done += 1

    def clear(self):
        if self.enabled and self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()
            self.width = 0


def _compile_reference():
    return torch.compile(reference.decode_step, dynamic=False)


def _ref_call(fn, inp: StepInputs):
    return fn(inp.pool, inp.x, inp.dt, inp.A, inp.B, inp.C, inp.D, inp.z, inp.dt_bias, True, inp.slot_idx, None,
              PAD_SLOT_ID)


def graph_time(step, n_sets: int, timer: Timer, device: torch.device, min_steps: int = 8, warmup: int = 3) -> float:
    """Capture max(n_sets, min_steps) calls step(0), step(1), ... in one CUDA graph (after
    `warmup` calls on a side stream); time replays; return seconds per call."""
    steps = max(n_sets, min_steps)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for j in range(warmup):
            step(j)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(steps):
            step(j)
    per_replay = timer.time(lambda i: graph.replay(), warmup_calls=3)
    return per_replay / steps


def step_time(sets, timer: Timer, warmup_calls: int) -> float:
    """Seconds per decode step, plain launches cycling over the input sets."""
    k = len(sets)
    return timer.time(lambda i: torch.ops.ssd.decode_step_out(*sets[i % k].op_args(), sets[i % k].out), warmup_calls)


def _graph_time(sets, timer: Timer, device: torch.device) -> float:
    """Seconds per decode step, several steps (cycling over the input sets) replayed in
    one CUDA graph."""
    def step(j):
        inp = sets[j % len(sets)]
        torch.ops.ssd.decode_step_out(*inp.op_args(), inp.out)

    return graph_time(step, len(sets), timer, device)


def rotating_sets(make, rotate_bytes: int, max_sets: int = 64) -> list:
    """Input sets from make() (each with an nbytes() method): the first, then as many more
    as together span at least rotate_bytes (max_sets at most), so that cycling over them
    defeats the cache."""
    probe = make()
    n_sets = max(1, min(max_sets, math.ceil(rotate_bytes / probe.nbytes())))
    return [probe] + [make() for _ in range(n_sets - 1)]


def make_input_sets(shape: Shape, T: int, pool_dtype, input_dtype, device, gen: torch.Generator,
                    rotate_bytes: int) -> list[StepInputs]:
    """Decode-step input sets (slots drawn from a pool of 2T) that together span at least
    rotate_bytes (rotating_sets)."""
    return rotating_sets(lambda: make_inputs(shape, T, 2 * T, pool_dtype, input_dtype, device, gen), rotate_bytes)


def copy_ceiling_bytes(device: torch.device) -> int:
    """Bytes of the same-run copy that sets the ceiling: large enough that the last-level
    cache does not help (1 GiB or 16 L2s on CUDA; 256 MB or 4 caches elsewhere)."""
    cache = last_level_cache_bytes(device)
    return max(1 << 30, 16 * cache) if device.type == "cuda" else max(256 << 20, 4 * cache)


def rotation_bytes(device: torch.device) -> int:
    """Bytes the rotating input sets span together: four last-level caches (at least 256 MB
    off CUDA)."""
    cache = last_level_cache_bytes(device)
    return 4 * cache if device.type == "cuda" else max(256 << 20, 4 * cache)


def add_sweep_args(ap: argparse.ArgumentParser, T: list[int], seconds: float) -> None:
    """The developer tools' sweep options (for input_set_sweep): --shapes, --pool-dtypes,
    --T (default T) and --seconds of samples per timing (default seconds)."""
    ap.add_argument("--shapes", nargs="+", default=MODEL_SHAPES)
    ap.add_argument("--pool-dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--T", nargs="+", type=int, default=T)
    ap.add_argument("--seconds", type=float, default=seconds)


def input_set_sweep(shapes, pool_dtype_names, Ts, device: torch.device, gen: torch.Generator,
                    input_dtype: torch.dtype = torch.bfloat16):
    """The developer tools' sweep: (shape, pool dtype name, pool dtype, T, input sets) for
    every case, the sets from make_input_sets over rotation_bytes(device). The sets are
    not kept here, so a caller that drops them frees them."""
    rotate_bytes = rotation_bytes(device)
    for text in shapes:
        shape = Shape.parse(text) if isinstance(text, str) else text
        for name in pool_dtype_names:
            pool_dtype = DTYPES[name]
            for T in Ts:
                yield shape, name, pool_dtype, T, make_input_sets(shape, T, pool_dtype, input_dtype, device, gen,
                                                                  rotate_bytes)


def bench_one(shape: Shape, T: int, pool_dtype, input_dtype, device, timer: Timer, cache_bytes: int,
              with_compile: bool, progress: Progress, seed: int) -> Row:
    gen = torch.Generator().manual_seed(seed)
    sets = make_input_sets(shape, T, pool_dtype, input_dtype, device, gen, cache_bytes)
    k = len(sets)
    row = Row(str(shape), T, SHORT_NAME[pool_dtype], SHORT_NAME[input_dtype],
              step_bytes(shape, T, pool_dtype, input_dtype), k)
    label = f"{shape} T={T} pool {SHORT_NAME[pool_dtype]}"
    warm = max(2, min(k, 16))

    progress.update(f"{label}: op")
    row.op_s = step_time(sets, timer, warm)

    if device.type == "cuda":
        progress.update(f"{label}: op in a CUDA graph")
        row.graph_s = _graph_time(sets, timer, device)

    progress.update(f"{label}: eager reference")
    # The reference is slow: a small time budget and a few samples are enough for a ratio.
    row.ref_s = timer.time(lambda i: _ref_call(reference.decode_step, sets[i % k]), warmup_calls=1,
                           budget_s=min(timer.budget_s, 0.5), min_samples=3)

    if with_compile:
        progress.update(f"{label}: compiling the reference")
        try:
            torch._dynamo.reset()  # one compile per configuration; no recompile limit reached across configs
            compiled = _compile_reference()
            _ref_call(compiled, sets[0])
            progress.update(f"{label}: torch.compile(reference)")
            row.compiled_s = timer.time(lambda i: _ref_call(compiled, sets[i % k]), warmup_calls=2,
                                        budget_s=min(timer.budget_s, 0.5), min_samples=3)
        except Exception as e:  # a compiler failure is reported, not fatal
            msg = str(e).strip().splitlines()
            row.compile_error = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
            progress.clear()
            print(f"torch.compile(reference) failed at {label}: {row.compile_error}", file=sys.stderr)
    return row


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _fmt(v, spec, width):
    return ("-" if v is None else format(v, spec)).rjust(width)


def print_tables(rows, copy_Bps: float, device: torch.device, out=None):
    out = sys.stdout if out is None else out  # the stdout of the call, not of the import
    copy_gbps = copy_Bps / 1e9
    graph = any(r.graph_s is not None for r in rows)
    for shape in dict.fromkeys(r.shape for r in rows):
        sub = [r for r in rows if r.shape == shape]
        print(f"\n(H,P,N,G) = {shape}   x/z/dt/B/C {sub[0].input_dtype}, A/D/dt_bias float32 per head, "
              f"dt_softplus, T slots drawn at random from a pool of 2T", file=out)
        head = f"{'pool':>4} {'T':>4} {'MB/step':>8} {'us/step':>9} {'GB/s':>7} {'%copy':>6}"
        if graph:
            head += f" | {'graph us':>9} {'GB/s':>7} {'%copy':>6}"
        head += f" | {'ref us':>9} {'x ref':>7} | {'compiled us':>11} {'x compiled':>10}"
        print(head, file=out)
        print("-" * len(head), file=out)
        for r in sub:
            op_gbps = r.gbps(r.op_s)
            line = (f"{r.pool_dtype:>4} {r.T:>4} {r.bytes_per_step / 1e6:8.2f} {_fmt(r.op_s and r.op_s * 1e6, '.1f', 9)}"
                    f" {_fmt(op_gbps, '.1f', 7)} {_fmt(op_gbps and 100 * op_gbps / copy_gbps, '.1f', 6)}")
            if graph:
                g = r.gbps(r.graph_s)
                line += (f" | {_fmt(r.graph_s and r.graph_s * 1e6, '.2f', 9)} {_fmt(g, '.1f', 7)}"
                         f" {_fmt(g and 100 * g / copy_gbps, '.1f', 6)}")
            line += (f" | {_fmt(r.ref_s and r.ref_s * 1e6, '.1f', 9)} "
                     f"{_fmt(r.ref_s and r.op_s and r.ref_s / r.op_s, '.1f', 7)}")
            comp = "failed" if r.compile_error else None
            line += (f" | {_fmt(r.compiled_s and r.compiled_s * 1e6, '.1f', 11)} "
                     f"{(comp or _fmt(r.compiled_s and r.op_s and r.compiled_s / r.op_s, '.1f', 10)).rjust(10)}")
            print(line, file=out)
    what = "memcpy" if device.type == "cpu" else "device-to-device copy"
    print(f"\nop: torch.ops.ssd.decode_step_out{', plain calls and replayed in a CUDA graph' if graph else ''}. "
          f"%copy: share of the {what} bandwidth measured in this run ({copy_gbps:.1f} GB/s). "
          f"x ref / x compiled: op speed-up over the eager reference / torch.compile(reference)"
          f"{' (plain calls)' if graph else ''}.", file=out)
    fastest = max((r.gbps(t) for r in rows for t in (r.op_s, r.graph_s) if t is not None), default=0.0)
    if fastest > copy_gbps:
        print("note: the op beat the copy ceiling. A copy also reads its destination before writing it "
              "(write-allocate, on CPUs), the op updates its rows in place: the in-place ceiling above is "
              "the stricter reference; a busy machine during the copies lowers the ceiling too.", file=out)


def plot(rows, copy_Bps: float, meta: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed; `pip install matplotlib` (or the extra "
              f"`pip install -e .[plot]`) and run again. The tables above are complete without it.", file=sys.stderr)
        return False
    shapes = list(dict.fromkeys(r.shape for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False, sharey=True)
    for ax, shape in zip(axes[0], shapes):
        # One colour per pool dtype, one line style per variant.
        for color, pool_dtype in zip(("tab:blue", "tab:red", "tab:green"), dict.fromkeys(r.pool_dtype for r in rows)):
            sub = sorted((r for r in rows if r.shape == shape and r.pool_dtype == pool_dtype), key=lambda r: r.T)
            for attr, name, style in (("op_s", "op", "-o"), ("graph_s", "op, CUDA graph", "--D"),
                                      ("compiled_s", "compile(ref)", ":s"), ("ref_s", "eager ref", ":x")):
                pts = [(r.T, r.gbps(getattr(r, attr))) for r in sub if getattr(r, attr) is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color,
                            label=f"{name}, {pool_dtype} pool")
        ax.axhline(copy_Bps / 1e9, color="gray", linestyle="--", linewidth=1, label="copy ceiling")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # the references sit orders of magnitude below the op
        ax.set_xlabel("T (rows per step)")
        ax.set_title(f"(H,P,N,G) = {shape}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("GB/s (log scale)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"torch_ssd decode_step on {meta['device_name']} (torch {meta['torch']}, {meta['date'][:10]})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
    return True


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def best_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple GPU (MPS), {platform.machine()}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, {torch.get_num_threads()} torch threads"


def build_parser(prog: str = "python -m torch_ssd") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Check torch.ops.ssd against the float64 reference, then benchmark the fused decode step "
                    "(op, CUDA-graph replay on CUDA, eager reference, torch.compile(reference), same-run copy "
                    "ceiling). Exit status 1 if an op disagrees with the reference.",
        epilog="Subcommands: `python -m torch_ssd bench [options]` (the default, this one) and "
               "`python -m torch_ssd demo [options]`.",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:N or mps (default: the best present: CUDA, then MPS, then CPU)")
    p.add_argument("--shapes", nargs="+", type=Shape.parse, metavar="H,P,N,G",
                   help=f"model shapes (default: {' '.join(MODEL_SHAPES)}; 24,64,128,1 is another real one)")
    p.add_argument("--T", nargs="+", type=int, metavar="T", dest="T",
                   help="rows per step (default: 1 16 64 256 on a GPU, 1 8 32 on the CPU)")
    p.add_argument("--pool-dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"],
                   help="state pool dtypes (default: fp32 bf16)")
    p.add_argument("--input-dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of x, z, dt, B, C (default: bf16)")
    p.add_argument("--quick", action="store_true", help="fewer T values and shorter timing (a smoke run)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    p.add_argument("--check-only", action="store_true", help="run the check against the reference, time nothing")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seconds", type=float, help="time budget per measurement (default 0.5, 0.15 with --quick)")
    p.add_argument("--plot", metavar="FILE.png", help="draw GB/s against T (needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="write the results and the run's metadata as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else best_device()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: torch here has no CUDA device", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        print("--device mps: MPS is not available here", file=sys.stderr)
        return 2
    kind = device.type if device.type in DEFAULT_T else "cuda"
    shapes = args.shapes or [Shape.parse(s) for s in MODEL_SHAPES]
    Ts = args.T or (QUICK_T if args.quick else DEFAULT_T)[kind]
    if any(t <= 0 for t in Ts):
        print("--T: every T must be positive", file=sys.stderr)
        return 2
    pool_dtypes = list(dict.fromkeys(DTYPES[d] for d in args.pool_dtypes))
    input_dtype = DTYPES[args.input_dtype]
    budget = args.seconds if args.seconds else (0.15 if args.quick else 0.5)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m torch_ssd " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_ssd": torch_ssd.__version__,
        "python": platform.python_version(),
        "host": platform.platform(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    print(f"torch_ssd {meta['torch_ssd']} | torch {meta['torch']}"
          f"{' | CUDA ' + meta['cuda'] if device.type == 'cuda' else ''} | {device}: {meta['device_name']}")
    busy = max(1.0, 0.5 * (os.cpu_count() or 1))
    if device.type == "cpu" and meta["load_average"] is not None and meta["load_average"] > busy:
        print(f"note: load average {meta['load_average']:.1f} at the start: other work on this machine "
              f"slows the timings down")

    n_configs = len(shapes) * len(Ts) * len(pool_dtypes)
    progress = Progress(total=0 if args.check_only else n_configs, enabled=not args.no_progress)
    try:
        run_checks(shapes, pool_dtypes, input_dtype, device, progress)
    except CheckFailed as e:
        progress.clear()
        print(f"\nCHECK FAILED on {device}: {e}\nThe op disagrees with the reference; nothing was timed.",
              file=sys.stderr)
        return 1
    if args.check_only:
        return 0

    timer = Timer(device, budget_s=budget, min_samples=5, max_samples=200)
    copy_bytes = copy_ceiling_bytes(device)
    rotate_bytes = rotation_bytes(device)
    progress.update(f"copy ceiling ({copy_bytes >> 20} MB copy)")
    copy_Bps = copy_bandwidth(device, copy_bytes, timer)

    rows = []
    seed = 0
    for shape in shapes:
        for pool_dtype in pool_dtypes:
            for T in Ts:
                seed += 1
                # The ceiling is sampled again before every configuration and the highest
                # value kept: on a shared machine a single measurement can catch a busy moment.
                progress.update(f"copy ceiling ({copy_bytes >> 20} MB copy)")
                copy_Bps = max(copy_Bps, copy_bandwidth(device, copy_bytes, timer, budget_s=0.2))
                rows.append(bench_one(shape, T, pool_dtype, input_dtype, device, timer, rotate_bytes,
                                      not args.no_compile, progress, seed))
                progress.step()
    # The ceiling again at the end; keep the highest (the stricter reference).
    progress.update("copy ceiling again")
    copy_Bps = max(copy_Bps, copy_bandwidth(device, copy_bytes, timer))
    progress.update("in-place ceiling")
    inplace_Bps = inplace_bandwidth(device, copy_bytes, timer)
    progress.clear()
    order = {str(s): i for i, s in enumerate(shapes)}
    rows.sort(key=lambda r: (order[r.shape], [SHORT_NAME[d] for d in pool_dtypes].index(r.pool_dtype), r.T))

    print(f"\ncopy ceiling: {copy_Bps / 1e9:.1f} GB/s ({copy_bytes >> 20} MB same-device copy, read + write; "
          f"the highest of {n_configs + 2} measurements spread over the run)")
    print(f"in-place ceiling: {inplace_Bps / 1e9:.1f} GB/s (the same bytes updated in place, read + write: "
          f"{inplace_Bps / copy_Bps:.2f}x the copy)")
    print_tables(rows, copy_Bps, device)

    if args.json:
        record = {"meta": meta, "copy_GBps": copy_Bps / 1e9, "inplace_GBps": inplace_Bps / 1e9,
                  "copy_bytes": copy_bytes,
                  "rows": [dict(asdict(r), op_GBps=r.gbps(r.op_s), graph_GBps=r.gbps(r.graph_s),
                                ref_GBps=r.gbps(r.ref_s), compiled_GBps=r.gbps(r.compiled_s)) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"results written to {args.json}")
    if args.plot:
        plot(rows, copy_Bps, meta, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
