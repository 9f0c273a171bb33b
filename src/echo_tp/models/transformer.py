"""Llama-3 / Qwen3 decoder written for ONE device, in plain PyTorch.

Module names mirror transformers' LlamaForCausalLM / Qwen3ForCausalLM, so HF keys map onto ours
(nearly) one to one and a TP plan can name modules by path:

    model.embed_tokens
    model.layers.{i}.input_layernorm
    model.layers.{i}.self_attn.{q_proj,k_proj,v_proj,o_proj}   (+ q_norm, k_norm when qk_norm)
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}
    model.norm
    lm_head

Nothing here knows about tensor parallelism. Attention infers its number of (local) heads from
the projection outputs and the MLP has no sizes in forward, so sharding q/k/v/gate/up column-wise
and o_proj/down_proj row-wise (and wrapping o_proj/down_proj so their outputs are all-reduced)
leaves this code unchanged. Each decoder layer is

    h   = x + o_proj(attention(input_layernorm(x)))
    out = h + down_proj(silu(gate_proj(u)) * up_proj(u)),   u = post_attention_layernorm(h)

RoPE uses the HF "rotate_half" layout (no weight permutation) and is computed from positions at
forward time, so no buffer needs re-initializing after a meta-device build.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from echo_tp.models.config import ModelConfig


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's formula: weight * cast(x * 1 / sqrt(mean(x^2) + eps)) over the last dim, fp32
    inside (weight broadcasts: [dim], or one row per virtual rank in tp/batched.py)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, head_dim] for integer positions [T] (fp32 math, cast to dtype)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)                  # [T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd] rotated by cos/sin [T, hd]."""
    return x * cos + _rotate_half(x) * sin


class LayerKVCache:
    """Static K/V buffers of one layer, [B, H_kv, max_len, hd] each, allocated on first update.

    The head count and dtype come from the first keys written, so a TP-sharded attention (fewer
    local kv heads) uses the same class unchanged.
    """

    def __init__(self, batch_size: int, max_len: int) -> None:
        self.batch_size = batch_size
        self.max_len = max_len
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, start_pos: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, T, hd] at positions start_pos..start_pos+T-1; return the cache
        prefix [B, H_kv, start_pos+T, hd] of keys and values."""
        B, H, T, hd = k.shape
        end = start_pos + T
        if B != self.batch_size:
            raise ValueError(f"KV cache was built for batch {self.batch_size}, got batch {B}")
        if start_pos < 0 or end > self.max_len:
            raise ValueError(
                f"positions {start_pos}..{end - 1} do not fit a KV cache of {self.max_len}; "
                "build a larger KVCache")
        if self.k is None:
            self.k = k.new_zeros(B, H, self.max_len, hd)
            self.v = v.new_zeros(B, H, self.max_len, hd)
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """One `LayerKVCache` per decoder layer, for batch_size sequences of up to max_len tokens."""

    def __init__(self, n_layers: int, batch_size: int, max_len: int) -> None:
        if n_layers <= 0 or batch_size <= 0 or max_len <= 0:
            raise ValueError(
                f"KVCache needs positive sizes, got n_layers={n_layers}, "
                f"batch_size={batch_size}, max_len={max_len}")
        self.max_len = max_len
        self.layers = [LayerKVCache(batch_size, max_len) for _ in range(n_layers)]

    def __getitem__(self, i: int) -> LayerKVCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)


class Attention(nn.Module):
    """Causal grouped-query attention with optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.dim, q_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, cfg.dim, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, start_pos: int,
                cache: LayerKVCache | None) -> torch.Tensor:
        """x [B, T, dim] -> o_proj output [B, T, dim] (a partial sum when o_proj is row-sharded)."""
        B, T, _ = x.shape
        hd = self.head_dim
        # Head counts come from the projection outputs, so sharded projections just work.
        q = self.q_proj(x).view(B, T, -1, hd)  # [B, T, Hq, hd]
        k = self.k_proj(x).view(B, T, -1, hd)  # [B, T, Hkv, hd]
        v = self.v_proj(x).view(B, T, -1, hd)  # [B, T, Hkv, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, Hq, T, hd]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, hd]
        v = v.transpose(1, 2)                         # [B, Hkv, T, hd]
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} kv heads")
        if cache is not None:
            k, v = cache.update(start_pos, k, v)  # [B, Hkv, S, hd], S = start_pos + T
        S = k.shape[2]
        if S == T:
            mask, causal = None, T > 1  # plain causal prefill
        elif T == 1:
            mask, causal = None, False  # one new token sees the whole prefix
        else:
            # Query i sits at position S - T + i and sees keys 0..S - T + i (bottom-right causal).
            q_pos = torch.arange(S - T, S, device=x.device)[:, None]  # [T, 1]
            mask, causal = torch.arange(S, device=x.device)[None, :] <= q_pos, False  # [T, S]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           enable_gqa=q.shape[1] != k.shape[1])  # [B, Hq, T, hd]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, dim] -> [B, T, dim] (a partial sum when down_proj is row-sharded)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn_out, out = h + mlp_out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.boundaries: tuple | None = None
        """Set by the TP engine (tp/parallelize.py): (after attention, after the MLP) functions
        (norm, residual, partial) -> (normed, residual + all_reduce(partial)); None: plain."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, start_pos: int,
                cache: LayerKVCache | None) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(x), cos, sin, start_pos=start_pos,
                                  cache=cache)
        h = x + attn_out
        mlp_out = self.mlp(self.post_attention_layernorm(h))
        return h + mlp_out

    def step(self, normed: torch.Tensor, h: torch.Tensor, next_norm: RMSNorm, cos, sin, *,
             start_pos: int, cache: LayerKVCache | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its input's norm: (input_layernorm(h), h) -> (next_norm(out), out),
        out = forward(h). Each block boundary (residual add, then the next RMSNorm) is one
        `boundaries` call under TP: the all-reduce, the add and the norm in one."""
        attn_out = self.self_attn(normed, cos, sin, start_pos=start_pos, cache=cache)
        after_attn, after_mlp = self.boundaries or (_add_norm, _add_norm)
        normed, h = after_attn(self.post_attention_layernorm, h, attn_out)
        return after_mlp(next_norm, h, self.mlp(normed))


