"""Fused block boundaries in transformers' plain pre-norm decoder layers (Llama, Mistral, Qwen2,
Qwen3, Qwen3-MoE): the all-reduce of each block's partial output, the residual add and the next
RMSNorm in one comm.all_reduce_add_rmsnorm call, as in the project's own models.

transformers' layer computes, per layer l (norm_next: layer l+1's input_layernorm, or the base
model's final norm after the last layer):

    h = x + all_reduce(attn(input_layernorm(x)))              # o_proj's site
    out = h + all_reduce(mlp(post_attention_layernorm(h)))     # down_proj's site
    ... norm_next(out)                                         # in the next layer / the model

The fused layer's forward runs the same modules with the blocks returning their partials:

    normed, h = boundary_attn(post_attention_layernorm, x, attn(normed_x))
    normed_next, out = boundary_mlp(norm_next, h, mlp(normed))

and hands normed_next to norm_next: norm_next's forward returns it when called on `out`
itself (the very tensor; any other input is normed as before). Layer 0's input norm runs
unfused (no all-reduce before it).

Which layers: those whose forward is, as code, the plain pre-norm body above (compared as
`ast` dumps, so formatting and comments do not count: a transformers release that changes it,
or a family with extra steps such as Phi-3's residual dropout or Gemma's sandwich norms, keeps
its own forward) and whose norms are transformers' plain RMSNorm (`weight * cast(x *
rsqrt(mean(x^2) + eps))`, likewise compared). Blocks that cannot hand over a partial (a
row-parallel bias, a MoE block all-reduced at its output on real ranks) keep the layer unfused
too. Sequence parallelism keeps every layer unfused (its boundaries are local adds and norms).

The fused norm differs from transformers' own only in the summation order of the sum of
squares (echo_tp.norm: a fixed order, so the kernel and the reference agree bit for bit).
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types

import torch
from torch import nn

from echo_tp.tp.parallelize import fuse_block_outputs

PLAIN_LAYER_BODY = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
    position_ids=position_ids, cache=cache, use_cache=use_cache,
    position_embeddings=position_embeddings, **kwargs,)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""
"""The decoder-layer forward body (transformers 5.x) the fused forward replaces."""

PLAIN_NORM_BODY = """
input_dtype = hidden_states.dtype
hidden_states = hidden_states.to(torch.float32)
variance = hidden_states.pow(2).mean(-1, keepdim=True)
hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
return self.weight * hidden_states.to(input_dtype)
"""
"""transformers' plain RMSNorm forward body (Llama's; Qwen2/3's and Mistral's are copies)."""


@functools.cache
def _body(fn) -> str | None:
    """ast.dump of fn's body statements (its docstring dropped); None without source. Cached:
    every layer of a model shares its class's forward."""
    try:
        src = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError):
        return None
    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    stmts = fdef.body
    if stmts and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant) \
            and isinstance(stmts[0].value.value, str):
        stmts = stmts[1:]
    return _dump(stmts)


def _dump(stmts) -> str:
    return "\n".join(ast.dump(st) for st in stmts)


def _same_code(fn, body: str) -> bool:
    """fn's body is `body` as code (formatting and comments aside)."""
    return _body(fn) == _dump(ast.parse(textwrap.dedent(body)).body)


def plain_layer(layer: nn.Module) -> bool:
    return (hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")
            and _same_code(type(layer).forward, PLAIN_LAYER_BODY))


def plain_norm(norm: nn.Module) -> bool:
    return (isinstance(getattr(norm, "weight", None), torch.Tensor)
            and isinstance(getattr(norm, "variance_epsilon", None), float)
            and _same_code(type(norm).forward, PLAIN_NORM_BODY))


class _Handover:
    """The normed output a fused boundary computed for the norm after it: (out, normed), taken
    by that norm's forward when called on `out` itself."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.normed: torch.Tensor | None = None

    def put(self, out: torch.Tensor, normed: torch.Tensor) -> None:
        self.out, self.normed = out, normed

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.out is not x:
            return None
        normed = self.normed
        self.out = self.normed = None
        return normed


def fuse_hf_boundaries(base: nn.Module, simulated: bool) -> int:
    """Fuse the boundaries of base.layers (parallelized) where the module docstring allows;
    returns how many layers were fused."""
    layers = list(base.layers)
    final = getattr(base, "norm", None)
    nexts = [layer.input_layernorm if hasattr(layer, "input_layernorm") else None
             for layer in layers[1:]] + [final]
    fused = 0
    for layer, nxt in zip(layers, nexts):
        norms = (layer.post_attention_layernorm, nxt) if plain_layer(layer) else ()
        if not norms or not all(n is not None and plain_norm(n) for n in norms):
            continue
        boundaries = fuse_block_outputs((layer.self_attn, layer.mlp), simulated)
        if boundaries is None:
            continue
        handover = _handover_of(nxt)
        layer.forward = types.MethodType(_fused_forward(boundaries, nxt, handover), layer)
        fused += 1
    return fused


def _handover_of(norm: nn.Module) -> _Handover:
    """The norm's handover (its forward takes a handed-over result first); made once."""
    h = norm.__dict__.get("_echo_handover")
    if h is None:
        h = norm.__dict__["_echo_handover"] = _Handover()
        own = type(norm).forward

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            normed = h.take(hidden_states)
            return own(self, hidden_states) if normed is None else normed
        norm.forward = types.MethodType(forward, norm)
    return h


def _fused_forward(boundaries, next_norm: nn.Module, handover: _Handover):
    after_attn, after_mlp = boundaries

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:
            raise TypeError(f"{type(self).__name__} with fused boundaries takes its inputs "
                            "after hidden_states as keywords (as transformers' models pass them)")
        normed = self.input_layernorm(hidden_states)
        partial, _ = self.self_attn(hidden_states=normed, **kwargs)
        normed, h = after_attn(self.post_attention_layernorm, hidden_states, partial)
        normed_next, out = after_mlp(next_norm, h, self.mlp(normed))
        handover.put(out, normed_next)
        return out
    return forward
