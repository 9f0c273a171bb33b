"""Tiny GGUF files in llama.cpp's layout, written with gguf.GGUFWriter (F32 tensors: nothing is
rounded on the way in), for tests/test_gguf.py and the GGUF example of docs/usage/models.md
(tests/test_readme.py).

    write_tiny_llama(path)    # SmolLM2's layout: 'llama', GPT-2 byte-level BPE, tied embeddings
    write_tiny_gemma3(path)   # Gemma 3 270M's layout: 'gemma3', sentencepiece vocabulary

Both: 2 layers, hidden 64, 4 attention heads, 2 KV heads, random weights of a fixed seed.
"""
from __future__ import annotations

import gguf
import numpy as np

H, FF, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
HEAD_DIM = H // HEADS


def _weights(rng):
    def w(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    return w


def _write(writer, tensors: dict) -> None:
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _writer(path, arch: str, eps: float) -> gguf.GGUFWriter:
    """A GGUFWriter for `arch` with the tiny model's shared hyperparameters written."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(eps)
    return writer


def write_tiny_llama(path) -> None:
    """SmolLM2's layout: GPT-2 byte-level BPE (tokenizer.ggml.model 'gpt2'), <|endoftext|> = 0,
    no output.weight (tied embeddings), llama.cpp's tensor names."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "o u", "e r"]
    tokens = ["<|endoftext|>", *bytes_to_unicode().values(), *("".join(m.split()) for m in merges)]
    vocab = len(tokens)
    w = _weights(np.random.default_rng(0))
    writer = _writer(path, "llama", 1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (vocab - 1))   # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    tensors = {"token_embd.weight": w(vocab, H, scale=1.0),
               "output_norm.weight": 1 + w(H, scale=0.1)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensors.update({
            b + "attn_norm.weight": 1 + w(H, scale=0.1),
            b + "attn_q.weight": w(H, H, scale=0.25),
            b + "attn_k.weight": w(KV_HEADS * HEAD_DIM, H, scale=0.25),
            b + "attn_v.weight": w(KV_HEADS * HEAD_DIM, H, scale=0.25),
            b + "attn_output.weight": w(H, H, scale=0.25),
            b + "ffn_norm.weight": 1 + w(H, scale=0.1),
            b + "ffn_gate.weight": w(FF, H, scale=0.25),
            b + "ffn_up.weight": w(FF, H, scale=0.25),
            b + "ffn_down.weight": w(H, FF, scale=0.18)})
    _write(writer, tensors)


def write_tiny_gemma3(path) -> None:
    """Gemma 3 270M's layout: sentencepiece vocabulary (tokenizer.ggml.model 'llama', no merges,
    <pad> <eos> <bos> <unk> = 0..3, add_bos_token), q/k norms, four norms per layer stored as
    w + 1, key_length = head_dim, a sliding window, tied embeddings."""
    letters = list("abcdefghijklmnopqrstuvwxyz.,")
    pieces = ["▁" + c for c in letters] + ["th", "he", "▁the", "▁a", "in", "er", "ou"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "▁", *letters, *pieces]
    vocab = len(tokens)
    w = _weights(np.random.default_rng(1))
    writer = _writer(path, "gemma3", 1e-6)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_sliding_window(8)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([3, 3, 3, 2] + [1] * (vocab - 4))   # 3: control, 2: unknown
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    tensors = {"token_embd.weight": w(vocab, H, scale=1.0),
               "output_norm.weight": 1 + w(H, scale=0.1)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            tensors[b + norm + ".weight"] = 1 + w(H, scale=0.1)
        for norm in ("attn_q_norm", "attn_k_norm"):
            tensors[b + norm + ".weight"] = 1 + w(HEAD_DIM, scale=0.1)
        tensors.update({
            b + "attn_q.weight": w(HEADS * HEAD_DIM, H, scale=0.25),
            b + "attn_k.weight": w(KV_HEADS * HEAD_DIM, H, scale=0.25),
            b + "attn_v.weight": w(KV_HEADS * HEAD_DIM, H, scale=0.25),
            b + "attn_output.weight": w(H, HEADS * HEAD_DIM, scale=0.25),
            b + "ffn_gate.weight": w(FF, H, scale=0.25),
            b + "ffn_up.weight": w(FF, H, scale=0.25),
            b + "ffn_down.weight": w(H, FF, scale=0.18)})
    _write(writer, tensors)
