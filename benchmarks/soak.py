"""Soak: many compensated calls on real gloo ranks, memory and call time flat over the run.

    python benchmarks/soak.py --world 2 --calls 20000 --numel 4096 --config echo4 --out soak.json

Each rank runs `calls` all-reduces of fresh random partials in passes of --sites calls (a new
forward pass, so a fresh compensator state, every --sites calls; every 8th pass also runs
--sites backward calls), and samples its resident set and the median call time of each window
of --window calls. Flat means: the last window's resident set within a few MiB of the first
window's (no per-call or per-pass leak), and its median call time within noise of the first.
Also checked on every call: y is finite and the same on every rank (a checksum compared once
per window). Prints one line per window (rank 0) and the JSON summary.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _rank(rank, world_size, calls, numel, config, sites, window):
    import torch.distributed as dist

    from echo_tp import EchoCommunicator, EchoConfig
    gen = torch.Generator().manual_seed(rank)
    comm = EchoCommunicator.from_group(None, EchoConfig.from_name(config))
    rows, times, check = [], [], torch.zeros(1, dtype=torch.float64)
    done = 0
    passes = 0
    while done < calls:
        direction = "backward" if passes % 8 == 7 else "forward"
        with comm.pass_scope(direction):
            for _ in range(min(sites, calls - done)):
                x = torch.randn(numel, generator=gen, dtype=torch.bfloat16)
                t0 = time.perf_counter()
                y = comm.all_reduce(x, direction=direction)
                times.append(time.perf_counter() - t0)
                if not torch.isfinite(y).all():
                    raise RuntimeError(f"rank {rank}: non-finite y at call {done}")
                check += y.double().sum()
                done += 1
                if done % window == 0:
                    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
                    dist.all_gather(sums, check)
                    if any(not torch.equal(s, sums[0]) for s in sums):
                        raise RuntimeError(f"ranks disagree on y by call {done}")
                    rows.append({"calls": done, "rss_mib": round(_rss_mib(), 1),
                                 "median_call_us": round(statistics.median(times) * 1e6, 1)})
                    if rank == 0:
                        print(json.dumps(rows[-1]), flush=True)
                    times = []
        passes += 1
    return rows


def main() -> None:
    from echo_tp.launch import run_ranks
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--config", default="echo4")
    ap.add_argument("--sites", type=int, default=64, help="calls per pass")
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    per_rank = run_ranks(a.world, _rank, a.calls, a.numel, a.config, a.sites, a.window,
                         timeout=3600)
    first, last = per_rank[0][0], per_rank[0][-1]
    summary = {"world": a.world, "calls": a.calls, "numel": a.numel, "config": a.config,
               "sites_per_pass": a.sites, "wall_s": round(time.time() - t0, 1),
               "rss_growth_mib": {r: round(rows[-1]["rss_mib"] - rows[0]["rss_mib"], 1)
                                  for r, rows in enumerate(per_rank)},
               "median_call_us_first_last": [first["median_call_us"], last["median_call_us"]],
               "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "windows": per_rank[0]}
    print(json.dumps({k: v for k, v in summary.items() if k != "windows"}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
