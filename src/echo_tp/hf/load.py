"""Memory-lean loading: each rank reads only its own shards of an HF checkpoint directory.

    model = load_hf_tp(path, EchoCommunicator.from_group(None, cfg), rank)   # a real rank
    model = load_hf_tp(path, SimulatedCommunicator(4, cfg))                   # P virtual ranks
    model = load_hf_tp("model.gguf", comm[, rank])        # a GGUF file: hf/gguf.py, then the same

The model is built on the meta device from config.json (transformers' AutoModelForCausalLM
.from_config: no storage), parallelized there by parallelize_hf (only shapes change), and then
every parameter is read from the *.safetensors files: a split one as the rows / columns its rank
keeps (the index list of tp.shards as contiguous runs, each one `get_slice(key)[..., a:b]`, so
the rest of the tensor is never read), a whole one entirely. Tied parameters are read once and
stay tied. Non-persistent buffers (RoPE inv_freq, Gemma's embed scale) are recomputed by the
model's own `_init_weights`, which skips every loaded parameter (`_is_hf_initialized`).

Peak memory per real rank: its shards plus the replicated embedding, norms and lm_head, instead
of the whole model that from_pretrained would materialize before sharding (benchmarks/
hf_load_memory.py measures both: docs/results/2026-12-01-hf-load-memory.md; reads go through
safetensors' pread backend, see _open). Checkpoints whose keys
are the model's parameter names load (what transformers' save_pretrained writes for the dense
families); a key the model needs but the files lack is a ValueError (for checkpoints stored in an
older layout, e.g. per-expert MoE weights, load with from_pretrained and call parallelize_hf), and
so is a tensor whose shape in the file differs from the one config.json implies, checked before
any slice of it is read (models/checkpoint.py; a truncated or corrupt shard is named too).

A GGUF file (a path ending in .gguf) is read whole by transformers' GGUF loader instead
(hf/gguf.py: dequantized into `dtype` on the CPU), then sharded by parallelize_hf and moved to
`device`: every rank holds the whole model once while loading; gguf_to_hf writes a folder that
loads the lean way.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from echo_tp.models.checkpoint import INDEX_FILE, check_shape, shard_errors, shard_files

from .gguf import is_gguf, load_gguf_model
from .parallelize import parallelize_hf
from .plan import text_config


def load_hf_tp(path: str | Path, comm, rank: int | None = None, *,
               dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               policy=None, sequence_parallel: bool = False) -> nn.Module:
    """An Echo-TP transformers causal LM whose rank (or virtual ranks) read only their shards
    (sequence_parallel: as parallelize_hf's); a .gguf file: read whole, then sharded."""
    if is_gguf(path):
        model = load_gguf_model(path, dtype=dtype)
        parallelize_hf(model, comm, rank, policy=policy, sequence_parallel=sequence_parallel)
        return model.to(device).eval()
    import transformers
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; expected an HF checkpoint directory "
                         "or a .gguf file")
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    parallelize_hf(model, comm, rank, policy=policy, sequence_parallel=sequence_parallel)
    files = _key_files(path)
    _check_layer_count(model, files)
    real = _real_names(model)
    fields = text_config(model).to_dict()
    loaded: dict[int, nn.Parameter] = {}  # id(meta parameter) -> loaded (ties stay ties)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(_open(f)) for f in sorted(set(files.values()))}
        for name, param in list(model.named_parameters(remove_duplicate=False)):
            new = loaded.get(id(param))
            if new is None:
                r, key = real[name]
                if key not in files:
                    raise ValueError(f"checkpoint {path} has no tensor {key!r} that "
                                     f"{type(model).__name__} needs; load it with "
                                     "from_pretrained and call parallelize_hf instead")
                shard = model.echo_tp.shards.get(key)
                handle = handles[files[key]]
                whole = list(param.shape)        # the unsplit shape config.json implies
                if shard is not None:
                    whole[shard[0]] = shard[2]
                check_shape(key, handle.get_slice(key).get_shape(), whole, fields, files[key])
                value = _read(handle, key, shard, r)
                new = nn.Parameter(value.to(device=device, dtype=param.dtype),
                                   requires_grad=param.requires_grad)
                new._is_hf_initialized = True
                loaded[id(param)] = new
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, new)
    _init_buffers(model, device)
    return model.eval()


def _open(f: Path):
    """A safetensors handle that reads with pread(2) where safetensors has it (>= 0.8).

    Why not the default mmap: a column slice (o_proj / down_proj keep a range of input
    features: every row's [a, b)) touches every page of the whole tensor through the mapping,
    and the kernel maps neighbouring pages too, so each rank's resident memory held most of
    every row-parallel weight (docs/results/2026-12-01-hf-load-memory.md has both peaks).
    pread copies only the requested bytes into the rank's tensor."""
    with shard_errors(f):
        try:
            return safe_open(str(f), framework="pt", device="cpu", backend="pread")
        except TypeError:  # safetensors < 0.8: no backend argument
            return safe_open(str(f), framework="pt", device="cpu")


def _key_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the file holding it."""
    if (path / INDEX_FILE).is_file():
        shard_files(path)                                     # a readable index
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    out = {}
    for f in shard_files(path):
        with shard_errors(f), safe_open(str(f), framework="pt", device="cpu") as h:
            out.update({k: f for k in h.keys()})
    return out


def _check_layer_count(model: nn.Module, files: dict[str, Path]) -> None:
    """ValueError when the checkpoint holds decoder layers past config.json's count (they
    would be left out silently: every tensor the model has is found, the extra ones unread)."""
    prefix = f"{model.base_model_prefix}.layers."
    n = len(model.base_model.layers)
    extra = sorted({int(k[len(prefix):].split(".")[0]) for k in files
                    if k.startswith(prefix) and k[len(prefix):].split(".")[0].isdigit()}
                   - set(range(n)))
    if extra:
        raise ValueError(f"the checkpoint holds {len(extra)} decoder layer(s) past "
                         f"config.json's num_hidden_layers = {n} (the first: {prefix}"
                         f"{extra[0]}): config.json and the weights disagree; fix the config or "
                         "use the weights it belongs to")


def _real_names(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Model parameter name -> (the rank whose slice it holds, the checkpoint key)."""
    tp = model.echo_tp
    sim = {s: (r, real) for (r, real), s in tp.sim_names.items()}
    own = 0 if tp.simulated else tp.rank
    return {n: sim.get(n, (own, n)) for n, _ in model.named_parameters(remove_duplicate=False)}


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 6), (9, 11)]: contiguous half-open ranges."""
    idx = idx.tolist()
    runs, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            runs.append((start, a + 1))
            start = b
    return runs


def _read(handle, key: str, shard, rank: int) -> torch.Tensor:
    if shard is None:
        return handle.get_tensor(key)
    dim, idx, _ = shard
    sl = handle.get_slice(key)
    lead = (slice(None),) * dim
    return torch.cat([sl[lead + (slice(a, b),)] for a, b in _runs(idx[rank])], dim=dim)


@torch.no_grad()
def _init_buffers(model: nn.Module, device) -> None:
    """Meta buffers -> real ones, filled by the model's own init (loaded weights untouched)."""
    for module in model.modules():
        metas = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not metas:
            continue
        for n in metas:
            module._buffers[n] = torch.empty_like(module._buffers[n], device=device)
        model._init_weights(module)
