"""The model `echo-tp train` runs, built for its mode, and its checkpoints.

Modes: "plain" (a group of one: the single-device model itself, no communicator, no TP layers;
the sum over one rank is its input exactly, so every comm config gives the same numbers),
"simulated" (P virtual ranks, tp.parallelize) and "ranks" (one rank of P real processes).

Models: ModelConfig shapes (a preset or a .json file, with fields on top; random init from the
seed, the same on every rank, sharded after) or an HF directory of a transformers causal LM
(config.json only: seeded from_config; with *.safetensors: its weights, each TP rank reading its
slices through echo_tp.hf.load_hf_tp). fp32 master weights in every case.

Checkpoints are whole (gathered from the shards; a collective on real ranks) HF directories in
`dtype` (float32 or bfloat16): save_hf_checkpoint for ModelConfig models, save_pretrained for
transformers models.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from echo_tp.models import (ModelConfig, build_meta_model, init_weights, resolve_model_config,
                            save_hf_checkpoint)
from echo_tp.tp import full_state_dict, parallelize, unshard

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def build_model(spec: str, fields: tuple[str, ...], *, seed: int, comm, rank: int | None,
                world_size: int, device: torch.device, policy,
                sequence_parallel: bool = False, sim_path: str = "shards") -> Built:
    """The model in train mode: plain when world_size == 1 (comm unused), else parallelized
    (sequence-parallel if asked; simulated ranks on sim_path, tp.parallelize; other modes
    ignore it)."""
    mode = "plain" if world_size == 1 else ("simulated" if rank is None else "ranks")
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
        return
    if plain:
        whole = build_meta_model(built.cfg)
        whole.load_state_dict(_cast(built.model.state_dict(), to), strict=True, assign=True)
        whole.tie_weights()
    else:
        whole = unshard(built.model).to(to)  # collective on real ranks
    if main:
        save_hf_checkpoint(whole, built.cfg, path)
