"""The model `echo-tp train` runs, built for its mode, and its checkpoints.

Modes: "plain" (a group of one: the single-device model itself, no communicator, no TP layers;
the sum over one rank is its input exactly, so every comm config gives the same numbers),
"simulated" (P virtual ranks, tp.parallelize) and "ranks" (one rank of P real processes).

Models: ModelConfig shapes (a preset or a .json file, with fields on top; random init from the
seed, the same on every rank, sharded after) or an HF directory of a transformers causal LM
(config.json only: seeded from_config; with *.safetensors: its weights, each TP rank reading its
slices through echo_tp.hf.load_hf_tp). fp32 master weights in every case.

init_from (continued pretraining): a pretrained HF folder (config.json + *.safetensors) or a GGUF
file, read whole on every rank in float32 (GGUF: dequantized by transformers, exact), then sharded.
A Llama or Qwen3 config becomes our own Transformer (ModelConfig.from_hf_config, so the batched
simulated path and compile reach it); any other family stays transformers' model
(hf.parallelize_hf). Checkpoints of such a run carry the source's tokenizer beside the weights.

Checkpoints are whole (gathered from the shards; a collective on real ranks) HF directories in
`dtype` (float32 or bfloat16): save_hf_checkpoint for ModelConfig models, save_pretrained for
transformers models.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from echo_tp.models import (ModelConfig, build_meta_model, init_weights, resolve_model_config,
                            save_hf_checkpoint)
from echo_tp.models.hf import hf_key_map, load_hf_checkpoint
from echo_tp.models.checkpoint import check_shards
from echo_tp.tp import full_state_dict, parallelize, unshard

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model",
                   "generation_config.json")
"""What a pretrained folder's tokenizer is made of (copied into checkpoints when present)."""


def is_hf_dir(spec: str) -> bool:
    """An HF directory (config.json), not a preset name; ValueError for a dir without one."""
    path = Path(spec)
    if not path.is_dir():
        return False
    if not (path / "config.json").is_file():
        raise ValueError(f"{spec} is a directory without config.json: pass a preset name, a .json "
                         "model config or an HF directory (config.json, optionally "
                         "*.safetensors)")
    return True


def model_config(spec: str, fields: tuple[str, ...]) -> ModelConfig | None:
    """The ModelConfig that `--model SPEC --model-field ...` names (None for an HF directory)."""
    if is_hf_dir(spec):
        if fields:
            raise ValueError(f"--model-field changes a preset or a .json model config; {spec} is "
                             "an HF directory: edit its config.json instead")
        return None
    return resolve_model_config(spec, fields)


@dataclass
class Built:
    model: nn.Module
    cfg: ModelConfig | None
    """None for a transformers model."""
    config: dict
    """The model's config as a dict (train_config.json records it)."""
    vocab_size: int
    mode: str
    """"plain", "simulated" or "ranks"."""
    source: str | None = None
    """The pretrained folder or GGUF file the weights came from (init_from), else None."""


def build_model(spec: str, fields: tuple[str, ...], *, seed: int, comm, rank: int | None,
                world_size: int, device: torch.device, policy,
                sequence_parallel: bool = False, sim_path: str = "shards",
                init_from: str | None = None) -> Built:
    """The model in train mode: plain when world_size == 1 (comm unused), else parallelized
    (sequence-parallel if asked; simulated ranks on sim_path, tp.parallelize; other modes
    ignore it). init_from: start from that pretrained folder or GGUF file (spec unused)."""
    mode = "plain" if world_size == 1 else ("simulated" if rank is None else "ranks")
    if init_from is not None:
        return _build_pretrained(init_from, comm, rank, device, policy, mode,
                                 sequence_parallel, sim_path)
    cfg = model_config(spec, fields)
    if cfg is None:
        model, config, vocab = _build_hf(spec, seed, comm, rank, device, policy, mode == "plain",
                                         sequence_parallel)
        return Built(model, None, config, vocab, mode)
    model = init_weights(build_meta_model(cfg).to_empty(device=device), seed=seed).train()
    if mode != "plain":
        parallelize(model, comm, rank, policy=policy, sequence_parallel=sequence_parallel,
                    sim_path=sim_path if mode == "simulated" else "shards")
    return Built(model, cfg, dataclasses.asdict(cfg), cfg.vocab_size, mode)


def check_init_from(path: str) -> None:
    """ValueError unless path is a GGUF file or an HF folder with config.json + *.safetensors."""
    from echo_tp.hf.gguf import check_gguf_file, is_gguf
    if is_gguf(path):
        check_gguf_file(path)
        return
    p = Path(path)
    if not (p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))):
        raise ValueError(f"--init-from {path}: expected a GGUF file (*.gguf) or a pretrained HF "
                         "folder (config.json + *.safetensors)")
    check_shards(p)


