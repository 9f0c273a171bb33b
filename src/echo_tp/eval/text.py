"""The eval data as tokens: which tokenizer reads a text file, and which token is the BOS.

    tokens = load_eval_tokens("doc.txt", model_spec="model.gguf", tokenizer=None)   # [N]
    bos = data_bos_id("doc.txt", model_spec="model.gguf", tokenizer=None)           # Gemma: 2

The tokenizer of a text file (tokenizer_source): `--tokenizer` when given (a directory, a
shipped name or a .gguf file), else the model's own (an HF directory's tokenizer.json or
vocab.json + merges.txt, a GGUF file's tokenizer.ggml.* metadata read by transformers:
echo_tp.hf.gguf), else the shipped GPT-2. It is the tokenizers pipeline whole, post-processor
included: a BOS the tokenizer adds (Gemma's) stays in the stream. A token file (.bin) is
read as it is.

The default BOS (data_bos_id, for `--bos` without `--bos-id`): a token file's eos_id (its
document separator); for text, the tokenizer's <|endoftext|> (the BOS of GPT-2-style
vocabularies), else the BOS token the tokenizer declares (a GGUF's tokenizer.ggml.bos_token_id,
a directory's tokenizer_config.json / special_tokens_map.json bos_token), else a ValueError
asking for --bos-id.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from echo_tp.hf.gguf import check_gguf_file, is_gguf, load_gguf_tokenizer
from echo_tp.models import build_tokenizer, load_tokens
from echo_tp.models.tokenize import (DEFAULT_EOS, declared_bos_token, resolve_tokenizer_dir,
                                     separator_id)


def tokenizer_source(model_spec: str, tokenizer: str | None) -> str | None:
    """Where a text file's tokenizer comes from (see the module docstring); None: GPT-2."""
    if tokenizer is not None:
        return tokenizer
    if is_gguf(model_spec):
        return model_spec
    if Path(model_spec).is_dir() and any(
            (Path(model_spec) / f).is_file() for f in ("tokenizer.json", "vocab.json")):
        return model_spec
    return None


def check_tokenizer(source: str) -> None:
    """ValueError unless `source` names a tokenizer directory, a shipped one or a GGUF file."""
    if is_gguf(source):
        check_gguf_file(source)
    else:
        resolve_tokenizer_dir(source)


def text_tokenizer(source: str | None) -> tuple[Tokenizer, int | None]:
    """(the tokenizers.Tokenizer of `source`, the BOS id it declares or None)."""
    if source is not None and is_gguf(source):
        tok = load_gguf_tokenizer(source)
        return tok.backend_tokenizer, tok.bos_token_id
    path = resolve_tokenizer_dir(source)
    tok = build_tokenizer(path)
    bos = declared_bos_token(path)
    return tok, None if bos is None else tok.token_to_id(bos)


def load_eval_tokens(data: str, *, model_spec: str, tokenizer: str | None) -> torch.Tensor:
    """A 1-D LongTensor of the data's tokens (a text file tokenized as the module docstring
    says)."""
    path = Path(data)
    if not path.is_file():
        raise ValueError(f"data file {data} does not exist")
    if path.suffix == ".bin":
        return load_tokens(path)
    tok, _ = text_tokenizer(tokenizer_source(model_spec, tokenizer))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data file {data} is not UTF-8 text ({e}); pass a token file (.bin) "
                         "or a UTF-8 text file") from None
    return torch.tensor(tok.encode(text).ids, dtype=torch.long)


def data_bos_id(data: str, *, model_spec: str, tokenizer: str | None) -> int:
    """The default BOS of `data` (see the module docstring)."""
    if Path(data).suffix == ".bin":
        return separator_id(data)
    tok, declared = text_tokenizer(tokenizer_source(model_spec, tokenizer))
    bos = tok.token_to_id(DEFAULT_EOS)
    if bos is None:
        bos = declared
    if bos is None:
        raise ValueError(f"the tokenizer has no {DEFAULT_EOS} and declares no BOS token: pass "
                         "--bos-id")
    return bos
