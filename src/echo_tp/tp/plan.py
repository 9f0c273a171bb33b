"""The tensor-parallel plan: a table of module path patterns -> how the module is split.

    TP_PLAN["model.layers.*.self_attn.q_proj"] = Colwise(unit="q_head")

Patterns name modules of `echo_tp.models.Transformer` by path; `*` matches one path component.
Modules the table does not name (embed_tokens, every RMSNorm but q/k norm, model.norm, lm_head)
stay whole and identical on every rank, so the vocabulary need not divide P.

Styles:
    Colwise(unit)   output rows split (q/k/v, gate/up); unit 'q_head' / 'kv_head' / 'row'
    Rowwise(unit, slot)
                    input columns split (o_proj, down_proj); the partial output is summed by the
                    block's FORWARD site 2*layer + slot (Megatron's "g"), the bias added after it
    BlockInput(slot)
                    the block's input is copied to the TP region: identity forward, all-reduce of
                    the input gradient backward: BACKWARD site 2*layer + slot (Megatron's "f")
    PartialGradReplicate()
                    a replicated weight used on this rank's heads only (Qwen3 q_norm / k_norm):
                    its gradient is a partial sum over the group (tp.sync_partial_grads)

Key/value heads: with n_kv_heads >= P they are split like query heads (n_kv_heads % P == 0);
with n_kv_heads < P (P % n_kv_heads == 0) each rank keeps the one kv head its query heads read,
so ranks P/n_kv_heads apart hold copies whose gradients are partial sums over those ranks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from echo_tp.models.config import ModelConfig

SITES_PER_LAYER = 2
"""Each decoder layer has one site per block: slot 0 = attention, slot 1 = MLP."""


@dataclass(frozen=True)
class Colwise:
    """Column-parallel linear: rank r keeps the output rows (and bias) of its units."""

    unit: str = "row"


@dataclass(frozen=True)
class Rowwise:
    """Row-parallel linear: rank r keeps the input columns of its units; output all-reduced."""

    unit: str = "row"
    slot: int = 0


@dataclass(frozen=True)
class BlockInput:
    """The f site at a block's input (gradient all-reduce in backward)."""

    slot: int = 0


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


def unit_rows(cfg: ModelConfig, unit: str, full: int, world_size: int, rank: int) -> torch.Tensor:
    """Indices (along the split dim, of size `full`) that rank keeps for a unit kind."""
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


def replica_groups(cfg: ModelConfig, unit: str, world_size: int) -> list[tuple[int, ...]]:
    """Ranks that hold the same slice of a unit kind (one group per distinct slice)."""
    groups: dict[tuple, list[int]] = {}
    for r in range(world_size):
        key = tuple(kv_heads(cfg, world_size, r)) if unit == "kv_head" else (r,)
        groups.setdefault(key, []).append(r)
    return [tuple(g) for g in groups.values()]
