"""`echo-tp eval --sequence-parallel` pads a window whose positions P does not divide (context
512 after BOS is 513 positions; P = 8) instead of refusing: the pad goes at the window's end,
is not scored, and, the model being causal, changes no scored logit. Compared here: the padded
sequence-parallel perplexity at 16 bits against the same windows without sequence parallelism
(fp32 on the CPU: equal to 1e-5 relative, the reorder of the sums the reduce-scatter does), a
length P divides against the same (no pad), the pad alone on one device (window_scores with
multiple=P against multiple=1: the same scores to 1e-5), and a 4-bit padded run finite and close
to the 16-bit one.
Where to look first: eval/metric.py (window_scores, _pad_to), eval/runner.py (multiple).
"""
import math

import numpy as np
import pytest
import torch

from echo_tp.eval import main as eval_main
from echo_tp.eval.metric import sliding_windows, window_scores
from echo_tp.eval.runner import load_model
from echo_tp.eval.text import load_eval_tokens
from echo_tp.models.tokenize import write_tokens


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "val.bin"
    rng = np.random.default_rng(3)
    write_tokens(rng.integers(1, 256, 1200).astype(np.int64), path, vocab_size=256,
                 meta={"eos_id": 0})
    return path


def _eval(tokens_file, context, comms=("16",), **kw):
    rows = eval_main(model="tiny-llama", data=str(tokens_file), comms=list(comms), bos=True,
                     context=context, batch_size=4, max_windows=8, simulate=4, progress=False,
                     **kw)
    return {r["label"]: r for r in rows}


@pytest.mark.parametrize("context", [9, 7])          # 10 positions: padded to 12; 8: no pad
def test_sequence_parallel_eval_equals_the_all_reduce_eval_at_16_bits(tokens_file, context):
    sp = _eval(tokens_file, context, sequence_parallel=True)["16"]
    ref = _eval(tokens_file, context)["16"]
    assert sp["tokens"] == ref["tokens"] == 8 * context
    assert sp["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)


def test_padded_four_bit_sequence_parallel_eval_runs(tokens_file):
    rows = _eval(tokens_file, 9, comms=("16", "echo4"), sequence_parallel=True)
    assert math.isfinite(rows["echo4"]["ppl"])
    assert rows["echo4"]["ppl"] == pytest.approx(rows["16"]["ppl"], rel=0.05)


def test_the_pad_changes_no_score_of_a_causal_model(tokens_file):
    model, _ = load_model("tiny-llama", seed=0, dtype=torch.float32, device=torch.device("cpu"))
    tokens = load_eval_tokens(str(tokens_file), model_spec="tiny-llama", tokenizer=None)
    windows = sliding_windows(tokens.numel(), 9, None, 6)
    kw = dict(context=9, batch_size=3, device="cpu", bos_id=0, reference=model)
    plain = window_scores(model, tokens, windows, **kw)
    padded = window_scores(model, tokens, windows, multiple=8, **kw)     # 10 -> 16 positions
    assert torch.equal(plain.count, padded.count)
    assert torch.equal(plain.correct, padded.correct)
    torch.testing.assert_close(padded.nll, plain.nll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded.kl, plain.kl, rtol=1e-5, atol=1e-5)
