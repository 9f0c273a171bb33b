"""`echo-tp train`: pretraining from scratch with TP, one comm config in forward and backward.

    main(model="qwen3-150m", train_data="train.bin", val_data="train.val.bin", comm="echo4",
         steps=2000, seq_len=1024, batch_size=8, grad_accum=4, lr=3.5e-4, simulate=4)

- Model: a preset, random init from `seed` on every rank, then tp.parallelize (fp32 master
  weights; bf16 autocast on CUDA unless amp=False). Or an HF directory with a config.json of a
  transformers causal LM (any family echo_tp.hf supports): with *.safetensors weights it is
  loaded by echo_tp.hf.load_hf_tp (fine-tuning; each rank reads its slices), with config.json
  only it is built by transformers (from_config, seeded by `seed`, the same on every rank) and
  sharded by parallelize_hf; fp32 either way. Checkpoints are then written by echo_tp.hf.save_hf.
- Data: train/data.py, order fixed by `seed`: the same batches for every comm config.
- Step: grad_accum micro-batches (loss / grad_accum), tp.sync_partial_grads, clipping on the
  global grad norm (tp.clip_grad_norm_: split parameters all slices, replicated ones once), AdamW
  (betas 0.9/0.95, weight decay on matrices only), linear warmup then cosine to min_lr.
- Every eval_every steps (and at the end): mean loss over the first eval_batches batches of
  val_data, same comm config. Every save_every steps (and at the end): whole weights gathered
  from the shards and written as an HF checkpoint (out_dir/checkpoints/step-N).
- out_dir/log.csv (per step) and out_dir/loss.png; out_dir/train_config.json.
Runs simulated (simulate=P), on P gloo processes (world_size=P) or under torchrun (NCCL on GPUs).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from echo_tp.models import ModelConfig, build_meta_model, init_weights, load_tokens, \
    save_hf_checkpoint
from echo_tp.tp import (clip_grad_norm_, grad_norm, parallelize, parse_comm_spec,
                        sync_partial_grads, unshard)
from echo_tp.tp.runtime import launch, make_comm, rank_device

from .data import TokenBatches, eval_batches
from .log import LossLog, plot_losses


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    model: str
    """Model preset name (echo_tp.models.PRESETS), or an HF directory (see the module doc)."""
    train_data: str
    """Token file (.bin + .json sidecar) to train on."""
    val_data: str | None = None
    """Held-out token file for periodic evaluation (None: no evaluation)."""
    comm: str = "16"
    """Comm spec string (tp.policy), used at every forward and backward site."""
    steps: int = 1000
    seq_len: int = 1024
    batch_size: int = 8
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 3e-4
    min_lr: float | None = None
    """End of the cosine decay (default lr / 10)."""
    warmup: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0
    """Max global grad norm (0: no clipping, the norm is still logged)."""
    eval_every: int = 0
    eval_batches: int = 20
    save_every: int = 0
    out_dir: str = "runs/train"
    seed: int = 0
    device: str | None = None
    amp: bool | None = None
    """bf16 autocast; default: on for CUDA, off on CPU."""
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "batch_size", "grad_accum", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got {self.lr}, {self.min_lr}")
        if self.clip < 0 or self.weight_decay < 0:
            raise ValueError("clip and weight_decay must be >= 0")


def lr_at(step: int, o: TrainOptions) -> float:
    """Linear warmup over `warmup` steps to lr, then cosine decay to min_lr at `steps`."""
    min_lr = o.lr / 10 if o.min_lr is None else o.min_lr
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    span = max(1, o.steps - o.warmup)
    t = min(1.0, (step - o.warmup) / span)
    return min_lr + 0.5 * (o.lr - min_lr) * (1 + math.cos(math.pi * t))


def build_optimizer(model, o: TrainOptions) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (ndim >= 2), none on norms and biases."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def is_hf_dir(spec: str) -> bool:
    """An HF directory (config.json), not a preset name; ValueError for a dir without one."""
    path = Path(spec)
    if not path.is_dir():
        return False
    if not (path / "config.json").is_file():
        raise ValueError(f"{spec} is a directory without config.json: pass a preset name or an "
                         "HF directory (config.json, optionally *.safetensors)")
    return True


def _build_hf(o: TrainOptions, comm, rank, device, policy):
    """(parallelized transformers model in train mode, its config as a dict, vocab_size)."""
    import transformers

    from echo_tp.hf import load_hf_tp, parallelize_hf
    from echo_tp.hf.plan import text_config
    if any(Path(o.model).glob("*.safetensors")):
        model = load_hf_tp(o.model, comm, rank, dtype=torch.float32, device=device,
                           policy=policy)
    else:
        config = transformers.AutoConfig.from_pretrained(o.model)
        torch.manual_seed(o.seed)  # the same init on every rank (built whole, then sharded)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        parallelize_hf(model.to(device), comm, rank, policy=policy)
    return model.train(), model.config.to_dict(), text_config(model).vocab_size


def _loss(model, x, y, amp: bool, device) -> torch.Tensor:
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(x)  # [B, T, V]
        logits = getattr(logits, "logits", logits)  # a transformers ModelOutput
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model, batches, amp: bool, device) -> float:
    total = 0.0
    for x, y in batches:
        total += float(_loss(model, x.to(device), y.to(device), amp, device))
    return total / len(batches)


def _rank_train(rank: int | None, world_size: int, o: TrainOptions) -> dict:
    device = rank_device(o.device, rank)
    amp = device.type == "cuda" if o.amp is None else o.amp
    main = rank in (None, 0)
    spec = parse_comm_spec(o.comm)
    comm = make_comm(rank, world_size, spec.config)
    if is_hf_dir(o.model):
        cfg = None
        model, model_config, vocab_size = _build_hf(o, comm, rank, device, spec.policy)
    else:
        cfg = ModelConfig.from_name(o.model)
        model = init_weights(build_meta_model(cfg).to_empty(device=device), seed=o.seed).train()
        parallelize(model, comm, rank, policy=spec.policy)
        model_config, vocab_size = dataclasses.asdict(cfg), cfg.vocab_size
    opt = build_optimizer(model, o)
    tokens = load_tokens(o.train_data)
    for name, t in (("train", tokens),):
        if t.numel() and int(t.max()) >= vocab_size:
            raise ValueError(f"{name} token id {int(t.max())} >= vocab_size {vocab_size}")
    batches = TokenBatches(tokens, seq_len=o.seq_len, batch_size=o.batch_size, seed=o.seed)
    val = None
    if o.val_data:
        val = eval_batches(load_tokens(o.val_data), seq_len=o.seq_len,
                           batch_size=o.batch_size, max_batches=o.eval_batches)
    out = Path(o.out_dir)
    log = None
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(
            {**dataclasses.asdict(o), "world_size": world_size, "simulated": rank is None,
             "comm_config": spec.as_dict(), "model_config": model_config},
            indent=2) + "\n")
        log = LossLog(out / "log.csv")
    bar = None
    if main and o.progress:
        from tqdm import tqdm
        bar = tqdm(total=o.steps, desc=f"train {spec.label}", unit="step")
    tokens_per_step = o.batch_size * o.grad_accum * o.seq_len
    t0 = time.perf_counter()
    val_loss = None
    for step in range(o.steps):
        lr = lr_at(step, o)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(o.grad_accum):
            x, y = next(batches)
            loss = _loss(model, x.to(device), y.to(device), amp, device)
            (loss / o.grad_accum).backward()
            loss_sum += float(loss.detach())
        step_loss = loss_sum / o.grad_accum
        if not math.isfinite(step_loss):
            raise RuntimeError(f"loss is {step_loss} at step {step + 1} ({spec.label}); lower "
                               "the learning rate or use more bits")
        sync_partial_grads(model)
        norm = float(clip_grad_norm_(model, o.clip) if o.clip > 0 else grad_norm(model))
        opt.step()
        if log is not None:
            log.append(step=step + 1, tokens=(step + 1) * tokens_per_step, lr=lr, loss=step_loss,
                       grad_norm=norm, val_loss=None, elapsed_s=time.perf_counter() - t0)
        last = step + 1 == o.steps
        if val is not None and ((o.eval_every and (step + 1) % o.eval_every == 0) or last):
            val_loss = evaluate(model, val, amp, device)
            model.train()
            if log is not None:
                log.set_val(val_loss)
        if (o.save_every and (step + 1) % o.save_every == 0) or last:
            _save(model, cfg, out / "checkpoints" / f"step-{step + 1}", main)
        if bar is not None:
            bar.set_postfix(loss=f"{step_loss:.3f}", **({"val": f"{val_loss:.3f}"}
                                                        if val_loss is not None else {}))
            bar.update(1)
    if bar is not None:
        bar.close()
    if not main:
        return {}
    plot = plot_losses(log.rows, out / "loss.png", title=f"{Path(o.model).name}, "
                       f"TP={world_size}, "
                       f"comm {spec.label}")
    losses = [r["loss"] for r in log.rows]
    tail = losses[-min(100, len(losses)):]
    return {"comm": spec.label, "steps": o.steps, "tokens": o.steps * tokens_per_step,
            "first_loss": losses[0], "final_loss": losses[-1], "tail_loss": sum(tail) / len(tail),
            "val_loss": val_loss, "log": str(log.path), "plot": str(plot),
            "checkpoint": str(out / "checkpoints" / f"step-{o.steps}"),
            "seconds": time.perf_counter() - t0}


def _save(model, cfg, path: Path, main: bool) -> None:
    if cfg is None:  # a transformers model
        from echo_tp.hf import save_hf
        save_hf(model, path)  # collective on real ranks; rank 0 writes
        return
    whole = unshard(model)  # collective on real ranks
    if main:
        save_hf_checkpoint(whole, cfg, path)


def main(*, model: str, train_data: str, val_data: str | None = None, comm: str = "16",
         steps: int = 1000, seq_len: int = 1024, batch_size: int = 8, grad_accum: int = 1,
         lr: float = 3e-4, min_lr: float | None = None, warmup: int = 100,
         weight_decay: float = 0.1, clip: float = 1.0, eval_every: int = 0,
         eval_batches: int = 20, save_every: int = 0, out_dir: str = "runs/train", seed: int = 0,
         device: str | None = None, amp: bool | None = None, simulate: int | None = None,
         world_size: int | None = None, progress: bool = True) -> dict:
    """Train (arguments as in TrainOptions) on simulate=P virtual ranks, world_size=P gloo
    processes or under torchrun. Prints a summary on rank 0 and returns it ({} elsewhere)."""
    o = TrainOptions(model=model, train_data=train_data, val_data=val_data, comm=comm,
                     steps=steps, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                     lr=lr, min_lr=min_lr, warmup=warmup, weight_decay=weight_decay, clip=clip,
                     eval_every=eval_every, eval_batches=eval_batches, save_every=save_every,
                     out_dir=out_dir, seed=seed, device=device, amp=amp, progress=progress)
    parse_comm_spec(o.comm)  # fail fast, before any process starts
    if not is_hf_dir(o.model):
        ModelConfig.from_name(o.model)
    run = launch(_rank_train, o, simulate=simulate, world_size=world_size)
    if run.is_main:
        r = run.result
        print(f"{o.model} | comm {r['comm']} | {r['steps']} steps, {r['tokens']:,} tokens | "
              f"loss {r['first_loss']:.4f} -> {r['final_loss']:.4f} (tail mean "
              f"{r['tail_loss']:.4f})"
              + (f" | val {r['val_loss']:.4f}" if r["val_loss"] is not None else "")
              + f" | {r['seconds']:.1f}s")
        print(f"log {r['log']}, plot {r['plot']}, checkpoint {r['checkpoint']}")
    return run.result
