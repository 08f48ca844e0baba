#!/usr/bin/env python
"""Replay a deterministic fuzz corpus of torch.ops.ssd calls on one device.

Each case is drawn from a seeded generator: random (T, H, P, N, G) with H % G == 0,
random pool and operand dtypes, random strides, storage offsets and stride-0
broadcasts, and slot tensors with duplicates, pads and out-of-range values; some
cases turn checked mode on, and some corrupt one argument on purpose. Every case
is checked against the float64 reference (torch_ssd.reference):

* the result equals the reference within a float32 error bound,
* pool rows the call does not address, and every byte around the tensors'
  views, are bit-for-bit unchanged,
* the same call on contiguous copies gives bit-identical results,
* refused calls raise a RuntimeError that names the bad argument and leave the
  pool alone.

    python tools/replay_fuzz_corpus.py --device cuda --cases 200
    compute-sanitizer --tool memcheck python tools/replay_fuzz_corpus.py --device cuda

Exit status 0 when every case passes, 1 otherwise (each failure is printed with
the case, so `--first K --cases 1` replays it alone). tests/test_fuzz.py draws
cases through the same code with hypothesis instead of a seeded generator.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import sys
from pathlib import Path
from typing import Protocol, Sequence

import torch
from torch import Tensor

try:
    import torch_ssd
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch_ssd
from torch_ssd import _C, reference

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
OPS = ("decode_step", "decode_step_out", "load_state", "store_state", "load_bc")
SPECIAL_N = (1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256)
SPECIAL_P = (1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 127, 128)
U32 = 2.0**-24  # float32 unit roundoff


# ---------------------------------------------------------------------------
# Choosers: the one interface the case generator draws from, so the same code
# serves a seeded corpus (random.Random) and hypothesis (tests/test_fuzz.py).
# Every choice shrinks toward its first / smallest option.
# ---------------------------------------------------------------------------


class Chooser(Protocol):
    def integer(self, lo: int, hi: int) -> int: ...
    def choice(self, options: Sequence): ...
    def rare(self, probability: float) -> bool: ...


class RandomChooser:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence):
        return options[self.rng.randrange(len(options))]

    def rare(self, probability: float) -> bool:
        return self.rng.random() < probability


# ---------------------------------------------------------------------------
# Layouts: every operand lives in a flat buffer, viewed with as_strided.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    order: tuple[int, ...]  # dims from outermost to innermost in memory
    steps: tuple[int, ...]  # gap factor per dim (1 = packed)
    offset: int = 0  # storage offset of element 0
    bcast: tuple[int, ...] = ()  # dims with stride 0
    tail: int = 0  # spare elements after the view

    @staticmethod
    def contiguous(ndim: int) -> "Layout":
        return Layout(tuple(range(ndim)), (1,) * ndim)

    def strides(self, shape: Sequence[int]) -> list[int]:
        strides = [0] * len(shape)
        running = 1
        for d in reversed(self.order):
            if d in self.bcast:
                continue
            strides[d] = running * self.steps[d]
            running = strides[d] * max(shape[d], 1)
        return strides

    def describe(self) -> str:
        parts = []
        if self.order != tuple(sorted(self.order)):
            parts.append(f"order={self.order}")
        if any(s != 1 for s in self.steps):
            parts.append(f"steps={self.steps}")
        if self.offset:
            parts.append(f"offset={self.offset}")
        if self.bcast:
            parts.append(f"bcast={self.bcast}")
        return "L(" + ", ".join(parts) + ")" if parts else "contig"


def draw_layout(ch: Chooser, ndim: int, broadcast_ok: bool) -> Layout:
    kinds = ("contiguous", "offset", "permuted", "strided") + (("broadcast",) if broadcast_ok else ())
    kind = ch.choice(kinds)
    if kind == "contiguous":
        return Layout.contiguous(ndim)
    order = list(range(ndim))
    if kind in ("permuted", "strided", "broadcast") and ndim > 1:
        for i in range(ndim - 1, 0, -1):  # Fisher-Yates through the chooser
            j = ch.integer(0, i)
            order[i], order[j] = order[j], order[i]
    steps = tuple(ch.integer(1, 3) if kind in ("strided", "broadcast") else 1 for _ in range(ndim))
    bcast: tuple[int, ...] = ()
    if kind == "broadcast":
        bcast = tuple(d for d in range(ndim) if ch.rare(0.5)) or (ndim - 1,)
    return Layout(tuple(order), steps, ch.integer(0, 5), bcast, ch.integer(0, 3))


def bits(t: Tensor) -> Tensor:
    """The raw bits of a tensor, so NaN == NaN and -0 != +0."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


