"""A hidden-size rotation folded into the weights offline (QuaRot-style): the same function, with
the residual stream, and so every all-reduced block output, in a rotated basis.

With Q [d, d] orthogonal and row vectors (y = x W^T), the residual stream h becomes h Q:
    embed_tokens   E -> E Q                     (each token's vector rotated)
    reading linears W -> W Q                    q/k/v_proj, gate/up_proj, lm_head: (hQ)(WQ)^T = hW^T
    writing linears W -> Q^T W, b -> b Q        o_proj, down_proj: their outputs land rotated
RMSNorm commutes with Q only without its weight (||hQ|| = ||h||), so each norm's weight is folded
into the linears that read it first (W -> W diag(w), w -> 1); the final norm's goes into lm_head,
which then no longer shares the embedding's Parameter. Outlier channels of h (massive
activations) are spread over all d channels by Q: what the 4-bit all-reduce sees changes, the
model's function does not (up to the rounding of the rotated weights to their dtype).

Q: a Hadamard matrix (Sylvester) times a seeded random +-1 diagonal, / sqrt(d), when d is a power
of two; else a seeded random orthogonal matrix (QR of a Gaussian).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from echo_tp.models.transformer import Transformer


def orthogonal_matrix(d: int, seed: int = 0) -> torch.Tensor:
    """Q [d, d] float64 with Q Q^T = I (see the module doc)."""
    gen = torch.Generator().manual_seed(seed)
    if d & (d - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:                       # Sylvester: H_2n = [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (d,), generator=gen).to(torch.float64) * 2 - 1
        return signs[:, None] * h / d ** 0.5
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


@torch.no_grad()
def rotate_hidden(model: Transformer, seed: int = 0) -> torch.Tensor:
    """Rotate `model` (one device, before parallelize) in place; returns Q [d, d] float64."""
    if getattr(model, "echo_tp", None) is not None:
        raise ValueError("rotate the model before parallelizing it")
    stack = model.model
    d = stack.embed_tokens.weight.shape[1]
    q = orthogonal_matrix(d, seed).to(stack.embed_tokens.weight.device)

    def reading(lin: nn.Linear, norm_w: torch.Tensor | None) -> None:
        w = lin.weight.double()
        if norm_w is not None:
            w = w * norm_w.double()[None, :]
        lin.weight.copy_((w @ q).to(lin.weight.dtype))

    def writing(lin: nn.Linear) -> None:
        lin.weight.copy_((q.T @ lin.weight.double()).to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_((lin.bias.double() @ q).to(lin.bias.dtype))

    head = model.lm_head
    if head.weight is stack.embed_tokens.weight:          # untie: lm_head gets the final norm
        head.weight = nn.Parameter(head.weight.detach().clone())
        model.cfg = dataclasses.replace(model.cfg, tie_embeddings=False)
    emb = stack.embed_tokens.weight
    emb.copy_((emb.double() @ q).to(emb.dtype))
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        w_in = layer.input_layernorm.weight
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            reading(lin, w_in)
        w_in.fill_(1.0)
        writing(attn.o_proj)
        w_post = layer.post_attention_layernorm.weight
        for lin in (mlp.gate_proj, mlp.up_proj):
            reading(lin, w_post)
        w_post.fill_(1.0)
        writing(mlp.down_proj)
    reading(head, stack.norm.weight)
    stack.norm.weight.fill_(1.0)
    return q
