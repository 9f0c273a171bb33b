"""Outlier values kept out of the 4-bit packet (issue 19 item 4), as a study on the reference
all-reduce: does sending each group's largest |value| exactly change fidelity?

    python studies/outlier_packet.py --model CK --data VAL.bin --out outlier.json [echo-tp eval
        options: --simulate 8 --bos --dtype bfloat16 --context 512 --max-windows 600 --kl ...]

The packet of one group of g values becomes: the standard codes, scale word and zero-point of
the group with its largest |value| replaced by the mean of the others (inside their range, so
the scale covers the other g - 1 values only), plus that value in bf16 and its index (16 + 8
bits; 4-bit g=128: 4.25 + 0.1875 = 4.4375 bits per value). The receiver decodes the group and
writes the bf16 value at its index. Both roundings of the all-reduce (entry and the owner's
requantization) use it, so the compensator sees its rounding errors as usual.

It patches the reference codec in this process (collective.qar.codec_for, quant.to_bytes /
from_bytes) and runs the reference all-reduce (ECHO_BACKEND=reference: no kernel carries the
format); then `echo_tp.eval.perplexity.main` with the given options. Rows are labelled with
'+outlier'; compare them with a plain `echo-tp eval` of the same windows by
`studies/fidelity_report.py outlier.json --refs plain.json`.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from echo_tp import quant
from echo_tp.config import QuantSpec

OUTLIER_BITS = 24
"""Wire bits per group for the kept value: bf16 value + an 8-bit index (g <= 256)."""


class OutlierPacket(NamedTuple):
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    value: torch.Tensor      # bf16 [..., G], each group's largest |value|
    index: torch.Tensor      # int16 [..., G], its place in the group


def _paper(spec: QuantSpec) -> QuantSpec:
    """The spec's grid without the library's own outlier word (this study's packet carries
    its kept value and index itself)."""
    return dataclasses.replace(spec, outlier=False)


def encode(x: torch.Tensor, spec: QuantSpec) -> OutlierPacket:
    """x [..., n] -> OutlierPacket. Unfused equivalent: quant.encode of x with each group's
    argmax |x| replaced by the mean of the rest, plus (value, index)."""
    spec = _paper(spec)
    xg = quant._as_groups(x, spec)                                   # [..., G, g] fp32
    idx = torch.nan_to_num(xg, nan=0.0).abs().argmax(-1, keepdim=True)
    top = xg.gather(-1, idx)
    rest_mean = (xg.sum(-1, keepdim=True) - top) / (spec.group_size - 1)
    rest = xg.scatter(-1, idx, torch.nan_to_num(rest_mean))
    p = quant.encode(rest.flatten(-2), spec)
    return OutlierPacket(p.codes, p.scale, p.zero, top[..., 0].to(torch.bfloat16),
                         idx[..., 0].to(torch.int16))


def decode(packet: OutlierPacket, spec: QuantSpec) -> torch.Tensor:
    """OutlierPacket -> fp32 [..., n]: the group decoded, the kept value at its index."""
    spec = _paper(spec)
    y = quant.decode(quant.Packet(packet.codes, packet.scale, packet.zero), spec)
    yg = y.reshape(*y.shape[:-1], -1, spec.group_size)
    yg = yg.scatter(-1, packet.index.long()[..., None], packet.value.float()[..., None])
    return yg.flatten(-2)


_plain_to_bytes, _plain_from_bytes = quant.to_bytes, quant.from_bytes


def to_bytes(p) -> torch.Tensor:
    if not isinstance(p, OutlierPacket):
        return _plain_to_bytes(p)
    head = _plain_to_bytes(quant.Packet(p.codes, p.scale, p.zero))
    return torch.cat([head, p.value.contiguous().view(torch.uint8),
                      p.index.contiguous().view(torch.uint8)], dim=-1)


def from_bytes(buf: torch.Tensor, n: int, spec: QuantSpec) -> OutlierPacket:
    spec = _paper(spec)
    groups = n // spec.group_size
    head = buf.shape[-1] - 4 * groups
    p = _plain_from_bytes(buf[..., :head], n, spec)
    value = buf[..., head:head + 2 * groups].contiguous().view(torch.bfloat16)
    index = buf[..., head + 2 * groups:].contiguous().view(torch.int16)
    return OutlierPacket(p.codes, p.scale, p.zero, value, index)


class _Codec:
    encode = staticmethod(encode)
    decode = staticmethod(decode)


def install() -> None:
    """Route this process's reference all-reduce through the outlier packet."""
    qar = importlib.import_module("echo_tp.collective.qar")   # the module, not the function
    os.environ["ECHO_BACKEND"] = "reference"
    qar.codec_for = lambda x: _Codec
    quant.to_bytes, quant.from_bytes = to_bytes, from_bytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a, rest = ap.parse_known_args(argv)
    install()
    from echo_tp.cli import main as cli_main
    rc = cli_main(["eval", *rest, "--out", a.out])
    if rc:
        return rc
    rec = json.loads(Path(a.out).read_text())
    for r in rec["results"]:
        if r["bits"] != 16 or r["policy"] not in ("config", "16"):
            r["wire_bits"] += OUTLIER_BITS / r["group_size"]
            r["label"] += " +outlier"
    rec["study"] = {"name": "outlier_packet", "outlier_bits_per_group": OUTLIER_BITS}
    Path(a.out).write_text(json.dumps(rec, indent=2) + "\n")
    print(f"rows relabelled '+outlier', wire bits + {OUTLIER_BITS} per group: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
