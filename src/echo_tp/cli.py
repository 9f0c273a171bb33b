"""`echo-tp` command line: argparse only; every subcommand calls a typed main(...) elsewhere."""
from __future__ import annotations

import argparse
import sys


def _demo(sub):
    p = sub.add_parser("demo", help="one pass of N sites on P gloo ranks: 16/8/4-bit vs Echo")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--sites", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--out", default="echo_demo.png", help="PNG plot of ||S_t|| against t")
    p.add_argument("--no-progress", action="store_true")

    def run(a):
        from .demo import main
        main(world_size=a.world_size, sites=a.sites, tokens=a.tokens, hidden=a.hidden,
             out=a.out, progress=not a.no_progress)
    p.set_defaults(func=run)


def _tokenize(sub):
    p = sub.add_parser("tokenize", help="text files/folders -> uint16/uint32 token files")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--tokenizer", default="", help="folder with vocab.json+merges.txt "
                   "(or tokenizer.json); default: the shipped GPT-2 tokenizer")
    p.add_argument("--out", required=True, help="output .bin path")
    p.add_argument("--val-fraction", type=float, default=0.0)

    def run(a):
        from .models.tokenize import main
        for path in main(a.inputs, a.tokenizer, a.out, val_fraction=a.val_fraction):
            print(path)
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echo-tp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_demo, _tokenize):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        print(f"echo-tp: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