def _ours(config: dict) -> ModelConfig | None:
    """Our ModelConfig for a transformers config dict (None: a family we do not write)."""
    try:
        return ModelConfig.from_hf_config(config)
    except ValueError:
        return None


def load_pretrained(path: str, device: torch.device) -> tuple[nn.Module, ModelConfig | None]:
    """The whole pretrained model of a GGUF file or HF folder, float32, train mode, on device:
    our Transformer (with its ModelConfig) for Llama / Qwen3 configs, else transformers' model
    (None)."""
    from echo_tp.hf.gguf import is_gguf, load_gguf_model
    check_init_from(path)
    if not is_gguf(path):
        config = json.loads((Path(path) / "config.json").read_text())
        if _ours(config) is not None:
            model, cfg = load_hf_checkpoint(path, dtype=torch.float32, device=device)
            return model.train(), cfg
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model.to(device).train(), None
    hf = load_gguf_model(path, dtype=torch.float32)
    cfg = _ours(hf.config.to_dict())
    if cfg is None:
        return hf.to(device).train(), None
    theirs = hf.state_dict()
    state = {ours: theirs[key] for key, ours in hf_key_map(cfg).items()}
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = build_meta_model(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.to(device).train(), cfg


def _build_pretrained(path, comm, rank, device, policy, mode, sequence_parallel,
                      sim_path) -> Built:
    model, cfg = load_pretrained(path, device)
    if cfg is None:
        from echo_tp.hf import parallelize_hf
        from echo_tp.hf.plan import text_config
        if mode != "plain":
            parallelize_hf(model, comm, rank, policy=policy, sequence_parallel=sequence_parallel)
        return Built(model, None, model.config.to_dict(), text_config(model).vocab_size, mode,
                     source=path)
    if mode != "plain":
        parallelize(model, comm, rank, policy=policy, sequence_parallel=sequence_parallel,
                    sim_path=sim_path if mode == "simulated" else "shards")
    return Built(model, cfg, dataclasses.asdict(cfg), cfg.vocab_size, mode, source=path)


def save_tokenizer(source: str, path: Path) -> None:
    """The source's tokenizer beside a checkpoint: a GGUF file's (transformers builds it from
    the file's metadata), or an HF folder's tokenizer files copied as they are."""
    from echo_tp.hf.gguf import is_gguf, load_gguf_tokenizer
    if is_gguf(source):
        load_gguf_tokenizer(source).save_pretrained(path)
        return
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, path / name)


def _build_hf(spec, seed, comm, rank, device, policy, plain: bool, sequence_parallel: bool):
    """(transformers model in train mode, its config as a dict, vocab_size)."""
    import transformers

    from echo_tp.hf import load_hf_tp, parallelize_hf
    from echo_tp.hf.plan import text_config
    if any(Path(spec).glob("*.safetensors")):
        if plain:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                spec, dtype=torch.float32).to(device)
        else:
            model = load_hf_tp(spec, comm, rank, dtype=torch.float32, device=device,
                               policy=policy, sequence_parallel=sequence_parallel)
    else:
        config = transformers.AutoConfig.from_pretrained(spec)
        torch.manual_seed(seed)  # the same init on every rank (built whole, then sharded)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(device)
        if not plain:
            parallelize_hf(model, comm, rank, policy=policy,
                           sequence_parallel=sequence_parallel)
    return model.train(), model.config.to_dict(), text_config(model).vocab_size


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor on CPU in dtype; tensors sharing storage (tied weights) stay shared."""
    memo: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = (t.data_ptr(), t.device, tuple(t.shape))
        if key not in memo:
            memo[key] = t.detach().to(device="cpu", dtype=dtype)
        out[name] = memo[key]
    return out


def save_checkpoint(built: Built, path: Path, *, main: bool, dtype: str = "float32") -> None:
    """Whole weights as an HF directory in dtype (call on every rank; the main one writes)."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"save dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    to = SAVE_DTYPES[dtype]
    plain = built.mode == "plain"
    if built.cfg is None:  # a transformers model
        state = _cast(built.model.state_dict() if plain else full_state_dict(built.model), to)
        if main:
            built.model.save_pretrained(path, state_dict=state)
            if built.source is not None:
                save_tokenizer(built.source, path)
        return
    if plain:
        whole = build_meta_model(built.cfg)
        whole.load_state_dict(_cast(built.model.state_dict(), to), strict=True, assign=True)
        whole.tie_weights()
    else:
        whole = unshard(built.model).to(to)  # collective on real ranks
    if main:
        save_hf_checkpoint(whole, built.cfg, path)
        if built.source is not None:
            save_tokenizer(built.source, path)
