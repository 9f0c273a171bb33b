"""Training tokens/s of simulated TP: the per-shard path against the batched fast path (and the
plain model as the ceiling), in one run, on one GPU.

    python benchmarks/train_speed.py --out $OUT/train_speed.json          # the testbed recipe
    python benchmarks/train_speed.py --device cpu --model tiny-qwen3 --batch-size 2 \\
        --seq-len 32 --windows 2 --window-steps 2 --out /tmp/speed.json        # a CPU dry run

Every variant (VARIANTS: the sim path, torch.compile or not, P) builds the model from the same
seed and trains it with the trainer's own step (echo_tp.train.Stepper: bf16 autocast on CUDA,
the partial-grad sync, clipping, AdamW; the '+graph' variants replay the step's passes as one
CUDA graph after its warm-up steps, as `train --cuda-graph` does) on the same batches: `--warmup` steps (compile, Triton
JIT), then `--windows` windows of `--window-steps` steps, each window ended by one device sync
(as the trainer syncs every few steps). Per variant: the median seconds per step over the
windows, tokens/s from it, the median host seconds per step (the time until the window's
Python returns, before the sync: close to the step time when the host bounds it), the first
step's seconds (compile included) and the last loss. Data: --train-data, or random tokens.

On CUDA one more step runs under torch.cuda.set_sync_debug_mode('warn'): the host syncs a
step makes (`host_syncs_per_step`, the first messages with it).

Equivalence (`--check`, on by default): one step of the same model and batch through both sim
paths, per comm: the largest logit and gradient differences, and whether they are bit for bit
(on the CPU they are: tests/test_tp_batched.py; a GPU's batched GEMMs may round otherwise);
then `--check-steps` training steps of each path from the same init on the same batches: the
losses, and their largest relative difference (whether rounding differences grow).
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from echo_tp.models import load_tokens
from echo_tp.tp import parse_comm_spec, rank_parameters, sync_partial_grads
from echo_tp.tp.runtime import make_comm
from echo_tp.train import Stepper, TokenBatches, TrainOptions, build_optimizer, lr_at, \
    prepare_forward
from echo_tp.train.model import build_model

VARIANTS = {  # name -> (sim path, torch.compile, simulated TP (False: the plain model),
    #          the step's passes as one CUDA graph: train --cuda-graph)
    "shards": ("shards", False, True, False),
    "shards+compile": ("shards", True, True, False),
    "batched": ("batched", False, True, False),
    "batched+compile": ("batched", True, True, False),
    "batched+graph": ("batched", False, True, True),
    "batched+compile+graph": ("batched", True, True, True),
    "plain": ("shards", False, False, False),
    "plain+compile": ("shards", True, False, False),
    "plain+compile+graph": ("shards", True, False, True),
}
DEFAULT_VARIANTS = ("batched+compile", "batched+compile+graph", "plain+compile",
                    "plain+compile+graph")
RECIPE = dict(model="studies/testbed/model.json", batch_size=64, seq_len=512, lr=2e-3,
              min_lr=2e-4, warmup=66, weight_decay=0.1)
"""The testbed recipe (studies/testbed/recipe.sh); its schedule only sets the LR here."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(a, vocab: int) -> TokenBatches:
    if a.train_data:
        tokens = load_tokens(a.train_data)
    else:  # random tokens: the speed does not depend on the text
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (a.batch_size * (a.seq_len + 1) * 64,), generator=g)
    return TokenBatches(tokens, seq_len=a.seq_len, batch_size=a.batch_size, seed=0)


def _build(a, comm_spec: str, sim_path: str, simulated: bool, device):
    spec = parse_comm_spec(comm_spec)
    P = a.simulate if simulated else 1
    comm = make_comm(None, P, spec.config) if P > 1 else None
    return build_model(a.model, tuple(a.model_field), seed=0, comm=comm, rank=None,
                       world_size=P, device=device, policy=spec.widths,
                       sim_path=sim_path if P > 1 else "shards", init_from=a.init_from)


