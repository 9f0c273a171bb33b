"""Echo inside megatron-core: every TP activation collective of a GPTModel through an
EchoCommunicator, forward and backward, with the sites and passes of echo-tp's own TP engine.

    from echo_tp.megatron import echo_block_spec, enable_echo
    model = GPTModel(config, echo_block_spec(config), vocab_size=V, max_sequence_length=T)
    enable_echo(model, EchoCommunicator.from_group(tp_group, EchoConfig.from_name("echo4")))

    spec.py      echo_layer_spec / echo_block_spec: megatron-core's local spec with the Echo
                 parallel linears (the supported extension point: ModuleSpec)
    layers.py    EchoColumnParallelLinear, EchoRowParallelLinear; TorchNorm (SP without apex)
    patches.py   the three megatron-core functions replaced by name where there is no hook
    version.py   TESTED_VERSIONS; any other megatron-core: an error on import
    enable.py    enable_echo / disable_echo: sites, passes, the recomputation guard
    context.py   MegatronContext: the TP engine's TPContext plus the forward guard
    grads.py     sync_tp_partial_grads, clip_grad_norm_: training without megatron-core's DDP
    cpu.py       run_on_cpu, CPU_CONFIG, causal_mask: megatron-core on gloo CPU ranks

Covered: GPTModel from megatron-core's local spec (get_gpt_layer_local_spec), tensor
parallelism with or without sequence_parallel, learned or rotary positions, tied or untied
output weights, selective recomputation of core_attn (tested; layernorm allowed). Not
covered (enable_echo raises): Transformer Engine layers, MoE, multi-latent attention,
multi-token prediction, pipeline or context parallelism, recompute_granularity='full' (or
selective recomputation of modules with TP collectives), the deferred output-layer weight
gradient. Never touched: the vocab-parallel cross entropy's reductions, gradient reductions of
parameters.
"""
from __future__ import annotations

try:
    import megatron.core as _core
except ImportError as e:                      # the optional dependency
    raise ImportError("echo_tp.megatron needs megatron-core: pip install -e \".[megatron]\" "
                      "(megatron-core==0.16.1)") from e

from .version import TESTED_VERSIONS, check_version

check_version(_core.__version__)

from .context import MegatronContext  # noqa: E402
from .enable import check_config, disable_echo, enable_echo  # noqa: E402
from .grads import clip_grad_norm_, partial_grad_params, sync_tp_partial_grads  # noqa: E402
from .layers import EchoColumnParallelLinear, EchoRowParallelLinear, TorchNorm  # noqa: E402
from .spec import ECHO_MODULES, echo_block_spec, echo_layer_spec, replace_in_spec  # noqa: E402

__all__ = ["enable_echo", "disable_echo", "echo_block_spec", "echo_layer_spec",
           "replace_in_spec", "ECHO_MODULES", "EchoColumnParallelLinear",
           "EchoRowParallelLinear", "TorchNorm", "MegatronContext", "check_config",
           "sync_tp_partial_grads", "partial_grad_params", "clip_grad_norm_", "check_version",
           "TESTED_VERSIONS"]
