"""The fidelity-study tools of `echo-tp train` / `echo-tp eval`, end to end on tiny shapes (CPU).

What is checked, each against an independent computation:
- model configs: a .json file (fields on a preset, full fields, a transformers config.json) and
  KEY=VALUE fields give the ModelConfig they name, and a run trains and saves that shape;
- BOS packing (pack_documents): every row starts with BOS, every piece lies inside one document
  and one row, every document token is a target exactly once, padding only at a row's end and
  never scored; train rows and validation rows are built that way under --bos;
- the plain path (no TP group, or --simulate 1): no communicator; step 1's loss and grad norm ==
  a plain model's forward/backward on the same batch, and its losses == a TP-parallelized P = 1
  model trained with the same parts (tp.parallelize, sync_partial_grads, clip_grad_norm_);
- --time-budget stops early, then evaluates and saves at the step it stopped;
- --compile (backend swapped to "eager" here: inductor compiles for half a minute on CPU) gives
  the same losses as eager;
- --save-dtype bfloat16: bf16 tensors on disk, evaluated by `echo-tp eval` to the training
  run's own validation loss within bf16 rounding;
- eval --bos: each window read after BOS, BOS position unscored, the same targets scored;
- --profile-steps N: profile.json holds exactly the last N steps (every operator's calls over
  two steps are twice those over one; the evaluation after them not counted).
Where to look first: train/data.py (packing), train/loop.py + train/model.py (modes, budget,
saving), eval/metric.py (window_nll), models/config.py (resolve_model_config), train/profile.py
(the profiled window).
"""
import csv
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from echo_tp import cli
from echo_tp.communicator import SimulatedCommunicator
from echo_tp.eval import window_nll
from echo_tp.models import (ModelConfig, build_meta_model, init_weights, load_hf_checkpoint,
                            resolve_model_config)
from echo_tp.models.config import FIELD_TYPES
from echo_tp.models.tokenize import write_tokens
from echo_tp.train import IGNORE, TokenBatches, TrainOptions, build_optimizer, eval_batches, \
    lr_at, pack_documents
from echo_tp.tp import clip_grad_norm_, parallelize, parse_comm_spec, sync_partial_grads

SEP = 0  # the document separator (eos_id) of the token files here; BOS by default


def documents_stream(n_docs: int, seed: int) -> np.ndarray:
    """Markov-chain documents of 5..150 tokens (ids 1..255), SEP between consecutive ones."""
    succ = np.random.default_rng(0).integers(1, 256, (256, 4))
    rng = np.random.default_rng(seed)
    out = []
    for d in range(n_docs):
        if d:
            out.append(SEP)
        tok = int(rng.integers(1, 256))
        for _ in range(int(rng.integers(5, 151))):
            out.append(tok)
            tok = int(succ[tok, rng.integers(0, 4)])
    return np.array(out, dtype=np.int64)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    write_tokens(documents_stream(150, 1), d / "train.bin", vocab_size=256, meta={"eos_id": SEP})
    write_tokens(documents_stream(40, 2), d / "val.bin", vocab_size=256, meta={"eos_id": SEP})
    return d


