"""Concurrent calls give the same bits as sequential ones.

CPU: several Python threads call the ops at once (torch.ops calls run without
the GIL, and each call fans out over the intra-op thread pool), on separate
pools, on disjoint slots of one shared pool with shared read-only operands, mixing
the loader verbs with the fused step, and with refused calls in between.
CUDA (when the extension has CUDA kernels): the same work spread over several
streams, against the same work on one stream.
"""

from __future__ import annotations

import threading

import pytest
import torch

import torch_ssd

WORKERS = 4
STEPS = 6
SHAPE = dict(T=8, H=4, P=16, N=48, G=2)  # N = three 16-wide chunks: vector and tail paths both run


def _has_cuda_kernels() -> bool:
    return torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("ssd::decode_step", "CUDA")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.fixture(autouse=True)
def _checks_off():
    previous = torch_ssd.checks_enabled()
    torch_ssd.set_checks(False)
    yield
    torch_ssd.set_checks(previous)


def _worker_inputs(seed: int, slots: list[int], pool_dtype=torch.bfloat16, dtype=torch.float16) -> dict:
    """One worker's per-step operands (STEPS of them) and its slot tensor."""
    T, H, P, N, G = (SHAPE[k] for k in "THPNG")
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        steps.append({
            "x": (torch.rand(T, H, P, generator=g) * 4 - 2).to(dtype),
            "dt": (torch.rand(T, H, generator=g) * 3 - 2).to(dtype).unsqueeze(-1).expand(T, H, P),
            "B": (torch.rand(T, G, N, generator=g) * 4 - 2).to(dtype),
            "C": (torch.rand(T, G, N, generator=g) * 4 - 2).to(dtype),
            "z": (torch.rand(T, H, P, generator=g) * 8 - 4).to(dtype),
        })
    return {"steps": steps, "slot_idx": torch.tensor(slots, dtype=torch.int32), "pool_dtype": pool_dtype}


def _shared_operands(seed: int, dtype=torch.float32) -> dict:
    """Per-head A, D and dt_bias expanded with stride 0, as models pass them."""
    H, P, N = (SHAPE[k] for k in "HPN")
    g = torch.Generator().manual_seed(seed)
    return {
        "A": (-torch.rand(H, generator=g) * 2 - 0.1).to(dtype).view(H, 1, 1).expand(H, P, N),
        "D": torch.rand(H, generator=g).to(dtype).view(H, 1).expand(H, P),
        "dt_bias": (torch.rand(H, generator=g) - 0.5).to(dtype).view(H, 1).expand(H, P),
    }


