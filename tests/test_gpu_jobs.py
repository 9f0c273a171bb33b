"""The GPU-job runner (benchmarks/jobs) on the CPU: the table is well formed (every job's
script parses under bash with the prelude, its knobs are read, its records exist, what it
carries is git-ignored), the device command it prints fits the device tool's 2,000 characters,
a job runs end to end (a trivial script: start/stop/rc logged, outputs packed into at most 8
files), the budget skips a job that won't fit and stops one that overruns.
Where to look when it fails: benchmarks/jobs/table.py (an entry) or runner.py (run_jobs, pack).
"""
from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.jobs import runner  # noqa: E402
from benchmarks.jobs.__main__ import main  # noqa: E402
from benchmarks.jobs.table import JOBS, PRELUDE, Job  # noqa: E402

KINDS = ("nvidia-h200", "nvidia-h100-x1", "nvidia-h200-x2", "nvidia-h200-x4", "nvidia-h200-x8")


@pytest.mark.parametrize("name", list(JOBS))
def test_each_job_is_well_formed(name):
    job = JOBS[name]
    assert job.name == name and re.fullmatch(r"[a-z0-9-]+", name)
    assert job.kind in KINDS and 0 < job.seconds <= 600 and job.about
    subprocess.run(["bash", "-n", "-c", PRELUDE + job.script], check=True)
    for knob in job.knobs:
        assert re.search(rf"\b{knob}\b", PRELUDE + job.script), f"{name}: knob {knob} is never read"
    for rec in job.records:
        assert (ROOT / "docs/results" / rec).is_file(), rec
    for c in job.carry:
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{c.path}/f"], cwd=ROOT)
        assert ignored.returncode == 0, f"{name} carries {c.path}, which git does not ignore"
        assert c.how
    for k in job.keep:
        assert "/" not in k


def test_the_device_command_fits_and_names_the_jobs(capsys):
    for kind in KINDS:
        names = [j.name for j in JOBS.values() if j.kind == kind]
        if names:
            knobs = {k: v for j in names for k, v in JOBS[j].knobs.items() if v}
            cmd = runner.device_command(names, 560, knobs)
            assert len(cmd) <= runner.MAX_COMMAND
            assert cmd.startswith(runner.DEVICE_ENV) and cmd.endswith(" ".join(names))
    assert main(["command", "sp-kernels", "--budget", "300"]) == 0     # carries nothing
    out = capsys.readouterr().out
    assert "kind: nvidia-h200" in out and 'carry: []' in out
    line = out.strip().splitlines()[-1]
    assert line == runner.device_command(["sp-kernels"], 300, {})
    assert main(["command", "nope"]) == 2
    assert main(["command", "p4", "x2"]) == 2             # two kinds: two calls


def test_every_headline_figure_names_the_job_that_reproduces_it():
    text = (ROOT / "docs/results/README.md").read_text()
    head = text[text.index("## Headline figures"):]
    table = next(b for b in head.split("\n\n") if b.startswith("|")).splitlines()
    assert table[0].rstrip().endswith("| job |")
    for row in table[2:]:
        cell = row.split("|")[-2]
        names = re.findall(r"`([a-z0-9-]+)`", cell)
        assert names or "CPU" in cell, row[:80]
        assert all(n in JOBS for n in names), (names, row[:80])
        assert "job" not in cell or names


def _trivial(name, script, seconds=5, keep=()):
    return Job(name=name, kind="nvidia-h200", seconds=seconds, about="a test job",
               knobs={"WORD": "hello"}, script=script, keep=keep)


def test_a_job_runs_logs_and_packs(tmp_path, monkeypatch):
    jobs = {f"t{i}": _trivial(f"t{i}", 'echo "$WORD from $JOB_NAME" > "$OUT/said.txt"; '
                              'mkdir -p "$OUT/sub"; echo x > "$OUT/sub/deep.txt"',
                              keep=("said.txt",)) for i in range(3)}
    jobs["fails"] = _trivial("fails", "exit 3")
    monkeypatch.setattr(runner, "JOBS", {**JOBS, **jobs})
    out = tmp_path / "out"
    status = runner.run_jobs(["t0", "fails", "t1"], budget=60, out=out,
                             knobs={"WORD": "hi"}, work_root=tmp_path / "work")
    assert status == {"t0": 0, "fails": 3, "t1": 0}
    files = sorted(p.name for p in out.iterdir())
    assert files == ["fails.tgz", "jobs.log", "t0-said.txt", "t0.tgz", "t1-said.txt", "t1.tgz"]
    assert (out / "t1-said.txt").read_text() == "hi from t1\n"
    with tarfile.open(out / "t0.tgz") as t:
        assert t.extractfile("./sub/deep.txt").read() == b"x\n"
    log = (out / "jobs.log").read_text()
    assert "START t0" in log and "STOP fails rc=3" in log and "done: t0=0, fails=3, t1=0" in log
    # more jobs than the 8 files allow: one jobs.tgz
    many = {f"m{i}": _trivial(f"m{i}", 'echo $JOB_NAME > "$OUT/n.txt"') for i in range(9)}
    monkeypatch.setattr(runner, "JOBS", {**JOBS, **many})
    out2 = tmp_path / "out2"
    runner.run_jobs(list(many), budget=60, out=out2, knobs={}, work_root=tmp_path / "w2")
    assert sorted(p.name for p in out2.iterdir()) == ["jobs.log", "jobs.tgz"]
    with tarfile.open(out2 / "jobs.tgz") as t:
        assert t.extractfile("m8/n.txt").read() == b"m8\n"


