"""transformers models through the project's tools and back (issue 16): eval, train, save,
generate.

What is compared with what (CPU, fp32, a tiny random Qwen2 (qkv bias: not a config the
project's own Transformer reproduces, so `--model-impl auto` picks transformers) or Llama 3):
- `echo-tp eval --model HF_DIR` on a text file tokenized by the directory's tokenizer.json (the
  shipped gutenberg-8k one, vocab 8192 = the model's), simulated P=2 and 2 gloo ranks: the
  16-bit perplexity == unsharded transformers' on the same windows (rtol 1e-5: TP sums the same
  fp32 products in another grouping, ~1e-7 relative per logit; a wrong shard is O(1)); Echo
  4-bit differs from it.
- echo_tp.hf.save_hf after parallelize_hf (simulated P=2): AutoModelForCausalLM.from_pretrained
  of the saved directory has logits bit-identical to the original unsharded model (the gathered
  weights are the original tensors put back, and the load is unsharded).
- `echo-tp train --model DIR` from a config.json-only dir (seeded from_config init), simulated
  P=2, 16 bits: step 1's loss and grad norm == the unsharded model's on the same batch; the
  checkpoint it saves (save_hf) loads with from_pretrained.
- transformers' generate on a parallelize_hf'd model (simulated P=2, 16 bits) for a batch of two
  prompts of different lengths (left padding + attention_mask), EOS stop, sampling (temperature,
  top_k, top_p, fixed seed) == generate on the unsharded model, token for token (the logits
  differ by fp32 regrouping only, ~1e-7 relative: a flip would need a sampled draw or a top-k /
  top-p cut within that of a boundary; if one ever appears at a new seed, check the logits
  first: a real shard error moves them by O(1)).
Where to look first: eval -> eval/config.py model_impl, eval/runner.py _rank_eval (the transformers
branch); train -> train/loop.py _build_hf / _loss; save -> hf/save.py; generate ->
hf/parallelize.py split_cache (per-shard caches) and the masks transformers builds (padding
reaches every shard through the same kwargs).
"""
import json
import math
import shutil

import pytest
import torch

from echo_tp import EchoConfig, SimulatedCommunicator, cli
from echo_tp.eval import sliding_windows, window_nll
from echo_tp.hf import parallelize_hf, save_hf
from echo_tp.models import build_tokenizer
from echo_tp.models.tokenize import ASSETS_DIR

T = pytest.importorskip("transformers")

TOKENIZER = ASSETS_DIR / "gutenberg-8k" / "tokenizer.json"
TEXT = (ASSETS_DIR.parent / "text" / "heldout_rowlandson.txt").read_text(encoding="utf-8")[:3000]
SMALL = dict(vocab_size=8192, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64,
             max_position_embeddings=256)


