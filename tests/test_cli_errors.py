"""Issue 28, item 2: every user-caused failure of every `echo-tp` subcommand prints one line that
names the file or the argument and exits 2, and is found before the expensive work where it can
be (the tokenizing, the model build, the evaluation, the training run).

Compared, per case: cli.main's return code and stderr (one line, `echo-tp: error: ...`, naming
the argument and the path), with the expensive step replaced by a failing stand-in where the
case is one that is checkable first (so reaching it fails the test). The cases: output paths
that are directories, lie under a file or end in .json; inputs that are missing, not UTF-8, of
the wrong kind; token files without a sidecar or shorter than it says; broken tokenizers; a
truncated shard among several (simulated and on gloo ranks: found before either starts) or a
config that disagrees with its weights (tests/test_checkpoint_errors.py has the loaders' own
cases); a write that fails mid-run (a full disk, made with RLIMIT_FSIZE in a subprocess: the
write gets EFBIG as it would ENOSPC) for tokenize (numpy's and Path's writes) and train's
checkpoint (safetensors'); an OSError from anywhere.
Where to look first: cli.main (_one_line), paths.py (the output checks, `writing`), the
preflight at the top of each tool's main (eval/runner.py, train/loop.py, models/tokenize.py,
demo.py).
"""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from echo_tp import cli
from echo_tp.models.tokenize import write_tokens

HERE = os.path.dirname(__file__)
SRC = os.path.join(HERE, "..", "src")


