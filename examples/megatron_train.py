"""Megatron-core's GPTModel trained with Echo at every TP collective (echo_tp.megatron).

    echo-tp tokenize BOOKS/ --tokenizer gutenberg-8k --out data/books.bin --val-fraction 0.05
    torchrun --nproc-per-node 2 examples/megatron_train.py --tokens data/books.bin \
        --comm 16 4 echo4 --steps 300 --out-dir runs/megatron
    python examples/megatron_train.py --world-size 2 ...      # spawns 2 gloo ranks itself

Under torchrun the TP group is every rank: NCCL on GPUs (cuda:LOCAL_RANK), gloo on the CPU
(echo_tp.megatron.cpu: run_on_cpu). Each comm spec (tp.policy syntax: '16', '4', 'echo4',
'echo4:policy=early8', ...) trains the same model from the same init on the same batches:
megatron-core's GPTModel from echo_block_spec (RMSNorm, SwiGLU, rotary positions, untied
output layer), AdamW with linear warmup and cosine decay, the loss megatron-core's own
vocab-parallel cross entropy computes. Rank 0 writes <out-dir>/<label>.csv (step, loss,
elapsed), summary.json (per comm: tail-mean loss, validation loss, the mean per-step |loss -
the first run's loss|, seconds per step, the per-step losses; and the validation loss of the
first run's trained weights under each comm, which isolates each comm's forward error) and
losses.png (the curves, smoothed, and each one's gap to 16 bits); `--plot summary.json` draws
losses.png again from a summary.

The validation loss is taken on the token file's .val.bin when there is one (echo-tp tokenize
--val-fraction), else on its last 5%, under the run's own comm.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from echo_tp import EchoCommunicator
from echo_tp.megatron import clip_grad_norm_, cpu, echo_block_spec, enable_echo, \
    sync_tp_partial_grads
from echo_tp.models.tokenize import load_tokens, token_file_info, val_path_for
from echo_tp.tp.policy import parse_comm_specs
from echo_tp.tp.runtime import launch
from echo_tp.train.data import TokenBatches, eval_batches


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", help="token file (.bin + .json sidecar)")
    p.add_argument("--plot", metavar="SUMMARY", help="only draw <out-dir>/losses.png from a "
                   "summary.json this script wrote")
    p.add_argument("--comm", nargs="+", default=["16", "4", "echo4"], help="comm specs")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--minutes", type=float, default=0.0,
                   help="per comm: stop after this many minutes (0: run all steps)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=None,
                   help="spawn this many gloo ranks (CPU) instead of running under torchrun")
    p.add_argument("--out-dir", default="runs/megatron")
    return p.parse_args(argv)


VAL_BATCHES = 32
"""Validation batches (of batch-size x seq-len tokens) per evaluation."""


def lr_at(step: int, o) -> float:
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    t = (step - o.warmup) / max(1, o.steps - o.warmup)
    return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def build_model(o, vocab: int, world_size: int, device: torch.device):
    dtype = getattr(torch, o.dtype)
    config = TransformerConfig(
        num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads,
        ffn_hidden_size=4 * o.hidden, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=world_size,
        sequence_parallel=o.sequence_parallel, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, **cpu.CPU_CONFIG)
    torch.manual_seed(o.seed)
    spec = echo_block_spec(config, get_gpt_layer_local_spec(normalization="RMSNorm"))
    model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=o.seq_len,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    return model.to(device=device, dtype=dtype)


def padded_vocab(vocab: int, world_size: int) -> int:
    """Rounded up to a multiple of 128 * TP, as Megatron-LM pads it."""
    m = 128 * world_size
    return -(-vocab // m) * m


def _run_comm(o, spec, model, group, tokens, val, device) -> dict:
    comm = EchoCommunicator.from_group(group, spec.config)
    enable_echo(model, comm, policy=spec.widths)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=o.lr, betas=(0.9, 0.95))
    T, B = o.seq_len, o.batch_size
    mask = cpu.causal_mask(T, device)
    pos = torch.arange(T, device=device).expand(B, T)
    batches = TokenBatches(tokens, seq_len=T, batch_size=B, seed=o.seed)
    rows, t0 = [], time.perf_counter()
    model.train()
    for step in range(o.steps):
        x, y = (t.to(device) for t in next(batches))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o)
        opt.zero_grad(set_to_none=True)
        loss = model(x, pos, mask, labels=y).float().mean()
        loss.backward()
        sync_tp_partial_grads(model, group)
        clip_grad_norm_(model, 1.0, group)
        opt.step()
        rows.append({"step": step, "loss": loss.item(), "elapsed_s": time.perf_counter() - t0})
        if o.minutes and rows[-1]["elapsed_s"] > 60 * o.minutes:
            break
    return {"rows": rows, "val_loss": evaluate(o, model, val, device)}


@torch.no_grad()
def evaluate(o, model, val, device) -> float:
    """Mean loss over the first VAL_BATCHES batches of the validation tokens, under the comm
    the model has now."""
    T = o.seq_len
    mask = cpu.causal_mask(T, device)
    model.eval()
    losses = []
    for x, y in eval_batches(val, seq_len=T, batch_size=o.batch_size, max_batches=VAL_BATCHES):
        pos = torch.arange(T, device=device).expand_as(x)
        losses.append(float(model(x.to(device), pos.to(device), mask,
                                  labels=y.to(device)).float().mean()))
    model.train()
    return sum(losses) / len(losses)


def _rank(rank, world_size, o) -> dict | None:
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu \
        else torch.device("cpu")
    if not on_gpu:
        cpu.run_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    if on_gpu:
        model_parallel_cuda_manual_seed(o.seed)
    group = parallel_state.get_tensor_model_parallel_group()
    tokens = load_tokens(o.tokens)
    vpath = val_path_for(o.tokens)
    if vpath.is_file():
        val = load_tokens(vpath)
    else:
        cut = int(tokens.numel() * 0.95)
        tokens, val = tokens[:cut], tokens[cut:]
    vocab = padded_vocab(int(token_file_info(o.tokens).get("vocab_size", int(tokens.max()) + 1)),
                         world_size)
    out, first = {}, None
    specs = parse_comm_specs(o.comm)
    for spec in specs:
        model = build_model(o, vocab, world_size, device)
        out[spec.label] = _run_comm(o, spec, model, group, tokens, val, device)
        out[spec.label]["config"] = spec.as_dict()
        first = model if first is None else first
    # the first run's trained weights under every comm: each comm's forward error alone
    for spec in specs:
        enable_echo(first, EchoCommunicator.from_group(group, spec.config), policy=spec.widths)
        out[spec.label]["val_loss_first_weights"] = evaluate(o, first, val, device)
    parallel_state.destroy_model_parallel()
    return out if rank == 0 else None


def write_outputs(o, results: dict, world_size: int) -> None:
    out_dir = Path(o.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"args": {k: v for k, v in vars(o).items()}, "tp": world_size, "runs": {}}
    for label, r in results.items():
        rows = r["rows"]
        with open(out_dir / f"{label.replace(':', '_')}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["step", "loss", "elapsed_s"])
            w.writeheader()
            w.writerows(rows)
        tail = rows[-max(1, len(rows) // 10):]
        base = results[next(iter(results))]["rows"]
        summary["runs"][label] = {
            "steps": len(rows), "tail_loss": sum(x["loss"] for x in tail) / len(tail),
            "val_loss": r["val_loss"], "val_loss_first_weights": r["val_loss_first_weights"],
            "mean_abs_gap_to_first": sum(abs(x["loss"] - y["loss"]) for x, y in zip(rows, base))
            / min(len(rows), len(base)),
            "s_per_step": rows[-1]["elapsed_s"] / len(rows),
            "config": r["config"], "losses": [round(x["loss"], 5) for x in rows]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out_dir / "losses.png")
    for label, s in summary["runs"].items():
        print(f"{label:>12}: {s['steps']} steps, tail loss {s['tail_loss']:.4f}, "
              f"val loss {s['val_loss']:.4f}, mean |loss - first run's| "
              f"{s['mean_abs_gap_to_first']:.4f}, first run's weights: val loss "
              f"{s['val_loss_first_weights']:.4f}, {s['s_per_step']:.3f} s/step")


def _running_mean(v: list[float], k: int) -> list[float]:
    return [sum(v[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(v))]


def plot(summary: dict, out: Path) -> None:
    """Left: each run's training loss (k-step running mean); right: its gap to the '16' run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    a = summary["args"]
    title = (f"megatron-core GPTModel, TP={summary['tp']}{' SP' if a['sequence_parallel'] else ''}"
             f", {a['layers']}L x {a['hidden']}")
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 4))
    runs = summary["runs"]
    base = runs.get("16")
    k = 1
    for label, r in runs.items():
        loss = r["losses"]
        k = max(1, min(20, len(loss) // 10))
        ax.plot(_running_mean(loss, k), lw=1.3, label=f"{label} (val {r['val_loss']:.3f})")
        if base is not None and label != "16":
            gap = [x - y for x, y in zip(loss, base["losses"])]
            dx.plot(_running_mean(gap, k), lw=1.3, label=label)
    ax.set(xlabel="step", ylabel=f"train loss ({k}-step mean)", title=title)
    dx.axhline(0.0, color="k", lw=0.6)
    dx.set(xlabel="step", ylabel="loss - 16-bit loss (same steps)", title="gap to 16 bits")
    for axis in (ax, dx):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    o = parse_args(argv)
    if o.plot:
        out = Path(o.out_dir) / "losses.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(json.loads(Path(o.plot).read_text()), out)
        return
    if not o.tokens:
        raise SystemExit("--tokens FILE.bin is required (make one with `echo-tp tokenize`)")
    launched = launch(_rank, o, world_size=o.world_size)
    if launched.is_main and launched.result is not None:
        write_outputs(o, launched.result, o.world_size or int(os.environ["WORLD_SIZE"]))


if __name__ == "__main__":
    main()
