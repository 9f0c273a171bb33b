"""The table `echo-tp eval` prints: one row per comm config."""
from __future__ import annotations

def format_table(results: list[dict]) -> str:
    """A fixed-width table: one row per comm config, ppl change against the first row; with
    bootstrap statistics (see _add_statistics), the gap closed and its 95% interval, the wire
    bits per value and the last-word accuracy."""
    base = results[0]["ppl"]
    width = max(12, *(len(r["label"]) for r in results))
    gap = any(r.get("gap_closed") is not None for r in results)
    lw = any(r.get("last_word_accuracy") is not None for r in results)
    kl = any(r.get("kl") is not None for r in results)
    head = (f"{'comm config':<{width}}  {'ppl':>10}  {'vs ' + results[0]['label']:>12}  "
            f"{'tokens':>9}  {'s':>7}")
    if "wire_bits" in results[0]:
        head += f"  {'bits/val':>8}"
    if gap:
        head += f"  {'gap closed [95% CI]':>24}"
    if lw:
        head += f"  {'last-word %':>11}"
    if kl:
        head += f"  {'KL vs 16-bit [95% CI]':>30}"
    lines = [head]
    for r in results:
        line = (f"{r['label']:<{width}}  {r['ppl']:>10.4f}  {r['ppl'] - base:>+12.4f}  "
                f"{r['tokens']:>9}  {r['seconds']:>7.1f}")
        if "wire_bits" in r:
            line += f"  {r['wire_bits']:>8.3f}"
        if gap:
            g, ci = r.get("gap_closed"), r.get("gap_closed_ci")
            cell = "" if g is None else f"{g:6.1%} [{ci[0]:6.1%}, {ci[1]:6.1%}]"
            line += f"  {cell:>24}"
        if lw:
            line += f"  {r['last_word_accuracy']:>11.2f}"
        if kl:
            k, ci = r.get("kl"), r.get("kl_ci")
            cell = "" if k is None else f"{k:.2e} [{ci[0]:.2e}, {ci[1]:.2e}]"
            line += f"  {cell:>30}"
        lines.append(line)
    return "\n".join(lines)

