"""Launch P local processes on gloo (CPU) and collect each rank's return value.

    results = run_ranks(world_size, fn, *args)   # fn(rank, world_size, *args) -> picklable

Used by the demo, the CLI's CPU paths and the tests. fn must be importable (module level).
"""
from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, outdir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from datetime import timedelta

    from . import envs
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=envs.collective_timeout_s()))
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0):
    """Run fn(rank, world_size, *args) on world_size gloo processes; return the per-rank results.
    Raises with the failing rank's traceback."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world_size, _free_port(), outdir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        if not ctx.join(timeout=timeout):
            # join() returns False while processes are alive: wait until they are all done
            while not ctx.join(timeout=timeout):
                pass
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} produced no result")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results
