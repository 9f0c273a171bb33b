"""echo_tp.models against transformers, on CPU in fp32.

What is compared with what:
- HF -> ours: tiny random LlamaForCausalLM / Qwen3ForCausalLM (norm weights perturbed so q_norm,
  k_norm and the layer norms matter), saved with save_pretrained (single file and sharded), loaded
  with load_hf_checkpoint: our logits == HF logits.
- ours -> HF: init_weights + save_hf_checkpoint, loaded by AutoModelForCausalLM: equal logits,
  and load_hf_checkpoint restores the same tensors and the lm_head tie.
- KV cache: generate() == greedy argmax by full re-forward; chunked prefill with a cache == one
  full forward. A hand-made 2-way column/row split of attention and MLP sums to the unsplit
  output (the module reads its head count from the weights, as TP needs).
- presets, tokenizer (vs transformers' GPT2Tokenizer / Qwen2Tokenizer), token files, bad input;
  the validation split: whole documents, disjoint from training, several, seeded (or the tail).

Tolerance: atol 1e-5, rtol 0 on logits of magnitude ~1. Both sides run the same fp32 ops in the
same order (fp32 RMSNorm, rotate_half RoPE, SDPA); they agree bit for bit today, and 1e-5 leaves
room only for a different SDPA kernel or BLAS blocking, never for a wrong weight or mask.

Where to look first on failure: HF parity -> config.from_hf_config / hf.hf_key_map (a field or
key mapped wrong), then transformer.Attention (RoPE layout, q/k norm before RoPE); cache tests ->
the mask branch in Attention.forward and LayerKVCache.update; tokenizer tests ->
tokenize.build_tokenizer (pre-tokenizer choice, special tokens).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

try:
    import echo_tp.models  # noqa: F401
except ImportError:  # not pip-installed (`make install` does that): use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from echo_tp.models import (ModelConfig, build_meta_model, build_tokenizer, init_weights,
                            load_hf_checkpoint, load_tokens, save_hf_checkpoint, tokenize_files,
                            tokenize_main)
from echo_tp.models.tokenize import ASSETS_DIR, choose_val_documents, val_path_for
from echo_tp.models.transformer import rope_cos_sin

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
QWEN2_DIR = Path("/work/shared/data/tokenizers/qwen2")  # optional, test skipped without it


def hf_config(arch: str, *, tied: bool, bias: bool = False):
    """A tiny HF config written with HF's own field names (independent of our to_hf_config)."""
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                  max_position_embeddings=128, tie_word_embeddings=tied, attention_bias=bias)
    if arch == "llama":
        return transformers.LlamaConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return transformers.Qwen3Config(
        **common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def random_hf_model(arch: str, *, tied: bool, bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen3ForCausalLM
    model = cls(hf_config(arch, tied=tied, bias=bias)).eval()
    perturb_norms(model)
    return model


@torch.no_grad()
def perturb_norms(model: nn.Module) -> None:
    """Norm weights start at 1; move them so a swapped or dropped norm changes the logits."""
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            p.add_(0.1 * torch.randn_like(p))


def tokens(b: int = 2, t: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch,tied,bias", [("llama", False, False), ("llama", True, True),
                                            ("qwen3", False, False), ("qwen3", True, False)])
def test_hf_checkpoint_loads_with_equal_logits(tmp_path, arch, tied, bias):
    ref = random_hf_model(arch, tied=tied, bias=bias)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    model, cfg = load_hf_checkpoint(tmp_path, dtype=torch.float32, device="cpu")
    assert cfg.qk_norm == (arch == "qwen3") and cfg.tie_embeddings == tied
    assert cfg.attention_bias == bias
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    x = tokens()
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)


def test_sharded_checkpoint_loads(tmp_path):
    ref = random_hf_model("qwen3", tied=False)
    ref.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _ = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    x = tokens()
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_saved_checkpoint_loads_in_transformers(tmp_path, preset, tied):
    cfg = ModelConfig.from_name(preset).replace(tie_embeddings=tied)
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=3).eval()
    perturb_norms(model)
    save_hf_checkpoint(model, cfg, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
    assert type(ref).__name__ == expected
    x = tokens()
    with torch.no_grad():
        assert_close(model(x), ref(x).logits)
    back, cfg_back = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    assert cfg_back == cfg
    for name, p in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied


def test_init_weights_is_seeded_and_tied():
    cfg = ModelConfig.from_name("tiny-qwen3")
    a = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=7)
    b = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=7)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    assert torch.equal(a.model.norm.weight, torch.ones(cfg.dim))
    assert 0.015 < a.model.embed_tokens.weight.std().item() < 0.025
    with pytest.raises(ValueError, match="to_empty"):
        init_weights(build_meta_model(cfg), seed=0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_generate_with_cache_matches_full_reforward(preset):
    cfg = ModelConfig.from_name(preset)
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=5, std=0.2).eval()
    prompt, n_new = tokens(b=2, t=5, seed=9), 8
    out = model.generate(prompt, n_new, greedy=True)
    seq = prompt
    with torch.no_grad():
        for _ in range(n_new):
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(out, seq)
    assert len(set(seq[0, 5:].tolist())) > 1, "degenerate test: the model repeats one token"
    assert torch.equal(model.generate(prompt[0], 3), seq[0, :8])  # 1-D prompt


