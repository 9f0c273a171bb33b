"""Last-word accuracy, LAMBADA-style: does the model name the word that ends a sentence?

A target is a whole word (one or more tokens) that ends a sentence in the held-out text: its first
token starts with a space and a letter (byte-level BPE: 'Ġ' + letters), any further tokens are
letters only, and the token after it starts with '.', '!' or '?'. It counts as right when the
greedy prediction (argmax of the logits, teacher-forced) is right at every one of its tokens.
Targets come from the scored part of the evaluation windows, each with at least `min_context`
tokens of its window before it (at most half the window), so every config is asked the same
questions.

    correct [n_tokens] int8: 1 / 0 where the token at that position was predicted right / wrong
                             (positions of scored targets), -1 elsewhere
    spans   [K, 2] int64:    (first, end) token positions of each target word
"""
from __future__ import annotations

import torch

SENTENCE_END = (".", "!", "?")
MIN_CONTEXT = 64


def token_classes(tokenizer, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token id (bool [V] each): starts a word (space + letters), continues one (letters
    only), ends a sentence (starts with . ! or ?). tokenizer: a `tokenizers.Tokenizer`."""
    start = torch.zeros(vocab_size, dtype=torch.bool)
    cont = torch.zeros(vocab_size, dtype=torch.bool)
    end = torch.zeros(vocab_size, dtype=torch.bool)
    for i in range(vocab_size):
        s = tokenizer.id_to_token(i)
        if not s:
            continue
        if s[0] == "\u0120" and s[1:].isalpha():
            start[i] = True
        elif s.isalpha():
            cont[i] = True
        elif s[0] in SENTENCE_END:
            end[i] = True
    return start, cont, end


def target_spans(tokens: torch.Tensor, windows, context: int, classes,
                 min_context: int = MIN_CONTEXT) -> torch.Tensor:
    """[K, 2] (first, end) positions of the sentence-final words inside the windows' scored
    targets, at least min_context tokens into their window (windows from sliding_windows:
    window (s, first) scores the tokens at positions s + 1 + t for t in [first, context))."""
    start, cont, end = classes
    min_context = min(min_context, context // 2)
    toks = tokens.long()
    spans = []
    for s, first in windows:
        lo = s + 1 + max(first, min_context)
        hi = s + 1 + context                  # positions [lo, hi) are scored, with context
        seg = toks[lo:hi + 1]                 # one more: the token after a word
        is_start, is_cont, is_end = start[seg], cont[seg], end[seg]
        for i in torch.nonzero(is_start[:-1]).flatten().tolist():
            j = i + 1
            while j < len(seg) - 1 and is_cont[j]:
                j += 1
            if j < len(seg) and is_end[j] and lo + j <= hi:
                spans.append((lo + i, lo + j))
    return torch.tensor(spans, dtype=torch.long).reshape(-1, 2)


def word_hits(correct: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """correct [n_tokens] int8, spans [K, 2] -> [K] bool: every token of the word right."""
    hits = torch.empty(spans.shape[0], dtype=torch.bool)
    for k, (a, b) in enumerate(spans.tolist()):
        seg = correct[a:b]
        if bool((seg < 0).any()):
            raise ValueError(f"target word at positions [{a}, {b}) was not scored")
        hits[k] = bool((seg == 1).all())
    return hits
