"""Peak host memory of one all-reduce call on the CPU backends, relative to its input's bytes.

    python benchmarks/memory.py --backend simulated --numel 67108864 --dtype bfloat16
    python benchmarks/memory.py --backend reference --world 2 --numel 16777216 --out m.json

Each (config, dtype) runs in a fresh process: the inputs and the compensator state are built
first, then the peak resident set (ru_maxrss) during one call, less the resident set just
before it, is the call's peak (temporaries plus its output). input bytes: the [P, N] stack
(simulated) or one rank's N values (reference, measured on every rank, the largest reported).
The last word printed is the largest ratio (tests/test_defined_answers.py reads it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys

import torch


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _measure(comm, x: torch.Tensor, direction: str) -> dict:
    """One call's peak over the resident set before it, in bytes, with its input's bytes."""
    cfg = comm.config
    n = x.shape[-1] if comm.simulated else x.numel()
    if cfg.compensated:   # the persistent state exists before the measured call
        batch = (x.shape[0],) if comm.simulated else ()
        comm.passes[direction].get(n, batch, x.device, getattr(torch, cfg.state_dtype),
                                   compact=cfg.beta1 == cfg.beta2)
    before = _rss_kib()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    y = comm.all_reduce(x, direction=direction)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del y
    return {"input_bytes": x.numel() * x.element_size(), "peak_bytes": (peak - before) * 1024,
            "stale_peak": peak_before > before + 1024}   # an earlier peak hides this one


def _rank(rank, world_size, numel, dtype, config, direction):
    from echo_tp import EchoCommunicator, EchoConfig
    torch.manual_seed(rank)
    comm = EchoCommunicator.from_group(None, EchoConfig.from_name(config))
    comm.all_reduce(torch.randn(4096, dtype=dtype), direction=direction)   # warm-up
    return _measure(comm, torch.randn(numel, dtype=dtype), direction)


def one(backend: str, world: int, numel: int, dtype: str, config: str, direction: str,
        chunk_elems: int | None) -> dict:
    from echo_tp import EchoConfig, SimulatedCommunicator
    if chunk_elems is not None:
        from echo_tp.collective import chunked
        chunked.CHUNK_ELEMS = chunk_elems
    dt = getattr(torch, dtype)
    if backend == "simulated":
        comm = SimulatedCommunicator(world, EchoConfig.from_name(config))
        comm.all_reduce(torch.randn(world, 4096, dtype=dt), direction=direction)
        m = _measure(comm, torch.randn(world, numel, dtype=dt), direction)
    else:
        from echo_tp.launch import run_ranks
        ms = run_ranks(world, _rank, numel, dt, config, direction, timeout=1800.0)
        m = max(ms, key=lambda r: r["peak_bytes"])
    return {**m, "ratio": m["peak_bytes"] / m["input_bytes"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["simulated", "reference"], default="simulated")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--numel", type=int, default=1 << 24, help="values per rank")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--configs", nargs="+", default=["16", "4", "echo4", "echo4-2ts"])
    p.add_argument("--direction", default="forward", choices=["forward", "backward"])
    p.add_argument("--chunk-elems", type=int, default=None,
                   help="smallest chunk (collective/chunked.py; simulated only): default the "
                   "package's CHUNK_ELEMS")
    p.add_argument("--out", default=None, help="JSON record")
    p.add_argument("--quiet", action="store_true", help="print only the largest ratio")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:   # the child: one measurement, JSON on stdout
        print(json.dumps(one(a.backend, a.world, a.numel, a.dtype[0], a.configs[0],
                             a.direction, a.chunk_elems)))
        return
    rows = []
    for config in a.configs:
        for dtype in a.dtype:
            cmd = [sys.executable, __file__, "--one", "--backend", a.backend, "--world",
                   str(a.world), "--numel", str(a.numel), "--dtype", dtype, "--configs", config,
                   "--direction", a.direction]
            if a.chunk_elems is not None:
                cmd += ["--chunk-elems", str(a.chunk_elems)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row = {"config": config, "dtype": dtype, **json.loads(out.stdout.splitlines()[-1])}
            rows.append(row)
            if not a.quiet:
                print(f"{config:>10} {dtype:>9}  input {row['input_bytes'] / 2**20:9.1f} MiB  "
                      f"peak {row['peak_bytes'] / 2**20:9.1f} MiB  {row['ratio']:5.2f}x"
                      + ("  (stale peak)" if row["stale_peak"] else ""))
    if a.out:
        record = {"backend": a.backend, "world": a.world, "numel": a.numel,
                  "chunk_elems": a.chunk_elems,
                  "direction": a.direction, "machine": platform.node(),
                  "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                  "command": " ".join(sys.argv), "rows": rows}
        with open(a.out, "w") as f:
            json.dump(record, f, indent=2)
    print("max ratio", max(r["ratio"] for r in rows))


if __name__ == "__main__":
    main()
