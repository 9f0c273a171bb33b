"""enable_echo: Echo at every TP activation collective of a megatron-core GPTModel built from an
Echo spec (echo_tp.megatron.spec), with the sites and passes of echo-tp's own TP engine.

    model = GPTModel(config, echo_block_spec(config), vocab_size=V, max_sequence_length=T)
    enable_echo(model, EchoCommunicator.from_group(tp_group, EchoConfig.from_name("echo4")))

Sites (static index -> width ctx.bits(index): tp.policy.site_width, the TP engine's rule):
    decoder layer l (layer_number l + 1): self_attention's linears site 2l, mlp's site 2l + 1
        forward:  linear_proj / linear_fc2 all-reduce (SP: reduce-scatter)
        backward: linear_qkv / linear_fc1 input-gradient all-reduce (SP: reduce-scatter; their
                  SP input all-gather forward, at gather_bits)
    the word embeddings' forward all-reduce (SP: reduce-scatter, or with learned positions the
        scatter, whose backward all-gathers): site 0's width, the first collective of a pass
    the output layer's input-gradient all-reduce (SP: its input all-gather forward, gradient
        reduce-scatter backward): the last site's (2L - 1) width, the first of a backward pass
So under the default WidthPlan (edge_bits=8) the embedding, layer 0's attention, the last
layer's MLP and the output layer run at 8 bits. The vocab-parallel cross entropy's all-reduces,
the logits' gather (parallel_output=False) and every other collective stay megatron-core's.

Passes: every forward of the model starts a forward pass (comm.new_pass('forward'): fresh
compensator state); its output goes through tp.sites.BackwardPassStart, whose backward, the
first node of the backward pass, starts a backward pass. So each micro-batch's forward and
backward get fresh state, and the embedding's and the output layer's collectives share the
stream of the pass with the layers' (all [s, b, h]; patches.Scope.batch_first).

Recomputation: a site that runs outside the model's forward raises RuntimeError
(MegatronContext.check_forward), and enable_echo refuses recompute_granularity='full' and
selective recomputation of modules with TP collectives up front. Echo refuses rather than
replays: a replay would have to keep every site's output of the recomputed layers.

The instances GPTModel builds outside the layer spec are adapted in place: the output layer's
class becomes EchoColumnParallelLinear (a subclass adding no state), the embedding module gets
a forward pre-hook and hook that open an Echo scope. disable_echo(model) removes the hooks and
every site: the model then runs megatron-core's collectives exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from echo_tp.tp.plan import SITES_PER_LAYER
from echo_tp.tp.policy import WidthPlan
from echo_tp.tp.sites import BackwardPassStart, Site

from . import patches
from .context import SAFE_RECOMPUTE, MegatronContext
from .layers import EchoColumnParallelLinear
from .spec import ECHO_LINEARS

SEQ_DIM = 0
"""megatron-core's activations are [s, b, h]."""


@dataclass(eq=False, kw_only=True)
class EchoState:
    """What enable_echo put on a model (model.echo_megatron)."""

    ctx: MegatronContext
    modules: list = field(default_factory=list)
    """Every module holding an echo_site."""
    handles: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    """The embedding's open Echo scopes (a stack: one per running embedding forward)."""


def unwrap(model) -> GPTModel:
    """The GPTModel inside megatron-core's wrappers (Float16Module, DDP: `.module`)."""
    m = model
    while not isinstance(m, GPTModel) and hasattr(m, "module"):
        m = m.module
    if not isinstance(m, GPTModel):
        raise ValueError(f"enable_echo takes a megatron-core GPTModel (or a wrapper of one), "
                         f"got {type(model).__name__}")
    return m


