"""What the ranks' call agreement costs a call (agreement.Agreement.check; on CPU also the in-band
length check, collective/inband.py; on GPUs the p2p and one-shot kernels' packet headers), on
gloo or (--backend nccl, one GPU a rank) NCCL.

    python benchmarks/signature_check.py --world 2 --lengths 1000 --out serve.json   # serving
    python benchmarks/signature_check.py --world 2 --numel 1024 65536 --out s.json   # per size
    python benchmarks/signature_check.py --backend nccl --world 2 --lengths 1000 --hidden 4096 \
        --configs echo4 --out serve-gpu.json      # GPUs: one-shot, NCCL and p2p routes by size

--lengths N, serving: partials [tokens, --hidden] for N distinct token counts (1..N, in a seeded
random order, as prefill lengths arrive), one call each in a forward pass of its own: pass "new";
then the same N calls again: pass "seen", the steady state where every length was met before.
Per config and pass, on rank 0: wall seconds, median and mean ms per call, `checks` = the agreement collectives the calls ran
(all-gathers of int64 values: signature and width agreements, each also a host read; counted by
wrapping torch.distributed.all_gather) and `kept` = what the communicator remembers after the pass
(its signature and width caches). The per-new-length cost is (new - seen) / N. Run it with
PYTHONPATH=<another tree>/src to measure that tree (main's, for before / after on one machine).
--paired adds the steady-state price of the in-band length (padded rows + header): each call on
an in-band communicator and on one sending bare rows (its exact checks remembered: what a seen
length costs on main), alternating, so that both meet the same load on a shared host.

--numel, per size: lookup_us (one steady-state check: a cache lookup), call_us (one 4-bit call),
checked_us (one call that runs the agreement: ECHO_DEBUG_CHECKS=1) and their difference.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch
import torch.distributed as dist
from common import wall_median_ms


class _Counter:
    """Counts all-gathers of int64 tensors (the agreement collectives) through dist.all_gather."""

    def __init__(self):
        self.count = 0
        self._real = dist.all_gather

        def counted(tensors, tensor, *a, **kw):
            if tensor.dtype == torch.int64:
                self.count += 1
            return self._real(tensors, tensor, *a, **kw)
        dist.all_gather = counted


def _kept(comm) -> dict:
    """The sizes of the communicator's caches (whichever this tree has)."""
    out = {}
    for name in ("_checked", "_agreed"):
        kept = getattr(getattr(comm, "agreement", comm), name, None)
        if kept is not None:
            out[name.strip("_")] = len(kept)
    ref = getattr(comm.dispatcher, "backends", {}).get("reference")
    widths = getattr(getattr(ref, "transport", None), "widths", None)
    if widths is not None:
        out["widths"] = len(widths)
    return out


def _serve(rank, world_size, lengths, hidden, configs, seed, paired, cuda=False):
    from echo_tp import EchoCommunicator, EchoConfig
    counter = _Counter()
    order = list(range(1, lengths + 1))
    random.Random(seed).shuffle(order)
    gen = torch.Generator().manual_seed(seed + rank)
    dev = "cpu"
    if cuda:
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
    xs = [torch.randn(t, hidden, generator=gen).to(dev, torch.bfloat16 if cuda else None)
          for t in order]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for name in configs:
        comm = EchoCommunicator.from_group(None, EchoConfig.from_name(name))
        for phase in ("new", "seen"):
            dist.barrier()
            counter.count = 0
            times = []
            t0 = time.perf_counter()
            routes: dict = {}
            for x in xs:
                t = time.perf_counter()
                comm.new_pass("forward")                     # a request's forward pass
                comm.all_reduce(x)
                sync()
                times.append((time.perf_counter() - t) * 1e3)
                backend = comm.dispatcher.last_backend
                routes[backend] = routes.get(backend, 0) + 1
            if cuda:
                for b in comm.dispatcher.backends.values():
                    getattr(b, "check_error", lambda: None)()
            rows.append({"config": name, "pass": phase, "calls": len(xs), "routes": routes,
                         "seconds": time.perf_counter() - t0,
                         "median_ms": statistics.median(times),
                         "mean_ms": statistics.fmean(times), "checks": counter.count,
                         "kept": _kept(comm)})
        if paired and comm.config.quantized and getattr(comm, "_lengths", None) is not None:
            rows.append(_paired(comm, EchoCommunicator.from_group(None, comm.config), xs, name))
        comm.close()
    return rows


