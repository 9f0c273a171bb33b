"""Per-site bit policies and the compact comm-config spec strings of `echo-tp eval/train`.

A policy maps a STATIC site index to a bit width (4, 8, 16) or None (the communicator config's
own width). Site 2l is layer l's attention block, 2l+1 its MLP block; the backward site of a
block uses the same index, so layer l's bits apply in both directions (tp/sites.py).

Presets: 'config' (None everywhere), 'uniform4', 'uniform8', '16' (plain all-reduce), 'early8'
(sites of the first n_layers // 2 layers at 8 bits, the rest at 4: SPEC §7).

Comm spec strings:  NAME[:KEY=VALUE[,KEY=VALUE...]]
    NAME   a preset of EchoConfig.from_name ('16', '8', '4', 'echo8', 'echo4', 'echo4-output',
           'echo4-local', 'echo4bf'), or 'early8' (= echo4 with policy=early8)
    KEY    bits, group_size (or g), quantizer, eta, a, beta1, beta2, residual, grad_scaling,
           state_dtype, policy
    e.g.   'echo4:eta=0.9,quantizer=naive'   '4:g=256'   'early8:residual=local'
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from echo_tp.config import EchoConfig

from .plan import SITES_PER_LAYER

BitPolicy = Callable[[int], "int | None"]
POLICIES = ("config", "uniform4", "uniform8", "16", "early8")
_KEY_ALIASES = {"g": "group_size"}
_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(EchoConfig)}


def make_policy(spec, n_layers: int) -> BitPolicy:
    """A policy from a preset name, a {site: bits} table, a per-site sequence or a callable."""
    n_sites = SITES_PER_LAYER * n_layers
    if spec is None or spec == "config":
        fn = _none
    elif isinstance(spec, str):
        if spec == "uniform4":
            fn = _const(4)
        elif spec == "uniform8":
            fn = _const(8)
        elif spec == "16":
            fn = _const(16)
        elif spec == "early8":
            fn = _EarlyWide(n_layers // 2)
        else:
            raise ValueError(f"unknown bit policy {spec!r}; choose one of {POLICIES}")
    elif isinstance(spec, Mapping):
        table = {int(k): v for k, v in spec.items()}
        fn = table.get
    elif isinstance(spec, Sequence):
        if len(spec) != n_sites:
            raise ValueError(f"a per-site bit list needs {n_sites} entries (2 per layer), "
                             f"got {len(spec)}")
        seq = list(spec)
        fn = seq.__getitem__
    elif callable(spec):
        fn = spec
    else:
        raise ValueError(f"a bit policy is a name, a table, a list or a callable, got {spec!r}")
    for site in range(n_sites):
        bits = fn(site)
        if bits not in (None, 4, 8, 16):
            raise ValueError(f"bit policy gives {bits!r} at site {site}; expected 4, 8, 16 or None")
    return fn


def _none(site: int) -> None:
    return None


@dataclass(frozen=True)
class _const:
    bits: int

    def __call__(self, site: int) -> int:
        return self.bits


@dataclass(frozen=True)
class _EarlyWide:
    wide_layers: int

    def __call__(self, site: int) -> int:
        return 8 if site // SITES_PER_LAYER < self.wide_layers else 4


@dataclass(frozen=True, kw_only=True)
class CommSpec:
    """One parsed comm config: its label (the spec string), EchoConfig and bit policy name."""

    label: str
    config: EchoConfig
    policy: str = "config"

    def as_dict(self) -> dict:
        return {"label": self.label, "policy": self.policy, **dataclasses.asdict(self.config)}


def parse_comm_spec(text: str) -> CommSpec:
    """'echo4:eta=0.9,quantizer=naive' -> CommSpec (see the module docstring for the syntax)."""
    text = text.strip()
    name, _, rest = text.partition(":")
    policy = "config"
    if name == "early8":
        base, policy = EchoConfig.from_name("echo4"), "early8"
    else:
        base = EchoConfig.from_name(name)
    changes: dict = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = _KEY_ALIASES.get(key.strip(), key.strip())
        if not eq:
            raise ValueError(f"comm spec {text!r}: {item!r} is not KEY=VALUE")
        if key == "policy":
            policy = value.strip()
            continue
        if key not in _FIELD_TYPES:
            raise ValueError(f"comm spec {text!r}: unknown key {key!r}; known: "
                             f"{sorted(_FIELD_TYPES) + ['policy', 'g']}")
        changes[key] = _convert(key, value.strip(), text)
    if policy not in POLICIES:
        raise ValueError(f"comm spec {text!r}: unknown policy {policy!r}; choose one of {POLICIES}")
    return CommSpec(label=text, config=base.replace(**changes), policy=policy)


def parse_comm_specs(texts: str | Sequence[str]) -> list[CommSpec]:
    """Several specs: a list, or one string separated by ';' or whitespace."""
    if isinstance(texts, str):
        texts = texts.replace(";", " ").split()
    specs = [parse_comm_spec(t) for t in texts]
    if not specs:
        raise ValueError("no comm config given")
    return specs


def _convert(key: str, value: str, text: str):
    kind = str(_FIELD_TYPES[key])
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
    except ValueError:
        raise ValueError(f"comm spec {text!r}: {key}={value!r} is not a valid {kind}") from None
    return value
