"""One entry point for every GPU job (the table: benchmarks/jobs/table.py).

On this machine (the repository root):

    python -m benchmarks.jobs list                       # the jobs: kind, seconds, records
    python -m benchmarks.jobs command testbed fidelity --budget 560 [--from DIR]
        [--part smol:FILE.part00 ...] [--set KEY=VALUE ...]

`command` copies the carried inputs into place (from DIR, where they lie under their file
names; --part: pieces of a split GGUF file into .work/parts), says what is still missing and
how to make it, checks the size that travels (64 MiB), and prints the device kind, the
`carry` list and the one bash line (<= 2,000 characters) to hand to the device tool.

On the device machine (that line):

    python3 -m benchmarks.jobs run --budget 560 [--set KEY=VALUE ...] NAME [NAME ...]

runs the jobs in order, skipping any whose expected seconds exceed what is left of the budget
(or whose inputs from an earlier job are absent), stops a job when the budget runs out, logs
START / STOP rc / SKIP lines, and leaves in $OUT at most 8 files: jobs.log and NAME.tgz per
job (its work folder), then the jobs' `keep` files as NAME-FILE.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from .runner import (MAX_CARRY_MIB, carry_of, device_command, jobs_named, parse_knobs, prepare,
                     run_jobs, size_mib)
from .table import JOBS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.jobs",
                                 description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("list", help="the jobs")
    for verb in ("command", "run"):
        p = sub.add_parser(verb)
        p.add_argument("names", nargs="+", metavar="NAME")
        p.add_argument("--budget", type=int, default=560,
                       help="seconds for the whole list (default 560: a 600 s call)")
        p.add_argument("--set", dest="knobs", action="append", default=[],
                       metavar="KEY=VALUE", help="a knob of the jobs (see `list`)")
        if verb == "command":
            p.add_argument("--from", dest="source", type=Path, default=None,
                           help="a folder holding the carried files under their names")
            p.add_argument("--part", dest="parts", action="append", default=[],
                           metavar="NAME:FILE", help="a piece of a split model file to carry")
        else:
            p.add_argument("--out", type=Path, default=None, help="default: $OUT")
    a = ap.parse_args(argv)
    if a.verb == "list":
        for j in JOBS.values():
            knobs = " ".join(f"{k}={v!r}" for k, v in j.knobs.items())
            print(f"{j.name:15} {j.kind:15} {j.seconds:4d} s  {j.about}")
            if knobs:
                print(f"{'':37}knobs: {knobs}")
            if j.records:
                print(f"{'':37}records: {', '.join(j.records)}")
        return 0
    try:
        jobs = jobs_named(a.names)
        knobs = parse_knobs(a.knobs, jobs)
        if a.verb == "run":
            # SIGINT (`timeout -s INT`) as KeyboardInterrupt even where the shell started this
            # process with SIGINT ignored (a background job of a non-interactive shell)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            out = a.out or Path(os.environ.get("OUT", "out"))
            status = run_jobs(a.names, budget=a.budget, out=out, knobs=knobs)
            return 0 if all(v == 0 for v in status.values()) else 1
        kinds = sorted({j.kind for j in jobs})
        if len(kinds) > 1:
            raise ValueError(f"the jobs ask for different kinds {kinds}: one call runs on one "
                             "machine; split the list")
        carry = carry_of(jobs, knobs)
        missing = prepare(jobs, a.source, a.parts)
        command = device_command(a.names, a.budget, knobs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for m in missing:
        print(f"missing {m}", file=sys.stderr)
    mib = size_mib(carry)
    print(f"kind: {kinds[0]}")
    print(f"carry: {json.dumps(carry)}")
    print(f"travels: {mib:.1f} MiB of {MAX_CARRY_MIB}" + ("  (TOO LARGE)" if mib > MAX_CARRY_MIB
                                                          else ""))
    print(f"command ({len(command)} chars):")
    print(command)
    return 1 if missing or mib > MAX_CARRY_MIB else 0


if __name__ == "__main__":
    sys.exit(main())