def train(data, out, *extra):
    args = ["train", "--model", "tiny-llama", "--train-data", str(data / "train.bin"),
            "--val-data", str(data / "val.bin"), "--seq-len", "32", "--batch-size", "4",
            "--lr", "3e-3", "--warmup", "2", "--eval-batches", "2", "--out-dir", str(out),
            "--no-progress", *extra]
    assert cli.main(args) == 0
    with open(out / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def documents(stream: np.ndarray) -> list[list[int]]:
    docs, cur = [], []
    for t in stream.tolist():
        if t == SEP:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return [d for d in docs + [cur] if d]


def test_model_config_from_json_and_fields(tmp_path):
    assert set(FIELD_TYPES) == {f.name for f in dataclasses.fields(ModelConfig)}
    base = ModelConfig.from_name("tiny-qwen3")
    (tmp_path / "on_preset.json").write_text(json.dumps({"preset": "tiny-qwen3", "n_layers": 3}))
    assert resolve_model_config(str(tmp_path / "on_preset.json")) == base.replace(n_layers=3)
    full = {**dataclasses.asdict(base), "dim": 96}
    (tmp_path / "full.json").write_text(json.dumps(full))
    assert resolve_model_config(str(tmp_path / "full.json")) == base.replace(dim=96)
    (tmp_path / "hf.json").write_text(json.dumps(base.to_hf_config()))
    assert resolve_model_config(str(tmp_path / "hf.json")) == base
    got = resolve_model_config("tiny-qwen3", ["n_layers=4", "qk_norm=false", "rope_theta=1e4"])
    assert got == base.replace(n_layers=4, qk_norm=False, rope_theta=1e4)
    (tmp_path / "partial.json").write_text(json.dumps({"dim": 64}))
    for spec, fields, match in [("tiny-qwen3", ["layers=2"], "unknown model field"),
                                ("tiny-qwen3", ["n_layers=two"], "expected int"),
                                ("tiny-qwen3", ["n_layers"], "KEY=VALUE"),
                                (str(tmp_path / "partial.json"), [], "lacks the fields"),
                                (str(tmp_path / "nope.json"), [], "does not exist"),
                                ("tiny-gpt", [], "unknown model")]:
        with pytest.raises(ValueError, match=match):
            resolve_model_config(spec, fields)


def test_train_a_shape_from_a_json_file_and_fields(data, tmp_path):
    (tmp_path / "shape.json").write_text(json.dumps({"preset": "tiny-llama", "dim": 32}))
    train(data, tmp_path / "run", "--model", str(tmp_path / "shape.json"), "--model-field",
          "n_layers=1", "intermediate_size=64", "--steps", "2")
    want = ModelConfig.from_name("tiny-llama").replace(dim=32, n_layers=1, intermediate_size=64)
    record = json.loads((tmp_path / "run/train_config.json").read_text())
    assert record["model_config"] == dataclasses.asdict(want)
    _, cfg = load_hf_checkpoint(tmp_path / "run/checkpoints/step-2")
    assert cfg == want


def test_pack_documents_keeps_documents_whole_and_starts_rows_with_bos():
    stream = documents_stream(60, 5)
    T, bos = 32, 300  # a BOS id distinct from SEP, so pieces are read from the rows alone
    rows = pack_documents(torch.from_numpy(stream), seq_len=T, sep_id=SEP, bos_id=bos).long()
    assert rows.shape[1] == T + 1 and (rows[:, 0] == bos).all()
    pieces = []
    for row in rows.tolist():
        valid = [t for t in row if t != IGNORE]
        assert row[:len(valid)] == valid  # padding only at the end
        for t in valid:
            if t == bos:
                pieces.append([])
            else:
                pieces[-1].append(t)
    docs = documents(stream)
    # Every piece is a seq_len-aligned slice of one document: full pieces alone in a row,
    # short ones (a document's remainder) packed; read in row order, they rebuild each document.
    expected = sorted([tuple(d[i:i + T]) for d in docs for i in range(0, len(d), T)])
    assert sorted(map(tuple, pieces)) == expected
    assert sum(len(p) for p in pieces) == sum(len(d) for d in docs)  # each token once
    assert any(row.count(bos) > 1 for row in rows.tolist())  # short pieces were packed
    x, y = next(TokenBatches(torch.from_numpy(stream), seq_len=T, batch_size=8, seed=0,
                             bos_id=bos, sep_id=SEP))
    assert (x[:, 0] == bos).all() and (x >= 0).all()
    assert torch.equal(x[:, 1:][y[:, :-1] != IGNORE], y[:, :-1][y[:, :-1] != IGNORE])
    val = eval_batches(torch.from_numpy(stream), seq_len=T, batch_size=4, max_batches=2,
                       bos_id=bos, sep_id=SEP)
    assert len(val) == 2 and torch.equal(val[0][1], rows[:4, 1:])  # the first rows, in order


def test_train_bos_rows_every_sequence_starts_with_bos(data, tmp_path, monkeypatch):
    seen = []
    real = F.cross_entropy

    def spy(logits, target, *a, **k):  # the targets the loss sees
        seen.append(target.clone())
        return real(logits, target, *a, **k)

    import echo_tp.train.loop as loop
    monkeypatch.setattr(loop.F, "cross_entropy", spy)
    inputs = []
    real_batch = TokenBatches.__next__

    def spy_batch(self):
        x, y = real_batch(self)
        inputs.append(x)
        return x, y

    monkeypatch.setattr(TokenBatches, "__next__", spy_batch)
    rows = train(data, tmp_path / "run", "--bos", "--steps", "3", "--eval-every", "3")
    record = json.loads((tmp_path / "run/train_config.json").read_text())
    assert record["bos_id"] == SEP and record["mode"] == "plain"
    assert len(inputs) == 3 and all((x[:, 0] == SEP).all() for x in inputs)
    assert any((t == IGNORE).any() for t in seen)  # padding reached the loss, as ignored
    assert all(math.isfinite(float(r["loss"])) for r in rows) and rows[-1]["val_loss"]


def test_plain_path_equals_a_plain_model_and_the_p1_tp_model(data, tmp_path):
    rows = train(data, tmp_path / "plain", "--steps", "5", "--clip", "0.5", "--bos")
    same = train(data, tmp_path / "sim1", "--steps", "5", "--clip", "0.5", "--bos",
                 "--simulate", "1", "--comm", "echo4")  # a group of one: comm is the identity
    assert [r["loss"] for r in rows] == [r["loss"] for r in same]
    assert json.loads((tmp_path / "sim1/train_config.json").read_text())["mode"] == "plain"
    o = TrainOptions(model="tiny-llama", train_data=str(data / "train.bin"), steps=5,
                     seq_len=32, batch_size=4, lr=3e-3, warmup=2, clip=0.5, bos=True)
    tokens = torch.from_numpy(np.fromfile(data / "train.bin", dtype="<u2").astype(np.int64))

    def fresh():
        cfg = ModelConfig.from_name("tiny-llama")
        return init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=0).train()

    # Step 1 against a plain model's own forward/backward.
    x, y = next(TokenBatches(tokens, seq_len=32, batch_size=4, seed=0, bos_id=SEP, sep_id=SEP))
    model = fresh()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    norm = torch.stack([p.grad.square().sum() for p in model.parameters()]).sum().sqrt()
    assert float(rows[0]["loss"]) == float(loss.detach())
    assert float(rows[0]["grad_norm"]) == pytest.approx(float(norm), rel=1e-5)
    # Five steps against the TP engine at P = 1 (simulated), trained with the same parts.
    spec = parse_comm_spec("16")
    tp = parallelize(fresh(), SimulatedCommunicator(1, spec.config), None, policy=spec.widths)
    opt = build_optimizer(tp, o)
    batches = TokenBatches(tokens, seq_len=32, batch_size=4, seed=0, bos_id=SEP, sep_id=SEP)
    for step, row in enumerate(rows):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o)
        opt.zero_grad(set_to_none=True)
        x, y = next(batches)
        loss = F.cross_entropy(tp(x).flatten(0, 1), y.flatten())
        loss.backward()
        sync_partial_grads(tp)
        clip_grad_norm_(tp, 0.5)
        opt.step()
        assert float(row["loss"]) == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-6), step


