"""Echo layer specs: megatron-core's own spec (ModuleSpec) with the Echo parallel linears.

    spec = echo_block_spec(config)          # the local spec's layers + the final norm
    model = GPTModel(config, spec, vocab_size=V, max_sequence_length=T)

`replace_in_spec(spec, table)` rebuilds a spec tree with the classes of `table` swapped
(ModuleSpec.module and every class among a submodules dataclass's fields, recursively; the
input spec is left as it was). ECHO_MODULES swaps megatron-core's ColumnParallelLinear and
RowParallelLinear for the Echo subclasses, and its torch-norm wrapper (WrappedTorchNorm, the
local spec's norm without apex, which refuses sequence parallelism) for layers.TorchNorm;
apex's or Transformer Engine's norms stay. A spec without megatron-core's local parallel
linears (Transformer Engine's layers run their own collectives) gets a ValueError.
"""
from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec, import_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)

from .layers import EchoColumnParallelLinear, EchoRowParallelLinear, TorchNorm

ECHO_MODULES = {ColumnParallelLinear: EchoColumnParallelLinear,
                RowParallelLinear: EchoRowParallelLinear,
                WrappedTorchNorm: TorchNorm}
"""megatron-core class -> its Echo replacement in a layer spec."""
ECHO_LINEARS = (EchoColumnParallelLinear, EchoRowParallelLinear)


def replace_in_spec(spec, table: dict):
    """(new spec, {old class: times replaced}) with the classes of `table` swapped."""
    counts: dict = {}

    def swap(cls):
        if _is_path(cls):                          # (module path, name): megatron's lazy form
            cls = import_module(cls)
        new = table.get(cls)
        if new is None:
            return cls
        counts[cls] = counts.get(cls, 0) + 1
        return new

    def walk(node):
        if isinstance(node, ModuleSpec):
            return dataclasses.replace(node, module=swap(node.module), params=dict(node.params),
                                       submodules=walk(node.submodules))
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return dataclasses.replace(node, **{f.name: walk(getattr(node, f.name))
                                                for f in dataclasses.fields(node) if f.init})
        if isinstance(node, list):
            return [walk(n) for n in node]
        if isinstance(node, type) or _is_path(node):
            return swap(node)
        return node

    return walk(spec), counts


def _is_path(node) -> bool:
    return isinstance(node, tuple) and len(node) == 2 and all(isinstance(x, str) for x in node)


def echo_layer_spec(base: ModuleSpec | None = None) -> ModuleSpec:
    """A transformer layer spec with the Echo parallel linears: `base` (default megatron-core's
    get_gpt_layer_local_spec()) with ECHO_MODULES swapped in."""
    base = get_gpt_layer_local_spec() if base is None else base
    spec, counts = replace_in_spec(base, ECHO_MODULES)
    if not counts.get(ColumnParallelLinear) or not counts.get(RowParallelLinear):
        raise ValueError("the layer spec holds no megatron-core ColumnParallelLinear and "
                         "RowParallelLinear: Echo covers megatron-core's local layers "
                         "(get_gpt_layer_local_spec); Transformer Engine's layers run their own "
                         "collectives. Build the model from the local spec")
    return spec


def echo_block_spec(config, base: ModuleSpec | None = None, *, vp_stage: int | None = None,
                    pp_rank: int | None = None) -> TransformerBlockSubmodules:
    """The decoder block spec GPTModel takes: echo_layer_spec(base) for each layer this
    pipeline stage builds, and the final norm megatron-core would use (TorchNorm in place of
    WrappedTorchNorm, so that sequence parallelism runs without apex)."""
    layer = echo_layer_spec(base)
    n = get_num_layers_to_build(config, vp_stage, pp_rank)
    norm = transformer_block.LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=[layer] * n,
                                      layer_norm=ECHO_MODULES.get(norm, norm))
