"""Fidelity to the 16-bit model as the KL divergence of next-token distributions, beside the NLL
change, for a few bit policies on one model (CPU; simulated TP).

    python studies/kl_probe.py [--model DIR] [--data TOKENS.bin] [--windows 48] [--context 256]

Perplexity change can rank configs against their closeness to the 16-bit outputs on a model far
outside its training distribution (the demo model scores ~400 on WikiText-2): it measures how
the noise moves the NLL of the targets, not how far the outputs moved. KL(p_16 || p_config),
averaged over scored tokens, measures the latter. Configs: 16, echo4 with every site at 4 bits
(edge_bits=0), with site 0 at 8 bits (first8), with the last site at 8 bits (last8), with both
(the default, WidthPlan.edge_bits = 8), naive 4.
Every window starts with BOS (id 0).
"""
from __future__ import annotations

import argparse

import torch

from echo_tp import EchoConfig, SimulatedCommunicator
from echo_tp.eval.perplexity import load_eval_tokens, load_model
from echo_tp.tp import parallelize, set_comm
from echo_tp.tp.policy import WidthPlan

CONFIGS = [("16", dict(bits=16), WidthPlan()),
           ("echo4, every site at 4 bits", dict(bits=4), WidthPlan(edge_bits=0)),
           ("echo4, first8 (site 0 at 8 bits)", dict(bits=4),
            WidthPlan(policy="first8", edge_bits=0)),
           ("echo4, last8", dict(bits=4), WidthPlan(policy="last8", edge_bits=0)),
           ("echo4, ends8 (the default)", dict(bits=4), WidthPlan()),
           ("4", dict(bits=4, eta=0.0), WidthPlan.from_name("4"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="src/echo_tp/assets/models/demo-8k")
    ap.add_argument("--data", default=".work/data/wiki8k.bin")
    ap.add_argument("--windows", type=int, default=48)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--simulate", type=int, default=4)
    a = ap.parse_args()
    model, _ = load_model(a.model, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    tokens = load_eval_tokens(a.data, model_spec=a.model, tokenizer=None)
    B, T = a.windows, a.context
    x = torch.cat([torch.zeros(B, 1, dtype=torch.long), tokens[:B * T].view(B, T)], 1)
    y = tokens[1:B * T + 1].view(B, T)
    logp = {}
    for i, (name, fields, policy) in enumerate(CONFIGS):
        comm = SimulatedCommunicator(a.simulate, EchoConfig(**fields))
        if i == 0:
            parallelize(model, comm, policy=policy)
        else:
            set_comm(model, comm, policy=policy)
        with torch.no_grad():
            logp[name] = torch.cat([model(x[j:j + 16])[:, 1:].log_softmax(-1)
                                    for j in range(0, B, 16)])          # [B, T, V]
    ref = logp["16"]
    nll16 = float(-ref.gather(-1, y[..., None]).mean())
    print(f"{B * T} scored tokens, simulated TP={a.simulate}")
    for name, lp in logp.items():
        kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
        nll = float(-lp.gather(-1, y[..., None]).mean())
        print(f"{name:34s} KL(16 || config) {kl:.5f}   NLL change {nll - nll16:+.5f}")


if __name__ == "__main__":
    main()
