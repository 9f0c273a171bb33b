"""The TP engine's width rules: which bit width each site of a model runs at, and the compact
comm-config spec strings of `echo-tp eval/train`.

One decision, one function: `site_width(plan, site, bits=, n_layers=, kind=)` gives a static
site's width from a frozen `WidthPlan` (three rules, in order) and the communicator config's own
width `bits` (the only thing the collective's config contributes):

    policy       site -> 4 / 8 / 16 / None (None: the config's width); `make_policy`
    edge_bits    where the policy gives None at a model's first or last site (layer 0's
                 attention, the last layer's MLP; both directions) of a quantized config:
                 max(bits, edge_bits); 0 turns the rule off. 8 by default (why, and what it
                 costs: docs/results/2026-12-01-edge-sites.md)
    gather_bits  sequence parallelism's all-gathers (uncompensated, tp/sequence.py): the site's
                 width, widened to gather_bits where that is wider; 0: the site's own. 8 by
                 default (docs/results/2026-12-01-sp-testbed.md)

A site at a wider width than a rule's keeps its own. Site 2l is layer l's attention block,
2l+1 its MLP block; the backward site of a block uses the same index, so layer l's width
applies in both directions (tp/sites.py).

Policy presets: 'config' (None everywhere), 'uniform4', 'uniform8', '16' (plain all-reduce),
'early8' (sites of the first n_layers // 2 layers at 8 bits, the rest at 4: SPEC §7); 'first8',
'last8', 'ends8': the first site, the last, or both at 8 bits, None elsewhere (so under the
default edge_bits the other end is at 8 bits too; with edge_bits=0 they widen only their own
sites).

Telemetry policies, 'telemetry@B' and 'telemetry-rel@B' (B: average wire bits per value, e.g.
5.0): chosen from the collective's own error telemetry (echo_tp.telemetry) on a calibration
pass at the config's width; the sites with the largest measured rounding error (absolute
energy ||delta||^2, or relative to the site's output ||delta||^2 / ||y||^2 for '-rel') are
widened to 8 bits, largest first, while the average wire bits per value stay <= B
(`telemetry_policy`; `echo-tp eval` runs the calibration pass itself, `calibration_plan`).

Comm spec strings:  NAME[:KEY=VALUE[,KEY=VALUE...]]
    NAME   a preset of EchoConfig.from_name ('16', '8', '4', 'echo8', 'echo4', 'echo4-output',
           'echo4-local', 'echo4-2ts', 'echo4bf'; its width rules: WidthPlan.from_name), or
           'early8' (= echo4 with policy=early8)
    KEY    an EchoConfig field (bits, group_size (or g), quantizer, eta, a, beta1, beta2,
           residual, grad_scaling, state_dtype) or a WidthPlan rule (policy, edge_bits,
           gather_bits)
    e.g.   'echo4:eta=0.9,quantizer=naive'   '4:g=256'   'early8:residual=local'
           'echo4:edge_bits=0,gather_bits=4'
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from echo_tp.config import EchoConfig

from .plan import SITES_PER_LAYER

BitPolicy = Callable[[int], "int | None"]
POLICIES = ("config", "uniform4", "uniform8", "16", "early8", "first8", "last8", "ends8")
SITE_KINDS = ("reduce", "gather")
"""What a site's collective does: 'reduce' (the all-reduce, or SP's reduce-scatter: the
compensated sum) or 'gather' (SP's all-gather: uncompensated)."""
_KEY_ALIASES = {"g": "group_size"}
_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(EchoConfig) if f.name != "preset"}


