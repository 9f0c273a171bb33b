"""`echo-tp train --cuda-graph`: each step's passes replayed as one CUDA graph (train/graphed.py).

What is compared with what:
- CPU: --cuda-graph cannot apply (no CUDA device): the run goes eagerly, says why in its result,
  and logs the same losses as a run without it; train_step with the gradients zeroed in place
  (set_to_none=False, as between replays) equals the default step bit for bit;
- GPU (skipped without CUDA): simulated TP=2 at Echo 4 bits (the fused simulated kernels),
  2 micro-batches a step, a telemetry step and evaluations in between: the graphed run's losses,
  grad norms and held-out losses equal the eager run's bit for bit (a replay launches the
  recorded kernels on the same inputs; a difference means a stale input or gradient), and the
  graph was captured (result "on"); the plain model likewise.
Where to look first: train/graphed.py (static inputs, .grad lifetime), then loop.py's step
branch (warm-up on a side stream, set_to_none=False for eager steps after the capture).
"""
from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from echo_tp.models.tokenize import write_tokens
from echo_tp.train import TrainOptions
from echo_tp.train import loop


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("graph")
    rng = np.random.default_rng(0)
    write_tokens(rng.integers(1, 256, 20000), d / "train.bin", vocab_size=256, meta={"eos_id": 0})
    write_tokens(rng.integers(1, 256, 4000), d / "val.bin", vocab_size=256, meta={"eos_id": 0})
    return d


def run(data, out, *, device, **extra):
    result = loop.main(model="tiny-llama", train_data=str(data / "train.bin"),
                       val_data=str(data / "val.bin"), seq_len=32, batch_size=4, lr=3e-3,
                       warmup=2, eval_batches=2, out_dir=str(out), progress=False,
                       device=device, **extra)
    with open(out / "log.csv", newline="") as f:
        return result, list(csv.DictReader(f))


def test_cpu_runs_eagerly_and_says_why(data, tmp_path):
    got, rows = run(data, tmp_path / "g", device="cpu", steps=6, simulate=2, comm="echo4",
                    cuda_graph=True)
    assert "CUDA device" in got["cuda_graph"]
    _, want = run(data, tmp_path / "e", device="cpu", steps=6, simulate=2, comm="echo4")
    assert [r["loss"] for r in rows] == [r["loss"] for r in want]


def test_zeroing_in_place_is_the_same_step(data):
    from echo_tp.train import TokenBatches
    from echo_tp.train.model import build_model
    from echo_tp.tp import parse_comm_spec
    from echo_tp.tp.runtime import make_comm
    o = TrainOptions(model="tiny-llama", train_data=str(data / "train.bin"), seq_len=32,
                     batch_size=4, grad_accum=2, comm="echo4")
    tokens = torch.from_numpy(np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int64))
    out = []
    for set_to_none in (True, False):
        spec = parse_comm_spec(o.comm)
        built = build_model(o.model, (), seed=0, comm=make_comm(None, 2, spec.config), rank=None,
                            world_size=2, device=torch.device("cpu"), policy=spec.widths)
        opt = loop.build_optimizer(built.model, o)
        batches = iter(TokenBatches(tokens, seq_len=32, batch_size=4, seed=0))
        steps = [loop.train_step(built.model, built, opt, batches, o, torch.device("cpu"),
                                 False, set_to_none=set_to_none) for _ in range(3)]
        out.append([(float(a), float(b)) for a, b in steps])
    assert out[0] == out[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("simulate", (2, 1))
def test_graph_replays_the_eager_step(data, tmp_path, simulate):
    args = dict(device="cuda", steps=10, grad_accum=2, eval_every=4, simulate=simulate,
                comm="echo4", telemetry_every=6 if simulate > 1 else 0)
    got, graphed = run(data, tmp_path / "g", cuda_graph=True, **args)
    assert got["cuda_graph"] == "on", got["cuda_graph"]
    _, eager = run(data, tmp_path / "e", **args)
    for a, b in zip(graphed, eager, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            assert a[key] == b[key], (key, a, b)