@dataclasses.dataclass
class Placed:
    """A view into a flat buffer plus what is needed to see what the op touched."""

    view: Tensor
    buf: Tensor
    layout: Layout
    before: Tensor  # CPU copy of buf before the call

    def positions(self) -> Tensor:
        """Index in buf of each element of the view (CPU, int64)."""
        flat = torch.arange(self.buf.numel())
        return flat.as_strided(self.view.shape, self.view.stride(), self.view.storage_offset())

    def changed(self) -> Tensor:
        """Mask over buf: elements whose bits differ from before the call."""
        return bits(self.buf.cpu()) != bits(self.before)


def place(values: Tensor, layout: Layout, device: torch.device | str, fill: float | int) -> Placed:
    """Copy `values` (CPU, contiguous, constant along layout.bcast) into a fresh
    buffer filled with `fill` and return the strided view of it."""
    shape = list(values.shape)
    strides = layout.strides(shape)
    if all(shape):
        extent = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
    else:
        extent = 0
    size = max(1, layout.offset + extent + layout.tail)
    buf = torch.full((size,), fill, dtype=values.dtype)
    lead = tuple(slice(0, 1) if d in layout.bcast else slice(None) for d in range(len(shape)))
    small = values[lead]
    buf.as_strided(small.shape, strides, layout.offset).copy_(small)
    before = buf.clone()
    buf = buf.to(device)
    return Placed(buf.as_strided(shape, strides, layout.offset), buf, layout, before)


# ---------------------------------------------------------------------------
# Cases.
# ---------------------------------------------------------------------------

