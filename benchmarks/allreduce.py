"""All-reduce latency at P GPUs: NCCL 16-bit vs the reference (two NCCL collectives) vs p2p.

    python benchmarks/allreduce.py --world 4 --out out/ [--methods nccl16,p2p4,auto4c]

Per message size (bf16 bytes per GPU) and method: warm-up, then `iters` back-to-back calls (at
least 300 up to 4 MiB) each bracketed by CUDA events; the median per rank, the max over ranks
reported. Methods are the named rows of METHODS below (what each runs, its config, and for p2p
the kernel form and overlap, forced or as routed). Bus bandwidth uses bf16-equivalent bytes:
2 (P-1)/P * bytes / time (the nccl-tests convention). Writes allreduce_P{P}.json/.md/.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
from common import median_ms, spawn_nccl

from echo_tp.config import EchoConfig

MB = 1 << 20
SIZES = [64 << 10, 256 << 10, MB, 4 * MB, 16 * MB, 64 * MB, 128 * MB, 256 * MB, 512 * MB,
         1024 * MB]
U4, U8 = EchoConfig(bits=4, eta=0.0), EchoConfig(bits=8, eta=0.0)
C4 = EchoConfig(bits=4)                                       # the default: one bf16 state
PAPER = EchoConfig.from_name("echo4-2ts")                     # the paper's fp32 pair, local
PAPER_OUT = EchoConfig(bits=4, eta=0.75, a=0.35, beta1=0.7, beta2=0.3, state_dtype="float32",
                       residual="output")                     # the paper's residual too


@dataclass(frozen=True)
class Method:
    """One benchmarked way to all-reduce.
    kind: 'nccl' (dist.all_reduce in place), 'oneshot' (the 16-bit one-shot kernel, in place,
    up to max_bytes), 'reference' (the reference backend over NCCL), 'p2p' (P2PBackend with
    the route 'p2p' mode gives; form / overlap forced where set), 'graph' (one p2p call
    captured in a CUDA graph and replayed, up to max_bytes), 'unfused' (the output-residual
    compensator as separate torch ops around an uncompensated p2p call), 'auto'
    (EchoCommunicator with backend='auto', in place: what a TP layer gets)."""

    kind: str
    cfg: EchoConfig | None = None
    form: str | None = None           # p2p: 'fused' | 'staged' | None (by size)
    overlap: str | None = None        # staged p2p: 'off' | 'launch' | None (as measured)
    max_bytes: int | None = None


METHODS: dict[str, Method] = {
    "nccl16": Method("nccl"),
    "oneshot16": Method("oneshot", max_bytes=64 * MB),
    "ref4": Method("reference", U4),
    "ref8": Method("reference", U8),
    "p2p4": Method("p2p", U4),
    "p2p4-fused": Method("p2p", U4, form="fused"),
    "p2p4-staged": Method("p2p", U4, form="staged", overlap="off"),
    "p2p4-launch": Method("p2p", U4, form="staged", overlap="launch"),
    "p2p8": Method("p2p", U8),
    "p2p8-staged": Method("p2p", U8, form="staged", overlap="off"),
    "p2p8-launch": Method("p2p", U8, form="staged", overlap="launch"),
    "p2p4c": Method("p2p", C4),
    "p2p4c-staged": Method("p2p", C4, form="staged"),
    "p2p4c-fp32": Method("p2p", PAPER),
    "p2p4c-out": Method("p2p", PAPER_OUT),
    "p2p4c-out-unfused": Method("unfused", PAPER_OUT),
    "p2p4-graph": Method("graph", U4, max_bytes=64 * MB),
    "auto4": Method("auto", U4),
    "auto4c": Method("auto", C4),
    "auto4c-fp32": Method("auto", PAPER),
}
DEFAULT_METHODS = ("nccl16", "oneshot16", "ref4", "p2p8", "p2p4", "p2p4-staged", "p2p4c",
                   "p2p4c-staged", "p2p4c-fp32", "p2p4-graph", "auto4", "auto4c",
                   "auto4c-fp32")
STAGE_MIN_BYTES = 64 * MB


def ceilings(rank: int, world: int, nbytes: int = 1 << 30, iters: int = 10) -> dict:
    """Measured ceilings on this rank: local device-to-device copy (read + write bytes / s),
    and NVLink writes into the next rank's symmetric buffer while every rank writes at once:
    a copy-engine memcpy ('ce_push') and an SM kernel storing to the peer ('sm_push'),
    per-direction GB/s."""
    from torch.distributed import _symmetric_memory as symm
    out = {}
    a = torch.randn(nbytes // 4, device="cuda")
    b = torch.empty_like(a)

    def med(fn):
        return median_ms(fn, iters, 2)

    ms = med(lambda: b.copy_(a))
    out["d2d_copy_GBps"] = 2 * nbytes / (ms * 1e-3) / 1e9
    peer_bytes = min(nbytes, 256 << 20)
    try:
        if symm.get_backend(torch.device("cuda", rank)) is None:
            symm.set_backend("CUDA")
    except Exception:  # noqa: BLE001
        pass
    buf = symm.empty(peer_bytes, dtype=torch.uint8, device="cuda")
    hdl = symm.rendezvous(buf, dist.group.WORLD)
    offset = buf.data_ptr() - int(hdl.buffer_ptrs[rank])          # bytes; 0 in practice
    peer = hdl.get_buffer((rank + 1) % world, (peer_bytes // 4,), torch.float32, offset // 4)
    src = a[:peer_bytes // 4]
    ms = med(lambda: peer.copy_(src))
    out["ce_push_GBps"] = peer_bytes / (ms * 1e-3) / 1e9
    ms = med(lambda: torch.mul(src, 1.0, out=peer))
    out["sm_push_GBps"] = peer_bytes / (ms * 1e-3) / 1e9
    dst = b[:peer_bytes // 4]
    ms = med(lambda: torch.mul(peer, 1.0, out=dst))
    out["sm_pull_GBps"] = peer_bytes / (ms * 1e-3) / 1e9
    torch.cuda.synchronize()
    dist.barrier()
    del peer, hdl, buf
    return out


def stage_times(p2p, x, cfg, route, state, iters: int = 20) -> dict:
    """Median ms of entry, reduce (its waits included) and tail of staged p2p calls, from CUDA
    events recorded between the launches of the call's plan (P2PBackend.prepare); with overlap
    'launch' reduce is both and tail 0."""
    per = {"entry": [], "reduce": [], "tail": []}
    dist.barrier()
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        plan, ws, y = p2p.prepare(x, cfg, route, state=state, backward=False)
        ev[0].record()
        plan.entry()
        ev[1].record()
        if route.overlap == "launch":
            plan.reduce_tail(y, ws.ticket, p2p.overlap_lag)
        else:
            plan.reduce(y)
        ev[2].record()
        if route.overlap != "launch":
            plan.tail(y)
        ev[3].record()
        torch.cuda.synchronize()
        for k, name in enumerate(per):
            per[name].append(ev[k].elapsed_time(ev[k + 1]))
    return {k: statistics.median(v) for k, v in per.items()}


class _Bench:
    """The backends of one rank, built once; `call(method, x)` -> a no-argument timed call."""

    def __init__(self, sizes):
        from echo_tp.collective.dispatch import TransportBackend
        from echo_tp.collective.oneshot import OneShotBackend
        from echo_tp.collective.p2p import P2PBackend
        from echo_tp.collective.reference import DistTransport
        self.world = dist.get_world_size()
        self.p2p = P2PBackend(None)
        self.one = OneShotBackend(None, cap_bytes=min(max(sizes), METHODS["oneshot16"].max_bytes))
        self.ref = TransportBackend(DistTransport(None))
        self.autos: dict = {}

    def route(self, m: Method, x):
        from echo_tp.collective import routing, tuning
        call = routing.Call.of(x.numel(), x.element_size(), m.cfg, self.world, on_gpu=True)
        return routing.p2p_route(call, tuning.DEFAULT, "benchmark", form=m.form,
                                 overlap=m.overlap)

    def state(self, cfg, n):
        from echo_tp.compensator import CompState
        if not cfg.compensated:
            return None
        return CompState.zeros(n, "cuda", getattr(torch, cfg.state_dtype),
                               compact=cfg.beta1 == cfg.beta2)

    def call(self, name: str, x):
        """-> (fn, extras): fn() runs one call; extras: stage timing inputs or the communicator."""
        m = METHODS[name]
        n = x.numel()
        if m.kind == "nccl":
            buf = x.clone()
            return (lambda: dist.all_reduce(buf)), {}
        if m.kind == "oneshot":
            buf = x.clone()
            return (lambda: self.one.run(buf, None, state=None, backward=False, record=False,
                                         inplace=True)), {}
        if m.kind == "reference":
            return (lambda: self.ref.run(x, m.cfg, state=None, backward=False,
                                         record=False)), {}
        if m.kind == "auto":
            from echo_tp.communicator import EchoCommunicator
            comm = self.autos.get(name)
            if comm is None:
                comm = self.autos[name] = EchoCommunicator.from_group(None, m.cfg)
            comm.new_pass()
            buf = x.clone()
            return (lambda: comm.all_reduce(buf, inplace=True)), {"comm": comm}
        route = self.route(m, x)
        if m.kind == "unfused":
            from echo_tp.collective.unfused import unfused_output_compensated
            plain = m.cfg.replace(eta=0.0)
            proute = self.route(Method("p2p", plain), x)
            state = self.state(m.cfg, n)
            return (lambda: unfused_output_compensated(
                lambda xp: self.p2p.run(xp, plain, route=proute, state=None, backward=False,
                                        record=False)[0], x, m.cfg, state, self.world)), {}
        state = self.state(m.cfg, n)

        def run():
            return self.p2p.run(x, m.cfg, route=route, state=state, backward=False,
                                record=False)
        if m.kind == "graph":
            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            return graph.replay, {}
        return run, {"route": route, "state": state}


def bench_worker(rank: int, world: int, sizes=SIZES, methods=DEFAULT_METHODS, iters: int = 50,
                 warmup: int = 5, deadline: float | None = None,
                 stages: bool = False) -> list[dict]:
    """On one rank: every size x method -> {'bytes', 'method', 'ms'} (this rank's median)."""
    bench = _Bench(sizes)
    rows = []
    broken: set = set()      # methods that failed on some rank: skipped for the other sizes

    def agree(err: str | None) -> bool:
        """True when every rank succeeded (one NCCL all-reduce, so ranks stay in step)."""
        bad = torch.tensor([err is not None], device="cuda", dtype=torch.int32)
        dist.all_reduce(bad)
        return not bad.item()

    for nbytes in sizes:
        gen = torch.Generator(device="cuda").manual_seed(rank + 1)
        x = (torch.randn(nbytes // 2, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
        for name in methods:
            m = METHODS[name]
            flag = torch.tensor([time.time() > deadline if deadline else False],
                                device="cuda", dtype=torch.int32)
            dist.all_reduce(flag)                     # all ranks skip together
            if flag.item() or name in broken or (m.max_bytes and nbytes > m.max_bytes):
                continue
            err, extras, row = None, {}, None
            try:                                      # set-up and one call (compiles)
                fn, extras = bench.call(name, x)
                fn()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - report it, keep the other methods
                err = traceback.format_exc()[-1500:]
            if agree(err):
                try:
                    row = {"bytes": nbytes, "method": name,
                           "ms": median_ms(fn, small_iters(nbytes, iters), warmup)}
                    if "comm" in extras:
                        row["backend"] = extras["comm"].dispatcher.last_backend
                    route = extras.get("route")
                    if route is not None:
                        row["route"] = f"{route.form}/{route.overlap}/t{route.tile}"
                    if stages and route is not None and route.form == "staged" \
                            and nbytes >= STAGE_MIN_BYTES:
                        row["stages_ms"] = stage_times(bench.p2p, x, m.cfg, route,
                                                       extras["state"],
                                                       iters=max(5, iters // 2))
                except Exception:  # noqa: BLE001
                    err = traceback.format_exc()[-1500:]
            if not agree(err):
                broken.add(name)
                row = {"bytes": nbytes, "method": name, "error": err or "failed on another rank"}
            rows.append(row)
            if rank == 0 or "error" in row:
                print(f"[bench P{world} rank{rank}] {row}", flush=True)
            del extras
        torch.cuda.empty_cache()
    for be in (bench.p2p, bench.one):
        try:
            be.check_error()
        except Exception:  # noqa: BLE001
            rows.append({"bytes": 0, "method": "check_error",
                         "error": traceback.format_exc()[-1500:]})
        be.close()
    return rows


SMALL_BYTES, SMALL_ITERS = 4 * MB, 300
"""Messages up to SMALL_BYTES are timed over at least SMALL_ITERS calls: their medians are
host-bound and moved 2x between runs at 50 (2026-11-30: NCCL 0.032 vs 0.070 ms at 64 KiB)."""


def small_iters(nbytes: int, iters: int) -> int:
    return max(iters, SMALL_ITERS) if nbytes <= SMALL_BYTES else iters


def summarize(per_rank: list[list[dict]], world: int) -> list[dict]:
    """Max over ranks of the per-rank medians; speedup vs nccl16; bf16-equivalent bus GB/s."""
    table: dict = {}
    stages: dict = {}
    picked: dict = {}
    for rows in per_rank:
        for r in rows:
            if "ms" not in r:            # failed: listed by errors()
                continue
            key = (r["bytes"], r["method"])
            table[key] = max(table.get(key, 0.0), r["ms"])
            if "backend" in r:
                picked[key] = r["backend"]
            for k, v in r.get("stages_ms", {}).items():
                stages.setdefault(key, {})[k] = max(stages.get(key, {}).get(k, 0.0), v)
    out = []
    for (nbytes, method), ms in sorted(table.items()):
        base = table.get((nbytes, "nccl16"))
        row = {"bytes": nbytes, "method": method, "ms": ms,
               "speedup": base / ms if base else None,
               "busbw_GBps": 2 * (world - 1) / world * nbytes / (ms * 1e-3) / 1e9}
        if (nbytes, method) in stages:
            row["stages_ms"] = stages[(nbytes, method)]
        if (nbytes, method) in picked:
            row["backend"] = picked[(nbytes, method)]
        out.append(row)
    return out


def markdown(rows: list[dict], world: int, header: str = "") -> str:
    sizes = sorted({r["bytes"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["bytes"], r["method"]): r for r in rows}
    lines = [f"### P={world} all-reduce, bf16 bytes per GPU: ms (speedup vs NCCL)", header, "",
             "| size | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for s in sizes:
        vals = []
        for m in methods:
            r = cell.get((s, m))
            vals.append("-" if r is None else
                        f"{r['ms']:.3f}" + (f" ({r['speedup']:.2f}x)" if r["speedup"] else "")
                        + (f" [{r['backend']}]" if "backend" in r else ""))
        label = f"{s >> 20} MB" if s >= MB else f"{s >> 10} KB"
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def errors(per_rank: list[list[dict]]) -> list[dict]:
    """The failed (size, method) rows of every rank."""
    return [dict(r, rank=k) for k, rows in enumerate(per_rank) for r in rows if "error" in r]


def stage_markdown(rows: list[dict]) -> str:
    """Per-stage medians (max over ranks) where measured: entry | reduce (waits included) | tail."""
    lines = ["| size | method | total ms | entry | reduce | tail | bus GB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r.get("stages_ms")
        if not st:
            continue
        label = f"{r['bytes'] >> 20} MB"
        lines.append(f"| {label} | {r['method']} | {r['ms']:.3f} | {st['entry']:.3f} | "
                     f"{st['reduce']:.3f} | {st['tail']:.3f} | {r['busbw_GBps']:.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def crossover(rows: list[dict], method: str = "p2p4", margin: float = 0.0) -> int | None:
    """Smallest size from which `method` beats nccl16 by at least `margin` (0.05: NCCL's time
    >= 1.05x the method's) at every larger measured size."""
    cell = {(r["bytes"], r["method"]): r["ms"] for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    best = None
    for s in reversed(sizes):
        a, b = cell.get((s, method)), cell.get((s, "nccl16"))
        if a is None or b is None or b < a * (1.0 + margin):
            break
        best = s
    return best


def plot(rows: list[dict], world: int, path: str, title: str = "") -> None:
    """Speedup over NCCL vs message size, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["bytes"], r["speedup"]) for r in rows
                     if r["method"] == m and r.get("speedup"))
        if pts and m != "nccl16":
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.95, color="k", lw=0.5, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("bf16 bytes per GPU")
    ax.set_ylabel("speedup over NCCL bf16 all-reduce")
    ax.set_title(title or f"P={world}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(world: int = 4, out: str = "out", iters: int = 50, max_mb: int = 1024,
         budget_s: float = 1e9, methods: tuple = DEFAULT_METHODS, min_mb: float = 0,
         stages: bool = False) -> list[dict]:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    sizes = [s for s in SIZES if min_mb * MB <= s <= max_mb * MB]
    per_rank = spawn_nccl(world, bench_worker, sizes, methods, iters, 5, time.time() + budget_s,
                          stages)
    rows = summarize(per_rank, world)
    os.makedirs(out, exist_ok=True)
    meta = {"world": world, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "date": time.strftime("%Y-%m-%d"), "crossover_p2p4": crossover(rows)}
    with open(os.path.join(out, f"allreduce_P{world}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    md = markdown(rows, world, f"{meta['gpu']}, torch {meta['torch']}, {meta['date']}")
    with open(os.path.join(out, f"allreduce_P{world}.md"), "w") as f:
        f.write(md + "\n")
    try:
        plot(rows, world, os.path.join(out, f"allreduce_P{world}.png"),
             f"P={world}, {meta['gpu']}, {meta['date']}")
    except Exception as e:  # noqa: BLE001 - the table is the record; the plot is a view
        print(f"plot failed: {e}")
    print(md)
    for e in errors(per_rank):
        print("ERROR", e)
    return rows


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--max-mb", type=int, default=1024)
    ap.add_argument("--min-mb", type=float, default=0)
    ap.add_argument("--stages", action="store_true",
                    help="also time entry/reduce/tail of the staged p2p methods (CUDA events "
                         "between the stage launches) from 64 MB")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma-separated names of the METHODS table: " + ", ".join(METHODS))
    a = ap.parse_args()
    main(a.world, a.out, a.iters, a.max_mb, a.budget_s, tuple(a.methods.split(",")), a.min_mb,
         a.stages)


if __name__ == "__main__":
    cli()