def test_chunked_prefill_with_cache_matches_full_forward():
    cfg = ModelConfig.from_name("tiny-qwen3")
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=2, std=0.2).eval()
    x = tokens(b=2, t=12)
    cache = model.new_kv_cache(2, 16)
    with torch.no_grad():
        full = model(x)
        parts = [model(x[:, :4], kv_cache=cache),
                 model(x[:, 4:9], start_pos=4, kv_cache=cache),   # T > 1 on top of a prefix
                 model(x[:, 9:10], start_pos=9, kv_cache=cache),  # one decode step
                 model(x[:, 10:], start_pos=10, kv_cache=cache)]
        assert_close(torch.cat(parts, dim=1), full)
        with pytest.raises(ValueError, match="KV cache"):
            model(x[:, :8], start_pos=12, kv_cache=cache)


def _split(linear: nn.Linear, dim: int, rank: int, world: int) -> nn.Linear:
    """Rank's shard of linear: dim=0 column-parallel (output rows), dim=1 row-parallel."""
    w = linear.weight.chunk(world, dim=dim)[rank]
    shard = nn.Linear(w.shape[1], w.shape[0], bias=False)
    shard.weight = nn.Parameter(w.clone())
    return shard


@pytest.mark.parametrize("world", [2, 4])
def test_column_row_split_sums_to_unsplit_output(world):
    """What TP will do: q/k/v/gate/up column-split, o/down row-split, partial outputs summed."""
    import copy
    cfg = ModelConfig.from_name("tiny-qwen3")
    model = init_weights(build_meta_model(cfg).to_empty(device="cpu"), seed=4, std=0.2).eval()
    layer = model.model.layers[0]
    x = torch.randn(2, 7, cfg.dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.arange(7), cfg.head_dim, cfg.rope_theta, x.dtype)
    with torch.no_grad():
        attn_ref = layer.self_attn(x, cos, sin, start_pos=0, cache=None)
        mlp_ref = layer.mlp(x)
        attn_sum, mlp_sum = torch.zeros_like(x), torch.zeros_like(x)
        for r in range(world):
            attn, mlp = copy.deepcopy(layer.self_attn), copy.deepcopy(layer.mlp)
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, _split(getattr(layer.self_attn, name), 0, r, world))
            attn.o_proj = _split(layer.self_attn.o_proj, 1, r, world)
            mlp.gate_proj = _split(layer.mlp.gate_proj, 0, r, world)
            mlp.up_proj = _split(layer.mlp.up_proj, 0, r, world)
            mlp.down_proj = _split(layer.mlp.down_proj, 1, r, world)
            attn_sum += attn(x, cos, sin, start_pos=0, cache=None)
            mlp_sum += mlp(x)
    assert_close(attn_sum, attn_ref)
    assert_close(mlp_sum, mlp_ref)


@pytest.mark.parametrize("name,low,high,tied", [
    ("llama-3-8b", 7.9e9, 8.1e9, False), ("qwen3-8b", 8.1e9, 8.3e9, False),
    ("qwen3-0.6b", 0.55e9, 0.65e9, True), ("qwen3-150m", 100e6, 200e6, True)])
