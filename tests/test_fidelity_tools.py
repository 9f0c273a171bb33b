"""The tools of the fidelity study (issue 19): paired bootstrap, last-word accuracy, telemetry
bit policies, the hidden-size rotation, and `echo-tp eval` using them end to end (CPU, tiny).

Where to look first: intervals -> eval/stats.py; last-word targets -> eval/lastword.py; chosen
bit tables -> tp/policy.py (telemetry_policy); a rotated model that changed its outputs ->
models/rotate.py; the eval rows -> eval/runner.py (_add_statistics).
"""
import json
import math

import pytest
import torch

from echo_tp.config import EchoConfig
from echo_tp.eval import main as eval_main
from echo_tp.eval.lastword import target_spans, token_classes, word_hits
from echo_tp.eval.perplexity import format_table
from echo_tp.eval.stats import gap_closed_table, paired_difference
from echo_tp.models import build_meta_model, build_tokenizer, init_weights, resolve_model_config
from echo_tp.models.rotate import orthogonal_matrix, rotate_hidden
from echo_tp.models.tokenize import resolve_tokenizer_dir, write_tokens
from echo_tp.tp.policy import (average_wire_bits, make_policy, parse_comm_spec,
                               telemetry_budget, telemetry_policy, wire_bits_per_value)


# ----------------------------------------------------------------------------- bootstrap

def test_gap_closed_point_values_and_intervals():
    g = torch.Generator().manual_seed(0)
    W = 400
    count = torch.full((W,), 100, dtype=torch.long)
    base = 300 + 20 * torch.rand(W, generator=g, dtype=torch.float64)
    noise = torch.rand(W, generator=g, dtype=torch.float64)
    nll = torch.stack([base,                      # 16
                       base + 4 + noise,          # 4: +4 nats / window
                       base + 1 + noise / 4,      # ~ closes 3/4 of the gap
                       base + 4 + noise])         # = the 4-bit row
    rows = gap_closed_table(nll, count, ref16=0, ref4=1, resamples=500, seed=1)
    ppl = torch.exp(nll.sum(-1) / count.sum())
    for r, p in zip(rows, ppl):
        assert r["ppl_change_pct"] == pytest.approx(float((p / ppl[0] - 1) * 100))
    assert rows[0]["gap_closed"] == pytest.approx(1.0) and rows[1]["gap_closed"] == 0.0
    assert rows[3]["gap_closed_ci"] == pytest.approx((0.0, 0.0))
    lo, hi = rows[2]["gap_closed_ci"]
    assert lo < rows[2]["gap_closed"] < hi and 0.6 < lo and hi < 0.85
    # paired: the interval of a row that differs from the 4-bit row by a constant is tight,
    # far tighter than the spread of the windows' own perplexities
    assert hi - lo < 0.05


def test_gap_is_none_when_4bit_costs_nothing():
    nll = torch.ones(3, 10, dtype=torch.float64)
    rows = gap_closed_table(nll, torch.ones(10, dtype=torch.long), 0, 1, resamples=50)
    assert all(r["gap_closed"] is None for r in rows)
    assert rows[2]["ppl_change_pct"] == 0.0


def test_paired_difference_of_accuracies():
    hits = torch.tensor([[1, 1, 0, 1] * 25, [1, 0, 0, 1] * 25], dtype=torch.bool)
    rows = paired_difference(hits, 0, resamples=300)
    assert rows[0]["accuracy"] == 75.0 and rows[1]["accuracy"] == 50.0
    assert rows[1]["diff_pts"] == -25.0
    lo, hi = rows[1]["diff_pts_ci"]
    assert lo < -25.0 < hi < 0


# ----------------------------------------------------------------------------- last word

class FakeTokenizer:
    VOCAB = ["<|endoftext|>", "\u0120The", "\u0120cat", "\u0120sat", ".", "\u0120on", "\u0120mat",
             "ting", "!", ",", "\u01201999"]

    def id_to_token(self, i):
        return self.VOCAB[i]


