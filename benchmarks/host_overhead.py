"""Where an eager small all-reduce spends its host time, per rank (P GPUs, one message size).

    python benchmarks/host_overhead.py --world 2 --kb 64 --out $OUT

For each method: `host_us`, the CPU time per call of `calls` back-to-back calls issued without
synchronizing (what bounds an eager decode step when the GPU work is shorter), and `wall_us`,
the time per call including the wait for the GPU; then a cProfile of the communicator path and
of the fused p2p call on rank 0 (top functions by own time). Methods: nccl16 (dist.all_reduce),
oneshot16, p2p4 (fused kernel), p2p4-staged (three kernels), auto4 / auto4c (EchoCommunicator,
backend='auto', in place; uncompensated / compensated, local residual).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import torch
import torch.distributed as dist

from common import spawn_nccl


def _host_and_wall(fn, calls: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def _profile(fn, calls: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    return s.getvalue()


def worker(rank: int, world: int, nbytes: int, calls: int) -> dict:
    from echo_tp.collective import routing, tuning
    from echo_tp.collective.oneshot import OneShotBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.communicator import EchoCommunicator
    from echo_tp.config import EchoConfig
    from echo_tp.kernels import launcher
    n = nbytes // 2
    x = (torch.randn(n, device="cuda") * 1e-3).to(torch.bfloat16)
    buf = x.clone()
    cfg = EchoConfig(bits=4, eta=0.0)
    call = routing.Call.of(n, 2, cfg, world, on_gpu=True)
    fused_r = routing.p2p_route(call, tuning.DEFAULT, "benchmark", form="fused")
    staged_r = routing.p2p_route(call, tuning.DEFAULT, "benchmark", form="staged")
    p2p = P2PBackend(None)
    one = OneShotBackend(None, cap_bytes=max(nbytes, 1 << 20))
    comm = EchoCommunicator.from_group(None, cfg)
    comm.new_pass()
    comm_c = EchoCommunicator.from_group(None, EchoConfig(bits=4, residual="local"))
    comm_c.new_pass()
    methods = {
        "nccl16": lambda: dist.all_reduce(buf),
        "oneshot16": lambda: one.run(buf, cfg, state=None, backward=False, record=False,
                                     inplace=True),
        "p2p4": lambda: p2p.run(x, cfg, route=fused_r, state=None, backward=False,
                                record=False),
        "p2p4-staged": lambda: p2p.run(x, cfg, route=staged_r, state=None, backward=False,
                                       record=False),
        "auto4": lambda: comm.all_reduce(buf, inplace=True),
        "auto4c": lambda: comm_c.all_reduce(buf, inplace=True),
    }
    out = {"rows": {}}
    for name, fn in methods.items():
        host, wall = _host_and_wall(fn, calls)
        out["rows"][name] = {"host_us": round(host, 1), "wall_us": round(wall, 1)}
    out["backend_auto"] = comm.dispatcher.last_backend
    out["fast_launch_entries"] = len(launcher._CACHE)
    for name in ("auto4", "auto4c", "p2p4"):
        prof = _profile(methods[name], calls)
        if rank == 0:
            out[f"profile_{name}"] = prof
    for b in (p2p, one):
        b.check_error()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kb", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    res = spawn_nccl(a.world, worker, a.kb << 10, a.calls)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"host_overhead_P{a.world}_{a.kb}KB.json"), "w") as f:
        json.dump(res, f, indent=1)
    for r, d in enumerate(res):
        print(f"rank {r}: auto picked {d['backend_auto']}, fast-launch entries "
              f"{d['fast_launch_entries']}")
        for name, row in d["rows"].items():
            print(f"  {name:12s} host {row['host_us']:7.1f} us/call   wall {row['wall_us']:7.1f}")
    for name in ("auto4", "auto4c", "p2p4"):
        print(res[0][f"profile_{name}"])


if __name__ == "__main__":
    main()
