"""Launch P local processes on gloo (CPU) or NCCL (one GPU each) and collect each rank's return
value.

    results = run_ranks(world_size, fn, *args)   # fn(rank, world_size, *args) -> picklable

Used by the demo, the CLI's CPU paths, the tests and the GPU benchmarks (backend='nccl'). fn
must be importable (module level).
Every outcome ends in bounded time with a name: the first rank that fails (or dies) is reported
at once and the others are stopped (a rank that died, with its exit code or signal, is named
before the peers that then failed waiting on it); ranks still running after `timeout` seconds
are stopped and named; an interrupt of the parent (Ctrl-C, SIGINT) stops every rank before it
propagates. Inside the ranks every collective waits at most ECHO_COLLECTIVE_TIMEOUT_S on a peer
(group_timeout); gloo ranks compute at ECHO_RANK_THREADS intra-op threads (default 1, as a
simulated model does: threads.py).
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import envs

POLL_S = 0.05
"""How often the parent looks at its ranks."""
STOP_GRACE_S = 5.0
"""Seconds a stopped rank gets between SIGTERM and SIGKILL."""
DEATH_GRACE_S = 2.0
"""After a rank fails waiting on its peers: how long to look for a peer that died (the cause)."""
PEER_FAILURES = ("PeerWaitError", "DistBackendError", "DistNetworkError", "DistStoreError",
                 "Connection closed by peer", "Connection reset by peer")
"""Traceback text of a failure to wait on peers (echo-tp's own, and torch.distributed's)."""


class RankError(RuntimeError):
    """A rank of run_ranks failed, died or did not finish in time. `rank`; `summary`: one line
    ('rank 1 failed: ValueError: ...'); `detail`: the rank's traceback (may be empty)."""

    def __init__(self, rank: int, summary: str, detail: str = ""):
        super().__init__(summary + (f"\n{detail}" if detail else ""))
        self.rank, self.summary, self.detail = rank, summary, detail


def group_timeout() -> timedelta:
    """The wait on a peer every echo-tp group gets (ECHO_COLLECTIVE_TIMEOUT_S): pass it as
    `dist.init_process_group(..., timeout=group_timeout())` for groups you build yourself."""
    return timedelta(seconds=envs.collective_timeout_s())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, outdir, fn, args, backend="gloo"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank), timeout=group_timeout())
    else:
        torch.set_num_threads(envs.rank_threads())   # a simulated model's count (threads.py)
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=group_timeout())
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        result = ("error", traceback.format_exc())
    path = _result_path(outdir, rank)
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)   # the parent never reads half a file
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _result_path(outdir: str, rank: int) -> str:
    return os.path.join(outdir, f"rank{rank}.pt")


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0, backend: str = "gloo"):
    """Run fn(rank, world_size, *args) on world_size processes whose default group is `backend`
    ('gloo', or 'nccl': rank r on GPU r); return the per-rank results. Raises RankError naming
    the first rank that failed, died or was still running after `timeout` seconds; every rank
    is stopped before run_ranks returns or raises."""
    if not timeout > 0:
        raise ValueError(f"run_ranks timeout must be > 0 seconds, got {timeout!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks backend must be 'gloo' or 'nccl', got {backend!r}")
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world_size, _free_port(), outdir, fn, args,
                                                backend),
                                 nprocs=world_size, join=False, start_method="spawn")
        try:
            return _collect(ctx.processes, outdir, timeout)
        finally:
            _stop(ctx.processes)


def _collect(procs, outdir: str, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    results: dict[int, object] = {}
    while True:
        for r in range(len(procs)):
            if r not in results and os.path.exists(_result_path(outdir, r)):
                status, value = torch.load(_result_path(outdir, r), weights_only=False)
                if status == "error":
                    raise _failure(procs, outdir, r, value)
                results[r] = value
        if len(results) == len(procs):
            return [results[r] for r in range(len(procs))]
        dead = _dead(procs, outdir)
        if dead:
            raise RankError(dead[0], _died(procs, dead[0]))
        if time.monotonic() > deadline:
            late = [r for r in range(len(procs)) if r not in results]
            raise RankError(late[0], f"rank {late[0]} did not finish within {timeout:g} s "
                                     f"(still running: ranks {late}); a rank waiting on a peer "
                                     "fails after ECHO_COLLECTIVE_TIMEOUT_S, a slow fn needs "
                                     "run_ranks(timeout=...)")
        time.sleep(POLL_S)


def _dead(procs, outdir: str) -> list[int]:
    """Ranks whose process has ended without writing a result (killed, os._exit, a crash)."""
    return [r for r, p in enumerate(procs)
            if not p.is_alive() and not os.path.exists(_result_path(outdir, r))]


def _died(procs, r: int) -> str:
    return f"rank {r} died ({_exit_reason(procs[r].exitcode)}) before reporting a result"


def _failure(procs, outdir: str, r: int, tb: str) -> RankError:
    """The RankError of rank r's failure. A rank that died (its peers then fail waiting on it)
    is the cause, so it is named first. A peer notices a death before the dead process is
    reaped, so after a failure of a wait on peers (PEER_FAILURES) the death is looked for up to
    DEATH_GRACE_S; any other failure is rank r's own and is reported at once."""
    peer_wait = any(k in tb for k in PEER_FAILURES)
    end = time.monotonic() + (DEATH_GRACE_S if peer_wait else 0.0)
    while True:
        dead = _dead(procs, outdir)
        if dead:
            return RankError(dead[0], f"{_died(procs, dead[0])}; then rank {r} failed: "
                                      f"{_last_line(tb)}", tb)
        pending = [q for q in range(len(procs)) if q != r
                   and not os.path.exists(_result_path(outdir, q))]
        if not pending or time.monotonic() >= end:
            return RankError(r, f"rank {r} failed: {_last_line(tb)}", tb)
        time.sleep(POLL_S / 5)


def _last_line(tb: str) -> str:
    lines = [ln for ln in tb.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "unknown error"


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _stop(procs) -> None:
    """Every rank ends: a short wait for ranks that are done, SIGTERM, then SIGKILL."""
    end = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(timeout=max(0.0, min(1.0, end - time.monotonic())))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)