def _fresh_pool(S: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    H, P, N = (SHAPE[k] for k in "HPN")
    return (torch.rand(S, H, P, N, generator=g) * 4 - 2).to(dtype).to(device)


def _run_worker(pool, shared, work, ys, index, device="cpu"):
    """STEPS decode steps of one worker; y of each step goes to ys[index]."""
    slot_idx = work["slot_idx"].to(device)
    A, D, bias = (shared[k].to(device) for k in ("A", "D", "dt_bias"))
    out = []
    for step in work["steps"]:
        s = {k: v.to(device) for k, v in step.items()}
        out.append(torch.ops.ssd.decode_step(pool, s["x"], s["dt"], A, s["B"], s["C"], D, s["z"], bias, True,
                                             slot_idx, None, -1))
    ys[index] = out


def _in_threads(targets) -> None:
    """Start all targets together (behind a barrier); re-raise the first error."""
    barrier = threading.Barrier(len(targets))
    errors = []

    def wrap(fn):
        def run():
            barrier.wait()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001  (reported to the test below)
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _assert_same_ys(a, b):
    for w, (ya, yb) in enumerate(zip(a, b)):
        for s, (u, v) in enumerate(zip(ya, yb)):
            assert torch.equal(_bits(u), _bits(v)), f"worker {w}, step {s}: y differs from the sequential run"


def test_threads_on_separate_pools_match_sequential():
    T = SHAPE["T"]
    shared = _shared_operands(1)
    work = [_worker_inputs(10 + w, list(range(T))[::-1], pool_dtype=(torch.float32, torch.bfloat16)[w % 2])
            for w in range(WORKERS)]
    seq_pools = [_fresh_pool(T + 2, work[w]["pool_dtype"], 20 + w) for w in range(WORKERS)]
    par_pools = [p.clone() for p in seq_pools]
    seq_y, par_y = [None] * WORKERS, [None] * WORKERS

    for w in range(WORKERS):
        _run_worker(seq_pools[w], shared, work[w], seq_y, w)
    _in_threads([lambda w=w: _run_worker(par_pools[w], shared, work[w], par_y, w) for w in range(WORKERS)])

    _assert_same_ys(seq_y, par_y)
    for w in range(WORKERS):
        assert torch.equal(_bits(seq_pools[w]), _bits(par_pools[w])), f"worker {w}: pool differs"


def test_threads_on_disjoint_slots_of_one_pool_match_sequential():
    """One shared pool, each thread owning its own slots; shared read-only operands
    (the same tensor objects) in every thread; two slots nobody addresses."""
    T = SHAPE["T"]
    S = WORKERS * T + 2
    order = torch.randperm(WORKERS * T, generator=torch.Generator().manual_seed(3)).tolist()
    shared = _shared_operands(2)
    work = [_worker_inputs(30 + w, order[w * T:(w + 1) * T]) for w in range(WORKERS)]
    seq_pool = _fresh_pool(S, torch.bfloat16, 4)
    par_pool = seq_pool.clone()
    before = seq_pool.clone()
    seq_y, par_y = [None] * WORKERS, [None] * WORKERS

    for w in range(WORKERS):
        _run_worker(seq_pool, shared, work[w], seq_y, w)
    _in_threads([lambda w=w: _run_worker(par_pool, shared, work[w], par_y, w) for w in range(WORKERS)])

    _assert_same_ys(seq_y, par_y)
    assert torch.equal(_bits(seq_pool), _bits(par_pool)), "shared pool differs from the sequential run"
    assert torch.equal(_bits(par_pool[-2:]), _bits(before[-2:])), "slots no thread addressed changed"
    assert not torch.equal(_bits(par_pool[:-2]), _bits(before[:-2]))  # the steps did write


def test_loader_verbs_and_step_in_threads_match_sequential():
    """load_state / store_state on some slots while decode steps run on others."""
    T, H, P, N = (SHAPE[k] for k in "THPN")
    S = 3 * T
    shared = _shared_operands(5)
    step_work = _worker_inputs(40, list(range(T)))
    g = torch.Generator().manual_seed(6)
    states = [torch.rand(T, H, P, N, generator=g) * 4 - 2 for _ in range(STEPS)]
    store_slots = torch.arange(T, 2 * T)
    load_slots = torch.arange(2 * T, 3 * T)

    def storer(pool, out):
        for s in states:
            torch.ops.ssd.store_state(s, pool, store_slots, -1)
        out.append(True)

    def loader(pool, out):
        for _ in range(STEPS):
            out.append(torch.ops.ssd.load_state(pool, load_slots, -1))

    def run_all(pool, concurrent):
        ys, stored, loaded = [None], [], []
        jobs = [lambda: _run_worker(pool, shared, step_work, ys, 0), lambda: storer(pool, stored),
                lambda: loader(pool, loaded)]
        if concurrent:
            _in_threads(jobs)
        else:
            for job in jobs:
                job()
        return ys, loaded

    seq_pool = _fresh_pool(S, torch.float16, 7)
    par_pool = seq_pool.clone()
    seq_y, seq_loaded = run_all(seq_pool, concurrent=False)
    par_y, par_loaded = run_all(par_pool, concurrent=True)

    _assert_same_ys(seq_y, par_y)
    assert torch.equal(_bits(seq_pool), _bits(par_pool))
    for a, b in zip(seq_loaded, par_loaded):
        assert torch.equal(_bits(a), _bits(b))


def test_refused_calls_in_one_thread_leave_the_others_alone():
    """A thread making calls that are refused (wrong shapes, a G that does not
    divide H) runs next to threads making good calls: every bad call raises a
    RuntimeError naming its argument, its pool never changes, and the good
    threads get the sequential bits."""
    T, H, P, N, G = (SHAPE[k] for k in "THPNG")
    shared = _shared_operands(8)
    work = [_worker_inputs(50 + w, list(range(T))) for w in range(WORKERS - 1)]
    seq_pools = [_fresh_pool(T, torch.bfloat16, 60 + w) for w in range(WORKERS - 1)]
    par_pools = [p.clone() for p in seq_pools]
    seq_y, par_y = [None] * (WORKERS - 1), [None] * (WORKERS - 1)
    for w in range(WORKERS - 1):
        _run_worker(seq_pools[w], shared, work[w], seq_y, w)

    bad_pool = _fresh_pool(T, torch.float32, 70)
    bad_before = bad_pool.clone()
    step = work[0]["steps"][0]
    A, D, bias = shared["A"], shared["D"], shared["dt_bias"]
    bad_calls = [
        ("x", lambda: torch.ops.ssd.decode_step(bad_pool, step["x"][:, :, :-1], step["dt"], A, step["B"], step["C"],
                                                D, step["z"], bias, True, None, None, -1)),
        ("B", lambda: torch.ops.ssd.decode_step(bad_pool, step["x"], step["dt"], A, step["B"][:, :1].expand(T, 3, N),
                                                step["C"], D, step["z"], bias, True, None, None, -1)),
        ("dt_bias", lambda: torch.ops.ssd.decode_step(bad_pool, step["x"], step["dt"], A, step["B"], step["C"], D,
                                                      step["z"], bias.double(), True, None, None, -1)),
    ]
    messages = []

    def bad_worker():
        for _ in range(STEPS):
            for name, fn in bad_calls:
                try:
                    fn()
                except RuntimeError as e:
                    messages.append((name, str(e)))
                else:
                    messages.append((name, None))

    jobs = [lambda w=w: _run_worker(par_pools[w], shared, work[w], par_y, w) for w in range(WORKERS - 1)]
    _in_threads(jobs + [bad_worker])

    assert len(messages) == STEPS * len(bad_calls)
    for name, message in messages:
        assert message is not None, f"a call with a bad '{name}' was not refused"
        assert f"'{name}'" in message, message
    assert torch.equal(_bits(bad_pool), _bits(bad_before)), "a refused call changed its pool"
    _assert_same_ys(seq_y, par_y)
    for w in range(WORKERS - 1):
        assert torch.equal(_bits(seq_pools[w]), _bits(par_pools[w]))


@pytest.mark.skipif(not _has_cuda_kernels(), reason="needs CUDA and the extension's CUDA kernels")
def test_cuda_streams_match_one_stream():
    """Each worker's steps on its own stream (separate pools, then disjoint slots of
    one pool), launched interleaved, against all of them on the current stream."""
    device = "cuda"
    T = SHAPE["T"]
    shared = _shared_operands(9)
    order = torch.randperm(WORKERS * T, generator=torch.Generator().manual_seed(9)).tolist()
    work = [_worker_inputs(80 + w, order[w * T:(w + 1) * T]) for w in range(WORKERS)]
    S = WORKERS * T + 2

    def on_device(w):
        return {
            "slot_idx": work[w]["slot_idx"].to(device),
            "steps": [{k: v.to(device) for k, v in s.items()} for s in work[w]["steps"]],
        }

    inputs = [on_device(w) for w in range(WORKERS)]
    A, D, bias = (shared[k].to(device) for k in ("A", "D", "dt_bias"))

    def step(pool, w, i):
        s = inputs[w]["steps"][i]
        return torch.ops.ssd.decode_step(pool, s["x"], s["dt"], A, s["B"], s["C"], D, s["z"], bias, True,
                                         inputs[w]["slot_idx"], None, -1)

    for shared_pool in (False, True):
        base = [_fresh_pool(S, torch.bfloat16, 90 + (0 if shared_pool else w), device) for w in range(WORKERS)]
        if shared_pool:
            base = [base[0]] * WORKERS
        seq_pools = [p.clone() for p in base] if not shared_pool else [base[0].clone()] * WORKERS
        par_pools = [p.clone() for p in base] if not shared_pool else [base[0].clone()] * WORKERS
        seq_y = [[step(seq_pools[w], w, i) for i in range(STEPS)] for w in range(WORKERS)]
        torch.cuda.synchronize()

        streams = [torch.cuda.Stream() for _ in range(WORKERS)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        par_y = [[] for _ in range(WORKERS)]
        for i in range(STEPS):  # interleave the launches across streams
            for w in range(WORKERS):
                with torch.cuda.stream(streams[w]):
                    par_y[w].append(step(par_pools[w], w, i))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()

        _assert_same_ys(seq_y, par_y)
        for w in range(WORKERS):
            assert torch.equal(_bits(seq_pools[w]), _bits(par_pools[w])), f"stream {w}: pool differs"