def test_sentence_final_words_and_hits():
    classes = token_classes(FakeTokenizer(), len(FakeTokenizer.VOCAB))
    #        0  1  2  3  4  5  6  7  8  9  10 11 12 13
    toks = torch.tensor([1, 2, 3, 4, 1, 6, 7, 8, 5, 10, 4, 2, 9, 3])
    spans = target_spans(toks, [(0, 0)], context=12, classes=classes, min_context=0)
    # "sat" then "." at 2-3; "mat" "ting" then "!" at 5-7; "1999" is no word (digits)
    assert spans.tolist() == [[2, 3], [5, 7]]
    # a window scores positions 1..12; min_context=4 keeps words starting at >= 5
    assert target_spans(toks, [(0, 0)], context=12, classes=classes,
                        min_context=4).tolist() == [[5, 7]]
    correct = torch.full((14,), -1, dtype=torch.int8)
    correct[1:13] = 1
    correct[6] = 0                                   # "ting" mispredicted
    assert word_hits(correct, spans).tolist() == [True, False]
    correct[2] = -1
    with pytest.raises(ValueError, match="not scored"):
        word_hits(correct, spans)


# ----------------------------------------------------------------------------- bit policies

def _rows(errs, y_sq=None):
    return [{"direction": "forward", "site": s, "numel": 1024, "delta_norm_est": math.sqrt(e),
             "y_sq": 1.0 if y_sq is None else y_sq[s]} for s, e in enumerate(errs)]


def test_telemetry_policy_widens_the_worst_sites_within_budget():
    cfg = EchoConfig(bits=4, outlier=False)          # g=128: 4.25 bits/value, 8-bit 8.25
    assert wire_bits_per_value(cfg, None) == 4.25 and wire_bits_per_value(cfg, 8) == 8.25
    word = EchoConfig(bits=4)                        # the outlier word: +16 bits a group
    assert wire_bits_per_value(word, None) == 4.375 and wire_bits_per_value(word, 8) == 8.375
    assert wire_bits_per_value(cfg, 16) == 16.0
    errs = [1.0, 9.0, 2.0, 7.0, 3.0, 0.5, 0.1, 4.0]
    table = telemetry_policy(_rows(errs), 5.25, cfg)  # room for 2 of 8 sites at 8 bits
    assert [s for s, b in table.items() if b == 8] == [1, 3]
    assert average_wire_bits(cfg, table, {s: 1024 for s in table}) == pytest.approx(5.25)
    rel = telemetry_policy(_rows(errs, y_sq=[1, 100, 1, 100, 1, 1, 1, 1]), 5.25, cfg,
                           score="relative")
    assert [s for s, b in rel.items() if b == 8] == [4, 7]
    assert telemetry_policy(_rows(errs), 4.25, cfg) == {s: 4 for s in range(8)}
    with pytest.raises(ValueError, match="below the base"):
        telemetry_policy(_rows(errs), 4.0, cfg)
    assert make_policy(table, 4)(1) == 8


def test_telemetry_policy_names():
    assert telemetry_budget("telemetry@5.0") == ("absolute", 5.0)
    assert telemetry_budget("telemetry-rel@4.6") == ("relative", 4.6)
    assert telemetry_budget("early8") is None
    for bad in ("telemetry", "telemetry@x", "telemetry@-1"):
        with pytest.raises(ValueError, match="telemetry"):
            telemetry_budget(bad)
    assert parse_comm_spec("echo4:policy=telemetry@5").widths.policy == "telemetry@5"
    with pytest.raises(ValueError, match="calibration pass"):
        make_policy("telemetry@5", 2)


# ----------------------------------------------------------------------------- rotation

@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_rotation_keeps_the_function_and_rotates_the_stream(preset):
    q = orthogonal_matrix(64, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    q48 = orthogonal_matrix(48, seed=3)
    assert torch.allclose(q48 @ q48.T, torch.eye(48, dtype=torch.float64), atol=1e-12)
    cfg = resolve_model_config(preset)
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=0).eval()
    for n, p in model.named_parameters():           # non-trivial norm weights to fold
        if n.endswith("layernorm.weight") or n == "model.norm.weight":
            p.data.uniform_(0.5, 1.5)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        ref = model(x)
        h_ref = model.model.embed_tokens(x)
    rotated = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=0).eval()
    rotated.load_state_dict(model.state_dict())
    q = rotate_hidden(rotated, seed=1)
    with torch.no_grad():
        out = rotated(x)
        h = rotated.model.embed_tokens(x)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(h.double(), h_ref.double() @ q, atol=1e-5)
    assert rotated.lm_head.weight is not rotated.model.embed_tokens.weight
    assert not rotated.cfg.tie_embeddings


