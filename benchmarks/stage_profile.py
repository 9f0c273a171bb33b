"""Per-stage cost of the p2p kernels on ONE GPU, without the link: the compute + HBM floor.

P simulated ranks live on one GPU (collective/simulated_fused.py layout: P byte buffers, real
flags). One full call sets every flag; then each stage kernel of rank 0 is re-launched alone
(its waits pass at once: the flags already hold the epoch) and timed with CUDA events, median
of --reps. Values per second are per stage (entry: (P-1)/P n values, reduce: n/P, tail: n, or
(P-1)/P n when the reduce wrote the own segment's y).
Compare with the all-reduce benchmark's times on P GPUs to see how far the link and the
stage serialization add on top.

Parts (--parts): the all-reduce of n values per rank, and its two halves on the same layout
(sequence parallelism: the reduce-scatter of the same n values, the all-gather back to n):

    all_reduce      entry, reduce, tail              (values: (P-1)/P n, n/P, n or (P-1)/P n)
    reduce_scatter  entry, reduce (HALF=1: no requantization)      ((P-1)/P n, n/P)
    all_gather      encode (the reduce kernel, HALF=2), tail over all P owners   (n/P, n)

A part's row has <stage>_ms and <stage>_Gval_s for its stages, and sum_ms. The halves warm
up only what rank 0's timed stages wait for (every rank's entry, or encode; rank 0's reduce,
or tail): fewer cold compiles. Shape 'route': the tile, step and warps the routing policy
picks for the call (collective/routing.p2p_route, staged form).

    python benchmarks/stage_profile.py --out $OUT [--numel 67108864] [--label new]
        [--parts all_reduce,reduce_scatter,all_gather] [--shapes route,2048x4]

Run it twice with PYTHONPATH pointing at two source trees to compare kernel versions in one
device call (the JSON rows carry --label).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

CONFIGS = {
    # name: (bits, residual or None, state dtype, compact)
    "u4": (4, None, "float32", False),
    "u8": (8, None, "float32", False),
    "c4-loc-f32": (4, "local", "float32", False),
    "c4-loc-bf16c": (4, "local", "bfloat16", True),
    "c4-out-f32": (4, "output", "float32", False),
}


def _timer(dev: str):
    """() -> stop(): milliseconds of the work queued in between (CUDA events, or wall time)."""
    if dev == "cpu":
        t0 = time.perf_counter()
        return lambda: (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()

    def stop():
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    return stop


PARTS = {
    # part: its stages (x [P, n] -> y [P, n]; reduce-scatter: -> [P, n/P]; all-gather: [P, n/P]
    # -> [P, n])
    "all_reduce": ("entry", "reduce", "tail"),
    "reduce_scatter": ("entry", "reduce"),
    "all_gather": ("encode", "tail"),
}


def config(name: str, outlier: bool | None = None):
    """The EchoConfig of a CONFIGS name (outlier: the packet's outlier word on or off; None:
    EchoConfig's default)."""
    from echo_tp.config import EchoConfig
    bits, resid, sdt, compact = CONFIGS[name]
    betas = dict(beta1=0.5, beta2=0.5) if compact else dict(beta1=0.7, beta2=0.3)
    word = {} if outlier is None else dict(outlier=outlier)
    return EchoConfig(bits=bits, eta=1.0 if resid else 0.0, residual=resid or "local",
                      state_dtype=sdt, **betas, **word)


def route_shape(P: int, n: int, name: str, outlier: bool | None = None) -> tuple[int, int, int]:
    """(tile, warps, step) the routing policy picks for a staged call of n bf16 values."""
    from echo_tp.collective import routing, tuning
    call = routing.Call.of(n, 2, config(name, outlier), P, on_gpu=True)
    r = routing.p2p_route(call, tuning.DEFAULT, "stage profile", form="staged")
    return r.tile, r.num_warps, r.step


def stage_times(P: int, n: int, name: str, tile: int, warps: int, reps: int,
                dev: str = "cuda", step: int | None = None,
                stages: int | None = None, part: str = "all_reduce",
                outlier: bool | None = None) -> dict:
    """One row: the median ms of each stage of `part` (PARTS) on rank 0, n values per rank
    (the all-reduce's and the reduce-scatter's input, the all-gather's output)."""
    from echo_tp.compensator import CompState
    from echo_tp.collective.simulated_fused import SimulatedFused
    names = PARTS[part]
    _, _, sdt, compact = CONFIGS[name]
    cfg = config(name, outlier)
    sim = SimulatedFused(P, tile_elems=tile, timeout_polls=10**7, step_elems=step or tile,
                         num_warps=warps, num_stages=stages)
    n_in = n // P if part == "all_gather" else n
    x = torch.randn(P, n_in, device=dev, dtype=torch.bfloat16)
    st = CompState.zeros((P, n_in), dev, getattr(torch, sdt), compact=compact) \
        if cfg.compensated else None
    y = torch.empty(P, n // P if part == "reduce_scatter" else n, device=dev,
                    dtype=torch.bfloat16)
    half = None if part == "all_reduce" else part
    plans = sim.plans(x, cfg, st, half=half)
    for i, stage in enumerate(names):                        # sets the flags (and JITs)
        last = half is not None and i == len(names) - 1      # only rank 0's waits matter
        for p in plans[:1] if last else plans:
            _stage(p, stage, y)()
    if dev != "cpu":
        torch.cuda.synchronize()
    out = {"P": P, "numel": n, "config": name, "part": part, "tile": tile, "warps": warps,
           "step": step or tile, "num_stages": stages, "outlier": cfg.outlier}
    tail_share = n * (P - 1) / P if plans[0].own_y else n     # the reduce wrote the own y
    share = {"entry": n * (P - 1) / P, "reduce": n / P, "tail": tail_share, "encode": n / P}
    for stage in names:
        run = _stage(plans[0], stage, y)
        times = []
        for _ in range(reps):
            stop = _timer(dev)
            run()
            times.append(stop())
        ms = statistics.median(times)
        out[f"{stage}_ms"] = round(ms, 4)
        out[f"{stage}_Gval_s"] = round(share[stage] / ms / 1e6, 1)
    out["sum_ms"] = round(sum(out[f"{stage}_ms"] for stage in names), 4)
    return out


def _stage(plan, stage: str, y: torch.Tensor):
    """() -> launches `stage` of one rank's plan (y [P, ...]: its output is y[rank])."""
    if stage in ("entry", "encode"):
        return getattr(plan, stage)
    return lambda f=getattr(plan, stage): f(y[plan.rank])


def copy_baseline(nbytes: int, reps: int, dev: str = "cuda") -> dict:
    """HBM roofline of this GPU in the same run: a device-to-device copy of nbytes, median of
    reps; read + write bytes per second."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        stop = _timer(dev)
        b.copy_(a)
        times.append(stop())
    ms = statistics.median(times)
    return {"copy_bytes": nbytes, "copy_ms": round(ms, 4),
            "copy_GBps": round(2 * nbytes / ms / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--label", default="current")
    ap.add_argument("--numel", type=int, default=64 << 20, help="values per rank")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shapes", default="1024x4,2048x4,2048x8,4096x4",
                    help="TILExWARPS[sSTEP][nSTAGES] (values per tile x warps, values per "
                         "step, triton pipelining depth), or 'route' (the routing's shape)")
    ap.add_argument("--parts", default="all_reduce",
                    help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--device", default="cuda", help="'cpu': a dry run under TRITON_INTERPRET")
    ap.add_argument("--outlier", default="default", choices=("default", "on", "off"),
                    help="the packet's outlier word (default: EchoConfig's)")
    args = ap.parse_args()
    outlier = {"on": True, "off": False}.get(args.outlier)
    os.makedirs(args.out, exist_ok=True)
    t_end = time.time() + args.budget_s
    rows = []
    base = copy_baseline(2 * args.numel, args.reps, args.device)
    print(json.dumps(base), flush=True)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    for P in map(int, args.worlds.split(",")):
        for name in args.configs.split(","):
            for shape in args.shapes.split(","):
                if shape == "route":
                    tile, warps, step = route_shape(P, args.numel, name, outlier)
                    stages = ""
                else:
                    tile, rest = shape.split("x")
                    rest, _, stages = rest.partition("n")
                    warps, _, step = rest.partition("s")
                    tile, warps, step = int(tile), int(warps), int(step or tile)
                for part in parts:
                    if time.time() > t_end:
                        print("budget spent; stopping", flush=True)
                        break
                    try:
                        row = stage_times(P, args.numel, name, tile, warps, args.reps,
                                          args.device, step, int(stages) if stages else None,
                                          part, outlier)
                    except Exception as e:   # one failing variant must not lose the others
                        row = {"P": P, "config": name, "part": part, "tile": tile,
                               "warps": warps, "error": f"{type(e).__name__}: {e}"[:300]}
                    row["label"] = args.label
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.device != "cpu":
                        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu (interpreter)"
    with open(os.path.join(args.out, f"stages-{args.label}.json"), "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "copy": base,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