def test_the_budget_skips_what_wont_fit_and_stops_an_overrun(tmp_path, monkeypatch):
    jobs = {"long": _trivial("long", "echo never", seconds=500),
            "slow": _trivial("slow", "echo started; sleep 30; echo never", seconds=1),
            "after": _trivial("after", "echo ok", seconds=1),
            "needy": Job(name="needy", kind="nvidia-h200", seconds=1, about="x", script="true",
                         needs=(".work/no-such-checkpoint",))}
    monkeypatch.setattr(runner, "JOBS", {**JOBS, **jobs})
    out = tmp_path / "out"
    status = runner.run_jobs(["long", "needy", "slow", "after"], budget=3, out=out, knobs={},
                             work_root=tmp_path / "work")
    assert status["long"].startswith("skipped: needs 500 s")
    assert status["needy"] == "skipped: .work/no-such-checkpoint absent"
    assert status["slow"] == 124                                     # stopped at the budget
    assert status["after"].startswith("skipped: needs 1 s")
    assert "started" in (tmp_path / "work/slow/job.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["jobs.log", "slow.tgz"]
    # a job as long as the whole budget runs when it comes first
    exact = {"exact": _trivial("exact", "echo ok", seconds=7)}
    monkeypatch.setattr(runner, "JOBS", {**JOBS, **exact})
    assert runner.run_jobs(["exact"], budget=7, out=tmp_path / "o2", knobs={},
                           work_root=tmp_path / "w2") == {"exact": 0}


def test_knobs_and_parts(tmp_path):
    with pytest.raises(ValueError, match="KEY one of"):
        runner.parse_knobs(["NOPE=1"], [JOBS["testbed"]])
    assert runner.parse_knobs(["QUICK=0"], [JOBS["testbed"]]) == {"QUICK": "0"}
    piece = tmp_path / "SmolLM2.Q4_1.gguf.part01"
    piece.write_bytes(b"abc")
    assert runner.prepare([JOBS["model-parts"]], None, [f"smol:{piece}"], root=tmp_path) == []
    assert (tmp_path / ".work/parts/smol.part01").read_bytes() == b"abc"
    src = tmp_path / "src"
    src.mkdir()
    for f in ("wiki8k.bin", "wiki8k.json"):
        (src / f).write_text(f)
    missing = runner.prepare([JOBS["schedule-probe"]], src, [], root=tmp_path)
    assert (tmp_path / ".work/data/wiki8k.json").read_text() == "wiki8k.json"
    assert [m.split(":")[0] for m in missing] == [f".work/data/gut108.{e}" for e in
                                                  ("bin", "json", "val.bin", "val.json")]


def test_the_pieces_travel_from_the_folder_named(tmp_path, monkeypatch):
    jobs = [JOBS["model-parts"]]
    assert runner.carry_of(jobs) == [".work/parts"]
    assert runner.carry_of(jobs, {"FROM": ".work/p1"}) == [".work/p1"]
    assert ".work/p1" in runner.carry_of([JOBS["real-llm"]], {"FROM": ".work/p1"})
    assert "FROM" in JOBS["real-llm"].knobs and "FROM" in JOBS["train-llm"].knobs
    # the device side copies the pieces of the folder named into $M
    (tmp_path / ".work/p1").mkdir(parents=True)
    (tmp_path / ".work/p1/smol.part01").write_bytes(b"xyz")
    m = tmp_path / "m"
    job = JOBS["model-parts"]
    subprocess.run(["bash", "-c", PRELUDE + job.script], cwd=tmp_path, check=True,
                   capture_output=True, env={"PATH": "/usr/bin:/bin", "M": str(m),
                                             "FROM": ".work/p1", "OUT": str(tmp_path)})
    assert (m / "smol.part01").read_bytes() == b"xyz"


def test_an_interrupted_run_packs_what_the_job_made(tmp_path, monkeypatch):
    """SIGINT (the device command under `timeout -s INT`): the job's process group is killed,
    what it wrote so far comes back packed, and the log says so."""
    import signal
    import threading
    jobs = {"slow": _trivial("slow", 'echo partial > "$OUT/part.txt"; echo ready; '
                             'sleep 30; echo never > "$OUT/never.txt"', seconds=1)}
    monkeypatch.setattr(runner, "JOBS", {**JOBS, **jobs})
    out = tmp_path / "out"
    # the signal taken by a thread other than the main one (the kernel may hand a
    # process-directed SIGINT to any thread): the runner must still stop within its poll
    t = threading.Timer(1.5, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT))
    # Python's own SIGINT handler, as `python3 -m benchmarks.jobs run` installs it (a process
    # started in the background of a non-interactive shell inherits SIGINT ignored)
    old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run_jobs(["slow"], budget=60, out=out, knobs={}, work_root=tmp_path / "work")
    finally:
        t.cancel()
        signal.signal(signal.SIGINT, old_handler)
    assert time.monotonic() - t0 < 15                # the 30 s sleep did not run out
    with tarfile.open(out / "slow.tgz") as tar:
        assert tar.extractfile("./part.txt").read() == b"partial\n"
    assert "INTERRUPTED slow" in (out / "jobs.log").read_text()