# ----------------------------------------------------------------------------- eval

def test_eval_reports_gap_intervals_last_word_and_telemetry_policy(tmp_path):
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(1, 8192, (2200,), generator=g)
    tok = build_tokenizer(resolve_tokenizer_dir("gutenberg-8k"))
    toks[10::20] = tok.token_to_id("\u0120house")      # a sentence-final word every 20 tokens
    toks[11::20] = tok.token_to_id(".")
    write_tokens(toks.numpy().astype("uint16"), tmp_path / "val.bin", vocab_size=8192,
                 meta={"tokenizer": "gutenberg-8k", "eos_id": 0})
    out = tmp_path / "r.json"
    model = tmp_path / "tiny-8k.json"                  # the gutenberg-8k vocabulary
    model.write_text(json.dumps({"preset": "tiny-qwen3", "vocab_size": 8192}))
    rows = eval_main(model=str(model), data=str(tmp_path / "val.bin"),
                     comms=["16", "4", "echo4", "echo4:policy=telemetry@5.375"], context=64,
                     batch_size=4, max_windows=12, simulate=2, progress=False, bos=True,
                     last_word=True, calibration_windows=2, out=str(out))
    assert [r["label"] for r in rows][:2] == ["16", "4"]
    assert rows[0]["gap_closed"] == pytest.approx(1.0) and rows[1]["gap_closed"] == 0.0
    assert rows[2]["gap_closed_ci"][0] <= rows[2]["gap_closed"] <= rows[2]["gap_closed_ci"][1]
    assert [len(r["window_nll"]) for r in rows] == [12] * 4
    assert math.exp(sum(rows[2]["window_nll"]) / rows[2]["tokens"]) == pytest.approx(
        rows[2]["ppl"])
    # echo4: the outlier word (4.375 bits), the edge sites at 8 (8.375): 2 of 4 sites
    assert rows[0]["wire_bits"] == 16.0 and rows[2]["wire_bits"] == (4.375 + 8.375) / 2
    tel = rows[3]
    # 2 layers = 4 sites: 5.375 bits per value leave room for one at 8 bits (4.375 / 8.375)
    assert tel["wire_bits"] == 5.375 and list(tel["policy_table"].values()).count(8) == 1
    assert tel["calibration"]["windows"] == 2
    assert all(r["last_word_targets"] == rows[0]["last_word_targets"] > 10 for r in rows)
    assert rows[0]["last_word_diff_pts"] == 0.0
    saved = json.loads(out.read_text())
    assert saved["results"][3]["policy_table"] == tel["policy_table"]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="rotation"):
        eval_main(model=str(tmp_path / "hf"), data=str(tmp_path / "val.bin"), comms=["16"],
                  simulate=2, rotate=0, impl="transformers")


def test_eval_kl_to_the_16_bit_model(tmp_path):
    """eval --kl: each row's mean KL of its next-token distributions from a 16-bit copy of the
    model; exactly 0 for the 16-bit row, 8-bit far below naive 4-bit; its interval holds it;
    the table shows it; SP runs it too."""
    g = torch.Generator().manual_seed(2)
    write_tokens(torch.randint(1, 256, (700,), generator=g).numpy().astype("uint16"),
                 tmp_path / "val.bin", vocab_size=256, meta={"eos_id": 0})
    kw = dict(model="tiny-qwen3", data=str(tmp_path / "val.bin"), context=63, batch_size=4,
              max_windows=6, simulate=2, progress=False, bos=True, kl=True)
    rows = eval_main(comms=["16", "8", "4", "echo4"], **kw)
    kl = {r["label"]: r["kl"] for r in rows}
    assert kl["16"] == 0.0
    assert 0 < kl["8"] < kl["4"] / 10 and kl["echo4"] > 0
    assert all(r["kl_ci"][0] <= r["kl"] <= r["kl_ci"][1] for r in rows)
    assert "KL vs 16-bit" in format_table(rows)
    sp = eval_main(comms=["16", "4"], sequence_parallel=True, **kw)
    assert sp[0]["kl"] == 0.0 and sp[1]["kl"] > 0
    assert "KL" not in format_table(eval_main(comms=["16"], **{**kw, "kl": False}))


