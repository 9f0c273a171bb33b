"""`echo-tp train`: pretraining from scratch with TP, one comm config in forward and backward.

    main(model="qwen3-150m", train_data="train.bin", val_data="train.val.bin", comm="echo4",
         steps=2000, seq_len=1024, batch_size=8, grad_accum=4, lr=3.5e-4, simulate=4)
    main(model="qwen3-100m-8k", model_fields=("n_layers=24", "dim=512"), train_data=...,
         bos=True, compile=True, time_budget=600, save_dtype="bfloat16")   # one device, plain

- Model (train/model.py): a preset, a .json model config or an HF directory, KEY=VALUE fields on
  top (`model_fields`); random init from `seed` on every rank, then tp.parallelize (fp32 master
  weights; bf16 autocast on CUDA unless amp=False). A group of one (no simulate / world_size /
  torchrun, or any of them with P = 1) trains the plain single-device model: no communicator, no
  TP layers (a sum over one rank is its input exactly, so the comm config changes nothing).
  compile=True wraps the model in torch.compile (a simulated TP model on sim_path='batched':
  its blocks' batched functions instead, tp/batched.py; the sites stay eager).
- Simulated TP (simulate=P): sim_path='shards' (default, the reference) runs each block's P
  virtual shards one after another; 'batched' runs the project's attention and MLP blocks
  with the ranks as a batch dim of every op (tp/batched.py: the same parameters, sites and
  communicator calls; bit for bit on the CPU, within float tolerance on GPUs).
- Data: train/data.py, order fixed by `seed`: the same batches for every comm config. bos=True:
  every row starts with BOS and holds whole document pieces (documents split at the token file's
  eos_id; BOS = bos_id, default that same id, as in GPT-2-style vocabularies); padding is not
  scored. The validation rows are packed the same way.
- Step: grad_accum micro-batches (loss / grad_accum), tp.sync_partial_grads, clipping on the
  global grad norm (tp.clip_grad_norm_: split parameters all slices, replicated ones once; the
  plain path: torch.nn.utils.clip_grad_norm_), AdamW (betas 0.9/0.95, weight decay on matrices
  only), linear warmup then cosine to min_lr at `steps`.
- Host syncs: loss and grad norm stay on the device and are read every `sync_every` steps (one
  read for them all); log.csv still gets one row per step, a non-finite loss is raised at the
  read that sees it. elapsed_s is the host clock when the step was queued. Batches reach CUDA
  through pinned memory (no wait on queued work).
- time_budget (seconds, counted from the first step, compile time included): the run stops after
  the first step that ends past it (real ranks: rank 0's clock decides, one broadcast per step),
  then evaluates and saves as at a normal end. The LR schedule stays the one over `steps`, so a
  budget-stopped run ends before its cosine does; to end both together, set `steps` from the
  steps/s a short run prints.
- Every eval_every steps (and at the end): mean loss over the first eval_batches batches of
  val_data, same comm config. Every save_every steps (and at the end): whole weights gathered
  from the shards, written in save_dtype (float32 default, or bfloat16) as an HF checkpoint
  (out_dir/checkpoints/step-N) that `echo-tp eval` loads.
- out_dir/log.csv (per step) and out_dir/loss.png; out_dir/train_config.json; out_dir/result.json
  (what main returns: losses, tokens/s, the CUDA graph's status); with val_data
  out_dir/val_rows.json: the final evaluation's summed NLL and scored tokens of every held-out
  row (the same rows for every comm config and seed: a paired bootstrap's windows).
- telemetry_every=N (P > 1): steps 0, N, 2N, ... run with the collective's telemetry on
  (echo_tp.telemetry; simulated: the exact ||rho|| = ||y - sum x|| and ||delta|| of every
  call; real ranks: the estimate), one row per call in out_dir/telemetry.csv. Telemetry takes
  the reference all-reduce (same bits, slower) for those steps.
Runs plain, simulated (simulate=P), on P gloo processes (world_size=P) or under torchrun.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from echo_tp.models import load_tokens
from echo_tp.models.checkpoint import check_shards
from echo_tp.models.tokenize import check_token_file, separator_id
from echo_tp.options import cli
from echo_tp.paths import check_dir_target, writing
from echo_tp.telemetry import Telemetry
from echo_tp.tp import (SIM_PATHS, clip_grad_norm_, grad_norm, parse_comm_spec,
                        sync_partial_grads)
from echo_tp.tp.runtime import check_group_args, in_torchrun, launch, make_comm, rank_device

from . import graphed
from .data import IGNORE, TokenBatches, eval_batches
from .log import LossLog, TelemetryLog, plot_losses
from .model import (SAVE_DTYPES, Built, build_model, check_init_from, is_hf_dir, model_config,
                    save_checkpoint)
from .profile import ProfileWindow

LOG = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """The options of `echo-tp train` and train.main: each field is one command-line option
    (echo_tp.options: `--field-name`, its docstring the help)."""

    model: str | None = None
    """Model preset (default qwen3-150m), a .json model config (ModelConfig fields, optionally
    on a "preset"; or a transformers config.json), or an HF directory of a transformers causal
    LM: config.json (random init from --seed) or config.json + *.safetensors (fine-tuning; each
    rank reads only its slices)."""
    train_data: str
    """Token file (.bin + .json sidecar) to train on."""
    init_from: str | None = field(default=None, metadata=cli(metavar="CHECKPOINT"))
    """Continued pretraining: start from this pretrained HF folder (config.json +
    *.safetensors) or GGUF file, its own config and weights (instead of --model; the optimizer
    starts fresh). Tokenize the data with its tokenizer (echo-tp tokenize --tokenizer
    CHECKPOINT); checkpoints carry that tokenizer."""
    model_fields: tuple[str, ...] = field(default=(), metadata=cli(flag="--model-field",
                                                                   metavar="KEY=VALUE"))
    """ModelConfig fields on top of --model, e.g. n_layers=24 dim=512 qk_norm=true."""
    val_data: str | None = None
    """Held-out token file for periodic evaluation (None: no evaluation)."""
    comm: str = "16"
    """Comm spec (tp.policy), used at every forward and backward site, e.g. 16, echo4,
    'echo4:eta=0.9'."""
    steps: int = 1000
    """Optimizer steps: the LR schedule's length (also when --time-budget stops the run
    early)."""
    time_budget: float | None = field(default=None, metadata=cli(metavar="SECONDS"))
    """Stop after the step that ends past SECONDS (from the first step), then evaluate and
    save; the schedule stays the one over --steps."""
    seq_len: int = 1024
    """Tokens per sequence."""
    batch_size: int = 8
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    bos: bool = field(default=False, metadata=cli(implied_by="bos_id"))
    """Every sequence starts with BOS and packs whole document pieces (documents split at the
    token file's eos_id; train/data.py)."""
    bos_id: int | None = None
    """BOS token id (implies --bos; default: the token file's eos_id, its document
    separator)."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float | None = None
    """End of the cosine decay (default: lr / 10)."""
    warmup: int = 100
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    clip: float = 1.0
    """Max global grad norm (0: no clipping, the norm is still logged)."""
    eval_every: int = 0
    """Evaluate on --val-data every N steps (0: at the end only)."""
    eval_batches: int = 20
    """Batches of each evaluation."""
    save_every: int = 0
    """Save a checkpoint every N steps (0: at the end only)."""
    save_dtype: str = field(default="float32", metadata=cli(choices=SAVE_DTYPES))
    """Checkpoint dtype: float32 (the master weights as they are) or bfloat16 (half the size)."""
    compile: bool = False
    """torch.compile the model (its forward and backward)."""
    cuda_graph: bool = False
    """Replay each step's passes as one CUDA graph (train/graphed.py: captured after a few
    eager steps; plain and simulated runs on CUDA, else eager with the reason logged)."""
    sync_every: int = field(default=10, metadata=cli(metavar="N"))
    """Read loss and grad norm from the device every N steps (one host sync per N steps; the
    CSV still gets a row per step)."""
    out_dir: str = "runs/train"
    """Output directory: config, log.csv, the plot, checkpoints."""
    seed: int = 0
    """Init and data order."""
    device: str | None = None
    """Plain and simulated runs: cpu/cuda (default cuda if any)."""
    amp: bool | None = None
    """bf16 autocast (default: on for CUDA, off on CPU)."""
    sequence_parallel: bool = field(default=False, metadata=cli(group="tp"))
    """TP runs sequence-parallel (tp/sequence.py): a reduce-scatter and an all-gather at each
    block boundary instead of the all-reduce (the all-gathers at the comm's gather_bits: 8
    unless the spec says, e.g. 'echo4:gather_bits=0'; seq_len must split over the ranks)."""
    sim_path: str = field(default="shards", metadata=cli(choices=SIM_PATHS, group="tp"))
    """--simulate: each block's virtual shards one after another ('shards', the reference) or
    the ranks as a batch dim of every op ('batched': the fast path, tp/batched.py; bit for bit
    on the CPU, within float tolerance on GPUs). Other modes ignore it."""
    telemetry_every: int = field(default=0, metadata=cli(metavar="N"))
    """Every N steps one step with the collective's per-call error telemetry on
    (out_dir/telemetry.csv; simulated: the exact ||y - sum x|| per site; 0: never; module
    doc)."""
    profile_steps: int = field(default=0, metadata=cli(metavar="N"))
    """Run the last N steps under torch.profiler: out_dir/profile.json, every kernel's (CUDA)
    or operator's (CPU) calls and time over them (train/profile.py; 0: off). The run's
    tokens/s then include the profiler's cost."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_fields", tuple(self.model_fields))
        if self.init_from is not None and (self.model is not None or self.model_fields):
            raise ValueError("--init-from brings its own model: drop --model and --model-field")
        if self.model is None and self.init_from is None:
            object.__setattr__(self, "model", "qwen3-150m")
        for name in ("steps", "seq_len", "batch_size", "grad_accum", "eval_batches",
                     "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "eval_every", "save_every", "telemetry_every", "profile_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr, got {self.lr}, {self.min_lr}")
        if self.clip < 0 or self.weight_decay < 0:
            raise ValueError("clip and weight_decay must be >= 0")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"time_budget must be > 0 seconds, got {self.time_budget}")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype must be one of {sorted(SAVE_DTYPES)}, got "
                             f"{self.save_dtype!r}")
        if self.sim_path not in SIM_PATHS:
            raise ValueError(f"sim_path must be one of {SIM_PATHS}, got {self.sim_path!r}")
        if self.profile_steps > self.steps:
            raise ValueError(f"profile_steps must be <= steps ({self.steps}), got "
                             f"{self.profile_steps}")
        if self.bos_id is not None and (not self.bos or self.bos_id < 0):
            raise ValueError(f"bos_id needs bos=True and an id >= 0, got {self.bos_id}")


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


def data_ids(o: TrainOptions) -> dict:
    """BOS and document-separator ids of the token files ({} unless o.bos)."""
    if not o.bos:
        return {}
    sep = separator_id(o.train_data)
    ids = {"bos_id": sep if o.bos_id is None else o.bos_id, "sep_id": sep}
    if o.val_data:
        ids["val_sep_id"] = separator_id(o.val_data)
    return ids


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on device; to CUDA through pinned memory, so the copy does not wait for the
    work already queued (a copy from pageable memory would: a host sync per micro-batch)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _logits(model, x, amp: bool, device) -> torch.Tensor:
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(x)  # [B, T, V]
        return getattr(logits, "logits", logits)  # a transformers ModelOutput


def _loss(model, x, y, amp: bool, device) -> torch.Tensor:
    logits = _logits(model, x, amp, device)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # padding (-100) skipped


@torch.no_grad()
def evaluate(model, batches, amp: bool, device, rows: bool = False):
    """The mean of the batches' mean losses; rows=True: (that mean, every row's summed NLL
    [R] float64, its scored tokens [R] int64), on the CPU."""
    total, nll, count = 0.0, [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        logits = _logits(model, x, amp, device).float().flatten(0, 1)
        total += float(F.cross_entropy(logits, y.flatten()))
        if rows:  # ignored (padding) positions give 0
            tok = F.cross_entropy(logits, y.flatten(), reduction="none").view(y.shape)
            nll.append(tok.double().sum(1).cpu())
            count.append((y != IGNORE).sum(1).cpu())
    mean = total / len(batches)
    return (mean, torch.cat(nll), torch.cat(count)) if rows else mean


def _grad_norm(built: Built, clip: float) -> torch.Tensor:
    """Global grad norm before clipping (clipped in place when clip > 0); no host sync."""
    if built.mode == "plain":
        params = [p for p in built.model.parameters() if p.grad is not None]
        if clip > 0:
            return torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    sync_partial_grads(built.model)
    return clip_grad_norm_(built.model, clip) if clip > 0 else grad_norm(built.model)


def prepare_forward(built: Built, compile: bool):
    """What a step calls: the model, or with compile torch.compile(model); a simulated model
    on the batched path compiles its blocks' batched functions instead (tp/batched.py)."""
    if not compile:
        return built.model
    tp = getattr(built.model, "echo_tp", None)
    if built.mode == "simulated" and tp is not None and tp.sim_path == "batched":
        tp.compile_blocks = True
        return built.model
    return torch.compile(built.model)


def step_passes(forward, built: Built, xs: list, ys: list, clip: float,
                amp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The passes of one step on its micro-batches xs, ys ([B, T] each, on the device): forward
    and backward of each (loss / len(xs)), the partial-grad sync and clipping -> (mean loss
    fp64, grad norm before clipping), both on the device (no host sync)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=xs[0].device)
    for x, y in zip(xs, ys):
        loss = _loss(forward, x, y, amp, x.device)
        (loss / len(xs)).backward()
        loss_sum += loss.detach().double()
    norm = _grad_norm(built, clip)
    return loss_sum / len(xs), norm.detach()


def train_step(forward, built: Built, opt, batches, o: TrainOptions, device,
               amp: bool, set_to_none: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step at the LR already set: o.grad_accum micro-batches from batches
    (step_passes), AdamW -> (mean loss fp64, grad norm before clipping), both on the device.
    set_to_none=False zeroes the gradients in place (a CUDA graph owns them: graphed.py)."""
    opt.zero_grad(set_to_none=set_to_none)
    pairs = [next(batches) for _ in range(o.grad_accum)]
    loss, norm = step_passes(forward, built, [_to(x, device) for x, _ in pairs],
                             [_to(y, device) for _, y in pairs], o.clip, amp)
    opt.step()
    return loss, norm


class Stepper:
    """One optimizer step per call: train_step, or with o.cuda_graph (where graphed.unfit
    allows) the graphed passes after graphed.WARM_STEPS warm-up steps on a side stream, then
    AdamW. eager=True runs a step eagerly (a telemetry step); after the capture such a step
    zeroes the gradients in place, since the graph writes into them. A capture that raises
    leaves the run eager, that step run on the batches already loaded; `status` says which."""

    def __init__(self, forward, built: Built, opt, o: TrainOptions, device, amp: bool):
        self.forward, self.built, self.opt, self.o = forward, built, opt, o
        self.device, self.amp = device, amp
        self.graph, self.status, self.count = None, "off", 0
        if o.cuda_graph:
            why = graphed.unfit(built.mode, device)
            if why is None:
                self.graph = graphed.GraphedPasses(forward, built, grad_accum=o.grad_accum,
                                                   clip=o.clip, amp=amp, passes=step_passes)
                self.status = "not captured"
            else:
                LOG.warning("--cuda-graph: running eagerly: %s", why)
                self.status = why

    def __call__(self, batches, eager: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        self.count += 1
        g = self.graph
        if g is None or (eager and g.graph is not None):
            return train_step(self.forward, self.built, self.opt, batches, self.o, self.device,
                              self.amp, set_to_none=g is None)
        if self.count <= graphed.WARM_STEPS or eager:
            with graphed.warm_stream(self.device):   # warm-up before the capture
                return train_step(self.forward, self.built, self.opt, batches, self.o,
                                  self.device, self.amp)
        try:
            loss, norm = g(batches)
            self.status = "on"
        except Exception as e:  # noqa: BLE001 - any capture failure: the run goes eagerly
            if g.graph is not None:
                raise
            LOG.warning("--cuda-graph: capture failed, running eagerly: %s", e)
            self.status = f"capture failed: {type(e).__name__}: {e}"
            self.graph = None
            self.opt.zero_grad(set_to_none=True)
            loss, norm = step_passes(self.forward, self.built, list(g.x.unbind(0)),
                                     list(g.y.unbind(0)), self.o.clip, self.amp)
        self.opt.step()
        return loss, norm


def _over_budget(o: TrainOptions, elapsed: float, built: Built, device) -> bool:
    if o.time_budget is None:
        return False
    over = elapsed >= o.time_budget
    if built.mode == "ranks":  # every rank stops at the same step: rank 0's clock decides
        flag = torch.tensor(float(over), device=device)
        dist.broadcast(flag, 0)
        over = bool(flag)
    return over


def _rank_train(rank: int | None, world_size: int, o: TrainOptions) -> dict:
    device = rank_device(o.device, rank)
    amp = device.type == "cuda" if o.amp is None else o.amp
    main = rank in (None, 0)
    spec = parse_comm_spec(o.comm)
    comm = None if world_size == 1 else make_comm(rank, world_size, spec.config)
    built = build_model(o.model, o.model_fields, seed=o.seed, comm=comm, rank=rank,
                        world_size=world_size, device=device, policy=spec.widths,
                        sequence_parallel=o.sequence_parallel, sim_path=o.sim_path,
                        init_from=o.init_from)
    model = built.model
    forward = prepare_forward(built, o.compile)
    opt = build_optimizer(model, o)
    ids = data_ids(o)
    tokens = load_tokens(o.train_data)
    top = max(int(tokens.max()) if tokens.numel() else -1, ids.get("bos_id", -1))
    if top >= built.vocab_size:
        raise ValueError(f"train token id {top} (BOS included) >= vocab_size "
                         f"{built.vocab_size}: data and model use different tokenizers")
    batches = TokenBatches(tokens, seq_len=o.seq_len, batch_size=o.batch_size, seed=o.seed,
                           bos_id=ids.get("bos_id"), sep_id=ids.get("sep_id"))
    val = None
    if o.val_data:
        val_tokens = load_tokens(o.val_data)
        if val_tokens.numel() and int(val_tokens.max()) >= built.vocab_size:
            raise ValueError(f"val token id {int(val_tokens.max())} >= vocab_size "
                             f"{built.vocab_size}: data and model use different tokenizers")
        val = eval_batches(val_tokens, seq_len=o.seq_len,
                           batch_size=o.batch_size, max_batches=o.eval_batches,
                           bos_id=ids.get("bos_id"), sep_id=ids.get("val_sep_id"))
    out = Path(o.out_dir)
    log = None
    if main:
        with writing(out / "train_config.json"):
            out.mkdir(parents=True, exist_ok=True)
            (out / "train_config.json").write_text(json.dumps(
                {**dataclasses.asdict(o), "world_size": world_size, "mode": built.mode,
                 "simulated": built.mode == "simulated", **ids, "comm_config": spec.as_dict(),
                 "model_config": built.config}, indent=2) + "\n")
        log = LossLog(out / "log.csv")
    tlog = TelemetryLog(out / "telemetry.csv") if main and o.telemetry_every and comm else None
    bar = None
    if main and o.progress:
        bar = tqdm(total=o.steps, desc=f"train {spec.label} ({built.mode})", unit="step")
    tokens_per_step = o.batch_size * o.grad_accum * o.seq_len
    stepper = Stepper(forward, built, opt, o, device, amp)
    window = ProfileWindow(o.profile_steps, o.steps, device) if main and o.profile_steps \
        else None
    pending: list[tuple] = []  # (step, lr, loss, norm, elapsed), loss and norm on the device
    state = {"loss": None}

    def read_pending() -> None:  # one host sync for every pending step
        if not pending:
            return
        values = torch.stack([torch.stack([p[2], p[3].double()]) for p in pending]).tolist()
        for (step, lr, _, _, elapsed), (loss, norm) in zip(pending, values):
            if not math.isfinite(loss):
                raise RuntimeError(f"loss is {loss} at step {step} ({spec.label}); lower the "
                                   "learning rate or use more bits")
            if log is not None:
                log.append(step=step, tokens=step * tokens_per_step, lr=lr, loss=loss,
                           grad_norm=norm, val_loss=None, elapsed_s=elapsed)
        if bar is not None:
            bar.update(len(pending))
            bar.set_postfix(loss=f"{values[-1][0]:.3f}")
        state["loss"] = values[-1][0]
        pending.clear()

    # the steady clock starts after step 1 (compile), with a graph after its first replay
    steady_step = max(1, min(1 + (graphed.WARM_STEPS if stepper.graph is not None else 0),
                             o.steps - 1))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    t_step1 = t_last = t0
    val_loss, done, stopped = None, 0, "steps"
    for step in range(o.steps):
        lr = lr_at(step, o)
        for group in opt.param_groups:
            group["lr"] = lr
        sample = comm is not None and o.telemetry_every and step % o.telemetry_every == 0
        if sample:
            comm.telemetry = Telemetry()        # this step's calls leave rows (module doc)
        if window is not None:
            window.before(step)
        loss, norm = stepper(batches, eager=sample)
        if sample:
            rows = comm.telemetry_summary()     # on real ranks a collective: every rank
            comm.telemetry = None
            if tlog is not None:
                tlog.append(step + 1, rows)
        done = step + 1
        elapsed = time.perf_counter() - t0
        pending.append((done, lr, loss, norm, elapsed))
        if _over_budget(o, elapsed, built, device):
            stopped = "time_budget"
        last = done == o.steps or stopped != "steps"
        do_eval = val is not None and ((o.eval_every and done % o.eval_every == 0) or last)
        do_save = (o.save_every and done % o.save_every == 0) or last
        if last and window is not None:
            window.stop()                      # before the evaluation and the checkpoint
        if (last or do_eval or do_save or done % o.sync_every == 0 or done == 1
                or done == steady_step):
            read_pending()                     # a device sync: the clock below sees the work
            if done == steady_step:
                t_step1 = time.perf_counter()  # compile, warm-up and capture are before it
            if last:
                t_last = time.perf_counter()
        if do_eval:
            got = evaluate(forward, val, amp, device, rows=last)
            val_loss = got[0] if last else got
            if last and main:
                (out / "val_rows.json").write_text(json.dumps(
                    {"step": done, "nll": got[1].tolist(), "tokens": got[2].tolist()}) + "\n")
            model.train()
            if log is not None:
                log.set_val(val_loss)
            if bar is not None:
                bar.set_postfix(loss=f"{state['loss']:.3f}", val=f"{val_loss:.3f}")
        if do_save:
            with writing(out / "checkpoints" / f"step-{done}"):
                save_checkpoint(built, out / "checkpoints" / f"step-{done}", main=main,
                                dtype=o.save_dtype)
        if last:
            break
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if not main:
        return {}
    with writing(out / "loss.png"):
        name = Path(o.model or o.init_from).name
        plot = plot_losses(log.rows, out / "loss.png", title=f"{name}, "
                           f"TP={world_size} ({built.mode}), comm {spec.label}")
    profiled = window.write(out / "profile.json") if window is not None else None
    losses = [r["loss"] for r in log.rows]
    tail = losses[-min(100, len(losses)):]
    result = {"comm": spec.label, "mode": built.mode, "steps": done, "planned_steps": o.steps,
            "stopped_by": stopped, "tokens": done * tokens_per_step,
            "first_loss": losses[0], "final_loss": losses[-1], "tail_loss": sum(tail) / len(tail),
            "val_loss": val_loss, "log": str(log.path), "plot": str(plot),
            "checkpoint": str(out / "checkpoints" / f"step-{done}"), "seconds": seconds,
            "cuda_graph": stepper.status,
            "tokens_per_s": done * tokens_per_step / seconds,
            "steady_from_step": steady_step,
            "steady_tokens_per_s": (done - steady_step) * tokens_per_step / (t_last - t_step1)
            if done > steady_step and t_last > t_step1 else None,
            "peak_gpu_mib": (torch.cuda.max_memory_allocated(device) / 2**20
                             if device.type == "cuda" else None),
            "profile": str(profiled) if profiled else None}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(*, simulate: int | None = None, world_size: int | None = None, **options) -> dict:
    """Train (options: TrainOptions' fields) on simulate=P virtual ranks, world_size=P gloo
    processes or under torchrun (tp.runtime.Group); with none of them (or P = 1) the plain
    single-device model. Prints a summary on rank 0 and returns it ({} elsewhere)."""
    o = TrainOptions(**options)
    check_group_args(simulate=simulate, world_size=world_size)
    parse_comm_spec(o.comm)  # fail fast, before any process starts or the model is built
    if o.init_from is not None:
        check_init_from(o.init_from)
    else:
        model_config(o.model, o.model_fields)
        if is_hf_dir(o.model) and any(Path(o.model).glob("*.safetensors")):
            check_shards(o.model)
    check_token_file(o.train_data, "--train-data")
    if o.val_data:
        check_token_file(o.val_data, "--val-data")
    check_dir_target(o.out_dir, "--out-dir")
    data_ids(o)
    if simulate is None and world_size is None and not in_torchrun():
        simulate = 1  # a group of one: the plain model, in this process
    run = launch(_rank_train, o, simulate=simulate, world_size=world_size)
    if run.is_main:
        r = run.result
        stop = (f" (time budget {o.time_budget:g}s, of {r['planned_steps']})"
                if r["stopped_by"] == "time_budget" else "")
        print(f"{o.model or o.init_from} | {r['mode']} | comm {r['comm']} | {r['steps']} steps"
              f"{stop}, "
              f"{r['tokens']:,} tokens | loss {r['first_loss']:.4f} -> {r['final_loss']:.4f} "
              f"(tail mean {r['tail_loss']:.4f})"
              + (f" | val {r['val_loss']:.4f}" if r["val_loss"] is not None else "")
              + f" | {r['seconds']:.1f}s, {r['tokens_per_s']:,.0f} tokens/s"
              + (f" ({r['steady_tokens_per_s']:,.0f} after step {r['steady_from_step']})"
                 if r.get("steady_tokens_per_s") else ""))
        print(f"log {r['log']}, plot {r['plot']}, checkpoint {r['checkpoint']}")
    return run.result