def one_line(capsys, code: int, *names: str) -> str:
    """Assert rc 2 and one stderr line naming each of `names`; return the line."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("echo-tp: error: "), err
    for n in names:
        assert str(n) in err, (n, err)
    return err


def expensive(*_, **__):
    pytest.fail("the expensive step ran before the bad argument was found")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "a.txt").write_text("hello world. " * 50)
    (d / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 20)
    (d / "afile").write_text("")
    (d / "adir").mkdir()
    (d / "empty_dir").mkdir()
    (d / "badtok").mkdir()
    (d / "badtok" / "tokenizer.json").write_text("{ broken")
    tokens = np.random.default_rng(0).integers(0, 256, 3000)
    write_tokens(tokens, d / "tok.bin", vocab_size=256, meta={})
    np.zeros(10, dtype=np.uint16).tofile(d / "nosidecar.bin")
    write_tokens(tokens, d / "short.bin", vocab_size=256, meta={})
    (d / "short.bin").write_bytes((d / "short.bin").read_bytes()[:1000])
    return d


# ----- tokenize --------------------------------------------------------------------------------
@pytest.mark.parametrize("out,names", [
    ("adir", ["--out", "adir"]),
    ("afile/x.bin", ["--out", "afile/x.bin", "is a file"]),
    ("x.json", ["x.json"]),
])
def test_tokenize_bad_out_is_found_before_tokenizing(files, capsys, monkeypatch, out, names):
    from echo_tp.models import tokenize
    monkeypatch.setattr(tokenize, "encode_each", expensive)
    monkeypatch.chdir(files)
    one_line(capsys, cli.main(["tokenize", "a.txt", "--out", out]), *names)


def test_tokenize_held_out_target_is_checked_too(files, capsys, monkeypatch):
    from echo_tp.models import tokenize
    monkeypatch.setattr(tokenize, "encode_each", expensive)
    (files / "t.val.bin").mkdir(exist_ok=True)
    one_line(capsys, cli.main(["tokenize", str(files / "a.txt"), "--out", str(files / "t.bin"),
                               "--val-fraction", "0.2", "--val-split", "tail"]), "t.val.bin")


@pytest.mark.parametrize("args,names", [
    (["nothere.txt"], ["nothere.txt"]),
    (["latin1.txt"], ["latin1.txt", "UTF-8"]),
    (["empty_dir"], ["empty_dir"]),
    (["a.txt", "--tokenizer", "adir"], ["adir"]),
    (["a.txt", "--tokenizer", "nosuchtok"], ["nosuchtok"]),
    (["a.txt", "--tokenizer", "badtok"], ["tokenizer.json"]),
])
def test_tokenize_bad_inputs(files, capsys, monkeypatch, args, names):
    monkeypatch.chdir(files)
    one_line(capsys, cli.main(["tokenize", *args, "--out", "o.bin"]), *names)


def _full_disk(limit: int):
    def apply():   # a write past `limit` bytes fails with EFBIG (as ENOSPC would), no signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def _cli_in_subprocess(args, limit, cwd):
    return subprocess.run([sys.executable, "-m", "echo_tp.cli", *args], cwd=cwd,
                          preexec_fn=_full_disk(limit), capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": SRC})


def test_tokenize_on_a_full_disk_names_the_file(files):
    r = _cli_in_subprocess(["tokenize", "a.txt", "--out", "full/out.bin"], 16, files)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert "full/out.bin" in err and "File too large" in err, err


# ----- eval ------------------------------------------------------------------------------------
EVAL = ["eval", "--model", "tiny-llama", "--comms", "16", "--context", "16", "--no-progress",
        "--simulate", "2"]


@pytest.mark.parametrize("extra,names", [
    (["--data", "nosidecar.bin"], ["--data", "nosidecar.bin", "sidecar"]),
    (["--data", "short.bin"], ["--data", "short.bin", "sidecar says"]),
    (["--data", "adir"], ["--data", "adir", "directory"]),
    (["--data", "tok.bin", "--calibration-data", "gone.bin"], ["--calibration-data", "gone.bin"]),
    (["--data", "a.txt", "--tokenizer", "nosuchtok"], ["nosuchtok"]),
    (["--data", "tok.bin", "--out", "adir"], ["--out", "adir"]),
    (["--data", "tok.bin", "--model", "adir"], ["adir", "config.json"]),
])
def test_eval_bad_arguments_are_found_before_the_model(files, capsys, monkeypatch, extra,
                                                       names):
    from echo_tp.eval import runner
    monkeypatch.setattr(runner, "launch", expensive)
    monkeypatch.chdir(files)
    args = EVAL + extra if "--model" not in extra else \
        [a for a in EVAL if a != "tiny-llama" and a != "--model"] + extra
    one_line(capsys, cli.main(args), *names)


def test_eval_text_that_is_not_utf8_is_found_before_the_model(files, capsys, monkeypatch):
    from echo_tp.eval import runner
    monkeypatch.setattr(runner, "launch", expensive)
    monkeypatch.chdir(files)
    one_line(capsys, cli.main(EVAL + ["--data", "latin1.txt"]), "--data", "latin1.txt", "UTF-8")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{'sharded': a tiny Llama over several files, 'truncated': one of them cut short,
    'mismatch': config.json's intermediate_size half the tensors'}."""
    from transformers import LlamaConfig, LlamaForCausalLM
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(root / "sharded", max_shard_size="20KB")
    shutil.copytree(root / "sharded", root / "truncated")
    f = sorted((root / "truncated").glob("*.safetensors"))[1]
    f.write_bytes(f.read_bytes()[:-64])
    shutil.copytree(root / "sharded", root / "mismatch")
    cfg = json.loads((root / "mismatch" / "config.json").read_text())
    (root / "mismatch" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 32}))
    return root, f.name


@pytest.mark.parametrize("mode", [["--simulate", "2"], ["--world-size", "2"]])
@pytest.mark.parametrize("impl", ["echo", "transformers"])
def test_eval_truncated_shard_among_several_is_named_first(files, checkpoints, capsys,
                                                           monkeypatch, mode, impl):
    from echo_tp.eval import runner
    monkeypatch.setattr(runner, "launch", expensive)
    root, shard = checkpoints
    code = cli.main(["eval", "--model", str(root / "truncated"), "--data", str(files / "tok.bin"),
                     "--comms", "16", "--context", "16", "--model-impl", impl, *mode])
    one_line(capsys, code, shard, "truncated or corrupt")


