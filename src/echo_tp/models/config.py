"""Shape of a Llama-3 / Qwen3 decoder: `ModelConfig`, named presets and the HF config mapping.

One dataclass covers both families; they differ only in `qk_norm` (Qwen3 normalizes each query and
key head with its own RMSNorm before RoPE) and in their preset numbers. `from_hf_config` reads a
transformers `config.json` dict (4.x `rope_theta` or 5.x `rope_parameters`), `to_hf_config` writes
one that `AutoModelForCausalLM` loads as `LlamaForCausalLM` or `Qwen3ForCausalLM`.

`resolve_model_config(spec, fields)` is what the tools take as `--model`: a preset name or a JSON
file (ModelConfig fields, optionally on top of a `"preset"`; or a transformers config.json dict),
then `KEY=VALUE` field overrides (`--model-field n_layers=24 dim=512`), so a custom shape needs
no code.

Tiny presets ("tiny-llama", "tiny-qwen3") have 8 query heads and 4 key/value heads so that the
q/k/v column split and the o_proj row split divide evenly at TP=2 and TP=4 (one kv head per rank at
TP=4); their q width (8 * 16 = 128) differs from dim (64) on purpose, as in Qwen3-0.6B, so a code
path that confuses the two fails in the tests.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCH_LLAMA = "LlamaForCausalLM"
ARCH_QWEN3 = "Qwen3ForCausalLM"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of one decoder-only transformer (Llama-3 when qk_norm=False, Qwen3 when True)."""

    vocab_size: int
    """Rows of the embedding table and of lm_head (HF `vocab_size`)."""
    dim: int
    """Residual stream width (HF `hidden_size`)."""
    n_layers: int
    """Decoder layers (HF `num_hidden_layers`)."""
    n_heads: int
    """Query heads (HF `num_attention_heads`)."""
    n_kv_heads: int
    """Key/value heads, grouped-query attention; must divide n_heads (HF `num_key_value_heads`)."""
    head_dim: int
    """Width of one head; n_heads * head_dim may differ from dim (Qwen3). Even, for RoPE."""
    intermediate_size: int
    """Hidden width of the SwiGLU MLP (gate_proj/up_proj outputs)."""
    rope_theta: float = 10000.0
    """RoPE base wavelength (plain RoPE, no scaling)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (HF `rms_norm_eps`)."""
    max_seq_len: int = 4096
    """Longest context the model is meant for (HF `max_position_embeddings`); the forward pass
    itself does not cap positions, generation and KV caches are sized by their callers."""
    tie_embeddings: bool = False
    """lm_head shares its weight with embed_tokens (HF `tie_word_embeddings`)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3); selects the HF architecture."""
    attention_bias: bool = False
    """Bias on q/k/v/o projections (HF `attention_bias`); a row-parallel o_proj must add its bias
    once, after the all-reduce."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) "
                "for grouped-query attention")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        for name in ("tie_embeddings", "qk_norm", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def architecture(self) -> str:
        """HF architecture name: Qwen3ForCausalLM when qk_norm, else LlamaForCausalLM."""
        return ARCH_QWEN3 if self.qk_norm else ARCH_LLAMA

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A named preset; see `PRESETS` for the names."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> ModelConfig:
        """From a dict of field values; an optional "preset" key names the base they change."""
        fields = dict(fields)
        base = fields.pop("preset", None)
        unknown = sorted(set(fields) - set(FIELD_TYPES))
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; the fields are "
                             f"{sorted(FIELD_TYPES)} (and 'preset')")
        if base is not None:
            return cls.from_name(base).replace(**fields)
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in fields)
        if missing:
            raise ValueError(f"model config lacks the fields {missing}: give them, or a "
                             f"\"preset\" to start from (one of {sorted(PRESETS)})")
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """A JSON file of ModelConfig fields (see from_fields), or a transformers config.json
        (it has "model_type"; see from_hf_config)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"model config file {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model config file {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"model config file {path} must hold a JSON object")
        return cls.from_hf_config(data) if "model_type" in data else cls.from_fields(data)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a transformers config.json dict of a Llama or Qwen3 causal LM."""
        model_type = hf.get("model_type")
        if model_type not in ("llama", "qwen3"):
            raise ValueError(
                f"unsupported model_type {model_type!r}: only 'llama' and 'qwen3' are mapped")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {hf.get('hidden_act')!r}")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported (Llama/Qwen3 MLPs have no bias)")
        if hf.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported (full attention only)")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"rope_type {rope_type!r} is not supported: only plain RoPE (e.g. Llama-3-8B, "
                "Qwen3); Llama-3.1+ 'llama3' frequency scaling is not implemented")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(theta),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_seq_len=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(hf.get("attention_bias", False)),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers loads as this architecture.

        RoPE is written both as 5.x `rope_parameters` and as 4.x `rope_theta`.
        """
        return {
            "architectures": [self.architecture],
            "model_type": "qwen3" if self.qk_norm else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "use_cache": True,
        }

    def num_params(self) -> int:
        """Parameter count, counting a tied embedding once."""
        d, hd = self.dim, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d
        if self.attention_bias:
            attn += q + 2 * kv + d
        if self.qk_norm:
            attn += 2 * hd
        layer = attn + 3 * d * self.intermediate_size + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + embed + d


