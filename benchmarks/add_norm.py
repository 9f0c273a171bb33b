"""The block boundary on one GPU: the residual add + RMSNorm after the all-reduce, two parts.

    python benchmarks/add_norm.py --out $OUT                      # both parts, P=4
    python benchmarks/add_norm.py --out $OUT --parts boundary --world 4 --configs c4,u4

Part 'kernel': from the all-reduced y, the add + RMSNorm kernel (kernels/norm_kernels.py, one
pass) against torch's add then the models' RMSNorm; median ms of --iters calls (CUDA events) and
the bytes each must move at least (read y, residual, weight; write residual_out and normed);
the HBM copy of the same run beside it.

Part 'boundary' (issue 18 item 2): from the partials, P simulated ranks on one GPU
(collective/simulated_fused.py: every rank's stage kernels over real per-rank buffers and flags),
the whole boundary three ways (METHODS):

    fused   the all-reduce with the residual added where y is decoded (the reduce's own segment
            and the tail write residual + y), then the norm-only kernel
    kernel  the all-reduce, then the add + RMSNorm kernel
    torch   the all-reduce, then torch's residual + y, then the models' RMSNorm

Per shape (tokens x hidden, one rank's rows) and config: median ms of one whole boundary of
every rank (entry, reduce, tail, epilogue; per rank = /P) replayed from a CUDA graph, the same
eagerly (host launch cost included), and rank 0's reduce + tail + epilogue alone from a graph
(the part where the methods differ; the flags already hold the epoch, so its waits pass). The
stage kernels as routed for the size with overlap off: the fused single kernel and the
overlapped reduce_tail need the P ranks running at once, which one process cannot do. Before
timing, one call of each method from the same state: fused and kernel must agree bit for bit
(outputs and state; the row says so), torch's normed is within its own summation order.
--device cpu: a tiny dry run under TRITON_INTERPRET (tests/test_benchmarks_cpu.py).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from common import median_ms, wall_median_ms

SHAPES = [(8, 4096), (64, 4096), (2048, 4096), (8192, 4096), (32768, 4096), (8192, 8192)]
BOUNDARY_SHAPES = [(8, 4096), (64, 4096), (8192, 4096), (32768, 4096)]
METHODS = ("fused", "kernel", "torch")
EPS = 1e-6


def configs():
    """name -> EchoConfig: c4 the default (compensated, one bf16 state tensor), u4 none."""
    from echo_tp.config import EchoConfig
    return {"c4": EchoConfig(bits=4), "u4": EchoConfig(bits=4, eta=0.0)}


@torch.no_grad()
def kernel_rows(iters: int) -> list[dict]:
    """Part 'kernel': the add + RMSNorm kernel against torch, from y."""
    from echo_tp.kernels import norm_kernels
    from echo_tp.models.transformer import RMSNorm
    rows_out = []
    for rows, h in SHAPES:
        y = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        norm = RMSNorm(h, EPS).cuda().to(torch.bfloat16)
        w = norm.weight.data

        def unfused():
            r = res + y
            return norm(r), r

        def fused():
            return norm_kernels.add_rmsnorm(y, res, w, EPS)
        t_u = median_ms(unfused, iters, 10, barrier=False)
        t_f = median_ms(fused, iters, 10, barrier=False)
        nbytes = 5 * rows * h * 2 + h * 2
        row = {"rows": rows, "hidden": h, "torch_ms": round(t_u, 4), "fused_ms": round(t_f, 4),
               "speedup": round(t_u / t_f, 2), "fused_GBps": round(nbytes / t_f / 1e6, 1)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


class Boundary:
    """One boundary of P simulated ranks: partials x [P, rows*H], residuals [P, rows*H] (one
    per rank), weight [H]; `call(method)` runs every rank's all-reduce and epilogue into
    out (residual_out, or y for 'kernel' / 'torch' first) and normed."""

    def __init__(self, P: int, rows: int, h: int, cfg, dev: str, seed: int = 0):
        from echo_tp.collective import routing, tuning
        from echo_tp.compensator import CompState
        from echo_tp.collective.simulated_fused import SimulatedFused
        from echo_tp.models.transformer import RMSNorm
        self.P, self.rows, self.h, self.cfg = P, rows, h, cfg
        n = rows * h
        call = routing.Call.of(n, 2, cfg, P, on_gpu=True)
        self.route = routing.p2p_route(call, tuning.DEFAULT, "benchmark", form="staged",
                                       overlap="off")
        self.sim = SimulatedFused(P, tile_elems=self.route.tile, step_elems=self.route.step,
                                  num_warps=self.route.num_warps, timeout_polls=10**7)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.x = (torch.randn(P, n, generator=gen, device=dev) * 2).to(torch.bfloat16)
        self.res = (torch.randn(P, n, generator=gen, device=dev) * 4).to(torch.bfloat16)
        self.norm = RMSNorm(h, EPS).to(dev).to(torch.bfloat16)
        self.norm.weight.data = (1 + 0.1 * torch.randn(h, generator=gen, device=dev)) \
            .to(torch.bfloat16)
        self.state = CompState.zeros((P, n), dev, getattr(torch, cfg.state_dtype),
                                     compact=cfg.beta1 == cfg.beta2) if cfg.compensated else None
        self.out = torch.empty_like(self.x)           # y, or residual_out (fused)
        self.normed = torch.empty_like(self.x)        # filled by call(keep=True) only
        self.plans = None
        self._keep = False

    def _epilogue(self, method: str, r: int) -> None:
        from echo_tp.norm import add_rmsnorm, rmsnorm
        rows, h, w = self.rows, self.h, self.norm.weight.data
        y, res = self.out[r].view(rows, h), self.res[r].view(rows, h)
        if method == "fused":                  # out holds residual + y already
            rout, normed = y, rmsnorm(y, w, EPS)
        elif method == "kernel":
            normed, rout = add_rmsnorm(y, res, w, EPS)
        else:
            rout = res + y
            normed = self.norm(rout)
        if self._keep:
            self.out[r].copy_(rout.view(-1))
            self.normed[r].copy_(normed.view(-1))

    def call(self, method: str, keep: bool = False) -> None:
        """One boundary of every rank (keep: leave residual_out in out and normed in normed,
        for the exactness check; copies a timed call does not make)."""
        self._keep = keep
        P = self.P
        self.plans = self.sim.plans(self.x, self.cfg, self.state,
                                    residual=self.res if method == "fused" else None)
        for p in self.plans:
            p.entry()
        for p in self.plans:
            p.reduce(self.out[p.rank])
        for p in self.plans:
            p.tail(self.out[p.rank])
        for r in range(P):
            self._epilogue(method, r)

    def rank0(self, method: str) -> None:
        """Rank 0's reduce, tail and epilogue of the last call again (flags already set)."""
        self._keep = False
        p = self.plans[0]
        p.reduce(self.out[0])
        p.tail(self.out[0])
        self._epilogue(method, 0)

    def check_errors(self) -> None:
        from echo_tp.kernels.flags import describe_error
        ws = self.sim.workspace(self.x.shape[-1], self.cfg.quant_spec(), self.x.device)
        for e in ws["errs"]:
            msg = describe_error(e.cpu())
            if msg is not None:
                raise RuntimeError(msg)