class Run:
    """One variant's model, optimizer and batches; step() is the trainer's step at the
    schedule's LR (no host sync)."""

    def __init__(self, a, name: str, comm_spec: str, device):
        sim_path, compile_, simulated, graph = VARIANTS[name]
        self.o = TrainOptions(model=None if a.init_from else a.model, init_from=a.init_from,
                              train_data="-", model_fields=tuple(a.model_field),
                              steps=a.warmup + a.windows * a.window_steps, seq_len=a.seq_len,
                              batch_size=a.batch_size, lr=a.lr, min_lr=a.min_lr,
                              warmup=a.lr_warmup, weight_decay=a.weight_decay,
                              compile=compile_, sim_path=sim_path, device=str(device),
                              cuda_graph=graph)
        self.amp = device.type == "cuda" if a.amp is None else a.amp
        self.device = device
        self.built = _build(a, comm_spec, sim_path, simulated, device)
        self.forward = prepare_forward(self.built, compile_)
        self.opt = build_optimizer(self.built.model, self.o)
        self.batches = _batches(a, self.built.vocab_size)
        self.stepper = Stepper(self.forward, self.built, self.opt, self.o, device, self.amp)
        self.steps = 0

    def step(self):
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.steps, self.o)
        self.steps += 1
        return self.stepper(self.batches)


