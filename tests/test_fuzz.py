"""Property-based tests of torch.ops.ssd (hypothesis), bounded for CI.

The cases come from tools/replay_fuzz_corpus.py (the same generator the device
corpus replays): random (T, H, P, N, G) with H % G == 0, N in 1..256, P in 1..128;
random pool and operand dtypes; random strides, storage offsets and stride-0
broadcasts; slot tensors with duplicates, pads and out-of-range values; checked
mode on or off; deliberately corrupted arguments. For every case, check_case
verifies:

* the op equals the float64 reference (torch_ssd.reference) within a float32
  error bound, and the loader verbs equal it bit for bit;
* pool rows the call does not address, and every element around each view, keep
  their bits (so nothing is read or written out of bounds either: the guard
  region holds NaN, which would show up in y);
* the same call on contiguous copies gives bit-identical results;
* a refused call raises a RuntimeError naming the argument and changes nothing.

Hypothesis runs derandomized without an example database, so CI sees the same
examples every run. TORCH_SSD_FUZZ_SCALE=10 runs ten times as many examples.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_ssd
from torch_ssd import reference

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "replay_fuzz_corpus.py"
_spec = importlib.util.spec_from_file_location("replay_fuzz_corpus", _TOOL)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["replay_fuzz_corpus"] = fuzz
_spec.loader.exec_module(fuzz)

SCALE = float(os.environ.get("TORCH_SSD_FUZZ_SCALE", "1"))


def _fuzz_settings(examples: int):
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def _backends() -> list[str]:
    devices = ["cpu"]
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if torch.cuda.is_available() and has("ssd::decode_step", "CUDA"):
        devices.append("cuda")
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


DEVICES = _backends()


class HypothesisChooser:
    """The generator's Chooser interface on top of hypothesis draws (shrinkable)."""

    def __init__(self, data):
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options):
        return self.data.draw(st.sampled_from(list(options)))

    def rare(self, probability: float) -> bool:
        return self.data.draw(st.integers(0, 999)) >= round(1000 * (1 - probability))


def _check(case, device):
    failures = fuzz.check_case(case, device)
    assert not failures, case.describe() + "\n" + "\n".join(failures)


@pytest.fixture(autouse=True)
def _checks_off():
    """Every property starts with checked mode off and leaves it as it found it."""
    previous = torch_ssd.checks_enabled()
    torch_ssd.set_checks(False)
    yield
    torch_ssd.set_checks(previous)


# Two kinds of properties: HypothesisChooser lets hypothesis pick every choice
# (boundaries first, failures shrink to a minimal case); seeded ones let
# hypothesis pick only a seed for the corpus generator, which spreads the
# examples more widely. A failure prints the case; seeded ones replay with
# tools/replay_fuzz_corpus.py as well.


def _seeded(seed: int):
    return fuzz.RandomChooser(seed)


@pytest.mark.parametrize("device", DEVICES)
@_fuzz_settings(35)
@given(data=st.data())
def test_decode_step_matches_reference(device, data):
    case = fuzz.draw_case(HypothesisChooser(data), max_elems=1 << 13, ops=("decode_step", "decode_step_out"),
                          checked_rate=0.1, corrupt_rate=0.0)
    _check(case, device)


@pytest.mark.parametrize("device", DEVICES)
@_fuzz_settings(50)
@given(seed=st.integers(0, 2**32 - 1))
def test_decode_step_matches_reference_seeded(device, seed):
    case = fuzz.draw_case(_seeded(seed), max_elems=1 << 13, ops=("decode_step", "decode_step_out"),
                          checked_rate=0.1, corrupt_rate=0.0)
    _check(case, device)


@pytest.mark.parametrize("device", DEVICES)
@_fuzz_settings(30)
@given(seed=st.integers(0, 2**32 - 1))
def test_loader_verbs_match_reference(device, seed):
    case = fuzz.draw_case(_seeded(seed), max_elems=1 << 13, ops=("load_state", "store_state", "load_bc"),
                          checked_rate=0.1, corrupt_rate=0.0)
    _check(case, device)


