"""transformers' `base_model_tp_plan` -> the project's TP plan table (echo_tp.tp.plan).

A transformers config names, per parameter or module path below the base model, a style string:

    "layers.*.self_attn.q_proj": "colwise"     "layers.*.mlp.experts.gate_up_proj": "packed_colwise"
    "layers.*.self_attn.o_proj": "rowwise"     "layers.*.mlp.experts.down_proj": "rowwise"
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"
    "layers.*.self_attn.qkv_proj": "colwise_gather_output"   (Phi-3: packed q|k|v)

`hf_plan` turns it into Colwise / Rowwise / SplitParams / PartialGradReplicate entries with full
module paths, plus one `BlockInput` per block (the decoder-layer child holding a row-parallel
part: attention = slot 0, MLP or MoE = slot 1), so the one TP engine (tp/parallelize.py) shards
transformers' own modules exactly as it shards the project's models.

How each style maps (P ranks; Echo all-reduces only where a partial sum ends):
    colwise                 Colwise: q_proj by query heads, k/v_proj by kv heads, others by rows
    rowwise (nn.Linear)     Rowwise: its output is the block's forward site, bias added after
    rowwise (a parameter)   the experts' down_proj [E, H, I]: split along I (SplitParams)
    packed_colwise          gate_up_proj packed [gate; up]: each half split (Linear or experts)
    colwise_gather_output / colwise_rep, rowwise_split_input / rowwise_rep
                            transformers gathers a packed output (Phi-3 qkv_proj, gate_up_proj)
                            because DTensor cannot split it; here the packed weight is split by
                            sections (q heads | kv heads | kv heads, or gate | up), so no gather
                            is needed and the row-parallel layer takes its input already split
    replicated_with_grad_allreduce
                            PartialGradReplicate (q_norm / k_norm: partial gradients)
    moe_tp_experts          the experts module: its output is the MoE block's partial sum, which
                            is all-reduced once per block (its parameters come from their own
                            entries)
    replicate               nothing to do
Every other replicated parameter inside a block (a MoE router) gets PartialGradReplicate: its
gradient is computed from this rank's partial outputs. Embeddings and lm_head stay whole on every
rank (the CausalLM-level "lm_head": "colwise_gather_output" is not applied), so the vocabulary
need not divide P and no extra collective runs outside the 2L sites.
Any other style (embedding_*, sequence_parallel, mla_kv_a_proj, all_reduce, ...) is refused with
a ValueError naming it.
"""
from __future__ import annotations

import re

from torch import nn

from echo_tp.tp.plan import (BlockInput, Colwise, HeadLayout, PartialGradReplicate, Rowwise,
                             SplitParams, match_plan)

ATTENTION_BLOCKS = ("self_attn", "attn", "attention", "self_attention")
MLP_BLOCKS = ("mlp", "feed_forward", "block_sparse_moe", "moe")
GATHER_COLWISE = ("colwise_gather_output", "colwise_rep")
SPLIT_ROWWISE = ("rowwise_split_input", "rowwise_rep")
REPLICATED = ("replicate", "embedding_rowwise")
"""Plan styles echo-tp keeps whole on every rank: 'embedding_rowwise' (a vocab-parallel
embedding, in some transformers releases' Gemma 3 plan) stays a replicated embedding, as in
the families whose plans leave the embedding out: no all-reduce before the first block."""
SUPPORTED = ("colwise", "rowwise", "packed_colwise", *GATHER_COLWISE, *SPLIT_ROWWISE,
             "replicated_with_grad_allreduce", "moe_tp_experts", *REPLICATED)
HEAD_UNITS = {"q_proj": "q_head", "k_proj": "kv_head", "v_proj": "kv_head", "o_proj": "q_head",
              "qkv_proj": ("q_head", "kv_head", "kv_head")}
PACKED_2 = ("row", "row")