def test_eval_config_weights_mismatch_is_one_line(files, checkpoints, capsys):
    root, _ = checkpoints
    code = cli.main(["eval", "--model", str(root / "mismatch"), "--data", str(files / "tok.bin"),
                     "--comms", "16", "--context", "16", "--no-progress", "--model-impl",
                     "transformers", "--simulate", "2"])
    one_line(capsys, code, "checkpoint tensor", "intermediate_size", "mlp.")


# ----- train -----------------------------------------------------------------------------------
TRAIN = ["train", "--model", "tiny-llama", "--steps", "2", "--seq-len", "16", "--batch-size", "2",
         "--no-progress"]


@pytest.mark.parametrize("extra,names", [
    (["--train-data", "tok.bin", "--out-dir", "afile/run"], ["--out-dir", "afile/run"]),
    (["--train-data", "tok.bin", "--out-dir", "afile"], ["--out-dir", "afile", "is a file"]),
    (["--train-data", "gone.bin", "--out-dir", "r"], ["--train-data", "gone.bin"]),
    (["--train-data", "tok.bin", "--val-data", "nosidecar.bin", "--out-dir", "r"],
     ["--val-data", "nosidecar.bin"]),
    (["--train-data", "short.bin", "--out-dir", "r"], ["--train-data", "short.bin"]),
])
def test_train_bad_arguments_are_found_before_the_model(files, capsys, monkeypatch, extra,
                                                        names):
    from echo_tp.train import loop
    monkeypatch.setattr(loop, "launch", expensive)
    monkeypatch.chdir(files)
    one_line(capsys, cli.main(TRAIN + extra), *names)


def test_train_truncated_checkpoint_is_found_before_the_model(files, checkpoints, capsys,
                                                              monkeypatch):
    from echo_tp.train import loop
    monkeypatch.setattr(loop, "launch", expensive)
    root, shard = checkpoints
    code = cli.main(["train", "--model", str(root / "truncated"), "--train-data",
                     str(files / "tok.bin"), "--out-dir", str(files / "r"), "--simulate", "2"])
    one_line(capsys, code, shard)


def test_train_checkpoint_on_a_full_disk_names_the_file(files, tmp_path):
    # the log and config fit in 64 KiB; the checkpoint (tiny-llama, fp32) does not
    r = _cli_in_subprocess(TRAIN + ["--train-data", str(files / "tok.bin"), "--out-dir",
                                    str(tmp_path / "run")], 1 << 16, tmp_path)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert "checkpoints" in err and "File too large" in err, err


# ----- demo, and any OSError ------------------------------------------------------------------
def test_demo_bad_arguments_are_found_before_the_run(files, capsys, monkeypatch):
    from echo_tp import demo
    monkeypatch.setattr(demo, "run", expensive)
    one_line(capsys, cli.main(["demo", "--out", str(files / "adir")]), "--out", "adir")
    one_line(capsys, cli.main(["demo", "--out", str(files / "afile" / "p.png")]), "--out")
    one_line(capsys, cli.main(["demo", "--world-size", "0"]), "--world-size")
    one_line(capsys, cli.main(["demo", "--sites", "0"]), "--sites")


def test_an_os_error_anywhere_is_one_line_naming_its_file(capsys, monkeypatch):
    from echo_tp.models import tokenize

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", "/data/corpus/a.txt")
    monkeypatch.setattr(tokenize, "main", denied)
    one_line(capsys, cli.main(["tokenize", "x", "--out", "y.bin"]), "/data/corpus/a.txt",
             "Permission denied")

    def multiline(*a, **k):
        raise ValueError("first line\nsecond line")
    monkeypatch.setattr(tokenize, "main", multiline)
    one_line(capsys, cli.main(["tokenize", "x", "--out", "y.bin"]), "first line second line")
