"""All-reduce latency at P GPUs: NCCL 16-bit vs the reference (two NCCL collectives) vs p2p.

    python benchmarks/allreduce.py --world 4 --out out/           # spawns 4 NCCL ranks

Per message size (bf16 bytes per GPU) and method: warm-up, then `iters` back-to-back calls
each bracketed by CUDA events; the median per rank, the max over ranks reported. Methods:
nccl16 (dist.all_reduce, in place), ref4/ref8 (reference backend, uncompensated), p2p8/p2p4
(uncompensated), p2p4c-out / p2p4c-loc (4-bit compensated, residual output / local),
p2p4-graph (p2p4 replayed from a CUDA graph, small sizes). Bus
bandwidth uses bf16-equivalent bytes: 2 (P-1)/P * bytes / time (the nccl-tests convention).
Writes allreduce_P{P}.json and allreduce_P{P}.md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MB = 1 << 20
SIZES = [64 << 10, 256 << 10, MB, 4 * MB, 16 * MB, 64 * MB, 128 * MB, 256 * MB, 512 * MB,
         1024 * MB]
METHODS = ("nccl16", "ref4", "p2p8", "p2p4", "p2p4c-out", "p2p4c-loc", "p2p4-graph")
GRAPH_MAX_BYTES = 64 * MB
"""p2p4-graph (one uncompensated call captured in a CUDA graph, replayed) up to this size:
it shows how much of the small-message time is host launch overhead."""
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, outdir, fn, args):
    os.environ.update(SAFE_ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    import traceback
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - report to the parent
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def spawn_nccl(world: int, fn, *args) -> list:
    """fn(rank, world, *args) on `world` NCCL ranks (one GPU each) -> per-rank results."""
    import tempfile
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world, _free_port(), outdir, fn, args), nprocs=world,
                           join=True, start_method="spawn")
        out = []
        for r in range(world):
            status, value = torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
            if status == "error":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            out.append(value)
        return out


def _time(fn, iters: int, warmup: int) -> float:
    """Median ms of `iters` back-to-back calls, each between two CUDA events."""
    for _ in range(warmup):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda.synchronize()
    dist.barrier()
    ev[0].record()
    for i in range(iters):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(iters))


def bench_worker(rank: int, world: int, sizes=SIZES, methods=METHODS, iters: int = 50,
                 warmup: int = 5, deadline: float | None = None, **p2p_kwargs) -> list[dict]:
    """On one rank: every size x method -> {'bytes', 'method', 'ms'} (this rank's median)."""
    from echo_tp.collective.dispatch import TransportBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.collective.reference import DistTransport
    from echo_tp.compensator import CompState
    from echo_tp.config import EchoConfig
    p2p = P2PBackend(None, min_bytes=0, **p2p_kwargs)
    ref = TransportBackend(DistTransport(None))
    rows = []
    for nbytes in sizes:
        n = nbytes // 2
        gen = torch.Generator(device="cuda").manual_seed(rank + 1)
        x = (torch.randn(n, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
        for method in methods:
            flag = torch.tensor([time.time() > deadline if deadline else False],
                                device="cuda", dtype=torch.int32)
            dist.all_reduce(flag)                     # all ranks skip together
            if flag.item():
                continue
            state = None
            if method == "p2p4-graph" and nbytes > GRAPH_MAX_BYTES:
                continue
            if method == "nccl16":
                buf = x.clone()
                fn = lambda: dist.all_reduce(buf)     # noqa: E731
            elif method == "p2p4-graph":
                cfg = EchoConfig(bits=4, eta=0.0)
                p2p.run(x, cfg, state=None, backward=False, record=False)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    p2p.run(x, cfg, state=None, backward=False, record=False)
                fn = graph.replay
            elif method.startswith("ref"):
                cfg = EchoConfig(bits=int(method[3:]), eta=0.0)
                fn = lambda: ref.run(x, cfg, state=None, backward=False, record=False)  # noqa
            else:
                bits = int(method[3])
                comp = method.startswith("p2p4c")
                cfg = EchoConfig(bits=bits, eta=0.75 if comp else 0.0,
                                 residual="local" if method.endswith("loc") else "output")
                state = CompState.zeros(n, "cuda") if comp else None
                fn = lambda: p2p.run(x, cfg, state=state, backward=False, record=False)  # noqa
            ms = _time(fn, iters, warmup)
            rows.append({"bytes": nbytes, "method": method, "ms": ms})
            del state
        torch.cuda.empty_cache()
    p2p.check_error()
    p2p.close()
    return rows


def summarize(per_rank: list[list[dict]], world: int) -> list[dict]:
    """Max over ranks of the per-rank medians; speedup vs nccl16; bf16-equivalent bus GB/s."""
    table: dict = {}
    for rows in per_rank:
        for r in rows:
            key = (r["bytes"], r["method"])
            table[key] = max(table.get(key, 0.0), r["ms"])
    out = []
    for (nbytes, method), ms in sorted(table.items()):
        base = table.get((nbytes, "nccl16"))
        out.append({"bytes": nbytes, "method": method, "ms": ms,
                    "speedup": base / ms if base else None,
                    "busbw_GBps": 2 * (world - 1) / world * nbytes / (ms * 1e-3) / 1e9})
    return out


def markdown(rows: list[dict], world: int, header: str = "") -> str:
    sizes = sorted({r["bytes"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    cell = {(r["bytes"], r["method"]): r for r in rows}
    lines = [f"### P={world} all-reduce, bf16 bytes per GPU: ms (speedup vs NCCL)", header, "",
             "| size | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for s in sizes:
        vals = []
        for m in methods:
            r = cell.get((s, m))
            vals.append("-" if r is None else
                        f"{r['ms']:.3f}" + (f" ({r['speedup']:.2f}x)" if r["speedup"] else ""))
        label = f"{s >> 20} MB" if s >= MB else f"{s >> 10} KB"
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def crossover(rows: list[dict], method: str = "p2p4") -> int | None:
    """Smallest size from which `method` beats nccl16 at every larger measured size."""
    cell = {(r["bytes"], r["method"]): r["ms"] for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    best = None
    for s in reversed(sizes):
        a, b = cell.get((s, method)), cell.get((s, "nccl16"))
        if a is None or b is None or a >= b:
            break
        best = s
    return best


def main(world: int = 4, out: str = "out", iters: int = 50, max_mb: int = 1024,
         budget_s: float = 1e9) -> list[dict]:
    os.environ.update(SAFE_ENV)
    sizes = [s for s in SIZES if s <= max_mb * MB]
    per_rank = spawn_nccl(world, bench_worker, sizes, METHODS, iters, 5, time.time() + budget_s)
    rows = summarize(per_rank, world)
    os.makedirs(out, exist_ok=True)
    meta = {"world": world, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "date": time.strftime("%Y-%m-%d"), "crossover_p2p4": crossover(rows)}
    with open(os.path.join(out, f"allreduce_P{world}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = markdown(rows, world, f"{meta['gpu']}, torch {meta['torch']}, {meta['date']}")
    with open(os.path.join(out, f"allreduce_P{world}.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return rows


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-mb", type=int, default=1024)
    a = ap.parse_args()
    main(a.world, a.out, a.iters, a.max_mb)


if __name__ == "__main__":
    cli()
