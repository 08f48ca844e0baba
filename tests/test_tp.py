"""Tensor parallelism by heads on torch.distributed.

Each rank owns H / world heads of every pool slot, the matching slice of x, z, dt,
A, D and dt_bias, and either its share of the B/C groups (G % world == 0) or a
replica of them (G < world, as engines do for single-group models). One decode
step per rank, then the head shards are gathered: y and the pool must be exactly
the unsharded step's (every (t, h, p) channel is computed on its own, so sharding
heads changes no bits). A row-parallel output projection with all_reduce closes
the loop the way a model layer would. Two gloo processes on CPU; NCCL when two GPUs
with torch_ssd CUDA kernels are present.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _backends() -> list[str]:
    backends = []
    if dist.is_available() and dist.is_gloo_available():
        backends.append("gloo")
    if (dist.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= WORLD
            and torch._C._dispatch_has_kernel_for_dispatch_key("ssd::decode_step", "CUDA")):
        backends.append("nccl")
    return backends


def _full_problem(H, G, S=8, T=5, P=8, N=16, hidden=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        pool=torch.randn(S, H, P, N, generator=g),
        x=torch.randn(T, H, P, generator=g),
        z=torch.randn(T, H, P, generator=g),
        dt=torch.randn(T, H, generator=g) * 0.5,
        A=-torch.rand(H, generator=g) - 0.5,
        B=torch.randn(T, G, N, generator=g),
        C=torch.randn(T, G, N, generator=g),
        D=torch.randn(H, generator=g),
        dt_bias=torch.rand(H, generator=g) - 2.0,
        slot_idx=torch.tensor([6, -1, 0, 3, 5])[:T],
        out_proj=torch.randn(hidden, H * P, generator=g) / (H * P) ** 0.5,
    )


def _step(pool, p, heads=slice(None), groups=slice(None)):
    import torch_ssd

    return torch_ssd.selective_state_update(
        pool, p["x"][:, heads], p["dt"][:, heads], p["A"][heads], p["B"][:, groups], p["C"][:, groups],
        D=p["D"][heads], z=p["z"][:, heads], dt_bias=p["dt_bias"][heads], dt_softplus=True,
        state_batch_indices=p["slot_idx"], pad_slot_id=-1,
    )


def _worker(rank: int, world: int, backend: str, init_file: str) -> None:
    import torch_ssd  # noqa: F401  (registers torch.ops.ssd in the child)

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        for H, G in ((8, 4), (8, 1)):  # groups sharded, and one group replicated on every rank
            full = {k: v.to(device) for k, v in _full_problem(H, G).items()}
            full_pool = full["pool"].clone()
            y_full = _step(full_pool, full)

            heads_per_rank = H // world
            heads = slice(rank * heads_per_rank, (rank + 1) * heads_per_rank)
            if G % world == 0:
                groups = slice(rank * (G // world), (rank + 1) * (G // world))
            else:
                assert G == 1
                groups = slice(None)
            # A rank's own pool holds only its heads (a separate allocation, not a view).
            local_pool = full["pool"][:, heads].contiguous()
            y_local = _step(local_pool, full, heads, groups)

            y_parts = [torch.empty_like(y_local) for _ in range(world)]
            dist.all_gather(y_parts, y_local.contiguous())
            pool_parts = [torch.empty_like(local_pool) for _ in range(world)]
            dist.all_gather(pool_parts, local_pool)
            assert torch.equal(torch.cat(y_parts, dim=1), y_full), f"H={H} G={G}: gathered y differs"
            assert torch.equal(torch.cat(pool_parts, dim=1), full_pool), f"H={H} G={G}: gathered pool differs"
            assert torch.all(y_local[1] == 0)  # the pad row, on every rank

            # Row-parallel output projection: each rank's partial product, summed across ranks.
            P = y_local.shape[-1]
            w_local = full["out_proj"][:, heads.start * P:heads.stop * P]
            partial = y_local.flatten(1) @ w_local.T
            dist.all_reduce(partial)
            torch.testing.assert_close(partial, y_full.flatten(1) @ full["out_proj"].T, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", _backends())
def test_heads_sharded_across_ranks_reproduce_unsharded_step(backend, tmp_path, monkeypatch):
    init_file = str(tmp_path / "rendezvous")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two small processes on a shared CI machine
    mp.spawn(_worker, args=(WORLD, backend, init_file), nprocs=WORLD, join=True)


def test_single_process_sharding_is_exact():
    """The claim the distributed test rests on, checked without processes: any head shard
    of the step is bit-identical to the same heads of the unsharded step."""
    for H, G in ((8, 4), (8, 2), (8, 1)):
        full = _full_problem(H, G)
        full_pool = full["pool"].clone()
        y_full = _step(full_pool, full)
        for heads in (slice(0, 4), slice(4, 8), slice(2, 4)):
            per_group = H // G
            if G == 1:
                groups = slice(None)  # replicated
            elif heads.start % per_group == 0 and heads.stop % per_group == 0:
                groups = slice(heads.start // per_group, heads.stop // per_group)
            else:
                continue  # this head range splits a group
            local_pool = full["pool"][:, heads].contiguous()
            y_local = _step(local_pool, full, heads, groups)
            assert torch.equal(y_local, y_full[:, heads])
            assert torch.equal(local_pool, full_pool[:, heads])