FIELD_TYPES: dict[str, type] = {"vocab_size": int, "dim": int, "n_layers": int, "n_heads": int,
                               "n_kv_heads": int, "head_dim": int, "intermediate_size": int,
                               "rope_theta": float, "norm_eps": float, "max_seq_len": int,
                               "tie_embeddings": bool, "qk_norm": bool, "attention_bias": bool}
"""Every ModelConfig field and the type a KEY=VALUE string is read as."""


def parse_model_fields(items: Sequence[str]) -> dict[str, Any]:
    """["n_layers=24", "qk_norm=true", ...] -> {"n_layers": 24, "qk_norm": True, ...}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key or not text:
            raise ValueError(f"model field {item!r} is not KEY=VALUE (e.g. n_layers=24)")
        if key not in FIELD_TYPES:
            raise ValueError(f"unknown model field {key!r}; the fields are {sorted(FIELD_TYPES)}")
        kind = FIELD_TYPES[key]
        try:
            if kind is bool:
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = text.lower() in ("true", "1")
            else:
                out[key] = kind(text)
        except ValueError:
            raise ValueError(f"model field {key}={text!r}: expected {kind.__name__}") from None
    return out


def resolve_model_config(spec: str, fields: Sequence[str] | Mapping[str, Any] = ()
                         ) -> ModelConfig:
    """What `--model SPEC --model-field K=V ...` names: a preset name or a .json file
    (ModelConfig.from_json), with the fields (KEY=VALUE strings or a dict) changed on top."""
    if spec.endswith(".json") or Path(spec).is_file():
        cfg = ModelConfig.from_json(spec)
    elif spec in PRESETS:
        cfg = ModelConfig.from_name(spec)
    else:
        raise ValueError(f"unknown model {spec!r}: pass a preset ({sorted(PRESETS)}) or a .json "
                         "file of ModelConfig fields")
    changes = dict(fields) if isinstance(fields, Mapping) else parse_model_fields(fields)
    return cfg.replace(**changes) if changes else cfg


_TINY = dict(vocab_size=256, dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=16,
             intermediate_size=128, norm_eps=1e-6, max_seq_len=256)

PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B: 8.03B parameters, untied.
    "llama-3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                       head_dim=128, intermediate_size=14336, rope_theta=500000.0, norm_eps=1e-5,
                       max_seq_len=8192),
    # Qwen/Qwen3-8B: 8.19B parameters, untied, q/k norm.
    "qwen3-8b": dict(vocab_size=151936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                     head_dim=128, intermediate_size=12288, rope_theta=1000000.0, norm_eps=1e-6,
                     max_seq_len=40960, qk_norm=True),
    # Qwen/Qwen3-0.6B: 0.60B parameters with the tied embedding counted once.
    "qwen3-0.6b": dict(vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       head_dim=128, intermediate_size=3072, rope_theta=1000000.0, norm_eps=1e-6,
                       max_seq_len=40960, tie_embeddings=True, qk_norm=True),
    # A Qwen3-style model for training runs on the GPT-2 vocabulary: ~114M parameters (tied).
    "qwen3-150m": dict(vocab_size=50257, dim=768, n_layers=12, n_heads=12, n_kv_heads=4,
                       head_dim=64, intermediate_size=2048, rope_theta=1000000.0, norm_eps=1e-6,
                       max_seq_len=2048, tie_embeddings=True, qk_norm=True),
    # The training study's model on the 8k Gutenberg tokenizer: ~107M parameters (tied).
    "qwen3-100m-8k": dict(vocab_size=8192, dim=768, n_layers=16, n_heads=12, n_kv_heads=4,
                          head_dim=64, intermediate_size=2048, rope_theta=1000000.0,
                          norm_eps=1e-6, max_seq_len=2048, tie_embeddings=True, qk_norm=True),
    # The demo's shipped model: ~6.8M parameters on the 8k Gutenberg tokenizer (13.7 MB in bf16).
    "qwen3-demo-8k": dict(vocab_size=8192, dim=256, n_layers=6, n_heads=8, n_kv_heads=4,
                          head_dim=32, intermediate_size=768, rope_theta=1000000.0,
                          norm_eps=1e-6, max_seq_len=1024, tie_embeddings=True, qk_norm=True),
    # Test shapes (see the module docstring for why 8 heads / 4 kv heads).
    "tiny-llama": dict(_TINY, rope_theta=500000.0),
    "tiny-qwen3": dict(_TINY, rope_theta=1000000.0, qk_norm=True, tie_embeddings=True),
}