def tiny(cls, config_cls, seed: int = 0, **over):
    """A random model, weights x5 so its predictions are far from uniform."""
    torch.manual_seed(seed)
    model = cls(config_cls(**{**SMALL, **over})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    tiny(T.Qwen2ForCausalLM, T.Qwen2Config).save_pretrained(path)
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    (path / "doc.txt").write_text(TEXT, encoding="utf-8")
    return path


def test_eval_cli_on_a_transformers_dir_matches_unsharded_transformers(qwen2_dir, tmp_path):
    context, windows = 32, 4
    ref = T.AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    tokens = torch.tensor(build_tokenizer(qwen2_dir).encode(TEXT).ids)  # [N]
    wins = sliding_windows(tokens.numel(), context, max_windows=windows)
    nll, n = window_nll(lambda x: ref(x).logits, tokens, wins, context=context,
                        batch_size=2, device="cpu")
    want = math.exp(nll / n)
    base = ["eval", "--model", str(qwen2_dir), "--data", str(qwen2_dir / "doc.txt"),
            "--context", str(context), "--max-windows", str(windows), "--batch-size", "2",
            "--no-progress"]
    out = tmp_path / "sim.json"
    assert cli.main(base + ["--comms", "16", "echo4", "--simulate", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["impl"] == "transformers"  # auto: the project's model has no qwen2
    rows = record["results"]
    assert rows[0]["tokens"] == n
    assert rows[0]["ppl"] == pytest.approx(want, rel=1e-5)
    assert rows[1]["ppl"] != rows[0]["ppl"]  # 4 bits changed something
    out = tmp_path / "gloo.json"
    assert cli.main(base + ["--comms", "16", "--world-size", "2", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["ppl"] == pytest.approx(want, rel=1e-5)


def test_save_hf_round_trip_through_from_pretrained(tmp_path):
    x = torch.randint(0, 8192, (2, 7), generator=torch.Generator().manual_seed(1))  # [B, T]
    cfg = dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))
    with torch.no_grad():
        want = tiny(T.LlamaForCausalLM, T.LlamaConfig, **cfg)(x).logits  # [B, T, V]
        model = tiny(T.LlamaForCausalLM, T.LlamaConfig, **cfg)
        parallelize_hf(model, SimulatedCommunicator(2, EchoConfig(bits=16)))
        save_hf(model, tmp_path / "saved")
        back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
        assert getattr(back, "echo_tp", None) is None and back.lm_head.weight is \
            back.model.embed_tokens.weight  # a plain, tied transformers model
        assert torch.equal(back.eval()(x).logits, want)
    with pytest.raises(ValueError, match="parallelize_hf"):
        save_hf(tiny(T.LlamaForCausalLM, T.LlamaConfig), tmp_path / "plain")


def sample(model, prompts, pad: int, eos: int):
    """Left-padded batch [2, T_max] + mask -> generate with sampling, fixed seed."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])           # [2, T_max]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [2, T_max]
    torch.manual_seed(1234)
    return model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                          temperature=0.8, top_k=20, top_p=0.9, pad_token_id=pad,
                          eos_token_id=eos)


def test_sampled_generate_with_left_padding_matches_unsharded():
    prompts = [[5, 17, 300, 42, 9, 77], [8, 1000]]
    ref = tiny(T.Qwen2ForCausalLM, T.Qwen2Config)
    free = sample(ref, prompts, pad=0, eos=None)  # [2, 6 + 12]
    eos = int(free[1, 6 + 2])  # EOS := the short prompt's third sampled token: that row stops
    want = sample(ref, prompts, pad=0, eos=eos)
    row = want[1, 6:].tolist()
    stop = row.index(eos)  # the row stopped at its EOS and is padded after it
    assert stop <= 2 and all(t == 0 for t in row[stop + 1:]), want
    model = tiny(T.Qwen2ForCausalLM, T.Qwen2Config)
    parallelize_hf(model, SimulatedCommunicator(2, EchoConfig(bits=16)))
    got = sample(model, prompts, pad=0, eos=eos)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("mode", [["--simulate", "2"], ["--save-dtype", "bfloat16"]],
                         ids=["simulated-2", "plain-bf16"])
def test_train_cli_on_a_transformers_config_dir(tmp_path, mode):
    """2 simulated ranks (or the plain model: no TP group), 16 bits, 2 steps from a
    config.json-only dir (seeded from_config init): step 1's loss and global grad norm == the
    unsharded model's on the same batch (rtol 1e-5 / 1e-4: fp32 regrouping), and the saved
    checkpoint (float32, or bfloat16) is a plain transformers one."""
    import csv

    import numpy as np
    import torch.nn.functional as F
    from safetensors.torch import load_file

    from echo_tp.models.tokenize import write_tokens
    from echo_tp.train import TokenBatches
    config = T.Qwen2Config(**{**SMALL, "vocab_size": 256})
    (tmp_path / "cfg").mkdir()
    config.save_pretrained(tmp_path / "cfg")
    tokens = np.random.default_rng(0).integers(0, 256, 2000)
    write_tokens(tokens, tmp_path / "train.bin", vocab_size=256, meta={})
    out = tmp_path / "run"
    assert cli.main(["train", "--model", str(tmp_path / "cfg"), "--train-data",
                     str(tmp_path / "train.bin"), "--comm", "16", "--steps", "2", "--seq-len",
                     "32", "--batch-size", "2", "--warmup", "1", "--seed", "3", *mode,
                     "--out-dir", str(out), "--no-progress"]) == 0
    with open(out / "log.csv", newline="") as f:
        first = next(csv.DictReader(f))
    torch.manual_seed(3)
    ref = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    x, y = next(TokenBatches(torch.from_numpy(tokens), seq_len=32, batch_size=2, seed=3))
    loss = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten())  # x, y [2, 32]
    loss.backward()
    norm = torch.stack([p.grad.square().sum() for p in ref.parameters()]).sum().sqrt()
    assert float(first["loss"]) == pytest.approx(float(loss.detach()), rel=1e-5)
    assert float(first["grad_norm"]) == pytest.approx(float(norm), rel=1e-4)
    back = T.AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step-2")
    assert type(back).__name__ == "Qwen2ForCausalLM"
    saved = load_file(out / "checkpoints" / "step-2" / "model.safetensors")
    want = torch.bfloat16 if "bfloat16" in mode else torch.float32
    assert {t.dtype for t in saved.values()} == {want}