# (shape letters, value range) per operand; dt and dt_bias ranges depend on softplus.
OPERANDS = {
    "ssm_pool": ("SHPN", (-2.0, 2.0)),
    "x": ("THP", (-2.0, 2.0)),
    "dt": ("THP", None),
    "A": ("HPN", (-3.0, 0.5)),
    "B": ("TGN", (-2.0, 2.0)),
    "C": ("TGN", (-2.0, 2.0)),
    "D": ("HP", (-2.0, 2.0)),
    "z": ("THP", (-4.0, 4.0)),
    "dt_bias": ("HP", None),
    "out": ("THP", None),
    "state": ("THPN", (-4.0, 4.0)),
}
DT_RANGE = {True: (-4.0, 1.5), False: (0.0, 1.5)}
DT_BIAS_RANGE = {True: (-1.0, 0.5), False: (-0.25, 0.5)}
OPERANDS_OF = {
    "decode_step": ("ssm_pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias"),
    "decode_step_out": ("ssm_pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "out"),
    "load_state": ("ssm_pool",),
    "store_state": ("state", "ssm_pool"),
    "load_bc": ("B", "C"),
}
WRITTEN = ("ssm_pool", "out")  # operands an op may write; never broadcast


@dataclasses.dataclass
class Case:
    op: str
    S: int
    T: int
    H: int
    P: int
    N: int
    G: int
    dtypes: dict[str, torch.dtype]
    layouts: dict[str, Layout]
    present: tuple[str, ...]  # operands passed (optional ones may be None)
    slot_idx: list[int] | None
    dst_slot_idx: list[int] | None
    index_dtypes: tuple[torch.dtype, torch.dtype]
    index_layouts: tuple[Layout, Layout]
    pad_slot_id: int
    dt_softplus: bool
    checked: bool
    seed: int
    corrupt: tuple[str, str, int] | None = None  # (argument, how, dim): a call that must be refused

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(getattr(self, letter) for letter in OPERANDS[name][0])

    def describe(self) -> str:
        dims = f"S={self.S} T={self.T} H={self.H} P={self.P} N={self.N} G={self.G}"
        ops = ", ".join(
            f"{n}:{str(self.dtypes[n]).replace('torch.', '')}/{self.layouts[n].describe()}" for n in self.present
        )
        slots = f"slot_idx={self.slot_idx} dst_slot_idx={self.dst_slot_idx} pad={self.pad_slot_id}"
        idx = "/".join(str(d).replace("torch.", "") for d in self.index_dtypes)
        flags = f"softplus={self.dt_softplus} checked={self.checked} seed={self.seed} corrupt={self.corrupt}"
        return f"{self.op} {dims} [{ops}] {slots} ({idx}) {flags}"


def _out_of_range(ch: Chooser, S: int, index_dtype: torch.dtype) -> int:
    options = [S, S + 1, -2, S + 100, -100, 2**31 - 1, -(2**31)]
    if index_dtype == torch.int64:
        options += [2**40, -(2**40)]
    return ch.choice(options)


def _draw_slots(ch: Chooser, kind: str, T: int, S: int, pad: int, index_dtype: torch.dtype,
                avoid: Sequence[int] = ()) -> list[int]:
    if kind == "distinct":  # a random injection of rows into slots
        free = list(range(S))
        out = []
        for _ in range(T):
            out.append(free.pop(ch.integer(0, len(free) - 1)) if free else pad)
        return out
    if kind == "dups":
        return [ch.integer(0, S - 1) for _ in range(T)]
    if kind == "disjoint":  # destinations no row reads from
        free = [s for s in range(S) if s not in set(avoid)]
        out = []
        for _ in range(T):
            out.append(free.pop(ch.integer(0, len(free) - 1)) if free and not ch.rare(0.2) else pad)
        return out
    if kind == "disjoint_dups":
        free = [s for s in range(S) if s not in set(avoid)]
        return [ch.choice(free) if free and not ch.rare(0.2) else pad for _ in range(T)]
    if kind == "all_pad":
        return [pad] * T
    # "mixed": in-range slots, pads and out-of-range values
    out = []
    for _ in range(T):
        pick = ch.choice(("slot", "pad", "out_of_range"))
        if pick == "slot":
            out.append(ch.integer(0, S - 1))
        elif pick == "pad":
            out.append(pad)
        else:
            out.append(_out_of_range(ch, S, index_dtype))
    return out


def draw_case(ch: Chooser, max_elems: int = 1 << 14, ops: Sequence[str] = OPS,
              checked_rate: float = 0.15, corrupt_rate: float = 0.1) -> Case:
    """Draw one case; T*H*P*N (and S*H*P*N) stay within about max_elems."""
    op = ch.choice(tuple(ops))
    # "small" keeps P and N low so that T and H vary; "wide" spans the full P, N range
    wide = ch.choice(("small", "wide")) == "wide"
    n_max, p_max = (256, 128) if wide else (48, 16)
    N = ch.choice(SPECIAL_N) if ch.rare(0.5) else ch.integer(1, n_max)
    N = min(N, n_max, max_elems)
    p_cap = max(1, min(p_max, max_elems // N))
    P = min(ch.choice(SPECIAL_P), p_cap) if ch.rare(0.5) else ch.integer(1, p_cap)
    H = ch.integer(1, max(1, min(8, max_elems // (P * N))))
    divisors = [g for g in range(1, H + 1) if H % g == 0]
    G = ch.choice(divisors)
    t_cap = max(1, min(16 if wide else 24, max_elems // (H * P * N)))
    T = ch.integer(0, t_cap) if ch.rare(0.1) else ch.integer(1, t_cap)

    has_slots = op != "load_bc"
    src_kind = ch.choice(("none", "distinct", "dups", "mixed", "all_pad")) if has_slots else "none"
    s_cap = max(1, 2 * t_cap + 2)
    if src_kind in ("none", "distinct"):
        S = max(1, T + ch.integer(0, 3))
    else:
        S = ch.integer(1, max(1, s_cap))
    if op == "load_state" and src_kind == "none":
        T = S  # without slot_idx load_state reads every slot

    pad = ch.choice((-1, S, -3, 0, 2**31 - 1))
    index_dtypes = (ch.choice(INDEX_DTYPES), ch.choice(INDEX_DTYPES))
    index_layouts = tuple(draw_layout(ch, 1, broadcast_ok=True) for _ in range(2))
    slot_idx = None if src_kind == "none" else _draw_slots(ch, src_kind, T, S, pad, index_dtypes[0])
    dst_slot_idx = None
    if op in ("decode_step", "decode_step_out"):
        dst_kind = ch.choice(("none", "same", "disjoint", "disjoint_dups", "wild"))
        reads = list(range(T)) if slot_idx is None else slot_idx
        if dst_kind == "same":
            dst_slot_idx = list(reads)
        elif dst_kind in ("disjoint", "disjoint_dups"):
            dst_slot_idx = _draw_slots(ch, dst_kind, T, S, pad, index_dtypes[1], avoid=reads)
        elif dst_kind == "wild":
            dst_slot_idx = _draw_slots(ch, ch.choice(("dups", "mixed")), T, S, pad, index_dtypes[1])

    if dst_slot_idx is not None and any(not -(2**31) <= v < 2**31 for v in dst_slot_idx):
        index_dtypes = (index_dtypes[0], torch.int64)  # "same" may copy int64-only values

    softplus = ch.rare(0.5)
    present = []
    for name in OPERANDS_OF[op]:
        if name in ("D", "z", "dt_bias") and ch.rare(0.3):
            continue
        present.append(name)
    dtypes = {}
    layouts = {}
    for name in present:
        shape_len = len(OPERANDS[name][0])
        dtypes[name] = torch.float32 if name == "state" else ch.choice(FLOAT_DTYPES)
        layouts[name] = draw_layout(ch, shape_len, broadcast_ok=name not in WRITTEN)
    if "out" in present:
        dtypes["out"] = dtypes["x"]

    case = Case(op, S, T, H, P, N, G, dtypes, layouts, tuple(present), slot_idx, dst_slot_idx,
                index_dtypes, index_layouts, pad, softplus, ch.rare(checked_rate), ch.integer(0, 2**31 - 1))
    if ch.rare(corrupt_rate):
        case.corrupt = ch.choice(corruptions(case))
    return case


def corruptions(case: Case) -> list[tuple[str, str, int]]:
    """Ways to break one argument so that its own check (not a later one) fires."""
    out: list[tuple[str, str, int]] = []
    for name in case.present:
        ndim = len(OPERANDS[name][0])
        out += [(name, "rank", 0), (name, "dtype", 0)]
        if name == "ssm_pool":
            continue  # the pool defines S, H, P, N and the device: anything else is blamed on others
        if not (name == "B" and case.op == "load_bc"):  # in load_bc, B defines the device
            out.append((name, "device", 0))
        if name == "x":
            dims = (1, 2)  # x defines T
        elif name == "B" and case.op != "load_bc":
            dims = (0, 2)  # B defines G
        elif name == "B":
            dims = ()  # in load_bc, B defines T, G and N
        elif name == "state":
            dims = (1, 2, 3)  # state defines T
        else:
            dims = tuple(range(ndim))
        out += [(name, "shape", d) for d in dims]
    if case.slot_idx is not None:
        out += [("slot_idx", "dtype", 0), ("slot_idx", "rank", 0), ("slot_idx", "device", 0)]
        if case.op != "load_state":  # load_state's T comes from slot_idx
            out.append(("slot_idx", "shape", 0))
    if case.dst_slot_idx is not None:
        out += [("dst_slot_idx", "dtype", 0), ("dst_slot_idx", "rank", 0), ("dst_slot_idx", "shape", 0),
                ("dst_slot_idx", "device", 0)]
    if case.op in ("decode_step", "decode_step_out") and case.H > 1:
        out.append(("B", "groups", 0))
    return out


# ---------------------------------------------------------------------------
# Building the tensors.
# ---------------------------------------------------------------------------


def _values(case: Case, name: str, gen: torch.Generator) -> Tensor:
    shape = case.shape(name)
    layout = case.layouts[name]
    lo_hi = OPERANDS[name][1]
    if name == "dt":
        lo_hi = DT_RANGE[case.dt_softplus]
    elif name == "dt_bias":
        lo_hi = DT_BIAS_RANGE[case.dt_softplus]
    small_shape = [1 if d in layout.bcast else s for d, s in enumerate(shape)]
    if name == "out":
        return torch.full(shape, float("nan"), dtype=case.dtypes[name])
    lo, hi = lo_hi
    v = torch.rand(small_shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo
    if name == "state":  # put some values exactly halfway between bf16 / fp16 neighbours
        raw = v.view(torch.int32)
        ties = torch.rand(small_shape, generator=gen) < 0.25
        bf16_tie = (raw & ~0xFFFF) | 0x8000
        fp16_tie = (raw & ~0x1FFF) | 0x1000
        raw = torch.where(ties, torch.where(torch.rand(small_shape, generator=gen) < 0.5, bf16_tie, fp16_tie), raw)
        v = raw.view(torch.float32)
    return v.to(case.dtypes[name]).expand(shape).contiguous()


@dataclasses.dataclass
class Built:
    placed: dict[str, Placed]
    slots: dict[str, Placed]  # "slot_idx", "dst_slot_idx" when present
    device: torch.device

    def arg(self, name: str) -> Tensor | None:
        if name in self.placed:
            return self.placed[name].view
        if name in self.slots:
            return self.slots[name].view
        return None


def build(case: Case, device: torch.device | str) -> Built:
    gen = torch.Generator().manual_seed(case.seed)
    placed = {}
    for name in case.present:
        placed[name] = place(_values(case, name, gen), case.layouts[name], device, float("nan"))
    slots = {}
    for i, (key, values) in enumerate((("slot_idx", case.slot_idx), ("dst_slot_idx", case.dst_slot_idx))):
        if values is None:
            continue
        layout = case.index_layouts[i]
        if len(set(values)) > 1:  # a stride-0 index tensor can only hold one slot
            layout = dataclasses.replace(layout, bcast=())
        # the guard holds slot 0: reading outside the view would address a real row
        slots[key] = place(torch.tensor(values, dtype=case.index_dtypes[i]), layout, device, 0)
    return Built(placed, slots, torch.device(device))


def contiguous_twin(built: Built, snapshot: dict[str, Tensor]) -> Built:
    """The values `built` held before the call (`snapshot`) in fresh contiguous
    tensors: the baseline of the layout property."""
    def twin(name: str) -> Placed:
        values = snapshot[name].contiguous()
        return place(values, Layout.contiguous(values.dim()), built.device, 0)
    return Built({k: twin(k) for k in built.placed}, {k: twin(k) for k in built.slots}, built.device)


def _corrupted(case: Case, built: Built) -> tuple[dict[str, Tensor | None], str]:
    """Arguments with case.corrupt applied; returns them and the name the error must carry."""
    args = {name: built.arg(name) for name in list(OPERANDS) + ["slot_idx", "dst_slot_idx"]}
    name, how, dim = case.corrupt
    t = args[name]
    expect = name
    if how == "rank":
        t = t.unsqueeze(0)
    elif how == "dtype":
        t = t.to(torch.float32 if name in ("slot_idx", "dst_slot_idx") else
                 (torch.float16 if name == "state" else torch.float64))
        if name == "out" and t.dtype == args["x"].dtype:
            t = t.to(torch.float64)
    elif how == "shape":
        size = list(t.shape)
        size[dim] += 1
        t = torch.zeros(size, dtype=t.dtype, device=t.device)
    elif how == "device":  # on an accelerator: a CPU tensor; on the CPU: a meta tensor (see check_case)
        t = t.cpu() if t.device.type != "cpu" else t.to("meta")
    elif how == "groups":  # G that does not divide H
        G = next(g for g in range(2, 2 * case.H + 1) if case.H % g)
        t = torch.zeros(case.T, G, case.N, dtype=t.dtype, device=t.device)
    args[name] = t
    return args, expect


# ---------------------------------------------------------------------------
# Running and checking.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def checked_mode(enabled: bool):
    previous = torch_ssd.checks_enabled()
    torch_ssd.set_checks(enabled)
    try:
        yield
    finally:
        torch_ssd.set_checks(previous)


def call(case: Case, args: dict[str, Tensor | None]) -> Tensor | tuple[Tensor, Tensor] | None:
    g = args.get
    if case.op == "decode_step":
        return torch.ops.ssd.decode_step(g("ssm_pool"), g("x"), g("dt"), g("A"), g("B"), g("C"), g("D"), g("z"),
                                         g("dt_bias"), case.dt_softplus, g("slot_idx"), g("dst_slot_idx"),
                                         case.pad_slot_id)
    if case.op == "decode_step_out":
        torch.ops.ssd.decode_step_out(g("ssm_pool"), g("x"), g("dt"), g("A"), g("B"), g("C"), g("D"), g("z"),
                                      g("dt_bias"), case.dt_softplus, g("slot_idx"), g("dst_slot_idx"),
                                      case.pad_slot_id, g("out"))
        return g("out")
    if case.op == "load_state":
        return torch.ops.ssd.load_state(g("ssm_pool"), g("slot_idx"), case.pad_slot_id)
    if case.op == "store_state":
        torch.ops.ssd.store_state(g("state"), g("ssm_pool"), g("slot_idx"), case.pad_slot_id)
        return None
    if case.op == "load_bc":
        return torch.ops.ssd.load_bc(g("B"), g("C"))
    raise ValueError(case.op)


def call_checks(case: Case, args: dict[str, Tensor | None]) -> None:
    """Only the shared argument checks of case.op (torch_ssd._C.check_*), which is
    how a device mismatch is exercised on a machine whose only device is the CPU
    (a CPU + meta mix would dispatch to the fake kernel, not to the checks)."""
    g = args.get
    if case.op in ("decode_step", "decode_step_out"):
        _C.check_decode_step(case.op, g("ssm_pool"), g("x"), g("dt"), g("A"), g("B"), g("C"), g("D"), g("z"),
                             g("dt_bias"), g("slot_idx"), g("dst_slot_idx"), case.pad_slot_id,
                             g("out") if case.op == "decode_step_out" else None)
    elif case.op == "load_state":
        _C.check_load_state(g("ssm_pool"), g("slot_idx"), case.pad_slot_id)
    elif case.op == "store_state":
        _C.check_store_state(g("state"), g("ssm_pool"), g("slot_idx"), case.pad_slot_id)
    else:
        _C.check_load_bc(g("B"), g("C"))


def _addressable(slot: int, S: int, pad: int) -> bool:
    return slot != pad and 0 <= slot < S


@dataclasses.dataclass
class WritePlan:
    """Which rows read, which write where, and which results the contract defines.

    A slot that one row writes and another row reads (a read/write hazard) is
    unspecified: that reader's y, and whatever the writers whose source is such a
    slot store, are left out of the comparison."""

    reads: list[bool]
    writer: dict[int, int]  # slot -> the row that writes it (the last row naming it)
    y_defined: list[bool]
    slot_defined: dict[int, bool]


def write_plan(case: Case) -> WritePlan:
    T, S, pad = case.T, case.S, case.pad_slot_id
    src = list(range(T)) if case.slot_idx is None else case.slot_idx
    if case.op == "store_state":
        dst, reads = src, [True] * T
    else:
        dst = src if case.dst_slot_idx is None else case.dst_slot_idx
        reads = [_addressable(s, S, pad) for s in src]
    writer = {}
    for t in range(T):
        if reads[t] and _addressable(dst[t], S, pad):
            writer[dst[t]] = t
    if case.op == "store_state":
        return WritePlan(reads, writer, [True] * T, {k: True for k in writer})
    y_defined = [not reads[t] or writer.get(src[t], t) == t for t in range(T)]
    return WritePlan(reads, writer, y_defined, {k: y_defined[w] for k, w in writer.items()})


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def subnormal_step(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def step_tolerances(case: Case, args: dict[str, Tensor | None], old: Tensor, y64: Tensor, state64: Tensor):
    """Float32 error bounds for y (T, H, P) and the stored state (T, H, P, N).

    The kernel computes in float32; the reference in float64. The bound follows
    the operations: dt (+ dt_bias) and softplus, exp(A * dt), the recurrence, the
    N-term sum for y, D and silu(z), then the final rounding to the output dtype.
    """
    f = torch.float64
    x = args["x"].to(f)
    dt = args["dt"].to(f)
    raw, raw_abs = dt, dt.abs()
    if args.get("dt_bias") is not None:
        raw = raw + args["dt_bias"].to(f)
        raw_abs = raw_abs + args["dt_bias"].to(f).abs()
    dtv = torch.where(raw <= 20, torch.log1p(torch.exp(raw)), raw) if case.dt_softplus else raw
    dtv_err = U32 * (2 * raw_abs + 4 * dtv.abs())
    dtv4, err4, x4 = dtv.unsqueeze(-1), dtv_err.unsqueeze(-1), x.unsqueeze(-1)
    rep = case.H // case.G
    Bh = args["B"].to(f).repeat_interleave(rep, dim=1).unsqueeze(2)
    Ch = args["C"].to(f).repeat_interleave(rep, dim=1).unsqueeze(2)
    a = args["A"].to(f)
    a_dtv = (a * dtv4).abs()
    decayed = (old * torch.exp(a * dtv4)).abs()
    s_err = 4 * (decayed * (a.abs() * err4 + U32 * (2 * a_dtv + 4)) + (Bh * x4).abs() * err4
                 + U32 * 4 * (dtv4 * Bh * x4).abs())
    terms = (state64 * Ch).abs()
    y_err = (s_err * Ch.abs()).sum(-1) + U32 * (case.N / 16 + 8) * terms.sum(-1)
    if args.get("D") is not None:
        y_err = y_err + U32 * 4 * (args["D"].to(f) * x).abs()
    if args.get("z") is not None:
        y_err = y_err * torch.nn.functional.silu(args["z"].to(f)).abs() + U32 * 8 * y64.abs()
    ux, upool = case.dtypes["x"], case.dtypes["ssm_pool"]
    y_tol = y_err + unit_roundoff(ux) * (y64.abs() + y_err) + subnormal_step(ux)
    pool_tol = s_err + unit_roundoff(upool) * (state64.abs() + s_err) + subnormal_step(upool)
    return y_tol, pool_tol


def compare(what: str, actual: Tensor, expected: Tensor, tol: Tensor | float) -> list[str]:
    """NaN where the reference has NaN, the same infinities, finite values within tol."""
    a = actual.detach().cpu().to(torch.float64)
    e = expected.detach().cpu().to(torch.float64)
    if a.shape != e.shape:
        return [f"{what}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"]
    tol = torch.as_tensor(tol, dtype=torch.float64).expand_as(e)
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    inf_any = torch.isinf(a) | torch.isinf(e)
    finite = ~(nan_a | nan_e | inf_any)
    bad = (nan_a != nan_e) | (inf_any & (a != e)) | (finite & ((a - e).abs() > tol))
    if not bad.any():
        return []
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return [f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first at {idx}: "
            f"got {a[idx].item()!r}, expected {e[idx].item()!r} (tol {tol[idx].item():.3g})"]


def _untouched(name: str, p: Placed, allowed: Tensor | None = None) -> list[str]:
    """Bits of p's buffer outside `allowed` (positions in buf) must not change."""
    changed = p.changed()
    if allowed is not None:
        changed[allowed] = False
    if not changed.any():
        return []
    first = int(changed.nonzero()[0])
    inside = bool((p.positions().reshape(-1) == first).any())
    where = "inside the view" if inside else "outside the view (guard region)"
    return [f"{name}: {int(changed.sum())} buffer elements changed that must not; first at buffer index "
            f"{first}, {where}"]


def expected_refusal(case: Case) -> str | None:
    """The message fragment checked mode must raise for this case, or None."""
    if not case.checked or case.op == "load_bc":
        return None
    S, pad = case.S, case.pad_slot_id
    named = [("slot_idx", case.slot_idx)]
    if case.op in ("decode_step", "decode_step_out"):
        named.append(("dst_slot_idx", case.dst_slot_idx))
    for name, values in named:
        for t, v in enumerate(values or []):
            if v != pad and not 0 <= v < S:
                return f"{name}[{t}] = {v} is not a slot"
    if case.op == "load_state":
        return None
    writes = case.dst_slot_idx if case.dst_slot_idx is not None else case.slot_idx
    # decode_step: a row whose source slot is the pad id is a pad row and writes
    # nothing, so it cannot duplicate a destination (store_state has no source).
    sources = case.slot_idx if case.op in ("decode_step", "decode_step_out") else None
    first: dict[int, int] = {}
    for t, v in enumerate(writes or []):
        if v == pad or (sources is not None and sources[t] == pad):
            continue
        if v in first:
            return f"rows {first[v]} and {t} both write slot {v}"
        first[v] = t
    if case.op in ("decode_step", "decode_step_out") and case.dst_slot_idx is not None:
        # decode_step: no row may write a slot that another row reads (rows run in no
        # fixed order, so that reader could see either state).
        src = case.slot_idx if case.slot_idx is not None else list(range(case.T))
        readers: dict[int, set[int]] = {}
        for t, v in enumerate(src):
            if v != pad:
                readers.setdefault(v, set()).add(t)
        for t, v in enumerate(case.dst_slot_idx):
            if src[t] != pad and v != pad and readers.get(v, {t}) != {t}:
                return f"row {t} writes slot {v} (dst_slot_idx[{t}]) which another row reads"
    return None


def _reference_inputs(built: Built) -> dict[str, Tensor | None]:
    """The views on the CPU (float64 reference runs there)."""
    out = {k: p.view.detach().cpu().clone() for k, p in built.placed.items()}
    out.update({k: p.view.detach().cpu().clone() for k, p in built.slots.items()})
    return out


def check_case(case: Case, device: torch.device | str) -> list[str]:
    """Run one case on `device`; return the list of contract violations (empty: pass)."""
    built = build(case, device)
    ref_in = _reference_inputs(built)  # snapshot before the call
    args = {name: built.arg(name) for name in list(OPERANDS) + ["slot_idx", "dst_slot_idx"]}
    every = dict(built.placed, **built.slots)

    if case.corrupt is not None:
        bad_args, name = _corrupted(case, built)
        on_meta = any(t is not None and t.device.type == "meta" for t in bad_args.values())
        with checked_mode(case.checked):
            try:
                (call_checks if on_meta else call)(case, bad_args)
            except RuntimeError as e:
                failures = [] if f"'{name}'" in str(e) else [f"refusal names the wrong argument: {e}"]
            else:
                failures = [f"call with corrupted {case.corrupt} was not refused"]
        for key, p in every.items():
            failures += _untouched(key, p)
        return failures

    refusal = expected_refusal(case)
    with checked_mode(case.checked):
        try:
            result = call(case, args)
        except RuntimeError as e:
            if refusal is None:
                return [f"unexpected RuntimeError: {e}"]
            failures = [] if refusal in str(e) else [f"checked mode raised {e!r}, expected it to say {refusal!r}"]
            for key, p in every.items():
                failures += _untouched(key, p)
            return failures
    if refusal is not None:
        return [f"checked mode accepted a call it must refuse ({refusal})"]
    if built.device.type == "cuda":
        torch.cuda.synchronize(built.device)

    failures = _check_result(case, built, ref_in, result)
    if not failures:  # layout never changes the answer
        twin = contiguous_twin(built, ref_in)
        plain = dataclasses.replace(case, op="decode_step" if case.op == "decode_step_out" else case.op)
        twin_args = {name: twin.arg(name) for name in list(OPERANDS) + ["slot_idx", "dst_slot_idx"]}
        with checked_mode(case.checked):
            twin_result = call(plain, twin_args)
        failures += _check_bitwise(case, built, twin, result, twin_result)
    return failures


def _check_result(case: Case, built: Built, ref: dict[str, Tensor | None], result) -> list[str]:
    g = ref.get
    failures: list[str] = []
    pool = built.placed.get("ssm_pool")
    if case.op == "load_bc":
        eb, ec = reference.load_bc(g("B"), g("C"))
        for what, got, exp in (("load_bc B", result[0], eb), ("load_bc C", result[1], ec)):
            failures += _exact_float32(what, got, exp)
        failures += _untouched("B", built.placed["B"]) + _untouched("C", built.placed["C"])
        return failures
    if case.op == "load_state":
        expected = reference.load_state(g("ssm_pool"), g("slot_idx"), case.pad_slot_id)
        failures += _exact_float32("load_state", result, expected)
        return failures + _untouched("ssm_pool", pool)

    plan = write_plan(case)
    positions = pool.positions()
    allowed = positions[sorted(plan.writer)].reshape(-1) if plan.writer else None
    failures += _untouched("ssm_pool", pool, allowed)
    new_pool = pool.view.detach().cpu()
    defined_slots = [k for k, ok in plan.slot_defined.items() if ok]

    if case.op == "store_state":
        expected = reference.store_state(g("state"), g("ssm_pool"), g("slot_idx"), case.pad_slot_id)
        if defined_slots:
            if not torch.equal(bits(new_pool[defined_slots]), bits(expected[defined_slots])):
                failures.append("store_state: written rows are not the reference's round-to-nearest-even")
        return failures + _untouched("state", built.placed["state"])

    # decode_step / decode_step_out
    y64, _, state64 = reference.decode_step(
        g("ssm_pool"), g("x"), g("dt"), g("A"), g("B"), g("C"), g("D"), g("z"), g("dt_bias"), case.dt_softplus,
        g("slot_idx"), g("dst_slot_idx"), case.pad_slot_id, compute_dtype=torch.float64)
    src = torch.arange(case.T) if case.slot_idx is None else torch.tensor(case.slot_idx, dtype=torch.int64)
    old = reference.load_state(g("ssm_pool"), src, case.pad_slot_id, compute_dtype=torch.float64)
    y_tol, pool_tol = step_tolerances(case, ref, old, y64, state64)
    y_tol[[t for t in range(case.T) if not plan.reads[t]]] = 0.0  # pad rows give exactly 0

    y = result
    if y.dtype != case.dtypes["x"] or tuple(y.shape) != (case.T, case.H, case.P):
        failures.append(f"y has dtype {y.dtype} shape {tuple(y.shape)}")
        return failures
    rows = [t for t in range(case.T) if plan.y_defined[t]]
    failures += compare("y", y.detach().cpu()[rows], y64[rows], y_tol[rows])
    if defined_slots:
        writers = [plan.writer[k] for k in defined_slots]
        failures += compare("pool", new_pool[defined_slots], state64[writers], pool_tol[writers])
    for name in case.present:
        if name == "ssm_pool":
            continue
        if name == "out":
            failures += _untouched("out", built.placed["out"], built.placed["out"].positions().reshape(-1))
        else:
            failures += _untouched(name, built.placed[name])
    for name, p in built.slots.items():
        failures += _untouched(name, p)
    return failures


def _exact_float32(what: str, got: Tensor, expected: Tensor) -> list[str]:
    if got.dtype != torch.float32 or tuple(got.shape) != tuple(expected.shape) or not got.is_contiguous():
        return [f"{what}: got {got.dtype} {tuple(got.shape)} contiguous={got.is_contiguous()}, expected "
                f"float32 {tuple(expected.shape)} contiguous"]
    if not torch.equal(bits(got.cpu()), bits(expected.to(torch.float32))):
        return [f"{what}: not bit-exact with the reference"]
    return []


def _check_bitwise(case: Case, built: Built, twin: Built, result, twin_result) -> list[str]:
    """The strided call and the contiguous call must agree bit for bit."""
    failures = []
    if case.op == "load_bc":
        for i, what in enumerate("BC"):
            if not torch.equal(bits(result[i].cpu()), bits(twin_result[i].cpu())):
                failures.append(f"layout changed load_bc {what}")
        return failures
    if case.op == "load_state":
        if not torch.equal(bits(result.cpu()), bits(twin_result.cpu())):
            failures.append("layout changed load_state")
        return failures
    plan = write_plan(case)
    defined_slots = [k for k, ok in plan.slot_defined.items() if ok]
    a = built.placed["ssm_pool"].view.detach().cpu()
    b = twin.placed["ssm_pool"].view.detach().cpu()
    untouched = [k for k in range(case.S) if k not in plan.writer]
    keep = defined_slots + untouched
    if keep and not torch.equal(bits(a[keep]), bits(b[keep])):
        failures.append("layout changed the stored state (bits differ from the contiguous call)")
    if case.op == "store_state":
        return failures
    rows = [t for t in range(case.T) if plan.y_defined[t]]
    ya, yb = result.detach().cpu()[rows], twin_result.detach().cpu()[rows]
    if not torch.equal(bits(ya), bits(yb)):
        diff = (bits(ya) != bits(yb)).nonzero()[0].tolist()
        failures.append(f"layout changed y (bits differ from the contiguous call), first at row-subset index {diff}")
    return failures


# ---------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------


def corpus(seed: int, count: int, max_elems: int, first: int = 0):
    """Case k of the corpus depends only on (seed, k)."""
    for k in range(first, first + count):
        yield k, draw_case(RandomChooser(seed * 1_000_003 + k), max_elems=max_elems)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps ...")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--first", type=int, default=0, help="index of the first case (to replay one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-elems", type=int, default=1 << 16, help="bound on T*H*P*N per case")
    parser.add_argument("--verbose", action="store_true", help="print every case")
    opts = parser.parse_args(argv)

    device = torch.device(opts.device)
    failed = 0
    counts: dict[str, int] = {}
    for k, case in corpus(opts.seed, opts.cases, opts.max_elems, opts.first):
        kind = case.op + (" corrupt" if case.corrupt else "") + (" checked" if case.checked else "")
        counts[kind] = counts.get(kind, 0) + 1
        try:
            failures = check_case(case, device)
        except Exception as e:  # a crash is a failure of this case, not of the run
            failures = [f"crashed: {type(e).__name__}: {e}"]
        if opts.verbose or failures:
            print(f"case {k}: {'FAIL' if failures else 'ok'}: {case.describe()}")
        for f in failures:
            print(f"    {f}")
        failed += bool(failures)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    print(f"{opts.cases - failed}/{opts.cases} cases passed on {device} (seed {opts.seed}; {summary})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
