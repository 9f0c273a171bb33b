"""Echo TP for transformers' own models: `parallelize_hf(model, comm[, rank])`.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)      # or from_config
    parallelize_hf(model, SimulatedCommunicator(4, EchoConfig(bits=4)))          # P virtual ranks
    parallelize_hf(model, EchoCommunicator.from_group(None, cfg), rank)         # a real rank
    logits = model(input_ids).logits; model.generate(...) works as before

The model object is sharded in place from its config's `base_model_tp_plan` (hf/plan.py) by the
one TP engine (echo_tp.tp.parallelize): q/k/v/gate/up (and packed qkv / gate_up, fused expert
weights) keep this rank's rows, o_proj / down_proj become row-parallel, every attention and MLP
(or MoE) block gets its forward site (the partial output all-reduced through the communicator,
`bits=policy(site)`) and its backward site (the block input's gradient all-reduced). Passes are
delimited at the base model (`model.model`): each of its forwards is one forward pass, and the
backward of its output starts one backward pass, so a loss computed inside the CausalLM's forward
(labels=...) is covered too. tp.sync_partial_grads / grad_norm / clip_grad_norm_ /
full_state_dict work on the result (tp.unshard, which builds the project's Transformer, does not).
In plain pre-norm layers (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE) each block boundary is one
comm.all_reduce_add_rmsnorm call: the all-reduce, the residual add and the next RMSNorm
(hf/boundaries.py).

Simulated: each block becomes a SimTPBlock of P deep copies, sharded per virtual rank; attention
shards keep their own KV cache (`split_cache`): shard 0 writes the caller's Cache (so its
sequence length and masks stay right), shards 1..P-1 a private layer of the same kind. Cache
reordering (beam search, assisted decoding) does not reach those private layers: simulate greedy
or sampled decoding; real ranks have no such limit.

Why the project's own models (echo_tp.models) stay: they are the single-device reference the
studies, `echo-tp eval/train` and the CPU demo are built and measured on (no transformers
import, meta-device build, their own KV cache and generate), and their checkpoint adapter reads
and writes HF checkpoints. Both kinds run through the same plan -> shard -> sites engine; only the
plan tables differ (tp.TP_PLAN vs hf_plan(model)), so there is one TP engine, not two.
"""
from __future__ import annotations

import copy

from torch import nn

from echo_tp.tp.parallelize import parallelize

from .boundaries import fuse_hf_boundaries
from .plan import head_layout, hf_plan, output_norms


def parallelize_hf(model: nn.Module, comm, rank: int | None = None, *, policy=None,
                   plan: dict[str, str] | None = None,
                   sequence_parallel: bool = False) -> nn.Module:
    """Shard a transformers causal LM in place for `rank` of comm's group (all P virtual ranks
    when comm is a SimulatedCommunicator); see the module docstring.

    policy: as tp.parallelize (None, 'early8', {site: bits}, ...); site 2l / 2l+1 are layer l's
    attention / MLP. plan: transformers-style {key: style} replacing the config's plan.
    sequence_parallel: as tp.parallelize (tp/sequence.py): the decoder layers' residual stream
    sharded over the sequence, the first layer's input scattered and the final norm's output
    gathered (for training and scoring whole sequences: no KV-cache decoding)."""
    table = hf_plan(model, plan)
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at base_model.layers: "
                         "echo-tp parallelizes decoder-only transformers causal LMs")
    parallelize(model, comm, rank, policy=policy, plan=table, layout=head_layout(model),
                n_layers=len(layers), pass_root=base, split_cache=split_cache,
                sequence_parallel=sequence_parallel)
    model.echo_tp.output_norms.update(output_norms(model))
    if not model.echo_tp.sequence_parallel and comm.world_size > 1:
        fuse_hf_boundaries(base, model.echo_tp.simulated)
    return model


def split_cache(cache, n_shards: int, shard: nn.Module) -> list:
    """Per-shard KV caches for one simulated attention block (called before its first use)."""
    layer_idx = getattr(shard, "layer_idx", None)
    layers = getattr(cache, "layers", None)
    if layer_idx is None or layers is None:
        raise ValueError(f"simulated TP keeps one KV cache per virtual rank and needs a "
                         f"transformers Cache and an attention with layer_idx; got "
                         f"{type(cache).__name__}")
    if layer_idx < len(layers):
        template = layers[layer_idx]
        if getattr(template, "is_initialized", False):
            raise ValueError("simulated TP needs a fresh cache (this one already holds keys for "
                             f"layer {layer_idx}): let the model build it, or pass an empty one")
        make = lambda: copy.deepcopy(template)  # noqa: E731 - an empty layer, cheap to copy
    elif getattr(cache, "layer_class_to_replicate", None) is not None:
        make = cache.layer_class_to_replicate
    else:
        raise ValueError(f"cache {type(cache).__name__} has no layer {layer_idx}")
    return [cache] + [ShardCache(layer_idx, make()) for _ in range(n_shards - 1)]


class ShardCache:
    """The cache a virtual shard 1..P-1 writes to: one private layer (its own kv heads)."""

    def __init__(self, layer_idx: int, layer):
        self.layer_idx = layer_idx
        self.layer = layer

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """k, v [B, H_kv / P, T, hd] -> the layer's cached keys and values (as Cache.update)."""
        if layer_idx != self.layer_idx:
            raise ValueError(f"shard cache of layer {self.layer_idx} got layer {layer_idx}")
        return self.layer.update(key_states, value_states, *args, **kwargs)

