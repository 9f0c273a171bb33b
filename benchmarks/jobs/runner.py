"""The GPU-job runner: the device side (run the named jobs under one time budget, log each
job's start, stop and exit status, pack the results into at most 8 files) and this machine's
side (prepare what the jobs carry, print the `carry` list and the one command line to hand to
the device tool).

The device tool runs one bash command of at most 2,000 characters in the repository root,
takes along the git-ignored paths named in `carry` (64 MiB with the working tree) and brings
back at most 8 files from $OUT (16 MiB each). A job is one table entry (benchmarks/jobs/
table.py): its bash script runs in the repository root with $OUT set to its own work folder
(/tmp/jobs/NAME); what it leaves there comes back as NAME.tgz, its `keep` files also as plain
files while the 8-file limit allows.
"""
from __future__ import annotations

import math
import os
import shlex
import shutil
import signal
import threading
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from .table import JOBS, KNOB_ENV, PRELUDE, Job

MAX_FILES = 8
"""Files the device tool brings back from $OUT."""
MAX_COMMAND = 2000
"""Characters of one device command."""
MAX_CARRY_MIB = 64
"""The working tree and the carried paths together."""
DEVICE_ENV = "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
"""Multicast and NVLS off: every device command starts with it (the device tool's rule)."""
ROOT = Path(__file__).resolve().parents[2]


def jobs_named(names: list[str]) -> list[Job]:
    """The table's jobs, in the order named; ValueError naming the unknown ones."""
    unknown = [n for n in names if n not in JOBS]
    if unknown:
        raise ValueError(f"unknown job(s) {unknown}; the jobs: {', '.join(JOBS)}")
    if not names:
        raise ValueError(f"name at least one job; the jobs: {', '.join(JOBS)}")
    return [JOBS[n] for n in names]


def parse_knobs(pairs: list[str], jobs: list[Job]) -> dict[str, str]:
    """KEY=VALUE pairs -> {KEY: VALUE}; each KEY must be a knob of one of the jobs."""
    known = {k for j in jobs for k in j.knobs}
    out = {}
    for p in pairs:
        key, eq, value = p.partition("=")
        if not eq or key not in known:
            raise ValueError(f"--set {p!r}: expected KEY=VALUE with KEY one of "
                             f"{sorted(known) or 'no knobs (these jobs have none)'}")
        out[key] = value
    return out


# ----- this machine: what to hand to the device tool -----

def carry_of(jobs: list[Job], knobs: dict[str, str] | None = None) -> list[str]:
    """The git-ignored paths the jobs read, each once, in order: a Carry's files one by one
    (only they travel), or its folder where that would name more than the device tool's 8;
    the model pieces' folder is the FROM knob's where one is set."""
    pieces = (knobs or {}).get("FROM") or PARTS_DIR

    def collect(by_file: bool) -> list[str]:
        out: list[str] = []
        for j in jobs:
            for c in j.carry:
                path = pieces if c.path == PARTS_DIR else c.path
                paths = [f"{path}/{f}" for f in c.files] if by_file and c.files else [path]
                out += [p for p in paths if p not in out]
        return out

    out = collect(by_file=True)
    if len(out) > 8:
        out = collect(by_file=False)
    if len(out) > 8:
        raise ValueError(f"{len(out)} carried paths; the device tool takes 8: name a folder "
                         f"above them ({out})")
    return out


def device_command(names: list[str], budget: int, knobs: dict[str, str]) -> str:
    """The one bash line that runs `names` on the device machine."""
    args = " ".join(f"--set {shlex.quote(f'{k}={v}')}" for k, v in knobs.items())
    cmd = (f"{DEVICE_ENV}; python3 -m benchmarks.jobs run --budget {budget} "
           f"{args + ' ' if args else ''}{' '.join(names)}")
    if len(cmd) > MAX_COMMAND:
        raise ValueError(f"the device command is {len(cmd)} characters (limit {MAX_COMMAND})")
    return cmd


def prepare(jobs: list[Job], source: Path | None, parts: list[str], root: Path = ROOT
            ) -> list[str]:
    """Copy the carried inputs into place (from `source`, a local folder holding them under
    their file names; `parts`: NAME:FILE pieces of a split model file, copied as
    .work/parts/NAME.partNN) and return what is still missing, each with how to make it."""
    missing = []
    for job in jobs:
        for c in job.carry:
            target = root / c.path
            if c.path == PARTS_DIR:
                continue
            for f in c.files:
                dst = target / f
                if not dst.exists() and source is not None and (source / f).exists():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source / f, dst)
                if not dst.exists():
                    missing.append(f"{c.path}/{f}: {c.how}")
            if not c.files and not target.exists():
                missing.append(f"{c.path}: {c.how}")
    missing = list(dict.fromkeys(missing))
    if parts:
        pdir = root / PARTS_DIR
        shutil.rmtree(pdir, ignore_errors=True)
        pdir.mkdir(parents=True)
        for p in parts:
            name, colon, path = p.partition(":")
            suffix = Path(path).name.rpartition(".part")[2]
            if not colon or not suffix.isdigit() or not Path(path).is_file():
                raise ValueError(f"--part {p!r}: expected NAME:FILE.partNN with the file present")
            shutil.copy2(path, pdir / f"{name}.part{suffix}")
    return missing


PARTS_DIR = ".work/parts"
"""Where the pieces of a split model file travel; the device side moves them to /tmp/m."""


