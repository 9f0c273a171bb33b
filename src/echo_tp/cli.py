"""`echo-tp` command line: argparse only; every subcommand calls a typed main(...) elsewhere.
eval's and train's options are their dataclasses' fields (EvalOptions, TrainOptions, and
tp.runtime.Group for the TP group; echo_tp.options turns fields into arguments): a new
option is one new field."""
from __future__ import annotations

import argparse
import sys
import traceback

from safetensors import SafetensorError

from . import demo, envs
from .eval import runner as eval_runner
from .eval.config import EvalOptions
from .launch import RankError
from .models import tokenize
from .options import add_bool, add_options, from_args
from .tp.runtime import Group
from .train import loop
from .train.loop import TrainOptions


def _demo(sub):
    p = sub.add_parser("demo", help="one pass of N sites on P gloo ranks: 16/8/4-bit vs Echo")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sites", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--out", default="echo_demo.png", help="PNG plot of ||S_t|| against t")
    add_bool(p, "--progress", dest="progress", default=True, help="show a progress bar")
    add_bool(p, "--model", dest="with_model", default=True,
             help="add the perplexity table of the shipped trained model")

    def run(a):
        demo.main(world_size=a.world_size, sites=a.sites, tokens=a.tokens, hidden=a.hidden,
                  out=a.out, progress=a.progress, with_model=a.with_model)
    p.set_defaults(func=run)


def _tokenize(sub):
    p = sub.add_parser("tokenize", help="text files/folders -> uint16/uint32 token files")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--tokenizer", default="", help="folder with vocab.json+merges.txt "
                   "(or tokenizer.json), or a GGUF file (its tokenizer); default: the shipped "
                   "GPT-2 tokenizer")
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


def _group(p, title: str) -> dict:
    """The TP group's options (tp.runtime.Group) in their own argument group."""
    g = p.add_argument_group(title)
    add_options(g, Group)
    return {"tp": g}


def _eval(sub):
    p = sub.add_parser("eval", help="perplexity under several comm configs (16/8/4/Echo/...)")
    groups = _group(p, "TP group (pick one; under torchrun: neither)")
    add_options(p, EvalOptions, groups)
    p.set_defaults(func=lambda a: eval_runner.main(**from_args(EvalOptions, a),
                                                  **from_args(Group, a)))


def _train(sub):
    p = sub.add_parser("train", help="pretraining from scratch: one device, or TP with one comm "
                       "config")
    groups = _group(p, "TP group (none of them: the plain model on one device; under "
                       "torchrun: neither)")
    add_options(p, TrainOptions, groups)
    p.set_defaults(func=lambda a: loop.main(**from_args(TrainOptions, a), **from_args(Group, a)))


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
