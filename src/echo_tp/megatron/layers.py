"""Echo subclasses of megatron-core's parallel linear layers (an Echo layer spec builds them:
echo_tp.megatron.spec), and a torch norm that runs under sequence parallelism.

Each layer holds `echo_site` (an echo_tp.tp.sites.Site, set by enable_echo); with None it is
megatron-core's layer exactly. With a site:

    EchoColumnParallelLinear   the input goes through CopyToTP (identity forward, its gradient
                               all-reduced through Echo: the backward site), or under sequence
                               parallelism AllGather (the shards all-gathered forward at
                               gather_bits, the gradient reduce-scattered backward); megatron-
                               core's linear function then runs with allreduce_dgrad=False and
                               sequence_parallel=False, so it issues no collective of its own
    EchoRowParallelLinear      forward inside an Echo scope: the all-reduce (SP: reduce-scatter)
                               its forward calls goes through Echo (patches.py), backward as
                               megatron-core's (identity; SP: an all-gather through Echo)

Against megatron-core's own ColumnParallelLinear backward, which launches the input gradient's
all-reduce with async_op=True before the weight-gradient GEMM and waits on the handle after
it: here the linear function returns the unreduced input gradient (no handle exists) and the
Echo all-reduce runs after it, in CopyToTP's backward. Same values; on a GPU the overlap of
that all-reduce with the weight-gradient GEMM is given up (Echo's collective runs on the
compute stream). Under SP the linear function saves the gathered input for its weight
gradient instead of re-gathering it in the backward (megatron-core keeps the shard and
gathers again): one collective less per layer, the gathered input's memory more, and the
weight gradient sees exactly the input the forward used (a 4-bit gather is not exact).
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from echo_tp.tp.sites import AllGather, CopyToTP

from . import patches
from .version import TESTED_VERSIONS

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class EchoColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose input collectives run through Echo (module docstring)."""

    echo_site = None

    def _forward_impl(self, input, weight, *args, **kwargs):
        site = self.echo_site
        if site is None or self.explicit_expert_comm:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if args or "allreduce_dgrad" not in kwargs or "sequence_parallel" not in kwargs:
            raise RuntimeError("echo-tp: ColumnParallelLinear._forward_impl was called with "
                               "another signature than megatron-core "
                               f"{TESTED_VERSIONS} uses (keywords allreduce_dgrad, "
                               "sequence_parallel); this megatron-core is not supported")
        site.tp.check_forward(self)
        if kwargs["sequence_parallel"]:
            input = AllGather.apply(input, site)          # [s/P, b, h] -> [s, b, h]
        elif kwargs["allreduce_dgrad"]:
            input = CopyToTP.apply(input, site)           # backward: the gradient all-reduced
        kwargs.update(allreduce_dgrad=False, sequence_parallel=False)
        return super()._forward_impl(input, weight, **kwargs)


class EchoRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose output all-reduce (SP: reduce-scatter) runs through Echo."""

    echo_site = None

    def forward(self, input_):
        site = self.echo_site
        if site is None or self.explicit_expert_comm:
            return super().forward(input_)
        site.tp.check_forward(self)
        patches.require_installed()
        with patches.scope(patches.Scope(site=site)):
            return super().forward(input_)


class TorchNorm:
    """torch.nn.LayerNorm / RMSNorm (config.normalization) for a layer spec, as megatron-core's
    WrappedTorchNorm builds them, but also under sequence parallelism: the weight and bias are
    marked `sequence_parallel` (as megatron-core's fused norms mark theirs), so their
    rank-partial gradients are summed over the TP group (echo_tp.megatron.
    sync_sequence_parallel_grads, or megatron-core's finalize_model_grads)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = _NORMS.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"TorchNorm builds {sorted(_NORMS)}, not normalization="
                             f"{config.normalization!r}")
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm or \
                config.persist_layer_norm:
            raise ValueError("TorchNorm (torch's LayerNorm/RMSNorm) has no zero-centered gamma, "
                             "memory-efficient or persistent form: set "
                             "layernorm_zero_centered_gamma, memory_efficient_layer_norm and "
                             "persist_layer_norm to False")
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm
