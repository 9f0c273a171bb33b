"""`echo-tp` command line: argparse only; every subcommand calls a typed main(...) elsewhere."""
from __future__ import annotations

import argparse
import sys
import traceback

from safetensors import SafetensorError

from . import demo, envs
from .eval import perplexity
from .launch import RankError
from .models import tokenize
from .train import loop


def _demo(sub):
    p = sub.add_parser("demo", help="one pass of N sites on P gloo ranks: 16/8/4-bit vs Echo")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sites", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--out", default="echo_demo.png", help="PNG plot of ||S_t|| against t")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-model", action="store_true",
                   help="skip the perplexity table of the shipped trained model")

    def run(a):
        demo.main(world_size=a.world_size, sites=a.sites, tokens=a.tokens, hidden=a.hidden,
             out=a.out, progress=not a.no_progress, with_model=not a.no_model)
    p.set_defaults(func=run)


def _tokenize(sub):
    p = sub.add_parser("tokenize", help="text files/folders -> uint16/uint32 token files")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--tokenizer", default="", help="folder with vocab.json+merges.txt "
                   "(or tokenizer.json); default: the shipped GPT-2 tokenizer")
    p.add_argument("--out", required=True, help="output .bin path")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="hold out about this fraction of the tokens in OUT's .val.bin")
    p.add_argument("--val-split", default="documents", choices=["documents", "tail"],
                   help="documents: whole input files, a seeded choice spread over the corpus; "
                   "tail: the end of the token stream (e.g. for one input file)")
    p.add_argument("--seed", type=int, default=0, help="which documents are held out")

    def run(a):
        for path in tokenize.main(a.inputs, a.tokenizer, a.out, val_fraction=a.val_fraction,
                         val_split=a.val_split, seed=a.seed):
            print(path)
    p.set_defaults(func=run)


def _tp_mode(p):
    g = p.add_argument_group("TP group (pick one; under torchrun: neither)")
    g.add_argument("--simulate", type=int, default=None, metavar="P",
                   help="P virtual ranks in this process (bit-identical to real ranks at 4/8 bits)")
    g.add_argument("--world-size", type=int, default=None, metavar="P",
                   help="spawn P gloo processes on CPU")


def _eval(sub):
    p = sub.add_parser("eval", help="perplexity under several comm configs (16/8/4/Echo/...)")
    p.add_argument("--model", required=True, help="HF checkpoint directory, or a preset name "
                   "or .json model config (random init from --seed)")
    p.add_argument("--data", required=True, help="token file (.bin + .json sidecar) or a text file")
    p.add_argument("--comms", nargs="+", default=["16", "8", "4", "echo4"],
                   help="comm specs NAME[:KEY=VALUE,...], e.g. 16 4 echo4 early8 "
                   "'echo4:eta=0.9,quantizer=naive' (keys: bits g quantizer eta a beta1 beta2 "
                   "residual grad_scaling state_dtype policy edge_bits gather_bits)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--stride", type=int, default=None,
                   help="window stride (default: --context, non-overlapping windows)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--bos", action="store_true",
                   help="prefix each window with BOS (not scored; the same targets are scored)")
    p.add_argument("--bos-id", type=int, default=None, help="BOS token id (implies --bos; "
                   "default: the token file's eos_id, or the tokenizer's <|endoftext|>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="simulated runs: cpu/cuda (default cuda if any)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory for text data "
                   "(default: the model directory's tokenizer.json, else GPT-2)")
    p.add_argument("--model-impl", default="auto", choices=["auto", "echo", "transformers"],
                   help="HF directories: the project's Transformer ('echo', Llama/Qwen3 with "
                   "plain RoPE) or transformers' own model through echo_tp.hf.load_hf_tp "
                   "('transformers': any family with a base_model_tp_plan); auto: echo where it "
                   "reproduces the config, else transformers")
    p.add_argument("--last-word", action="store_true", help="also score last-word accuracy "
                   "(LAMBADA-style: the greedy prediction of each sentence's final word)")
    p.add_argument("--calibration-data", default=None, help="token or text file of the "
                   "calibration pass of telemetry policies (policy=telemetry@BITS; default: --data)")
    p.add_argument("--calibration-windows", type=int, default=8)
    p.add_argument("--rotate", type=int, default=None, metavar="SEED", help="fold a hidden-size "
                   "rotation (Hadamard x random signs of this seed) into the weights first")
    p.add_argument("--sequence-parallel", action="store_true", help="the project's Transformer "
                   "sequence-parallel: a reduce-scatter and an all-gather at each block boundary "
                   "(the all-gathers at the comm's gather_bits: 8 unless the spec says, e.g. "
                   "'echo4:gather_bits=0' for the sites' own width)")
    p.add_argument("--kl", action="store_true", help="also the KL divergence of each config's "
                   "next-token distributions from the 16-bit model's (a 16-bit copy of the model "
                   "runs beside it)")
    p.add_argument("--out", default=None, help="JSON results file (with per-window NLLs)")
    p.add_argument("--no-progress", action="store_true")
    _tp_mode(p)

    def run(a):
        perplexity.main(model=a.model, data=a.data, comms=a.comms, context=a.context, stride=a.stride,
             batch_size=a.batch_size, max_windows=a.max_windows, simulate=a.simulate,
             world_size=a.world_size, seed=a.seed, dtype=a.dtype, device=a.device,
             tokenizer=a.tokenizer, out=a.out, progress=not a.no_progress,
             impl=a.model_impl, bos=a.bos or a.bos_id is not None, bos_id=a.bos_id,
             last_word=a.last_word, calibration_data=a.calibration_data,
             calibration_windows=a.calibration_windows, rotate=a.rotate,
             sequence_parallel=a.sequence_parallel, kl=a.kl)
    p.set_defaults(func=run)


