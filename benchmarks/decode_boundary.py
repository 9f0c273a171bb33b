"""The decode block boundary on one GPU with P simulated ranks: the one-shot all-reduce + add +
RMSNorm as one kernel (kernels/oneshot_kernels.oneshot_add_rmsnorm_kernel) against the two
launches it replaces (oneshot_kernel's sum, then norm_kernels.add_rmsnorm).

Every rank's push runs first (PHASES 1: it sets the flags), then rank 0's sum side is timed
alone, as CUDA-graph replays of `--iters` calls (its waits pass at once: PHASES 2 reuses the
push's epoch), median of --reps replays:

    fused    oneshot_add_rmsnorm (PHASES 2)          one launch: y never leaves registers
    unfused  oneshot (PHASES 2) -> y; add_rmsnorm(y)  two launches, y written and read back

The push is the same in both (each rank stores its x into its peers' slots) and is left out.
Outputs are checked against the pure-torch reference (oneshot_add_rmsnorm_reference) bit for
bit before timing.

    python benchmarks/decode_boundary.py --out $OUT [--worlds 2,4,8] [--rows 1,8,32,128]
        [--hidden 4096,8192]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from echo_tp.kernels import norm_kernels
from echo_tp.kernels import oneshot_kernels as ok
from echo_tp.kernels.flags import new_error_buffer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


class Ranks:
    """P simulated ranks' one-shot buffers on one GPU (the layout of collective/oneshot.py)."""

    def __init__(self, P: int, cap_bytes: int, programs: int):
        self.P = P
        self.lay = ok.OneShotLayout.build(P, cap_bytes)
        self.bufs = [torch.zeros(self.lay.nbytes, dtype=torch.uint8, device="cuda")
                     for _ in range(P)]
        self.errs = [new_error_buffer(True) for _ in range(P)]
        self.tables = [torch.tensor([b.data_ptr() for b in self.bufs] + [e.data_ptr()],
                                    dtype=torch.int64, device="cuda") for e in self.errs]
        self.epochs = [torch.zeros(programs, dtype=torch.int64, device="cuda")
                       for _ in range(P)]

    def kw(self, r: int, phases: int) -> dict:
        return dict(rank=r, lay=self.lay, epochs=self.epochs[r], table=self.tables[r],
                    timeout=10**9, use_timer=True, phases=phases)


def graph_ms(fn, iters: int, reps: int) -> float:
    """Median ms of one fn() as replays of a CUDA graph of `iters` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def case(P: int, rows: int, H: int, iters: int, reps: int, programs: int) -> dict:
    from harness import bits_differ
    dt = torch.bfloat16
    ranks = Ranks(P, max(rows * H * 2, 256), programs)
    xs = [torch.randn(rows, H, device="cuda", dtype=dt) for _ in range(P)]
    res = torch.randn(rows, H, device="cuda", dtype=dt)
    w = torch.randn(H, device="cuda", dtype=dt)
    eps = 1e-6
    for r in range(P):                                     # every rank's push: the flags
        ok.oneshot_add_rmsnorm(xs[r], res, w, eps, **ranks.kw(r, 1))
    normed, rout = ok.oneshot_add_rmsnorm(xs[0], res, w, eps, **ranks.kw(0, 2))
    want = ok.oneshot_add_rmsnorm_reference(xs, res, w, eps)
    exact = not (bits_differ(normed, want[0]).any() or bits_differ(rout, want[1]).any())
    # the same epoch for the unfused kernel: its own buffers, pushed the same way
    ranks2 = Ranks(P, max(rows * H * 2, 256), programs)
    y = torch.empty_like(xs[0])
    for r in range(P):
        ok.oneshot(xs[r].reshape(-1), y.reshape(-1), **ranks2.kw(r, 1))
    out = (torch.empty_like(normed), torch.empty_like(rout))

    def fused():
        ok.oneshot_add_rmsnorm(xs[0], res, w, eps, out=out, **ranks.kw(0, 2))

    def unfused():
        ok.oneshot(xs[0].reshape(-1), y.reshape(-1), **ranks2.kw(0, 2))
        norm_kernels.add_rmsnorm(y, res, w, eps)

    unfused()
    torch.cuda.synchronize()
    exact_unfused = not (bits_differ(norm_kernels.add_rmsnorm(y, res, w, eps)[0],
                                     want[0]).any())
    f_ms = graph_ms(fused, iters, reps)
    u_ms = graph_ms(unfused, iters, reps)
    return {"P": P, "rows": rows, "hidden": H, "dtype": "bf16", "fused_us": round(f_ms * 1e3, 2),
            "unfused_us": round(u_ms * 1e3, 2), "speedup": round(u_ms / f_ms, 3),
            "fused_bit_exact": exact, "unfused_bit_exact": exact_unfused}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--programs", type=int, default=528,
                    help="programs per launch (collective/oneshot.py: 4 x the SM count; rows "
                         "beyond it run in turn)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows_out = []
    for P in map(int, args.worlds.split(",")):
        for H in map(int, args.hidden.split(",")):
            for rows in map(int, args.rows.split(",")):
                try:
                    row = case(P, rows, H, args.iters, args.reps, args.programs)
                except Exception as e:          # one failing case must not lose the others
                    row = {"P": P, "rows": rows, "hidden": H,
                           "error": f"{type(e).__name__}: {e}"[:300]}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "decode-boundary.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
