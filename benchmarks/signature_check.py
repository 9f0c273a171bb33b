"""What the per-signature agreement check costs a call (communicator.check_same_call), on gloo.

    python benchmarks/signature_check.py --world 2 --numel 1024 65536 1048576 --out s.json

Per message size, medians over --iters calls on every rank (rank 0 reported):
  lookup_us   the check on a steady-state call: one set lookup of the cached signature
  checked_us  one call that runs the check (a 4-integer all-gather): ECHO_DEBUG_CHECKS=1,
              what every first call of a signature pays once
  call_us     one cached 4-bit all-reduce of that size (what the lookup is compared with)
A steady-state call pays lookup_us, a new signature once pays checked_us - call_us.
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
from common import wall_median_ms


def _rank(rank, world_size, sizes, iters):
    import torch.distributed as dist

    from echo_tp import EchoCommunicator, EchoConfig
    rows = []
    for n in sizes:
        x = torch.randn(n)
        comm = EchoCommunicator.from_group(None, EchoConfig(bits=4, eta=0.0))
        comm.all_reduce(x)                                   # the signature is checked here
        cfg = comm.config_for(None)
        lookup = 1e3 * wall_median_ms(lambda: comm._check_call(x, cfg, "forward", "all_reduce"),
                                    iters * 50)
        dist.barrier()
        call = 1e3 * wall_median_ms(lambda: comm.all_reduce(x), iters)
        comm._debug_checks = True                            # = ECHO_DEBUG_CHECKS=1
        comm._checked.clear()
        dist.barrier()
        checked = 1e3 * wall_median_ms(lambda: comm.all_reduce(x), iters)
        rows.append({"numel": n, "lookup_us": lookup, "call_us": call, "checked_us": checked,
                     "check_collective_us": checked - call})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--numel", type=int, nargs="+", default=[1024, 65536, 1 << 20])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from echo_tp.launch import run_ranks
    rows = run_ranks(a.world, _rank, a.numel, a.iters, timeout=1800.0)[0]
    for r in rows:
        print(f"numel {r['numel']:>9}  lookup {r['lookup_us']:7.3f} us  call {r['call_us']:10.1f}"
              f" us  call+check {r['checked_us']:10.1f} us  (check {r['check_collective_us']:+.1f}"
              f" us, once per signature)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"world": a.world, "iters": a.iters, "machine": platform.node(),
                       "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
