"""`echo-tp eval` and `echo-tp train` end to end on tiny shapes (CPU, fp32), through cli.main.

What is checked:
- train: 30 steps of tiny-llama at Echo 4-bit on 2 simulated ranks, on a synthetic Markov chain
  (every token has 4 successors, so the loss can fall from ln 256 = 5.55 towards ln 4 = 1.39):
  the loss falls, the CSV/PNG/config/HF checkpoint are written, the checkpoint loads.
- train on 2 gloo processes == the same run simulated (losses, grad norms, final weights), since
  simulated TP is bit-identical to real TP at 4 bits.
- eval: several comm specs in one call on the trained checkpoint (token file), JSON + table; and
  a text file through the GPT-2 tokenizer. (eval's gloo path is the launcher train uses; real vs
  simulated logits are compared bit for bit in test_tp.py.)
- the window and batch arithmetic, the LR schedule, and errors for bad input.
Where to look first: eval numbers -> eval/metric.py (sliding_windows, window_nll); training
-> train/loop.py, then tp/grads.py (sync, norm); spawn failures -> tp/runtime.py.
"""
import csv
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from echo_tp import cli
from echo_tp.eval import main as eval_main
from echo_tp.eval import sliding_windows
from echo_tp.models import ModelConfig, build_meta_model, build_tokenizer, init_weights, \
    load_hf_checkpoint, save_hf_checkpoint
from echo_tp.models.tokenize import write_tokens
from echo_tp.train import TokenBatches, TrainOptions, lr_at

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 +
        "It was the best of times, it was the worst of times; " * 3) * 6


def markov_tokens(n: int, seed: int) -> np.ndarray:
    succ = np.random.default_rng(0).integers(0, 256, (256, 4))  # the chain, fixed
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    for i in range(1, n):
        out[i] = succ[out[i - 1], rng.integers(0, 4)]
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    write_tokens(markov_tokens(20000, 1), d / "train.bin", vocab_size=256, meta={})
    write_tokens(markov_tokens(3000, 2), d / "val.bin", vocab_size=256, meta={})
    return d


def train_args(data, out, *extra):
    return ["train", "--model", "tiny-llama", "--train-data", str(data / "train.bin"),
            "--val-data", str(data / "val.bin"), "--comm", "echo4", "--seq-len", "64",
            "--batch-size", "8", "--lr", "3e-3", "--warmup", "5", "--eval-batches", "4",
            "--out-dir", str(out), "--no-progress", *extra]


