"""HF checkpoint adapter: config.json + *.safetensors <-> `Transformer`, and random init.

Keys go through an explicit map (`hf_key_map`), HF name -> our name. Our module names mirror
transformers', so the map is the identity on names, but it is written out in full: a key the map
does not know is an error, never silently dropped. Models are built on the meta device and the
checkpoint tensors are attached with `load_state_dict(assign=True)`, so no memory is spent on a
throwaway random init.

Tied embeddings: a tied checkpoint has no `lm_head.weight` (if one is present anyway it is
ignored); after loading, `Transformer.tie_weights()` makes lm_head share embed_tokens' Parameter
again, because assign=True replaces Parameters one by one.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from echo_tp.models.checkpoint import SINGLE_FILE, check_shape, open_shard, shard_files
from echo_tp.models.config import ModelConfig
from echo_tp.models.transformer import Transformer

CONFIG_FILE = "config.json"
# Keys some checkpoints carry that hold no weights (old Llama conversions saved RoPE buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_key_map(cfg: ModelConfig) -> dict[str, str]:
    """HF state-dict key -> our state-dict key, for every tensor a checkpoint of cfg holds.

    lm_head is absent when cfg.tie_embeddings (HF does not save it).
    """
    keys = {"model.embed_tokens.weight": "model.embed_tokens.weight",
            "model.norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        keys["lm_head.weight"] = "lm_head.weight"
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        layer.append(f"self_attn.{proj}.weight")
        if cfg.attention_bias:
            layer.append(f"self_attn.{proj}.bias")
    if cfg.qk_norm:
        layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(cfg.n_layers):
        for name in layer:
            keys[f"model.layers.{i}.{name}"] = f"model.layers.{i}.{name}"
    return keys


def build_meta_model(cfg: ModelConfig) -> Transformer:
    """A `Transformer` whose parameters live on the meta device (no storage)."""
    with torch.device("meta"):
        return Transformer(cfg)


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu") -> tuple[Transformer, ModelConfig]:
    """Load an HF Llama/Qwen3 checkpoint directory into a `Transformer` (eval mode).

    path holds config.json and model.safetensors, or shards listed in model.safetensors.index.json.
    Every tensor is cast to dtype and placed on device. A config the Transformer does not
    reproduce (e.g. Llama-3.1+'s 'llama3' RoPE scaling, other families) is a ValueError that
    names the echo_tp.hf.load_hf_tp call which loads it as transformers' own model.
    """
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path} has no {CONFIG_FILE}; expected an HF checkpoint directory")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point dtype, got {dtype}")
    config = json.loads((path / CONFIG_FILE).read_text())
    try:
        cfg = ModelConfig.from_hf_config(config)
    except ValueError as e:
        raise ValueError(f"{path}: {e}. {_load_hf_tp_call(path, dtype)}") from None
    key_map = hf_key_map(cfg)
    model = build_meta_model(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in shard_files(path):
        unexpected += _read_file(file, key_map, cfg, state, device, dtype, shapes, config)
    missing = sorted(set(key_map.values()) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config: missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {sorted(unexpected)[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}")
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval(), cfg


def _load_hf_tp_call(path: Path, dtype: torch.dtype) -> str:
    """What to run instead on a config the project's Transformer does not reproduce: the exact
    call that loads it as transformers' own model (echo_tp.hf, unsharded with one virtual
    rank; families with a TP plan: docs/usage/models.md)."""
    return ("transformers' own model of it loads through echo_tp.hf, whole: "
            f"`echo_tp.hf.load_hf_tp({str(path)!r}, echo_tp.SimulatedCommunicator(1, "
            f"echo_tp.EchoConfig(bits=16)), dtype={dtype})` (after `import echo_tp, "
            "echo_tp.hf, torch`; sharded: SimulatedCommunicator(P, echo_config) for P virtual "
            "ranks, or EchoCommunicator.from_group(None, echo_config), rank on a real rank)")


def _read_file(file: Path, key_map: dict, cfg: ModelConfig, state: dict, device, dtype,
               shapes: dict, config: dict) -> list[str]:
    """The mapped tensors of one safetensors file into state, each shape checked against the
    model's (config.json's) before it is read; returns the file's unexpected keys."""
    unexpected = []
    with open_shard(file) as f:
        for key in f.keys():
            if key in key_map:
                check_shape(key, f.get_slice(key).get_shape(), shapes[key_map[key]], config,
                            file)
                state[key_map[key]] = f.get_tensor(key).to(device=device, dtype=dtype)
            elif key == "lm_head.weight" and cfg.tie_embeddings:
                continue  # tied: the embedding is the head
            elif not key.endswith(IGNORED_SUFFIXES):
                unexpected.append(key)
    return unexpected


def save_hf_checkpoint(model: Transformer, cfg: ModelConfig, path: str | Path) -> None:
    """Write config.json + model.safetensors (HF key names) that AutoModelForCausalLM loads.

    Tensors are saved in their current dtype; the model must be whole (not TP-sharded).
    """
    path = Path(path)
    ours = model.state_dict()
    expected = build_meta_model(cfg).state_dict()
    for name, ref in expected.items():
        if name not in ours or tuple(ours[name].shape) != tuple(ref.shape):
            got = tuple(ours[name].shape) if name in ours else None
            raise ValueError(
                f"model does not match cfg at {name}: expected shape {tuple(ref.shape)}, got "
                f"{got}; save the unsharded model with its own config")
    tensors = {hf: ours[name].detach().to("cpu").contiguous()
               for hf, name in hf_key_map(cfg).items()}
    dtypes = {t.dtype for t in tensors.values()}
    hf_config = cfg.to_hf_config()
    if len(dtypes) == 1:
        hf_config["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


@torch.no_grad()
def init_weights(model: Transformer, seed: int, *, std: float = 0.02) -> Transformer:
    """Random init in place: Linear/Embedding weights ~ N(0, std), biases 0, norm weights 1.

    The model must be materialized: build on meta, `model.to_empty(device=...)`, then call this.
    The lm_head/embed_tokens tie (which to_empty breaks) is restored first, so a tied weight is
    drawn once. Deterministic for a given seed and device.
    """
    if not math.isfinite(std) or std <= 0:
        raise ValueError(f"std must be a positive finite float, got {std!r}")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("init_weights needs real storage: call model.to_empty(device=...) first")
    model.tie_weights()
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():  # tied weights appear once
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gens[p.device])
    return model