def test_time_budget_stops_early_and_saves(data, tmp_path):
    rows = train(data, tmp_path / "run", "--steps", "100000", "--time-budget", "1.5",
                 "--eval-every", "100000")
    n = len(rows)
    assert 2 <= n < 100000 and int(rows[-1]["step"]) == n
    assert float(rows[-1]["elapsed_s"]) >= 1.5 > float(rows[-2]["elapsed_s"])  # the first past
    assert rows[-1]["val_loss"] and not any(r["val_loss"] for r in rows[:-1])
    assert (tmp_path / f"run/checkpoints/step-{n}/model.safetensors").is_file()
    o = TrainOptions(model="tiny-llama", train_data="x", steps=100000, lr=3e-3, warmup=2)
    assert float(rows[-1]["lr"]) == pytest.approx(lr_at(n - 1, o))  # the --steps schedule


def test_compile_gives_the_eager_losses(data, tmp_path, monkeypatch):
    calls = []
    real = torch.compile

    def eager_compile(model, **kw):
        calls.append(type(model).__name__)
        return real(model, backend="eager")

    monkeypatch.setattr(torch, "compile", eager_compile)
    compiled = train(data, tmp_path / "c", "--steps", "3", "--compile", "--bos",
                     "--eval-every", "3")
    eager = train(data, tmp_path / "e", "--steps", "3", "--bos", "--eval-every", "3")
    assert calls == ["Transformer"]
    for a, b in zip(compiled, eager, strict=True):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-6)
        assert a["val_loss"] == b["val_loss"] or float(a["val_loss"]) == pytest.approx(
            float(b["val_loss"]), rel=1e-6)


