"""All-reduce latency at P GPUs: NCCL 16-bit vs the reference (two NCCL collectives) vs p2p.

    python benchmarks/allreduce.py --world 4 --out out/           # spawns 4 NCCL ranks

Per message size (bf16 bytes per GPU) and method: warm-up, then `iters` back-to-back calls
(at least 300 up to 4 MiB) each bracketed by CUDA events; the median per rank, the max over
ranks reported. Methods: nccl16 (dist.all_reduce, in place), oneshot16 (the 16-bit one-shot kernel, in place, small
sizes), ref4/ref8 (reference backend, uncompensated), p2p8/p2p4 (uncompensated, the backend's
choice of fused or stage kernels), p2p4-staged (always the three stage kernels), p2p4c-out /
p2p4c-loc (4-bit compensated, residual output / local; -staged: three kernels; -bf16: bf16
compensator state; -single: beta1 = beta2 = 0, one state tensor), p2p4c-out-unfused (the
compensator as separate torch ops around the uncompensated p2p call, on fp32 x'), p2p4-graph
(p2p4 replayed from a CUDA graph, small sizes), auto4 / auto4c / auto4c-fp32
(EchoCommunicator with backend='auto': 4-bit uncompensated / the default compensated config,
one bf16 state tensor / the paper's fp32 two-timescale pair, local residual; in place like
nccl16: what a TP layer gets, the dispatch picking one-shot, p2p or the plain bf16 all-reduce
per size). The p2p4c methods use eta 0.75 and, unless -single, the paper's betas 0.7/0.3.
Bus bandwidth uses bf16-equivalent bytes: 2 (P-1)/P * bytes / time (the nccl-tests
convention).
Suffixes: '@...' a p2p launch shape (ppsK, wK, tK, sK; d0 = output-residual update inside the
call instead of deferred to a side stream; o0 = reduce then tail, o1 = overlapped in one
launch, o2 = the tail on a second stream beside the reduce; lK = tails K tiles behind the
reduces; gK = K persistent tail programs per SM with o2); '+mm' each call preceded by a bf16
matmul with an output of the message's size, the matmul's own time subtracted (the paper's
timing of the fused output residual, whose deferred update runs beside that matmul); +mm rows
compare with nccl16+mm.
Writes allreduce_P{P}.json and allreduce_P{P}.md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MB = 1 << 20
SIZES = [64 << 10, 256 << 10, MB, 4 * MB, 16 * MB, 64 * MB, 128 * MB, 256 * MB, 512 * MB,
         1024 * MB]
METHODS = ("nccl16", "oneshot16", "ref4", "p2p8", "p2p4", "p2p4-staged", "p2p4c-out",
           "p2p4c-out-unfused", "p2p4c-loc", "p2p4c-loc-staged", "p2p4-graph", "auto4",
           "auto4c", "auto4c-fp32")
ONESHOT_MAX_BYTES = 64 * MB
"""oneshot16 (the 16-bit one-shot kernel) is timed up to this size."""
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
    from echo_tp.launch import group_timeout
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank), timeout=group_timeout())
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


def stage_times(p2p, x, cfg, state, iters: int = 20) -> dict:
    """Median ms of entry, reduce (its waits included) and tail over `iters` calls, from
    events recorded between the launches (P2PBackend.stage_events)."""
    per = {"entry": [], "reduce": [], "tail": []}
    dist.barrier()
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        p2p.stage_events = ev
        p2p.run(x, cfg, state=state, backward=False, record=False)
        p2p.stage_events = None
        torch.cuda.synchronize()
        for k, name in enumerate(per):
            per[name].append(ev[k].elapsed_time(ev[k + 1]))
    return {k: statistics.median(v) for k, v in per.items()}


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
        return _time(fn, iters, 2)

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


STAGE_METHODS = ("p2p4-staged", "p2p8-staged", "p2p4c-loc-staged",
                 "p2p4c-loc-bf16-single-staged")
"""Methods timed per stage with --stages (where reduce and tail run as one overlapped launch,
'reduce' is both and 'tail' 0)."""
STAGE_MIN_BYTES = 64 * MB


def bench_worker(rank: int, world: int, sizes=SIZES, methods=METHODS, iters: int = 50,
                 warmup: int = 5, deadline: float | None = None, stages: bool = False,
                 **p2p_kwargs) -> list[dict]:
    """On one rank: every size x method -> {'bytes', 'method', 'ms'} (this rank's median)."""
    from echo_tp.collective.dispatch import TransportBackend
    from echo_tp.collective.p2p import P2PBackend
    from echo_tp.collective.reference import DistTransport
    from echo_tp.compensator import CompState
    from echo_tp.config import EchoConfig
    from echo_tp.communicator import EchoCommunicator
    from echo_tp.collective.oneshot import OneShotBackend
    p2p = P2PBackend(None, min_bytes=0, **p2p_kwargs)
    staged = P2PBackend(None, min_bytes=0, fused=False,
                        **{k: v for k, v in p2p_kwargs.items() if k != "programs_per_sm"}) \
        if any(m.endswith("-staged") for m in methods) else None
    one = OneShotBackend(None, cap_bytes=min(max(sizes), ONESHOT_MAX_BYTES)) \
        if "oneshot16" in methods else None
    ref = TransportBackend(DistTransport(None))
    variants: dict = {}
    autos = {"auto4": EchoCommunicator.from_group(None, EchoConfig(bits=4, eta=0.0)),
             "auto4c": EchoCommunicator.from_group(None, EchoConfig(bits=4)),
             "auto4c-fp32": EchoCommunicator.from_group(None,
                                                        EchoConfig.from_name("echo4-2ts"))}
    rows = []
    broken: set = set()      # methods that failed on some rank: skipped for the other sizes

    def agree(err: str | None) -> bool:
        """True when every rank succeeded (one NCCL all-reduce, so ranks stay in step)."""
        bad = torch.tensor([err is not None], device="cuda", dtype=torch.int32)
        dist.all_reduce(bad)
        return not bad.item()

    for nbytes in sizes:
        n = nbytes // 2
        gen = torch.Generator(device="cuda").manual_seed(rank + 1)
        x = (torch.randn(n, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
        mm_alone: list = []                          # the matmul's own time at this size
        for full in methods:
            method = full.removesuffix("+mm")         # '+mm': after a matmul, matmul subtracted
            flag = torch.tensor([time.time() > deadline if deadline else False],
                                device="cuda", dtype=torch.int32)
            dist.all_reduce(flag)                     # all ranks skip together
            if flag.item() or full in broken:
                continue
            state = None
            if method == "p2p4-graph" and nbytes > GRAPH_MAX_BYTES:
                continue
            if method.startswith("oneshot16") and nbytes > ONESHOT_MAX_BYTES:
                continue
            err = None
            try:                                      # set-up and one call (compiles)
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
                elif method.startswith("oneshot16"):
                    buf = x.clone()
                    be = one
                    if "@" in method:         # variant: oneshot16@pps{K}w{W}
                        if method not in variants:
                            pps, warps = (int(v) for v in method.split("@pps")[1].split("w"))
                            variants[method] = OneShotBackend(None, cap_bytes=one.cap_bytes,
                                                            num_warps=warps, programs_per_sm=pps)
                        be = variants[method]
                    fn = lambda: be.run(buf, None, state=None, backward=False,  # noqa: E731
                                        record=False, inplace=True)
                elif method in autos:
                    comm = autos[method]
                    comm.new_pass()
                    buf = x.clone()
                    fn = lambda: comm.all_reduce(buf, inplace=True)   # noqa: E731
                elif method == "p2p4c-out-unfused":     # compensator as separate torch ops
                    from echo_tp.collective.unfused import unfused_output_compensated
                    cfg = EchoConfig.from_name("echo4-output")
                    plain = cfg.replace(eta=0.0)
                    state = CompState.zeros(n, "cuda")
                    fn = lambda: unfused_output_compensated(  # noqa: E731
                        lambda xp: p2p.run(xp, plain, state=None, backward=False,
                                           record=False)[0], x, cfg, state, world)
                elif method.startswith("ref"):
                    cfg = EchoConfig(bits=int(method[3:]), eta=0.0)
                    fn = lambda: ref.run(x, cfg, state=None, backward=False, record=False)  # noqa
                else:
                    bits = int(method[3])
                    comp = method.startswith("p2p4c")
                    base, _, variant = method.partition("@")
                    be = staged if base.endswith("-staged") else p2p
                    # launch shape: @ppsK (fused, K programs/SM), wK (warps), tK (values per
                    # tile: one flag), sK (values per step within a tile), e.g. @w4t8192s2048
                    if variant:
                        if method not in variants:
                            import re

                            from echo_tp import envs
                            kw = dict(p2p_kwargs,
                                      fused=False if base.endswith("-staged") else None)
                            for k, v in re.findall(r"(pps|w|t|s|d|o|l|g)(\d+)", variant):
                                if k == "pps":
                                    kw.update(programs_per_sm=int(v), fused=True)
                                elif k == "d":            # d0: output-residual update inline
                                    kw["defer_output"] = bool(int(v))
                                elif k == "o":            # o0 off, o1 launch, o2 stream
                                    kw["overlap"] = envs.OVERLAP_MODES[int(v)]
                                elif k == "l":            # lK: tails K tiles behind
                                    kw["overlap_lag"] = int(v)
                                elif k == "g":            # gK: o2's tail programs per SM
                                    kw["tail_programs_per_sm"] = int(v)
                                else:
                                    kw[{"w": "num_warps", "t": "tile_elems",
                                        "s": "step_elems"}[k]] = int(v)
                            variants[method] = P2PBackend(None, min_bytes=0, **kw)
                        be = variants[method]
                    sdt = "bfloat16" if "-bf16" in method else "float32"
                    single = "-single" in method          # beta1 = beta2 = 0: one state tensor
                    cfg = EchoConfig(bits=bits, eta=0.75 if comp else 0.0,
                                     residual="local" if "-loc" in method else "output",
                                     state_dtype=sdt, beta1=0.0 if single else 0.7,
                                     beta2=0.0 if single else 0.3)
                    state = CompState.zeros(n, "cuda", getattr(torch, sdt), compact=single) \
                        if comp else None
                    fn = lambda: be.run(x, cfg, state=state, backward=False,  # noqa: E731
                                        record=False)
                if full.endswith("+mm"):
                    fn = _after_matmul(fn, n, mm_alone, iters, warmup)
                fn()
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - report it, keep the other methods
                err = traceback.format_exc()[-1500:]
            if agree(err):
                try:
                    row = {"bytes": nbytes, "method": full,
                           "ms": _time(fn, small_iters(nbytes, iters), warmup)}
                    if full.endswith("+mm"):
                        row["ms"] -= mm_alone[0]
                        row["matmul_ms"] = mm_alone[0]
                    if method in autos:
                        row["backend"] = autos[method].dispatcher.last_backend
                    if stages and staged is not None and method in STAGE_METHODS \
                            and nbytes >= STAGE_MIN_BYTES:
                        row["stages_ms"] = stage_times(staged, x, cfg, state,
                                                       iters=max(5, iters // 2))
                except Exception:  # noqa: BLE001
                    err = traceback.format_exc()[-1500:]
            if not agree(err):
                broken.add(full)
                row = {"bytes": nbytes, "method": full,
                       "error": err or "failed on another rank"}
            rows.append(row)
            if rank == 0 or "error" in row:
                print(f"[bench P{world} rank{rank}] {row}", flush=True)
            del state
        torch.cuda.empty_cache()
    for be in (p2p, staged, one, *variants.values()):
        if be is None:
            continue
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


def _after_matmul(fn, n: int, mm_alone: list, iters: int, warmup: int):
    """fn preceded by a bf16 matmul whose output has ~n values ([n/4096, 4096] x [4096, 4096],
    the shape of a TP block's next projection): the paper's way to time an all-reduce whose
    compensator update runs beside the next matmul. mm_alone[0] gets the matmul's own median
    (measured once per size), which the caller subtracts."""
    rows = max(1, n // 4096)
    a = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    out = torch.empty(rows, 4096, device="cuda", dtype=torch.bfloat16)

    def mm():
        torch.mm(a, w, out=out)
    if not mm_alone:
        mm_alone.append(_time(mm, iters, warmup))

    def both():
        mm()
        fn()
    return both


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
        base = table.get((nbytes, "nccl16+mm" if method.endswith("+mm") else "nccl16"))
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
         budget_s: float = 1e9, methods: tuple = METHODS, min_mb: float = 0,
         stages: bool = False) -> list[dict]:
    os.environ.update(SAFE_ENV)
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
                    help="also time entry/reduce/tail of the -staged methods (stage events)")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated; p2p methods take an @ppsK suffix (K programs per SM "
                         "for the fused kernel)")
    a = ap.parse_args()
    main(a.world, a.out, a.iters, a.max_mb, a.budget_s, tuple(a.methods.split(",")), a.min_mb,
         a.stages)


if __name__ == "__main__":
    cli()
