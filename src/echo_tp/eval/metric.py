"""The metric of `echo-tp eval`: sliding windows over a token stream, each window's summed NLL,
scored-target count, per-token argmax hits and (against a reference forward) KL; perplexity =
exp(total NLL / scored tokens). Windows, BOS and padding: echo_tp/eval/perplexity.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

def sliding_windows(n_tokens: int, context: int, stride: int | None = None,
                    max_windows: int | None = None) -> list[tuple[int, int]]:
    """(start, first scored position) of each window over a stream of n_tokens."""
    stride = context if stride is None else stride
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 1 and 1 <= stride <= context, got {context}, {stride}")
    if n_tokens < context + 1:
        raise ValueError(f"{n_tokens} tokens do not fill one window of {context} (+1 target); "
                         "lower --context")
    count = (n_tokens - 1 - context) // stride + 1
    if max_windows is not None:
        count = min(count, max_windows)
    return [(k * stride, 0 if k == 0 else context - stride) for k in range(count)]



@dataclass
class WindowScores:
    """What one config scores on the windows: nll [W] float64 (summed NLL per window), count
    [W] int64 (scored targets per window), correct [n_tokens] int8 (1 / 0: the argmax predicted
    the token at that position right / wrong; -1: not a scored target)."""

    nll: torch.Tensor
    count: torch.Tensor
    correct: torch.Tensor
    kl: torch.Tensor | None = None
    """[W] float64: summed KL(reference || model) of the next-token distributions per window
    (window_scores(reference=...)), else None."""


@torch.inference_mode()
def window_scores(model, tokens: torch.Tensor, windows, *, context: int, batch_size: int,
                  device, bar=None, bos_id: int | None = None, reference=None,
                  multiple: int = 1) -> WindowScores:
    """Per-window NLL and per-token argmax hits over windows of `context` tokens (each read
    after a BOS token when bos_id is given; its position is not scored); with reference (a
    second forward, e.g. the 16-bit model), the per-window KL(reference || model) too.
    multiple: the forward's length must be a multiple of it (sequence parallelism: P); a
    window that is not is padded at its end, and the pad positions are not scored (the model
    is causal: they change no earlier logit)."""
    T = context
    kl_w = None if reference is None else torch.zeros(len(windows), dtype=torch.float64)
    nll_w = torch.zeros(len(windows), dtype=torch.float64)
    count_w = torch.zeros(len(windows), dtype=torch.long)
    correct = torch.full((tokens.numel(),), -1, dtype=torch.int8)
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        x = torch.stack([tokens[s:s + T] for s, _ in batch]).to(device)          # [B, T]
        y = torch.stack([tokens[s + 1:s + T + 1] for s, _ in batch]).to(device)  # [B, T]
        if bos_id is not None:
            x = torch.cat([x.new_full((len(batch), 1), bos_id), x], dim=1)     # [B, T + 1]
        x, n = _pad_to(x, multiple)                                    # [B, L >= n], n = T (+ 1)
        logits = model(x)                                              # [B, L, V]
        logits = getattr(logits, "logits", logits)[:, :n]  # a transformers ModelOutput; no pad
        if bos_id is not None:
            logits = logits[:, 1:]  # the BOS position predicts x's first token: not scored
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        nll = nll.view(len(batch), T).double().cpu()
        hit = (logits.argmax(-1) == y).to(torch.int8).cpu()                     # [B, T]
        kl = None
        if reference is not None:
            ref = reference(x)
            ref = getattr(ref, "logits", ref)[:, :n]
            ref_lp = (ref[:, 1:] if bos_id is not None else ref).float().log_softmax(-1)
            lp = logits.float().log_softmax(-1)
            kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).double().cpu()          # [B, T]
        for b, (s, first) in enumerate(batch):
            if kl is not None:
                kl_w[i + b] = kl[b, first:].sum()
            nll_w[i + b] = nll[b, first:].sum()
            count_w[i + b] = T - first
            correct[s + 1 + first:s + 1 + T] = hit[b, first:]
        if bar is not None:
            bar.update(len(batch))
    return WindowScores(nll=nll_w, count=count_w, correct=correct, kl=kl_w)


def window_nll(model, tokens: torch.Tensor, windows, *, context: int, batch_size: int, device,
               bar=None, bos_id: int | None = None) -> tuple[float, int]:
    """(sum of NLL in float64, scored tokens) over the windows (window_scores, summed)."""
    sc = window_scores(model, tokens, windows, context=context, batch_size=batch_size,
                       device=device, bar=bar, bos_id=bos_id)
    return float(sc.nll.sum()), int(sc.count.sum())


def _pad_to(x: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """x [B, n] -> (x padded at its end with token 0 to a length L that multiple divides, n)."""
    n = x.shape[1]
    pad = -n % multiple
    return (torch.cat([x, x.new_zeros(x.shape[0], pad)], dim=1) if pad else x), n
