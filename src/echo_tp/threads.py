"""A simulated model computes at the intra-op thread count of a rank.

    at_rank_threads(model)      # model's forward and backward (on the CPU) at ECHO_RANK_THREADS
                                # threads (default 1), the count of each rank run_ranks spawns

Simulated TP gives the real ranks' results bit for bit only when both compute at the same
intra-op thread count: MKL's sgemm splits x @ W^T of some row counts (5-7 and 9-11 rows: the
tokens an MoE expert gets, short sequences) over 1 and 2 threads differently and rounds
differently. tp.parallelize puts every simulated model of P > 1 ranks under `at_rank_threads`
(P = 1 stays the plain model, at the process's count), so a process at its default count (one
thread per core) simulates ranks that run one thread each; outside the model's forward and
backward the process keeps its own count. Models on CUDA are left alone (their matmuls do not
depend on it). The price: a CPU simulation computes on one core by
default (ECHO_RANK_THREADS=N: on N, and each spawned rank too).

How: a forward pre-hook sets the rank's count and a forward hook (also called when the
forward raises) restores the process's; the outputs that need a gradient pass through an
identity whose backward, the first node of the model's backward, sets the count again and
queues the restore for the end of that backward (the autograd engine's final callback). A
backward that raises skips its callbacks: the next forward of the model restores the count.
"""
from __future__ import annotations

import torch
from torch import nn

from . import envs


class _Scope:
    """The process's count while a model runs at a rank's count (torch's setting is global, so
    this record is too: one per process)."""

    def __init__(self):
        self.outer: int | None = None   # the count to restore; None: at the process's count
        self.depth = 0                  # forwards running (nested: a model inside a model)

    def set_rank(self, n: int) -> None:
        if self.outer is None:
            self.outer = torch.get_num_threads()
            if self.outer != n:
                torch.set_num_threads(n)

    def restore(self) -> None:
        if self.outer is not None and self.depth == 0:
            if torch.get_num_threads() != self.outer:
                torch.set_num_threads(self.outer)
            self.outer = None


_SCOPE = _Scope()


def at_rank_threads(model: nn.Module, n: int | None = None) -> None:
    """Run model's forward and backward at n intra-op threads (default: ECHO_RANK_THREADS) while
    its parameters are on the CPU; the process's count is restored after each. Nested models
    under it (a base model inside its causal LM) may get it too: the outermost restores."""
    n = envs.rank_threads() if n is None else n
    if n < 1:
        raise ValueError(f"a thread count is >= 1, got {n}")
    entered: list[bool] = []   # per running forward of this model: whether it set the count

    @torch.compiler.disable   # under torch.compile(model) the hooks run eagerly
    def pre_hook(module, args):
        on = _on_cpu(module)
        entered.append(on)
        if on:
            _SCOPE.depth += 1
            _SCOPE.set_rank(n)

    @torch.compiler.disable
    def hook(module, args, out):
        if not entered or not entered.pop():
            return None
        _SCOPE.depth -= 1
        _SCOPE.restore()
        return _wrap(out, n) if torch.is_grad_enabled() else None

    model.register_forward_pre_hook(pre_hook)
    model.register_forward_hook(hook, always_call=True)


def _on_cpu(module: nn.Module) -> bool:
    p = next(module.parameters(), None)
    return p is not None and p.device.type == "cpu"


def _wrap(out, n: int):
    """out with every tensor that needs a gradient (a tensor, in a tuple, or a field of a
    transformers ModelOutput) passed through _AtRankThreads; None: out unchanged."""
    if isinstance(out, torch.Tensor):
        return _AtRankThreads.apply(out, n) if out.requires_grad else None
    if isinstance(out, tuple) and not hasattr(out, "keys"):
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in out):
            return None
        items = [_AtRankThreads.apply(t, n) if isinstance(t, torch.Tensor) and t.requires_grad
                 else t for t in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
    if hasattr(out, "keys"):   # a ModelOutput: item and attribute set together
        for k in list(out.keys()):
            v = out[k]
            if isinstance(v, torch.Tensor) and v.requires_grad:
                out[k] = _AtRankThreads.apply(v, n)
        return out
    return None


class _AtRankThreads(torch.autograd.Function):
    """Identity on a model output; its backward runs the rest of the backward at n threads and
    queues the restore of the process's count for its end."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int) -> torch.Tensor:
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad.device.type == "cpu":
            _SCOPE.set_rank(ctx.n)
            torch.autograd.Variable._execution_engine.queue_callback(_SCOPE.restore)
        return grad, None
