"""Kernel launches that skip triton's JIT dispatch after the first one of a specialization.

    launch(kernel, grid, args, meta)   ==   kernel[grid](*args, **meta, **LAUNCH_OPTS)

On CUDA, the first launch of a specialization takes the JIT path; later ones go straight to the
compiled kernel's own launcher, skipping triton's per-call argument binding and cache lookup
(host time on every call of the collective: docs/results/2026-11-29-p2p-x2.md and -r2.md
measured it). The cache key holds every value triton specializes on (non-tensor arguments and
constexprs exactly; tensors by dtype and 16-byte alignment), so a hit launches the binary
triton itself would pick. Under TRITON_INTERPRET (no compiled kernel), while triton launch
hooks are installed (profilers), or with `FAST` set False (tests), every launch takes the JIT
path.
"""
from __future__ import annotations

import torch
import triton
from triton import knobs

from .quant_kernels import LAUNCH_OPTS

FAST = not getattr(knobs.runtime, "interpret", False)
"""Whether repeat launches may bypass the JIT (False under the interpreter)."""

_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas"})
_CACHE: dict = {}


def launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """kernel[grid](*args, **meta) with LAUNCH_OPTS; args[0] is a tensor on the launch device."""
    key = None
    if FAST and args[0].is_cuda and _no_hooks():
        key = (kernel, args[0].get_device(),
               *[(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a
                 for a in args], *meta.values())
        hit = _CACHE.get(key)
        if hit is not None:
            compiled, tail, device, stream_of = hit
            g = (*grid, 1, 1)
            compiled.run(g[0], g[1], g[2], stream_of(device),
                         compiled.function, compiled.packed_metadata, None, None, None,
                         *args, *tail)
            return
    compiled = kernel[grid](*args, **meta, **LAUNCH_OPTS)
    if key is not None and compiled is not None and hasattr(compiled, "packed_metadata"):
        names = kernel.arg_names[len(args):]
        if set(names) == set(meta) - _OPTIONS:   # the other parameters are constexprs given here
            _CACHE[key] = (compiled, tuple(meta[k] for k in names), args[0].get_device(),
                           triton.runtime.driver.active.get_current_stream)


def _no_hooks() -> bool:
    """No triton launch hooks installed (None, or an empty HookChain in triton >= 3.4)."""
    for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return False
    return True