def size_mib(paths: list[str], root: Path = ROOT) -> float:
    """MiB of what travels: tracked and untracked-not-ignored files plus the carried paths."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    total = sum((root / f).stat().st_size for f in listed if f and (root / f).is_file())
    for p in paths:
        q = root / p
        total += sum(f.stat().st_size for f in q.rglob("*") if f.is_file()) if q.is_dir() \
            else (q.stat().st_size if q.exists() else 0)
    return total / 2**20


# ----- the device machine: run and pack -----

class Log:
    """Lines to stdout (the device tool's output tail) and to $OUT/jobs.log."""

    def __init__(self, path: Path):
        self.f = open(path, "a")

    def __call__(self, line: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"[jobs {stamp}] {line}", flush=True)
        self.f.write(f"{stamp} {line}\n")
        self.f.flush()


def run_jobs(names: list[str], *, budget: float, out: Path, knobs: dict[str, str],
             work_root: Path = Path("/tmp/jobs"), root: Path = ROOT) -> dict[str, int | str]:
    """Run the jobs in order while the budget lasts: a job whose `seconds` exceed what is left,
    or whose `needs` are absent, is skipped (and logged); a running job is stopped when the
    budget runs out. Returns {name: exit status, or 'skipped: why'}; packs after each job."""
    jobs = jobs_named(names)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "jobs.log")
    end = time.monotonic() + budget
    status: dict[str, int | str] = {}
    log(f"budget {budget:.0f} s: {' '.join(names)}")
    for job in jobs:
        left = end - time.monotonic()
        absent = [n for n in job.needs if not (root / n).exists() and not Path(n).exists()]
        if job.seconds > math.ceil(left):    # --budget 590 runs a 590 s job first
            status[job.name] = f"skipped: needs {job.seconds} s, {left:.0f} s left"
        elif absent:
            status[job.name] = f"skipped: {', '.join(absent)} absent"
        if job.name in status:
            log(f"SKIP {job.name}: {status[job.name].removeprefix('skipped: ')}")
            continue
        work = work_root / job.name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        env = {**os.environ, **{k: v for k, v in job.knobs.items() if k not in os.environ},
               **knobs, "OUT": str(work), KNOB_ENV: job.name}
        t0 = time.monotonic()
        log(f"START {job.name} ({job.seconds} s expected, {left:.0f} s left)")
        try:
            rc = _run_script(PRELUDE + job.script, env, root, work / "job.log", left)
        except KeyboardInterrupt:          # SIGINT (timeout -s INT): keep what the job made
            status[job.name] = 130
            log(f"INTERRUPTED {job.name} after {time.monotonic() - t0:.0f} s; packing")
            pack(jobs, status, work_root, out)
            raise
        status[job.name] = rc
        log(f"STOP {job.name} rc={rc} after {time.monotonic() - t0:.0f} s")
        pack(jobs, status, work_root, out)
    log("done: " + ", ".join(f"{k}={v}" for k, v in status.items()))
    pack(jobs, status, work_root, out)
    return status


def _run_script(script: str, env: dict, cwd: Path, log_path: Path, limit: float) -> int:
    """bash -c script, its output to stdout and log_path; killed (its process group) after
    `limit` seconds: exit status 124, as timeout(1) gives.

    A thread copies the output; the main thread polls every POLL_S. So a SIGINT reaches it as
    KeyboardInterrupt whichever thread the kernel hands the signal to (a main thread blocked
    reading the pipe would sleep through a signal taken by another thread), and the job's
    whole group is killed before it propagates."""
    with open(log_path, "w") as logf:
        p = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True, text=True,
                             bufsize=1)
        copier = threading.Thread(target=_copy_lines, args=(p.stdout, logf), daemon=True)
        copier.start()
        deadline = time.monotonic() + limit
        timed_out = False
        try:
            while p.poll() is None:
                if time.monotonic() >= deadline:
                    timed_out = True
                    _kill_group(p)
                    break
                time.sleep(POLL_S)
            p.wait()
        except BaseException:              # interrupted: the job's whole group goes too
            _kill_group(p)
            p.wait()
            copier.join(5)
            raise
        copier.join(5)
    return 124 if timed_out else p.returncode


POLL_S = 0.1
"""How often the runner looks at a running job (its deadline, a pending SIGINT)."""


def _copy_lines(stream, logf) -> None:
    """Each line of stream to stdout and logf, until the job's output closes."""
    for line in stream:
        sys.stdout.write(line)
        logf.write(line)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def pack(jobs: list[Job], status: dict, work_root: Path, out: Path) -> list[Path]:
    """$OUT holds at most MAX_FILES files: jobs.log, NAME.tgz of each job that ran (its work
    folder), then the jobs' `keep` files (NAME-FILE) while room is left. More jobs than the
    limit allows: one jobs.tgz of every work folder instead."""
    ran = [j for j in jobs if isinstance(status.get(j.name), int)]
    for old in out.iterdir():              # what an earlier pack of these jobs left
        if old.is_file() and (old.name == "jobs.tgz" or any(
                old.name == f"{j.name}.tgz" or old.name.startswith(f"{j.name}-") for j in jobs)):
            old.unlink()
    made = []
    if len(ran) + 1 > MAX_FILES:
        made.append(_tar(out / "jobs.tgz", [(work_root / j.name, j.name) for j in ran]))
    else:
        made += [_tar(out / f"{j.name}.tgz", [(work_root / j.name, ".")]) for j in ran]
    for j in ran:
        for k in j.keep:
            src = work_root / j.name / k
            if src.is_file() and len(made) + 1 < MAX_FILES:
                made.append(Path(shutil.copy2(src, out / f"{j.name}-{Path(k).name}")))
    return made


def _tar(path: Path, folders: list[tuple[Path, str]]) -> Path:
    with tarfile.open(path, "w:gz") as t:
        for folder, arc in folders:
            if folder.exists():
                t.add(folder, arcname=arc)
    return path