def _add_norm(norm: RMSNorm, residual: torch.Tensor, out: torch.Tensor):
    """-> (norm(residual + out), residual + out): the plain block boundary."""
    h = residual + out
    return norm(h), h


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (HF `model.*`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Transformer(nn.Module):
    """Causal LM: `model` (DecoderStack) + `lm_head`, tied to embed_tokens when configured."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head share embed_tokens' Parameter (again, e.g. after load with assign=True)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_kv_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KV cache for batch_size sequences of up to max_len positions."""
        return KVCache(len(self.model.layers), batch_size, max_len)

    def forward(self, tokens: torch.Tensor, *, start_pos: int = 0, kv_cache: KVCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] at positions start_pos.. -> logits [B, T, V] ([B, 1, V] if last_only).

        Without a cache, start_pos only shifts RoPE positions. With one, keys/values of the new
        tokens are written at start_pos.. and attention covers every cached position before them.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if kv_cache is not None and len(kv_cache) != len(self.model.layers):
            raise ValueError(f"KV cache has {len(kv_cache)} layers, model {len(self.model.layers)}")
        T = tokens.shape[1]
        h = self.model.embed_tokens(tokens)  # [B, T, dim]
        positions = torch.arange(start_pos, start_pos + T, device=tokens.device)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype)
        layers = self.model.layers
        normed = layers[0].input_layernorm(h) if len(layers) else self.model.norm(h)
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            normed, h = layer.step(normed, h, nxt, cos, sin, start_pos=start_pos,
                                   cache=None if kv_cache is None else kv_cache[i])
        if last_only:
            normed = normed[:, -1:]                    # the norm is per position
        return self.lm_head(normed)  # [B, T, V]

    @torch.inference_mode()
    def generate(self, prompt_tokens: torch.Tensor, max_new_tokens: int, greedy: bool = True, *,
                 temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend prompt_tokens [B, T] (or [T]) by max_new_tokens using a KV cache.

        greedy: argmax at each step; otherwise sample from softmax(logits / temperature).
        Returns [B, T + max_new_tokens] (or [T + max_new_tokens] for a 1-D prompt).
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not greedy and not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        squeeze = prompt_tokens.dim() == 1
        tokens = prompt_tokens[None] if squeeze else prompt_tokens
        B, T = tokens.shape
        if T == 0:
            raise ValueError("generate needs a non-empty prompt")
        cache = self.new_kv_cache(B, T + max_new_tokens)
        out = [tokens]
        logits = self(tokens, start_pos=0, kv_cache=cache, last_only=True)  # [B, 1, V]
        for step in range(max_new_tokens):
            last = logits[:, -1].float()  # [B, V]
            if greedy:
                nxt = last.argmax(dim=-1, keepdim=True)  # [B, 1]
            else:
                probs = torch.softmax(last / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            out.append(nxt)
            if step + 1 < max_new_tokens:
                logits = self(nxt, start_pos=T + step, kv_cache=cache)
        result = torch.cat(out, dim=1)
        return result[0] if squeeze else result