def test_bf16_checkpoint_is_bf16_and_evaluates(data, tmp_path):
    rows = train(data, tmp_path / "run", "--steps", "20", "--save-dtype", "bfloat16",
                 "--eval-every", "20")
    ckpt = tmp_path / "run/checkpoints/step-20"
    tensors = load_file(ckpt / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    out = tmp_path / "eval.json"
    # The training run's validation set: the first 2 x 4 non-overlapping windows of 32.
    assert cli.main(["eval", "--model", str(ckpt), "--data", str(data / "val.bin"), "--comms",
                     "16", "--context", "32", "--max-windows", "8", "--batch-size", "4",
                     "--simulate", "1", "--no-progress", "--out", str(out)]) == 0
    nll = json.loads(out.read_text())["results"][0]["nll"]
    assert nll == pytest.approx(float(rows[-1]["val_loss"]), abs=0.02)  # bf16 weights


def test_eval_bos_windows(data, tmp_path):
    cfg = ModelConfig.from_name("tiny-llama")
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=4).eval()
    tokens = torch.from_numpy(documents_stream(10, 3))
    windows = [(0, 0), (16, 8), (32, 8)]
    nll, n = window_nll(model, tokens, windows, context=16, batch_size=2, device="cpu",
                        bos_id=7)
    plain_nll, plain_n = window_nll(model, tokens, windows, context=16, batch_size=2,
                                    device="cpu")
    want = 0.0
    with torch.no_grad():
        for s, first in windows:
            x = torch.cat([torch.tensor([7]), tokens[s:s + 16]])[None]          # [1, 17]
            logp = model(x)[0, 1:].log_softmax(-1)                              # [16, V]
            y = tokens[s + 1:s + 17]
            want -= float(logp[torch.arange(16), y][first:].double().sum())
    assert n == plain_n == 16 + 8 + 8 and nll == pytest.approx(want, rel=1e-6)
    assert nll != plain_nll
    out = tmp_path / "eval.json"
    assert cli.main(["eval", "--model", "tiny-llama", "--data", str(data / "val.bin"),
                     "--comms", "16", "echo4", "--context", "32", "--max-windows", "4",
                     "--bos", "--simulate", "2", "--no-progress", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["bos_id"] == SEP and record["results"][0]["tokens"] == 4 * 32


def test_simulated_tp_training_under_autocast(data, tmp_path):
    """bf16 autocast (--amp, as on GPUs) with the TP model's fused block boundaries: a bf16 block
    output meets the fp32 residual stream. 16-bit at simulated TP=2 follows the plain model's
    autocast losses; Echo 4-bit trains (it once raised 'residual must match')."""
    plain = train(data, tmp_path / "plain", "--steps", "4", "--amp", "--device", "cpu")
    tp16 = train(data, tmp_path / "tp16", "--steps", "4", "--amp", "--device", "cpu",
                 "--simulate", "2", "--comm", "16")
    echo = train(data, tmp_path / "echo", "--steps", "4", "--amp", "--device", "cpu",
                 "--simulate", "2", "--comm", "echo4")
    for a, b in zip(plain, tp16):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=2e-2)
    assert all(math.isfinite(float(r["loss"])) for r in echo)
    assert float(echo[-1]["loss"]) < float(echo[0]["loss"])


def test_sequence_parallel_training_under_autocast(data, tmp_path):
    """`echo-tp train --sequence-parallel` under bf16 autocast: the reduce-scatter's bf16 output
    meets the fp32 residual stream on the shard (it once raised 'residual must match'). 16-bit
    SP follows the plain model's losses; Echo with 8-bit all-gathers trains."""
    plain = train(data, tmp_path / "plain", "--steps", "3", "--amp", "--device", "cpu")
    sp16 = train(data, tmp_path / "sp16", "--steps", "3", "--amp", "--device", "cpu",
                 "--simulate", "2", "--comm", "16", "--sequence-parallel")
    echo = train(data, tmp_path / "echo", "--steps", "3", "--amp", "--device", "cpu",
                 "--simulate", "2", "--comm", "echo4:gather_bits=8", "--sequence-parallel")
    for a, b in zip(plain, sp16):
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=2e-2)
    assert all(math.isfinite(float(r["loss"])) for r in echo)
    assert float(echo[-1]["loss"]) < float(echo[0]["loss"])
    config = json.loads((tmp_path / "echo" / "train_config.json").read_text())
    assert config["sequence_parallel"] and config["comm_config"]["gather_bits"] == 8


def test_profile_steps_profiles_the_last_steps(data, tmp_path):
    """--profile-steps N: out_dir/profile.json covers the last N steps only. On the CPU every
    step runs the same operators, so two steps' calls are twice one step's, operator by
    operator; the evaluation and the save after the window add nothing."""
    got = {}
    for n in (1, 2):
        out = tmp_path / f"p{n}"
        train(data, out, "--steps", "3", "--profile-steps", str(n), "--simulate", "2",
              "--sim-path", "batched", "--comm", "echo4")
        got[n] = json.loads((out / "profile.json").read_text())
        assert json.loads((out / "result.json").read_text())["profile"] == str(
            out / "profile.json")
        assert got[n]["steps"] == n and got[n]["device"] == "cpu" and got[n]["wall_s"] > 0
        assert got[n]["time_us"] == pytest.approx(sum(r["us"] for r in got[n]["rows"]),
                                                  abs=1e-2)
    one, two = ({r["name"]: r["calls"] for r in got[n]["rows"]} for n in (1, 2))
    assert "aten::bmm" in one and two == {k: 2 * v for k, v in one.items()}
    with pytest.raises(ValueError, match="profile_steps must be <= steps"):
        TrainOptions(train_data="x", steps=2, profile_steps=3)