def check_config(config) -> None:
    """ValueError for the TransformerConfig settings Echo does not cover."""
    if config.recompute_granularity == "full":
        raise ValueError("recompute_granularity='full' reruns every layer's forward in the "
                         "backward pass, which would advance Echo's compensator a second time; "
                         "Echo refuses it. Use recompute_granularity=None or 'selective' with "
                         f"recompute_modules among {list(SAFE_RECOMPUTE)}")
    if config.recompute_granularity == "selective":
        bad = sorted(set(config.recompute_modules or ()) - set(SAFE_RECOMPUTE))
        if bad:
            raise ValueError(f"selective recomputation of {bad} reruns TP collectives in the "
                             "backward pass, which would advance Echo's compensator a second "
                             f"time; keep recompute_modules among {list(SAFE_RECOMPUTE)}")
    unsupported = {
        "num_moe_experts": "mixture-of-experts layers (their dispatchers' collectives)",
        "multi_latent_attention": "multi-latent attention",
        "mtp_num_layers": "multi-token prediction",
        "tp_comm_overlap": "Transformer Engine's communication overlap",
        "defer_embedding_wgrad_compute": "the output layer's deferred weight gradient (it "
                                         "gathers the input again with megatron-core's own "
                                         "collective)",
    }
    for name, what in unsupported.items():
        if getattr(config, name, None):
            raise ValueError(f"echo_tp.megatron does not cover {what}: set {name} off, or run "
                             "the model without Echo")
    for name in ("pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(config, name, 1) > 1:
            raise ValueError(f"echo_tp.megatron is tested with tensor parallelism alone: {name}="
                             f"{getattr(config, name)} is not supported (set it to 1)")


def _tp_group(modules) -> dist.ProcessGroup:
    groups = {id(m.tp_group): m.tp_group for m in modules}
    if len(groups) != 1:
        raise ValueError("the model's parallel linears use more than one TP group")
    return next(iter(groups.values()))


def _check_comm(comm, tp_group) -> None:
    if getattr(comm, "simulated", False):
        raise ValueError("echo_tp.megatron runs on real ranks: build the communicator with "
                         "EchoCommunicator.from_group(parallel_state."
                         "get_tensor_model_parallel_group(), config)")
    want = dist.get_process_group_ranks(tp_group)
    got = dist.get_process_group_ranks(comm.group if comm.group is not None else
                                       dist.group.WORLD)
    if got != want:
        raise ValueError(f"the communicator's group holds ranks {got}, the model's TP group "
                         f"{want}: build it with EchoCommunicator.from_group(parallel_state."
                         "get_tensor_model_parallel_group(), config)")


def enable_echo(model, comm, *, policy=None) -> MegatronContext:
    """Route every TP activation collective of `model` (a GPTModel built from an Echo spec, or
    a wrapper of one) through `comm` (an EchoCommunicator over the model's TP group), each
    site at its width (tp.policy.site_width; policy: a WidthPlan, or its per-site policy
    alone as tp.parallelize takes it). Enabling again replaces the earlier comm."""
    gpt = unwrap(model)
    config = gpt.config
    check_config(config)
    if getattr(gpt, "echo_megatron", None) is not None:
        disable_echo(gpt)
    layers = list(gpt.decoder.layers)
    linears = [m for m in gpt.decoder.modules() if isinstance(m, ECHO_LINEARS)]
    plain = [n for n, m in gpt.decoder.named_modules()
             if type(m) in (ColumnParallelLinear, RowParallelLinear)]
    if plain or not linears:
        raise ValueError(f"the decoder has megatron-core parallel linears without Echo "
                         f"({plain[:4]}{'...' if len(plain) > 4 else ''}): build the model "
                         "with transformer_layer_spec=echo_block_spec(config) (or "
                         "echo_layer_spec())")
    tp_group = _tp_group(linears)
    _check_comm(comm, tp_group)
    n_layers = config.num_layers
    P = comm.world_size
    ctx = MegatronContext(comm=comm, widths=WidthPlan.of(policy, comm.config).resolved(n_layers),
                          world_size=P, n_layers=n_layers, rank=dist.get_rank(tp_group),
                          sequence_parallel=bool(config.sequence_parallel) and P > 1,
                          model_name=type(gpt).__name__)
    state = EchoState(ctx=ctx)
    patches.install()
    placed = set()
    for layer in layers:
        for slot, block in enumerate((layer.self_attention, layer.mlp)):
            site = Site(ctx, SITES_PER_LAYER * (layer.layer_number - 1) + slot, dim=SEQ_DIM)
            for m in block.modules():
                if isinstance(m, ECHO_LINEARS):
                    m.echo_site = site
                    placed.add(id(m))
                    state.modules.append(m)
    stray = [n for n, m in gpt.decoder.named_modules()
             if isinstance(m, ECHO_LINEARS) and id(m) not in placed]
    if stray:
        _clear(state)
        raise ValueError(f"Echo parallel linears outside a layer's self_attention or mlp: "
                         f"{stray}; their site is unknown")
    last = Site(ctx, max(0, SITES_PER_LAYER * n_layers - 1), dim=SEQ_DIM)
    if gpt.post_process:
        out = gpt.output_layer
        if type(out) is ColumnParallelLinear:
            out.__class__ = EchoColumnParallelLinear
        if not isinstance(out, EchoColumnParallelLinear):
            _clear(state)
            raise ValueError(f"the output layer is a {type(out).__name__}, not megatron-core's "
                             "ColumnParallelLinear: Echo cannot route its collectives")
        out.echo_site = last
        state.modules.append(out)
    if gpt.pre_process:
        scope = patches.Scope(site=Site(ctx, 0, dim=SEQ_DIM), batch_first=True)
        emb = gpt.embedding
        state.handles += [emb.register_forward_pre_hook(_enter_scope(state, scope)),
                          emb.register_forward_hook(_leave_scope(state), always_call=True)]
    state.handles += [gpt.register_forward_pre_hook(_forward_starts(ctx)),
                      gpt.register_forward_hook(_forward_ends(ctx), always_call=True)]
    gpt.echo_megatron = state
    return ctx


def disable_echo(model) -> None:
    """Undo enable_echo: the model runs megatron-core's own collectives exactly."""
    gpt = unwrap(model)
    state = getattr(gpt, "echo_megatron", None)
    if state is None:
        return
    _clear(state)
    del gpt.echo_megatron


def _clear(state: EchoState) -> None:
    for h in state.handles:
        h.remove()
    for m in state.modules:
        m.echo_site = None
    state.handles.clear()
    state.modules.clear()


def _enter_scope(state: EchoState, scope: patches.Scope):
    def hook(module, args):
        state.ctx.check_forward(module)
        state.tokens.append(patches.enter(scope))
    return hook


def _leave_scope(state: EchoState):
    def hook(module, args, out):
        if state.tokens:
            patches.leave(state.tokens.pop())
    return hook


def _forward_starts(ctx: MegatronContext):
    def hook(module, args):
        ctx.depth += 1
        if ctx.depth == 1:
            ctx.comm.new_pass("forward")
    return hook


def _forward_ends(ctx: MegatronContext):
    def hook(module, args, out):
        ctx.depth -= 1
        if ctx.depth or not isinstance(out, torch.Tensor):
            return None
        if not (torch.is_grad_enabled() and out.requires_grad):
            return None
        return BackwardPassStart.apply(out, ctx)
    return hook
