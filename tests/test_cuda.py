"""CUDA-only tests: graph capture and replay, torch.compile with CUDA graphs, pools
beyond 2^31 elements, CPU/CUDA agreement, the current stream, no host sync and no
allocation but y. (The rest of the suite runs on CUDA through the ``device``
fixture.) Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import torch_ssd  # noqa: F401  (registers torch.ops.ssd.*)
from conftest import (
    STEP_ARGS,
    apply_layout,
    assert_lean_kernel_runs,
    assert_step_matches_reference,
    clone_inputs,
    make_inputs,
    relative_error,
    step_args,
    ulp,
    y_tolerance,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (H, P, N, G) small enough to be quick, with a tail along N (N % 8 != 0) in one.
SHAPES = [(4, 16, 64, 2), (3, 8, 20, 1)]


def _step_inputs(T, H, P, N, G, pool_dtype, dtype=torch.bfloat16, seed=0, **kw):
    return make_inputs(None, T, H, P, N, G, device="cuda", pool_dtype=pool_dtype, dtype=dtype,
                       slots="dst", seed=seed, **kw)


def _fresh_x(inputs, steps, seed):
    """Per-step x and z values (what changes from one decode step to the next)."""
    gen = torch.Generator().manual_seed(seed)
    x = inputs["x"]
    xs = (torch.randn((steps, *x.shape), generator=gen)).to(x.dtype).to("cuda")
    zs = (torch.randn((steps, *x.shape), generator=gen)).to(x.dtype).to("cuda")
    return xs, zs


def _loop(inputs, xs, zs, outs):
    """A serving loop: several steps into caller buffers, state carried in the pool
    (each step reads the slots the previous one wrote)."""
    args = dict(inputs)
    src, dst = inputs["slot_idx"], inputs["dst_slot_idx"]
    for k in range(xs.shape[0]):
        args["x"].copy_(xs[k])
        args["z"].copy_(zs[k])
        a = dict(args, slot_idx=src if k % 2 == 0 else dst, dst_slot_idx=dst if k % 2 == 0 else src)
        torch.ops.ssd.decode_step_out(*(a[n] for n in STEP_ARGS), outs[k])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_graph_replay_of_multi_step_loop_equals_eager(pool_dtype, shape):
    H, P, N, G = shape
    T, steps = 5, 4
    inputs = _step_inputs(T, H, P, N, G, pool_dtype)
    eager = clone_inputs(inputs)
    xs, zs = _fresh_x(inputs, 2 * steps, seed=1)
    outs = torch.full((steps, T, H, P), 7.0, dtype=inputs["x"].dtype, device="cuda")
    eager_outs = outs.clone()

    # Warm up on a side stream (first calls may set things up), then capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warm = clone_inputs(inputs)
    with torch.cuda.stream(side):
        _loop(warm, xs[:steps], zs[:steps], outs.clone())
    torch.cuda.current_stream().wait_stream(side)

    static_x = torch.empty_like(xs[:steps])
    static_z = torch.empty_like(zs[:steps])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _loop(inputs, static_x, static_z, outs)
    # Capture only records: nothing ran.
    torch.cuda.synchronize()
    assert torch.equal(inputs["ssm_pool"], eager["ssm_pool"])

    for rep in range(2):  # replay twice: the second replay starts from the first one's pool
        chunk = slice(rep * steps, (rep + 1) * steps)
        static_x.copy_(xs[chunk])
        static_z.copy_(zs[chunk])
        graph.replay()
        _loop(eager, xs[chunk], zs[chunk], eager_outs)
        torch.cuda.synchronize()
        assert torch.equal(outs, eager_outs), f"replay {rep}: y differs from eager"
        assert torch.equal(inputs["ssm_pool"], eager["ssm_pool"]), f"replay {rep}: pool differs from eager"
    assert not torch.equal(outs, torch.full_like(outs, 7.0))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("speculate", ["0", "1", "2"])
def test_slot_index_written_by_the_kernel_before_is_the_one_used(pool_dtype, speculate, monkeypatch):
    """With programmatic dependent launch the lean kernel may start while the kernel
    before it still runs, and at T = 1 it reads the slot index early to fetch the state
    rows into L2 and (speculate 1) to load them from that slot right after the wait (2:
    from a wrong slot on purpose, so that every step loads them again). In a graph where an
    elementwise kernel moves the slot index on right before each step, every step must
    read and write the slot written for it: the result equals eager steps with the
    prefetch, the speculation and the overlap turned off."""
    T, H, P, N, G, S, steps = 1, 8, 64, 128, 1, 5, 6
    inputs = make_inputs(S, T, H, P, N, G, device="cuda", pool_dtype=pool_dtype, dtype=torch.bfloat16,
                         per_head=True, seed=9)
    inputs = apply_layout(inputs, "broadcast")
    inputs["slot_idx"].fill_(0)
    eager = clone_inputs(inputs)
    outs = torch.full((steps, T, H, P), 7.0, dtype=inputs["x"].dtype, device="cuda")
    eager_outs = outs.clone()

    def loop(args, ys):
        for k in range(steps):
            args["slot_idx"].add_(2).remainder_(S)  # a kernel writes the slot the step reads
            torch.ops.ssd.decode_step_out(*step_args(args), ys[k])

    monkeypatch.setenv("TORCH_SSD_CUDA_PREFETCH", "1")
    monkeypatch.setenv("TORCH_SSD_CUDA_SPECULATE", speculate)
    monkeypatch.delenv("TORCH_SSD_CUDA_PDL", raising=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warm = clone_inputs(inputs)
    with torch.cuda.stream(side):
        loop(warm, outs.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop(inputs, outs)
    graph.replay()

    monkeypatch.setenv("TORCH_SSD_CUDA_PREFETCH", "0")
    monkeypatch.setenv("TORCH_SSD_CUDA_SPECULATE", "0")
    monkeypatch.setenv("TORCH_SSD_CUDA_PDL", "0")
    for k in range(steps):
        eager["slot_idx"].add_(2).remainder_(S)
        torch.cuda.synchronize()
        torch.ops.ssd.decode_step_out(*step_args(eager), eager_outs[k])
    torch.cuda.synchronize()
    assert torch.equal(inputs["slot_idx"], eager["slot_idx"])
    assert torch.equal(outs, eager_outs), "y differs from the eager steps"
    assert torch.equal(inputs["ssm_pool"], eager["ssm_pool"]), "pool differs from the eager steps"
    assert not torch.equal(outs, torch.full_like(outs, 7.0))


def test_graph_capture_of_allocating_decode_step():
    """decode_step (which allocates y) captures too: y comes from the graph's pool."""
    inputs = _step_inputs(3, 4, 16, 32, 2, torch.float32)
    eager = clone_inputs(inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops.ssd.decode_step(*step_args(clone_inputs(inputs)))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.ssd.decode_step(*step_args(inputs))
    graph.replay()
    y_eager = torch.ops.ssd.decode_step(*step_args(eager))
    torch.cuda.synchronize()
    assert torch.equal(y, y_eager)
    assert torch.equal(inputs["ssm_pool"], eager["ssm_pool"])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compile_reduce_overhead_fullgraph_equals_eager(pool_dtype):
    torch._dynamo.reset()
    T, H, P, N, G = 4, 4, 16, 64, 2
    inputs = _step_inputs(T, H, P, N, G, pool_dtype, per_head=True)
    eager = clone_inputs(inputs)

    def steps(pool, x, dt, A, B, C, D, z, dt_bias, slot_idx, dst_slot_idx):
        # Two steps: the second reads the slots the first wrote.
        y1 = torch.ops.ssd.decode_step(pool, x, dt, A, B, C, D, z, dt_bias, True, slot_idx, dst_slot_idx, -1)
        y2 = torch.ops.ssd.decode_step(pool, x * 0.5, dt, A, B, C, D, z, dt_bias, True, dst_slot_idx, slot_idx, -1)
        return y1 + y2

    compiled = torch.compile(steps, mode="reduce-overhead", fullgraph=True)
    names = ("ssm_pool", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "slot_idx", "dst_slot_idx")
    for call in range(3):  # warm-up, recording, replay
        got = compiled(*(inputs[n] for n in names))
        want = steps(*(eager[n] for n in names))
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"call {call}: y differs from eager"
        assert torch.equal(inputs["ssm_pool"], eager["ssm_pool"]), f"call {call}: pool differs from eager"


def test_pool_beyond_2_31_elements():
    """bf16 (4200, 80, 64, 128): 2.75e9 elements. Rows near the end and one slot
    straddling element 2^31 behave exactly like the same rows in a small pool."""
    S_big, H, P, N, G = 4200, 80, 64, 128, 1
    per_slot = H * P * N
    assert S_big * per_slot > 2**31
    try:
        big = torch.empty((S_big, H, P, N), dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 5.5 GB pool")
    T = 4
    small = make_inputs(8, T, H, P, N, G, device="cuda", pool_dtype=torch.bfloat16, dtype=torch.bfloat16,
                        slots="dst", pad_rows=(), seed=3)
    # Small slot k lives at big slot far[k]: the last slots, and 3276 (which holds element 2^31).
    far = torch.tensor([S_big - 1, S_big - 2, 3276, S_big - 5, 4000, S_big - 3, 2**31 // per_slot + 1, 4100],
                       device="cuda")
    assert far[2] * per_slot < 2**31 < (far[2] + 1) * per_slot
    canary = torch.tensor([0, 3275, S_big - 4], device="cuda")
    big[canary] = 1.5
    big[far] = small["ssm_pool"]

    ref = clone_inputs(small)
    y_small = torch.ops.ssd.decode_step(*step_args(ref))
    args = dict(small, ssm_pool=big, slot_idx=far[small["slot_idx"]], dst_slot_idx=far[small["dst_slot_idx"]])
    y_big = torch.ops.ssd.decode_step(*step_args(args))
    torch.cuda.synchronize()
    assert torch.equal(y_big, y_small)
    assert torch.equal(big[far], ref["ssm_pool"])
    assert torch.equal(big[canary], torch.full_like(big[canary], 1.5))

    # The loader verbs address it the same way.
    loaded = torch.ops.ssd.load_state(big, far[small["dst_slot_idx"]])
    assert torch.equal(loaded, torch.ops.ssd.load_state(ref["ssm_pool"], small["dst_slot_idx"]))
    state = torch.randn((2, H, P, N), device="cuda")
    torch.ops.ssd.store_state(state, big, far[:2])
    assert torch.equal(big[far[:2]], state.to(torch.bfloat16))
    assert torch.equal(big[canary], torch.full_like(big[canary], 1.5))
    del big
    torch.cuda.empty_cache()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "broadcast"])
def test_cpu_and_cuda_agree(pool_dtype, layout):
    T, H, P, N, G = 6, 4, 8, 40, 2
    cpu = make_inputs(None, T, H, P, N, G, device="cpu", pool_dtype=pool_dtype, dtype=torch.bfloat16,
                      slots="dst", pad_rows=(1,), dst_pad_rows=(4,), per_head=True, seed=5)
    cpu = apply_layout(cpu, layout)
    gpu = apply_layout({k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in cpu.items()}, layout)
    y_cpu = torch.ops.ssd.decode_step(*step_args(cpu))
    y_gpu = torch.ops.ssd.decode_step(*step_args(gpu)).cpu()
    assert relative_error(y_gpu, y_cpu) <= 2 * y_tolerance(torch.bfloat16)
    pool_cpu, pool_gpu = cpu["ssm_pool"], gpu["ssm_pool"].cpu()
    # Each backend rounds its float32 state once: at most one ulp of the pool dtype
    # apart, plus a few float32 ulps of the terms' size -- the two expf
    # implementations, and CUDA's fused multiply-adds against the CPU's separate
    # roundings, which differ most where the decay and input terms cancel (so the
    # scale is the row's typical magnitude, not the element's).
    state = pool_cpu.double()
    scale = state.abs() + state.pow(2).mean(dim=-1, keepdim=True).sqrt()
    bound = ulp(state, pool_dtype) + 8 * torch.finfo(torch.float32).eps * scale
    assert ((pool_gpu.double() - pool_cpu.double()).abs() <= bound).all()


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_big_shape_matches_reference(pool_dtype):
    """A benchmark-sized head layout (N = 128, G = 8) against the float64 reference."""
    inputs = make_inputs(None, 3, 16, 64, 128, 8, device="cuda", pool_dtype=pool_dtype,
                         dtype=torch.bfloat16, slots="dst", pad_rows=(1,), seed=7)
    before = inputs["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step(*step_args(inputs))
    assert_step_matches_reference(inputs, before, y)


# Every CUDA decode-step kernel and launch choice (tools/cuda_tune.py's knobs): the
# defaults pick among them by shape and dtype, so each must give the same bits.
KERNEL_CHOICES = [
    {},
    {"TORCH_SSD_CUDA_KERNEL": "block"},
    {"TORCH_SSD_CUDA_KERNEL": "block", "TORCH_SSD_CUDA_STAGE": "0"},
    {"TORCH_SSD_CUDA_KERNEL": "pipe"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "1", "TORCH_SSD_CUDA_WARPS": "1"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "2", "TORCH_SSD_CUDA_WARPS": "2"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "2", "TORCH_SSD_CUDA_WARPS": "8", "TORCH_SSD_CUDA_PDL": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "4", "TORCH_SSD_CUDA_WARPS": "2"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "2", "TORCH_SSD_CUDA_PREFETCH": "1"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "4", "TORCH_SSD_CUDA_PREFETCH": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "4", "TORCH_SSD_CUDA_WARPS": "1", "TORCH_SSD_CUDA_PDL": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "4", "TORCH_SSD_CUDA_LEAN_ORDER": "1"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "2", "TORCH_SSD_CUDA_WARPS": "2", "TORCH_SSD_CUDA_LEAN_ORDER": "1"},
    {"TORCH_SSD_CUDA_LEAN_ORDER": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "2", "TORCH_SSD_CUDA_TOUCH_PARAMS": "1"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "1", "TORCH_SSD_CUDA_TOUCH_PARAMS": "1", "TORCH_SSD_CUDA_PREFETCH": "0"},
    {"TORCH_SSD_CUDA_TOUCH_PARAMS": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "2", "TORCH_SSD_CUDA_TOUCH_PARAMS": "2"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "4", "TORCH_SSD_CUDA_TOUCH_PARAMS": "3"},
    {"TORCH_SSD_CUDA_SPECULATE": "1"},
    {"TORCH_SSD_CUDA_SPECULATE": "2"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "4", "TORCH_SSD_CUDA_SPECULATE": "2", "TORCH_SSD_CUDA_PREFETCH": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "1", "TORCH_SSD_CUDA_SPECULATE": "1", "TORCH_SSD_CUDA_PDL": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "2", "TORCH_SSD_CUDA_SPECULATE": "0"},
    # N = 128 takes the lean kernels with a row's lanes fixed; these take the run-time form.
    {"TORCH_SSD_CUDA_LEAN_FIXED_LANES": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "1", "TORCH_SSD_CUDA_LEAN_FIXED_LANES": "0"},
    {"TORCH_SSD_CUDA_LEAN_ROWS": "4", "TORCH_SSD_CUDA_WARPS": "1", "TORCH_SSD_CUDA_LEAN_FIXED_LANES": "0"},
]
KERNEL_KNOBS = sorted({key for env in KERNEL_CHOICES for key in env})


def _every_choice_same_bits(pool_dtype, shape, bc_dtype, monkeypatch, extra_env=None):
    """Serving-style inputs (per-head A / dt / D / dt_bias broadcast along P, rows that
    split evenly over lanes) with pad rows and a shared destination slot, P not a
    multiple of any tile: every kernel choice (with `extra_env` set for all of them)
    matches the reference and the others."""
    T, H, P, N, G = shape
    inputs = make_inputs(None, T, H, P, N, G, device="cuda", pool_dtype=pool_dtype, dtype=torch.bfloat16,
                         dtypes={"B": bc_dtype, "C": bc_dtype}, slots="dst", pad_rows=(1,),
                         dst_pad_rows=(T - 2,), per_head=True, seed=11)
    inputs = apply_layout(inputs, "broadcast")
    inputs["dst_slot_idx"][0] = inputs["dst_slot_idx"][T - 1]  # row T-1 writes, row 0 only computes y
    pool0 = inputs["ssm_pool"].clone()
    first = None
    for env in KERNEL_CHOICES:
        for key in KERNEL_KNOBS:
            monkeypatch.delenv(key, raising=False)
        for key, value in {**(extra_env or {}), **env}.items():
            monkeypatch.setenv(key, value)
        inputs["ssm_pool"].copy_(pool0)
        y = torch.ops.ssd.decode_step(*step_args(inputs))
        got = (y, inputs["ssm_pool"].clone())
        if first is None:
            assert_step_matches_reference(inputs, pool0, y)
            first = got
        else:
            assert torch.equal(got[0], first[0]), f"y differs with {env}"
            assert torch.equal(got[1], first[1]), f"pool differs with {env}"


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", [(5, 3, 24, 64, 1), (7, 4, 40, 128, 2), (2, 2, 8, 256, 2), (6, 3, 24, 16, 1)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bc_dtype", [torch.bfloat16, torch.float32], ids=["bc_bf16", "bc_f32"])
def test_every_kernel_choice_gives_the_same_bits(pool_dtype, shape, bc_dtype, monkeypatch):
    """The default mapping along N (N = 16: two chunks per lane for 16-bit pools, which
    the lean kernel does not take)."""
    _every_choice_same_bits(pool_dtype, shape, bc_dtype, monkeypatch)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("chunks", ["2", "4"])
def test_every_kernel_choice_gives_the_same_bits_with_other_mappings(pool_dtype, chunks, monkeypatch):
    """TORCH_SSD_CUDA_CHUNKS (more lanes per row: with four chunks per lane float32 rows
    keep the lean kernel, with two every kernel choice falls to the block and pipelined
    kernels) changes the mapping along N for every kernel alike."""
    _every_choice_same_bits(pool_dtype, (7, 4, 40, 128, 2), torch.bfloat16, monkeypatch,
                            {"TORCH_SSD_CUDA_CHUNKS": chunks})


def test_serving_inputs_take_the_lean_kernel(monkeypatch):
    """The kernel names the profiler sees: the lean kernel for serving-style inputs by
    default, another with TORCH_SSD_CUDA_KERNEL=block (so the test above compares
    different kernels)."""
    inputs = make_inputs(None, 4, 3, 24, 128, 1, device="cuda", pool_dtype=torch.bfloat16, dtype=torch.bfloat16,
                         slots="dst", per_head=True, seed=3)
    inputs = apply_layout(inputs, "broadcast")
    assert_lean_kernel_runs(lambda: torch.ops.ssd.decode_step(*step_args(inputs)), "decode_step",
                            "decode_step_lean", monkeypatch)


def test_runs_on_the_current_stream():
    """The op is ordered after work queued on the current (non-default) stream."""
    inputs = _step_inputs(4, 4, 16, 64, 2, torch.float32)
    expected_inputs = clone_inputs(inputs)
    new_x = torch.randn_like(inputs["x"])
    expected_inputs["x"].copy_(new_x)
    want = torch.ops.ssd.decode_step(*step_args(expected_inputs))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time queued ahead of the copy
        inputs["x"].copy_(new_x)
        got = torch.ops.ssd.decode_step(*step_args(inputs))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(inputs["ssm_pool"], expected_inputs["ssm_pool"])


def test_no_host_sync_and_no_allocation_but_y():
    inputs = _step_inputs(8, 4, 16, 64, 2, torch.bfloat16)
    out = torch.empty_like(inputs["x"])
    torch.ops.ssd.decode_step_out(*step_args(inputs), out)  # warm-up
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        torch.ops.ssd.decode_step_out(*step_args(inputs), out)
        assert torch.cuda.memory_allocated() == before, "decode_step_out allocated"
        y = torch.ops.ssd.decode_step(*step_args(inputs))
        y_block = -(-y.numel() * y.element_size() // 512) * 512  # the allocator's rounding
        assert torch.cuda.memory_allocated() - before == y_block, "decode_step allocated more than y"
        torch.ops.ssd.load_state(inputs["ssm_pool"], inputs["slot_idx"])
        torch.ops.ssd.load_bc(inputs["B"], inputs["C"])
        torch.ops.ssd.store_state(torch.zeros((8, 4, 16, 64), device="cuda"), inputs["ssm_pool"],
                                  inputs["dst_slot_idx"])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_out_of_range_and_pad_slots_never_touch_the_pool(pool_dtype, unchecked_mode):
    """Slots past either end of the pool (huge, negative, S) are pad rows on CUDA too."""
    T, H, P, N, G = 6, 2, 8, 32, 1
    inputs = make_inputs(None, T, H, P, N, G, device="cuda", pool_dtype=pool_dtype, slots="dst", seed=9)
    S = inputs["ssm_pool"].shape[0]
    inputs["slot_idx"][1] = S
    inputs["slot_idx"][2] = -(2**40)
    inputs["slot_idx"][3] = -1  # the pad id
    inputs["dst_slot_idx"][4] = 2**40
    before = inputs["ssm_pool"].clone()
    y = torch.ops.ssd.decode_step(*step_args(inputs))
    assert_step_matches_reference(inputs, before, y)
