"""The simulated TP blocks' fast path: the P virtual ranks as a batch dim of every matmul.

`SimTPBlock` (tp/parallelize.py) runs its P shards one after another: P times the launches, each
a matmul of a 1/P share, all from the host (host-bound: the speeds of both paths are in
docs/results/2026-12-02-train-speed.md). With `parallelize(..., sim_path='batched')`
the project's own Attention and MLP (models/transformer.py) run each op of a shard ONCE, over a
leading rank dim:

    x [B, T, D] --SimExpand--> xs [P, B, T, D]      the f site: rank r's copy of the input (an
                                                    expand); backward: the P input gradients
                                                    [P, B, T, D] through the backward site
    attention  q, k, v = column_linear(xs, W_r): ONE x @ cat_r(W_r)^T  [P, B*T, H_r*hd]
               (every rank's input is the same x: the plain model's GEMM; backward: each
               rank's own input gradient, bmm)
               q/k norm with rank r's weight, RoPE, one SDPA over P*B sequences of H_r heads
               (heads are independent: rank r's queries only meet rank r's keys, as on a rank)
               partial_r = bmm(y_r, Wo_r^T)                          [P, B, T, D]
    mlp        partial_r = bmm(silu(column_linear(xs, Wg)) * column_linear(xs, Wu), Wd_r^T)
    partials [P, B, T, D] --> the g site (the fused boundary ReduceAddNorm, or SimReduce): the
                              stack the shard loop builds, through the same communicator call

The parameters stay the shards' own (names, optimizer state, tp.rank_parameters and tp/grads.py
unchanged); every forward stacks them ([P, ...], one copy per weight, fused with autocast's bf16
cast under torch.compile). Blocks it does not take (transformers' modules, a KV cache, sequence
parallelism) run shard by shard: `unfit` says why, and SimTPBlock logs it once.

Exactness: each rank's values come from the shard's own ops with a rank dim in front. On the CPU
(fp32) the batched matmuls give the shard loop's bits (tests/test_tp_batched.py); on a GPU a
batched GEMM may take another kernel and round differently, so there the fast path is the
per-shard path within float tolerance, not bit for bit (docs/usage/models.md).

torch.compile: with TPContext.compile_blocks the two block functions run compiled, one graph each
for every layer (weights come in as tensors, so no layer recompiles), and so does the block
boundary's backward (tp/sites.add_norm_grads: the RMSNorm's gradients written out, within float
rounding of the autograd form the other paths run); the collectives stay eager.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from echo_tp.models.transformer import MLP, Attention, RMSNorm, apply_rope, rms_norm

KINDS = ("attention", "mlp")


def block_kind(shard: nn.Module) -> str | None:
    """'attention' / 'mlp' for a shard of the project's Attention / MLP whose row-parallel output
    has no bias (a simulated shard's moved out), else None (the shard loop)."""
    if isinstance(shard, Attention):
        linears = (shard.q_proj, shard.k_proj, shard.v_proj)
        norms = (shard.q_norm, shard.k_norm)
        ok = (all(isinstance(m, nn.Linear) for m in linears)
              and getattr(shard.o_proj, "bias", 0) is None
              and all(n is None or isinstance(n, RMSNorm) for n in norms)
              and (norms[0] is None) == (norms[1] is None))
        return "attention" if ok else None
    if isinstance(shard, MLP):
        ok = (all(isinstance(m, nn.Linear) and m.bias is None
                  for m in (shard.gate_proj, shard.up_proj))
              and getattr(shard.down_proj, "bias", 0) is None)
        return "mlp" if ok else None
    return None


def unfit(kind: str | None, args: tuple, kwargs: dict, sequence_parallel: bool) -> str | None:
    """Why a block call cannot run batched (None when it can)."""
    if kind is None:
        return "a block that is not the project's Attention / MLP"
    if sequence_parallel:
        return "sequence parallelism"
    if not args or args[0].dim() != 3:
        return "a block input that is not the first argument, [B, T, dim]"
    if kind == "attention":
        if len(args) != 3 or kwargs.get("cache") is not None:
            return "attention with a KV cache (decoding)"
    elif len(args) != 1 or kwargs:
        return "an MLP call with more than its input"
    return None


def partials(kind: str, shards: nn.ModuleList, xs: torch.Tensor, args: tuple,
             compiled: dict | None = None) -> torch.Tensor:
    """The P shards' partial outputs [P, B, T, D] of block input copies xs [P, B, T, D] (args:
    the block call's positional arguments; attention: (x, cos, sin)). compiled: None (eager),
    or the dict that keeps this model's torch.compile'd block functions (filled on first use)."""
    if kind == "attention":
        a = shards[0]
        qn = None if a.q_norm is None else [s.q_norm.weight for s in shards]
        kn = None if a.k_norm is None else [s.k_norm.weight for s in shards]
        eps = (0.0, 0.0) if a.q_norm is None else (a.q_norm.eps, a.k_norm.eps)
        bias = a.q_proj.bias is not None
        fn = attention_partials if compiled is None else compiled_fn(compiled, attention_partials)
        return fn(xs, args[1], args[2],
                  [s.q_proj.weight for s in shards], [s.k_proj.weight for s in shards],
                  [s.v_proj.weight for s in shards], [s.o_proj.weight for s in shards],
                  [s.q_proj.bias for s in shards] if bias else None,
                  [s.k_proj.bias for s in shards] if bias else None,
                  [s.v_proj.bias for s in shards] if bias else None,
                  qn, kn, a.head_dim, eps)
    if kind == "mlp":
        fn = mlp_partials if compiled is None else compiled_fn(compiled, mlp_partials)
        return fn(xs, [s.gate_proj.weight for s in shards], [s.up_proj.weight for s in shards],
                  [s.down_proj.weight for s in shards])
    raise ValueError(f"unknown batched block kind {kind!r}; one of {KINDS}")


def linear(x: torch.Tensor, weights: list, biases: list | None = None) -> torch.Tensor:
    """x [P, N, in], weights P x [out, in], biases P x [out] or None -> [P, N, out]: rank r's
    F.linear(x[r], weights[r], biases[r]), batched."""
    w = torch.stack(weights).transpose(1, 2)                   # [P, in, out]
    if biases is None:
        return torch.bmm(x, w)
    return torch.baddbmm(torch.stack(biases).unsqueeze(1), x, w)


def column_linear(xs: torch.Tensor, weights: list, biases: list | None = None) -> torch.Tensor:
    """A column-parallel product of the ranks' copies of one input: xs [P, N, in], weights
    P x [out, in] -> [P, N, out], rank r's F.linear(xs[r], weights[r], biases[r]) as `linear`
    gives it. Where xs is one x [N, in] expanded (stride 0 over the ranks) and there is no
    bias, the forward is ONE x @ cat(weights)^T of the plain model's shape (no [P, N, in]
    copy or cast of the input, one GEMM of P*out columns), laid out as `linear`'s [P, N, out]
    (so on the CPU the elementwise ops after it take the same vector paths and the shard
    loop's bits hold); backward (ColumnProduct): each rank's own input gradient [P, N, in]
    (for the backward site's all-reduce) and weight gradient, batched over the ranks. Any
    other xs, and biases (which `linear`'s baddbmm adds inside the product), go to `linear`."""
    if xs.stride(0) != 0 or biases is not None:    # not one input expanded, or a bias (the
        return linear(xs, weights, biases)          # baddbmm adds it in the GEMM): batched
    return ColumnProduct.apply(xs, torch.cat(weights)).contiguous()  # [P, N, out]: `linear`'s
    #                                               layout, so the ops after it round alike


class ColumnProduct(torch.autograd.Function):
    """xs [P, N, in] (P copies of x [N, in]), w [P*out, in] (rank r's rows r*out..) ->
    [P, N, out]: rank r's xs[r] @ w_r^T. Unfused equivalent: torch.bmm(xs, w.view(P, out,
    in).transpose(1, 2)). Under autocast the operands are cast as autocast casts a matmul's
    (to its dtype; the gradients come back in the inputs' dtypes, as through those casts)."""

    @staticmethod
    def forward(ctx, xs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        P, N, _ = xs.shape
        x = xs[0]
        dev = x.device.type
        ctx.dtypes = (xs.dtype, w.dtype)
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w = x.to(dt), w.to(dt)
        ctx.save_for_backward(x, w)
        with torch.autocast(dev, enabled=False):
            y = x @ w.t()                                      # [N, P*out]
        return y.view(N, P, -1).transpose(0, 1)                # [P, N, out]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        P, N, out = g.shape
        g = g.to(x.dtype).contiguous()      # as bmm's own backward sees it (the same bits)
        with torch.autocast(g.device.type, enabled=False):
            gx = torch.bmm(g, w.view(P, out, -1))              # [P, N, in]: rank r's own
            gw = torch.bmm(x.expand(P, N, -1).transpose(1, 2), g)   # [P, in, out]
        return gx.to(ctx.dtypes[0]), gw.transpose(1, 2).reshape(P * out, -1).to(ctx.dtypes[1])
def attention_partials(xs, cos, sin, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm,
                       head_dim: int, eps: tuple[float, float]) -> torch.Tensor:
    """Attention.forward (no cache) of every shard: xs [P, B, T, D], cos/sin [T, hd], weights
    and biases P-lists (q_norm/k_norm P-lists of [hd] or None, eps their epsilons) -> partials
    [P, B, T, D]."""
    P, B, T, D = xs.shape
    x = xs.reshape(P, B * T, D)
    q = _by_rank(column_linear(x, wq, bq), B, T, head_dim)     # [P, B, T, Hq_r, hd]
    k = _by_rank(column_linear(x, wk, bk), B, T, head_dim)     # [P, B, T, Hkv_r, hd]
    v = _by_rank(column_linear(x, wv, bv), B, T, head_dim)
    if q_norm is not None:                                      # rank r's weight on its heads
        q = rms_norm(q, torch.stack(q_norm).view(P, 1, 1, 1, head_dim), eps[0])
        k = rms_norm(k, torch.stack(k_norm).view(P, 1, 1, 1, head_dim), eps[1])
    q = apply_rope(_sequences(q), cos, sin)                     # [P*B, Hq_r, T, hd]
    k = apply_rope(_sequences(k), cos, sin)                     # [P*B, Hkv_r, T, hd]
    v = _sequences(v)
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
    y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1,
                                       enable_gqa=q.shape[1] != k.shape[1])  # [P*B, Hq_r, T, hd]
    y = y.transpose(1, 2).reshape(P, B * T, -1)                # [P, B*T, Hq_r*hd]
    return linear(y, wo).view(P, B, T, D)


def mlp_partials(xs, w_gate, w_up, w_down) -> torch.Tensor:
    """MLP.forward of every shard: xs [P, B, T, D], weights P-lists -> partials [P, B, T, D]."""
    P, B, T, D = xs.shape
    x = xs.reshape(P, B * T, D)
    h = F.silu(column_linear(x, w_gate)) * column_linear(x, w_up)   # [P, B*T, I_r]
    return linear(h, w_down).view(P, B, T, D)


def _by_rank(t: torch.Tensor, B: int, T: int, head_dim: int) -> torch.Tensor:
    """column_linear's [P, B*T, H_r*hd] -> [P, B, T, H_r, hd] (a view)."""
    P = t.shape[0]
    return t.view(P, B, T, -1, head_dim)


def _sequences(t: torch.Tensor) -> torch.Tensor:
    """[P, B, T, H, hd] -> [P*B, H, T, hd]: rank r's batch as P*B sequences (the shard's
    transpose(1, 2))."""
    P, B, T, H, hd = t.shape
    return t.reshape(P * B, T, H, hd).transpose(1, 2)


def compiled_fn(cache: dict, fn):
    """fn through torch.compile, built on first use and kept in cache (one per function)."""
    if fn not in cache:
        cache[fn] = torch.compile(fn, fullgraph=True)
    return cache[fn]