@dataclass(frozen=True, kw_only=True)
class WidthPlan:
    """A TP model's width rules (the module docstring; `site_width` applies them)."""

    policy: object = None
    """The per-site rule: None / 'config' (the config's width), a preset name, a {site: bits}
    table, a per-site list or a callable (make_policy); the TP engine resolves it for the
    model's layers (`resolved`)."""
    edge_bits: int = 8
    """The width of a model's first and last site where the policy leaves it to the config
    (max with the config's width); 0: the config's width there too."""
    gather_bits: int = 8
    """The width of sequence parallelism's all-gathers (max with the site's width); 0: each
    site's own width."""

    def __post_init__(self) -> None:
        for name in ("edge_bits", "gather_bits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v not in RULE_BITS:
                hint = (f"; write {name}={int(v)}" if isinstance(v, float) and v.is_integer()
                        and int(v) in RULE_BITS else "")
                raise ValueError(f"WidthPlan {name} must be one of the ints {RULE_BITS} (0: the "
                                 f"rule off), got {v!r} ({type(v).__name__}){hint}")

    def replace(self, **changes) -> "WidthPlan":
        return dataclasses.replace(self, **changes)

    def resolved(self, n_layers: int) -> "WidthPlan":
        """This plan with its policy made a checked site -> bits function for n_layers."""
        return self.replace(policy=make_policy(self.policy, n_layers))

    @property
    def policy_name(self) -> str:
        """The policy as a name ('config' for None; a preset or telemetry name as given; 'table'
        for anything else)."""
        if self.policy is None:
            return "config"
        return self.policy if isinstance(self.policy, str) else "table"

    @classmethod
    def of(cls, policy, config: EchoConfig | None = None) -> "WidthPlan":
        """A WidthPlan as given, or a bare policy (make_policy's spec) under the edge and gather
        rules of the config's preset (`config.preset`, WidthPlan.from_name: a preset name means
        the same widths here as in a comm spec); a config of no preset: the default rules."""
        if isinstance(policy, WidthPlan):
            return policy
        preset = None if config is None else config.preset
        return cls.from_name(preset).replace(policy=policy) if preset else cls(policy=policy)

    @classmethod
    def from_name(cls, name: str) -> "WidthPlan":
        """The width rules of a comm preset (EchoConfig.from_name's names): the naive presets
        '4' and '8' run every site, gathers included, at their own width; the paper's setting
        'echo4-output' has no edge rule; 'early8' is the early8 policy; the rest the defaults."""
        return cls(**PRESET_WIDTHS.get(name, {}))


RULE_BITS = (0, 4, 8, 16)
"""The values of edge_bits and gather_bits (0: the rule off)."""

PRESET_WIDTHS = {
    "8": dict(edge_bits=0, gather_bits=0),
    "4": dict(edge_bits=0, gather_bits=0),
    "echo4-output": dict(edge_bits=0),
    "early8": dict(policy="early8"),
}
"""Comm presets whose width rules differ from WidthPlan's defaults (the rest of each preset,
what the collective reads, is EchoConfig.from_name's)."""
_PLAN_KEYS = ("policy", "edge_bits", "gather_bits")


def site_width(plan: WidthPlan, site: int, *, bits: int, n_layers: int,
               kind: str = "reduce") -> int | None:
    """The width of static site `site` of a model of n_layers layers under `plan`, on a
    communicator whose config runs at `bits`; None: the config's width (the call passes no
    bits). kind 'reduce' (the all-reduce, SP's reduce-scatter): the policy's width; where the
    policy gives None at the first or last site (0, 2 * n_layers - 1) of a quantized config,
    max(bits, edge_bits) (edge_bits 0: None). kind 'gather' (SP's all-gather): the reduce
    width (bits where None) widened to gather_bits (gather_bits 0: unchanged); never None."""
    if kind not in SITE_KINDS:
        raise ValueError(f"kind must be one of {SITE_KINDS}, got {kind!r}")
    fn = plan.policy if callable(plan.policy) else make_policy(plan.policy, n_layers)
    width = fn(site)
    if (width is None and plan.edge_bits and bits != 16 and n_layers >= 1
            and site in (0, SITES_PER_LAYER * n_layers - 1)):
        width = max(bits, plan.edge_bits)
    if kind == "reduce":
        return width
    b = bits if width is None else width
    return max(b, plan.gather_bits) if plan.gather_bits else b


def calibration_plan(plan: WidthPlan) -> WidthPlan:
    """The plan of a telemetry policy's calibration pass: every site at the config's own width
    (no policy, no edge rule), the gathers as the plan says."""
    return plan.replace(policy=None, edge_bits=0)


def make_policy(spec, n_layers: int) -> BitPolicy:
    """A policy from a preset name, a {site: bits} table, a per-site sequence or a callable."""
    n_sites = SITES_PER_LAYER * n_layers
    if isinstance(spec, str) and telemetry_budget(spec) is not None:
        raise ValueError(f"bit policy {spec!r} is chosen from telemetry on a calibration pass: "
                         "build its table with echo_tp.tp.policy.telemetry_policy (echo-tp eval "
                         "does this itself) and pass the table")
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
        elif spec in _ENDS:
            first, last = _ENDS[spec]
            fn = _EndsWide(first=first, last=n_sites - 1 if last else None)
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


_ENDS = {"first8": (True, False), "last8": (False, True), "ends8": (True, True)}


@dataclass(frozen=True, kw_only=True)
class _EndsWide:
    first: bool
    last: int | None

    def __call__(self, site: int) -> int | None:
        return 8 if (self.first and site == 0) or site == self.last else None


@dataclass(frozen=True, kw_only=True)
class CommSpec:
    """One parsed comm config: its label (the spec string), what the collective reads
    (EchoConfig) and the TP engine's width rules (WidthPlan, its policy a name)."""

    label: str
    config: EchoConfig
    widths: WidthPlan = WidthPlan()

    def as_dict(self) -> dict:
        """One flat row: label, policy (name), the config's fields, edge_bits, gather_bits."""
        fields = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "preset"}
        return {"label": self.label, "policy": self.widths.policy_name,
                **fields, "edge_bits": self.widths.edge_bits,
                "gather_bits": self.widths.gather_bits}