OUTPUT_NORMS = {
    "gemma2": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "gemma3": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "gemma3_text": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
}
"""Families whose decoder layer norms each block's output before the residual add ('post-
norms'): model_type -> the layer's (attention output norm, MLP output norm) attributes."""


def output_norms(model: nn.Module) -> dict[int, nn.Module]:
    """Static forward site (2l: layer l's attention, 2l+1: its MLP) -> the norm module its
    all-reduced output passes before the residual add; {} for pre-norm families."""
    return layer_output_norms(list(model.base_model.layers),
                              getattr(text_config(model), "model_type", None))


def layer_output_norms(layers: list[nn.Module], model_type: str | None) -> dict[int, nn.Module]:
    """output_norms over decoder layer modules in order (transformers' attribute names, which
    vLLM's decoder layers share): site 2l + slot -> layers[l]'s OUTPUT_NORMS[model_type][slot]."""
    names = OUTPUT_NORMS.get(model_type)
    if names is None:
        return {}
    out = {}
    for i, layer in enumerate(layers):
        for slot, attr in enumerate(names):
            norm = getattr(layer, attr, None)
            if norm is None:
                raise ValueError(f"{type(layer).__name__} has no {attr}, which its family's "
                                 "output-norm entry (hf/plan.OUTPUT_NORMS) names")
            out[2 * i + slot] = norm
    return out


def text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass a transformers model")
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def base_plan(model: nn.Module) -> dict[str, str]:
    """The model's `base_model_tp_plan` (keys below the base model), or a ValueError."""
    config = text_config(model)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} ({type(config).__name__}) has no base_model_tp_plan, so "
            "echo-tp cannot tell which layers to shard. Pass plan={'layers.*.self_attn.q_proj': "
            "'colwise', ...} (transformers' style names, keys below the base model) or use a "
            "family whose config has a plan (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, "
            "Qwen3-MoE, Mixtral, ...)")
    return dict(plan)


def head_layout(model: nn.Module) -> HeadLayout:
    config = text_config(model)
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    return HeadLayout(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)


def _compile(pattern: str) -> re.Pattern:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def _first_match(pattern: str, names) -> str | None:
    rx = _compile(pattern)
    return next((n for n in names if rx.match(n)), None)


def _block_of(key: str) -> tuple[str, int]:
    """'model.layers.*.mlp.experts.down_proj' -> ('model.layers.*.mlp', slot 1)."""
    parts = key.split(".")
    if "*" not in parts or parts.index("*") + 1 >= len(parts):
        raise ValueError(f"TP plan key {key!r} is not inside a decoder layer ('layers.*.<block>.'"
                         "...); echo-tp shards decoder blocks only")
    i = parts.index("*") + 1
    block = parts[i]
    if block in ATTENTION_BLOCKS:
        slot = 0
    elif block in MLP_BLOCKS:
        slot = 1
    else:
        raise ValueError(f"TP plan key {key!r}: cannot tell whether block {block!r} is the "
                         f"attention ({ATTENTION_BLOCKS}) or the MLP ({MLP_BLOCKS}) of its layer")
    return ".".join(parts[:i + 1]), slot


