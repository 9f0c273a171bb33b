"""What every GPU benchmark here shares: the environment, rank spawning, and timing.

    from common import SAFE_ENV, spawn_nccl, median_ms
    rows = spawn_nccl(P, fn, *args)      # fn(rank, world, *args) on P NCCL ranks, one GPU each

SAFE_ENV keeps NVLink multicast (NVLS) off in NCCL, torch symmetric memory and NVSHMEM; it is
applied in the parent before spawning, so every rank inherits it. Ranks run through
echo_tp.launch.run_ranks: a rank that fails, dies or outlives `timeout` is named and the others
are stopped.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def spawn_nccl(world: int, fn, *args, timeout: float = 1800.0) -> list:
    """fn(rank, world, *args) on `world` NCCL ranks (rank r on GPU r) -> per-rank results."""
    from echo_tp.launch import run_ranks
    os.environ.update(SAFE_ENV)
    return run_ranks(world, fn, *args, timeout=timeout, backend="nccl")


def wall_median_ms(fn, iters: int) -> float:
    """Median host wall-clock ms of `iters` calls of fn (no device sync: eager host cost)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def median_ms(fn, iters: int, warmup: int, barrier: bool = True) -> float:
    """Median ms of `iters` back-to-back calls of fn, each between two CUDA events (after
    `warmup` calls and, on a process group, a barrier so that ranks start together)."""
    for _ in range(warmup):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda.synchronize()
    if barrier and dist.is_initialized():
        dist.barrier()
    ev[0].record()
    for i in range(iters):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(iters))
