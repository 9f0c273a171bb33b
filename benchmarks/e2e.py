"""End-to-end speed at TP=P: time to first token, decode step and training step, NCCL 16-bit
against Echo (auto dispatch: the p2p fast path where it wins), idle and under background
interconnect load. Every row of the table comes from the same run.

    torchrun --nproc-per-node 4 benchmarks/e2e.py --out DIR [--models llama-3-8b qwen3-8b]

Per model shape (random weights, all layers, bf16):
  * prefill (TTFT): one forward of [batch, 2048] tokens, a large batch (all-reduce message
    ~ --big-mb per call) and a small one;
  * decode: one token for a small batch with a KV cache (messages of KB), eager (--decode-iters
    repetitions: a host-bound step varies more) and replayed from a CUDA graph captured per
    communicator after an eager warm-up (how serving engines run decode);
  * train: forward + backward of [train-batch, 2048] (both directions compensated, gradient
    scaling included); no optimizer step;
  * each timed for comm in {nccl16, echo4, echo8, early8} and with the all-reduce replaced by
    the identity ('no-ar': the compute alone), so the all-reduce share of the 16-bit step
    s = 1 - t_noar / t_nccl and its Amdahl bound 1 / (1 - s) sit next to the speedup;
  * prefill and train again under background peer-to-peer copies at 50/75/100% duty cycle.
Medians of --iters timed repetitions after warm-up, CUDA events. JSON + markdown on rank 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from echo_tp.bench.background import BackgroundLoad
from echo_tp.communicator import EchoCommunicator
from echo_tp.models import ModelConfig, build_meta_model, init_weights
from echo_tp.tp import parallelize, parse_comm_spec, set_comm

COMMS = {"nccl16": "16", "echo4": "echo4", "echo4bf": "echo4bf",
         "echo8": "echo8", "early8": "early8"}
"""echo4: the default config (one bf16 state tensor, beta1 = beta2 = 0; since 2026-11-30);
echo4bf: the paper's two-timescale pair stored in bf16 (runs before 2026-11-30 called the
then-default fp32 pair echo4)."""


class IdentityComm:
    """Stands where the communicator stands and returns its input: the compute-only step."""

    simulated = False

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_reduce(self, x, *, direction="forward", bits=None, inplace=False, output_map=None):
        return x

    def new_pass(self, direction="forward"):
        pass


class CallTimes:
    """A communicator that brackets each all_reduce with CUDA events while `on` (no host sync):
    the time the step spends inside the collective, per step, measured in the model."""

    def __init__(self, comm):
        self.comm, self.on, self.events = comm, False, []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def all_reduce(self, x, **kw):
        if not self.on:
            return self.comm.all_reduce(x, **kw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = self.comm.all_reduce(x, **kw)
        end.record()
        self.events.append((start, end))
        return y

    def ms_per_step(self, steps: int) -> float:
        """Summed call time / steps (after a sync), then the events are dropped."""
        torch.cuda.synchronize()
        total = sum(s.elapsed_time(e) for s, e in self.events)
        self.events.clear()
        return total / max(1, steps)


def timed(fn, iters: int, warmup: int = 2) -> float:
    """Median ms of fn() over iters runs (CUDA events, ranks aligned by a barrier each run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    return float(t)


def build(name: str, rank: int, world: int, comm):
    cfg = ModelConfig.from_name(name)
    model = build_meta_model(cfg).to_empty(device="cuda")
    init_weights(model, seed=0)
    model = model.to(torch.bfloat16)
    parallelize(model, comm, rank)
    return model, cfg


def bench_model(name: str, a, rank: int, world: int) -> list[dict]:
    specs = {k: parse_comm_spec(v) for k, v in COMMS.items()}
    comms = {k: EchoCommunicator.from_group(None, s.config) for k, s in specs.items()}
    model, cfg = build(name, rank, world, comms["nccl16"])
    dev = torch.device("cuda")
    big_b = max(1, round(a.big_mb * 2**20 / (a.seq * cfg.dim * 2)))
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)

    def tokens(b, t):
        return torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(dev)

    def with_comm(key, call_times=None):
        if key == "no-ar":
            set_comm(model, IdentityComm(world))
        else:
            comm = comms[key] if call_times is None else call_times
            set_comm(model, comm, policy=specs[key].widths)

    def prefill(b):
        x = tokens(b, a.seq)

        def run():
            with torch.no_grad():
                model(x, last_only=True)
        return run

    def decode(b):
        cache = model.new_kv_cache(b, a.seq + 8)
        prompt = tokens(b, 64)
        with torch.no_grad():
            model(prompt, kv_cache=cache)
        nxt = tokens(b, 1)

        def run():
            with torch.no_grad():
                model(nxt, start_pos=64, kv_cache=cache, last_only=True)
        return run

    def decode_graph(b):
        """-> a factory: called after the communicator is set, it warms up eagerly (allocating
        the backends' buffers outside capture), captures one decode step, returns its replay."""
        eager = decode(b)

        def capture():
            for _ in range(2):
                eager()
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                eager()
            torch.cuda.synchronize()
            graphs.append(graph)
            return graph.replay
        return capture

    graphs: list = []

    def train(b):
        x = tokens(b, a.seq)

        def run():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().logsumexp(-1).mean()
            loss.backward()
        return run

    # (kind, batch, step factory, timed under the background loads too)
    cases = [("prefill", big_b, prefill, True), ("prefill", a.small_batch, prefill, False),
             ("decode", a.decode_batch, decode, False),
             ("decode-graph", a.decode_batch, decode_graph, False),
             ("train", a.train_batch, train, True)]
    cases = [c for c in cases if c[0] in a.cases]
    for kind, b, make, loaded in cases:
        msg_mb = b * (1 if kind.startswith("decode") else a.seq) * cfg.dim * 2 / 2**20
        loads = a.loads if loaded else [0.0]
        iters = a.decode_iters if kind.startswith("decode") else a.iters
        fn = make(b)
        for duty in loads:
            row = {"model": name, "kind": kind, "batch": b, "msg_mb": msg_mb, "load": duty}
            with BackgroundLoad(duty=duty, rank=rank, world_size=world):
                for key in ["no-ar", *a.order]:
                    if kind == "train" and key == "no-ar" and duty:
                        continue
                    ct = CallTimes(comms[key]) if a.call_times and key != "no-ar" \
                        and kind in ("prefill", "train") else None
                    with_comm(key, ct)
                    step = fn() if kind == "decode-graph" else fn   # capture per communicator
                    t0 = time.time()
                    row[key] = timed(step, iters)
                    if a.phase_log and rank == 0:  # wall-clock window, to match GPU telemetry
                        print(json.dumps({"phase": f"{name} {kind} b{b} load {duty} {key}",
                                          "t0": t0, "t1": time.time()}), flush=True)
                    if ct is not None:          # a second pass, events on: the calls' share
                        ct.on = True
                        for _ in range(iters):
                            step()
                        row[f"ar_ms_{key}"] = ct.ms_per_step(iters)
            graphs.clear()
            base = row["nccl16"]
            for key in COMMS:
                if key in row:
                    row[f"speedup_{key}"] = base / row[key]
            if "no-ar" in row:
                row["ar_share"] = max(0.0, 1 - row["no-ar"] / base)
                row["amdahl_bound"] = base / row["no-ar"]
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    for c in comms.values():
        c.close()
    del model
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# End-to-end at TP={meta['world_size']} ({meta['date']})", "",
           f"{meta['gpus']}; torch {meta['torch']}, triton {meta['triton']}, "
           f"NCCL {meta['nccl']}", "", f"Command: `{meta['command']}`", "",
           "| model | step | batch | AR msg MB | load | NCCL ms | Echo4 ms | x | Echo4bf x | "
           "Echo8 x | early8 x | AR share | Amdahl bound | AR ms in step: NCCL / Echo4 |",
           "|" + "---|" * 14]

    def x(r, key):
        return f"{r[f'speedup_{key}']:.2f}" if f"speedup_{key}" in r else "-"
    for r in rows:
        share = f"{100 * r['ar_share']:.0f}%" if "ar_share" in r else ""
        bound = f"{r['amdahl_bound']:.2f}" if "amdahl_bound" in r else ""
        calls = " / ".join(f"{r[k]:.1f}" if k in r else "-"
                           for k in ("ar_ms_nccl16", "ar_ms_echo4")) \
            if "ar_ms_nccl16" in r or "ar_ms_echo4" in r else ""
        out.append(f"| {r['model']} | {r['kind']} | {r['batch']} | {r['msg_mb']:.1f} | "
                   f"{100 * r['load']:.0f}% | {r['nccl16']:.2f} | {r.get('echo4', 0):.2f} | "
                   f"{x(r, 'echo4')} | {x(r, 'echo4bf')} | {x(r, 'echo8')} | "
                   f"{x(r, 'early8')} | {share} | {bound} | {calls} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Speedup over NCCL per row and comm, with the Amdahl bound as a marker."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['model'].split('-')[0]} {r['kind']} b{r['batch']} {100 * r['load']:.0f}%"
              for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows)), 4.5))
    keys = [k for k in COMMS if k != "nccl16" and any(f"speedup_{k}" in r for r in rows)]
    width = 0.8 / max(1, len(keys))
    for k, key in enumerate(keys):
        ax.bar([i + (k - (len(keys) - 1) / 2) * width for i in range(len(rows))],
               [r.get(f"speedup_{key}", float("nan")) for r in rows], width, label=key)
    ax.plot(range(len(rows)), [r.get("amdahl_bound", float("nan")) for r in rows], "k_",
            markersize=14, label="Amdahl bound (free all-reduce)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup over NCCL 16-bit")
    ax.set_title(f"TP={meta['world_size']}, {meta['gpus']}, {meta['date']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-3-8b", "qwen3-8b"])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--big-mb", type=float, default=1024.0)
    ap.add_argument("--small-batch", type=int, default=4)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.0, 0.5, 0.75, 1.0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--decode-iters", type=int, default=30)
    ap.add_argument("--cases", nargs="+", default=["prefill", "decode", "decode-graph", "train"],
                    choices=["prefill", "decode", "decode-graph", "train"])
    ap.add_argument("--order", nargs="+", default=list(COMMS), choices=list(COMMS),
                    help="the communicators timed, in this order (nccl16 is needed: the baseline)")
    ap.add_argument("--out", type=Path, default=Path("docs/results/raw"))
    ap.add_argument("--phase-log", action="store_true",
                    help="rank 0 prints each timed phase's wall-clock window (JSON lines)")
    ap.add_argument("--call-times", action="store_true",
                    help="prefill/train: also time every all-reduce call inside the step "
                         "(CUDA events, separate untimed-step pass): ar_ms_<comm> per step")
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from echo_tp.launch import group_timeout
    dist.init_process_group("nccl", timeout=group_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.time()
    rows = []
    for name in a.models:
        rows += bench_model(name, a, rank, world)
    if rank == 0:
        import triton
        meta = {"date": time.strftime("%Y-%m-%d"), "world_size": world,
                "gpus": f"{world}x {torch.cuda.get_device_name()}", "torch": torch.__version__,
                "triton": triton.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "command": "torchrun --nproc-per-node %d benchmarks/e2e.py %s"
                           % (world, " ".join(os.sys.argv[1:])), "seconds": time.time() - t0}
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"e2e-P{world}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                             indent=1) + "\n")
        (a.out / f"e2e-P{world}.md").write_text(markdown(rows, meta))
        try:
            plot(rows, meta, a.out / f"e2e-P{world}.png")
        except Exception as e:  # noqa: BLE001 - the table is the record
            print(f"plot failed: {e}")
        print(markdown(rows, meta))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
