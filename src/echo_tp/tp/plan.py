"""The tensor-parallel plan: a table of module path patterns -> how the module is split.

    TP_PLAN["model.layers.*.self_attn.q_proj"] = Colwise(unit="q_head")

Patterns name modules of `echo_tp.models.Transformer` by path; `*` matches one path component.
Modules the table does not name (embed_tokens, every RMSNorm but q/k norm, model.norm, lm_head)
stay whole and identical on every rank, so the vocabulary need not divide P.

Styles:
    Colwise(unit)   output rows split (q/k/v, gate/up); unit 'q_head' / 'kv_head' / 'row', or a
                    tuple of them for a packed weight (Phi-3 qkv_proj: ('q_head', 'kv_head',
                    'kv_head'); gate_up_proj: ('row', 'row')): each section split on its own
    Rowwise(unit, slot)
                    input columns split (o_proj, down_proj); the partial output is summed by the
                    block's FORWARD site 2*layer + slot (Megatron's "g"), the bias added after it
    BlockInput(slot, local_heads)
                    the block's input is copied to the TP region: identity forward, all-reduce of
                    the input gradient backward: BACKWARD site 2*layer + slot (Megatron's "f").
                    local_heads: an attention module that keeps head counts in attributes
                    (transformers' num_key_value_groups, ...): they are set to this rank's
    SplitParams(params)
                    a module whose own parameters are split, ((name, dim, unit), ...): fused MoE
                    experts (gate_up_proj [E, 2I, H] along dim 1, down_proj [E, H, I] along dim 2).
                    Its output is a partial sum: the enclosing block's output is all-reduced once
                    (one forward site per MoE block, however many experts)
    PartialGradReplicate()
                    a replicated weight used on this rank's heads only (Qwen3 q_norm / k_norm):
                    its gradient is a partial sum over the group (tp.sync_partial_grads)

Key/value heads: with n_kv_heads >= P they are split like query heads (n_kv_heads % P == 0);
with n_kv_heads < P (P % n_kv_heads == 0) each rank keeps the one kv head its query heads read,
so ranks P/n_kv_heads apart hold copies whose gradients are partial sums over those ranks.
The head maths reads only `n_heads`, `n_kv_heads` and `head_dim` of its layout argument: a
`ModelConfig`, or a `HeadLayout` for models built elsewhere (echo_tp.hf).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from echo_tp.models.config import ModelConfig

SITES_PER_LAYER = 2
"""Each decoder layer has one site per block: slot 0 = attention, slot 1 = MLP."""


@dataclass(frozen=True)
class HeadLayout:
    """The attention shape the shard maths needs (ModelConfig has the same three fields)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Colwise:
    """Column-parallel linear: rank r keeps the output rows (and bias) of its units."""

    unit: str | tuple[str, ...] = "row"


@dataclass(frozen=True)
class Rowwise:
    """Row-parallel linear: rank r keeps the input columns of its units; output all-reduced."""

    unit: str = "row"
    slot: int = 0


@dataclass(frozen=True)
class BlockInput:
    """The f site at a block's input (gradient all-reduce in backward)."""

    slot: int = 0
    local_heads: bool = False


@dataclass(frozen=True)
class SplitParams:
    """A module's own parameters split along a dim each: ((param name, dim, unit), ...)."""

    params: tuple[tuple[str, int, str | tuple[str, ...]], ...]


@dataclass(frozen=True)
class PartialGradReplicate:
    """Whole on every rank, but each rank's gradient covers its own heads only."""


TP_PLAN: dict[str, object] = {
    "model.layers.*.self_attn": BlockInput(slot=0),
    "model.layers.*.self_attn.q_proj": Colwise(unit="q_head"),
    "model.layers.*.self_attn.k_proj": Colwise(unit="kv_head"),
    "model.layers.*.self_attn.v_proj": Colwise(unit="kv_head"),
    "model.layers.*.self_attn.o_proj": Rowwise(unit="q_head", slot=0),
    "model.layers.*.self_attn.q_norm": PartialGradReplicate(),
    "model.layers.*.self_attn.k_norm": PartialGradReplicate(),
    "model.layers.*.mlp": BlockInput(slot=1),
    "model.layers.*.mlp.gate_proj": Colwise(unit="row"),
    "model.layers.*.mlp.up_proj": Colwise(unit="row"),
    "model.layers.*.mlp.down_proj": Rowwise(unit="row", slot=1),
}