def hf_plan(model: nn.Module, plan: dict[str, str] | None = None) -> dict[str, object]:
    """The project's plan table for a transformers causal LM (see the module docstring)."""
    plan = base_plan(model) if plan is None else dict(plan)
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and getattr(model, prefix, None) is None:
        prefix = ""
    full = {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    bad = {k: v for k, v in full.items() if v not in SUPPORTED}
    if bad:
        key, style = next(iter(bad.items()))
        hint = (" (echo-tp runs sequence parallelism for the whole model: parallelize_hf(model, "
                "comm, sequence_parallel=True) with the plain plan)"
                if style == "sequence_parallel" else "")
        raise ValueError(f"{type(model).__name__}: TP style {style!r} (at {key!r}) is not "
                         f"supported by echo-tp{hint}; supported styles: {SUPPORTED}")
    table: dict[str, object] = {}
    split: dict[str, list] = {}  # experts module pattern -> [(param, dim, unit)]
    blocks: dict[str, int] = {}
    gathered = {_block_of(k)[0] for k, v in full.items() if v in GATHER_COLWISE}
    for key, style in full.items():
        if style in REPLICATED:
            continue
        module_name = _first_match(key, modules)
        param_name = None if module_name else _first_match(key, params)
        if module_name is None and param_name is None:
            continue  # e.g. dense-MLP entries of an all-MoE model: nothing to shard
        leaf = key.rsplit(".", 1)[-1]
        if style == "replicated_with_grad_allreduce":
            table[key] = PartialGradReplicate()
            continue
        if style == "moe_tp_experts":
            split.setdefault(key, [])
            blocks.setdefault(*_block_of(key))
            continue
        block, slot = _block_of(key)
        if param_name is not None:  # a bare parameter of fused experts
            owner, pname = key.rsplit(".", 1)
            ndim = params[param_name].dim()
            if style == "packed_colwise":
                split.setdefault(owner, []).append((pname, ndim - 2, PACKED_2))
            elif style == "rowwise":
                split.setdefault(owner, []).append((pname, ndim - 1, "row"))
            else:
                raise ValueError(f"TP style {style!r} on parameter {key!r} is not supported")
            blocks.setdefault(block, slot)
            continue
        if not isinstance(modules[module_name], nn.Linear):
            raise ValueError(f"TP style {style!r} at {key!r}: {type(modules[module_name]).__name__}"
                             " is not an nn.Linear; echo-tp splits linear layers and fused "
                             "expert parameters")
        if style == "colwise":
            table[key] = Colwise(unit=_unit(key, slot))
        elif style == "packed_colwise":
            table[key] = Colwise(unit=PACKED_2)
        elif style in GATHER_COLWISE:
            if leaf == "qkv_proj":
                table[key] = Colwise(unit=HEAD_UNITS[leaf])
            elif leaf == "gate_up_proj":
                table[key] = Colwise(unit=PACKED_2)
            else:
                raise ValueError(f"TP style {style!r} at {key!r}: echo-tp splits a gathered "
                                 "column-parallel output only for packed qkv_proj / gate_up_proj")
        elif style == "rowwise" or style in SPLIT_ROWWISE:
            if style in SPLIT_ROWWISE and block not in gathered:
                raise ValueError(f"TP style {style!r} at {key!r} needs a packed "
                                 "colwise_gather_output layer in the same block")
            table[key] = Rowwise(unit=_unit(key, slot), slot=slot)
            blocks[block] = slot
    for owner, entries in split.items():
        if entries:
            table[owner] = SplitParams(params=tuple(entries))
    for block, slot in blocks.items():
        table[block] = BlockInput(slot=slot, local_heads=slot == 0)
    _partial_replicas(table, modules, blocks)
    return table


def _unit(key: str, slot: int):
    """How an attention projection splits (by heads; its name says which) or an MLP's (rows)."""
    if slot != 0:
        return "row"
    leaf = key.rsplit(".", 1)[-1]
    if leaf not in HEAD_UNITS:
        raise ValueError(f"TP plan key {key!r}: echo-tp cannot tell how attention projection "
                         f"{leaf!r} splits into heads (known: {sorted(HEAD_UNITS)})")
    return HEAD_UNITS[leaf]


def _partial_replicas(table: dict, modules: dict, blocks: dict) -> None:
    """Whole parameters used inside a block (a MoE router): their gradients are partial."""
    for block in blocks:
        rx = _compile(block)
        for name in [n for n in modules if rx.match(n)]:
            for child_name, child in modules[name].named_modules():
                if not child_name or not list(child.parameters(recurse=False)):
                    continue
                if match_plan(table, f"{name}.{child_name}") is None:
                    table[f"{block}.{child_name}"] = PartialGradReplicate()