@pytest.mark.parametrize("device", DEVICES)
@_fuzz_settings(25)
@given(seed=st.integers(0, 2**32 - 1))
def test_checked_mode_refuses_bad_slots_or_matches(device, seed):
    case = fuzz.draw_case(_seeded(seed), max_elems=1 << 12,
                          ops=("decode_step", "decode_step_out", "load_state", "store_state"),
                          checked_rate=1.0, corrupt_rate=0.0)
    _check(case, device)


@pytest.mark.parametrize("device", DEVICES)
@_fuzz_settings(25)
@given(seed=st.integers(0, 2**32 - 1))
def test_bad_argument_is_refused_and_nothing_changes(device, seed):
    case = fuzz.draw_case(_seeded(seed), max_elems=1 << 12, corrupt_rate=1.0)
    _check(case, device)


# ---------------------------------------------------------------------------
# The checker itself must catch broken kernels: run it against a fake kernel
# (the float32 reference plus a write-back loop) with one bug planted at a time.
# ---------------------------------------------------------------------------


def _fake_kernel(bug: str | None):
    real_call = fuzz.call

    def call(case, args):
        if case.op not in ("decode_step", "decode_step_out"):
            return real_call(case, args)

        def c(name):
            t = args.get(name)
            return None if t is None else t.contiguous()

        pool = args["ssm_pool"]
        y, _, state = reference.decode_step(
            pool.contiguous(), c("x"), c("dt"), c("A"), c("B"), c("C"), c("D"), c("z"), c("dt_bias"),
            case.dt_softplus, c("slot_idx"), c("dst_slot_idx"), case.pad_slot_id)
        y = y.to(args["x"].dtype)
        src = list(range(case.T)) if case.slot_idx is None else case.slot_idx
        dst = src if case.dst_slot_idx is None else case.dst_slot_idx

        def ok(v):
            return v != case.pad_slot_id and 0 <= v < case.S

        rows = range(case.T) if bug != "first_writer_wins" else reversed(range(case.T))
        for t in rows:
            reads = ok(src[t])
            if ok(dst[t]) and (reads or bug == "pad_row_writes"):
                pool[dst[t]] = state[t].to(pool.dtype)
        if bug == "y_off_by_1e-3":
            y = y * (1 + 1e-3)
        if bug == "layout_dependent" and not args["x"].is_contiguous():
            y.view(torch.int32)[0, 0, 0] ^= 1
        if bug == "writes_guard":
            guard = pool.as_strided((1,), (1,), pool.storage_offset() - 1)
            guard.fill_(0.0)
        if case.op == "decode_step_out":
            args["out"].copy_(y)
            return args["out"]
        return y

    return call


def _simple_case(**changes):
    """A small all-float32, all-contiguous decode case."""
    names = ("ssm_pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias")
    base = fuzz.Case(
        op="decode_step", S=6, T=4, H=2, P=3, N=5, G=1,
        dtypes={n: torch.float32 for n in names},
        layouts={n: fuzz.Layout.contiguous(len(fuzz.OPERANDS[n][0])) for n in names},
        present=names, slot_idx=[0, 1, 2, 3], dst_slot_idx=None,
        index_dtypes=(torch.int64, torch.int64),
        index_layouts=(fuzz.Layout.contiguous(1), fuzz.Layout.contiguous(1)),
        pad_slot_id=-1, dt_softplus=True, checked=False, seed=1234)
    return dataclasses.replace(base, **changes)


PLANTED = {
    # bug -> a case that exposes it
    None: _simple_case(slot_idx=[0, 5, -1, 2], dst_slot_idx=[3, 3, 4, 1]),
    "first_writer_wins": _simple_case(slot_idx=[0, 5, -1, 2], dst_slot_idx=[3, 3, 4, 1]),
    "pad_row_writes": _simple_case(slot_idx=[0, 5, -1, 2], dst_slot_idx=[3, 3, 4, 1]),
    "y_off_by_1e-3": _simple_case(),
    "layout_dependent": _simple_case(layouts=dict(_simple_case().layouts, x=fuzz.Layout((2, 0, 1), (1, 1, 1)))),
    "writes_guard": _simple_case(layouts=dict(_simple_case().layouts, ssm_pool=fuzz.Layout((0, 1, 2, 3), (1,) * 4, 3))),
}


