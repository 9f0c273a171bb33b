"""Massive activations of a checkpoint: per layer, the largest |value| of the residual stream
against its median |value|, and where the largest sits (position, channel).

    python studies/massive_activations.py --model CKPT_DIR --data val.bin [--bos] [--out F.json]

One batch of windows (BOS-started with --bos, as the model was trained), fp32 statistics of
each decoder layer's output h [B, T, d] (the residual `DecoderLayer.step` returns; the model
runs on one device).
"""
from __future__ import annotations

import argparse
import json

import torch

from echo_tp.eval.perplexity import load_model
from echo_tp.models import load_tokens
from echo_tp.models.tokenize import separator_id


def layer_stats(model, x: torch.Tensor) -> list[dict]:
    """x [B, T] tokens -> one row per decoder layer: max/median |h|, argmax position/channel."""
    rows: list[dict] = []

    def record(out):
        h = out[1].float().abs()                                            # [B, T, d]
        flat = h.flatten()
        i = int(flat.argmax())
        _, t, d = h.shape
        rows.append({"layer": len(rows), "max": float(flat[i]),
                     "median": float(flat.median()), "ratio": float(flat[i] / flat.median()),
                     "position": (i // d) % t, "channel": i % d,
                     "top_channels": torch.topk(h.amax(dim=(0, 1)), 3).indices.tolist()})

    def watched(step):
        def run(*args, **kw):
            out = step(*args, **kw)
            record(out)
            return out
        return run

    layers = model.model.layers
    for layer in layers:
        layer.step = watched(layer.step)
    try:
        with torch.no_grad():
            model(x)
    finally:
        for layer in layers:
            del layer.step
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--bos", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = load_model(a.model, seed=0, dtype=getattr(torch, a.dtype), device=device)
    toks = load_tokens(a.data)[:a.batch * a.context].view(a.batch, a.context)
    if a.bos:
        toks = torch.cat([toks.new_full((a.batch, 1), separator_id(a.data)), toks], 1)
    rows = layer_stats(model, toks.to(device))
    for r in rows:
        print(f"layer {r['layer']:2d}  max {r['max']:9.2f}  median {r['median']:7.4f}  "
              f"ratio {r['ratio']:8.1f}  at position {r['position']:4d} channel {r['channel']:4d}"
              f"  top channels {r['top_channels']}")
    best = max(rows, key=lambda r: r["ratio"])
    print(f"largest: {best['ratio']:.1f}x at layer {best['layer']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "data": a.data, "bos": a.bos, "layers": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