def _compile(pattern: str) -> re.Pattern:
    parts = [r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def match_plan(plan: dict[str, object], name: str):
    """The style of module `name` in plan (None when the table does not name it)."""
    for pattern, style in plan.items():
        if _compile(pattern).match(name):
            return style
    return None


def layer_index(name: str) -> int:
    """The decoder layer a module path lies in: the first integer path component."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    raise ValueError(f"module {name!r} has no layer index; TP sites live inside decoder layers")


def site_index(name: str, slot: int) -> int:
    """Static site number of a block: 2*layer + slot (attention 2l, MLP 2l+1)."""
    return SITES_PER_LAYER * layer_index(name) + slot


def q_heads(cfg: ModelConfig, world_size: int, rank: int) -> list[int]:
    """The query heads rank keeps: a contiguous n_heads/P block."""
    if cfg.n_heads % world_size:
        raise ValueError(f"n_heads={cfg.n_heads} does not split over TP={world_size}: "
                         "choose a TP size that divides the number of attention heads")
    per = cfg.n_heads // world_size
    return list(range(rank * per, (rank + 1) * per))


def kv_heads(cfg: ModelConfig, world_size: int, rank: int) -> list[int]:
    """The key/value heads rank keeps: its n_kv_heads/P block, or (n_kv_heads < P) the one kv
    head its query heads are grouped on (replicated over P/n_kv_heads ranks)."""
    hq, hkv = cfg.n_heads, cfg.n_kv_heads
    if hkv % world_size == 0:
        per = hkv // world_size
        return list(range(rank * per, (rank + 1) * per))
    if world_size % hkv == 0:
        first_q = q_heads(cfg, world_size, rank)[0]
        return [first_q // (hq // hkv)]
    raise ValueError(f"n_kv_heads={hkv} neither divides nor is divided by TP={world_size}; "
                     "pick a TP size that divides it or that it divides")


def unit_rows(cfg: ModelConfig, unit, full: int, world_size: int, rank: int) -> torch.Tensor:
    """Indices (along the split dim, of size `full`) that rank keeps for a unit kind, or for a
    packed tuple of kinds (sections in order; head sections are n_heads / n_kv_heads heads wide,
    'row' sections share what is left equally)."""
    if isinstance(unit, tuple):
        sizes = _section_sizes(cfg, unit, full)
        parts, offset = [], 0
        for kind, size in zip(unit, sizes):
            parts.append(offset + unit_rows(cfg, kind, size, world_size, rank))
            offset += size
        return torch.cat(parts)
    if unit == "q_head":
        heads = q_heads(cfg, world_size, rank)
    elif unit == "kv_head":
        heads = kv_heads(cfg, world_size, rank)
    elif unit == "row":
        if full % world_size:
            raise ValueError(f"a dimension of {full} does not split over TP={world_size}: "
                             "choose a TP size that divides intermediate_size")
        per = full // world_size
        return torch.arange(rank * per, (rank + 1) * per)
    else:
        raise ValueError(f"unknown shard unit {unit!r}")
    hd = cfg.head_dim
    return torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads])


def _section_sizes(cfg, units: tuple[str, ...], full: int) -> list[int]:
    """Widths of the sections of a packed dim of size `full` (see unit_rows)."""
    heads = {"q_head": cfg.n_heads * cfg.head_dim, "kv_head": cfg.n_kv_heads * cfg.head_dim}
    bad = [u for u in units if u not in (*heads, "row")]
    if bad:
        raise ValueError(f"unknown shard unit {bad[0]!r} in packed units {units}")
    fixed = sum(heads.get(u, 0) for u in units)
    n_rows = sum(u == "row" for u in units)
    rest = full - fixed
    if rest < 0 or (n_rows and rest % n_rows) or (not n_rows and rest):
        raise ValueError(f"a packed dim of {full} does not hold the sections {units} of "
                         f"{cfg.n_heads} q / {cfg.n_kv_heads} kv heads of {cfg.head_dim}")
    return [heads[u] if u in heads else rest // n_rows for u in units]


def replica_groups(cfg: ModelConfig, unit, world_size: int) -> list[tuple[int, ...]]:
    """Ranks that hold the same slice of a unit kind (one group per distinct slice)."""
    groups: dict[tuple, list[int]] = {}
    has_kv = unit == "kv_head" or (isinstance(unit, tuple) and "kv_head" in unit)
    if isinstance(unit, tuple) and has_kv and cfg.n_kv_heads % world_size:
        raise ValueError(f"a packed {unit} weight cannot keep {cfg.n_kv_heads} kv heads whole "
                         f"on TP={world_size} ranks (its q rows differ per rank): choose a TP "
                         "size that divides the number of key/value heads")
    for r in range(world_size):
        key = tuple(kv_heads(cfg, world_size, r)) if has_kv else (r,)
        groups.setdefault(key, []).append(r)
    return [tuple(g) for g in groups.values()]