def exactness(b: Boundary) -> dict:
    """One call of each method from the same state: fused == kernel bit for bit (residual_out,
    normed, state); torch's normed against the kernel's (max |difference|)."""
    from echo_tp.compensator import CompState
    start = b.state
    got = {}
    for m in METHODS:
        if start is not None:                  # each method from a copy of the same state
            m1 = start.m1.clone()
            b.state = CompState(m1, m1 if start.compact else start.m2.clone())
        b.call(m, keep=True)
        got[m] = (b.out.clone(), b.normed.clone(), b.state)
    f, k, t = got["fused"], got["kernel"], got["torch"]
    same = torch.equal(f[0].view(torch.int16), k[0].view(torch.int16)) and \
        torch.equal(f[1].view(torch.int16), k[1].view(torch.int16))
    if b.state is not None:
        same = same and torch.equal(f[2].m1, k[2].m1) and torch.equal(f[2].m2, k[2].m2)
    return {"fused_equals_kernel": bool(same),
            "torch_normed_max_diff": float((t[1].float() - k[1].float()).abs().max()),
            "torch_residual_out_equal": bool(torch.equal(t[0], k[0]))}


def _graph_ms(fn, iters: int) -> float:
    """Median ms of replays of a CUDA graph of fn (after eager warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return median_ms(g.replay, iters, 3, barrier=False)


@torch.no_grad()
def boundary_row(P: int, rows: int, h: int, name: str, iters: int, dev: str = "cuda") -> dict:
    """Part 'boundary' for one shape and config -> a row of times (ms) per method."""
    b = Boundary(P, rows, h, configs()[name], dev)
    row = {"P": P, "rows": rows, "hidden": h, "config": name, "tile": b.route.tile,
           "step": b.route.step, **exactness(b)}
    for m in METHODS:
        if dev == "cpu":
            row[f"{m}_eager_ms"] = round(wall_median_ms(lambda: b.call(m), iters), 3)
            continue
        row[f"{m}_ms"] = round(_graph_ms(lambda: b.call(m), iters), 4)
        row[f"{m}_per_rank_ms"] = round(row[f"{m}_ms"] / P, 4)
        row[f"{m}_eager_ms"] = round(median_ms(lambda: b.call(m), iters, 3, barrier=False), 4)
        b.call(m)                                          # rank0 re-runs this call's stages
        row[f"{m}_rank0_ms"] = round(_graph_ms(lambda: b.rank0(m), iters), 4)
    if dev != "cpu":
        for base in ("kernel", "torch"):
            row[f"speedup_vs_{base}"] = round(row[f"{base}_ms"] / row["fused_ms"], 3)
            row[f"rank0_speedup_vs_{base}"] = round(row[f"{base}_rank0_ms"]
                                                    / row["fused_rank0_ms"], 3)
        torch.cuda.synchronize()
    b.check_errors()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--parts", default="kernel,boundary")
    ap.add_argument("--world", type=int, default=4, help="simulated ranks of part 'boundary'")
    ap.add_argument("--configs", default="c4,u4")
    ap.add_argument("--shapes", default=",".join(f"{r}x{h}" for r, h in BOUNDARY_SHAPES),
                    help="TOKENSxHIDDEN of part 'boundary'")
    ap.add_argument("--device", default="cuda", help="'cpu': a dry run under TRITON_INTERPRET")
    a = ap.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels are imported
    parts = a.parts.split(",")
    result: dict = {}
    import triton
    if a.device == "cuda":
        big = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
        big2 = torch.empty_like(big)
        copy_ms = median_ms(lambda: big2.copy_(big), 20, 3)
        del big, big2
        result["meta"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "triton": triton.__version__,
                          "copy_GBps": round(2 * (1 << 29) / copy_ms / 1e6, 1)}
    else:
        result["meta"] = {"gpu": "cpu (interpreter)", "torch": torch.__version__,
                          "triton": triton.__version__}
    print(json.dumps(result["meta"]), flush=True)
    if "kernel" in parts and a.device == "cuda":
        result["rows"] = kernel_rows(a.iters)
    if "boundary" in parts:
        result["boundary"] = []
        for shape in a.shapes.split(","):
            rows, h = map(int, shape.split("x"))
            for name in a.configs.split(","):
                row = boundary_row(a.world, rows, h, name, a.iters, a.device)
                result["boundary"].append(row)
                print(json.dumps(row), flush=True)
                if a.device == "cuda":
                    torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "add_norm.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
