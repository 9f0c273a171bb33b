"""How the TP engine reads a block it did not write: its input, extra outputs, head attributes.

Shared by the real-rank and the simulated paths of tp/parallelize.py, so both treat a block
(ours or transformers') the same way:
- block_input: the input is the first positional argument or `hidden_states=` (transformers'
  decoder layers call attention with keywords only);
- join_heads: extra per-shard outputs of a simulated block (attention weights [B, H/P, T, S])
  are concatenated along heads, in rank order, as one unsharded module would return them;
- set_local_heads: transformers attention keeps head counts in attributes (num_key_value_groups;
  Phi-3 also reads config.num_attention_heads): they are set to the heads a rank keeps.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .plan import kv_heads, q_heads


def join_heads(items: list):
    """Extra per-shard outputs (attention weights [B, H/P, T, S]) -> one, heads in rank order."""
    if all(i is None for i in items):
        return None
    return torch.cat(items, dim=1)


def block_input(args: tuple, kwargs: dict):
    """The block input and a function that puts a replacement back where it came from."""
    if args:
        return args[0], lambda x: ((x, *args[1:]), dict(kwargs))
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], lambda x: ((), {**kwargs, "hidden_states": x})
    raise ValueError("a TP block takes its input as the first positional argument or as "
                     f"hidden_states=; got keyword arguments {sorted(kwargs)}")


def set_local_heads(tp, module: nn.Module, rank: int) -> None:
    """transformers attention keeps head counts in attributes (and Phi-3 reads its config's):
    set them to the heads this rank keeps, on a per-module copy of the config."""
    nq = len(q_heads(tp.cfg, tp.world_size, rank))
    nkv = len(kv_heads(tp.cfg, tp.world_size, rank))
    local = {"num_key_value_groups": nq // nkv, "num_heads": nq, "num_attention_heads": nq,
             "num_key_value_heads": nkv}
    for attr, value in local.items():
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, value)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):
        config = copy.copy(config)
        config.num_attention_heads, config.num_key_value_heads = nq, nkv
        module.config = config
