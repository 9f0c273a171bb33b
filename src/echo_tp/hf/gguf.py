"""GGUF checkpoints (llama.cpp's one-file format) through transformers' own GGUF support.

    model = load_hf_tp("model.gguf", comm[, rank])     # hf/load.py sends a .gguf path here
    model = load_gguf_model("model.gguf", dtype=torch.bfloat16)   # unsharded, dense
    tokenizer = load_gguf_tokenizer("model.gguf")      # from the file's tokenizer.ggml.* keys
    gguf_to_hf("model.gguf", "out_dir")                # a plain HF folder for the dir loaders

transformers does the reading (from_pretrained(..., gguf_file=...)): it maps llama.cpp's metadata
to a config (architectures 'llama', 'gemma3', 'qwen2', 'mistral', ...), dequantizes every tensor
(Q4_1, Q4_K, Q8_0, ...) into the requested dtype and undoes llama.cpp's renaming and row
permutations. The model returned is an ordinary dense one: its GGUF quantizer is dropped (the
weights are plain tensors already), so parallelize_hf, save_hf and save_pretrained treat it like
any other.

Memory: from_pretrained builds the whole dequantized model, on every rank, before it is
sharded. A directory is read slice by slice instead (load.py), so for many ranks or a large
model convert once (gguf_to_hf, or studies/fetch_models.py --hf) and load the folder.
Dequantized values are exact in float32 (a block scale times a small integer); bfloat16 rounds
them, which is why gguf_to_hf writes float32 unless told otherwise.

Needs the gguf extra (transformers, gguf, accelerate): pip install "echo-tp[gguf]".
"""
from __future__ import annotations

import functools
import importlib
from pathlib import Path

import torch
from torch import nn

EXTRA = 'pip install "echo-tp[gguf]"'
MAGIC = b"GGUF"
_NEEDS = ("transformers", "gguf", "accelerate")  # what transformers' GGUF loader imports


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; check_gguf_file reads it)."""
    return str(path).lower().endswith(".gguf")


def check_gguf_file(path: str | Path) -> Path:
    """The path of a readable GGUF file (its first bytes are the magic 'GGUF'), else ValueError."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist (studies/fetch_models.py fetches two "
                         "small ones into .work/models)")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r}); "
                         "a truncated download or a partial join? fetch it again")
    return path


def require_gguf_support():
    """transformers, after checking that its GGUF loader's dependencies import; ImportError
    naming the extra otherwise."""
    missing = []
    for name in _NEEDS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ImportError(f"loading a GGUF checkpoint needs {', '.join(missing)} (transformers "
                          f"reads the file with gguf and accelerate): {EXTRA}")
    return importlib.import_module("transformers")


def load_gguf_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' causal LM of a GGUF file on the CPU, dequantized into `dtype`, in eval
    mode, with no quantizer attached (see the module docstring)."""
    transformers = require_gguf_support()
    path = check_gguf_file(path).resolve()
    kwargs = {}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:  # newer transformers can keep GGUF blocks; ask for dense weights
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    # gguf_file absolute: transformers takes a relative name from the working directory first
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=str(path), dtype=dtype, **kwargs)
    model.hf_quantizer = None          # dense already: a quantizer would refuse save_pretrained
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval()


def load_gguf_tokenizer(path: str | Path):
    """transformers' tokenizer of a GGUF file (its backend_tokenizer is a tokenizers.Tokenizer;
    bos_token_id as the file declares it). Built once per file and process: a large vocabulary
    (Gemma 3's 262k tokens) takes seconds to turn into merges."""
    path = check_gguf_file(path).resolve()
    stat = path.stat()
    return _tokenizer(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, size: int, mtime_ns: int):
    """(size, mtime_ns: a rewritten file is read again)."""
    transformers = require_gguf_support()
    return transformers.AutoTokenizer.from_pretrained(Path(path).parent, gguf_file=path)


def gguf_to_hf(path: str | Path, out_dir: str | Path, *,
               dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file as a plain HF checkpoint folder (config.json, generation_config.json,
    model.safetensors, tokenizer.json + tokenizer_config.json) that load_hf_tp, `echo-tp eval`
    and from_pretrained read as a directory; returns out_dir."""
    model = load_gguf_model(path, dtype=dtype)
    tokenizer = load_gguf_tokenizer(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
