"""Per-site error telemetry, reported by the collective itself.

Each call leaves a row. On a real rank the row holds what that rank knows without extra
communication: its send rounding energy ||x'_j - x^_j||^2 over the segments it sends, the exact
requantization energy ||s - y||^2 of the segment it owns, and ||c||^2, ||x||^2, ||y||^2. `summary()` adds
these over the group in ONE small all-reduce per call of `summary` (never per site): their sum
estimates ||delta_k||^2 (||y||^2 is kept once, y being the same on every rank; exact when the rounding errors of different ranks are uncorrelated).
The simulated backend sees every rank, so its rows also hold the exact norms of
delta_k = y_k - sum_i x'_{k,i}, rho_k = y_k - sum_i x_{k,i} and the partial sum S_t = sum rho_k.
Values stay on the device until read, so recording adds no host synchronization.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Telemetry:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._partial: dict[tuple[str, int], torch.Tensor] = {}
        self._pass = {"forward": -1, "backward": -1}

    def new_pass(self, direction: str) -> None:
        self._pass[direction] += 1
        for key in [k for k in self._partial if k[0] == direction]:
            del self._partial[key]

    def clear(self) -> None:
        self.rows.clear()
        self._partial.clear()

    def record(self, *, direction: str, site: int, bits: int, x: torch.Tensor, y: torch.Tensor,
               rec, simulated: bool) -> None:
        """x [*B, N] caller's input (uncompensated), y [*B, N] output, rec: qar.StepRecord."""
        row = {"pass": self._pass[direction], "direction": direction, "site": site, "bits": bits,
               "numel": x.shape[-1],
               "x_sq": x.to(torch.float32).square().sum(-1),
               "y_sq": (y[0] if simulated else y).to(torch.float32).square().sum()}
        if rec is not None:
            row["sent_err_sq"] = rec.sent_err_sq
            row["requant_err_sq"] = rec.requant_err_sq
            row["corr_sq"] = (rec.correction.square().sum(-1) if rec.correction is not None
                              else torch.zeros_like(row["x_sq"]))
        if simulated:
            exact_x = x.to(torch.float64).sum(0)
            rho = y[0].to(torch.float64) - exact_x
            row["rho_norm"] = rho.norm()
            if rec is not None:
                row["delta_norm"] = (y[0].to(torch.float64)
                                     - rec.x_prime.to(torch.float64).sum(0)).norm()
            key = (direction, x.shape[-1])
            s = self._partial.get(key)
            s = rho if s is None else s + rho
            self._partial[key] = s
            row["partial_sum_norm"] = s.norm()
            row["exact_sum_norm"] = exact_x.norm()
        self.rows.append(row)

    def summary(self, group: dist.ProcessGroup | None = None, reduce: bool = True) -> list[dict]:
        """Rows as plain floats. On a real group (every rank must call this together) the
        per-rank energies are summed over the group and 'delta_norm_est' is added."""
        if not self.rows:
            return []
        keys = ("x_sq", "sent_err_sq", "requant_err_sq", "corr_sq", "y_sq")
        vals = torch.stack([torch.stack([r[k].to(torch.float64).sum() if k in r
                                         else torch.zeros((), dtype=torch.float64,
                                                          device=r["x_sq"].device)
                                         for k in keys]) for r in self.rows])
        simulated = "rho_norm" in self.rows[0]
        if not simulated and reduce and dist.is_initialized():
            vals = vals.to(self.rows[0]["x_sq"].device)
            dist.all_reduce(vals, group=group)
            vals[:, 4] /= dist.get_world_size(group)   # y is the same on every rank
        vals = vals.cpu()
        out = []
        for r, v in zip(self.rows, vals):
            row = {k: r[k] for k in ("pass", "direction", "site", "bits", "numel")}
            row.update({k: float(x) for k, x in zip(keys, v)})
            row["delta_norm_est"] = float((v[1] + v[2]).sqrt())
            for k in ("rho_norm", "delta_norm", "partial_sum_norm", "exact_sum_norm"):
                if k in r:
                    row[k] = float(r[k])
            out.append(row)
        return out