@pytest.mark.parametrize("bug", list(PLANTED), ids=str)
def test_checker_catches_planted_bug(monkeypatch, bug):
    monkeypatch.setattr(fuzz, "call", _fake_kernel(bug))
    failures = fuzz.check_case(PLANTED[bug], "cpu")
    if bug is None:
        assert failures == []  # the fake without a bug is a correct kernel
    else:
        assert failures, f"the checker missed the planted bug {bug!r}"


def test_replay_tool_passes_and_fails(monkeypatch, capsys):
    assert fuzz.main(["--cases", "12", "--seed", "3", "--max-elems", "4096"]) == 0
    monkeypatch.setattr(fuzz, "call", _fake_kernel("first_writer_wins"))
    # dst duplicates are common enough in the corpus that 40 cases contain some
    assert fuzz.main(["--cases", "40", "--seed", "3", "--max-elems", "4096"]) == 1
    assert "FAIL" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# Empty dimensions. A crash here would take the whole test process down, so
# each run happens in a child process: the op must either work (and match the
# reference) or raise a RuntimeError, never crash.
# ---------------------------------------------------------------------------

_EMPTY_DIM_SCRIPT = r"""
import sys, torch, torch_ssd
from torch_ssd import reference
for spec in sys.argv[1:]:  # "DIM:op,op,..."
    name, ops = spec.split(":")
    dims = dict(S=5, T=3, H=4, P=3, N=5, G=2)
    dims[name] = 0
    if name == "H":
        dims["G"] = 1
    S, T, H, P, N, G = (dims[c] for c in "STHPNG")
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.rand(*shape, generator=g)
    pool, x, dt, A = r(S, H, P, N), r(T, H, P), r(T, H, P), -r(H, P, N)
    B, C, D, z, bias = r(T, G, N), r(T, G, N), r(H, P), r(T, H, P), r(H, P)
    slots = torch.arange(T) % max(S, 1) if S else torch.full((T,), 7)
    for op in ops.split(","):
        print(f"{name}=0 {op}: ", end="", flush=True)
        try:
            if op == "decode_step":
                p = pool.clone()
                y = torch.ops.ssd.decode_step(p, x, dt, A, B, C, D, z, bias, True, slots, None, -1)
                y64, p64, _ = reference.decode_step(pool, x, dt, A, B, C, D, z, bias, True, slots, None, -1,
                                                    compute_dtype=torch.float64)
                ok = torch.allclose(y.double(), y64, atol=1e-5) and torch.allclose(p.double(), p64.double(), atol=1e-5)
            elif op == "load_state":
                ok = torch.equal(torch.ops.ssd.load_state(pool, slots, -1), reference.load_state(pool, slots, -1))
            elif op == "store_state":
                p = pool.clone()
                st = r(T, H, P, N)
                torch.ops.ssd.store_state(st, p, slots, -1)
                ok = torch.equal(p, reference.store_state(st, pool, slots, -1))
            else:
                b, c = torch.ops.ssd.load_bc(B, C)
                ok = torch.equal(b, B) and torch.equal(c, C)
            print("ok" if ok else "MISMATCH", flush=True)
        except RuntimeError as e:
            print("refused:", str(e).splitlines()[0], flush=True)
"""

_ALL_OPS = "decode_step,load_state,store_state,load_bc"


def _run_empty_dims(*specs: str):
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _EMPTY_DIM_SCRIPT, *specs], capture_output=True, text=True,
                          timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, f"crashed (exit {proc.returncode}) in: {lines[-1:]}\n{proc.stderr[-2000:]}"
    assert len(lines) == sum(len(s.split(":")[1].split(",")) for s in specs), lines
    assert not [line for line in lines if "MISMATCH" in line], lines


def test_empty_dimensions_work_or_are_refused():
    _run_empty_dims(*(f"{d}:{_ALL_OPS}" for d in "TSHP"), "N:load_state,store_state,load_bc")


def test_empty_state_dimension_decode_step():
    # N = 0 once crashed the CPU kernel (it read A[h, p, 0] of an empty A).
    _run_empty_dims("N:decode_step")
