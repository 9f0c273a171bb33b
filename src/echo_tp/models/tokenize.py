"""Byte-level BPE tokenizers from vocab.json + merges.txt, and flat token files for training/eval.

`build_tokenizer(dir)` returns a `tokenizers.Tokenizer`. A directory with tokenizer.json is loaded
as is; otherwise the BPE model is built from vocab.json + merges.txt with the pre-tokenizer that
matches the family named in tokenizer_config.json: GPT-2's ByteLevel regex by default, the Qwen2
split regex + NFC for `Qwen2Tokenizer` (the same pipelines transformers' GPT2Tokenizer /
Qwen2Tokenizer build). Special tokens from special_tokens_map.json, added_tokens.json and
tokenizer_config.json keep their ids and are never split. With no directory, the GPT-2 files that
ship in echo_tp/assets/tokenizers/gpt2 are used.

Token files: `X.bin` is a flat little-endian uint16 array (uint32 when the vocabulary exceeds
2^16 ids) of every input document's tokens, with one EOS token between consecutive documents (one
input file = one document, encoded whole). `X.json` beside it records dtype, n_tokens, tokenizer
name, vocab size, EOS id (`eos_id`: the document separator, which train/eval `--bos` read) and
the sources. `main` can hold out whole documents in `X.val.bin` (`choose_val_documents`: a seeded
choice spread over the corpus), or the tail of the stream (`val_split="tail"`, for one document).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

from echo_tp.paths import check_file_target, writing

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizers"
DEFAULT_TOKENIZER = "gpt2"
DEFAULT_EOS = "<|endoftext|>"
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
ENCODE_BATCH = 16  # documents per encode_batch call (parallel inside tokenizers)


def resolve_tokenizer_dir(tokenizer_dir: str | Path | None = None) -> Path:
    """A tokenizer directory: None/"" -> the shipped GPT-2 files; a shipped name ("gpt2") or a
    path."""
    if tokenizer_dir is None or str(tokenizer_dir) == "":
        return ASSETS_DIR / DEFAULT_TOKENIZER
    path = Path(tokenizer_dir)
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return path
    if (ASSETS_DIR / str(tokenizer_dir)).is_dir():
        return ASSETS_DIR / str(tokenizer_dir)
    shipped = sorted(p.name for p in ASSETS_DIR.iterdir() if p.is_dir())
    raise ValueError(f"tokenizer directory {tokenizer_dir!r} does not exist (shipped: {shipped})")


def _read_json(path: Path) -> dict:
    """The JSON object in path ({} when there is no such file); ValueError naming a broken one."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:   # also UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def _token_content(value) -> list[str]:
    """Token strings in a special_tokens_map value: str, {"content": str} or a list of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and "content" in value:
        return [value["content"]]
    if isinstance(value, list):
        return [c for v in value for c in _token_content(v)]
    return []


def _special_tokens(path: Path) -> dict[str, int | None]:
    """Special token -> required id (None: keep its vocab id, or append)."""
    config = _read_json(path / "tokenizer_config.json")
    specials: dict[str, int | None] = {}
    for idx, entry in config.get("added_tokens_decoder", {}).items():
        specials[entry["content"]] = int(idx)
    for content, idx in _read_json(path / "added_tokens.json").items():
        specials[content] = int(idx)
    token_map = _read_json(path / "special_tokens_map.json")
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        for content in _token_content(config.get(key)):
            specials.setdefault(content, None)
    for value in token_map.values():
        for content in _token_content(value):
            specials.setdefault(content, None)
    return specials


def declared_bos_token(tokenizer_dir: str | Path | None = None) -> str | None:
    """The BOS token a tokenizer directory declares (tokenizer_config.json's bos_token, else
    special_tokens_map.json's), or None."""
    path = resolve_tokenizer_dir(tokenizer_dir)
    if path.is_file():  # a GGUF file: the BOS its metadata declares
        from echo_tp.hf.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(path).bos_token
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        found = _token_content(_read_json(path / name).get("bos_token"))
        if found:
            return found[0]
    return None


def build_tokenizer(tokenizer_dir: str | Path | None = None) -> Tokenizer:
    """A byte-level BPE `Tokenizer` from tokenizer_dir (default: the shipped GPT-2 files), or
    the tokenizer of a GGUF file (transformers builds it from the file's metadata)."""
    path = resolve_tokenizer_dir(tokenizer_dir)
    if path.is_file():
        from echo_tp.hf.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(path).backend_tokenizer
    if (path / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ValueError(f"{path / 'tokenizer.json'} is not a tokenizers file "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
                from None
    vocab, merges = path / "vocab.json", path / "merges.txt"
    if not vocab.is_file() or not merges.is_file():
        raise ValueError(f"{path} needs tokenizer.json, or vocab.json + merges.txt")
    try:
        bpe = models.BPE.from_file(str(vocab), str(merges), continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        raise ValueError(f"{vocab} + {merges.name} do not form a BPE tokenizer "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    tok = Tokenizer(bpe)
    family = str(_read_json(path / "tokenizer_config.json").get("tokenizer_class", ""))
    if family.startswith("Qwen2"):
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = _special_tokens(path)
    # Tokens already in vocab.json keep their id; new ones are appended in id order.
    ordered = sorted(specials.items(), key=lambda kv: (kv[1] is None, kv[1] or 0, kv[0]))
    for content, want in ordered:
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        got = tok.token_to_id(content)
        if want is not None and got != want:
            raise ValueError(f"special token {content!r} got id {got}, the config says {want}; "
                             f"{path} is inconsistent")
    return tok


def train_tokenizer(inputs: list[str | Path], vocab_size: int, out_dir: str | Path) -> Path:
    """Train a GPT-2-style byte-level BPE (`tokenizers`' trainer) on inputs (files or folders of
    *.txt) with <|endoftext|> as its only special token; saves out_dir/tokenizer.json."""
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols + EOS, got {vocab_size}")
    files = _expand(list(inputs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[DEFAULT_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(f) for f in files], trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _expand(paths: list[str | Path]) -> list[Path]:
    """Input files in order; a directory stands for its *.txt files, sorted by name."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.txt"))
            if not found:
                raise ValueError(f"directory {p} has no *.txt files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"input {p} does not exist")
    if not files:
        raise ValueError("no input files given")
    return files


def _eos_id(tokenizer: Tokenizer, eos_token: str) -> int:
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"tokenizer has no token {eos_token!r} to separate documents")
    return eos_id


def encode_each(paths: list[str | Path], tokenizer: Tokenizer) -> tuple[list[np.ndarray],
                                                                       list[Path]]:
    """Token ids (int64) of each file, one array per document; and the files read."""
    files = _expand(paths)
    docs: list[np.ndarray] = []
    for start in range(0, len(files), ENCODE_BATCH):
        texts = []
        for f in files[start:start + ENCODE_BATCH]:
            try:
                texts.append(f.read_text(encoding="utf-8"))
            except UnicodeDecodeError as err:
                raise ValueError(f"{f} is not UTF-8 text: {err}") from err
        docs += [np.asarray(enc.ids, dtype=np.int64)
                 for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return docs, files


def join_documents(docs: list[np.ndarray], eos_id: int) -> np.ndarray:
    """One stream: the documents in order, one EOS token between consecutive ones."""
    pieces: list[np.ndarray] = []
    for doc in docs:
        if pieces:
            pieces.append(np.array([eos_id], dtype=np.int64))
        pieces.append(doc)
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)


def encode_documents(paths: list[str | Path], tokenizer: Tokenizer, *,
                     eos_token: str = DEFAULT_EOS) -> tuple[np.ndarray, list[Path]]:
    """Token ids (int64) of every file, EOS between consecutive documents; and the files read."""
    eos_id = _eos_id(tokenizer, eos_token)
    docs, files = encode_each(paths, tokenizer)
    return join_documents(docs, eos_id), files


def choose_val_documents(lengths: list[int], fraction: float, seed: int = 0) -> list[int]:
    """Indices (ascending) of the documents to hold out: about `fraction` of all tokens, whole
    documents spread over the corpus.

    The documents are visited in a seeded random order (numpy default_rng(seed).permutation);
    each is held out if it still fits in the target (fraction * total tokens, separators not
    counted). If no document fits, the smallest is held out. At least one document always stays
    for training (fraction < 1 and each pick fits in the target)."""
    if len(lengths) < 2:
        raise ValueError(f"holding out whole documents needs >= 2 documents (input files), got "
                         f"{len(lengths)}; pass more files, or val_split='tail' "
                         "(--val-split tail) to hold out the stream's tail")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {fraction}")
    target = fraction * sum(lengths)
    chosen, held = [], 0
    for i in np.random.default_rng(seed).permutation(len(lengths)).tolist():
        if held + lengths[i] <= target:
            chosen.append(i)
            held += lengths[i]
    if not chosen:
        chosen = [min(range(len(lengths)), key=lambda i: (lengths[i], i))]
    return sorted(chosen)


def sidecar_path(out_path: str | Path) -> Path:
    """X.bin -> X.json, the metadata file beside a token file."""
    out_path = Path(out_path)
    if out_path.suffix == ".json":
        raise ValueError(f"token file {out_path} must not end in .json (that is the sidecar)")
    return out_path.with_suffix(".json")


def write_tokens(tokens: np.ndarray, out_path: str | Path, *, vocab_size: int, meta: dict) -> dict:
    """Write tokens as a flat .bin and its .json sidecar; return the sidecar dict."""
    out_path = Path(out_path)
    dtype = token_dtype(vocab_size)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}) cannot be stored")
    with writing(out_path):
        out_path.parent.mkdir(parents=True, exist_ok=True)
        with open(out_path, "wb") as f:   # (ndarray.tofile ignores a failed final flush)
            f.write(np.ascontiguousarray(tokens, dtype=dtype.newbyteorder("<")).data)
    info = {"dtype": dtype.name, "byteorder": "little", "n_tokens": int(tokens.size),
            "vocab_size": vocab_size, **meta}
    with writing(sidecar_path(out_path)):
        sidecar_path(out_path).write_text(json.dumps(info, indent=2) + "\n")
    return info


def tokenize_files(paths: list[str | Path], tokenizer: Tokenizer, out_path: str | Path, *,
                   eos_token: str = DEFAULT_EOS, tokenizer_name: str = DEFAULT_TOKENIZER) -> dict:
    """Tokenize files (one document each) into one flat token file; return its metadata."""
    tokens, files = encode_documents(paths, tokenizer, eos_token=eos_token)
    meta = {"tokenizer": tokenizer_name, "eos_id": tokenizer.token_to_id(eos_token),
            "n_documents": len(files), "sources": [f.name for f in files], "split": "all"}
    return write_tokens(tokens, out_path, vocab_size=tokenizer.get_vocab_size(), meta=meta)


def token_file_info(path: str | Path) -> dict:
    """The .json sidecar of a token file ({} when there is none)."""
    return _read_json(sidecar_path(path))


def separator_id(path: str | Path) -> int:
    """The document separator of a token file: the EOS id its sidecar records."""
    eos = token_file_info(path).get("eos_id")
    if not isinstance(eos, int):
        raise ValueError(f"{path}: its sidecar {sidecar_path(path).name} records no eos_id (the "
                         "document separator); write the file with `echo-tp tokenize`, or add "
                         '"eos_id" to the sidecar')
    return eos


def check_token_file(path: str | Path, what: str) -> None:
    """ValueError naming `what` unless path is a token file whose sidecar names its dtype and
    whose size matches the sidecar's n_tokens (what load_tokens reads, checked from the sizes
    alone: before a long run starts)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path} is a directory, not a token file" if path.is_dir()
                         else f"{what} {path}: the token file does not exist")
    try:
        info = _read_json(sidecar_path(path))
    except ValueError as e:
        raise ValueError(f"{what} {path}: its sidecar {sidecar_path(path).name} is not valid "
                         f"JSON ({e})") from None
    dtype = info.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{what} {path}: no sidecar {sidecar_path(path).name} naming the dtype "
                         "(write token files with `echo-tp tokenize`)")
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size % item or ("n_tokens" in info and size // item != info["n_tokens"]):
        raise ValueError(f"{what} {path}: {size} bytes, but its sidecar says "
                         f"{info.get('n_tokens')} {dtype} tokens (a truncated or replaced file)")


def load_tokens(path: str | Path, *, dtype: str | None = None) -> torch.Tensor:
    """A token file as a 1-D LongTensor; dtype comes from the .json sidecar unless given."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"token file {path} does not exist")
    info = _read_json(sidecar_path(path))
    dtype = dtype or info.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{path}: no sidecar {sidecar_path(path).name} naming the dtype; "
                         "pass dtype='uint16' or 'uint32'")
    arr = np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<"))
    if "n_tokens" in info and arr.size != info["n_tokens"]:
        raise ValueError(f"{path} holds {arr.size} tokens, its sidecar says {info['n_tokens']}")
    return torch.from_numpy(arr.astype(np.int64))


def val_path_for(out: str | Path) -> Path:
    """train.bin -> train.val.bin, where `main` writes the held-out split."""
    out = Path(out)
    return out.with_name(f"{out.stem}.val{out.suffix or '.bin'}")


VAL_SPLITS = ("documents", "tail")


def main(inputs: list[str], tokenizer_dir: str | None, out: str, val_fraction: float = 0.0, *,
         val_split: str = "documents", seed: int = 0) -> list[Path]:
    """Tokenize inputs (files or directories of *.txt; one file = one document) into out. With
    val_fraction > 0 a held-out split goes to val_path_for(out): val_split="documents" holds out
    whole documents, about val_fraction of the tokens, chosen by choose_val_documents(seed);
    "tail" the last val_fraction of the token stream. Returns the files written."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_split not in VAL_SPLITS:
        raise ValueError(f"val_split must be one of {VAL_SPLITS}, got {val_split!r}")
    targets = [Path(out)] + ([val_path_for(out)] if val_fraction > 0 else [])
    for dest in targets:                          # before any tokenizing
        check_file_target(dest, "--out")
        check_file_target(sidecar_path(dest), "--out (its .json sidecar)")
    path = resolve_tokenizer_dir(tokenizer_dir)
    tokenizer = build_tokenizer(path)
    eos_id = _eos_id(tokenizer, DEFAULT_EOS)
    docs, files = encode_each(inputs, tokenizer)
    meta = {"tokenizer": path.name, "eos_id": eos_id}
    vocab_size = tokenizer.get_vocab_size()
    names = [f.name for f in files]
    if val_fraction == 0:
        splits = [(Path(out), join_documents(docs, eos_id), names, "all")]
    elif val_split == "documents":
        val = set(choose_val_documents([d.size for d in docs], val_fraction, seed))
        keep = [i for i in range(len(docs)) if i not in val]
        splits = [(Path(out), join_documents([docs[i] for i in keep], eos_id),
                   [names[i] for i in keep], "train"),
                  (val_path_for(out), join_documents([docs[i] for i in sorted(val)], eos_id),
                   [names[i] for i in sorted(val)], "val")]
        meta.update(val_split="documents", split_seed=seed)
    else:
        tokens = join_documents(docs, eos_id)
        n_val = max(1, round(tokens.size * val_fraction))
        if n_val >= tokens.size:
            raise ValueError(f"val_fraction {val_fraction} leaves no training tokens of "
                             f"{tokens.size}")
        splits = [(Path(out), tokens[:tokens.size - n_val], names, "train"),
                  (val_path_for(out), tokens[tokens.size - n_val:], names, "val")]
        meta.update(val_split="tail")
    written = []
    for dest, part, sources, split in splits:
        info = write_tokens(part, dest, vocab_size=vocab_size,
                            meta={**meta, "n_documents": len(sources), "sources": sources,
                                  "split": split})
        print(f"wrote {dest}: {info['n_tokens']:,} tokens, {len(sources)} documents "
              f"({info['dtype']}, {split})")
        written.append(dest)
    return written


tokenize_main = main