def parse_comm_spec(text: str) -> CommSpec:
    """'echo4:eta=0.9,quantizer=naive' -> CommSpec (see the module docstring for the syntax)."""
    text = text.strip()
    name, _, rest = text.partition(":")
    base = EchoConfig.from_name("echo4" if name == "early8" else name)
    widths = {"policy": "config", **PRESET_WIDTHS.get(name, {})}
    changes: dict = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = _KEY_ALIASES.get(key.strip(), key.strip())
        if not eq:
            raise ValueError(f"comm spec {text!r}: {item!r} is not KEY=VALUE")
        if key == "policy":
            widths["policy"] = value.strip()
        elif key in _PLAN_KEYS:
            widths[key] = _convert(key, value.strip(), text, "int")
        elif key in _FIELD_TYPES:
            changes[key] = _convert(key, value.strip(), text, str(_FIELD_TYPES[key]))
        else:
            raise ValueError(f"comm spec {text!r}: unknown key {key!r}; known: "
                             f"{sorted([*_FIELD_TYPES, *_PLAN_KEYS, 'g'])}")
    policy = widths["policy"]
    if policy not in POLICIES and telemetry_budget(policy) is None:
        raise ValueError(f"comm spec {text!r}: unknown policy {policy!r}; choose one of "
                         f"{POLICIES} or telemetry@BITS / telemetry-rel@BITS")
    return CommSpec(label=text, config=base.replace(**changes), widths=WidthPlan(**widths))


def parse_comm_specs(texts: str | Sequence[str]) -> list[CommSpec]:
    """Several specs: a list, or one string separated by ';' or whitespace."""
    if isinstance(texts, str):
        texts = texts.replace(";", " ").split()
    specs = [parse_comm_spec(t) for t in texts]
    if not specs:
        raise ValueError("no comm config given")
    return specs


def _convert(key: str, value: str, text: str, kind: str):
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


TELEMETRY_SCORES = {"telemetry": "absolute", "telemetry-rel": "relative"}


def telemetry_budget(policy: str) -> tuple[str, float] | None:
    """'telemetry@5.0' -> ('absolute', 5.0), 'telemetry-rel@4.6' -> ('relative', 4.6); None for
    any other policy name. ValueError for a malformed budget."""
    name, at, budget = policy.partition("@")
    if name not in TELEMETRY_SCORES:
        return None
    try:
        bits = float(budget) if at else float("nan")
    except ValueError:
        bits = float("nan")
    if not bits > 0:
        raise ValueError(f"bit policy {policy!r}: expected {name}@BITS with BITS the average wire "
                         "bits per value, e.g. telemetry@5.0")
    return TELEMETRY_SCORES[name], bits


def wire_bits_per_value(config: EchoConfig, bits: int | None) -> float:
    """Bits one value costs on the wire at this width (codes + scale words [+ zero-points])."""
    b = config.bits if bits is None else bits
    if b == 16:
        return 16.0
    spec = config.replace(bits=b).quant_spec()
    return spec.packet_bytes(spec.group_size) * 8 / spec.group_size


def average_wire_bits(config: EchoConfig, table: Mapping[int, int | None], numel: Mapping[int, int]
                      ) -> float:
    """The numel-weighted average wire bits per value of a per-site table."""
    total = sum(numel.values())
    return sum(wire_bits_per_value(config, table.get(s)) * n for s, n in numel.items()) / total


def telemetry_policy(rows: Sequence[Mapping], budget_bits: float, config: EchoConfig, *,
                     score: str = "absolute", wide_bits: int = 8) -> dict[int, int]:
    """A {site: bits} table from telemetry summary rows (EchoCommunicator.telemetry_summary of
    a calibration pass at `config`'s width): forward rows, their error estimate
    delta_norm_est^2 averaged per site (score 'relative': divided by the site's ||y||^2).
    Sites are widened to `wide_bits` in decreasing score while the numel-weighted average wire
    bits per value stay within budget_bits. ValueError when the budget is below the base
    width's cost or no forward rows are given."""
    if score not in ("absolute", "relative"):
        raise ValueError(f"score must be 'absolute' or 'relative', got {score!r}")
    err: dict[int, float] = {}
    numel: dict[int, int] = {}
    for r in rows:
        if r["direction"] != "forward":
            continue
        s = int(r["site"])
        e = r["delta_norm_est"] ** 2
        if score == "relative":
            e = e / max(r.get("y_sq", 0.0), 1e-30)
        err[s] = err.get(s, 0.0) + e
        numel[s] = int(r["numel"])
    if not err:
        raise ValueError("no forward telemetry rows: run a calibration pass with telemetry=True")
    table = {s: config.bits for s in err}
    base = average_wire_bits(config, table, numel)
    if base > budget_bits + 1e-9:
        raise ValueError(f"a budget of {budget_bits} bits per value is below the base width's "
                         f"{base:.3f}")
    for s in sorted(err, key=err.get, reverse=True):
        trial = {**table, s: wide_bits}
        if average_wire_bits(config, trial, numel) <= budget_bits + 1e-9:
            table = trial
    return table