def run_variant(a, name: str, comm_spec: str, device) -> dict:
    sim_path, compile_, simulated, graph = VARIANTS[name]
    run = Run(a, name, comm_spec, device)
    one = run.step
    t0 = time.perf_counter()
    loss, _ = one()
    _sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(a.warmup - 1):
        one()
    _sync(device)
    per_step, host = [], []
    for _ in range(a.windows):
        t0 = time.perf_counter()
        for _ in range(a.window_steps):
            loss, _ = one()
        t_host = time.perf_counter()
        _sync(device)
        t1 = time.perf_counter()
        per_step.append((t1 - t0) / a.window_steps)
        host.append((t_host - t0) / a.window_steps)
    syncs = _count_syncs(one, device)
    tokens = a.batch_size * a.seq_len
    med = statistics.median(per_step)
    out = {"variant": name, "comm": comm_spec, "sim_path": sim_path if simulated else None,
           "compile": compile_, "cuda_graph": run.stepper.status,
           "world_size": a.simulate if simulated else 1,
           "tokens_per_s": tokens / med, "step_s_median": med,
           "host_s_median": statistics.median(host), "step_s": per_step,
           "first_step_s": first_s, "steps": run.steps, "last_loss": float(loss), **syncs}
    if device.type == "cuda":
        out["max_memory_GiB"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    del run, one
    _release(device)
    return out


def _count_syncs(one, device) -> dict:
    """One more step under torch.cuda.set_sync_debug_mode('warn'): the synchronizing calls it
    makes (a host sync stalls the queue; the step should make none). {} off CUDA."""
    if device.type != "cuda":
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            one()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    _sync(device)
    return {"host_syncs_per_step": len(msgs), "host_sync_messages": msgs[:5]}


def _release(device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def equivalence(a, comm_spec: str, device) -> dict:
    """One forward + backward of the same model and batch through both sim paths."""
    amp = device.type == "cuda" if a.amp is None else a.amp
    got = {}
    for path in ("shards", "batched"):
        built = _build(a, comm_spec, path, True, device)
        x, y = next(_batches(a, built.vocab_size))
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = built.model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        sync_partial_grads(built.model)
        grads = {(r, n): p.grad.detach().float() for r in range(a.simulate)
                 for n, p in rank_parameters(built.model, r).items()}
        got[path] = logits.detach().float(), grads
        del built
        _release(device)
    (la, ga), (lb, gb) = got["shards"], got["batched"]
    rel = max(float((ga[k] - gb[k]).abs().max() / ga[k].abs().max().clamp_min(1e-30))
              for k in ga)
    losses = {}
    for path in ("shards", "batched"):       # a short training run: do differences grow?
        run = Run(a, path, comm_spec, device)
        losses[path] = torch.stack([run.step()[0] for _ in range(a.check_steps)]).tolist()
        del run
        _release(device)
    return {"comm": comm_spec, "logits_bit_identical": bool(torch.equal(la, lb)),
            "grads_bit_identical": all(torch.equal(ga[k], gb[k]) for k in ga),
            "max_logit_diff": float((la - lb).abs().max()),
            "logit_scale": float(la.abs().max()), "max_grad_rel_diff": rel,
            "losses": losses, "max_loss_rel_diff": max(
                abs(x / y - 1) for x, y in zip(losses["batched"], losses["shards"]))}


def environment(device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": str(device)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=RECIPE["model"])
    ap.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                    help="a pretrained HF folder or GGUF file instead of --model")
    ap.add_argument("--model-field", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    ap.add_argument("--train-data", default=None, help="token file (default: random tokens)")
    ap.add_argument("--simulate", type=int, default=4, metavar="P")
    ap.add_argument("--comms", nargs="+", default=["echo4"])
    ap.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                    choices=list(VARIANTS))
    ap.add_argument("--batch-size", type=int, default=RECIPE["batch_size"])
    ap.add_argument("--seq-len", type=int, default=RECIPE["seq_len"])
    ap.add_argument("--lr", type=float, default=RECIPE["lr"])
    ap.add_argument("--min-lr", type=float, default=RECIPE["min_lr"])
    ap.add_argument("--lr-warmup", type=int, default=RECIPE["warmup"])
    ap.add_argument("--weight-decay", type=float, default=RECIPE["weight_decay"])
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (compile, JIT)")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--window-steps", type=int, default=4)
    ap.add_argument("--device", default=None)
    ap.add_argument("--amp", default=None, action=argparse.BooleanOptionalAction)
    ap.add_argument("--check", default=True, action=argparse.BooleanOptionalAction,
                    help="the equivalence of the two sim paths, per comm")
    ap.add_argument("--check-steps", type=int, default=8,
                    help="training steps of the equivalence's loss comparison")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="skip the variants that would start past this many seconds")
    ap.add_argument("--out", required=True, help="JSON results")
    a = ap.parse_args(argv)
    if min(a.warmup, a.windows, a.window_steps, a.check_steps) < 1:
        raise SystemExit("--warmup, --windows, --window-steps and --check-steps must be >= 1")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    result = {"env": environment(device), "args": vars(a), "rows": [], "skipped": [],
              "equivalence": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(result, indent=1) + "\n")

    if a.check:
        for comm in a.comms:
            result["equivalence"].append(equivalence(a, comm, device))
            print("equivalence", result["equivalence"][-1], flush=True)
            save()
    for i, comm in enumerate(a.comms):
        for name in a.variants:
            if not VARIANTS[name][2] and i:          # the plain model has no comm: once
                continue
            if a.deadline_s is not None and time.perf_counter() - start > a.deadline_s:
                result["skipped"].append(f"{name} {comm}")
                print(f"SKIPPED {name} {comm} (deadline)", flush=True)
                continue
            row = run_variant(a, name, comm, device)
            result["rows"].append(row)
            ms, host = row["step_s_median"] * 1e3, row["host_s_median"] * 1e3
            print(f"{name:16s} {comm:6s} {row['tokens_per_s']:>12,.0f} tokens/s  step "
                  f"{ms:8.1f} ms (host {host:7.1f} ms)  first step {row['first_step_s']:6.1f} s"
                  f"  loss {row['last_loss']:.4f}", flush=True)
            save()
    base = {r["comm"]: r["tokens_per_s"] for r in result["rows"] if r["variant"] == "shards"}
    plain = {r["variant"]: r["tokens_per_s"] for r in result["rows"] if r["world_size"] == 1}
    for r in result["rows"]:
        if r["comm"] in base:
            r["speedup_over_shards"] = r["tokens_per_s"] / base[r["comm"]]
        if "plain+compile" in plain:   # the ceiling: the plain model compiled
            r["ratio_to_plain_compiled"] = r["tokens_per_s"] / plain["plain+compile"]
    result["seconds"] = time.perf_counter() - start
    save()
    return result


if __name__ == "__main__":
    main()