def read_log(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert cli.main(train_args(data, out, "--steps", "30", "--eval-every", "10",
                               "--simulate", "2")) == 0
    return out


def test_train_30_steps_echo4_reduces_loss(trained):
    rows = read_log(trained / "log.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 31))
    loss = [float(r["loss"]) for r in rows]
    assert abs(loss[0] - math.log(256)) < 0.1  # std-0.02 init: near-uniform predictions
    assert np.mean(loss[-5:]) < np.mean(loss[:5]) - 0.5, loss
    val = {int(r["step"]): float(r["val_loss"]) for r in rows if r["val_loss"]}
    assert sorted(val) == [10, 20, 30] and val[30] < val[10], val
    assert all(float(r["grad_norm"]) > 0 for r in rows)
    assert (trained / "loss.png").stat().st_size > 1000
    config = json.loads((trained / "train_config.json").read_text())
    assert config["comm_config"]["bits"] == 4 and config["simulated"] and config["world_size"] == 2
    model, cfg = load_hf_checkpoint(trained / "checkpoints" / "step-30", dtype=torch.float32)
    assert cfg == ModelConfig.from_name("tiny-llama")


def test_train_on_gloo_ranks_equals_simulated(data, tmp_path):
    args = ("--steps", "4", "--grad-accum", "2", "--batch-size", "4", "--eval-every", "2")
    assert cli.main(train_args(data, tmp_path / "real", *args, "--world-size", "2")) == 0
    assert cli.main(train_args(data, tmp_path / "sim", *args, "--simulate", "2")) == 0
    real, sim = read_log(tmp_path / "real/log.csv"), read_log(tmp_path / "sim/log.csv")
    for a, b in zip(real, sim, strict=True):
        for key in ("loss", "grad_norm", "val_loss", "lr"):
            assert a[key] == b[key], (key, a, b)
    wa = load_file(tmp_path / "real/checkpoints/step-4/model.safetensors")
    wb = load_file(tmp_path / "sim/checkpoints/step-4/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_eval_cli_many_configs(trained, data, tmp_path, capsys):
    out = tmp_path / "eval.json"
    specs = ["16", "8", "4", "echo4", "echo4-local", "early8:eta=0.5",
             "echo4:quantizer=naive,g=64"]
    assert cli.main(["eval", "--model", str(trained / "checkpoints" / "step-30"), "--data",
                     str(data / "val.bin"), "--comms", *specs, "--context", "32", "--stride",
                     "16", "--max-windows", "24", "--batch-size", "8", "--simulate", "2",
                     "--no-progress", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["results"]
    assert [r["label"] for r in rows] == specs
    assert record["stride"] == 16 and record["world_size"] == 2 and record["mode"] == "simulated"
    n_windows = 24  # of (3000 - 1 - 32) // 16 + 1 = 186
    for r in rows:
        assert r["windows"] == n_windows and r["tokens"] == 32 + (n_windows - 1) * 16
        assert math.isfinite(r["ppl"]) and r["ppl"] < 256  # trained: better than uniform
    assert rows[5]["policy"] == "early8" and rows[5]["eta"] == 0.5
    assert rows[6]["quantizer"] == "naive" and rows[6]["group_size"] == 64
    text = capsys.readouterr().out
    assert "echo4:quantizer=naive,g=64" in text and "vs 16" in text


def test_eval_text_file_with_the_gpt2_tokenizer(tmp_path):
    cfg = ModelConfig.from_name("tiny-qwen3").replace(vocab_size=50257)  # GPT-2 vocabulary
    save_hf_checkpoint(init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=3),
                       cfg, tmp_path / "hf")
    (tmp_path / "doc.txt").write_text(TEXT)
    n_tokens = len(build_tokenizer().encode(TEXT).ids)
    rows = eval_main(model=str(tmp_path / "hf"), data=str(tmp_path / "doc.txt"),
                     comms=["16", "echo4", "early8"], context=32, batch_size=2, simulate=2,
                     progress=False)
    for r in rows:
        assert r["tokens"] == 32 * ((n_tokens - 1) // 32)  # non-overlapping windows
        assert abs(r["nll"] - math.log(50257)) < 0.5  # std-0.02 init: near-uniform
    assert rows[0]["nll"] != rows[1]["nll"]  # 4-bit changed something


def test_sliding_windows_score_every_target_once():
    for n, T, S in [(100, 10, 10), (100, 10, 3), (11, 10, 1), (57, 8, 5)]:
        wins = sliding_windows(n, T, S)
        scored = [s + 1 + j for s, first in wins for j in range(first, T)]
        assert scored == list(range(1, scored[-1] + 1)), (n, T, S)
        assert scored[-1] <= n - 1 and n - 1 - scored[-1] < S
        assert all(first == T - S for _, first in wins[1:])
    assert len(sliding_windows(100, 10, max_windows=3)) == 3
    with pytest.raises(ValueError, match="do not fill"):
        sliding_windows(10, 10)
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(100, 10, 11)


def test_token_batches_order_is_fixed_by_the_seed():
    tokens = torch.arange(1000)

    def chunks(batch_size, seed, n):
        it = TokenBatches(tokens, seq_len=10, batch_size=batch_size, seed=seed)
        xs = torch.cat([next(it)[0] for _ in range(n)])
        return xs[:, 0].tolist()

    a = chunks(4, 7, 60)  # 240 sequences: 99 chunks per epoch, so it runs into epoch 2
    assert a == chunks(4, 7, 60) and a[:200] == chunks(8, 7, 25)
    assert a != chunks(4, 8, 60)
    assert sorted(a[:99]) == list(range(0, 990, 10))  # one epoch visits every chunk once
    x, y = next(TokenBatches(tokens, seq_len=10, batch_size=2, seed=0))
    assert torch.equal(y, x + 1)


def test_lr_schedule_and_options():
    o = TrainOptions(model="tiny-llama", train_data="x", steps=100, warmup=10, lr=1.0,
                     min_lr=0.1)
    assert lr_at(0, o) == pytest.approx(0.1) and lr_at(9, o) == pytest.approx(1.0)
    assert lr_at(10, o) == pytest.approx(1.0) and lr_at(99, o) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(s, o) >= lr_at(s + 1, o) for s in range(10, 99))
    with pytest.raises(ValueError, match="grad_accum"):
        TrainOptions(model="tiny-llama", train_data="x", grad_accum=0)


def test_bad_input_is_reported(data, capsys):
    base = ["eval", "--model", "tiny-llama", "--data", str(data / "val.bin"), "--no-progress"]
    assert cli.main(base) == 2  # no TP group chosen
    assert "--simulate" in capsys.readouterr().err
    assert cli.main(base + ["--simulate", "2", "--comms", "echo4:eta"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert cli.main(["eval", "--model", "tiny-llama", "--data", str(data / "nope.bin"),
                     "--simulate", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(base + ["--simulate", "2", "--world-size", "2"]) == 2
