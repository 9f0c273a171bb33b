"""The block-boundary epilogue on one GPU: residual add + RMSNorm as one kernel pass
(kernels/norm_kernels.py) against torch's add then the models' RMSNorm, decode and prefill rows.

    python benchmarks/add_norm.py --out $OUT

Both start from the all-reduced y (the all-reduce itself is the same in both). Per shape: median
ms of --iters calls (CUDA events) and the bytes each must move at least (read y, residual,
weight; write residual_out and normed) over that time; the HBM copy of the same run beside it.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from common import median_ms

SHAPES = [(8, 4096), (64, 4096), (2048, 4096), (8192, 4096), (32768, 4096), (8192, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--iters", type=int, default=100)
    a = ap.parse_args()
    from echo_tp.kernels import norm_kernels
    from echo_tp.models.transformer import RMSNorm
    rows_out = []
    big = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    copy_ms = median_ms(lambda: big2.copy_(big), 20, 3)
    for rows, h in SHAPES:
        y = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        norm = RMSNorm(h, 1e-6).cuda().to(torch.bfloat16)
        w = norm.weight.data

        def unfused():
            r = res + y
            return norm(r), r

        def fused():
            return norm_kernels.add_rmsnorm(y, res, w, 1e-6)
        t_u = median_ms(unfused, a.iters, 10, barrier=False)
        t_f = median_ms(fused, a.iters, 10, barrier=False)
        nbytes = 5 * rows * h * 2 + h * 2
        row = {"rows": rows, "hidden": h, "torch_ms": round(t_u, 4), "fused_ms": round(t_f, 4),
               "speedup": round(t_u / t_f, 2), "fused_GBps": round(nbytes / t_f / 1e6, 1)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "copy_GBps": round(2 * big.numel() / copy_ms / 1e6, 1)}
    print(json.dumps(meta))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "add_norm.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