def _train(sub):
    p = sub.add_parser("train", help="pretraining from scratch: one device, or TP with one comm "
                       "config")
    p.add_argument("--model", default="qwen3-150m", help="model preset, a .json model config "
                   "(ModelConfig fields, optionally on a \"preset\"; or a transformers "
                   "config.json), or an HF directory of a transformers causal LM: config.json "
                   "(random init from --seed) or config.json + *.safetensors (fine-tuning; each "
                   "rank reads only its slices)")
    p.add_argument("--model-field", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="ModelConfig fields on top of --model, e.g. n_layers=24 dim=512 "
                   "qk_norm=true")
    p.add_argument("--train-data", required=True, help="token file (.bin + .json sidecar)")
    p.add_argument("--val-data", default=None, help="held-out token file")
    p.add_argument("--comm", default="16", help="comm spec, e.g. 16, echo4, 'echo4:eta=0.9'")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps: the LR schedule")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop after the step that ends past SECONDS (from the first step), then "
                   "evaluate and save; the schedule stays the one over --steps")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--bos", action="store_true", help="every sequence starts with BOS and packs "
                   "whole document pieces (documents split at the token file's eos_id)")
    p.add_argument("--bos-id", type=int, default=None,
                   help="BOS token id (implies --bos; default: the token file's eos_id)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=None, help="default: lr / 10")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="max grad norm (0: off)")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="checkpoint dtype (default float32, the master weights as they are)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--sync-every", type=int, default=10, metavar="N",
                   help="read loss and grad norm from the device every N steps (the CSV still "
                   "gets a row per step)")
    p.add_argument("--out-dir", default="runs/train")
    p.add_argument("--seed", type=int, default=0, help="init and data order")
    p.add_argument("--device", default=None, help="plain and simulated runs: cpu/cuda (default "
                   "cuda if any)")
    p.add_argument("--amp", default=None, action=argparse.BooleanOptionalAction,
                   help="bf16 autocast (default: on for CUDA)")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("TP group (none of them: the plain model on one device; under "
                             "torchrun: neither)")
    g.add_argument("--simulate", type=int, default=None, metavar="P",
                   help="P virtual ranks in this process (bit-identical to real ranks at 4/8 "
                   "bits; P = 1: the plain model)")
    g.add_argument("--world-size", type=int, default=None, metavar="P",
                   help="spawn P gloo processes on CPU")
    g.add_argument("--sequence-parallel", action="store_true", help="a reduce-scatter and an "
                   "all-gather at each block boundary (the all-gathers at the comm's "
                   "gather_bits: 8 unless the spec says, e.g. 'echo4:gather_bits=0')")
    g.add_argument("--sim-path", default="shards", choices=["shards", "batched"],
                   help="--simulate: each block's virtual shards one after another (shards, "
                   "the reference) or the ranks as a batch dim of every op (batched: the "
                   "fast path; bit for bit on the CPU, within float tolerance on GPUs)")
    p.add_argument("--telemetry-every", type=int, default=0, metavar="N",
                   help="every N steps one step with the collective's per-call error telemetry "
                   "(out_dir/telemetry.csv; simulated: the exact ||y - sum x|| per site)")

    def run(a):
        loop.main(model=a.model, model_fields=a.model_field, train_data=a.train_data,
             val_data=a.val_data, comm=a.comm, steps=a.steps, time_budget=a.time_budget,
             seq_len=a.seq_len, batch_size=a.batch_size, grad_accum=a.grad_accum,
             bos=a.bos or a.bos_id is not None, bos_id=a.bos_id, lr=a.lr, min_lr=a.min_lr,
             warmup=a.warmup, weight_decay=a.weight_decay, clip=a.clip,
             eval_every=a.eval_every, eval_batches=a.eval_batches, save_every=a.save_every,
             save_dtype=a.save_dtype, compile=a.compile, sync_every=a.sync_every,
             out_dir=a.out_dir, seed=a.seed, device=a.device, amp=a.amp, simulate=a.simulate,
             world_size=a.world_size, progress=not a.no_progress,
             sequence_parallel=a.sequence_parallel, sim_path=a.sim_path,
             telemetry_every=a.telemetry_every)
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-tp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_demo, _tokenize, _eval, _train):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Errors a user can fix print one line and return 2: bad input (ValueError), a file that
    cannot be read or written (OSError: a wrong path, permissions, a full disk; the line names
    the file), a rank of --world-size that failed, died or hung. ECHO_CLI_TRACEBACK=1 prints
    the traceback (a rank's: its own) too."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except RankError as e:
        if envs.cli_traceback() and e.detail:
            print(e.detail, file=sys.stderr)
        print(f"echo-tp: error: {e.summary}", file=sys.stderr)
        return 2
    except (ValueError, OSError, SafetensorError) as e:
        if envs.cli_traceback():
            traceback.print_exc()
        print(f"echo-tp: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0


def _one_line(e: BaseException) -> str:
    """The error as one line; an OSError as 'file: reason' (the file it names)."""
    if isinstance(e, OSError) and e.filename:
        text = f"{e.filename}: {e.strerror or e}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
