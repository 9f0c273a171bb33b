"""megatron-core 0.16.1 on a machine without CUDA: gloo ranks for development, CI and the CPU
example. Not needed on GPUs.

    run_on_cpu()                                    # once per process, before the model
    config = TransformerConfig(..., **CPU_CONFIG)   # CPU initialization, no fused kernels

What megatron-core needs there, besides CPU_CONFIG:
* `torch.cuda.current_device()` in megatron.core.utils (GlobalMemoryBuffer.get_tensor, used by
  the attention's matmul buffer), tensor_parallel.mappings and .layers (the output buffers of
  megatron-core's own sequence-parallel collectives) and the rotary embedding (RoPE's
  frequencies) must answer the CPU: run_on_cpu sets each of these modules' `torch` to a view
  of torch whose cuda.current_device() is torch.device('cpu') (everything else is torch's).
* activation recomputation saves and restores the CUDA RNG state
  (tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state): an empty state and a
  no-op on the CPU.
* the RNG tracker: tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
  instead of model_parallel_cuda_manual_seed (run_on_cpu calls it).
* an explicit attention mask (megatron-core builds its default causal mask on 'cuda'):
  `causal_mask(seq_len)`.
* sequence parallelism without apex: echo_tp.megatron.TorchNorm (echo_block_spec uses it).
megatron-core's DistributedDataParallel and get_megatron_optimizer are CUDA-only: train with a
torch optimizer and echo_tp.megatron.sync_tp_partial_grads.
"""
from __future__ import annotations

import torch
from megatron.core import utils as core_utils
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as tp_random

CPU_CONFIG = dict(use_cpu_initialization=True, bias_activation_fusion=False,
                  masked_softmax_fusion=False, persist_layer_norm=False,
                  gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                  apply_rope_fusion=False)
"""TransformerConfig settings for the CPU: weights built on the CPU, fused kernels off."""

_MODULES = (core_utils, mappings, tp_layers, rotary_pos_embedding)


class _CpuCuda:
    """torch.cuda, but the current device is the CPU."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")


class _CpuTorch:
    """torch, with cuda.current_device() the CPU."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state, *args, **kwargs) -> None:
    return None


def run_on_cpu() -> None:
    """Apply the module docstring's CPU settings to megatron-core in this process
    (idempotent). Call it only in processes that run megatron-core on the CPU."""
    for mod in _MODULES:
        mod.torch = _CPU_TORCH
    tp_random._get_cuda_rng_state = _no_cuda_rng_state
    tp_random._set_cuda_rng_state = _set_no_cuda_rng_state
    tp_random.initialize_rng_tracker(inference_rng_tracker=True)


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """[1, 1, s, s] bool, True above the diagonal (the positions megatron-core masks out)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]
