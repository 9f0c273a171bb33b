"""`echo-tp train --init-from CHECKPOINT`: continued pretraining from a pretrained GGUF file or
HF folder (CPU, fp32, the tiny GGUF files of tests/tiny_gguf.py).

What is compared with what:
- the weights are the checkpoint's: step 1's loss of a plain run (--init-from x.gguf) equals
  transformers' own GGUF model's loss on the same first batch (the batch rebuilt from the same
  TokenBatches), within 1e-5 relative (our Transformer vs transformers' Llama: the same fp32 math
  in another op order); a random init is off by O(1);
- the GGUF file and its converted folder (gguf_to_hf) start identical: the same logged losses,
  bit for bit, over 3 simulated TP=2 steps at 4 bits;
- Echo at 4 bits on simulated TP=2: the loss decreases over 12 steps; real gloo ranks
  (--world-size 2) log the same losses and grad norms bit for bit and save the same weights;
- saving writes a folder transformers loads (AutoModelForCausalLM, AutoTokenizer): its logits
  equal our checkpoint's own reload (load_hf_checkpoint), and the tokenizer encodes as the
  GGUF's;
- a family we do not write (Gemma 3) trains through transformers' model at TP=2;
- `echo-tp tokenize --tokenizer x.gguf` writes the GGUF tokenizer's ids, EOS between files;
- user errors: --init-from with --model, a path that is neither GGUF nor an HF folder.
Where to look first: train/model.py (load_pretrained, _build_pretrained, save_tokenizer), then
hf/gguf.py; a gloo mismatch as in test_eval_train.py.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from echo_tp import cli
from echo_tp.models import load_hf_checkpoint, load_tokens
from echo_tp.models.tokenize import write_tokens
from echo_tp.train import TokenBatches, TrainOptions

T = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gguf import write_tiny_gemma3, write_tiny_llama  # noqa: E402

from echo_tp.hf import gguf_to_hf, load_gguf_tokenizer  # noqa: E402
from echo_tp.hf.gguf import load_gguf_model  # noqa: E402

WORDS = ("the quick brown fox jumps over the lazy dog in the house there was a mouse and "
         "a cat that sat on the mat while the rain fell on the town").split()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama GGUF, its converted folder, a Gemma 3 GGUF and token files of random word
    documents tokenized with the Llama GGUF's tokenizer."""
    d = tmp_path_factory.mktemp("init")
    write_tiny_llama(d / "llama.gguf")
    write_tiny_gemma3(d / "gemma.gguf")
    gguf_to_hf(d / "llama.gguf", d / "llama-hf")
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("val", 6)):
        (d / split).mkdir()
        for i in range(n):
            words = rng.choice(WORDS, size=int(rng.integers(20, 60)))
            (d / split / f"doc{i:02d}.txt").write_text(" ".join(words) + ".\n")
        assert cli.main(["tokenize", str(d / split), "--tokenizer", str(d / "llama.gguf"),
                         "--out", str(d / f"{split}.bin")]) == 0
    return d


def train(files, out, init, *extra, data="train.bin", val="val.bin"):
    args = ["train", "--init-from", str(init), "--train-data", str(files / data),
            "--val-data", str(files / val), "--seq-len", "32", "--batch-size", "4",
            "--lr", "3e-3", "--warmup", "2", "--eval-batches", "2", "--out-dir", str(out),
            "--no-progress", *extra]
    assert cli.main(args) == 0
    with open(out / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_tokenize_with_a_gguf_tokenizer(files):
    tok = load_gguf_tokenizer(files / "llama.gguf")
    ids = load_tokens(files / "val.bin").tolist()
    first = (files / "val" / "doc00.txt").read_text()
    want = tok(first)["input_ids"]
    assert ids[:len(want)] == want and ids[len(want)] == tok.convert_tokens_to_ids(
        "<|endoftext|>")


def test_step_one_is_the_pretrained_model(files, tmp_path):
    rows = train(files, tmp_path / "plain", files / "llama.gguf", "--steps", "1")
    o = TrainOptions(init_from=str(files / "llama.gguf"), train_data=str(files / "train.bin"),
                     seq_len=32, batch_size=4)
    x, y = next(iter(TokenBatches(load_tokens(o.train_data), seq_len=32, batch_size=4, seed=0)))
    ref = load_gguf_model(files / "llama.gguf", dtype=torch.float32)
    with torch.no_grad():
        want = float(F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()))
    got = float(rows[0]["loss"])
    assert abs(got - want) <= 1e-5 * want, (got, want)


def test_gguf_and_its_folder_start_the_same(files, tmp_path):
    args = ("--steps", "3", "--simulate", "2", "--comm", "echo4")
    a = train(files, tmp_path / "gguf", files / "llama.gguf", *args)
    b = train(files, tmp_path / "dir", files / "llama-hf", *args)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_echo4_trains_and_real_ranks_equal_simulated(files, tmp_path):
    args = ("--steps", "12", "--comm", "echo4", "--eval-every", "6")
    sim = train(files, tmp_path / "sim", files / "llama.gguf", *args, "--simulate", "2")
    losses = [float(r["loss"]) for r in sim]
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    real = train(files, tmp_path / "real", files / "llama.gguf", *args, "--world-size", "2")
    for a, b in zip(real, sim, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            assert a[key] == b[key], (key, a, b)
    wa = load_file(tmp_path / "real/checkpoints/step-12/model.safetensors")
    wb = load_file(tmp_path / "sim/checkpoints/step-12/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)

    ckpt = tmp_path / "sim/checkpoints/step-12"
    theirs = T.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours, _ = load_hf_checkpoint(ckpt, dtype=torch.float32)
    x = load_tokens(files / "val.bin")[:32].view(1, -1)
    with torch.no_grad():
        lt, lo = theirs(x).logits, ours(x)
    assert (lt - lo).abs().max() <= 1e-5 * lo.abs().max()
    tok = T.AutoTokenizer.from_pretrained(ckpt)
    text = (files / "val" / "doc01.txt").read_text()
    assert tok(text)["input_ids"] == load_gguf_tokenizer(files / "llama.gguf")(text)["input_ids"]


def test_a_family_we_do_not_write_trains_through_transformers(files, tmp_path, capsys):
    vocab = load_gguf_model(files / "gemma.gguf").config.vocab_size
    rng = np.random.default_rng(1)
    for name, n in (("gemma.bin", 4000), ("gemma.val.bin", 1000)):
        write_tokens(rng.integers(3, vocab, n), files / name, vocab_size=vocab,
                     meta={"eos_id": 1})
    assert cli.main(["train", "--init-from", str(files / "gemma.gguf"), "--train-data",
                     str(files / "gemma.bin"), "--val-data", str(files / "train.bin"),
                     "--steps", "1", "--seq-len", "32", "--out-dir", str(tmp_path / "mixed"),
                     "--no-progress"]) == 2           # the Llama vocabulary's val file
    assert "val token id" in capsys.readouterr().err
    rows = train(files, tmp_path / "gemma", files / "gemma.gguf", "--steps", "4",
                 "--simulate", "2", "--comm", "echo4", data="gemma.bin", val="gemma.val.bin")
    cfg = (tmp_path / "gemma/checkpoints/step-4/config.json").read_text()
    assert '"gemma3' in cfg and len(rows) == 4 and all(np.isfinite(float(r["loss"]))
                                                       for r in rows)


def test_init_from_errors(files, tmp_path):
    with pytest.raises(ValueError, match="drop --model"):
        TrainOptions(init_from=str(files / "llama.gguf"), model="tiny-llama",
                     train_data=str(files / "train.bin"))
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing.bin"):
        assert cli.main(["train", "--init-from", str(bad), "--train-data",
                         str(files / "train.bin"), "--out-dir", str(tmp_path / "o"),
                         "--no-progress"]) != 0