def _paired(inband, exact, xs, name: str) -> dict:
    """The steady-state price of the in-band length (padded rows + header): every length seen,
    each call made on `inband` and on `exact` (the same calls with bare rows: this tree's exact
    check, remembered), in alternating order, so both meet the same load."""
    exact.agreement.lengths = None
    for x in xs:                                   # every exact signature remembered first
        exact.new_pass("forward")
        exact.all_reduce(x)
    t = {"inband": [], "exact": []}
    for i, x in enumerate(xs):
        for which in (("inband", "exact") if i % 2 else ("exact", "inband")):
            comm = inband if which == "inband" else exact
            dist.barrier()
            t0 = time.perf_counter()
            comm.new_pass("forward")
            comm.all_reduce(x)
            t[which].append((time.perf_counter() - t0) * 1e3)
    diff = [a - b for a, b in zip(t["inband"], t["exact"])]
    return {"config": name, "pass": "paired", "calls": len(xs),
            "inband_median_ms": statistics.median(t["inband"]),
            "exact_median_ms": statistics.median(t["exact"]),
            "median_diff_ms": statistics.median(diff),
            "sum_ratio": sum(t["inband"]) / sum(t["exact"])}


def _sizes(rank, world_size, sizes, iters):
    from echo_tp import EchoCommunicator, EchoConfig
    rows = []
    for n in sizes:
        x = torch.randn(n)
        comm = EchoCommunicator.from_group(None, EchoConfig(bits=4, eta=0.0))
        comm.all_reduce(x)                                   # the signature is checked here
        cfg = comm.config_for(None)
        lookup = 1e3 * wall_median_ms(lambda: comm.agreement.check(x, cfg, "forward", "all_reduce"),
                                      iters * 50)
        dist.barrier()
        call = 1e3 * wall_median_ms(lambda: comm.all_reduce(x), iters)
        comm.agreement.debug = True                          # = ECHO_DEBUG_CHECKS=1
        comm.agreement._checked.clear()
        dist.barrier()
        checked = 1e3 * wall_median_ms(lambda: comm.all_reduce(x), iters)
        rows.append({"numel": n, "lookup_us": lookup, "call_us": call, "checked_us": checked,
                     "check_collective_us": checked - call})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="nccl: one GPU a rank, bf16 partials (serving only)")
    p.add_argument("--lengths", type=int, default=None, help="serving: N distinct lengths")
    p.add_argument("--hidden", type=int, default=64, help="serving: values per token")
    p.add_argument("--configs", nargs="+", default=["echo4", "16"], help="serving: presets")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paired", action="store_true", help="serving: also the steady-state price "
                   "of the in-band length, paired call by call against bare rows (this tree)")
    p.add_argument("--numel", type=int, nargs="+", default=[1024, 65536, 1 << 20])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import echo_tp
    from echo_tp.launch import run_ranks
    record = {"world": a.world, "machine": platform.node(), "processor": platform.processor(),
              "torch": torch.__version__, "echo_tp": str(echo_tp.__file__)}
    if a.lengths:
        rows = run_ranks(a.world, _serve, a.lengths, a.hidden, a.configs, a.seed, a.paired,
                         a.backend == "nccl", timeout=3600.0, backend=a.backend)[0]
        for r in rows:
            if r["pass"] == "paired":
                print(f"{r['config']:>6} paired: in-band {r['inband_median_ms']:7.3f} ms, bare "
                      f"rows {r['exact_median_ms']:7.3f} ms (medians), median difference "
                      f"{r['median_diff_ms']:+.3f} ms, total ratio {r['sum_ratio']:.3f}")
                continue
            print(f"{r['config']:>6} {r['pass']:>4}: {r['calls']} calls {r['seconds']:7.2f} s  "
                  f"median {r['median_ms']:7.3f} ms  mean {r['mean_ms']:7.3f} ms  "
                  f"checks {r['checks']:5d}  kept {r['kept']}  routes {r['routes']}")
        record.update(lengths=a.lengths, hidden=a.hidden, seed=a.seed, backend=a.backend,
                      rows=rows)
    else:
        rows = run_ranks(a.world, _sizes, a.numel, a.iters, timeout=1800.0)[0]
        for r in rows:
            print(f"numel {r['numel']:>9}  lookup {r['lookup_us']:7.3f} us  call "
                  f"{r['call_us']:10.1f} us  call+check {r['checked_us']:10.1f} us  (check "
                  f"{r['check_collective_us']:+.1f} us, once per signature)")
        record.update(iters=a.iters, rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