def test_eval_sequence_parallel(tmp_path):
    """eval --sequence-parallel: the 16-bit SP model scores the windows as the non-SP one
    (fp32), and quantized SP configs run; a window P does not divide is padded."""
    g = torch.Generator().manual_seed(1)
    write_tokens(torch.randint(1, 256, (700,), generator=g).numpy().astype("uint16"),
                 tmp_path / "val.bin", vocab_size=256, meta={"eos_id": 0})
    kw = dict(model="tiny-qwen3", data=str(tmp_path / "val.bin"), context=63, batch_size=4,
              max_windows=8, simulate=2, progress=False, bos=True)
    plain = eval_main(comms=["16", "echo4"], **kw)
    sp = eval_main(comms=["16", "4", "echo4", "echo4:gather_bits=0"], sequence_parallel=True,
                   **kw)
    assert sp[0]["ppl"] == pytest.approx(plain[0]["ppl"], rel=1e-5)
    assert all(math.isfinite(r["ppl"]) for r in sp)
    # the reduce-scatter and the all-gather move the same values. 2 layers: echo4's sites 0
    # and 3 at edge_bits 8 (its reduce-scatters average 6.25 bits), its gathers at gather_bits 8
    # (gather_bits=0: each site's width); naive '4' at 4 everywhere
    assert [r["wire_bits"] for r in sp] == [16.0, 4.25, (6.375 + 8.375) / 2, 6.375]
    # BOS + 64 positions: padded to 66 for the 2 shards, the pad unscored (tests/test_eval_sp.py)
    padded = eval_main(comms=["16"], sequence_parallel=True, **{**kw, "context": 64})
    assert padded[0]["ppl"] == pytest.approx(eval_main(comms=["16"], **{**kw, "context": 64})[0]
                                             ["ppl"], rel=1e-5)
    with pytest.raises(ValueError, match="names no tokenizer"):   # no tokenizer to read words
        eval_main(comms=["16"], last_word=True, **kw)


# ----------------------------------------------------------------------------- outlier packet

def test_outlier_packet_study_codec():
    """studies/outlier_packet.py: each group's largest |value| travels exactly (bf16 input), the
    rest on a grid sized by the others; bytes round-trip; the reference all-reduce runs on it."""
    import importlib
    import os
    import sys
    from echo_tp import SimulatedCommunicator, quant
    from echo_tp.config import QuantSpec
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "studies"))
    try:
        op = importlib.import_module("outlier_packet")
    finally:
        sys.path.pop(0)
    spec = QuantSpec(bits=4, group_size=128)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    x[:, 7] = 500.0                                        # one massive value in group 0
    p = op.encode(x, spec)
    back = op.from_bytes(op.to_bytes(p), 512, spec)
    assert all(torch.equal(a, b) for a, b in zip(p, back))
    y = op.decode(back, spec)
    assert torch.equal(y[:, 7], x[:, 7].float())
    plain = quant.decode(quant.encode(x, spec), spec)
    err, err_plain = (y - x.float())[:, :128].abs(), (plain - x.float())[:, :128].abs()
    assert err.max() < 0.1 * err_plain.max()    # step ~0.4 (the others), not ~33 (500)
    assert op.to_bytes(p).shape[-1] == quant.packet_nbytes(512, spec) + 4 * 4
    saved = (importlib.import_module("echo_tp.collective.qar").codec_for, quant.to_bytes,
             quant.from_bytes, os.environ.get("ECHO_BACKEND"))
    try:
        op.install()
        xs = torch.randn(2, 3, 512, generator=g)
        xs[:, :, 3] = 300.0
        out = SimulatedCommunicator(2, EchoConfig(bits=4, eta=0.0)).all_reduce(xs)
        assert (out[0] - xs.sum(0))[:, 3].abs().max() < 1e-3    # the outlier's sum: exact-ish
    finally:
        qar = importlib.import_module("echo_tp.collective.qar")
        qar.codec_for, quant.to_bytes, quant.from_bytes = saved[:3]
        if saved[3] is None:
            os.environ.pop("ECHO_BACKEND", None)
        else:
            os.environ["ECHO_BACKEND"] = saved[3]
