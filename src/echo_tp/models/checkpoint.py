"""What both checkpoint loaders (models/hf.py: the project's Transformer; hf/load.py: transformers'
own models, each rank reading its slices) check before they read a tensor:

    open_shard(file)                 a safetensors handle; a truncated, corrupt or missing file
                                     is a ValueError naming it (safetensors' own errors do not)
    check_shards(path)               every shard of a checkpoint directory opens (headers only:
                                     cheap), so the tools fail before they build anything
    check_shape(key, got, want, ...) a tensor's shape in the file against the shape config.json
                                     implies, checked before any slice is taken: a ValueError
                                     naming the tensor, both shapes and the config field

Why the shape check comes first: a rank reads rows or columns [a, b) of a split tensor, so a
config.json narrower than its weights (intermediate_size 128 over 256-wide tensors) would slice
the wrong weights without any error, and a wider one fails inside safetensors' slicing.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DIM_FIELDS = {
    # the last two parts of a tensor's name -> the config.json field(s) that set each dim
    # (a tuple: their product). The common decoder layouts; other tensors are named by search.
    "embed_tokens.weight": (("vocab_size",), ("hidden_size",)),
    "lm_head.weight": (("vocab_size",), ("hidden_size",)),
    "q_proj.weight": (("num_attention_heads", "head_dim"), ("hidden_size",)),
    "k_proj.weight": (("num_key_value_heads", "head_dim"), ("hidden_size",)),
    "v_proj.weight": (("num_key_value_heads", "head_dim"), ("hidden_size",)),
    "o_proj.weight": (("hidden_size",), ("num_attention_heads", "head_dim")),
    "q_proj.bias": (("num_attention_heads", "head_dim"),),
    "k_proj.bias": (("num_key_value_heads", "head_dim"),),
    "v_proj.bias": (("num_key_value_heads", "head_dim"),),
    "q_norm.weight": (("head_dim",),),
    "k_norm.weight": (("head_dim",),),
    "gate_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "up_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "down_proj.weight": (("hidden_size",), ("intermediate_size",)),
    "gate_up_proj.weight": ((2, "intermediate_size"), ("hidden_size",)),
}


def open_shard(file: Path, **kw):
    """safe_open(file, framework='pt', device='cpu', **kw); ValueError naming the file when it is
    missing, truncated or not a safetensors file (shard_errors)."""
    with shard_errors(file):
        return safe_open(str(file), framework="pt", device="cpu", **kw)


@contextlib.contextmanager
def shard_errors(file: Path):
    """safetensors' and the OS's errors of opening `file` as a ValueError naming it."""
    try:
        yield
    except SafetensorError as e:
        raise ValueError(f"checkpoint file {file} is truncated or corrupt ({e}); save or "
                         "download it again") from None
    except OSError as e:
        raise ValueError(f"checkpoint file {file} cannot be read ({e.strerror or e}); the "
                         "checkpoint is incomplete or the path is wrong") from None


def shard_files(path: Path) -> list[Path]:
    """The *.safetensors files of a checkpoint directory: those its index lists, else
    model.safetensors, else every *.safetensors file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"checkpoint index {index} is not a valid index file ({e!r}); "
                             "save or download it again") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path} "
                         "(PyTorch .bin checkpoints are not read)")
    return files


def check_shards(path: str | Path) -> None:
    """Open every shard of the checkpoint directory (headers only): ValueError naming the first
    one that is missing, truncated or corrupt, and for an unreadable config.json."""
    path = Path(path)
    config = path / "config.json"
    try:
        json.loads(config.read_text())
    except OSError as e:
        raise ValueError(f"{config} cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"{config} is not valid JSON ({e})") from None
    for f in shard_files(path):
        with open_shard(f):
            pass


def check_shape(key: str, got, want, config: dict, file: Path) -> None:
    """ValueError unless the checkpoint's tensor `key` (shape `got`, in `file`) has the shape
    `want` that the model built from `config` (config.json's fields) expects."""
    got, want = tuple(got), tuple(want)
    if got == want:
        return
    if len(got) != len(want):
        what = f"{len(got)} dims in the file, {len(want)} from config.json"
    else:
        what = "; ".join(f"dim {d} is {got[d]} in the file, {want[d]} from config.json's "
                         f"{implied_field(config, key, d, want[d])}"
                         for d in range(len(want)) if got[d] != want[d])
    raise ValueError(f"checkpoint tensor {key} in {file} has shape {got}, but config.json "
                     f"implies {want} ({what}): config.json and the weights disagree; fix the "
                     "config or use the weights it belongs to")


def implied_field(config: dict, key: str, dim: int, size: int) -> str:
    """The config field (or product of fields) that sets dim `dim` of tensor `key` to `size`:
    from DIM_FIELDS where it evaluates to `size`, else the int fields equal to `size`."""
    values = _with_defaults(config)
    dims = DIM_FIELDS.get(".".join(key.split(".")[-2:]))
    if dims is not None and dim < len(dims):
        factors = dims[dim]
        prod = 1
        for f in factors:
            v = f if isinstance(f, int) else values.get(f)
            prod = prod * v if isinstance(v, int) else None
            if prod is None:
                break
        if prod == size:
            names = " * ".join(str(f) for f in factors)
            return names if len(factors) == 1 else names + " = " + " * ".join(
                str(f if isinstance(f, int) else values[f]) for f in factors)
    equal = sorted(k for k, v in values.items() if isinstance(v, int)
                   and not isinstance(v, bool) and v == size)
    return " or ".join(equal) if equal else "fields"


def _with_defaults(config: dict) -> dict:
    """config plus the defaults transformers applies: head_dim, num_key_value_heads."""
    values = dict(config)
    heads = values.get("num_attention_heads")
    if values.get("num_key_value_heads") is None and isinstance(heads, int):
        values["num_key_value_heads"] = heads
    if values.get("head_dim") is None and isinstance(heads, int) and heads > 0 \
            and isinstance(values.get("hidden_size"), int):
        values["head_dim"] = values["hidden_size"] // heads
    return values