def test_presets_build_on_meta_with_plausible_sizes(name, low, high, tied):
    cfg = ModelConfig.from_name(name)
    model = build_meta_model(cfg)
    n = sum(p.numel() for p in model.parameters())  # a tied weight is counted once
    assert low < n < high and n == cfg.num_params()
    assert cfg.tie_embeddings == tied
    assert all(p.is_meta for p in model.parameters())
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_bad_input_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_name("llama-9b")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ModelConfig.from_name("tiny-llama").replace(n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="positive int"):
        ModelConfig.from_name("tiny-llama").replace(dim=0)
    llama31 = ModelConfig.from_name("tiny-llama").to_hf_config()
    llama31["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(ValueError, match="llama3"):
        ModelConfig.from_hf_config(llama31)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})
    ref = random_hf_model("llama", tied=False)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="unexpected"):
        load_hf_checkpoint(tmp_path, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not match cfg"):
        save_hf_checkpoint(build_meta_model(ModelConfig.from_name("tiny-llama")),
                           ModelConfig.from_name("tiny-qwen3"), tmp_path / "x")


SAMPLE = ("Hello world! It's a test: naïve café, 3.14159 and  double  spaces.\n\n"
          "    indented code()\n\tTabs, emoji 🙂, 日本語のテキスト <|endoftext|> end.\n")


def test_gpt2_tokenizer_round_trip_and_matches_transformers():
    tok = build_tokenizer()  # the shipped copy, no /work/shared at runtime
    ids = tok.encode(SAMPLE).ids
    assert tok.decode(ids, skip_special_tokens=False) == SAMPLE
    assert tok.get_vocab_size() == 50257 and tok.token_to_id("<|endoftext|>") == 50256
    assert 50256 in ids  # the special token is kept whole
    ref = transformers.AutoTokenizer.from_pretrained(ASSETS_DIR / "gpt2")
    assert ids == ref(SAMPLE, add_special_tokens=False)["input_ids"]


@pytest.mark.skipif(not QWEN2_DIR.is_dir(), reason="Qwen2 tokenizer files not present")
def test_qwen2_tokenizer_matches_transformers():
    tok = build_tokenizer(QWEN2_DIR)
    ref = transformers.AutoTokenizer.from_pretrained(QWEN2_DIR)
    text = SAMPLE + "<|im_start|>user 12345\r\n\r\n"
    ids = tok.encode(text).ids
    assert ids == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|endoftext|>") == 151643


def test_tokenize_files_count_dtype_and_val_split(tmp_path):
    tok = build_tokenizer()
    docs = ["First document.\nTwo lines.", "Second one, a bit longer " * 20, "3rd"]
    paths = []
    for i, text in enumerate(docs):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    per_doc = [tok.encode(t).ids for t in docs]
    expected = per_doc[0] + [50256] + per_doc[1] + [50256] + per_doc[2]  # EOS between documents
    info = tokenize_files(paths, tok, tmp_path / "all.bin")
    assert info["n_tokens"] == len(expected) and info["dtype"] == "uint16"
    assert (tmp_path / "all.bin").stat().st_size == 2 * len(expected)
    assert load_tokens(tmp_path / "all.bin").tolist() == expected
    assert load_tokens(tmp_path / "all.bin").dtype == torch.int64

    written = tokenize_main([str(tmp_path)], "", str(tmp_path / "out" / "train.bin"),
                            val_fraction=0.25, val_split="tail")
    train, val = (load_tokens(p) for p in written)
    assert written[1] == val_path_for(tmp_path / "out" / "train.bin")
    assert len(val) == round(0.25 * len(expected))
    assert torch.cat([train, val]).tolist() == expected  # the tail is held out, nothing lost
    meta = json.loads((tmp_path / "out" / "train.val.json").read_text())
    assert meta["split"] == "val" and meta["tokenizer"] == "gpt2" and meta["val_split"] == "tail"
    with pytest.raises(ValueError, match="val_fraction"):
        tokenize_main([str(paths[0])], "gpt2", str(tmp_path / "x.bin"), val_fraction=1.0)
    with pytest.raises(ValueError, match="--val-split tail"):  # one document: no whole one
        tokenize_main([str(paths[0])], "gpt2", str(tmp_path / "x.bin"), val_fraction=0.1)
    assert np.dtype(info["dtype"]).itemsize == 2


def test_val_split_holds_out_whole_documents(tmp_path):
    tok = build_tokenizer()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "north"]
    texts = {}
    for i in range(24):  # documents of different lengths, each with its own marker word
        body = " ".join(rng.choice(words, int(rng.integers(20, 200))))
        texts[f"doc{i:02d}.txt"] = f"Document{i} begins. {body}"
        (tmp_path / f"doc{i:02d}.txt").write_text(texts[f"doc{i:02d}.txt"], encoding="utf-8")
    out = tmp_path / "out" / "train.bin"
    train_path, val_path = tokenize_main([str(tmp_path)], "", str(out), val_fraction=0.2, seed=3)
    train_meta = json.loads(out.with_suffix(".json").read_text())
    val_meta = json.loads(val_path_for(out).with_suffix(".json").read_text())
    assert val_meta["split"] == "val" and val_meta["val_split"] == "documents"
    held = val_meta["sources"]
    assert len(held) >= 3 and not set(held) & set(train_meta["sources"])
    assert sorted(held + train_meta["sources"]) == sorted(texts)
    index = sorted(int(name[3:5]) for name in held)
    assert index != list(range(24 - len(held), 24))  # not the corpus' tail
    # The val file is exactly the held-out documents, EOS between them; train the others.
    for path, names in ((val_path, held), (train_path, train_meta["sources"])):
        want = []
        for name in names:
            want += ([50256] if want else []) + tok.encode(texts[name]).ids
        assert load_tokens(path).tolist() == want
    n_val = load_tokens(val_path).numel()
    n_all = sum(len(tok.encode(t).ids) for t in texts.values())
    assert 0.1 * n_all < n_val <= 0.2 * n_all + len(held)  # about the fraction, never above
    lengths = [len(tok.encode(texts[n]).ids) for n in sorted(texts)]
    assert choose_val_documents(lengths, 0.2, 3) == index  # deterministic by seed
    assert choose_val_documents(lengths, 0.2, 4) != index
    assert choose_val_documents([5, 100, 100], 0.01, 0) == [0]  # none fits: the smallest
