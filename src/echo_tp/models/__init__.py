"""Llama-3 / Qwen3 models written for one device, their HF checkpoint adapter and tokenizer tool.

    config.py       ModelConfig (kw_only, validated) + presets + HF config.json mapping;
                    resolve_model_config: a preset or a .json file, plus KEY=VALUE fields
    transformer.py  Transformer (HF module names), KVCache, generate
    hf.py           load_hf_checkpoint / save_hf_checkpoint through an explicit key map;
                    init_weights
    tokenize.py     byte-level BPE from vocab.json + merges.txt; flat .bin token files

Tensor parallelism is applied to these modules from outside (echo_tp.tp), by module path.
"""
from echo_tp.models.config import (PRESETS, ModelConfig, parse_model_fields,
                                   resolve_model_config)
from echo_tp.models.hf import (build_meta_model, hf_key_map, init_weights, load_hf_checkpoint,
                               save_hf_checkpoint)
from echo_tp.models.tokenize import build_tokenizer, load_tokens, tokenize_files, tokenize_main
from echo_tp.models.transformer import KVCache, Transformer

__all__ = [
    "PRESETS", "ModelConfig", "parse_model_fields", "resolve_model_config", "Transformer",
    "KVCache", "build_meta_model", "hf_key_map",
    "init_weights", "load_hf_checkpoint", "save_hf_checkpoint", "build_tokenizer", "load_tokens",
    "tokenize_files", "tokenize_main",
]
