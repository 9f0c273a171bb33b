"""The megatron-core functions Echo replaces by name, where megatron-core offers no hook.

* tensor_parallel.layers.reduce_from_tensor_model_parallel_region: called by
  RowParallelLinear.forward and VocabParallelEmbedding.forward -> tp.sites.ReduceFromTP
  (all-reduce forward, identity backward)
* tensor_parallel.layers.reduce_scatter_to_sequence_parallel_region: the same two under
  sequence parallelism -> tp.sites.ReduceScatter (reduce-scatter forward, all-gather backward)
* tensor_parallel.scatter_to_sequence_parallel_region (the package attribute): called by
  LanguageModelEmbedding.forward under SP with learned positions -> tp.sites.ScatterToSequence
  (this rank's shard forward, all-gather backward)

The two forward methods call these functions by their module-global names, so no subclass can
reach the collective without copying the method; each replacement runs Echo only inside an Echo
scope (`scope`: an Echo layer or the embedding of an Echo-enabled model is in its forward) and
calls megatron-core's own function otherwise. Every other caller (MoE dispatchers, MLA, the
padding-mask scatter, models without Echo) therefore gets megatron-core's behaviour exactly.
The vocab-parallel cross entropy calls torch.distributed directly and is never touched.

`install()` is idempotent and refuses if something else already replaced a name; `uninstall()`
puts megatron-core's functions back. Tested on the megatron-core versions of
version.TESTED_VERSIONS only; any other gets check_version's error on `import echo_tp.megatron`.
The other adaptations (the output layer's class, the embedding's hooks) are enable.py's; the
CPU-only ones are cpu.py's.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings

from echo_tp.tp.sites import ReduceFromTP, ReduceScatter, ScatterToSequence, Site

_TARGETS = (
    (tp_layers, "reduce_from_tensor_model_parallel_region",
     mappings.reduce_from_tensor_model_parallel_region),
    (tp_layers, "reduce_scatter_to_sequence_parallel_region",
     mappings.reduce_scatter_to_sequence_parallel_region),
    (tensor_parallel, "scatter_to_sequence_parallel_region",
     mappings.scatter_to_sequence_parallel_region),
)
"""(module, name, megatron-core's function) of each replaced name."""


@dataclass(frozen=True, kw_only=True)
class Scope:
    """The site the replaced functions route to while an Echo module's forward runs."""

    site: Site
    batch_first: bool = False
    """The all-reduce input is [b, s, h] (VocabParallelEmbedding's), not [s, b, h]: it is
    all-reduced as [s, b, h], the layout of every other site of the pass, so that the
    compensator state (flat, per pass) lines up element by element with the next site's."""


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("echo_megatron_scope",
                                                                      default=None)


@contextlib.contextmanager
def scope(s: Scope):
    token = _SCOPE.set(s)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def enter(s: Scope) -> contextvars.Token:
    """scope() split in two, for a module's forward pre-hook / forward hook."""
    return _SCOPE.set(s)


def leave(token: contextvars.Token) -> None:
    _SCOPE.reset(token)


def _reduce_from(input_: torch.Tensor, group=None) -> torch.Tensor:
    s = _SCOPE.get()
    if s is None:
        return mappings.reduce_from_tensor_model_parallel_region(input_, group=group)
    if s.batch_first:                   # [b, s, h] -> [s, b, h] -> all-reduce -> [b, s, h]
        return ReduceFromTP.apply(input_.transpose(0, 1).contiguous(), s.site).transpose(0, 1)
    return ReduceFromTP.apply(input_, s.site)


def _reduce_scatter(input_: torch.Tensor, group=None, input_split_sizes=None,
                    use_global_buffer=False) -> torch.Tensor:
    s = _SCOPE.get()
    if s is None:
        return mappings.reduce_scatter_to_sequence_parallel_region(
            input_, group=group, input_split_sizes=input_split_sizes,
            use_global_buffer=use_global_buffer)
    if input_split_sizes is not None:
        raise ValueError("echo-tp: a reduce-scatter into unequal sequence chunks "
                         "(input_split_sizes) has no Echo form; disable Echo for this model")
    return ReduceScatter.apply(input_, s.site)            # [s, b, h] -> [s/P, b, h]


def _scatter_to_sequence(input_: torch.Tensor, group=None) -> torch.Tensor:
    s = _SCOPE.get()
    if s is None:
        return mappings.scatter_to_sequence_parallel_region(input_, group=group)
    return ScatterToSequence.apply(input_, s.site)        # [s, b, h] -> [s/P, b, h]


_REPLACEMENTS = {
    "reduce_from_tensor_model_parallel_region": _reduce_from,
    "reduce_scatter_to_sequence_parallel_region": _reduce_scatter,
    "scatter_to_sequence_parallel_region": _scatter_to_sequence,
}


def installed() -> bool:
    return all(getattr(mod, name) is _REPLACEMENTS[name] for mod, name, _ in _TARGETS)


def install() -> None:
    """Replace the names of the module docstring (idempotent)."""
    for mod, name, original in _TARGETS:
        current = getattr(mod, name)
        if current is _REPLACEMENTS[name]:
            continue
        if current is not original:
            raise RuntimeError(f"echo-tp: {mod.__name__}.{name} was already replaced by "
                               f"{current!r}; Echo routes it itself and cannot share it")
        setattr(mod, name, _REPLACEMENTS[name])


def uninstall() -> None:
    """Put megatron-core's own functions back (Echo modules then run Megatron's collectives)."""
    for mod, name, original in _TARGETS:
        if getattr(mod, name) is _REPLACEMENTS[name]:
            setattr(mod, name, original)


def require_installed() -> None:
    if not installed():
        raise RuntimeError("echo-tp: the megatron-core replacements are not installed "
                           "(patches.uninstall() ran after enable_echo); call enable_echo again")
